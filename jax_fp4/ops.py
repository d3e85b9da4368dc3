"""The functional public API (docs/spec.md section 5), on top of :mod:`jax_fp4.prims`.

Each function validates its arguments (ValueError/TypeError naming the argument, the
expected and the actual value), moves the blocked axis last, flattens to the canonical
(rows, K) view, binds a primitive and restores the caller's layout.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import layout, reference, stochastic, validate
from .prims._common import get_backend
from .prims.fake_quantize import fake_quantize_p
from .prims.quantize import _swizzle, quantize_p
from .prims.scaled_matmul import scaled_matmul_operand, scaled_matmul_p
from .prims.tensor_scale import auto_tensor_scale
from .prims.wmatmul import wmatmul_p
from .formats import get_format
from ._rows import _from_rows, _qarray_rows, _row_ts, _to_rows, dequantize_qarray
from .qarray import QArray
from .sharding import _axes_size, with_out_sharding

_FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_ROUNDINGS = ("floor", "rceil")


# ------------------------------------------------------------------------ validation
def _check_float(x, name):
    if isinstance(x, QArray):
        raise TypeError(f"{name}: expected a float array, got a QArray ({x!r})")
    if not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x)
        except TypeError:
            raise TypeError(f"{name}: expected a float array, got {type(x).__name__}") from None
    if np.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def _normalize_axis(axis, ndim, name="axis"):
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{name}: expected an int, got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}: expected an axis in [{-ndim}, {ndim}) for a rank-{ndim} "
                         f"array, got {axis}")
    return int(axis) % ndim


_QUANTIZE_LAYOUTS = ("linear", "swizzled")  # "tiled": jax_fp4.prepare of a linear QArray


def _check_options(f, x_dtype, tensor_scale, scale_layout, scale_rounding, scale_dtype):
    if scale_layout not in _QUANTIZE_LAYOUTS:
        raise ValueError(f"scale_layout: expected one of {_QUANTIZE_LAYOUTS}, got "
                         f"{scale_layout!r} (the 'tiled' layout comes from jax_fp4.prepare)")
    if scale_rounding not in _ROUNDINGS:
        raise ValueError(f"scale_rounding: expected one of {_ROUNDINGS}, got {scale_rounding!r}")
    if scale_rounding == "rceil" and not f.has_scale_rounding:
        raise ValueError(f"scale_rounding: 'rceil' applies to MX formats only, got format "
                         f"{f.name!r}")
    if tensor_scale is not None and not f.has_tensor_scale:
        raise ValueError(f"tensor_scale: only nvfp4 has a per-tensor scale, got format "
                         f"{f.name!r} with tensor_scale={tensor_scale!r}")
    if scale_dtype is not None:
        if not f.scale_dtype_per_call:
            raise ValueError(f"scale_dtype: only int4 scales have a choice of dtype, got "
                             f"format {f.name!r}")
        return validate.float_dtype(scale_dtype, "scale_dtype")
    return f.default_scale_dtype(x_dtype)


def _tensor_scale(tensor_scale, x):
    """None | "auto" | scalar -> float32 scalar array or None (validated when concrete)."""
    if tensor_scale is None:
        return None
    if isinstance(tensor_scale, str):
        if tensor_scale != "auto":
            raise ValueError(f"tensor_scale: expected None, 'auto' or a float32 scalar, got "
                             f"{tensor_scale!r}")
        return auto_tensor_scale(x.reshape(-1, x.shape[-1]))
    validate.check_real_scalar(tensor_scale, "tensor_scale")
    ts = jnp.asarray(tensor_scale)
    if ts.shape != ():
        raise ValueError(f"tensor_scale: expected a scalar, got shape {ts.shape}")
    ts = ts.astype(jnp.float32)
    v = validate.concrete_float(ts)
    if v is None:
        return ts  # traced: invalid values give NaN scales (docs/spec.md section 3)
    if not (math.isfinite(v) and v >= reference.TENSOR_SCALE_MIN):
        raise ValueError(f"tensor_scale: expected a finite value >= 2**-120, got {v}")
    return ts


# ------------------------------------------------------------------------ quantize
def _quant_params(f, block_size, scale_rounding, ts, scale_dtype):
    return dict(fmt=f.name, block_size=block_size, rceil=scale_rounding == "rceil",
                two_level=ts is not None, scale_dtype=scale_dtype,
                impl=get_backend())


def _quantize_args(x, format, axis, block_size, tensor_scale, scale_layout, scale_rounding,
                   scale_dtype):
    x = _check_float(x, "x")
    f = get_format(format)
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one axis, got a scalar")
    axis = _normalize_axis(axis, x.ndim)
    bs = f.default_block if block_size is None else block_size
    bs = validate.check_int(bs, "block_size")
    f.check_block_size(bs, x.shape[axis])
    scale_dtype = _check_options(f, x.dtype, tensor_scale, scale_layout, scale_rounding,
                                 scale_dtype)
    ts = _tensor_scale(tensor_scale, x)
    x2, rest = _to_rows(x, axis)
    params = _quant_params(f, int(bs), scale_rounding, ts, scale_dtype)
    return f, x, axis, x2, rest, ts, params


# ------------------------------------------------------------------------ public API
def quantize(x, format="nvfp4", *, axis=-1, tensor_scale=None, block_size=None,
             scale_layout="linear", scale_rounding="floor", scale_dtype=None,
             rounding="nearest", key=None) -> QArray:
    """Quantize ``x`` into a :class:`QArray` blocked along ``axis``.

    Args:
      x: float32 / bfloat16 / float16 array of any rank >= 1.
      format: "nvfp4", "mxfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e4m3", "mxfp8_e5m2",
        "nf4", "bnb_fp4" or "int4" (docs/spec.md section 3).
      axis: the blocked axis (the contraction axis of a weight); its length must be a
        multiple of the block size.
      tensor_scale: nvfp4 only. None: one level (E4M3 block scales only); "auto": the
        per-tensor decode scale amax(x)/2688 computed inside the op; or a float32 scalar
        (finite, >= 2**-120; a traced invalid value yields NaN scales).
      block_size: elements per block/group; default 16 (nvfp4), 32 (MX), 64 (nf4,
        bnb_fp4: powers of two 32..4096), 128 (int4: any size dividing the axis).
      scale_layout: "linear" (scales shaped like x with the blocked axis divided by the
        block size, blocked axis last) or "swizzled" (the 128x4 tiled layout of cuBLASLt /
        CUTLASS / Blackwell tensor cores, 2-D, rows = product of the other axes).
      scale_rounding: MX only: "floor" (OCP MX v1.0) or "rceil" (NVIDIA hardware rule).
      scale_dtype: int4 only: dtype of the group scales (default x.dtype).
      rounding: how elements round onto their scaled grid: "nearest" (ties to even; INT4
        and codebooks: nearest) or "stochastic" (unbiased; needs ``key``; the bits drawn
        from the key and the rule: :mod:`jax_fp4.stochastic`). Block scales are the same.
      key: PRNG key for rounding="stochastic" (same key, same codes on every backend).
    Returns:
      QArray with ``dtype = x.dtype``.
    Raises:
      TypeError: x is not a float32/bfloat16/float16 array; bad argument types.
      ValueError: unknown format, axis out of range, axis length not a multiple of the
        block size, block size not allowed for the format, options that do not apply to
        the format, non-scalar or invalid concrete tensor_scale, unknown rounding.
    """
    _check_rounding(rounding, key)
    f, x, axis, x2, rest, ts, params = _quantize_args(
        x, format, axis, block_size, tensor_scale, scale_layout, scale_rounding, scale_dtype)
    rows, k = x2.shape
    if rounding == "stochastic":
        codes, scales, zeros = stochastic.quantize_sr_p.bind(
            x2, _row_ts(ts, rows), stochastic.random_bits(key, rows, k), **params)
        if scale_layout == "swizzled":
            scales = _swizzle(scales)
    else:
        codes, scales, zeros = quantize_p.bind(
            x2, _row_ts(ts, rows), swizzled=scale_layout == "swizzled", **params)
    data = codes.reshape(rest + (codes.shape[-1],))
    if f.bits == 8:
        data = lax.bitcast_convert_type(data, f.elem.np_dtype)
    if f.minifloat_scales:
        scales = lax.bitcast_convert_type(scales, f.scale_dtype)
    if scale_layout == "linear":
        scales = scales.reshape(rest + (scales.shape[-1],))
    return QArray(data, scales, ts, zeros.reshape(rest + (zeros.shape[-1],))
                  if f.has_zeros else None, format=f.name, axis=axis, shape=x.shape,
                  dtype=x.dtype, block_size=params["block_size"], scale_layout=scale_layout)


_ELEMENT_ROUNDINGS = ("nearest", "stochastic")


def _check_rounding(rounding, key):
    if rounding not in _ELEMENT_ROUNDINGS:
        raise ValueError(f"rounding: expected one of {_ELEMENT_ROUNDINGS}, got {rounding!r}")
    if rounding == "nearest" and key is not None:
        raise ValueError("key: only rounding='stochastic' takes a key, got rounding="
                         "'nearest' with a key")


def _check_qarray(q, name):
    if not isinstance(q, QArray):
        raise TypeError(f"{name}: expected a QArray, got {type(q).__name__}")


def dequantize(q: QArray, dtype=None):
    """Decode a :class:`QArray` to a dense array.

    Args:
      q: the QArray.
      dtype: float32, bfloat16 or float16 (default ``q.dtype``). Values are computed in
        float32 and rounded to nearest even.
    Returns:
      array of shape ``q.shape``.
    Raises:
      TypeError: q is not a QArray, or an unsupported dtype.
    """
    _check_qarray(q, "q")
    dtype = validate.float_dtype(q.dtype if dtype is None else dtype, "dtype")
    return dequantize_qarray(q, dtype)


def prepare(q: QArray) -> QArray:
    """A weight QArray in the layout the fused W4A16 kernel reads fastest (``"tiled"``).

    The codes, block scales and (int4) zero points of each 128-row x 128-k tile of the last
    two axes of ``q.data`` / ``q.scales`` / ``q.zeros`` are stored contiguously, tile by tile
    ([row tile][k step][row][bytes]; jax_fp4.layout.tile_rows), so that the CUDA wgmma
    kernel copies a stage's weight bytes with one 1-D bulk copy each instead of 128 strided
    rows (the offline re-layout of Marlin-style W4A16 kernels). Shapes, dtypes and every
    other field stay as they were; :func:`dequantize`, :func:`matmul` and every other op
    give bit-identical results, and safetensors checkpoints are written in the linear
    layout. Ops other than the wgmma kernel (CPU, the reference, other GPUs, large M)
    restore the linear layout first, which costs a copy of the weight per call: prepare
    weights for a Hopper GPU.

    Applies to QArrays with linear scales whose data has >= 2 axes, rows
    (``q.data.shape[-2]``: N of a (K, N) weight) a multiple of 128 and a blocked axis of
    length K % 128 == 0, in nvfp4 (block 16, one- or two-level), mxfp4 (block 32), or int4 /
    nf4 / bnb_fp4 in power-of-two blocks of 16..128 whose scales and zero points per row
    and 128 k fit the kernel's 16 bytes (int4 groups of 64 / 128 with any scale dtype or 32
    with bf16 / f16 scales, nf4 / bnb_fp4 blocks of 32..128; jax_fp4.layout.tileable). Any
    other QArray (and one already prepared) is returned unchanged, as is one whose blocked
    axis is split over devices (a row-parallel weight: the tiled layout interleaves K within
    each tile, so it cannot be split; docs/sharding.md) as far as its sharding is known (a
    committed array's; under jit with Explicit mesh axes, where any split weight is
    returned unchanged). Pure jnp: works under jit and on stacked (vmap / scan) weights.

    Args:
      q: a QArray.
    Returns:
      the QArray with ``scale_layout="tiled"``, or ``q``.
    Raises:
      TypeError: q is not a QArray.
    """
    _check_qarray(q, "q")
    return _relayout(q, layout.tile_weight, "tiled") if _tileable(q) else q


def _relayout(q: QArray, move, scale_layout):
    """q with (data, scales, zeros) = move(data, scales, zeros, block_size) and the given
    layout tag."""
    data, scales, zeros = move(q.data, q.scales, q.zeros, q.block_size)
    return QArray(data, scales, q.tensor_scale, zeros, format=q.format, axis=q._axis,
                  shape=q._shape, dtype=q.dtype, block_size=q.block_size,
                  scale_layout=scale_layout)


def _tileable(q: QArray) -> bool:
    """Whether :func:`prepare` applies (jax_fp4.layout.tileable, and a sharding the tiled
    layout can keep: _layout_keeps_sharding)."""
    return (q.scale_layout == "linear" and q.data.ndim >= 2
            and layout.tileable(q.format, q.block_size, q.scales.dtype, q.data.shape[-2],
                                q.shape[q.axis])
            and _layout_keeps_sharding(q.data))


def _layout_keeps_sharding(data) -> bool:
    """Whether the tiled layout can hold codes `data` as they are split over devices, as
    far as their sharding is known (a committed array's; under jit a traced one's where the
    mesh axes are Explicit, none where they are Auto). The blocked axis (the codes' last:
    K of a weight) must not be split: the layout interleaves K within each tile. Under
    Explicit axes no axis may be split, since the re-layout's reshapes would need output
    shardings of their own."""
    try:
        sharding, traced = data.sharding, False  # a committed array's
    except AttributeError:  # traced (or NumPy): the abstract value's, if it has one
        traced = True
        try:
            sharding = jax.typeof(data).sharding
        except Exception:  # none in this JAX's abstract values
            return True
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if not spec or mesh is None:
        return True
    split = [1 if e is None else _axes_size(mesh, e) for e in tuple(spec)[:data.ndim]]
    if traced:
        return all(n == 1 for n in split)
    return len(split) < data.ndim or split[data.ndim - 1] == 1


def unprepare(q: QArray) -> QArray:
    """Inverse of :func:`prepare`: a ``"tiled"`` QArray back in the linear layout (others
    unchanged). Raises TypeError if q is not a QArray."""
    _check_qarray(q, "q")
    return _relayout(q, layout.untile_weight, "linear") if q.scale_layout == "tiled" else q


_STES = ("identity", "clipped")


def fake_quantize(x, format="nvfp4", *, axis=-1, tensor_scale=None, block_size=None,
                  scale_rounding="floor", scale_dtype=None, ste="identity",
                  rounding="nearest", key=None):
    """Quantize-dequantize (QDQ) in one pass: ``dequantize(quantize(x, ...), x.dtype)``.

    Same arguments and errors as :func:`quantize` (no scale layout: nothing is stored).

    Args:
      ste: the gradient, a straight-through estimator (STE). "identity" (default; the
        torchao / TransformerEngine convention): the incoming gradient passes wherever x is
        finite. "clipped": it passes only where x is finite and inside its block's
        representable range (|x| <= max element * block scale (* tensor scale), which cuts
        the saturated elements of MX / NVFP4 blocks). Zero elsewhere.
      rounding, key: as :func:`quantize` ("stochastic": ``dequantize(quantize(x,
        rounding="stochastic", key=key))``, an unbiased estimate of x).
    Returns:
      array with x's shape and dtype.
    Raises:
      as :func:`quantize`; ValueError: ste not "identity" or "clipped".
    """
    if ste not in _STES:
        raise ValueError(f"ste: expected one of {_STES}, got {ste!r}")
    _check_rounding(rounding, key)
    f, x, axis, x2, rest, ts, params = _quantize_args(
        x, format, axis, block_size, tensor_scale, "linear", scale_rounding, scale_dtype)
    rows, k = x2.shape
    if rounding == "stochastic":
        y = stochastic.fake_quantize_sr(
            x2, _row_ts(ts, rows), stochastic.random_bits(key, rows, k), ste=ste,
            dequant_params=dict(fmt=f.name, block_size=params["block_size"], k=k,
                                dtype=x.dtype, two_level=ts is not None,
                                impl=params["impl"]), **params)
        return _from_rows(y, rest, axis)
    y = fake_quantize_p.bind(x2, _row_ts(ts, rows), ste=ste, **params)
    return _from_rows(y, rest, axis)


def tensor_scale_from_amax(amax, format="nvfp4"):
    """Per-tensor decode scale for NVFP4: amax / 2688 (E4M3 max 448 * E2M1 max 6).

    torchao ``per_tensor_amax_to_scale``, ModelOpt ``weight_scale_2``; amax == 0 gives 1.0
    and the result is floored at 2**-120. compressed-tensors / vLLM store the inverse.

    Args:
      amax: float scalar or array (non-negative).
      format: only "nvfp4" has a per-tensor scale.
    Returns:
      float32 array shaped like amax.
    Raises:
      TypeError: amax is not real (bool, complex, str).
      ValueError: a format other than nvfp4; a concrete amax that is negative or NaN
        (traced values follow the reference: NaN in, NaN out).
    """
    f = get_format(format)
    if not f.has_tensor_scale:
        raise ValueError(f"format: only nvfp4 has a per-tensor scale, got {f.name!r}")
    validate.check_real_scalar(amax, "amax")
    try:
        a = np.asarray(amax, np.float64)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            TypeError):
        a = None
    if a is not None and (np.isnan(a).any() or (a < 0).any()):
        raise ValueError(f"amax: expected non-negative values (an absolute maximum), got "
                         f"{amax!r}")
    return reference.tensor_scale_from_amax(amax)


# ------------------------------------------------------------------------ matmul
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
    """Drop-in for ``lax.dot_general`` where either operand may be a :class:`QArray`.

    A QArray operand must be contracted along its blocked axis (the axis it was quantized
    along); it is decoded to the other operand's dtype (W4A16) — through the fused
    weight-only matmul primitive when the QArray is a 2-D weight with no batch dims.
    Usable as Flax ``nn.Dense(dot_general=jax_fp4.dot_general)``.

    Args:
      lhs, rhs: arrays or QArrays (not both QArrays: use :func:`scaled_matmul`).
      dimension_numbers, precision, preferred_element_type, out_sharding: as
        ``lax.dot_general`` (Flax NNX passes ``out_sharding``: a NamedSharding, or a
        PartitionSpec under ``jax.set_mesh``; with a QArray weight the result is laid out
        as it, jax_fp4.sharding.with_out_sharding).
    Returns:
      as ``lax.dot_general`` on the dequantized operands; dtype
      ``preferred_element_type`` or the promoted dtype of the operands.
    Raises:
      TypeError: both operands are QArrays; the array operand next to a QArray is not a
        real floating-point array (complex, bool, integer); dimension_numbers malformed
        or inconsistent with the operands (as ``lax.dot_general`` raises).
      ValueError: a QArray's blocked axis is not one of its contracting dimensions.
    """
    lq, rq = isinstance(lhs, QArray), isinstance(rhs, QArray)
    if lq and rq:
        raise TypeError("lhs, rhs: both are QArrays; use jax_fp4.scaled_matmul for W4A4/W8A8")
    if lq or rq:
        if lq:
            rhs = validate.check_float_operand(rhs, "rhs")
        else:
            lhs = validate.check_float_operand(lhs, "lhs")
        dimension_numbers = validate.check_dimension_numbers(
            dimension_numbers, tuple(lhs.shape), tuple(rhs.shape))
    (lc, rc), (lb, rb) = dimension_numbers
    if not (lq or rq):
        kw = {} if out_sharding is None else {"out_sharding": out_sharding}
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type,
                               **kw)
    q, other, qc, name = (rhs, lhs, rc, "rhs") if rq else (lhs, rhs, lc, "lhs")
    if q.axis not in qc:
        raise ValueError(f"{name}: a QArray must be contracted along its blocked axis "
                         f"{q.axis}, but the contracting dimensions are {qc}")
    other = jnp.asarray(other)
    out_dtype = np.dtype(preferred_element_type or jnp.result_type(other.dtype, q.dtype))
    if rq and q.ndim == 2 and not lb and not rb and len(rc) == 1 and other.ndim >= 1:
        y = _weight_matmul(other, q, int(lc[0]) % other.ndim, precision, out_dtype)
        return with_out_sharding(y, out_sharding)
    w = dequantize(q, other.dtype if other.dtype in _FLOAT_DTYPES else q.dtype)
    args = (other, w) if rq else (w, other)
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    return lax.dot_general(*args, dimension_numbers, precision, preferred_element_type, **kw)


def _weight_matmul(x, w: QArray, x_axis, precision, out_dtype):
    """x (..., K at x_axis, ...) contracted with a 2-D QArray weight along its blocked axis.

    Output follows lax.dot_general: x's free dims, then w's free dim (N)."""
    if np.dtype(x.dtype) not in _FLOAT_DTYPES:
        x = x.astype(w.dtype)
    x2, rest = _to_rows(x, x_axis)
    bufs, _, k = _qarray_rows(w, keep_tiled=True)
    # one per-tensor scale for the whole weight: (1,), no per-row copy (the kernel reads it
    # once; the other paths broadcast it)
    bufs = (*bufs[:3], jnp.reshape(jnp.asarray(w.tensor_scale, jnp.float32), (1,))
            if w.tensor_scale is not None else jnp.zeros((1,), jnp.float32))
    if x2.shape[1] != k:
        raise ValueError(f"lhs: contracting dimension has size {x2.shape[1]}, the QArray's "
                         f"blocked axis has size {k}")
    y = wmatmul_p.bind(
        x2, *bufs, fmt=w.format, block_size=w.block_size, two_level=w.tensor_scale is not None,
        out_dtype=out_dtype, precision=precision, tiled=w.scale_layout == "tiled",
        impl=get_backend())
    return y.reshape(rest + (y.shape[-1],))


def matmul(x, w: QArray):
    """``x (..., K) @ w (K, N)`` with a QArray weight blocked along K (axis 0).

    On CUDA, with bf16/f16 x and a 4-bit weight (nvfp4, mxfp4, nf4, bnb_fp4, int4;
    K % 32 == 0; power-of-two block size), this runs the fused W4A16 kernel
    (csrc/cuda/wmatmul/) up to a number of rows of x that depends on the GPU, the
    format and the dtypes (any M for a weight through ``jax_fp4.prepare`` on a Hopper GPU
    with an sm_90a build); otherwise dequantize + XLA dot. The launch policy and why:
    docs/kernels.md; the measurements behind it: benchmarks/RESULTS.md.

    Returns:
      (..., N) array in the promoted dtype of x and ``w.dtype``.
    Raises:
      TypeError: w is not a QArray.
      ValueError: w is not 2-D or not blocked along axis 0; K mismatch.
    """
    _check_qarray(w, "w")
    if w.ndim != 2 or w.axis != 0:
        raise ValueError(f"w: expected a 2-D (K, N) QArray blocked along axis 0, got shape "
                         f"{w.shape} blocked along axis {w.axis}")
    x = validate.check_float_operand(x, "x", min_ndim=1)
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"x: expected a last axis of K={w.shape[0]} (w is {w.shape}), got "
                         f"shape {x.shape}")
    return dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def scaled_matmul(a: QArray, b: QArray, *, alpha=None, bias=None, out_dtype=jnp.bfloat16):
    """Block-scaled matmul ``D = alpha * A @ B^T + bias`` (W4A4 / W8A8).

    Args:
      a: (M, K) QArray blocked along K (axis 1): nvfp4 or an MX format.
      b: (N, K) QArray blocked along K (axis 1): the same format as ``a`` for nvfp4; any
        MX format when ``a`` is MX (e.g. mxfp6 x mxfp8), as cuBLASLt block scaling allows.
      alpha: float32 scalar (default 1).
      bias: (N,) array added per output column (default none).
      out_dtype: result dtype (float32, bfloat16 or float16).
    Returns:
      (M, N) array of out_dtype; the reference decodes both operands exactly to float32
      and accumulates in float32. On CUDA the operands are decoded exactly to bf16
      (without NVFP4 tensor scales, applied after) and multiplied on the tensor cores
      with float32 accumulation (docs/spec.md section 5).
    Raises:
      TypeError: a or b is not a QArray.
      ValueError: not 2-D / not blocked along K, K mismatch, a format without E4M3/E8M0
        block scales (nf4, bnb_fp4, int4), mismatched formats, bad alpha/bias shape.
    """
    _check_qarray(a, "a")
    _check_qarray(b, "b")
    for name, q in (("a", a), ("b", b)):
        if q.ndim != 2 or q.axis != 1:
            raise ValueError(f"{name}: expected a 2-D QArray blocked along axis 1 (K), got "
                             f"shape {q.shape} blocked along axis {q.axis}")
        if not q.fmt.minifloat_scales:
            raise ValueError(f"{name}: scaled_matmul takes nvfp4 or MX formats, got "
                             f"{q.format!r}")
        if q.block_size != q.fmt.default_block:
            raise ValueError(f"{name}: expected block_size {q.fmt.default_block}, got "
                             f"{q.block_size}")
    if a.fmt.family != b.fmt.family:
        raise ValueError(f"b: mismatched formats: a is {a.format!r}, b is {b.format!r} "
                         "(nvfp4 pairs with nvfp4, MX with MX)")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"b: K mismatch: a has K={a.shape[1]}, b has K={b.shape[1]}")
    n = b.shape[0]
    if alpha is not None:
        validate.check_real_scalar(alpha, "alpha")
    if bias is not None:
        bias = validate.check_float_operand(bias, "bias")
    alpha = jnp.float32(1.0) if alpha is None else jnp.asarray(alpha, jnp.float32)
    if alpha.shape != ():
        raise ValueError(f"alpha: expected a scalar, got shape {alpha.shape}")
    bias = jnp.zeros((n,), jnp.float32) if bias is None else jnp.asarray(bias)
    if bias.shape != (n,):
        raise ValueError(f"bias: expected shape ({n},), got {bias.shape}")
    out_dtype = validate.float_dtype(out_dtype, "out_dtype")
    (ac, asc, _, ats), _, k = _qarray_rows(a)
    (bc, bsc, _, bts), _, _ = _qarray_rows(b)
    # one-level NVFP4 decodes as two-level with a tensor scale of exactly 1
    ats = ats if a.tensor_scale is not None else jnp.ones_like(ats)
    bts = bts if b.tensor_scale is not None else jnp.ones_like(bts)
    return scaled_matmul_p.bind(
        ac, asc, ats, bc, bsc, bts, alpha, bias.astype(jnp.float32), a_fmt=a.format,
        b_fmt=b.format, k=k, out_dtype=out_dtype, impl=get_backend())


def scaled_matmul_operands(q: QArray):
    """A 2-D nvfp4 / MX QArray blocked along axis 1 as ``jax.nn.scaled_matmul`` operands.

    Returns:
      (data, scales, tensor_scale): data (1, R, K) float4_e2m1fn (nvfp4, mxfp4) or
      float8_e4m3fn / float8_e5m2 (mxfp8; mxfp6 E2M3 / E3M2 widened exactly to them),
      scales (1, R, K / block_size) float8_e4m3fn (nvfp4) or float8_e8m0fnu (MX) in the
      linear layout (jax swizzles them for cuDNN itself), and the NVFP4 per-tensor scale
      (or None), which ``jax.nn.scaled_matmul`` does not take: multiply its result by it.
      This is the Blackwell path of :func:`scaled_matmul`.
    Raises:
      TypeError: q is not a QArray.
      ValueError: q is not 2-D blocked along axis 1, or not nvfp4 / MX.
    """
    _check_qarray(q, "q")
    if q.ndim != 2 or q.axis != 1 or not q.fmt.minifloat_scales:
        raise ValueError(f"q: expected a 2-D nvfp4 or MX QArray blocked along axis 1, got "
                         f"{q.format!r} of shape {q.shape} blocked along axis {q.axis}")
    (codes, scales, _, _), _, k = _qarray_rows(q)
    data, s = scaled_matmul_operand(codes, scales, q.format, k)
    return data, s, q.tensor_scale


to_blocked = layout.to_blocked
from_blocked = layout.from_blocked
