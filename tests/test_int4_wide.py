"""INT4 blocks whose range max - min is >= 2**127 or overflows float32 (the wide-block
rule, docs/spec.md section 3, INT4): finite inputs decode to finite values, the reference
and the CPU kernels agree bit for bit, and the rule's values are what the spec says."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import _ext

F32_MAX = float(np.finfo(np.float32).max)

# (block values, expected float32 scale, expected zero point) for the float32 storage
WIDE = [
    ([-1.8e38, 1.8e38], 1.8e38 / 8, 8),
    ([-F32_MAX, F32_MAX], F32_MAX / 8, 8),
    ([-1e38, F32_MAX], F32_MAX / 8, 7),
    ([-F32_MAX, 3e37], F32_MAX / 8, 8),
    ([0.0, F32_MAX], F32_MAX / 8, 7),
    ([-F32_MAX, -1.0], F32_MAX / 8, 8),
]


def _block(vals, g=32):
    x = np.zeros(g, np.float32)
    x[: len(vals)] = vals
    x[len(vals):] = np.linspace(min(vals), max(vals), g - len(vals), dtype=np.float32)
    return x


def _run(backend, fn, x):
    old = jf.get_backend()
    jf.set_backend(backend)
    try:
        return jax.tree_util.tree_map(np.asarray, jax.jit(fn)(x))
    finally:
        jf.set_backend(old)


def _backends():
    return ["reference"] + (["kernels"] if _ext.build_info() else [])


@pytest.mark.parametrize("backend", ["reference", "kernels"])
@pytest.mark.parametrize("sd", ["float32", "bfloat16", "float16"])
def test_wide_blocks_decode_finite_and_match(backend, sd):
    if backend not in _backends():
        pytest.skip("compiled extension unavailable")
    x = jnp.asarray(np.stack([_block(v) for v, _, _ in WIDE]
                             + [_block([-3e4, 4e4]), _block([-1e6, 2e6])]))

    def f(v):
        q = jf.quantize(v, "int4", block_size=32, scale_dtype=sd)
        return q.data, q.scales, q.zeros, jf.dequantize(q, jnp.float32)

    data, scales, zeros, y = _run(backend, f, x)
    assert np.isfinite(y).all(), y
    s = scales.astype(np.float32)[:, 0]
    assert np.isfinite(s).all()
    if sd == "float32":
        np.testing.assert_array_equal(s[: len(WIDE)], np.float32([e for _, e, _ in WIDE]))
    if sd == "float16":
        assert (s[: len(WIDE)] == 65504).all()
        assert s[-1] == 65504  # 3e6 / 15 overflows float16: saturates
    np.testing.assert_array_equal(zeros[: len(WIDE), 0], [z for _, _, z in WIDE])
    # the block's element of largest magnitude decodes exactly (float32 scales)
    if sd == "float32":
        for i, (v, _, _) in enumerate(WIDE):
            m = max(v, key=abs)
            assert y[i][np.argmax(np.abs(x[i]))] == np.float32(m)
    if backend == "kernels":
        ref = _run("reference", f, x)
        for a, b in zip((data, scales, zeros, y), ref):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("sd", ["float32", "bfloat16", "float16"])
def test_fake_quantize_wide_blocks_never_nan(sd):
    """x's own dtype: the float32 value rounds to it and may overflow to +-Inf there (a
    grid point above float16's 65504), never NaN; float32 x stays finite."""
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[sd]
    fin = float(jnp.finfo(dt).max)
    x = jnp.asarray(np.stack([_block([-fin, fin]), _block([-fin * 0.5, fin])])).astype(dt)
    outs = [_run(b, lambda v: jf.fake_quantize(v, "int4", block_size=32), x)
            for b in _backends()]
    for y in outs:
        y32 = np.asarray(y, np.float32)
        assert not np.isnan(y32).any()
        if sd == "float32":
            assert np.isfinite(y32).all()
    for y in outs[1:]:
        np.testing.assert_array_equal(y.view(np.uint16), outs[0].view(np.uint16))


def test_normal_blocks_unchanged():
    """Blocks below the threshold keep the AutoAWQ rule: s = (max - min) / 15."""
    x = jnp.asarray(_block([-3.0, 12.0]))[None]
    q = jf.quantize(x, "int4", block_size=32)
    assert float(q.scales[0, 0]) == np.float32(15.0) / np.float32(15.0)
    assert int(q.zeros[0, 0]) == 3
