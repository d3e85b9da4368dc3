"""LightX2V ``lightx2v_kernel.gemm`` (SEEDS_API.md 000): the quantize ops and block-scaled
GEMMs with their argument names, shapes and byte layouts, as jittable JAX functions.

Layouts: 4-bit codes packed two per byte, element 2j in the low nibble; 6-bit codes as a
little-endian bit stream (a | (b&3)<<6, (b>>2) | (c&15)<<4, (c>>4) | d<<2); scales in the
128x4 swizzled layout (SWZ), shape (ru(m, 128), ru(n/block, 4)), padding 0. The upstream
ops are CUDA sm_120 only and raise RuntimeError on bad dtypes; these ports raise
TypeError (dtype) / ValueError (shape) and run anywhere. ``rcp.approx.ftz`` in the CUDA
code is ported as the exact reciprocal (SEEDS_API.md: platform-specific, <= 1 ulp).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import layout
from ..formats import E2M1, E3M2, E4M3
from ._common import (F32, amax_blocks, as_u8, check_2d, check_dtype, decode, div,
                      e4m3_code_rne_sat, e8m0_rceil, f32, ldexp, minifloat_code, mul, ru,
                      swizzle, unswizzle)

__all__ = ["scaled_nvfp4_quant", "scaled_mxfp4_quant", "scaled_mxfp6_quant",
           "scaled_mxfp8_quant", "cutlass_scaled_nvfp4_mm", "cutlass_scaled_mxfp4_mm",
           "cutlass_scaled_mxfp8_mm", "cutlass_scaled_mxfp6_mxfp8_mm"]

_HALF = (jnp.float16, jnp.bfloat16)
_SIXTH = F32(1.0 / 6.0)  # 0.16666667f, the CUDA code's multiplier


def _input(x, mult):
    check_2d("input", x)
    check_dtype("input", x, _HALF)
    if x.shape[1] % mult:
        raise ValueError(f"input: the last axis must be a multiple of {mult}, got {x.shape[1]}")
    return f32(x)


def scaled_nvfp4_quant(input, input_global_scale):
    """NVFP4 quantize with an *encode* global scale.

    Args:
      input: (m, n) float16/bfloat16, n % 16 == 0.
      input_global_scale: float32 1-element array, gs = 2688 / amax (encode).
    Returns:
      output: uint8 (m, n/2) E2M1 codes; output_scale: float8_e4m3fn (ru(m, 128),
      ru(n/16, 4)), swizzled. Per 16-block: S = gs * (amax * f32(1/6)); s = e4m3(S) RNE,
      saturating at 448, no lower clamp; inv = gs / s (0 if s == 0); code = e2m1(x * inv)
      RNE, saturating at 6, sign kept.
    """
    x = _input(input, 16)
    m, n = x.shape
    gs = jnp.asarray(input_global_scale, F32).reshape(())
    s_code = e4m3_code_rne_sat(mul(gs, mul(amax_blocks(x, 16), _SIXTH)))
    s = decode(s_code, E4M3)
    inv = jnp.where(s != 0, mul(gs, div(F32(1.0), jnp.where(s != 0, s, 1.0))), 0.0)
    y = mul(x.reshape(m, n // 16, 16), inv[..., None]).reshape(m, n)
    codes = minifloat_code(y, E2M1)
    sw = swizzle(s_code, m, n // 16)
    return layout.pack(codes, 4), lax.bitcast_convert_type(sw, jnp.float8_e4m3fn)


def _mx_quant(input, mf, block, scale_of_amax, bits):
    x = _input(input, block)
    m, n = x.shape
    c = e8m0_rceil(scale_of_amax(amax_blocks(x, block)))
    k = (127 - c.astype(jnp.int32))[..., None]
    xb = x.reshape(m, n // block, block)
    codes = minifloat_code(xb, mf, k)
    codes = jnp.where((c == 0)[..., None], 0, codes).reshape(m, n)  # SEEDS: code-0 blocks
    sw = swizzle(c, m, n // block)
    return layout.pack(codes, bits), lax.bitcast_convert_type(sw, jnp.float8_e8m0fnu)


def scaled_mxfp4_quant(input):
    """MXFP4 quantize: (m, n) f16/bf16, n % 32 == 0 (the upstream op checks only n % 16;
    n % 32 != 0 is undefined there and an error here) -> (uint8 (m, n/2), float8_e8m0fnu
    (ru(m, 128), ru(n/32, 4)) swizzled). S = amax * f32(1/6); E8M0 code = smallest c with
    2**(c-127) >= S; elements e2m1(x / 2**(c-127)) RNE, saturating. A block with scale code
    0 (2**-127, flushed by the CUDA reciprocal) gets element codes 0 (SEEDS_API.md's port
    rule)."""
    return _mx_quant(input, E2M1, 32, lambda a: mul(a, _SIXTH), 4)


def scaled_mxfp6_quant(input):
    """MXFP6 (E3M2) quantize (upstream; the seed lists only the name): S = amax / 28 (true
    divide), E8M0 as :func:`scaled_mxfp4_quant`, elements RNE saturating at 28. Returns
    uint8 (m, 3n/4) (little-endian 6-bit stream) and the swizzled float8_e8m0fnu scales."""
    return _mx_quant(input, E3M2, 32, lambda a: div(a, F32(28.0)), 6)


def scaled_mxfp8_quant(input):
    """MXFP8 (E4M3) quantize (upstream): S = amax / 448, elements RNE saturating at 448.
    Returns uint8 (m, n) raw E4M3 bytes and swizzled float8_e8m0fnu scales. Upstream the
    scale padding is uninitialized (torch.empty); here it is 0, and callers must not rely
    on it."""
    return _mx_quant(input, E4M3, 32, lambda a: div(a, F32(448.0)), 8)


def _check_scales(name, s, rows, cols, dtype):
    check_dtype(name, s, (dtype,))
    want = (ru(rows, 128), ru(cols, 4))
    if tuple(s.shape) != want:
        raise ValueError(f"{name}: expected shape {want}, got {tuple(s.shape)}")


def _decode_nv(codes_packed, scales, rows, k):
    v = decode(layout.unpack(codes_packed, 4), E2M1).reshape(rows, k // 16, 16)
    s = decode(unswizzle(as_u8(scales), rows, k // 16), E4M3)
    return mul(v, s[..., None]).reshape(rows, k)


def _decode_mx(codes_u8, scales, rows, k, mf, bits):
    v = decode(layout.unpack(codes_u8, bits) if bits < 8 else codes_u8, mf)
    c = unswizzle(as_u8(scales), rows, k // 32).astype(jnp.int32)
    v = v.reshape(rows, k // 32, 32)
    y = jnp.where(jnp.isfinite(v), ldexp(jnp.where(jnp.isfinite(v), v, 0), c[..., None] - 127), v)
    return jnp.where((c == 255)[..., None], jnp.nan, y).reshape(rows, k)


def _gemm(a, b, alpha, bias):
    acc = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                          preferred_element_type=F32)
    out = acc * jnp.asarray(alpha, F32).reshape(())
    if bias is not None:
        check_dtype("bias", bias, (jnp.bfloat16,))
        out = out + bias.astype(F32)[None, :]
    return out.astype(jnp.bfloat16)


def _check_ab(mat_a, mat_b, alpha, dtype=jnp.uint8):
    check_2d("mat_a", mat_a)
    check_2d("mat_b", mat_b)
    check_dtype("mat_a", mat_a, (dtype,))
    check_dtype("mat_b", mat_b, (dtype,))
    check_dtype("alpha", jnp.asarray(alpha), (jnp.float32,))


def cutlass_scaled_nvfp4_mm(mat_a, mat_b, scales_a, scales_b, alpha, bias=None):
    """bf16(alpha * A @ B^T + bias) for NVFP4 operands from :func:`scaled_nvfp4_quant`.

    Args:
      mat_a: uint8 (m, k/2); mat_b: uint8 (n, k/2) (weight rows = output columns);
      scales_a / scales_b: float8_e4m3fn (ru(m,128), ru(k/16,4)) / (ru(n,128), ru(k/16,4));
      alpha: float32 1-element (normally 1/(gs_a*gs_w)); bias: bf16 (n,) or None.
    Returns: bf16 (m, n); float32 accumulation (the order is unspecified upstream).
    Raises: TypeError (dtypes), ValueError (2-D, A.shape[1] == B.shape[1], k % 32, n % 32,
      exact scale shapes).
    """
    _check_ab(mat_a, mat_b, alpha)
    if mat_a.shape[1] != mat_b.shape[1]:
        raise ValueError(f"mat_a/mat_b: k/2 differs: {mat_a.shape[1]} vs {mat_b.shape[1]}")
    (m, kh), n = mat_a.shape, mat_b.shape[0]
    k = 2 * kh
    if k % 32 or n % 32:
        raise ValueError(f"mat_b: k ({k}) and n ({n}) must be multiples of 32")
    _check_scales("scales_a", scales_a, m, k // 16, jnp.float8_e4m3fn)
    _check_scales("scales_b", scales_b, n, k // 16, jnp.float8_e4m3fn)
    return _gemm(_decode_nv(mat_a, scales_a, m, k), _decode_nv(mat_b, scales_b, n, k),
                 alpha, bias)


def cutlass_scaled_mxfp4_mm(mat_a, mat_b, scales_a, scales_b, alpha, bias=None):
    """MXFP4 x MXFP4: A uint8 (m, k/2), B uint8 (n, k/2), float8_e8m0fnu scales
    (ru(rows,128), ru(k/32,4)); k % 128, n % 128. Result as :func:`cutlass_scaled_nvfp4_mm`."""
    _check_ab(mat_a, mat_b, alpha)
    if mat_a.shape[1] != mat_b.shape[1]:
        raise ValueError(f"mat_a/mat_b: k/2 differs: {mat_a.shape[1]} vs {mat_b.shape[1]}")
    (m, kh), n = mat_a.shape, mat_b.shape[0]
    k = 2 * kh
    if k % 128 or n % 128:
        raise ValueError(f"mat_b: k ({k}) and n ({n}) must be multiples of 128")
    _check_scales("scales_a", scales_a, m, k // 32, jnp.float8_e8m0fnu)
    _check_scales("scales_b", scales_b, n, k // 32, jnp.float8_e8m0fnu)
    return _gemm(_decode_mx(mat_a, scales_a, m, k, E2M1, 4),
                 _decode_mx(mat_b, scales_b, n, k, E2M1, 4), alpha, bias)


def cutlass_scaled_mxfp8_mm(mat_a, mat_b, scales_a, scales_b, alpha, bias=None):
    """MXFP8 (E4M3) x MXFP8 (upstream): A uint8 (m, k), B uint8 (n, k) raw E4M3 bytes;
    k % 16, n % 128, scales_a.shape[1] == scales_b.shape[1]."""
    _check_ab(mat_a, mat_b, alpha)
    if mat_a.shape[1] != mat_b.shape[1]:
        raise ValueError(f"mat_a/mat_b: k differs: {mat_a.shape[1]} vs {mat_b.shape[1]}")
    (m, k), n = mat_a.shape, mat_b.shape[0]
    if k % 16 or n % 128 or scales_a.shape[1] != scales_b.shape[1]:
        raise ValueError(f"mat_b: need k % 16 == 0 (k={k}), n % 128 == 0 (n={n}) and equal "
                         f"scale widths ({scales_a.shape[1]} vs {scales_b.shape[1]})")
    if k % 32:
        raise ValueError(f"mat_a: k = {k} is not a multiple of the MX block (32)")
    _check_scales("scales_a", scales_a, m, k // 32, jnp.float8_e8m0fnu)
    _check_scales("scales_b", scales_b, n, k // 32, jnp.float8_e8m0fnu)
    return _gemm(_decode_mx(mat_a, scales_a, m, k, E4M3, 8),
                 _decode_mx(mat_b, scales_b, n, k, E4M3, 8), alpha, bias)


def cutlass_scaled_mxfp6_mxfp8_mm(mat_a, mat_b, scales_a, scales_b, alpha, bias=None):
    """MXFP8-E4M3 activations x MXFP6-E3M2 weights (upstream): mat_a uint8 (m, k) E4M3
    bytes, mat_b uint8 (n, 3k/4) 6-bit stream; k from mat_a (no width check upstream;
    here mat_b must be (n, 3k/4)); k % 16, n % 128."""
    _check_ab(mat_a, mat_b, alpha)
    (m, k), n = mat_a.shape, mat_b.shape[0]
    if k % 16 or n % 128:
        raise ValueError(f"mat_b: need k % 16 == 0 (k={k}) and n % 128 == 0 (n={n})")
    if k % 32 or mat_b.shape[1] != 3 * k // 4:
        raise ValueError(f"mat_b: expected (n, 3k/4) = ({n}, {3 * k // 4}) with k % 32 == 0, "
                         f"got {tuple(mat_b.shape)}")
    _check_scales("scales_a", scales_a, m, k // 32, jnp.float8_e8m0fnu)
    _check_scales("scales_b", scales_b, n, k // 32, jnp.float8_e8m0fnu)
    return _gemm(_decode_mx(mat_a, scales_a, m, k, E4M3, 8),
                 _decode_mx(mat_b, scales_b, n, k, E3M2, 6), alpha, bias)
