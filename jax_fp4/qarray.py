"""QArray: a quantized array as an immutable JAX pytree (docs/spec.md section 4)."""
from __future__ import annotations

import math
import jax
import numpy as np

from . import validate
from .formats import get_format

SCALE_LAYOUTS = validate.SCALE_LAYOUTS


class QArray:
    """A quantized array: packed codes plus block scales, with static format metadata.

    Children (arrays, traced through jit/vmap/grad):
      data: element codes with the blocked axis moved last. A logical (..., K) array
        blocked along ``axis`` is stored as (rest..., K*bits/8) uint8 (two 4-bit codes per
        byte, low nibble first; 6-bit codes as a little-endian bit stream), or as
        (rest..., K) float8_e4m3fn / float8_e5m2 for MXFP8.
      scales: one per block. ``scale_layout="linear"``: (rest..., K/block_size);
        ``"swizzled"``: the 2-D 128x4 tiled layout (ceil(rows/128)*32, ceil(nb/4)*16) with
        rows = prod(rest), as cuBLASLt/CUTLASS read it. ``"tiled"`` (made by
        :func:`jax_fp4.prepare` for 4-bit weights): data, scales and zeros keep their linear
        shapes, but the bytes of each 128-row x 128-k tile of the last two axes are stored
        contiguously, tile by tile (jax_fp4.layout.tile_rows), as the fused W4A16 kernel
        reads them. dtype float8_e4m3fn (nvfp4),
        float8_e8m0fnu (MX), float32 absmax (nf4, bnb_fp4), or bf16/f16/f32 (int4).
      tensor_scale: NVFP4 per-tensor decode scale (float32 scalar) or None.
      zeros: INT4 zero points, uint8 shaped like linear scales, or None.

    Static (aux data): format name, ``axis`` (blocked axis of the logical shape,
    non-negative), logical ``shape`` at creation, ``dtype`` (default dequantize dtype),
    ``block_size`` and ``scale_layout``.

    Construction and unflattening check the static fields and every array-like leaf
    (jax_fp4.validate.check_leaves): TypeError for a wrong dtype, ValueError for a wrong
    shape, an axis out of range, a block size the format does not allow, zero points or a
    tensor scale on a format without them, or a per-row tensor scale.

    Under ``vmap``/``scan`` the leaves lose leading axes; ``shape``/``axis`` are derived
    from ``data`` so a stacked QArray of L layers sliced by scan reads as one layer.
    """

    __slots__ = ("data", "scales", "tensor_scale", "zeros", "format", "_axis", "_shape",
                 "dtype", "block_size", "scale_layout")

    def __init__(self, data, scales, tensor_scale=None, zeros=None, *, format, dtype,
                 block_size, axis=None, shape=None, scale_layout="linear", _axis=None,
                 _shape=None):
        if _axis is not None:  # unflattening: the stored static fields, as flattened
            aux = (format, _axis, _shape, dtype, block_size, scale_layout)
            validate.check_aux(aux)
        elif axis is None or shape is None:
            raise TypeError("QArray: the keyword arguments `axis` and `shape` are required")
        else:
            aux = validate.normalize_aux(format, axis, shape, dtype, block_size, scale_layout)
        (self.format, self._axis, self._shape, self.dtype, self.block_size,
         self.scale_layout) = aux
        self.data, self.scales, self.tensor_scale, self.zeros = data, scales, tensor_scale, zeros
        self._check_leaves()

    # -- pytree (registered below with register_dataclass: flattened by jax's C++ pytree
    # code, not a Python callback, which a jitted call's dispatch pays per QArray) -------
    _DATA_FIELDS = ("data", "scales", "tensor_scale", "zeros")
    _META_FIELDS = ("format", "_axis", "_shape", "dtype", "block_size", "scale_layout")

    def tree_flatten(self):
        """(children, aux) as jax flattens a QArray."""
        return (tuple(getattr(self, f) for f in self._DATA_FIELDS),
                tuple(getattr(self, f) for f in self._META_FIELDS))

    @classmethod
    def tree_unflatten(cls, aux, children):
        """The inverse of :meth:`tree_flatten` (checks the fields and leaves)."""
        return cls(*children, **dict(zip(cls._META_FIELDS, aux)))

    def _check_leaves(self):
        validate.check_leaves(self.format, self._axis, self._shape, self.block_size,
                              self.scale_layout, self.data, self.scales, self.tensor_scale,
                              self.zeros)

    # -- shape ---------------------------------------------------------------------
    @property
    def fmt(self):
        return get_format(self.format)

    @property
    def _dropped(self) -> int:
        """Leading logical axes that vmap/scan have taken off the leaves."""
        data_ndim = getattr(self.data, "ndim", None)
        if data_ndim is None:  # leaves replaced by non-arrays (e.g. tree_map to specs)
            return 0
        return len(self._shape) - data_ndim

    @property
    def axis(self) -> int:
        """Blocked axis of the logical shape (non-negative)."""
        ax = self._axis - self._dropped
        if ax < 0:
            raise ValueError(
                "QArray: the blocked axis was mapped over (vmap/scan over the blocked axis "
                "is not supported); map over a non-blocked axis instead")
        return ax

    @property
    def shape(self) -> tuple:
        """Logical shape (what ``dequantize`` returns)."""
        d = self._dropped
        if d == 0:
            return self._shape
        ax = self.axis
        rest = tuple(self.data.shape[:-1])
        k = self._shape[self._axis]
        return rest[:ax] + (k,) + rest[ax:]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (data, scales, tensor scale, zero points)."""
        leaves = jax.tree_util.tree_leaves((self.data, self.scales, self.tensor_scale,
                                            self.zeros))
        return int(sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in leaves))

    def dequantize(self, dtype=None):
        """Decode to a dense array of ``dtype`` (default ``self.dtype``); see
        :func:`jax_fp4.dequantize`."""
        from ._rows import dequantize_qarray

        return dequantize_qarray(self, validate.float_dtype(self.dtype if dtype is None else dtype,
                                                            "dtype"))

    def __repr__(self):
        ts = "" if self.tensor_scale is None else ", tensor_scale"
        z = "" if self.zeros is None else ", zeros"
        return (f"QArray(format={self.format}, shape={self.shape}, axis={self._axis}, "
                f"dtype={self.dtype.name}, block_size={self.block_size}, "
                f"scale_layout={self.scale_layout}{ts}{z})")


def is_qarray(x) -> bool:
    return isinstance(x, QArray)


jax.tree_util.register_dataclass(QArray, data_fields=list(QArray._DATA_FIELDS),
                                 meta_fields=list(QArray._META_FIELDS))
