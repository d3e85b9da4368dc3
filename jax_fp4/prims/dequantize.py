"""``dequantize_p``: the FFI buffers (codes, block scales, zero points, per-row tensor
scale) -> (R, K) values in float32 / bfloat16 / float16; the reference is
:func:`jax_fp4.reference.dequantize_2d`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from .. import reference
from ..formats import get_format
from ._common import _at_front, _attrs, _def_impl, _fold, _register_lowerings, _unfold

dequantize_p = Primitive("jax_fp4_dequantize")


def _dequantize_abstract(codes, scales, zeros, ts, *, fmt, block_size, k, dtype, two_level,
                         impl):
    return jax.core.ShapedArray((codes.shape[0], k), np.dtype(dtype))


def _dequantize_ref(codes, scales, zeros, ts, *, fmt, block_size, k, dtype, two_level, impl):
    return reference.dequantize_2d(codes, scales, zeros, fmt, block_size, k, dtype,
                                   tensor_scale=ts if two_level else None)


def _dequantize_batch(args, dims, **params):
    b = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    f = get_format(params["fmt"])
    folded = []
    for i, (a, d) in enumerate(zip(args, dims)):
        if i == 2 and not f.has_zeros:  # the empty zeros buffer stays (0,)
            folded.append(a if d is None else jnp.zeros((0,), jnp.uint8))
        else:
            folded.append(_fold(_at_front(a, d, b)))
    return _unfold(dequantize_p.bind(*folded, **params), b), 0


def _dequantize_jvp(primals, tangents, **params):
    """Dequantize is linear in float scales (nf4/bnb_fp4 absmax, int4 scales) and in the
    NVFP4 tensor scale; codes and zero points are integers (no tangent)."""
    codes, scales, zeros, ts = primals
    _, dscales, _, dts = tangents
    y = dequantize_p.bind(*primals, **params)
    f = get_format(params["fmt"])
    r, k, bs = codes.shape[0], params["k"], params["block_size"]
    unit_params = dict(params, dtype=np.dtype(np.float32))
    dy = jnp.zeros((r, k), jnp.float32)
    if not f.minifloat_scales and type(dscales) is not ad.Zero:
        unit = dequantize_p.bind(codes, jnp.ones_like(scales), zeros, ts, **unit_params)
        ds = dscales.astype(jnp.float32)[..., None]
        dy = dy + (unit.reshape(r, k // bs, bs) * ds).reshape(r, k)
    if f.has_tensor_scale and params["two_level"] and type(dts) is not ad.Zero:
        unit = dequantize_p.bind(codes, scales, zeros, jnp.ones_like(ts), **unit_params)
        dy = dy + unit * dts.astype(jnp.float32)[:, None]
    return y, dy.astype(y.dtype)


def _dequantize_ffi_attrs(*, fmt, block_size, two_level, **_):
    return _attrs(fmt, block_size, two_level=two_level)


_def_impl(dequantize_p)
dequantize_p.def_abstract_eval(_dequantize_abstract)
batching.primitive_batchers[dequantize_p] = _dequantize_batch
ad.primitive_jvps[dequantize_p] = _dequantize_jvp
_register_lowerings(dequantize_p, "jax_fp4_dequantize_v1", _dequantize_ref,
                    ffi_attrs=_dequantize_ffi_attrs)
