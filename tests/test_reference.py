"""The reference path against hand-computed values, ml_dtypes and exact numpy arithmetic."""
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_fp4 import layout, reference
from jax_fp4.formats import E2M1, E2M3, E3M2, E4M3, E5M2, FORMAT_NAMES, get_format

from edge import EDGE, assert_bits_equal, make_input

MINIFLOATS = [E2M1, E2M3, E3M2, E4M3, E5M2]


def _q(x, fmt, bs=None, **kw):
    f = get_format(fmt)
    return jax.jit(lambda v: reference.quantize_2d(v, fmt, bs or f.default_block, **kw))(x)


def _dq(c, s, z, fmt, bs, k, dtype=jnp.float32, **kw):
    return jax.jit(lambda *a: reference.dequantize_2d(*a, fmt, bs, k, dtype, **kw))(c, s, z)


@pytest.mark.parametrize("mf", MINIFLOATS, ids=lambda m: m.name)
def test_element_encode_matches_ml_dtypes(mf, rng):
    """RNE with saturation == ml_dtypes' cast of the clamped value, incl. ties/subnormals."""
    vals = np.unique(np.abs(np.asarray(reference._table(mf))))
    ties = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    x = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * np.float32(mf.max_value / 3),
        (rng.standard_normal(20000) * 2.0 ** rng.integers(-30, 5, 20000)).astype(np.float32),
        ties, -ties, EDGE, np.nextafter(ties, np.float32(0)), np.nextafter(ties, np.float32(9))])
    x = x[np.isfinite(x)]
    want = np.clip(x, -mf.max_value, mf.max_value).astype(mf.np_dtype).view(np.uint8)
    want &= (1 << mf.bits) - 1
    got = np.asarray(jax.jit(lambda b: reference.encode(b, mf))(x.view(np.uint32)))
    np.testing.assert_array_equal(got.astype(np.uint8), want)


def test_e2m1_hand_table():
    x = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, -0.1, 0.26, 100.0])
    want = [0, 2, 2, 4, 4, 6, 6, 7, 8, 8, 1, 7]
    got = np.asarray(reference.encode(jnp.asarray(x.view(np.uint32)), E2M1))
    assert got.tolist() == want


def test_nvfp4_hand_block():
    # amax 6 -> s = e4m3(1.0) = 0x38; codes are e2m1 of x itself.
    x = np.zeros((1, 16), np.float32)
    x[0, :4] = [6.0, -3.0, 0.5, 0.75]
    c, s, _ = _q(x, "nvfp4")
    assert int(s[0, 0]) == 0x38
    codes = np.asarray(layout.unpack(c, 4))[0, :4]
    assert codes.tolist() == [0x7, 0x8 | 0x5, 0x1, 0x2]
    # one-level x * (1/s), s = e4m3_rne(amax/6) for amax 1.0 -> 1/6 -> e4m3 0.1640625
    x = np.full((1, 16), 1.0, np.float32)
    c, s, _ = _q(x, "nvfp4")
    s_val = float(np.uint8(s[0, 0]).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert s_val == float(np.float32(1 / 6).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    e = float(np.float32(1.0) * (np.float32(1.0) / np.float32(s_val)))
    code = int(np.asarray(layout.unpack(c, 4))[0, 0])
    assert code == int(np.float32(min(e, 6.0)).astype(ml_dtypes.float4_e2m1fn).view(np.uint8))


def test_nvfp4_two_level_matches_formula(rng):
    x = (rng.standard_normal((4, 64)) * 3).astype(np.float32)
    amax = np.float32(np.abs(x).max())
    pts = np.float32(amax / np.float32(2688))
    c, s, _ = _q(x, "nvfp4", tensor_scale=jnp.full((4,), pts))
    blk = x.reshape(4, 4, 16)
    bamax = np.abs(blk).max(-1)
    s_want = np.clip((bamax / np.float32(6)) / pts, 2.0 ** -6, 448).astype(np.float32)
    s_want = s_want.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(s), s_want.view(np.uint8))
    recip = (np.float32(1) / pts) / s_want.astype(np.float32)
    e = np.clip(blk * recip[..., None], -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(layout.unpack(c, 4)).reshape(4, 4, 16), e)
    y = _dq(c, s, jnp.zeros((0,), jnp.uint8), "nvfp4", 16, 64,
            tensor_scale=jnp.full((4,), pts))
    tot = (pts * s_want.astype(np.float32)).astype(np.float32)
    want = (e.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * tot[..., None]).reshape(4, 64)
    np.testing.assert_array_equal(np.asarray(y), want)


def _exact_pow2_ceil_code(amax, max_elem):
    q = np.float32(np.float32(amax) / np.float32(max_elem))  # IEEE f32 divide (numpy)
    if q == 0:
        return 0
    fr = Fraction(float(q))
    e = math.ceil(math.log2(fr)) if fr > 0 else -127
    while Fraction(2) ** e < fr:
        e += 1
    while e > -127 and Fraction(2) ** (e - 1) >= fr:
        e -= 1
    return int(min(max(e + 127, 0), 254))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3",
                                 "mxfp8_e5m2"])
def test_mx_scales_floor_and_rceil(fmt, rng):
    f = get_format(fmt)
    amaxes = np.concatenate([
        (np.abs(rng.standard_normal(300)) * 2.0 ** rng.integers(-140, 120, 300)),
        [0.0, 1e-45, 1e-40, 2.0 ** -126, 6.0, 7.5, 28.0, 448.0, 57344.0, 3e38],
        [np.nextafter(np.float32(f.elem.max_value * 2.0 ** e), np.float32(np.inf))
         for e in range(-130, -120)]]).astype(np.float32)
    x = np.zeros((len(amaxes), 32), np.float32)
    x[:, 5] = amaxes
    _, s_floor, _ = _q(x, fmt)
    _, s_rceil, _ = _q(x, fmt, rceil=True)
    ef = (amaxes.view(np.uint32) >> 23).astype(np.int64)
    np.testing.assert_array_equal(np.asarray(s_floor)[:, 0], np.clip(ef - f.elem.emax, 0, 254))
    want = [_exact_pow2_ceil_code(a, f.elem.max_value) for a in amaxes]
    np.testing.assert_array_equal(np.asarray(s_rceil)[:, 0], want)


def test_mx_elements_scale_code_zero_is_2_pow_minus_127():
    # a block of subnormals: scale code 0, elements are x * 2**127 exactly (e4m3 keeps them)
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [2.0 ** -130, -(2.0 ** -133), 3 * 2.0 ** -135]
    c, s, z = _q(x, "mxfp8_e4m3")
    assert int(s[0, 0]) == 0
    v = np.asarray(c).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[0, :3]
    np.testing.assert_array_equal(v, [2.0 ** -3, -(2.0 ** -6), 3 * 2.0 ** -8])
    y = np.asarray(_dq(c, s, z, "mxfp8_e4m3", 32, 32))
    np.testing.assert_array_equal(y[0, :3], x[0, :3])  # subnormal f32 outputs, exact


def test_nf4_and_bnb_fp4_hand_codes():
    x = np.zeros((1, 64), np.float32)
    x[0, :6] = [1.0, 0.5, -1.0, 0.0, 0.07958029955625534 / 2, 1e-30]
    c, s, _ = _q(x, "nf4")
    assert float(s[0, 0]) == 1.0
    codes = np.asarray(layout.unpack(c, 4))[0, :6]
    # 0.5 is below the 12/13 midpoint; the exact 7/8 midpoint goes to the lower code
    assert codes.tolist() == [15, 12, 0, 7, 7, 7]
    c, s, _ = _q(x, "bnb_fp4")
    codes = np.asarray(layout.unpack(c, 4))[0, :6]
    assert codes[3] == 0 and codes[5] == 8  # +0.0 -> code 0, tiny positive -> code 8
    assert codes[0] == 3 and codes[2] == 11  # +-1.0


def test_codebook_all_zero_block_and_tiny_blocks():
    x = np.zeros((3, 64), np.float32)
    x[1, :2] = [1e-40, -3e-41]          # all-subnormal block: exact IEEE scaling
    x[2, :2] = [3e38, 1e-30]            # huge absmax: 1/absmax is subnormal
    for fmt in ("nf4", "bnb_fp4"):
        c, s, z = _q(x, fmt)
        f = get_format(fmt)
        absmax = np.abs(x).max(1)
        np.testing.assert_array_equal(np.asarray(s)[:, 0], absmax)
        with np.errstate(all="ignore"):
            r = np.float32(1) / np.maximum(absmax, np.float32(1e-38))
            scaled = np.clip(x * r[:, None], -1, 1)
        srt = np.argsort(f.table, kind="stable")
        mids = ((f.table[srt][:-1] + f.table[srt][1:]) / np.float32(2)).astype(np.float32)
        want = srt[np.searchsorted(mids, scaled, side="left")]
        np.testing.assert_array_equal(np.asarray(layout.unpack(c, 4)), want)
        y = np.asarray(_dq(c, s, z, fmt, 64, 64))
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(y, f.table[want] * absmax[:, None])


def test_int4_awq_rule(rng):
    x = np.arange(16, dtype=np.float32)[None]
    c, s, z = _q(x, "int4", 16)
    assert float(s[0, 0]) == 1.0 and int(z[0, 0]) == 0
    np.testing.assert_array_equal(np.asarray(layout.unpack(c, 4)), x.astype(np.uint8))
    x = (rng.standard_normal((8, 128)) * 0.05 + 0.01).astype(np.float32)
    for sdt in (np.float32, ml_dtypes.bfloat16, np.float16):
        c, s, z = _q(x, "int4", 32, scale_dtype=sdt)
        g = x.reshape(8, 4, 32)
        mn, mx = g.min(-1), g.max(-1)
        s_want = (np.maximum(mx - mn, np.float32(1e-5)) / np.float32(15)).astype(sdt)
        np.testing.assert_array_equal(np.asarray(s).view(np.uint8), s_want.view(np.uint8))
        sf = s_want.astype(np.float32)[..., None]
        z_want = np.clip(-np.round(mn[..., None] / sf), 0, 15)
        q_want = np.clip(np.round(g / sf) + z_want, 0, 15)
        np.testing.assert_array_equal(np.asarray(z), z_want[..., 0].astype(np.uint8))
        np.testing.assert_array_equal(np.asarray(layout.unpack(c, 4)).reshape(8, 4, 32), q_want)
        y = np.asarray(_dq(c, s, z, "int4", 32, 128))
        np.testing.assert_array_equal(y, ((q_want - z_want) * sf).reshape(8, 128))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_nonfinite_blocks_are_nan(fmt, rng):
    f = get_format(fmt)
    bs = 32 if fmt == "int4" else f.default_block
    x = (rng.standard_normal((3, bs * 2))).astype(np.float32)
    x[0, 3] = np.nan
    x[1, bs + 1] = -np.inf
    c, s, z = _q(x, fmt, bs)
    nan_scale = {"nvfp4": 0x7F, "mx": 0xFF}.get(f.family)
    sc = np.asarray(s)
    bad = [(0, 0), (1, 1)]
    for r, b in bad:
        if nan_scale is not None:
            assert sc[r, b] == nan_scale
        else:
            assert np.isnan(sc[r, b].astype(np.float32))
    codes = np.asarray(layout.unpack(c, f.bits) if f.bits != 8 else c).reshape(3, 2, bs)
    assert (codes[0, 0] == 0).all() and (codes[1, 1] == 0).all()
    y = np.asarray(_dq(c, s, z, fmt, bs, 2 * bs)).reshape(3, 2, bs)
    assert np.isnan(y[0, 0]).all() and np.isnan(y[1, 1]).all()
    assert np.isfinite(y[0, 1]).all() and np.isfinite(y[2]).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dequantize_rounds_float32_value_to_nearest_even(dtype, rng):
    x = make_input(rng, 4, 256, "nf4", nonfinite=False)
    c, s, z = _q(x, "nf4")
    y32 = np.asarray(_dq(c, s, z, "nf4", 64, 256))
    y = np.asarray(_dq(c, s, z, "nf4", 64, 256, dtype))
    np_dt = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float16
    assert_bits_equal(y, y32.astype(np_dt), "f32 -> narrow")


def test_round_f32_to_is_exact_for_subnormals_and_specials(rng):
    y = np.concatenate([(rng.standard_normal(5000) * 2.0 ** rng.integers(-149, 20, 5000)),
                        [np.inf, -np.inf, np.nan, 65520.0, 65519.99, 2.0 ** -25,
                         3 * 2.0 ** -26, 1e-40, -1e-45]]).astype(np.float32)
    for dt, np_dt in ((jnp.bfloat16, ml_dtypes.bfloat16), (jnp.float16, np.float16)):
        got = np.asarray(jax.jit(lambda v: reference.round_f32_to(v, dt))(y))
        with np.errstate(all="ignore"):
            assert_bits_equal(got, y.astype(np_dt), str(dt))


def test_exact_arithmetic_helpers(rng):
    a = (rng.standard_normal(20000) * 2.0 ** rng.integers(-149, 127, 20000)).astype(np.float32)
    b = (rng.standard_normal(20000) * 2.0 ** rng.integers(-149, 127, 20000)).astype(np.float32)
    with np.errstate(all="ignore"):
        want = a * b
    assert_bits_equal(np.asarray(jax.jit(reference._mul_exact)(a, b)), want, "mul")
    d = np.concatenate([a, np.float32([1e-38, 2.0 ** -126, 2.0 ** 126, 3e38, 0.0, -0.0, 1e-45,
                                       np.inf, np.nan, 3.0, 7.0])])
    n = np.concatenate([b, np.float32([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 3.0, 1.0, 2.0, 1.0, 1.0])])
    with np.errstate(all="ignore"):
        assert_bits_equal(np.asarray(jax.jit(reference._div)(n, d)), n / d, "div")
        assert_bits_equal(np.asarray(jax.jit(reference._div)(np.float32(1), d)),
                          np.float32(1) / d, "recip")
        c = np.float32(15.0)  # a constant divisor (XLA would use a reciprocal multiply)
        assert_bits_equal(np.asarray(jax.jit(lambda v: reference._div(v, 15.0))(n)), n / c,
                          "div by constant")


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_pack_unpack(bits, rng):
    codes = rng.integers(0, 1 << bits, size=(5, 64)).astype(np.uint8)
    packed = np.asarray(layout.pack(jnp.asarray(codes), bits))
    assert packed.shape == (5, 64 * bits // 8)
    np.testing.assert_array_equal(np.asarray(layout.unpack(packed, bits)), codes)
    # little-endian bit stream: element i occupies bits [i*b, (i+1)*b)
    stream = np.unpackbits(packed, axis=1, bitorder="little").reshape(5, 64, bits)
    np.testing.assert_array_equal((stream * (1 << np.arange(bits))).sum(-1), codes)


@pytest.mark.parametrize("shape", [(1, 1), (128, 4), (130, 5), (300, 9), (7, 64)])
def test_to_blocked_offsets(shape, rng):
    rows, cols = shape
    s = rng.integers(1, 255, size=shape).astype(np.uint8)
    flat = np.asarray(layout.to_blocked(jnp.asarray(s)))
    nk = -(-cols // 4)
    nr = -(-rows // 128)
    assert flat.size == nr * 128 * nk * 4
    want = np.zeros(flat.size, np.uint8)
    m, k = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = (m // 128) * nk * 512 + (k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
    want[off.reshape(-1)] = s.reshape(-1)
    np.testing.assert_array_equal(flat, want)
    np.testing.assert_array_equal(np.asarray(layout.from_blocked(flat, shape)), s)


def test_tensor_scale_from_amax():
    amax = np.float32([0.0, 2688.0, 1.0, 1e-38, np.inf])
    got = np.asarray(reference.tensor_scale_from_amax(jnp.asarray(amax)))
    assert got[0] == 1.0 and got[1] == 1.0
    assert got[2] == np.float32(np.float32(1.0) / np.float32(2688))
    assert got[3] == np.float32(2.0 ** -120) and np.isinf(got[4])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_fake_quantize_is_dequantize_of_quantize(fmt, rng):
    bs = 32 if fmt == "int4" else get_format(fmt).default_block
    x = make_input(rng, 3, 4 * bs, fmt, block_size=bs)
    for dt in (jnp.float32, jnp.bfloat16):
        xv = jnp.asarray(x).astype(dt)
        c, s, z = _q(xv, fmt, bs)
        want = _dq(c, s, z, fmt, bs, 4 * bs, dt)
        got = jax.jit(lambda v: reference.fake_quantize_2d(v, fmt, bs))(xv)
        assert_bits_equal(np.asarray(got), np.asarray(want), fmt)


def test_zero_size():
    c, s, z = reference.quantize_2d(jnp.zeros((0, 32)), "mxfp4", 32)
    assert c.shape == (0, 16) and s.shape == (0, 1)
    y = reference.dequantize_2d(c, s, z, "mxfp4", 32, 32, jnp.float32)
    assert y.shape == (0, 32)
