"""The CPU kernel of stochastic rounding (FFI target jax_fp4_quantize_sr_v1): lowered
where built, bit for bit the reference (jax_fp4.reference.quantize_2d(..., rand=...)) for
every format, dtype and given random bits, unbiased down to elements far below one grid
step, deterministic for a key."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4 import _ext, reference, stochastic
from jax_fp4.prims.tensor_scale import auto_tensor_scale
from jax_fp4.formats import FORMAT_NAMES, get_format

from edge import assert_bits_equal, make_input

TARGET = "jax_fp4_quantize_sr_v1"

pytestmark = pytest.mark.skipif(not _ext.has_kernels("cpu", TARGET),
                                reason=f"extension without the CPU {TARGET} target "
                                       f"({_ext.load_error()})")


def _sr(x2, rand, fmt, bs, *, impl, ts=None, rceil=False, scale_dtype=None):
    """quantize_sr_p on the canonical (R, K) view: (codes, scales, zeros) as numpy."""
    f = get_format(fmt)
    if f.family == "int4" and scale_dtype is None:
        scale_dtype = x2.dtype
    params = dict(fmt=f.name, block_size=bs, rceil=rceil, two_level=ts is not None,
                  scale_dtype=None if scale_dtype is None else np.dtype(scale_dtype),
                  impl=impl)
    ts_rows = jnp.zeros((x2.shape[0],), jnp.float32) if ts is None else ts
    out = _bind(tuple(sorted(params.items())))(x2, ts_rows, rand)
    return [np.asarray(o) for o in out]


@functools.lru_cache(maxsize=None)
def _bind(params):
    """One jitted quantize_sr_p per parameter set (new shapes retrace, bits do not)."""
    return jax.jit(lambda a, t, r: stochastic.quantize_sr_p.bind(a, t, r, **dict(params)))


def _rand_cases(shape, seed):
    """Random bits of a fixed key, with the extremes and the middle planted, and the
    constant arrays 0 (up whenever any fraction remains) and 2**32 - 1 (never up)."""
    r = np.array(jax.random.bits(jax.random.key(seed), shape, jnp.uint32))
    flat = r.reshape(-1)
    flat[::7] = 0
    flat[3::11] = 0xFFFFFFFF
    flat[5::13] = 0x80000000
    return [r, np.zeros(shape, np.uint32), np.full(shape, 0xFFFFFFFF, np.uint32)]


def test_stochastic_lowers_to_the_cpu_kernel():
    x = jnp.ones((4, 64), jnp.float32)
    key = jax.random.key(0)
    for fn in (lambda v: jf.quantize(v, "nvfp4", rounding="stochastic", key=key).data,
               lambda v: jf.fake_quantize(v, "mxfp4", rounding="stochastic", key=key)):
        hlo = jax.jit(fn).lower(x).as_text()
        assert TARGET in hlo, hlo[:2000]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_sr_kernel_matches_reference(fmt, rng):
    """Codes, scales and zero points equal the reference's for fresh random data with ties,
    zeros, -0.0, subnormals, huge values, NaN and Inf blocks, in float32 and a 16-bit
    float (bfloat16 / float16 by turns), odd row counts, given bits from a fixed key and the extreme bits."""
    f = get_format(fmt)
    bs = {"int4": 33, "codebook": 64}.get(f.family, f.default_block)
    variants = [dict()]
    if f.family == "nvfp4":
        variants.append(dict(two_level=True))
    if f.family == "mx":
        variants.append(dict(rceil=True))
    if f.family == "int4":
        variants.append(dict(scale_dtype=jnp.float16))
    half = (jnp.bfloat16, jnp.float16)[FORMAT_NAMES.index(fmt) % 2]
    for dtype, rows in ((jnp.float32, 7), (half, 3)):
        k = 6 * bs if f.family != "int4" else 8 * bs  # int4 with odd groups: K even
        x = jnp.asarray(make_input(rng, rows, k, fmt, block_size=bs)).astype(dtype)
        for var in variants:
            kw = dict(var)
            if kw.pop("two_level", False):
                kw["ts"] = jnp.broadcast_to(auto_tensor_scale(x), (rows,))
            for i, rand in enumerate(_rand_cases(x.shape, int(rng.integers(2**31)))):
                got = _sr(x, rand, fmt, bs, impl="kernels", **kw)
                want = _sr(x, rand, fmt, bs, impl="reference", **kw)
                for name, g, w in zip(("codes", "scales", "zeros"), got, want):
                    assert_bits_equal(g, w, f"{fmt} {jnp.dtype(dtype).name} {var} bits#{i} "
                                            f"{name}")


def _dequant(codes, scales, zeros, fmt, bs, k):
    return np.asarray(reference.dequantize_2d(codes, scales, zeros, fmt, bs, k, jnp.float32))


@pytest.mark.parametrize("impl", ["kernels", "reference"])
def test_sr_threshold_of_tiny_elements(impl):
    """An element t of a grid step above its lower neighbour moves up exactly for bits
    below floor(2**32 t), also where t is far below one step (shifts past 31 bits)."""
    # nvfp4 / mxfp4, block amax 6 -> scale 1, E2M1 step 0.5 near zero: t = 2 x
    for fmt, bs in (("nvfp4", 16), ("mxfp4", 32)):
        for x_small, thr in ((2.0 ** -20, 2 ** 13), (2.0 ** -31, 4), (2.0 ** -40, 0)):
            x = jnp.asarray([[6.0, x_small] + [1.0] * (bs - 2)], jnp.float32)
            for bits, up in ((thr - 1, True), (thr, False)):
                if bits < 0:
                    continue
                rand = np.zeros((1, bs), np.uint32)
                rand[0, 1] = bits
                y = _dequant(*_sr(x, rand, fmt, bs, impl=impl), fmt, bs, bs)
                assert y[0, 1] == (0.5 if up else 0.0), (fmt, x_small, bits, y[0, 1])
    # int4: min -1, max 14 -> s = 1, z = 1; 0.25 -> up below 2**30; a subnormal quotient
    # counts as zero and never moves
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [-1.0, 14.0, 0.25, -1e-40]
    for bits, want in ((2 ** 30 - 1, [1.0, 0.0]), (2 ** 30, [0.0, 0.0]),
                       (0xFFFFFFFF, [0.0, 0.0]), (0, [1.0, 0.0])):
        rand = np.full((1, 32), bits, np.uint32)
        y = _dequant(*_sr(jnp.asarray(x), rand, "int4", 32, impl=impl), "int4", 32, 32)
        np.testing.assert_array_equal(y[0, 2:4], want, err_msg=f"int4 bits={bits}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp6_e3m2", "nf4", "int4"])
def test_sr_kernel_unbiased_across_magnitudes(fmt, rng):
    """The mean of 4096 kernel draws is x within 6 standard errors, for blocks whose
    elements span six decades (many far below one grid step of their block)."""
    f = get_format(fmt)
    bs = 32 if f.family == "int4" else f.default_block
    x = (rng.standard_normal((2, 2 * bs)) * 10.0 ** rng.uniform(-6, 0, (2, 2 * bs)))
    x = jnp.asarray(x, jnp.float32)
    n = 4096
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), n)
    old = jf.get_backend()
    jf.set_backend("kernels")
    try:
        kw = {"block_size": bs} if f.family == "int4" else {}
        ys = np.asarray(jax.jit(jax.vmap(lambda k: jf.fake_quantize(
            x, fmt, rounding="stochastic", key=k, **kw)))(keys), np.float64)
    finally:
        jf.set_backend(old)
    xd = np.asarray(x, np.float64)
    lo, hi = ys.min(0), ys.max(0)
    # the two neighbours: where only one value was drawn the element sits on it or its
    # probability of the other is below ~1/n; bound the error by one step / n then
    inside = (lo <= xd) & (xd <= hi)
    p = np.where(hi > lo, (xd - lo) / np.where(hi > lo, hi - lo, 1), 0)
    se = (hi - lo) * np.sqrt(p * (1 - p) / n)
    # plus 3 draws' worth of one step: where n * min(p, 1 - p) is below ~1 the count of
    # rare draws is Poisson, not normal, and one rare draw alone is many standard errors
    # (such a draw has probability ~n * min(p, 1 - p); three more than expected, ~1e-8)
    bound = 6 * se + 3 * (hi - lo) / n + 1e-12
    err = np.abs(ys.mean(0) - xd)
    assert inside.mean() > 0.5
    assert np.all(err[inside] <= bound[inside]), float(np.max(err[inside] - bound[inside]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8_e4m3", "bnb_fp4", "int4"])
def test_sr_kernel_deterministic_and_fake_quantize(fmt, rng):
    """Same key, same codes (eager and jitted); another key, other codes; the kernel's
    fake_quantize(rounding="stochastic") is dequantize(quantize(...)) and the reference's."""
    f = get_format(fmt)
    kw = {"block_size": 32} if f.family == "int4" else {}
    x = jnp.asarray(rng.standard_normal((3, 5, 128)), jnp.float32)
    k1, k2 = jax.random.key(11), jax.random.key(12)
    old = jf.get_backend()
    jf.set_backend("kernels")
    try:
        a = jf.quantize(x, fmt, rounding="stochastic", key=k1, **kw)
        b = jax.jit(lambda v: jf.quantize(v, fmt, rounding="stochastic", key=k1, **kw))(x)
        c = jf.quantize(x, fmt, rounding="stochastic", key=k2, **kw)
        fq = jax.jit(lambda v: jf.fake_quantize(v, fmt, rounding="stochastic", key=k1,
                                                **kw))(x)
        assert TARGET in jax.jit(lambda v: jf.fake_quantize(
            v, fmt, rounding="stochastic", key=k1, **kw)).lower(x).as_text()
    finally:
        jf.set_backend(old)
    assert_bits_equal(a.data, b.data, "same key")
    assert not np.array_equal(np.asarray(a.data), np.asarray(c.data))
    assert_bits_equal(fq, a.dequantize(), "fake_quantize == dequantize(quantize)")
    jf.set_backend("reference")
    try:
        ref = jax.jit(lambda v: jf.fake_quantize(v, fmt, rounding="stochastic", key=k1,
                                                 **kw))(x)
    finally:
        jf.set_backend(old)
    assert_bits_equal(fq, ref, "kernel == reference")
