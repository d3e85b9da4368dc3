"""``wmatmul_group_p``: several W4A16 matmuls of one activation, y_i (M, N_i) = x (M, K) @
W_i (N_i, K)^T -- the q / k / v or gate / up projections of a layer -- as one call, each
y_i as :mod:`.wmatmul` defines it (the W4A16 tolerance of the exact sum, docs/spec.md
section 5). Bound by :func:`jax_fp4.group_matmuls`, which finds such calls in a traced
function; differentiable in x.

Operands: x, then codes, scales, zeros, ts of each weight; parameters: those of
``wmatmul_p``, shared by every weight (one format, block size, layout and output dtype).

Lowering: on CUDA one launch of the fused kernel reads the weights as one weight of their
rows together where the kernel can (the prepared layout on sm_90a, at most 4 weights:
:func:`jax_fp4.prims.wmatmul.fused_launches`), so a decode step pays one kernel start-up
and one graph node instead of one per weight; otherwise, and on other platforms, each
weight lowers as ``wmatmul_p`` does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from . import _gpu
from ._common import _at_front, _def_impl, _fold, _register_lowerings, _unfold
from .wmatmul import (_FUSED_TARGET, _wmatmul_kernels, _wmatmul_ref, fused_launches,
                      fused_wmatmul_applies, x_cotangent)

wmatmul_group_p = Primitive("jax_fp4_weight_matmul_group")
wmatmul_group_p.multiple_results = True


def weights_of(operands):
    """The (codes, scales, zeros, ts) of each weight from the operands after x."""
    return [tuple(operands[i:i + 4]) for i in range(0, len(operands), 4)]


def _abstract(x, *weights, out_dtype, **_):
    return [jax.core.ShapedArray((x.shape[0], w[0].shape[0]), jnp.dtype(out_dtype))
            for w in weights_of(weights)]


def _each(single, x, *weights, **params):
    """Each weight through ``single`` (a one-weight implementation of wmatmul_p)."""
    return [single(x, *w, **params) for w in weights_of(weights)]


def _applies(avals_in, params, gpu):
    x = avals_in[0]
    return all(fused_wmatmul_applies((x, *w), params, gpu) for w in weights_of(avals_in[1:]))


def _fused(x, *weights, fmt, block_size, two_level, out_dtype, precision, tiled, impl,
           gpu=None):
    return fused_launches(x, weights_of(weights), fmt=fmt, block_size=block_size,
                          two_level=two_level, out_dtype=out_dtype, tiled=tiled,
                          gpu=gpu or _gpu.gpu_props())


def _batch(args, dims, **params):
    if all(d is None for d in dims[1:]):  # only activations batched: fold into M
        b = args[0].shape[dims[0]]
        x = _fold(_at_front(args[0], dims[0], b))
        return [_unfold(y, b) for y in wmatmul_group_p.bind(x, *args[1:], **params)], [0] * (
            (len(args) - 1) // 4)
    fn = functools.partial(_each, _wmatmul_kernels, **params)
    outs = jax.vmap(fn, in_axes=dims)(*args)
    return outs, [0] * len(outs)


def _jvp(primals, tangents, **params):
    """Linear in x; the weights' tangents are not followed (as wmatmul_p's JVP)."""
    outs = wmatmul_group_p.bind(*primals, **params)
    if type(tangents[0]) is ad.Zero:
        return outs, [ad.Zero.from_primal_value(y) for y in outs]
    return outs, wmatmul_group_p.bind(tangents[0], *primals[1:], **params)


def _transpose(cts, x, *weights, **params):
    """Linear in x: x_bar = sum_i y_i_bar @ W_i (each as wmatmul_p's transpose), summed in
    float32 and rounded once to x's dtype."""
    parts = [x_cotangent(ct, x, *w, **params) for ct, w in zip(cts, weights_of(weights))
             if type(ct) is not ad.Zero]
    x_bar = functools.reduce(jnp.add, parts).astype(x.aval.dtype) if parts else None
    return [x_bar] + [None] * len(weights)


_def_impl(wmatmul_group_p)
wmatmul_group_p.def_abstract_eval(_abstract)
batching.primitive_batchers[wmatmul_group_p] = _batch
ad.primitive_jvps[wmatmul_group_p] = _jvp
ad.primitive_transposes[wmatmul_group_p] = _transpose
_register_lowerings(wmatmul_group_p, None, functools.partial(_each, _wmatmul_ref),
                    kernel_impl=functools.partial(_each, _wmatmul_kernels),
                    multiple_results=True, cuda_impl=(_FUSED_TARGET, _applies, _fused))
