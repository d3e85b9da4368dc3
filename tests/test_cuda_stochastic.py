"""CUDA stochastic-rounding quantize (FFI target jax_fp4_quantize_sr_v1) == the reference,
bit for bit (runs on a GPU machine; skipped elsewhere).

The oracle is jax_fp4.reference.quantize_2d(..., rand=...) on the CPU device. The random
words are an operand of the kernel, so the same words must give the same codes. Inputs:
fresh random data plus ties, zeros, -0.0, subnormals, huge values, NaN and Inf blocks
(tests/edge.py), odd shapes, fixed keys, and words chosen at the rounding threshold of
each element (rand = floor(2^32 t) - 1, floor(2^32 t), 0 and 2^32 - 1), where an
off-by-one in the kernel's threshold would change the code.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import reference, stochastic
from jax_fp4.formats import get_format

from edge import assert_bits_equal, kernel_cases, make_input

pytestmark = pytest.mark.gpu

TARGET = "jax_fp4_quantize_sr_v1"

# (format, block size, options): every format (reference.quantize_2d takes `rand` for
# every family); nvfp4 with and without the per-tensor scale, MX with both scale
# roundings, INT4 with each scale dtype, block sizes the CUDA kernels take (16 * 2^k).
CASES = kernel_cases((64, 32), [(128, {}), (32, {"scale_dtype": jnp.float32}),
                                    (64, {"scale_dtype": jnp.float16})])


def _gpu():
    return jax.devices("gpu")[0]


def _cpu():
    return jax.devices("cpu")[0]


def _params(fmt, bs, kw, x):
    f = get_format(fmt)
    sd = kw.get("scale_dtype")
    return dict(fmt=f.name, block_size=bs, rceil=kw.get("scale_rounding") == "rceil",
                two_level="tensor_scale" in kw,
                scale_dtype=(np.dtype(sd) if sd is not None else np.dtype(x.dtype))
                if f.family == "int4" else None)


def _ts_rows(x, kw):
    """The per-row tensor scale operand: NVFP4 tensor_scale="auto" of x (on the CPU, the
    reference's), else zeros (ignored)."""
    if "tensor_scale" not in kw:
        return jnp.zeros((x.shape[0],), jnp.float32)
    xc = jax.device_put(x, _cpu())
    return jnp.broadcast_to(reference.tensor_scale_from_amax(reference.amax(xc)),
                            (x.shape[0],)).astype(jnp.float32)


def _bind(x, ts, rand, params, impl, device):
    """(codes, scales, zeros) of the primitive on `device`; impl "kernels" must use the
    CUDA target (else the lowering raises), "reference" the oracle."""
    fn = jax.jit(lambda v, t, r: stochastic.quantize_sr_p.bind(v, t, r, impl=impl, **params))
    return [np.asarray(o) for o in fn(*(jax.device_put(a, device) for a in (x, ts, rand)))]


def _check(x, rand, fmt, bs, kw, what):
    params = _params(fmt, bs, kw, x)
    ts = _ts_rows(x, kw)
    got = _bind(x, ts, rand, params, "kernels", _gpu())
    want = _bind(x, ts, rand, params, "reference", _cpu())
    for name, g, w in zip(("codes", "scales", "zeros"), got, want):
        assert_bits_equal(g, w, f"{fmt} bs={bs} {kw} {x.dtype} {x.shape} {what}: {name}")


def _thresholds(x, fmt, bs, kw):
    """Per element, floor(2^32 t) of the reference (t its position between the two grid
    neighbours): the largest word that still rounds up is this minus one. Found by
    bisection on the reference with uniform words (monotone in the word)."""
    params = _params(fmt, bs, kw, x)
    ts = jax.device_put(_ts_rows(x, kw), _cpu())
    ref = jax.jit(lambda v, r: reference.quantize_2d(
        v, params["fmt"], bs, tensor_scale=ts if params["two_level"] else None,
        rceil=params["rceil"], scale_dtype=params["scale_dtype"], rand=r)[0])
    x_cpu = jax.device_put(x, _cpu())
    lo = np.zeros(x.shape, np.uint64)  # words < thr round up: up(lo) or thr == 0
    hi = np.full(x.shape, 2**32, np.uint64)
    down = np.asarray(ref(x_cpu, jnp.full(x.shape, 0xFFFFFFFF, jnp.uint32)))
    for _ in range(33):
        mid = (lo + hi) // 2
        codes = np.asarray(ref(x_cpu, jnp.asarray(np.minimum(mid, 2**32 - 1).astype(np.uint32))))
        # an element rounds up at `mid` when its packed code differs from the all-down one;
        # compare per element through the unpacked codes
        up = (_unpacked(codes, fmt, x.shape) != _unpacked(down, fmt, x.shape)).any(-1)
        lo = np.where(up, mid + 1, lo)
        hi = np.where(up, hi, mid)
    return lo  # the smallest word that does not round up = floor(2^32 t)


def _unpacked(codes, fmt, shape):
    bits = get_format(fmt).bits
    b = np.unpackbits(np.asarray(codes, np.uint8).reshape(shape[0], -1), axis=1,
                      bitorder="little")
    return b.reshape(shape[0], shape[1], bits)


@pytest.fixture(autouse=True)
def _kernels_built():
    caps = jf.capabilities()
    assert caps["kernels"]["cuda"], caps["load_error"]
    assert "cuda" in {p.lower() for p in caps["targets"].get(TARGET, ())}, (
        f"{TARGET} is not registered for CUDA in this build: {caps['targets']}")


@pytest.mark.parametrize("fmt,bs,kw", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_sr_matches_reference(fmt, bs, kw, dtype, rng):
    """Fresh random data with the edge values, odd shapes, fresh and fixed keys."""
    for rows, k in [(1, bs), (129, bs * max(1, 256 // bs)), (257, max(bs, 512))]:
        x = jnp.asarray(make_input(rng, rows, k, fmt, block_size=bs)).astype(dtype)
        for seed in (0, int(rng.integers(2**31))):
            rand = stochastic.random_bits(jax.random.key(seed), rows, k)
            _check(x, rand, fmt, bs, kw, f"key {seed}")


@pytest.mark.parametrize("fmt,bs,kw", CASES, ids=lambda v: str(v))
def test_cuda_sr_extreme_and_threshold_words(fmt, bs, kw, rng):
    """Words 0 (always up where the fraction is non-zero), 2^32 - 1 (never up), and each
    element's threshold word and the one below it (up / not up by one unit of 2^-32)."""
    x = jnp.asarray(make_input(rng, 5, 4 * bs, fmt, block_size=bs, nonfinite=False))
    for w in (0, 0xFFFFFFFF, 0x80000000):
        _check(x, jnp.full(x.shape, w, jnp.uint32), fmt, bs, kw, f"word {w:#x}")
    thr = _thresholds(x, fmt, bs, kw)
    at = jnp.asarray(np.minimum(thr, 2**32 - 1).astype(np.uint32))
    below = jnp.asarray((np.maximum(thr, 1) - 1).astype(np.uint32))
    _check(x, at, fmt, bs, kw, "threshold word")
    _check(x, below, fmt, bs, kw, "threshold word - 1")


def test_cuda_sr_lowers_to_the_kernel():
    """On the GPU, quantize(rounding="stochastic") lowers to the CUDA target."""
    x = jax.device_put(jnp.ones((4, 64), jnp.bfloat16), _gpu())
    key = jax.random.key(0)
    text = jax.jit(lambda v: jf.quantize(v, "nvfp4", rounding="stochastic", key=key).data) \
        .lower(x).as_text()
    assert TARGET in text, text[:2000]


def test_cuda_sr_bad_rand_operand():
    """The handler names the `rand` buffer when its dtype or shape is wrong."""
    x = jax.device_put(jnp.ones((2, 32), jnp.float32), _gpu())
    ts = jnp.zeros((2,), jnp.float32)
    out = (jax.ShapeDtypeStruct((2, 16), jnp.uint8), jax.ShapeDtypeStruct((2, 2), jnp.uint8),
           jax.ShapeDtypeStruct((0,), jnp.uint8))
    attrs = dict(fmt=np.int32(get_format("nvfp4").fid), block_size=np.int64(16),
                 rceil=np.int32(0), two_level=np.int32(0))
    for rand in (jnp.zeros((2, 31), jnp.uint32), jnp.zeros((2, 32), jnp.int32)):
        with pytest.raises(Exception, match="rand"):
            jax.block_until_ready(jax.jit(lambda a, t, r: jax.ffi.ffi_call(TARGET, out)(
                a, t, r, **attrs))(x, ts, jax.device_put(rand, _gpu())))
