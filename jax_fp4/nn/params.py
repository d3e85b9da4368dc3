"""Framework-neutral parameter quantization and the quantized-linear computation.

:func:`jax_fp4.nn.quantize_params` (:mod:`jax_fp4.nn.quantize`) turns the 2-D kernels of
any parameter pytree into :class:`~jax_fp4.QArray` s blocked along the contraction axis
with the leaf rules here; :func:`linear` is the one
implementation of a quantized dense layer (weight-only W4A16, activations fake-quantized,
or block-scaled W4A4/W8A8) that the Flax and Equinox layers share.

Conventions (which axis is contracted):
  * a leaf named ``kernel`` is a Flax kernel, shaped (in_features, out_features)
    (``flax.nnx.Linear``, ``flax.linen.Dense``): blocked along axis 0;
  * a leaf named ``weight`` is a PyTorch / Equinox weight, shaped (out_features,
    in_features) (``torch.nn.Linear``, ``equinox.nn.Linear``, Hugging Face checkpoints):
    blocked along axis 1.
Either way the stored codes are (out_features, in_features*bits/8) with the contraction axis
last, the layout of ModelOpt / compressed-tensors checkpoints.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import get_format
from ..ops import (dot_general, fake_quantize, quantize, scaled_matmul,
                   tensor_scale_from_amax)
from ..qarray import QArray
from ..tree_paths import _leaf_name, contraction_axis, path_str

__all__ = ["default_filter", "contraction_axis", "path_str",
           "transpose_2d", "linear", "ACT_MODES", "KERNEL_NAMES", "DEFAULT_EXCLUDE"]

#: leaf names taken to be dense-layer kernels by the default filter
KERNEL_NAMES = ("kernel", "weight")
#: paths the default filter leaves alone (embedding tables are looked up, not contracted)
DEFAULT_EXCLUDE = r"(?i)embed"
#: how a quantized linear layer treats its input activations
ACT_MODES = ("fake", "scaled")

Filter = Union[None, str, Callable[[str, Any], bool]]


def _is_float_array(x) -> bool:
    if not hasattr(x, "dtype") or not hasattr(x, "shape") or isinstance(x, QArray):
        return False
    try:
        return jnp.issubdtype(x.dtype, jnp.floating)
    except TypeError:
        return False


def default_filter(path: str, leaf) -> bool:
    """Default choice of what :func:`quantize_params` quantizes.

    True for a 2-D floating-point array whose name (last path component) is ``kernel`` or
    ``weight`` and whose path does not contain ``embed`` (case-insensitive). Biases and
    norm scales (1-D) and embedding tables are left alone.
    """
    return _is_kernel_shaped(leaf, False) and _kernel_named(path)


def _kernel_named(path: str) -> bool:
    return _leaf_name(path) in KERNEL_NAMES and not re.search(DEFAULT_EXCLUDE, path)


def _is_kernel_shaped(x, stacked) -> bool:
    """A float array of 2 axes, or with ``stacked`` of more (layers stacked on the leading
    axes of a scanned model)."""
    return _is_float_array(x) and (len(x.shape) == 2 or (stacked and len(x.shape) > 2))


def _make_filter(filter: Filter, stacked: bool = False) -> Callable[[str, Any], bool]:
    if filter is None:
        return lambda p, x: _is_kernel_shaped(x, stacked) and _kernel_named(p)
    if isinstance(filter, str):
        try:
            rx = re.compile(filter)
        except re.error as e:
            raise ValueError(f"filter: not a valid regular expression {filter!r}: {e}") from None
        return lambda p, x: _is_kernel_shaped(x, stacked) and rx.search(p) is not None
    if callable(filter):
        return lambda p, x: _is_kernel_shaped(x, stacked) and bool(filter(p, x))
    raise TypeError(f"filter: expected None, a regex string or a callable (path, leaf) -> "
                    f"bool, got {type(filter).__name__}")


# ----------------------------------------------------------------------------- leaves
def _quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype):
    f = get_format(format)
    kw = dict(block_size=block_size)
    if f.has_tensor_scale:
        kw["tensor_scale"] = tensor_scale
    if f.has_scale_rounding:
        kw["scale_rounding"] = scale_rounding
    if f.scale_dtype_per_call and scale_dtype is not None:
        kw["scale_dtype"] = scale_dtype
    return f, kw


def _resolve_axis(axis, path, leaf):
    if axis is None:
        ax = contraction_axis(path, leaf)
        if ax is None:
            raise ValueError(
                f"axis: cannot tell the contraction axis of {path!r} (shape "
                f"{tuple(leaf.shape)}) from its name (expected 'kernel' -> 0 or 'weight' -> 1); "
                "pass axis=0|1 or a callable (path, leaf) -> axis")
        return ax
    ax = axis(path, leaf) if callable(axis) else axis
    if not isinstance(ax, (int, np.integer)) or not -2 <= ax < 2:
        raise ValueError(f"axis: expected 0 or 1 for the 2-D kernel {path!r}, got {ax!r}")
    return int(ax) % 2


def _fits_block(path, what, k, f, block_size, strict, skipped):
    """Whether contraction length k is a multiple of the block size; if not, raise
    (strict) or record ``path`` in ``skipped``."""
    bs = f.default_block if block_size is None else block_size
    if k % bs == 0:
        return True
    if strict:
        raise ValueError(f"{path}: {what} {k} is not a multiple of the {f.name} block size {bs}")
    skipped.append(f"{path} (K={k} not a multiple of {bs})")
    return False


def _quantize_leaf(path, leaf, f, kw, axis, strict, skipped):
    """leaf as a QArray blocked along its contraction axis. A leaf of more than 2 axes is a
    stack of layers' (2-D) kernels on its leading axes: each is quantized on its own
    (``jax.vmap``; nvfp4: a tensor scale per layer), so that ``lax.scan`` over the leading
    axis hands each layer its own 2-D QArray; the axis rules apply to the layer's kernel."""
    matrix = leaf if leaf.ndim == 2 else jax.ShapeDtypeStruct(tuple(leaf.shape[-2:]), leaf.dtype)
    ax = _resolve_axis(axis, path, matrix)
    if not _fits_block(path, f"contraction axis {ax} has length", matrix.shape[ax], f,
                       kw["block_size"], strict, skipped):
        return leaf
    x = jnp.asarray(leaf)
    if x.dtype == jnp.float64:
        x = x.astype(jnp.float32)

    def one(m):
        return quantize(m, f.name, axis=ax, **kw)

    for _ in range(x.ndim - 2):
        one = jax.vmap(one)
    return one(x)


# ----------------------------------------------------------------------------- public
def transpose_2d(q: QArray) -> QArray:
    """The transpose of a 2-D QArray, without touching its buffers.

    A (K, N) QArray blocked along axis 0 and an (N, K) QArray blocked along axis 1 store
    the same codes and scales (blocked axis last: (N, K*bits/8)), so this only swaps the
    logical shape and the axis. Used to hand a Flax kernel to
    :func:`jax_fp4.scaled_matmul` (which takes B as (N, K)), and to load PyTorch
    (out, in) checkpoints into Flax (in, out) kernels.

    Raises:
      ValueError: q is not 2-D, or has swizzled scales (their 128-row tiles follow rows;
        the "tiled" layout of jax_fp4.prepare is defined on the stored buffers and
        transposes as they do).
    """
    if not isinstance(q, QArray):
        raise TypeError(f"q: expected a QArray, got {type(q).__name__}")
    if q.ndim != 2:
        raise ValueError(f"q: expected a 2-D QArray, got shape {q.shape}")
    if q.scale_layout == "swizzled":
        raise ValueError("q: transposing needs scale_layout 'linear' or 'tiled', got 'swizzled'")
    children, aux = q.tree_flatten()
    fmt, axis, shape, dtype, bs, layout = aux
    return QArray.tree_unflatten(
        (fmt, 1 - q.axis, (q.shape[1], q.shape[0]), dtype, bs, layout), children)


# ----------------------------------------------------------------------------- compute
def check_act_options(weight_format: str, act_format: Optional[str], act_mode: str,
                      block_size: Optional[int] = None) -> None:
    """Validate activation-quantization options for a layer (raises ValueError)."""
    if act_mode not in ACT_MODES:
        raise ValueError(f"act_mode: expected one of {ACT_MODES}, got {act_mode!r}")
    if act_format is None:
        return
    af = get_format(act_format)
    if not af.minifloat_scales:
        raise ValueError(f"act_format: activations take nvfp4 or an MX format, got "
                         f"{act_format!r}")
    if act_mode == "scaled":
        wf = get_format(weight_format)
        if wf.family != af.family:
            raise ValueError(
                f"act_mode: 'scaled' (block-scaled W4A4/W8A8 via jax_fp4.scaled_matmul) pairs "
                f"nvfp4 with nvfp4 and MX with MX, got weights {wf.name!r} and activations "
                f"{af.name!r}; use act_mode='fake'")
        if block_size is not None and block_size != wf.default_block:
            raise ValueError(f"act_mode: 'scaled' needs the default block size "
                             f"{wf.default_block}, got {block_size}")


def act_tensor_scale(x, act_scale):
    """NVFP4 activation tensor scale: the calibrated ``act_scale`` where it is > 0, else
    the dynamic amax(x)/2688 of this call (float32 scalar)."""
    dyn = tensor_scale_from_amax(jnp.max(jnp.abs(x)).astype(jnp.float32))
    if act_scale is None:
        return dyn
    s = jnp.asarray(act_scale, jnp.float32)
    return jnp.where(s > 0, s, dyn)


def linear(x, kernel: QArray, bias=None, *, contract_axis: int = 0,
           act_format: Optional[str] = None, act_mode: str = "fake", act_scale=None,
           precision=None, preferred_element_type=None):
    """A quantized dense layer ``y = x @ W + b`` with W a 2-D QArray.

    Args:
      x: (..., K) float array (float32/bfloat16/float16).
      kernel: QArray, (K, N) blocked along axis 0 (``contract_axis=0``, Flax) or (N, K)
        blocked along axis 1 (``contract_axis=1``, PyTorch/Equinox).
      bias: (N,) array or None.
      act_format: None (weight-only, W4A16: the weight is decoded to x's dtype and products
        accumulate in float32, :func:`jax_fp4.dot_general`), or "nvfp4" / an MX format
        to quantize the activations along K as well.
      act_mode: "fake": activations are fake-quantized (:func:`jax_fp4.fake_quantize`)
        then multiplied as W4A16 (any weight format); "scaled": activations are quantized
        and the block-scaled :func:`jax_fp4.scaled_matmul` runs W4A4/W8A8 (weights must be
        of the same family: nvfp4 with nvfp4, MX with MX).
      act_scale: nvfp4 activations: calibrated per-tensor decode scale (float32 scalar);
        None or 0 means dynamic, amax(x)/2688 per call.
    Returns:
      (..., N) array of x's dtype (or ``preferred_element_type``); products accumulate in
      float32.
    """
    k = kernel.shape[contract_axis]
    if x.shape[-1] != k:
        raise ValueError(f"x: expected last dimension {k} (the kernel's contraction axis), "
                         f"got shape {tuple(x.shape)}")
    dims = (((x.ndim - 1,), (contract_axis,)), ((), ()))
    # the kernel follows the activations' dtype (as a float layer casts its kernel)
    preferred_element_type = preferred_element_type or x.dtype
    if act_format is None:
        y = dot_general(x, kernel, dims, precision=precision,
                        preferred_element_type=preferred_element_type)
    else:
        af = get_format(act_format)
        ts = act_tensor_scale(x, act_scale) if af.has_tensor_scale else None
        if act_mode == "fake":
            xq = fake_quantize(x, af.name, axis=-1, tensor_scale=ts)
            y = dot_general(xq, kernel, dims, precision=precision,
                            preferred_element_type=preferred_element_type)
        else:
            w_nk = kernel if contract_axis == 1 else transpose_2d(kernel)
            lead = x.shape[:-1]
            a = quantize(x.reshape(-1, k), af.name, axis=1, tensor_scale=ts)
            y = scaled_matmul(a, w_nk, out_dtype=preferred_element_type)
            y = y.reshape(lead + (y.shape[-1],))
    if bias is not None:
        y = y + jnp.asarray(bias).astype(y.dtype)
    return y
