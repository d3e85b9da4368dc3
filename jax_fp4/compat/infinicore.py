"""InfiniCore's AWQ dequantize (SEEDS_API.md 001) as a functional JAX port of
``Descriptor::create(...)`` + ``calculate(workspace, workspace_size, out, qweight, scales,
zeros, stream)``: the descriptor/workspace/stream plumbing has no JAX counterpart."""
from __future__ import annotations

import jax.numpy as jnp

from ..reference import round_f32_to
from ._common import check_2d, check_dtype

__all__ = ["dequantize_awq"]

# column 8j + t of a word reads nibble _NIBBLE[t] (AutoAWQ's interleaved order)
_NIBBLE = jnp.array([0, 4, 1, 5, 2, 6, 3, 7], jnp.uint32)


def _unpack(w):
    u = w.astype(jnp.uint32) if w.dtype == jnp.uint32 else w.view(jnp.uint32)
    nib = (u[..., None] >> (4 * _NIBBLE)) & 0xF
    return nib.reshape(*u.shape[:-1], 8 * u.shape[-1]).astype(jnp.int32)


def dequantize_awq(qweight, scales, zeros):
    """AutoAWQ GEMM dequantize.

    Args:
      qweight: int32 (K, N/8); zeros: int32 (G, N/8); scales: float16 (G, N). Word w at
        [r, j] holds out[r, 8j + t] in nibble [0,4,1,5,2,6,3,7][t] (unsigned).
    Returns:
      float16 (K, N): fp16((v - z) * s) with one RNE rounding, row r using group
      r // (K // G); v == z gives +0.
    Raises:
      TypeError / ValueError: dtypes, ranks, or K not a multiple of G, or mismatched N
      (the upstream kernel does no checks and reads out of range instead).
    """
    for name, a in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        check_2d(name, a)
    check_dtype("qweight", qweight, (jnp.int32,))
    check_dtype("zeros", zeros, (jnp.int32,))
    check_dtype("scales", scales, (jnp.float16,))
    (k, n8), (g, n) = qweight.shape, scales.shape
    if n != 8 * n8 or zeros.shape != (g, n8) or g == 0 or k % g:
        raise ValueError(f"scales/zeros: expected scales (G, {8 * n8}) and zeros (G, {n8}) "
                         f"with G dividing K = {k}; got {tuple(scales.shape)}, "
                         f"{tuple(zeros.shape)}")
    gsz = k // g
    v = _unpack(qweight)
    z = jnp.repeat(_unpack(zeros), gsz, axis=0)
    s = jnp.repeat(scales.astype(jnp.float32), gsz, axis=0)
    d = (v - z).astype(jnp.float32)
    y = jnp.where(d == 0, 0.0, d * s)  # exact in float32; sub.f16x2 of equal values is +0
    return round_f32_to(y, jnp.float16)
