"""``wmatmul_p``: the W4A16 matmul y (M, N) = x (M, K) @ W (N, K)^T of a 16-bit activation
and a quantized weight, within the W4A16 tolerance of the exact sum (docs/spec.md section
5). Differentiable in x (transpose: through the dequantized weight).

Lowering: on CUDA the fused kernel (csrc/cuda/wmatmul/, FFI target jax_fp4_wmatmul_v3)
as :func:`jax_fp4.prims._launch_plan.wmatmul_plan` plans it for the target GPU, where it
covers the call (:func:`fused_launches`, which also serves the grouped call of
:mod:`.wmatmul_group`); elsewhere (and beyond its size limits) dequantize + XLA's dot.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

from .. import layout, partitioning
from . import _gpu, _launch_plan
from ._common import _at_front, _attrs, _def_impl, _fold, _register_lowerings, _unfold
from .dequantize import _dequantize_ref, dequantize_p

wmatmul_p = Primitive("jax_fp4_weight_matmul")


def _wmatmul_abstract(x, codes, scales, zeros, ts, *, out_dtype, **_):
    return jax.core.ShapedArray((x.shape[0], codes.shape[0]), np.dtype(out_dtype))


def _untiled(codes, scales, zeros, block_size, tiled):
    """The linear layout of a weight's codes, scales and zero points given in the prepared
    ("tiled") layout of jax_fp4.prepare (jax_fp4.layout.tile_rows), or them as they are."""
    return layout.untile_weight(codes, scales, zeros, block_size) if tiled else (codes, scales, zeros)


def _wmatmul_compose(dequantize, x, codes, scales, zeros, ts, *, fmt, block_size, two_level,
                     out_dtype, precision, tiled, impl):
    """y (M, N) = x (M, K) @ W(N, K)^T: W decoded in float32, rounded to x.dtype (the
    compute dtype of a W4A16 kernel), products accumulated in float32. `tiled`: the codes,
    scales and zero points come in the prepared layout (jax_fp4.prepare). ts: the
    per-tensor scale per weight row (N,) or one for all (1,)."""
    codes, scales, zeros = _untiled(codes, scales, zeros, block_size, tiled)
    ts = jnp.broadcast_to(ts, (codes.shape[0],))
    w = dequantize(codes, scales, zeros, ts, fmt=fmt, block_size=block_size, k=x.shape[1],
                   dtype=x.dtype, two_level=two_level, impl=impl)
    y = lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


_wmatmul_ref = functools.partial(_wmatmul_compose, _dequantize_ref)
_wmatmul_kernels = functools.partial(_wmatmul_compose, dequantize_p.bind)


def _wmatmul_batch(args, dims, **params):
    if all(d is None for d in dims[1:]):  # only activations batched: fold into M
        b = args[0].shape[dims[0]]
        x = _fold(_at_front(args[0], dims[0], b))
        return _unfold(wmatmul_p.bind(x, *args[1:], **params), b), 0
    fn = functools.partial(_wmatmul_kernels, **params)
    return jax.vmap(fn, in_axes=dims)(*args), 0


def _wmatmul_transpose(ct, x, codes, scales, zeros, ts, **params):
    """Linear in x: x_bar = y_bar @ W (through the dequantized weight)."""
    if type(ct) is ad.Zero:
        _check_transposable(x, codes, scales, zeros, ts)
        return [None] * 5
    return [x_cotangent(ct, x, codes, scales, zeros, ts, **params).astype(x.aval.dtype),
            None, None, None, None]


def _check_transposable(x, *weight):
    if not ad.is_undefined_primal(x) or any(ad.is_undefined_primal(a) for a in weight):
        raise NotImplementedError("jax_fp4 matmul differentiates w.r.t. the activations only")


def x_cotangent(ct, x, codes, scales, zeros, ts, **params):
    """y_bar (M, N) @ W (N, K) in float32 (W dequantized to x's dtype): x's cotangent
    before its cast to x's dtype. x: the undefined primal (its aval gives K and dtype)."""
    _check_transposable(x, codes, scales, zeros, ts)
    codes, scales, zeros = _untiled(codes, scales, zeros, params["block_size"], params["tiled"])
    ts = jnp.broadcast_to(ts, (codes.shape[0],))
    w = dequantize_p.bind(codes, scales, zeros, ts, fmt=params["fmt"],
                          block_size=params["block_size"], k=x.aval.shape[1],
                          dtype=x.aval.dtype, two_level=params["two_level"],
                          impl=params["impl"])
    ctx = lax.dot_general(ct.astype(x.aval.dtype), w, (((1,), (0,)), ((), ())),
                          precision=params["precision"], preferred_element_type=jnp.float32,
                          out_sharding=partitioning.explicit_sharding(x.aval))
    return ctx


# The table path's x permutation moves 32-bit pairs of elements where x needs no padding
# or has at least this many elements (padded), else bf16 elements: XLA moves pairs as
# words several times faster, except for tiny padded x, where the bitcasts cost more.
_X_PAIRS_MIN_SIZE = 1 << 19


def wmatmul_x_layout(x, bit_path, tile_m=1):
    """x (M, K) -> (M', K128) as the wgmma kernel stages it: K zero-padded to a multiple of
    128 and permuted within each 128-k block into the k order of the kernel's A fragments
    (csrc/cuda/wmatmul/wgmma_kernel.cuh); M' = M rounded up to a multiple of `tile_m`
    with zero rows, so that no activation box of the tensor memory accelerator reaches past
    x's rows (boxes partly out of bounds made the kernel markedly slower at tile_m >= 64).
    Block position 32 s2 + 16 hh + 8 sec + 2 tt + e holds element 32 tt + 8 s2 + 4 e +
    2 hh + sec (bit path: a register pairs elements p, p + 4 of a code word) or 32 tt +
    8 s2 + 4 hh + 2 sec + e (table path: elements 2 i, 2 i + 1); tt is the lane's k
    quarter, s2 the code word, hh / sec the two MMA steps a word feeds and the two pairs
    of each. The table path's permutation moves each pair e as one 32-bit word where that
    is faster (_X_PAIRS_MIN_SIZE): the same result."""
    m, k = x.shape
    kp = -(-k // 128) * 128
    mp = -(-m // tile_m) * tile_m
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if bit_path:  # (tt, s2, e, hh, sec) -> (s2, hh, sec, tt, e)
        x = x.reshape(mp, kp // 128, 4, 4, 2, 2, 2).transpose(0, 1, 3, 5, 6, 2, 4)
    elif (mp, kp) == (m, k) or mp * kp >= _X_PAIRS_MIN_SIZE:
        # (tt, s2, hh, sec) -> (s2, hh, sec, tt) of 32-bit words: each pair e stays
        # together, so XLA moves words (_X_PAIRS_MIN_SIZE)
        w = lax.bitcast_convert_type(x.reshape(mp, kp // 2, 2), jnp.uint32)
        w = w.reshape(mp, kp // 128, 4, 4, 2, 2).transpose(0, 1, 3, 4, 5, 2)
        x = lax.bitcast_convert_type(w.reshape(mp, kp // 2), x.dtype)
    else:  # (tt, s2, hh, sec, e) -> (s2, hh, sec, tt, e)
        x = x.reshape(mp, kp // 128, 4, 4, 2, 2, 2).transpose(0, 1, 3, 4, 5, 2, 6)
    return x.reshape(mp, kp)


_FUSED_TARGET = "jax_fp4_wmatmul_v3"
# Most weights one launch reads (kMaxMembers, csrc/cuda/wmatmul/launch.h).
_MAX_GROUP = 4


def _plan(avals_in, params, gpu, n=None):
    """The launch plan of x (avals_in[0]) with the weight avals_in[1:4] (n: its rows, or
    the rows of the weights of a grouped call, :func:`fused_launches`)."""
    x, codes, scales = avals_in[0], avals_in[1], avals_in[2]
    return _launch_plan.wmatmul_plan(
        x.shape[0], codes.shape[0] if n is None else n, x.shape[1], fmt=params["fmt"],
        block_size=params["block_size"], x_dtype=x.dtype, scale_dtype=scales.dtype,
        out_dtype=params.get("out_dtype", x.dtype), two_level=params["two_level"], tiled=params["tiled"],
        gpu=gpu)


def fused_wmatmul_applies(avals_in, params, gpu=None):
    """Whether the fused kernel covers this call (:func:`_launch_plan.wmatmul_applies`).

    avals_in: the primitive's operand avals (x (M, K), codes (N, K / 2) uint8, scales,
    ...); params: its parameters (fmt, block_size, two_level, tiled, out_dtype); gpu: the
    target's GpuProps (default the default GPU's). Returns a bool, raises nothing."""
    return _plan(avals_in, params, gpu or _gpu.gpu_props()) is not None


def fused_launches(x, weights, *, fmt, block_size, two_level, out_dtype, tiled, gpu):
    """y_i = x @ W_i^T for each weight W_i = (codes, scales, zeros, ts) of `weights`, by the
    fused kernel (each call covered: :func:`fused_wmatmul_applies`). Several weights run
    as one launch per planned row range where the kernel can read them as one weight of
    their rows together (WMembers, csrc/cuda/wmatmul/launch.h: the wgmma kernel on weights
    in the prepared layout, at most 4, one CTA per cluster); else each weight on its own.
    Each launch writes y's rows in x's dtype (or float32) itself where it has one K-split,
    else leaves float32 partial sums that XLA adds and casts. A prepared weight the planned
    kernel does not read is restored to the linear layout first. Returns the list of y_i."""
    params = dict(fmt=fmt, block_size=block_size, two_level=two_level, out_dtype=out_dtype,
                  tiled=tiled)
    ns = [w[0].shape[0] for w in weights]
    plan = _plan((x, *weights[0][:2]), params, gpu, n=sum(ns))
    if len(weights) > 1 and not (plan is not None and plan.tiled and len(weights) <= _MAX_GROUP
                                 and all(ln.tile_m and ln.cluster == 1 for ln in plan.launches)):
        return [y for w in weights for y in fused_launches(
            x, [w], fmt=fmt, block_size=block_size, two_level=two_level,
            out_dtype=out_dtype, tiled=tiled, gpu=gpu)]
    if plan.untile:
        weights = [(*_untiled(*w[:3], block_size, tiled), w[3]) for w in weights]
    if len({w[3].shape[0] > 1 for w in weights}) > 1:  # one form of ts for all (ffi.cu)
        weights = [(*w[:3], jnp.broadcast_to(w[3], (n,))) for w, n in zip(weights, ns)]
    buffers = [b for w in weights for b in w]

    def launch(xs, ln):
        if ln.tile_m:
            xs = wmatmul_x_layout(xs, ln.bit_path, ln.tile_m)
        part = jax.ffi.ffi_call(
            _FUSED_TARGET,
            jax.ShapeDtypeStruct((ln.splits, ln.rows, sum(ns)),
                                 out_dtype if ln.final else jnp.float32))(
            xs, *buffers, **_attrs(fmt, block_size, two_level=two_level),
            splits=np.int64(ln.splits), tile_m=np.int64(ln.tile_m),
            cluster=np.int64(ln.cluster), tiled=np.int32(plan.tiled))
        return part[0] if ln.final else part.sum(0).astype(out_dtype)

    if len(plan.launches) == 1:
        y = launch(x, plan.launches[0])
    else:
        y = jnp.concatenate([launch(x[ln.row0:ln.row0 + ln.rows], ln)
                             for ln in plan.launches], axis=0)
    if len(ns) == 1:
        return [y]
    ends = np.cumsum(ns)
    return [y[:, e - n:e] for e, n in zip(ends, ns)]


def _wmatmul_fused(x, codes, scales, zeros, ts, *, fmt, block_size, two_level, out_dtype,
                   precision, tiled, impl, gpu=None):
    """The fused kernel's launches of the plan (:func:`fused_launches` of one weight)."""
    return fused_launches(x, [(codes, scales, zeros, ts)], fmt=fmt, block_size=block_size,
                          two_level=two_level, out_dtype=out_dtype, tiled=tiled,
                          gpu=gpu or _gpu.gpu_props())[0]


def prepared_layout_native() -> bool:
    """Whether the default GPU's fused kernel reads a weight in the prepared layout
    (jax_fp4.prepare) as it is, so that storing weights prepared pays: the wgmma kernel
    (an sm_90 GPU and a build for sm_90a). Elsewhere a prepared weight is restored to the
    linear layout on every call."""
    return _gpu.wgmma_available()


_def_impl(wmatmul_p)
wmatmul_p.def_abstract_eval(_wmatmul_abstract)
batching.primitive_batchers[wmatmul_p] = _wmatmul_batch
ad.defjvp(wmatmul_p, lambda g, x, *w, **p: wmatmul_p.bind(g, *w, **p), None, None, None, None)
ad.primitive_transposes[wmatmul_p] = _wmatmul_transpose
_register_lowerings(wmatmul_p, None, _wmatmul_ref, kernel_impl=_wmatmul_kernels,
                    cuda_impl=(_FUSED_TARGET, fused_wmatmul_applies, _wmatmul_fused))
