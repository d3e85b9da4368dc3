"""The canonical (rows, K) view of arrays and QArrays that the primitives work on
(csrc/README.md): the blocked axis last, the other axes flattened row-major; and the
decode of a QArray through it. Used by :mod:`jax_fp4.ops` and by ``QArray.dequantize``
(so that :mod:`jax_fp4.qarray` needs no import of :mod:`jax_fp4.ops`)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from . import layout
from .prims._common import get_backend
from .prims.dequantize import dequantize_p


def _to_rows(x, axis):
    """Logical array -> (rows, K) with the blocked axis last, plus the moved shape."""
    xm = jnp.moveaxis(x, axis, -1)
    rest = xm.shape[:-1]
    return xm.reshape(math.prod(rest), xm.shape[-1]), rest


def _from_rows(y, rest, axis):
    return jnp.moveaxis(y.reshape(rest + (y.shape[-1],)), -1, axis)


def _row_ts(ts, rows):
    return jnp.zeros((rows,), jnp.float32) if ts is None else jnp.broadcast_to(ts, (rows,))


def _qarray_rows(q, keep_tiled=False):
    """QArray -> canonical buffers (codes, scales, zeros, ts rows) + (rest, K).

    keep_tiled: leave the codes and scales of a "tiled" QArray in that layout (for the
    fused kernel), else they come back linear."""
    f = q.fmt
    data = q.data
    if data.dtype != jnp.uint8:
        data = lax.bitcast_convert_type(data, jnp.uint8)
    rest = tuple(data.shape[:-1])
    rows = math.prod(rest)
    k = q.shape[q.axis]
    nb = k // q.block_size
    scales, zeros = q.scales, q.zeros
    if q.scale_layout == "tiled" and not keep_tiled:
        data, scales, zeros = layout.untile_weight(data, scales, zeros, q.block_size)
    codes = data.reshape(rows, data.shape[-1])
    if q.scale_layout == "swizzled":
        if q._dropped:
            raise ValueError("q: swizzled scales cannot be vmapped/scanned; use "
                             "scale_layout='linear' for stacked QArrays")
        scales = layout.from_blocked(scales, (rows, nb))
    else:
        scales = scales.reshape(rows, nb)
    if f.minifloat_scales:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)
    zeros = (zeros.reshape(rows, nb) if f.has_zeros
             else jnp.zeros((0,), jnp.uint8))
    ts = q.tensor_scale
    ts_rows = _row_ts(None if ts is None else jnp.asarray(ts, jnp.float32), rows)
    return (codes, scales, zeros, ts_rows), rest, k


def dequantize_qarray(q, dtype):
    """A QArray's values as a dense array of float ``dtype`` (already validated), through
    the dequantize primitive on the canonical view (:func:`jax_fp4.dequantize`)."""
    bufs, rest, k = _qarray_rows(q)
    y = dequantize_p.bind(
        *bufs, fmt=q.format, block_size=q.block_size, k=k, dtype=dtype,
        two_level=q.tensor_scale is not None, impl=get_backend())
    return _from_rows(y, rest, q.axis)
