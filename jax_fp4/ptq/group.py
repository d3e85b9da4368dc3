"""One jitted, vmapped call that quantizes weights of one shape with a method (RTN, MSE
block scales, GPTQ, AWQ's activation-weighted scales), and the single-weight entry points
built on it (:func:`quantize_mse`, :func:`gptq_quantize`). The driver over a model's
kernels is :mod:`jax_fp4.ptq.api`; the methods' arithmetic is in :mod:`jax_fp4.ptq.mse`
and :mod:`jax_fp4.ptq.gptq`."""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import reference as R
from ._common import QuantSpec, make_qarray, to_rows
from .calibration import LayerStats
from .gptq import SCALE_SEARCHES, gptq_rows
from .mse import mse_block_scales

__all__ = ["quantize_group", "quantize_mse", "gptq_quantize"]


def quantize_group(ws, axis: int, spec: QuantSpec, method: str, stats=None, *,
                   damp: float = 0.01, act_order: bool = False,
                   scale_search: str = "mse") -> list:
    """Quantize weights of one shape with ``method``, all in one jitted, vmapped call.

    Args:
      ws: list of 2-D float weights of one shape; axis: their contraction axis.
      spec: the format. method: "rtn", "mse" (MSE block scales), "gptq", or "awq" (MSE
        block scales with each input channel's error weighted by its mean square, diag H:
        AWQ's activation-aware clipping; the channel scaling itself is done by the caller).
      stats: list of :class:`LayerStats` (one per weight) for "gptq" / "awq".
      damp, act_order, scale_search: GPTQ options (:mod:`jax_fp4.ptq.gptq`).
    Returns:
      list of QArrays (linear layout), each of its weight's shape and dtype.
    Raises:
      ValueError: another method (awq+gptq is AWQ's folding by the caller, then "gptq").
    """
    from ..ops import quantize

    if method not in ("rtn", "mse", "gptq", "awq"):
        raise ValueError(f"method: expected 'rtn', 'mse', 'gptq' or 'awq' for one group of "
                         f"weights, got {method!r}")
    ws = [jnp.asarray(w) for w in ws]
    ws = [w.astype(jnp.float32) if w.dtype == jnp.float64 else w for w in ws]
    if method == "rtn":
        kw = {"tensor_scale": spec.tensor_scale} if spec.format.has_tensor_scale else {}
        if spec.rceil:
            kw["scale_rounding"] = "rceil"
        if spec.scale_dtype is not None:
            kw["scale_dtype"] = spec.scale_dtype
        return [quantize(w, spec.name, axis=axis, block_size=spec.block_size, **kw)
                for w in ws]
    if method in ("gptq", "awq") and stats is None:
        if method == "gptq":
            raise ValueError("calibration: GPTQ needs the input statistics of every "
                             "quantized layer")
        method = "mse"
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale_search: expected one of {SCALE_SEARCHES}, got "
                         f"{scale_search!r}")
    shape, dtype = tuple(ws[0].shape), np.dtype(ws[0].dtype)
    rows = jnp.stack([to_rows(w, axis) for w in ws])
    k = rows.shape[-1]
    spec.format.check_block_size(spec.block_size, k)
    hess = None
    if method in ("gptq", "awq"):
        for st in stats:
            if st.hessian.shape != (k, k):
                raise ValueError(f"calibration: Hessian of shape {tuple(st.hessian.shape)} "
                                 f"for a weight whose contraction axis has length {k}")
        hess = jnp.stack([jnp.asarray(st.hessian, jnp.float32) for st in stats])
    if method == "gptq" and not (np.isfinite(np.asarray(rows)).all()
                                 and np.isfinite(np.asarray(hess)).all()):
        raise ValueError("w, hessian: GPTQ needs finite weights and a finite Hessian")
    codes, sc, zs, ts = _buffers(rows, hess, spec=spec, method=method, damp=float(damp),
                                 act_order=bool(act_order), scale_search=scale_search,
                                 sd=spec.scale_dtype_for(dtype))
    return [make_qarray(codes[i], sc[i], zs[i], None if ts is None else ts[i], spec, shape,
                        axis, dtype) for i in range(len(ws))]


@jax.jit(static_argnames=("spec", "method", "damp", "act_order", "scale_search", "sd"))
def _buffers(rows, hess, *, spec, method, damp, act_order, scale_search, sd):
    """(L, N, K) weights [and (L, K, K) Hessians] -> stacked FFI buffers and row scales."""
    def one(w, h):
        row_ts = spec.row_tensor_scale(w)
        if method == "gptq":
            wq, scales, zeros = gptq_rows(w, h, spec, damp=damp, act_order=act_order,
                                          scale_search=scale_search, row_ts=row_ts,
                                          scale_dtype=sd)
        else:
            weight = None if h is None else jnp.diag(h)
            scales, zeros = mse_block_scales(w, spec, row_ts, weight, sd)
            wq = w
        codes, sc, zs = R.quantize_2d_with_scales(wq, spec.format, spec.block_size, scales,
                                                  zeros, tensor_scale=row_ts)
        return codes, sc, zs, row_ts

    return jax.vmap(one)(rows, hess)


def quantize_mse(w, format="nvfp4", *, axis: int = 0, block_size: Optional[int] = None,
                 tensor_scale="auto", scale_rounding: str = "floor", scale_dtype=None,
                 weight=None):
    """Quantize a 2-D weight with MSE-optimal block scales (jax_fp4.ptq.mse).

    Args:
      w: 2-D float32 / bfloat16 / float16 weight, blocked along ``axis`` (0: Flax (in,
        out) kernel; 1: PyTorch (out, in) weight).
      format, block_size, tensor_scale, scale_rounding, scale_dtype: as
        :func:`jax_fp4.quantize` (tensor_scale "auto" is two-level NVFP4).
      weight: optional (K,) per-input-channel error weight (see :func:`mse_block_scales`).
    Returns:
      a QArray of w's shape and dtype, linear scale layout; its error is never above
      RTN's (RTN is a candidate), weighted as asked.
    Raises:
      ValueError / TypeError: as :func:`jax_fp4.quantize`.
    """
    spec = QuantSpec.make(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    return _quantize_mse(jnp.asarray(w), spec, axis % 2, weight)


def _quantize_mse(w, spec, axis, weight=None):
    st = None
    if weight is not None:
        k = jnp.asarray(weight).shape[0]
        st = [LayerStats(jnp.diag(jnp.asarray(weight, jnp.float32)),
                         jnp.zeros((k,), jnp.float32), jnp.ones((), jnp.float32))]
    return quantize_group([w], axis, spec, "awq" if st else "mse", st)[0]


def gptq_quantize(w, hessian, format="nvfp4", *, axis: int = 0,
                  block_size: Optional[int] = None, tensor_scale="auto",
                  scale_rounding: str = "floor", scale_dtype=None, damp: float = 0.01,
                  act_order: bool = False, scale_search: str = "mse"):
    """Quantize one linear layer's weight with GPTQ (jax_fp4.ptq.gptq).

    Args:
      w: 2-D float32 / bfloat16 / float16 weight: (in, out) Flax kernel (``axis=0``) or
        (out, in) PyTorch weight (``axis=1``); ``axis`` is the contraction axis.
      hessian: (K, K) float, K = w.shape[axis]: sum over calibration tokens of x x^T
        (:class:`jax_fp4.ptq.LayerStats` ``.hessian``); any positive multiple gives the
        same result.
      format, block_size, tensor_scale, scale_rounding, scale_dtype: as
        :func:`jax_fp4.quantize`. NVFP4 "auto" two-level: the per-tensor scale is
        amax(w)/2688 of the original weight.
      damp: dampening, a fraction of the mean diagonal of H added to it (default 0.01).
      act_order: quantize columns by decreasing diag(H), scales fixed up front.
      scale_search: "mse" (default) or "rtn", how each block scale is chosen.
    Returns:
      QArray of w's shape and dtype (linear layout).
    Raises:
      ValueError: bad shapes, options or non-finite weights / Hessian; TypeError: non-float w.
    """
    spec = QuantSpec.make(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    w = jnp.asarray(w)
    if not jnp.issubdtype(w.dtype, jnp.floating):
        raise TypeError(f"w: expected a float array, got {w.dtype}")
    rows = to_rows(w, axis)
    n, k = rows.shape
    spec.format.check_block_size(spec.block_size, k)
    hessian = jnp.asarray(hessian, jnp.float32)
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: expected shape {(k, k)} (the contraction axis {axis} of "
                         f"w has length {k}), got {tuple(hessian.shape)}")
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale_search: expected one of {SCALE_SEARCHES}, got "
                         f"{scale_search!r}")
    if not (np.isfinite(np.asarray(rows)).all() and np.isfinite(np.asarray(hessian)).all()):
        raise ValueError("w, hessian: GPTQ needs finite weights and a finite Hessian")
    st = LayerStats(hessian, jnp.zeros((k,), jnp.float32), jnp.ones((), jnp.float32))
    return quantize_group([w], axis % 2, spec, "gptq", [st], damp=float(damp),
                          act_order=bool(act_order), scale_search=scale_search)[0]
