"""Stochastic rounding (SR): the ``jax_fp4_quantize_sr`` primitive and the key -> bits rule.

Quantize with stochastic rounding of the elements (block scales are chosen exactly as with
round-to-nearest): an element between two neighbours of its scaled grid rounds up with
probability equal to its position between them, so the quantized value is an unbiased
estimate of x (E[dequantize(quantize(x))] = x for x inside the block's range; saturated
elements clamp as always). Used for gradients and optimizer states in low-precision
training (Gupta et al. 2015; the OCP MX spec and NVIDIA Transformer Engine's NVFP4 recipe
round gradients stochastically).

Random bits (the contract kernels reproduce): the caller's PRNG key draws
``jax.random.bits(key, (R, K), jnp.uint32)`` for the canonical (rows, K) view (the blocked
axis moved last, other axes flattened row-major, as :mod:`jax_fp4.ops` lays every tensor
out), and element (r, k) uses bits[r, k]. Each kernel takes these bits as an operand, so
for a given key every backend produces the same codes; the rounding rule from the bits is
:func:`jax_fp4.reference.quantize_2d` (``rand``).

Lowering: a CPU / CUDA FFI target ``jax_fp4_quantize_sr_v1`` where the extension has one,
else the reference (:func:`jax_fp4.prims._common._register_lowerings`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from . import reference
from .prims import fake_quantize as _fq, quantize as _q
from .prims._common import _at_front, _attrs, _def_impl, _fold, _register_lowerings, _unfold
from .prims.dequantize import dequantize_p

__all__ = ["quantize_sr_p", "random_bits"]

quantize_sr_p = Primitive("jax_fp4_quantize_sr")
quantize_sr_p.multiple_results = True


def random_bits(key, rows: int, k: int):
    """The (rows, K) uint32 bits of the SR contract (module docstring) for ``key``.

    Raises: TypeError when key is not a PRNG key array (new-style or raw uint32)."""
    if key is None:
        raise TypeError("key: rounding='stochastic' needs a PRNG key (jax.random.key(...)), "
                        "got None")
    try:
        return jax.random.bits(key, (rows, k), jnp.uint32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"key: expected a PRNG key, got {key!r} ({e})") from None


def _abstract(x, ts, rand, *, swizzled=False, **params):
    return _q._quantize_abstract(x, ts, swizzled=False, **params)


def _ref(x, ts, rand, *, fmt, block_size, rceil, two_level, scale_dtype, impl):
    return reference.quantize_2d(x, fmt, block_size, tensor_scale=ts if two_level else None,
                                 rceil=rceil, scale_dtype=scale_dtype, rand=rand)


def _batch(args, dims, **params):
    x, ts, rand = args
    b = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    folded = [_fold(_at_front(a, d, b)) for a, d in zip(args, dims)]
    return [_unfold(o, b) for o in quantize_sr_p.bind(*folded, **params)], [0, 0, 0]


def _ffi_attrs(*, fmt, block_size, rceil, two_level, **_):
    return _attrs(fmt, block_size, rceil=rceil, two_level=two_level)


_def_impl(quantize_sr_p)
quantize_sr_p.def_abstract_eval(_abstract)
batching.primitive_batchers[quantize_sr_p] = _batch
_register_lowerings(quantize_sr_p, "jax_fp4_quantize_sr_v1", _ref,
                               ffi_attrs=_ffi_attrs, multiple_results=True)


def fake_quantize_sr(x2, ts_rows, rand, *, dequant_params, ste, **params):
    """QDQ of the canonical view with stochastic rounding; gradient: the STE of
    :func:`jax_fp4.fake_quantize` (identity where x is finite, or ``ste="clipped"``)."""

    @jax.custom_jvp
    def qdq(x):
        codes, scales, zeros = quantize_sr_p.bind(x, ts_rows, rand, **params)
        return dequantize_p.bind(codes, scales, zeros, ts_rows, **dequant_params)

    @qdq.defjvp
    def _jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        mask = _fq.ste_mask(x, ts_rows, ste=ste, **params)
        return qdq(x), jnp.where(mask, dx, jnp.zeros_like(dx))

    return qdq(x2)
