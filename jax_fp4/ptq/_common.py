"""Shared plumbing of the PTQ methods: the canonical (rows, K) view of a 2-D weight, the
options of a format, and QArrays built from FFI buffers chosen here."""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import reference as R
from ..formats import Format, get_format
from ..qarray import QArray


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """A weight format with its options, as :func:`jax_fp4.quantize` takes them.

    Attributes:
      name: the format's registry name (:attr:`format` is its
        :class:`~jax_fp4.formats.Format`).
      block_size: elements per block along the contraction axis.
      tensor_scale: nvfp4: "auto" (two-level, amax/2688), None (one level) or a float;
        ignored by the other formats.
      rceil: MX scale rounding "rceil" instead of "floor" (the RTN starting point).
      scale_dtype: int4 group-scale dtype (None: the weight's dtype).
    """

    name: str
    block_size: int
    tensor_scale: object = "auto"
    rceil: bool = False
    scale_dtype: Optional[object] = None

    @classmethod
    def make(cls, format, block_size=None, tensor_scale="auto", scale_rounding="floor",
             scale_dtype=None) -> "QuantSpec":
        f = get_format(format)
        if scale_rounding not in ("floor", "rceil"):
            raise ValueError(f"scale_rounding: expected 'floor' or 'rceil', got "
                             f"{scale_rounding!r}")
        bs = f.default_block if block_size is None else int(block_size)
        f.check_block_size(bs)
        ts = tensor_scale if f.has_tensor_scale else None
        if ts is not None and not isinstance(ts, str):
            ts = float(ts)  # hashable: the spec is a static argument of jitted functions
        sd = None if scale_dtype is None else np.dtype(scale_dtype).name
        return cls(f.name, bs, ts, scale_rounding == "rceil" and f.has_scale_rounding, sd)

    @property
    def format(self) -> Format:
        return get_format(self.name)

    def row_tensor_scale(self, w_rows):
        """(R,) float32 per-row nvfp4 decode scale for the (R, K) weight, or None."""
        if self.format.family != "nvfp4" or self.tensor_scale is None:
            return None
        if isinstance(self.tensor_scale, str):
            ts = R.tensor_scale_from_amax(R.amax(w_rows))
        else:
            ts = jnp.asarray(self.tensor_scale, jnp.float32)
        return jnp.broadcast_to(ts, (w_rows.shape[0],))

    def scale_dtype_for(self, dtype):
        if self.format.family != "int4":
            return None
        return jnp.dtype(self.scale_dtype if self.scale_dtype is not None else dtype)


def to_rows(w, axis: int):
    """2-D weight -> (rows, K) float32 with the blocked (contraction) axis last."""
    w = jnp.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"w: expected a 2-D weight, got shape {tuple(w.shape)}")
    if axis not in (0, 1, -1, -2):
        raise ValueError(f"axis: expected 0 or 1, got {axis!r}")
    return (w.T if axis % 2 == 0 else w).astype(jnp.float32)


def make_qarray(codes, scales, zeros, row_ts, spec: QuantSpec, shape, axis, dtype) -> QArray:
    """A linear-layout 2-D QArray from (rows, K) FFI buffers, as :func:`jax_fp4.quantize`
    builds it."""
    f = spec.format
    data = codes
    if f.bits == 8:
        data = lax.bitcast_convert_type(data, f.elem.np_dtype)
    if f.minifloat_scales:
        scales = lax.bitcast_convert_type(scales, f.scale_dtype)
    ts = None if row_ts is None else row_ts[0]
    return QArray(data, scales, ts, zeros if f.has_zeros else None, format=f.name,
                  axis=axis % 2, shape=tuple(shape), dtype=np.dtype(dtype),
                  block_size=spec.block_size, scale_layout="linear")


def fast_qdq(x, spec: QuantSpec, scales, zeros=None, row_ts=None):
    """Quantize-dequantize float32 ``x`` with given block scales in plain float arithmetic.

    The search loops (MSE candidates, GPTQ's error feedback) need Q(x) for many scales;
    this computes the same nearest grid value as the reference encode/decode
    (:func:`jax_fp4.reference.encode_blocks`, ``decode_blocks``) with a float division
    instead of the reference's exact integer emulation, so it compiles and runs much
    faster. It may differ from the reference only where x / scale lands exactly on a
    rounding boundary or in the float32 subnormal range; the stored codes are always
    recomputed by the reference from the chosen scales.

    Args:
      x: (..., bs) float32 (broadcast against scales[..., None]).
      scales: (...) block scales in the reference's buffer dtype.
      zeros: int4: (...) uint8 zero points.
      row_ts: nvfp4 two-level: per-row decode scale broadcastable to scales.
    Returns:
      float32 array of x's shape.
    """
    f = spec.format
    x = x.astype(jnp.float32)
    if f.family in ("nvfp4", "mx"):
        table = jnp.asarray(R._table(f.elem))
        if f.family == "nvfp4":
            s = jnp.asarray(R._table(R.E4M3))[scales.astype(jnp.int32)]
            if row_ts is not None:
                s = s * row_ts
            v = x / s[..., None]
        else:
            s = jnp.exp2(scales.astype(jnp.float32) - 127.0)
            v = x * jnp.exp2(127.0 - scales.astype(jnp.float32))[..., None]
        c = R.encode(R._bits(jnp.where(jnp.isfinite(v), v, 0.0)), f.elem)
        return table[c.astype(jnp.int32)] * s[..., None]
    if f.family == "codebook":
        a = jnp.maximum(scales.astype(jnp.float32), jnp.float32(1e-38))
        c = R.bucketize(x / a[..., None], f.table)
        return jnp.asarray(f.table)[c.astype(jnp.int32)] * scales.astype(jnp.float32)[..., None]
    s = scales.astype(jnp.float32)[..., None]
    z = zeros.astype(jnp.float32)[..., None]
    q = jnp.clip(jnp.round(x / s) + z, 0, 15)
    return (q - z) * s
