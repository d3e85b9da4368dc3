"""``quantize_p``: x (R, K) -> packed element codes, block scales and INT4 zero points (the
FFI buffers of csrc/README.md); the reference is :func:`jax_fp4.reference.quantize_2d`."""
from __future__ import annotations

import jax
from jax.extend.core import Primitive
from jax.interpreters import batching
import numpy as np

from .. import layout, reference
from ..formats import get_format
from ._common import _at_front, _attrs, _def_impl, _fold, _register_lowerings, _unfold

quantize_p = Primitive("jax_fp4_quantize")
quantize_p.multiple_results = True


def _quantize_abstract(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, swizzled,
                       impl):
    f = get_format(fmt)
    r, k = x.shape
    nb = k // block_size
    codes = jax.core.ShapedArray((r, k * f.bits // 8), np.uint8)
    scales = jax.core.ShapedArray(layout.swizzled_shape(r, nb) if swizzled else (r, nb),
                                  f.scale_buffer_dtype(scale_dtype))
    zeros = jax.core.ShapedArray((r, nb) if f.has_zeros else (0,), np.uint8)
    return codes, scales, zeros


def _swizzle(scales):
    """(R, nb) linear scales -> the 2-D 128x4 layout (layout.swizzled_shape)."""
    return layout.to_blocked(scales).reshape(layout.swizzled_shape(*scales.shape))


def _quantize_ref(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, swizzled, impl):
    codes, scales, zeros = reference.quantize_2d(
        x, fmt, block_size, tensor_scale=ts if two_level else None, rceil=rceil,
        scale_dtype=scale_dtype)
    return codes, _swizzle(scales) if swizzled else scales, zeros


def _quantize_batch(args, dims, *, swizzled, **params):
    """Rows of all batch members go to one call; swizzled scales are tiled per member."""
    x, ts = args
    b = x.shape[dims[0]] if dims[0] is not None else ts.shape[dims[1]]
    x, ts = _at_front(x, dims[0], b), _at_front(ts, dims[1], b)
    outs = [_unfold(o, b) for o in
            quantize_p.bind(_fold(x), _fold(ts), swizzled=False, **params)]
    if swizzled:
        outs[1] = jax.vmap(_swizzle)(outs[1])
    return outs, [0, 0, 0]


def _quantize_ffi_attrs(*, fmt, block_size, rceil, two_level, swizzled=False, **_):
    return _attrs(fmt, block_size, rceil=rceil, two_level=two_level, swizzled=swizzled)


_def_impl(quantize_p)
quantize_p.def_abstract_eval(_quantize_abstract)
batching.primitive_batchers[quantize_p] = _quantize_batch
_register_lowerings(quantize_p, "jax_fp4_quantize_v2", _quantize_ref,
                    ffi_attrs=_quantize_ffi_attrs, multiple_results=True)
