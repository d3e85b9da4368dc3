"""``torch._scaled_mm`` with NVFP4 operands and the seed's recipe helpers (SEEDS_API.md 002).

torch's ``float4_e2m1fn_x2`` has no JAX dtype: packed operands are uint8 bytes (element
2j in the low nibble, as torch and PTX). The recipe's own packing puts element 2j in the
HIGH nibble (reproduced as-is: :func:`recipe_quantize`); ``_scaled_mm`` results survive it
when both operands use it, the bytes do not.
"""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import layout
from ..formats import E2M1, E4M3
from ._common import F32, as_u8, check_dtype, decode, div, f32, mul, ru, unswizzle

__all__ = ["scaled_mm", "recipe_quantize", "flatten_stride16_rows_mod32_groups_of4",
           "flatten_stride16_rows_mod32_groups_of4_naive", "flatten_swizzled_padded",
           "_linear_index_map"]

_CB = np.float32([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6])


def _linear_index_map(h, w, device=None):
    """int64 (h*w,) indices: for each 128-row block b, 4-column group g, s in 0..31, r in
    (0, 32, 64, 96), c in 0..3, element (128b + s + r, 4g + c) of an (h, w) matrix,
    skipping those out of range (no padding). ``device`` is accepted and ignored."""
    idx = []
    for b in range(-(-h // 128)):
        for g in range(-(-w // 4)):
            for s in range(32):
                for r in (0, 32, 64, 96):
                    for c in range(4):
                        i, j = 128 * b + s + r, 4 * g + c
                        if i < h and j < w:
                            idx.append(i * w + j)
    return np.asarray(idx, np.int64)


def flatten_stride16_rows_mod32_groups_of4_naive(x):
    """x (H, W) -> 1-D ``x.reshape(-1)[_linear_index_map(H, W)]`` (loop form upstream)."""
    if x.ndim != 2:
        raise ValueError(f"x: expected a 2-D (H, W) array, got shape {x.shape}")
    return jnp.asarray(x).reshape(-1)[_linear_index_map(*x.shape)]


def flatten_stride16_rows_mod32_groups_of4(x):
    """Same result as the naive form (vectorized upstream). Equals the padded 128x4
    swizzle only when H % 128 == 0 and W % 4 == 0; otherwise it is compacted (what the
    seed does, not what ``_scaled_mm`` reads): use :func:`flatten_swizzled_padded`."""
    return flatten_stride16_rows_mod32_groups_of4_naive(x)


def flatten_swizzled_padded(x):
    """x (H, W) -> 1-D padded 128x4 swizzle of length ru(H,128)*ru(W,4) (what
    ``_scaled_mm`` reads; not in the seed)."""
    return layout.to_blocked(jnp.asarray(x))


def _e4m3_torch(v):
    """torch's float32 -> float8_e4m3fn cast: RNE, |v| >= 480 -> NaN (not saturating)."""
    from ._common import minifloat_code
    code = minifloat_code(jnp.clip(v, -448.0, 448.0), E4M3)
    nan = jnp.abs(v) >= 480.0
    code = jnp.where(nan | jnp.isnan(v), jnp.uint8(0x7F), code)
    return lax.bitcast_convert_type(code, jnp.float8_e4m3fn)


def recipe_quantize(x):
    """The seed's inline NVFP4 recipe (unnamed there). x (H, W) float32, W % 16 == 0.

    Blocks of 16 over ``x.reshape(-1)``; scale = (max|blk| + 1e-8) / 6 (float32, true
    divide, unrounded); y = clamp(x / scale, -6, 6); code = first index of the nearest
    entry of [0,.5,1,1.5,2,3,4,6,-0,-.5,...,-6] (ties to the smaller magnitude, not RNE;
    values nearest zero, negative too, give code 0); byte j = code[2j] << 4 | code[2j+1]
    (HIGH nibble first). Returns (uint8 (H, W/2), float8_e4m3fn 1-D scales from
    :func:`flatten_stride16_rows_mod32_groups_of4` of the (H, W/16) scales cast as torch
    casts: RNE, |v| >= 480 -> NaN; the seed does not show that cast).
    """
    if x.ndim != 2 or x.shape[1] % 16:
        raise ValueError(f"x: expected (H, W) with W % 16 == 0, got {x.shape}")
    h, w = x.shape
    xb = f32(x).reshape(-1, 16)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    scale = div(amax + F32(1e-8), F32(6.0))
    y = jnp.clip(div(xb, scale[:, None]), -6.0, 6.0)
    idx = jnp.argmin(jnp.abs(y[..., None] - jnp.asarray(_CB)), axis=-1).astype(jnp.uint8)
    c = idx.reshape(-1, 2)
    packed = ((c[:, 0] << 4) | c[:, 1]).reshape(h, w // 2)
    sc = _e4m3_torch(scale.reshape(h, w // 16))
    flat = flatten_stride16_rows_mod32_groups_of4(lax.bitcast_convert_type(sc, jnp.uint8))
    return packed, lax.bitcast_convert_type(flat, jnp.float8_e4m3fn)


def scaled_mm(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
              use_fast_accum=False):
    """``torch._scaled_mm`` for NVFP4: out = sum_k e2m1(A) sa e2m1(B) sb (+ bias).

    Args:
      self: A, uint8 (M, K/2) row-major (torch's float4_e2m1fn_x2 bytes).
      mat2: B, uint8 (K/2, N): the transpose of an (N, K/2) row-major tensor.
      scale_a / scale_b: float8_e4m3fn, 1-D, ru(M,128)*ru(K/16,4) / ru(N,128)*ru(K/16,4),
        128x4 swizzled; one scale per 16 K-elements (multiplied on decode).
      bias: float16/bfloat16 (N,) or None; scale_result: ignored (16/32-bit outputs, as
        torch); out_dtype: default bfloat16; use_fast_accum: ignored (float32 sums).
    Raises:
      TypeError / ValueError: dtypes; K mismatch; M, N, K not multiples of 32; scale sizes.
    """
    check_dtype("self", self, (jnp.uint8,))
    check_dtype("mat2", mat2, (jnp.uint8,))
    (m, kh), (kh2, n) = self.shape, mat2.shape
    if kh != kh2:
        raise ValueError(f"mat2: expected (K/2, N) with K/2 = {kh}, got {tuple(mat2.shape)}")
    k = 2 * kh
    if m % 32 or n % 32 or k % 32:
        raise ValueError(f"self/mat2: sizes must be multiples of 32, got M={m}, N={n}, K={k}")
    for name, s, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        check_dtype(name, s, (jnp.float8_e4m3fn,))
        if s.ndim != 1 or s.shape[0] != ru(rows, 128) * ru(k // 16, 4):
            raise ValueError(f"{name}: expected 1-D length {ru(rows, 128) * ru(k // 16, 4)}, "
                             f"got shape {tuple(s.shape)}")

    def dec(codes, s, rows):
        v = decode(layout.unpack(codes, 4), E2M1).reshape(rows, k // 16, 16)
        sc = decode(unswizzle(as_u8(s), rows, k // 16), E4M3)
        return mul(v, sc[..., None]).reshape(rows, k)

    a, b = dec(self, scale_a, m), dec(mat2.T, scale_b, n)
    acc = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                          preferred_element_type=F32)
    if bias is not None:
        acc = acc + bias.astype(F32)[None, :]
    return acc.astype(out_dtype or jnp.bfloat16)
