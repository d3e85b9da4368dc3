"""vLLM's NVFP4 emulation utilities (PR #40033, ``nvfp4_emulation_utils``; SEEDS_API.md 004):
``dequantize_to_dtype`` and ``ref_nvfp4_quant_dequant``."""
from __future__ import annotations

import jax.numpy as jnp

from .. import layout
from ..formats import E2M1, E4M3
from ..reference import round_f32_to
from ._common import (F32, amax_blocks, as_u8, decode, div, e4m3_code_rne_sat, f32,
                      minifloat_code, mul, unswizzle)

__all__ = ["dequantize_to_dtype", "ref_nvfp4_quant_dequant"]
_SIXTH = F32(1.0 / 6.0)


def dequantize_to_dtype(tensor_fp4, tensor_sf, global_scale, dtype, block_size=16,
                        swizzle=True):
    """NVFP4 decode with a *decode* global scale (ModelOpt ``weight_scale_2``).

    Args:
      tensor_fp4: uint8 (m, k/2) or (E, m, k/2), element 2j in the low nibble.
      tensor_sf: float8_e4m3fn (or its uint8 bytes). ``swizzle`` falsy: linear (m, k/bs) /
        (E, m, k/bs); truthy: the 128x4 swizzled layout padded to (ru(rows,128), ru(k/bs,4))
        with rows = m (2-D) or E*m (3-D: the experts' rows as one matrix), cropped to rows
        (upstream). (k/bs) % 4 == 0 is required upstream for the swizzled path; this port
        accepts any k/bs.
      global_scale: 1 element (2-D) or (E,) (3-D), float32.
      dtype: output dtype (float32, bfloat16, float16).
    Returns:
      dtype (..., m, k) = dtype(e2m1(c) * f32(f32(sf) * gs)).
    Raises:
      TypeError: tensor_fp4 is not uint8. ValueError: k % block_size, shapes.
    """
    if jnp.asarray(tensor_fp4).dtype != jnp.uint8:
        raise TypeError(f"tensor_fp4: expected uint8, got {jnp.asarray(tensor_fp4).dtype}")
    *lead, m, kh = tensor_fp4.shape
    k = 2 * kh
    if k % block_size:
        raise ValueError(f"tensor_fp4: k = {k} is not a multiple of block_size {block_size}")
    rows = m * (lead[0] if lead else 1)
    nb = k // block_size
    sf = as_u8(tensor_sf)
    if swizzle:
        sf = unswizzle(sf, rows, nb)
    sf = decode(sf.reshape(*lead, m, nb), E4M3)
    gs = jnp.asarray(global_scale, F32).reshape((-1, 1, 1) if lead else ())
    s = mul(sf, gs)
    v = decode(layout.unpack(tensor_fp4, 4), E2M1).reshape(*lead, m, nb, block_size)
    return round_f32_to(mul(v, s[..., None]).reshape(*lead, m, k), dtype)


def ref_nvfp4_quant_dequant(x, global_scale, block_size):
    """NVFP4 QDQ with an *encode* global scale (= 1/input_scale) (signature and math
    upstream; the seed gives the name).

    Args:
      x: (m, k) float32/bfloat16/float16, k % block_size == 0.
      global_scale: float32 1-element, encode scale.
      block_size: 16 for NVFP4.
    Returns:
      x's dtype and shape: per block a = max|x|; S = gs * (a * f32(1/6)) clamped to 448;
      s = e4m3(S) RNE; inv = gs / s (0 if s == 0); q = e2m1 RNE of clamp(x * inv, -6, 6);
      out = q * (s / gs). The CUDA path is ported (the non-CUDA fallback's
      1/(s*(1/gs)) may differ by one ulp).
    """
    if x.ndim != 2 or x.shape[1] % block_size:
        raise ValueError(f"x: expected (m, k) with k % {block_size} == 0, got {x.shape}")
    m, k = x.shape
    x32 = f32(x)
    gs = jnp.asarray(global_scale, F32).reshape(())
    s = decode(e4m3_code_rne_sat(mul(gs, mul(amax_blocks(x32, block_size), _SIXTH))), E4M3)
    inv = jnp.where(s != 0, div(gs, jnp.where(s != 0, s, 1.0)), 0.0)
    y = mul(x32.reshape(m, k // block_size, block_size), inv[..., None])
    q = decode(minifloat_code(jnp.clip(y, -6.0, 6.0), E2M1), E2M1)
    out = mul(q, div(s, gs)[..., None]).reshape(m, k)
    return round_f32_to(out, x.dtype)
