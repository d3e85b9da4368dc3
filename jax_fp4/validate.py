"""Argument validation shared by every public op and by :class:`jax_fp4.QArray`.

One place decides what a well-formed QArray and a well-formed op argument are, so that
the reference and the kernels (CPU, CUDA) see the same inputs and a bad one fails early
with a TypeError / ValueError naming the argument, what was expected and what was found.

QArray leaves are checked wherever they are arrays (or ``jax.ShapeDtypeStruct``s): at
construction and whenever a QArray is unflattened. Inside transformations leaves may be
tracers (checked: they have shapes and dtypes), float0 tangents, or placeholders that
jax's tree utilities put in (``object()``, None, shardings, ints, ...): those are left
alone, since only array-like leaves can be checked.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .formats import get_format

FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
SCALE_LAYOUTS = ("linear", "swizzled", "tiled")
_FLOAT_NAMES = "float32, bfloat16 or float16"


def _tname(v) -> str:
    return type(v).__name__


def check_int(v, name: str) -> int:
    """A Python / numpy integer (not bool) -> int; TypeError otherwise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (numbers.Integral, np.integer)):
        raise TypeError(f"{name}: expected an int, got {_tname(v)} ({v!r})")
    return int(v)


def float_dtype(v, name: str) -> np.dtype:
    """A dtype-like naming float32 / bfloat16 / float16 -> np.dtype."""
    try:
        d = np.dtype(v)
    except TypeError:
        raise TypeError(f"{name}: expected a dtype ({_FLOAT_NAMES}), got {v!r}") from None
    if d not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected {_FLOAT_NAMES}, got {d}")
    return d


def check_real_scalar(v, name: str, *, allow_str=False):
    """Reject bool, complex, str (unless allowed) and non-numeric arrays for a scalar
    numeric argument (tensor_scale, alpha, amax). Returns v unchanged."""
    if isinstance(v, str) and allow_str:
        return v
    if isinstance(v, (bool, np.bool_, str, bytes)) or v is None:
        raise TypeError(f"{name}: expected a real number, got {_tname(v)} ({v!r})")
    dt = getattr(v, "dtype", None)
    if dt is None:
        if not isinstance(v, (numbers.Real, list, tuple)):
            raise TypeError(f"{name}: expected a real number, got {_tname(v)} ({v!r})")
        dt = np.asarray(v).dtype
    dt = np.dtype(dt)
    if not (jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer)) \
            or dt == np.bool_:
        raise TypeError(f"{name}: expected a real (float or int) value, got dtype {dt}")
    return v


def concrete_float(v):
    """float(v) for a concrete scalar, None when v is traced."""
    try:
        return float(v)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            TypeError):
        return None


def check_float_operand(x, name: str, *, min_ndim=0):
    """An array operand of a matmul next to a QArray: real floating dtype (complex, bool
    and integer operands are rejected: the QArray is decoded to the operand's dtype)."""
    if not hasattr(x, "dtype"):
        try:
            x = jnp.asarray(x)
        except TypeError as e:
            raise TypeError(f"{name}: expected a float array, got {_tname(x)}: {e}") from None
    dt = np.dtype(x.dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name}: expected a floating-point array ({_FLOAT_NAMES}), got "
                        f"dtype {dt}")
    if x.ndim < min_ndim:
        raise ValueError(f"{name}: expected an array with at least {min_ndim} axis, got "
                         f"shape {x.shape}")
    return jnp.asarray(x)


# ------------------------------------------------------------------ dimension numbers
def _dims(v, name):
    if isinstance(v, (numbers.Integral, np.integer)) and not isinstance(v, bool):
        return (int(v),)
    if not isinstance(v, (tuple, list)):
        raise TypeError(f"dimension_numbers: expected {name} as a tuple of ints, got "
                        f"{_tname(v)} ({v!r})")
    return tuple(check_int(d, f"dimension_numbers ({name})") for d in v)


def check_dimension_numbers(dn, lhs_shape, rhs_shape):
    """``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))`` checked as
    ``lax.dot_general`` checks it (TypeError, as lax raises): dims non-negative and below
    each operand's rank, distinct, batch and contracting disjoint, equal lengths and equal
    sizes on both sides. Returns the normalised tuples."""
    try:
        (lc, rc), (lb, rb) = dn
    except (TypeError, ValueError):
        raise TypeError("dimension_numbers: expected ((lhs_contracting, rhs_contracting), "
                        f"(lhs_batch, rhs_batch)), got {dn!r}") from None
    lc, rc = _dims(lc, "lhs_contracting"), _dims(rc, "rhs_contracting")
    lb, rb = _dims(lb, "lhs_batch"), _dims(rb, "rhs_batch")
    for side, shape, c, b in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        nd = len(shape)
        for d in c + b:
            if not 0 <= d < nd:
                raise TypeError(
                    f"dimension_numbers: {side} dimension {d} is out of range for the "
                    f"rank-{nd} {side} (expected 0 <= d < {nd}; contracting {c}, batch {b})")
        if len(set(c + b)) != len(c + b):
            raise TypeError(f"dimension_numbers: {side} contracting {c} and batch {b} "
                            "dimensions must be distinct")
    for kind, l_, r_ in (("contracting", lc, rc), ("batch", lb, rb)):
        if len(l_) != len(r_):
            raise TypeError(f"dimension_numbers: lhs and rhs {kind} dimensions must have the "
                            f"same length, got {l_} and {r_}")
        ls, rs = tuple(lhs_shape[d] for d in l_), tuple(rhs_shape[d] for d in r_)
        if ls != rs:
            raise TypeError(f"dimension_numbers: {kind} dimensions must have the same sizes, "
                            f"got lhs {l_} of sizes {ls} and rhs {r_} of sizes {rs}")
    return (lc, rc), (lb, rb)


# ------------------------------------------------------------------ QArray
@functools.lru_cache(maxsize=4096)
def _check_aux(fmt, axis, shape, dtype, block_size, scale_layout):
    f = get_format(fmt)
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"QArray shape: expected a tuple of non-negative ints, got {shape!r}")
    if len(shape) == 0:
        raise ValueError("QArray shape: expected at least one axis, got ()")
    if not 0 <= axis < len(shape):
        raise ValueError(f"QArray axis: expected a blocked axis in [0, {len(shape)}) for shape "
                         f"{shape}, got {axis}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"QArray dtype: expected {_FLOAT_NAMES}, got {dtype}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"QArray scale_layout: expected one of {SCALE_LAYOUTS}, got "
                         f"{scale_layout!r}")
    try:
        f.check_block_size(block_size, shape[axis])
    except ValueError as e:
        raise ValueError(f"QArray block_size / shape: {e}") from None
    return f


def normalize_aux(format, axis, shape, dtype, block_size, scale_layout):
    """Check and normalise a QArray's static fields (construction)."""
    f = get_format(format)
    axis = check_int(axis, "QArray axis")
    try:
        shape = tuple(check_int(d, "QArray shape") for d in shape)
    except TypeError:
        raise TypeError(f"QArray shape: expected a tuple of ints, got {shape!r}") from None
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"QArray dtype: expected {_FLOAT_NAMES}, got {dtype!r}") from None
    block_size = check_int(block_size, "QArray block_size")
    if not isinstance(scale_layout, str):
        raise ValueError(f"QArray scale_layout: expected one of {SCALE_LAYOUTS}, got "
                         f"{scale_layout!r}")
    if axis < 0:
        raise ValueError(f"QArray axis: expected a non-negative blocked axis, got {axis}")
    _check_aux(f.name, axis, shape, dtype, block_size, scale_layout)
    return f.name, axis, shape, dtype, block_size, scale_layout


def check_aux(aux):
    """Check the static fields of an unflattened QArray (cached per distinct aux)."""
    try:
        _check_aux(*aux)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        raise TypeError(f"QArray aux data: expected hashable static fields, got {aux!r}") \
            from None


def _arraylike(v):
    if v is None:
        return False
    shape, dt = getattr(v, "shape", None), getattr(v, "dtype", None)
    if not isinstance(shape, tuple) or dt is None:
        return False
    try:
        dt = np.dtype(dt)
    except TypeError:
        return False
    return dt != jax.dtypes.float0


def _scale_dtypes(f):
    if f.scale_dtype_per_call:
        return FLOAT_DTYPES
    return (np.dtype(f.scale_dtype),)


def check_leaves(fmt, axis, shape, block_size, scale_layout, data, scales, tensor_scale, zeros):
    """Check a QArray's leaves against its static fields (array-like leaves only).

    data: dtype ``Format.data_dtype``, last axis K*bits/8 (K = shape[axis]); with its full
    rank, data.shape[:-1] is shape with the blocked axis removed. scales: the format's
    scale dtype (int4: float32/bfloat16/float16), shaped data.shape[:-1] + (K/block_size,)
    ("linear", "tiled") or 2-D swizzled. zeros: int4 only, uint8 shaped like linear scales.
    tensor_scale: nvfp4 only, float32 scalar (one value per stacked QArray under vmap).
    """
    f = get_format(fmt)
    k = shape[axis]
    nb = k // block_size
    if not f.has_zeros and zeros is not None and _arraylike(zeros):
        raise ValueError(f"QArray zeros: only int4 has zero points, got format {f.name!r} with "
                         f"zeros of shape {zeros.shape}")
    if not f.has_tensor_scale and tensor_scale is not None and _arraylike(tensor_scale):
        raise ValueError(f"QArray tensor_scale: only nvfp4 has a per-tensor scale, got format "
                         f"{f.name!r}")
    if not _arraylike(data):
        return
    if data is not None and np.dtype(data.dtype) != np.dtype(f.data_dtype):
        raise TypeError(f"QArray data: expected dtype {np.dtype(f.data_dtype)} for format "
                        f"{f.name!r}, got {data.dtype}")
    if len(data.shape) < 1 or data.shape[-1] != k * f.bits // 8:
        raise ValueError(f"QArray data: expected a last axis of {k * f.bits // 8} "
                         f"(K={k} {f.bits}-bit codes) for shape {shape} blocked along axis "
                         f"{axis}, got data of shape {data.shape}")
    rest = tuple(data.shape[:-1])
    full = len(data.shape) == len(shape)
    if full:
        want_rest = shape[:axis] + shape[axis + 1:]
        if rest != want_rest:
            raise ValueError(f"QArray data: expected shape {want_rest + (data.shape[-1],)} "
                             f"(the blocked axis {axis} of {shape} moved last), got "
                             f"{data.shape}")
    extra = max(0, len(data.shape) - len(shape))
    if _arraylike(scales):
        if np.dtype(scales.dtype) not in _scale_dtypes(f):
            want = " / ".join(str(d) for d in _scale_dtypes(f))
            raise TypeError(f"QArray scales: expected dtype {want} for format {f.name!r}, got "
                            f"{scales.dtype}")
        if scale_layout == "swizzled":
            from .layout import swizzled_shape
            want = swizzled_shape(math.prod(rest), nb)
            if (full or extra == 0) and tuple(scales.shape) != want:
                raise ValueError(f"QArray scales: expected the swizzled shape {want}, got "
                                 f"{scales.shape}")
        elif tuple(scales.shape) != rest + (nb,):
            raise ValueError(f"QArray scales: expected shape {rest + (nb,)} (one per block of "
                             f"{block_size}), got {scales.shape}")
    if f.has_zeros:
        if zeros is None:
            raise ValueError("QArray zeros: int4 needs zero points, got None")
        if _arraylike(zeros):
            if np.dtype(zeros.dtype) != np.uint8:
                raise TypeError(f"QArray zeros: expected dtype uint8, got {zeros.dtype}")
            if tuple(zeros.shape) != rest + (nb,):
                raise ValueError(f"QArray zeros: expected shape {rest + (nb,)}, got "
                                 f"{zeros.shape}")
    if f.has_tensor_scale and _arraylike(tensor_scale):
        if np.dtype(tensor_scale.dtype) != np.float32:
            raise TypeError(f"QArray tensor_scale: expected a float32 scalar, got dtype "
                            f"{tensor_scale.dtype}")
        if len(tensor_scale.shape) > extra:
            raise ValueError(f"QArray tensor_scale: expected a scalar (one per tensor), got "
                             f"shape {tensor_scale.shape}")
