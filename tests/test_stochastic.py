"""Stochastic rounding (jax_fp4.stochastic): unbiased, deterministic for a key, only ever
one of the two grid neighbours, and every backend equal to the reference for the same key
(the CPU / CUDA kernels take the key's bits as an operand)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import reference
from jax_fp4.prims.fake_quantize import ste_mask
from jax_fp4.prims.tensor_scale import auto_tensor_scale
from jax_fp4.formats import FORMAT_NAMES, get_format

from edge import assert_bits_equal, make_input


def _kw(fmt):
    f = get_format(fmt)
    return {"block_size": 32} if f.family == "int4" else (
        {"tensor_scale": "auto"} if f.family == "nvfp4" else {})


def _in_range(x, fmt, kw):
    """Elements inside their block's representable range (saturated ones clamp)."""
    x2 = jnp.asarray(x).reshape(-1, x.shape[-1])
    f = get_format(fmt)
    ts = kw.get("tensor_scale")
    ts_rows = (jnp.broadcast_to(auto_tensor_scale(x2), (x2.shape[0],))
               if ts else jnp.zeros((x2.shape[0],), jnp.float32))
    return np.asarray(jax.jit(lambda v, t: ste_mask(
        v, t, ste="clipped", fmt=f.name,
        block_size=kw.get("block_size", f.default_block), rceil=False, two_level=bool(ts),
        scale_dtype=np.dtype(np.float32) if f.family == "int4" else None,
        impl="reference"))(x2, ts_rows)).reshape(x.shape)


def _neighbours(x, fmt, kw):
    """The two values stochastic rounding chooses between: bits 0 (round up whenever the
    fraction is non-zero) and bits 2**32 - 1 (never up)."""
    def with_bits(b):
        x2 = x.reshape(-1, x.shape[-1])
        bs = kw.get("block_size", get_format(fmt).default_block)
        ts = (jnp.broadcast_to(auto_tensor_scale(x2), (x2.shape[0],))
              if "tensor_scale" in kw else None)
        rand = jnp.full(x2.shape, b, jnp.uint32)
        fq = jax.jit(lambda v, t, r: reference.fake_quantize_2d(v, fmt, bs, tensor_scale=t,
                                                                rand=r))
        return np.asarray(fq(x2, ts, rand), np.float64).reshape(x.shape)
    return with_bits(0), with_bits(0xFFFFFFFF)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_stochastic_rounding_is_unbiased(fmt, rng):
    """The mean of n draws converges to x: |mean - x| <= 6 standard errors per element
    (plus 3 / n of a step for rare draws), the standard error of the two-point law between
    x's grid neighbours a, b (|b - a| sqrt(p (1 - p) / n), p = (x - a) / (b - a)), for the
    elements inside their block's range (saturated ones clamp)."""
    kw = _kw(fmt)
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    n = 1024
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), n)
    ys = np.asarray(jax.jit(jax.vmap(
        lambda k: jf.fake_quantize(x, fmt, rounding="stochastic", key=k, **kw)))(keys),
        np.float64)
    xd = np.asarray(x, np.float64)
    a, b = _neighbours(x, fmt, kw)
    # inside the block's range, and for INT4 inside [code 0, code 15] (the group's
    # extremes can round past them and clamp)
    ok = _in_range(x, fmt, kw) & (np.minimum(a, b) <= xd) & (xd <= np.maximum(a, b))
    assert ok.mean() > 0.9
    gap = np.abs(b - a)
    p = np.where(gap > 0, np.abs(xd - a) / np.where(gap > 0, gap, 1), 0)
    se = gap * np.sqrt(p * (1 - p) / n)
    # plus 3 draws' worth of one step: for n * min(p, 1 - p) below ~1 the rare draws are
    # Poisson, and a single one is many standard errors
    bound = 6 * se + 3 * gap / n + 1e-7
    err = np.abs(ys.mean(0) - xd)
    assert np.all(err[ok] <= bound[ok]), float(np.max(err[ok] - bound[ok]))
    # each draw is one of the two neighbours
    assert np.all((ys == a) | (ys == b))
    # round-to-nearest is biased on these elements: the test could fail
    rne = np.asarray(jf.fake_quantize(x, fmt, **kw), np.float64)
    assert np.abs(rne - xd)[ok].mean() > 10 * err[ok].mean()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e5m2", "nf4", "int4"])
def test_stochastic_rounding_deterministic_for_a_key(fmt, rng):
    kw = _kw(fmt)
    x = jnp.asarray(rng.standard_normal((3, 5, 64)), jnp.float32)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = jf.quantize(x, fmt, rounding="stochastic", key=k1, **kw)
    b = jax.jit(lambda v: jf.quantize(v, fmt, rounding="stochastic", key=k1, **kw))(x)
    c = jf.quantize(x, fmt, rounding="stochastic", key=k2, **kw)
    assert_bits_equal(a.data, b.data, "same key")
    assert not np.array_equal(np.asarray(a.data), np.asarray(c.data))
    # scales are those of round-to-nearest; the fake-quantized value is the dequantized one
    assert_bits_equal(a.scales, jf.quantize(x, fmt, **kw).scales, "scales")
    assert_bits_equal(jf.fake_quantize(x, fmt, rounding="stochastic", key=k1, **kw),
                      a.dequantize(), "fake_quantize")
    # the bits contract: canonical (rows, K) view, bits[r, k] per element
    x2 = x.reshape(15, 64)
    rand = jax.random.bits(k1, (15, 64), jnp.uint32)
    codes, _, _ = reference.quantize_2d(
        x2, fmt, kw.get("block_size", get_format(fmt).default_block),
        tensor_scale=(jnp.broadcast_to(auto_tensor_scale(x2), (15,))
                      if "tensor_scale" in kw else None), rand=rand)
    np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8).reshape(15, -1),
                                  np.asarray(codes))


def test_stochastic_rounding_exact_cases():
    """Grid values never move; a value 1/4 of the way between two E2M1 neighbours rounds
    up exactly for bits below 2**30 (t = 0.25 -> threshold 2**30)."""
    x = jnp.asarray([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -6.0] * 2], jnp.float32)
    for seed in range(5):
        y = jf.fake_quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # block amax 6 -> E4M3 scale 1: 2.25 lies between 2 and 3 at t = 0.25
    x = jnp.asarray([[2.25] + [6.0] * 15], jnp.float32)
    rand = jnp.zeros((1, 16), jnp.uint32).at[0, 0].set(2**30 - 1)
    codes, s1, z1 = reference.quantize_2d(x, "nvfp4", 16, rand=rand)
    up = reference.dequantize_2d(codes, s1, z1, "nvfp4", 16, 16, jnp.float32)
    assert float(up[0, 0]) == 3.0
    rand = rand.at[0, 0].set(2**30)
    codes2, s2, z2 = reference.quantize_2d(x, "nvfp4", 16, rand=rand)
    down = reference.dequantize_2d(codes2, s2, z2, "nvfp4", 16, 16, jnp.float32)
    assert float(down[0, 0]) == 2.0


def test_stochastic_rounding_gradient_and_errors(rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    g = jax.grad(lambda v: jf.fake_quantize(v, "nvfp4", rounding="stochastic",
                                            key=jax.random.key(0)).sum())(x)
    np.testing.assert_array_equal(np.asarray(g), np.ones(x.shape, np.float32))
    with pytest.raises(TypeError, match="key"):
        jf.quantize(x, "nvfp4", rounding="stochastic")
    with pytest.raises(ValueError, match="rounding"):
        jf.quantize(x, "nvfp4", rounding="up")
    with pytest.raises(ValueError, match="key"):
        jf.fake_quantize(x, "nvfp4", key=jax.random.key(0))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_stochastic_rounding_backends_match_reference(fmt, rng):
    """The default backend (CPU kernels where built) == the reference for the same key,
    bit for bit, on random data with ties, zeros, subnormals, huge values, NaN, Inf."""
    kw = _kw(fmt)
    bs = kw.get("block_size", get_format(fmt).default_block)
    x = jnp.asarray(make_input(rng, 7, 4 * bs, fmt, block_size=bs))
    key = jax.random.key(int(rng.integers(2**31)))

    def run(backend):
        old = jf.get_backend()
        jf.set_backend(backend)
        try:
            q = jax.jit(lambda v: jf.quantize(v, fmt, rounding="stochastic", key=key,
                                              **kw))(x)
            return q.data, q.scales, q.dequantize()
        finally:
            jf.set_backend(old)

    for name, g, w in zip(("data", "scales", "deq"), run("auto"), run("reference")):
        assert_bits_equal(g, w, f"{fmt} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_cuda_stochastic_rounding_matches_reference(fmt, rng):
    """CUDA == the reference on the CPU device for the same key (codes, scales, QDQ)."""
    kw = _kw(fmt)
    bs = kw.get("block_size", get_format(fmt).default_block)
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jnp.asarray(make_input(rng, 129, 8 * bs, fmt, block_size=bs)).astype(dtype)
        key = jax.random.key(int(rng.integers(2**31)))

        def fn(v):
            q = jf.quantize(v, fmt, rounding="stochastic", key=key, **kw)
            return (q.data, q.scales, q.dequantize(),
                    jf.fake_quantize(v, fmt, rounding="stochastic", key=key, **kw))

        def run(backend, device):
            old = jf.get_backend()
            jf.set_backend(backend)
            try:
                return jax.tree_util.tree_map(
                    np.asarray, jax.jit(fn)(jax.device_put(x, device)))
            finally:
                jf.set_backend(old)

        got, want = run("kernels", gpu), run("reference", cpu)
        for name, g, w in zip(("data", "scales", "deq", "fake"), got, want):
            assert_bits_equal(g, w, f"{fmt} {dtype.__name__} {name}")


@pytest.mark.gpu
def test_cuda_stochastic_rounding_is_unbiased(rng):
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(jnp.asarray(rng.standard_normal((4, 64)), jnp.float32), gpu)
    keys = jax.random.split(jax.random.key(7), 2048)
    ys = np.asarray(jax.jit(jax.vmap(lambda k: jf.fake_quantize(
        x, "nvfp4", rounding="stochastic", key=k)))(keys), np.float64)
    ok = _in_range(np.asarray(x), "nvfp4", {})
    err = np.abs(ys.mean(0) - np.asarray(x))
    assert np.all(err[ok] <= 6 * ys.std(0, ddof=1)[ok] / np.sqrt(len(keys)) + 1e-7)
