"""jax_fp4.compat: the seeds' call signatures (SEEDS_API.md), against bitsandbytes on CPU
and otherwise against NumPy transcriptions of SEEDS_API.md's formulas (IEEE float32 with
subnormals, ml_dtypes' RNE casts)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_fp4 as jf
from jax_fp4.compat import bitsandbytes as cbnb
from jax_fp4.compat import infinicore, lightx2v, torch_scaled_mm, vllm

F32 = np.float32
E2M1 = np.float32([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def _x(rng, shape, dtype=jnp.bfloat16):
    x = rng.standard_normal(shape).astype(F32) * F32(rng.uniform(0.01, 100))
    x.reshape(-1)[:16] = 0.0  # an all-zero block
    x.reshape(-1)[40] = -0.0
    x.reshape(-1)[-1] = np.abs(x).max() * 3  # an outlier
    return jnp.asarray(x, dtype)


def _swz(sc):
    """SEEDS_API.md SWZ applied to a (rows, cols) uint8 matrix, padding 0."""
    rows, cols = sc.shape
    nkt = -(-cols // 4)
    out = np.zeros((-(-rows // 128) * 128, nkt * 4), np.uint8).reshape(-1)
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = (r // 128) * nkt * 512 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    out[off] = sc
    return out.reshape(-(-rows // 128) * 128, nkt * 4)


def _cast(v, dt):  # ml_dtypes RNE cast -> code in the low bits
    return np.asarray(v, F32).astype(dt).view(np.uint8)


def _pack4(codes):
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).astype(np.uint8)


# ----------------------------------------------------------------------------- LightX2V
def test_lightx2v_nvfp4_quant_matches_spec(rng):
    x = _x(rng, (130, 96))
    xf = np.asarray(x, F32)
    gs = F32(2688) / np.abs(xf).max() * F32(0.5)
    out, sc = jax.jit(lightx2v.scaled_nvfp4_quant)(x, jnp.float32([gs]))
    amax = np.abs(xf).reshape(130, 6, 16).max(-1)
    S = gs * (amax * F32(1 / 6))
    s_code = _cast(np.minimum(S, 448), ml_dtypes.float8_e4m3fn)
    s = s_code.view(ml_dtypes.float8_e4m3fn).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(s != 0, gs * (F32(1) / s), F32(0)).astype(F32)
    y = np.clip(xf.reshape(130, 6, 16) * inv[..., None], -6, 6).reshape(130, 96)
    codes = _cast(y, ml_dtypes.float4_e2m1fn) & 0xF
    np.testing.assert_array_equal(np.asarray(out), _pack4(codes))
    assert sc.dtype == jnp.float8_e4m3fn and sc.shape == (256, 8)
    np.testing.assert_array_equal(np.asarray(sc).view(np.uint8), _swz(s_code))


def _e8m0_rceil(S):
    m, e = np.frexp(S.astype(np.float64))
    c = np.where(m == 0.5, e - 1, e) + 127
    return np.where(S == 0, 0, np.clip(c, 0, 254)).astype(np.uint8)


@pytest.mark.parametrize("op,mf,amax_div,bits", [
    (lightx2v.scaled_mxfp4_quant, ml_dtypes.float4_e2m1fn, None, 4),
    (lightx2v.scaled_mxfp6_quant, ml_dtypes.float6_e3m2fn, 28.0, 6),
    (lightx2v.scaled_mxfp8_quant, ml_dtypes.float8_e4m3fn, 448.0, 8),
])
def test_lightx2v_mx_quant_matches_spec(rng, op, mf, amax_div, bits):
    x = _x(rng, (40, 64), jnp.float16)
    out, sc = jax.jit(op)(x)
    xf = np.asarray(x, F32).reshape(40, 2, 32)
    amax = np.abs(xf).max(-1)
    S = amax * F32(1 / 6) if amax_div is None else amax / F32(amax_div)
    c = _e8m0_rceil(S.astype(F32))
    y = np.ldexp(xf, (127 - c.astype(np.int32))[..., None]).astype(F32)
    mx = float(ml_dtypes.finfo(mf).max)
    codes = (_cast(np.clip(y, -mx, mx), mf) & ((1 << bits) - 1)).reshape(40, 64)
    codes = np.where(np.repeat(c == 0, 32, axis=1), 0, codes)
    want = np.asarray(jf.layout.pack(jnp.asarray(codes), bits))
    np.testing.assert_array_equal(np.asarray(out), want)
    assert sc.dtype == jnp.float8_e8m0fnu
    np.testing.assert_array_equal(np.asarray(sc).view(np.uint8), _swz(c))


def test_lightx2v_gemms_within_float32_accumulation(rng):
    a, b = _x(rng, (48, 128)), _x(rng, (128, 128))
    ga = jnp.float32([2688 / float(jnp.abs(a.astype(jnp.float32)).max())])
    gb = jnp.float32([2688 / float(jnp.abs(b.astype(jnp.float32)).max())])
    quant = jax.jit(lightx2v.scaled_nvfp4_quant)
    qa, sa = quant(a, ga)
    qb, sb = quant(b, gb)
    bias = jnp.asarray(rng.standard_normal(128), jnp.bfloat16)
    alpha = 1 / (ga * gb)
    got = np.asarray(jax.jit(lightx2v.cutlass_scaled_nvfp4_mm)(qa, qb, sa, sb, alpha, bias),
                     np.float64)

    def dec(q, s, rows):
        v = E2M1[np.asarray(jf.layout.unpack(q, 4))].astype(np.float64)
        lin = np.asarray(jf.layout.from_blocked(jnp.asarray(s).reshape(-1), (rows, 8)))
        return v * np.repeat(lin.astype(np.float64), 16, axis=1)

    exact = float(alpha[0]) * dec(qa, sa, 48) @ dec(qb, sb, 128).T + np.asarray(bias, np.float64)
    bound = np.abs(dec(qa, sa, 48)) @ np.abs(dec(qb, sb, 128)).T * float(alpha[0]) * 128 * 2**-24
    assert (np.abs(got - exact) <= bound + np.abs(exact) * 2**-8 + 1e-30).all()
    mxa, msa = jax.jit(lightx2v.scaled_mxfp4_quant)(a)
    mxb, msb = jax.jit(lightx2v.scaled_mxfp4_quant)(b)
    y = jax.jit(lightx2v.cutlass_scaled_mxfp4_mm)(mxa, mxb, msa, msb, jnp.float32([1.0]))
    assert y.shape == (48, 128) and y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, F32), np.asarray(a, F32) @ np.asarray(b, F32).T,
                               atol=0.35 * float(np.abs(np.asarray(a, F32) @ np.asarray(b, F32).T).max()))
    with pytest.raises(ValueError, match="scales_a: expected shape"):
        lightx2v.cutlass_scaled_nvfp4_mm(qa, qb, sa[:, :4], sb, alpha)
    with pytest.raises(TypeError, match="input: expected dtype"):
        lightx2v.scaled_nvfp4_quant(a.astype(jnp.float32), ga)


# ----------------------------------------------------------------------------- InfiniCore
def test_infinicore_dequantize_awq_matches_autoawq(rng):
    torch = pytest.importorskip("torch")
    from test_conventions import _awq_dequantize, _awq_pack, _awq_quantize

    w = torch.from_numpy(rng.standard_normal((64, 256)).astype(F32)).half()
    iw, iz, s = _awq_quantize(w, 64)
    qw, qz = _awq_pack(iw), _awq_pack(iz)
    got = jax.jit(infinicore.dequantize_awq)(jnp.asarray(qw.numpy()), jnp.asarray(s.numpy()),
                                             jnp.asarray(qz.numpy()))
    want = _awq_dequantize(qw, qz, s, 64).numpy()
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError, match="G dividing K"):
        infinicore.dequantize_awq(jnp.asarray(qw.numpy())[:98], jnp.asarray(s.numpy()),
                                  jnp.asarray(qz.numpy()))


# ----------------------------------------------------------------------------- vLLM
def test_vllm_dequantize_to_dtype_is_the_nvfp4_qarray(rng):
    x = _x(rng, (160, 64))
    q = jf.quantize(x, "nvfp4", tensor_scale="auto")
    want = np.asarray(q.dequantize(jnp.float32))
    deq = jax.jit(vllm.dequantize_to_dtype, static_argnums=(3, 4, 5))
    lin = deq(q.data, q.scales, q.tensor_scale, jnp.float32, 16, False)
    np.testing.assert_array_equal(np.asarray(lin).view(np.uint32), want.view(np.uint32))
    sw = _swz(np.asarray(q.scales).view(np.uint8)).view(ml_dtypes.float8_e4m3fn)
    got = deq(q.data, jnp.asarray(sw), q.tensor_scale, jnp.bfloat16, 16, True)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(q.dequantize(jnp.bfloat16)).view(np.uint16))
    # 3-D: experts with their own global scale
    d3 = deq(jnp.stack([q.data, q.data]), jnp.stack([q.scales] * 2),
             jnp.stack([q.tensor_scale, q.tensor_scale * 2]), jnp.float32, 16, False)
    np.testing.assert_array_equal(np.asarray(d3[1]), 2 * want)


def test_vllm_ref_nvfp4_quant_dequant_matches_spec(rng):
    x = _x(rng, (32, 128), jnp.float32)
    xf = np.asarray(x)
    gs = F32(2688) / np.abs(xf).max()
    got = np.asarray(jax.jit(vllm.ref_nvfp4_quant_dequant, static_argnums=2)(
        x, jnp.float32([gs]), 16))
    xb = xf.reshape(32, 8, 16)
    S = np.minimum(gs * (np.abs(xb).max(-1) * F32(1 / 6)), F32(448))
    s = S.astype(ml_dtypes.float8_e4m3fn).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(s == 0, F32(0), gs / s).astype(F32)
    y = np.clip(xb * inv[..., None], -6, 6)
    qv = y.astype(ml_dtypes.float4_e2m1fn).astype(F32)
    want = (qv * (s / gs)[..., None]).astype(F32).reshape(32, 128)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ----------------------------------------------------------------------------- torch recipe
def test_recipe_flatten_helpers():
    for h, w in ((128, 8), (256, 4), (130, 6)):
        x = jnp.arange(h * w, dtype=jnp.int32).reshape(h, w)
        flat = np.asarray(torch_scaled_mm.flatten_stride16_rows_mod32_groups_of4(x))
        assert flat.shape == (h * w,) and sorted(flat.tolist()) == list(range(h * w))
        if h % 128 == 0 and w % 4 == 0:  # the padded swizzle exactly when nothing is padded
            np.testing.assert_array_equal(
                flat, np.asarray(torch_scaled_mm.flatten_swizzled_padded(x)))
        idx = torch_scaled_mm._linear_index_map(h, w, "cpu")
        np.testing.assert_array_equal(flat, np.arange(h * w)[idx])
    with pytest.raises(ValueError, match="2-D"):
        torch_scaled_mm.flatten_stride16_rows_mod32_groups_of4_naive(jnp.zeros(4))


def test_recipe_quantize_and_scaled_mm(rng):
    x = _x(rng, (32, 64), jnp.float32)
    packed, scale = jax.jit(torch_scaled_mm.recipe_quantize)(x)
    xb = np.asarray(x).reshape(-1, 16)
    sc = ((np.abs(xb).max(-1) + F32(1e-8)) / F32(6)).astype(F32)
    y = np.clip(xb / sc[:, None], -6, 6)
    idx = np.argmin(np.abs(y[..., None] - E2M1), axis=-1).astype(np.uint8).reshape(-1, 2)
    np.testing.assert_array_equal(np.asarray(packed).reshape(-1), (idx[:, 0] << 4) | idx[:, 1])
    want_sc = sc.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(32, 4)
    np.testing.assert_array_equal(
        np.asarray(scale).view(np.uint8),
        np.asarray(torch_scaled_mm.flatten_stride16_rows_mod32_groups_of4(jnp.asarray(want_sc))))
    # _scaled_mm on jax-fp4 one-level nvfp4 operands (low nibble first, swizzled scales)
    a = jf.quantize(_x(rng, (32, 64)), "nvfp4", scale_layout="swizzled")
    b = jf.quantize(_x(rng, (32, 64)), "nvfp4", scale_layout="swizzled")
    out = jax.jit(torch_scaled_mm.scaled_mm, static_argnames="out_dtype")(
        a.data, b.data.T, a.scales.reshape(-1), b.scales.reshape(-1), out_dtype=jnp.float32)
    exact = np.asarray(a.dequantize(jnp.float32), np.float64) @ np.asarray(
        b.dequantize(jnp.float32), np.float64).T
    np.testing.assert_allclose(np.asarray(out), exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())


# ----------------------------------------------------------------------------- bitsandbytes


@pytest.mark.parametrize("qt", ["nf4", "fp4"])
def test_bnb_quantize_dequantize_match_bitsandbytes(rng, qt):
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    # in % blocksize == 0: bnb's CPU dequantize kernel blocks rows, not the flat tensor
    x = _x(rng, (48, 128), jnp.float32)
    xt = torch.from_numpy(np.asarray(x))
    q_ref, st = F.quantize_4bit(xt, blocksize=64, quant_type=qt)
    q, qs = jax.jit(lambda a: cbnb.quantize_4bit(a, 64, qt))(x)
    np.testing.assert_array_equal(np.asarray(qs.absmax), st.absmax.numpy())

    def codes(b):  # element order, high nibble first
        b = np.asarray(b).reshape(-1)
        return np.stack([b >> 4, b & 15], 1).reshape(-1)

    ours, theirs = codes(q), codes(q_ref.numpy())
    differ = ours != theirs
    # bnb's CPU quantizer buckets |y| < 0.0026 into FP4 code 0 or 8 by its table order, the
    # Triton seed by the sign of y; both decode to a zero
    y = np.asarray(x).reshape(-1) / np.repeat(st.absmax.numpy(), 64)
    if qt == "nf4":
        assert not differ.any()
    else:
        assert (np.abs(y[differ]) <= 0.00260417).all() and set(ours[differ]) <= {0, 8}
    ref = F.dequantize_4bit(q_ref, st).numpy()
    got = np.asarray(jax.jit(cbnb.dequantize_4bit)(jnp.asarray(q_ref.numpy()), qs))
    bad = got.view(np.uint32) != ref.view(np.uint32)
    if qt == "nf4":
        assert not bad.any()
    else:  # the Triton FP4 table's 0.00520833 is not bnb-CPU's f32(1/192); -0 vs +0 for 8
        c = theirs.reshape(x.shape)
        assert (((c[bad] & 7) == 1) | (c[bad] == 8)).all()
        np.testing.assert_allclose(got[bad], ref[bad], rtol=1e-6)
    # the upstream in-place signature, its output passed as a template
    out = cbnb.dequantize_4bit_impl(q, qs.absmax, 64, qt, None,
                                    jax.ShapeDtypeStruct(x.shape, jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape


def test_bnb_nested_quant_state_matches_bitsandbytes(rng):
    torch = pytest.importorskip("torch")
    F = pytest.importorskip("bitsandbytes.functional")
    xt = torch.from_numpy(np.asarray(_x(rng, (64, 256), jnp.float32))).bfloat16()
    q_ref, st = F.quantize_4bit(xt, blocksize=64, quant_type="nf4", compress_statistics=True)
    s2 = cbnb.QuantState(jnp.asarray(st.state2.absmax.numpy()), None,
                         jnp.asarray(st.state2.code.numpy()), st.state2.blocksize)
    qs = cbnb.QuantState(jnp.asarray(st.absmax.numpy()), tuple(xt.shape),
                         jnp.asarray(st.code.numpy()), 64, "nf4", jnp.bfloat16,
                         offset=float(st.offset), state2=s2)
    got = jax.jit(cbnb.dequantize_4bit)(jnp.asarray(q_ref.numpy()), qs)
    ref = F.dequantize_4bit(q_ref, st)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  ref.view(torch.int16).numpy().view(np.uint16))
    assert qs.as_dict()["nested_blocksize"] == 256
