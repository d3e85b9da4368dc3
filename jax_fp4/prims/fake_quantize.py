"""``fake_quantize_p``: QDQ, dequantize(quantize(x)) in x's dtype, with a straight-through
estimator (:func:`ste_mask`); the reference is :func:`jax_fp4.reference.fake_quantize_2d`."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from .. import reference
from ..formats import get_format
from ._common import _at_front, _attrs, _def_impl, _fold, _register_lowerings, _unfold
from .quantize import quantize_p

fake_quantize_p = Primitive("jax_fp4_fake_quantize")


def _fake_quantize_ref(x, ts, *, fmt, block_size, rceil, two_level, scale_dtype, impl,
                       ste="identity"):
    return reference.fake_quantize_2d(x, fmt, block_size, rceil=rceil, scale_dtype=scale_dtype,
                                      tensor_scale=ts if two_level else None)


def _fake_quantize_batch(args, dims, **params):
    x, ts = args
    b = x.shape[dims[0]] if dims[0] is not None else ts.shape[dims[1]]
    x, ts = _at_front(x, dims[0], b), _at_front(ts, dims[1], b)
    return _unfold(fake_quantize_p.bind(_fold(x), _fold(ts), **params), b), 0


def _fake_quantize_ffi_attrs(*, fmt, block_size, rceil, two_level, **_):
    return _attrs(fmt, block_size, rceil=rceil, two_level=two_level)


def ste_mask(x, ts, *, ste="identity", **params):
    """Where the straight-through estimator passes the gradient.

    ste="identity" (default; torchao / TransformerEngine): wherever x is finite.
    ste="clipped": finite x inside the representable range of its block,
    |x| <= max_elem * block scale (* tensor scale); codebook and INT4 blocks cover their own
    range, so there too only non-finite x is cut."""
    f = get_format(params["fmt"])
    xf = x.astype(jnp.float32)
    if ste == "identity" or not f.minifloat_scales:
        return jnp.isfinite(xf)
    _, scales, _ = quantize_p.bind(x, ts, swizzled=False, **params)
    r, k = x.shape
    bs = params["block_size"]
    s = lax.bitcast_convert_type(scales, f.scale_bits_dtype).astype(jnp.float32)
    if f.has_tensor_scale and params["two_level"]:
        s = s * ts[:, None]
    limit = jnp.float32(f.elem.max_value) * s
    ok = jnp.abs(xf).reshape(r, k // bs, bs) <= limit[..., None]
    return ok.reshape(r, k)


def _fake_quantize_jvp(primals, tangents, **params):
    x, ts = primals
    dx, _ = tangents
    y = fake_quantize_p.bind(x, ts, **params)
    if type(dx) is ad.Zero:
        return y, jnp.zeros_like(y)
    return y, jnp.where(ste_mask(x, ts, **params), dx, jnp.zeros_like(dx))


_def_impl(fake_quantize_p)
fake_quantize_p.def_abstract_eval(lambda x, ts, **_: jax.core.ShapedArray(x.shape, x.dtype))
batching.primitive_batchers[fake_quantize_p] = _fake_quantize_batch
ad.primitive_jvps[fake_quantize_p] = _fake_quantize_jvp
_register_lowerings(fake_quantize_p, "jax_fp4_fake_quantize_v1", _fake_quantize_ref,
                    ffi_attrs=_fake_quantize_ffi_attrs, fixed_scale_dtype=True)
