"""Framework-neutral parameter quantization and the quantized-linear computation.

:func:`quantize_params` turns the 2-D kernels of any parameter pytree into
:class:`~jax_fp4.QArray` s blocked along the contraction axis; :func:`linear` is the one
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
import sys
import warnings
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import get_format
from ..ops import (dot_general, fake_quantize, quantize, scaled_matmul,
                   tensor_scale_from_amax)
from ..qarray import QArray

__all__ = ["quantize_params", "default_filter", "contraction_axis", "path_str",
           "transpose_2d", "linear", "ACT_MODES", "KERNEL_NAMES", "DEFAULT_EXCLUDE"]

#: leaf names taken to be dense-layer kernels by the default filter
KERNEL_NAMES = ("kernel", "weight")
#: paths the default filter leaves alone (embedding tables are looked up, not contracted)
DEFAULT_EXCLUDE = r"(?i)embed"
#: how a quantized linear layer treats its input activations
ACT_MODES = ("fake", "scaled")

Filter = Union[None, str, Callable[[str, Any], bool]]


# ----------------------------------------------------------------------------- paths
def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    """A pytree key path as a dotted name: ``('params', 'Dense_0', 'kernel')`` ->
    ``"params.Dense_0.kernel"``.

    The ``value`` attribute of a Flax NNX Variable is dropped, so an NNX state leaf reads
    ``"layers.0.kernel"``.
    """
    parts = [_key_str(k) for k in path]
    # nnx.Variable flattens as GetAttrKey('value'); QArray children never reach here
    parts = [p for i, p in enumerate(parts)
             if not (p == "value" and type(path[i]).__name__ == "GetAttrKey")]
    return ".".join(parts)


def _leaf_name(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def contraction_axis(path: str, leaf=None) -> Optional[int]:
    """The contraction axis of a 2-D kernel from its name (module docstring).

    Returns:
      0 for a name ending in ``kernel`` (Flax, (in, out)), 1 for ``weight`` (PyTorch /
      Equinox, (out, in)), None when the name says neither.
    """
    name = _leaf_name(path)
    if name == "kernel":
        return 0
    if name == "weight":
        return 1
    return None


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
    return (_is_float_array(leaf) and len(leaf.shape) == 2
            and _leaf_name(path) in KERNEL_NAMES and not re.search(DEFAULT_EXCLUDE, path))


def _make_filter(filter: Filter) -> Callable[[str, Any], bool]:
    if filter is None:
        return default_filter
    if isinstance(filter, str):
        try:
            rx = re.compile(filter)
        except re.error as e:
            raise ValueError(f"filter: not a valid regular expression {filter!r}: {e}") from None
        return lambda p, x: (_is_float_array(x) and len(x.shape) == 2
                             and rx.search(p) is not None)
    if callable(filter):
        return lambda p, x: _is_float_array(x) and len(x.shape) == 2 and bool(filter(p, x))
    raise TypeError(f"filter: expected None, a regex string or a callable (path, leaf) -> "
                    f"bool, got {type(filter).__name__}")


# ----------------------------------------------------------------------------- leaves
def _quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype):
    f = get_format(format)
    kw = dict(block_size=block_size)
    if f.family == "nvfp4":
        kw["tensor_scale"] = tensor_scale
    if f.family == "mx":
        kw["scale_rounding"] = scale_rounding
    if f.family == "int4" and scale_dtype is not None:
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
    ax = _resolve_axis(axis, path, leaf)
    if not _fits_block(path, f"contraction axis {ax} has length", leaf.shape[ax], f,
                       kw["block_size"], strict, skipped):
        return leaf
    x = jnp.asarray(leaf)
    if x.dtype == jnp.float64:
        x = x.astype(jnp.float32)
    return quantize(x, f.name, axis=ax, **kw)


# ----------------------------------------------------------------------------- public
def quantize_params(tree, format: str = "nvfp4", *, filter: Filter = None, axis=None,
                    block_size: Optional[int] = None, tensor_scale="auto",
                    scale_rounding: str = "floor", scale_dtype=None, strict: bool = False,
                    act_format: Optional[str] = None, act_mode: str = "fake",
                    prepare: Optional[bool] = None, method: str = "rtn", calibration=None,
                    ptq_options: Optional[dict] = None):
    """Quantize the dense-layer kernels of a parameter pytree into QArrays.

    Works on any pytree: a plain dict, a Flax Linen ``params`` dict, a Flax NNX ``State``
    (``nnx.state(model)``), a dict of tensors loaded from safetensors, an Equinox model,
    or a Flax NNX module. Leaves are named by their dotted key path (:func:`path_str`).

    * Plain trees and NNX ``State``: each selected 2-D float leaf becomes a
      :class:`~jax_fp4.QArray` blocked along its contraction axis; everything else is
      returned unchanged. An NNX state converted this way merges into a model built with
      :class:`jax_fp4.nn.flax.QuantizedLinear` of the same format (``nnx.merge``).
    * An NNX module: returns a copy whose ``nnx.Linear`` layers are
      :class:`jax_fp4.nn.flax.QuantizedLinear` (:func:`jax_fp4.nn.flax.quantize_model`).
    * An Equinox model: each ``equinox.nn.Linear`` becomes a
      :class:`jax_fp4.nn.equinox.QuantizedLinear`; ``equinox.nn.Embedding`` is left alone
      (decided by layer type, not name).

    Args:
      tree: the pytree.
      format: any format of :data:`jax_fp4.FORMAT_NAMES`.
      filter: which leaves to quantize. None: :func:`default_filter` (2-D leaves named
        ``kernel``/``weight`` outside ``embed`` paths); a regex searched in the dotted
        path; or a callable ``(path, leaf) -> bool``. Only 2-D float arrays are ever
        quantized.
      axis: the contraction (blocked) axis. None: from the leaf name (``kernel`` -> 0,
        Flax (in, out); ``weight`` -> 1, PyTorch/Equinox (out, in)); an int; or a
        callable ``(path, leaf) -> int``.
      block_size: block size (default: the format's).
      tensor_scale: nvfp4 only (ignored otherwise): "auto" (default, two-level NVFP4 with
        the per-tensor decode scale amax/2688), None (one level) or a float32 scalar.
      scale_rounding: MX only: "floor" or "rceil".
      scale_dtype: int4 only: dtype of the group scales (default the kernel's dtype).
      strict: raise instead of skipping a selected kernel whose contraction axis is not a
        multiple of the block size (skipped kernels are reported with a warning).
      act_format, act_mode: for module trees (NNX, Equinox) only: activation quantization
        of the new layers (see :func:`linear`).
      prepare: store the new QArrays in the fused W4A16 kernel's layout
        (:func:`jax_fp4.prepare`: 4-bit weights with N and K multiples of 128 where
        jax_fp4.layout.tileable allows; bit-identical results, faster on a Hopper GPU at
        every M measured, a copy per call elsewhere). None (default): where the wgmma
        kernel can run on the default device (``jax_fp4.primitives.wgmma_available()``:
        an sm_90 GPU and a build for sm_90a), else not.
      method: how the weights are rounded (:mod:`jax_fp4.ptq`, docs/ptq.md): "rtn"
        (round to nearest, default), "mse" (MSE-optimal block scales), "gptq" (GPTQ
        error feedback; needs ``calibration``), "awq" (activation-aware channel scaling
        where a ScaleGroup folds, plus activation-weighted MSE scales) or "awq+gptq"
        (AWQ's channel scaling, then GPTQ). Plain trees and Flax NNX models; the stored
        QArrays are the same kind for every method.
      calibration: the inputs of each dense layer, for "gptq" / "awq" / "awq+gptq": a
        :class:`jax_fp4.ptq.Calibration` (batches and a forward function; NNX models), or
        ``{kernel path: activations (..., K) | jax_fp4.ptq.LayerStats}``.
      ptq_options: method options: ``damp`` (GPTQ dampening, 0.01), ``act_order``
        (False), ``scale_search`` ("mse" or "rtn": GPTQ's block scales), ``sequential``
        (True: with a Calibration, GPTQ quantizes one block of a layer stack at a time,
        each block calibrated on the outputs of the already quantized ones),
        ``awq_groups`` (a sequence of :class:`jax_fp4.ptq.ScaleGroup`; default for the
        MiniLM BertModel: :func:`jax_fp4.ptq.bert_groups`), ``progress`` (tqdm bars,
        True).
    Returns:
      a pytree of the same structure with QArray leaves (or a new module).
    Raises:
      ValueError: unknown format; a contraction axis that cannot be inferred; with
        ``strict``, a kernel that does not block evenly; ``act_format`` for a plain tree.
      TypeError: a filter of the wrong type.
    """
    f, kw = _quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    if prepare is None:
        from ..primitives import wgmma_available

        prepare = wgmma_available()
    if method != "rtn" or calibration is not None or ptq_options is not None:
        from ..ptq.api import quantize_params_ptq

        out = quantize_params_ptq(tree, f.name, method=method, calibration=calibration,
                                  options=ptq_options, filter=filter, axis=axis,
                                  block_size=block_size, tensor_scale=tensor_scale,
                                  scale_rounding=scale_rounding, scale_dtype=scale_dtype,
                                  strict=strict, act_format=act_format, act_mode=act_mode)
        if prepare and "flax" in sys.modules:
            from flax import nnx

            if isinstance(out, nnx.Module):
                nnx.update(out, _prepared(nnx.state(out)))
                return out
        return _prepared(out) if prepare else out
    if "flax" in sys.modules:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            from .flax import quantize_model

            model = quantize_model(tree, format, filter=filter, block_size=block_size,
                                   tensor_scale=tensor_scale, scale_rounding=scale_rounding,
                                   scale_dtype=scale_dtype, strict=strict,
                                   act_format=act_format, act_mode=act_mode)
            if prepare:
                nnx.update(model, _prepared(nnx.state(model)))
            return model
    pred = _make_filter(filter)
    skipped: list = []
    eqx_types: tuple = ()
    if "equinox" in sys.modules:
        import equinox as eqx

        from .equinox import QuantizedLinear as EqxQuantizedLinear

        eqx_types = (eqx.nn.Linear, eqx.nn.Embedding, EqxQuantizedLinear)
    is_module_tree = False

    def visit(path, leaf):
        nonlocal is_module_tree
        p = path_str(path)
        if eqx_types and isinstance(leaf, eqx_types):
            is_module_tree = True
            if isinstance(leaf, eqx_types[0]):  # equinox.nn.Linear
                wpath = f"{p}.weight" if p else "weight"
                if not pred(wpath, leaf.weight):
                    return leaf
                if not _fits_block(wpath, "in_features", leaf.weight.shape[1], f, block_size,
                                   strict, skipped):
                    return leaf
                return EqxQuantizedLinear.from_linear(
                    leaf, format, block_size=block_size, tensor_scale=tensor_scale,
                    scale_rounding=scale_rounding, scale_dtype=scale_dtype,
                    act_format=act_format, act_mode=act_mode, name=p)
            return leaf  # embeddings, already-quantized layers
        if isinstance(leaf, QArray) or not pred(p, leaf):
            return leaf
        return _quantize_leaf(p, leaf, f, kw, axis, strict, skipped)

    out = jax.tree_util.tree_map_with_path(
        visit, tree, is_leaf=lambda x: isinstance(x, QArray) or
        (bool(eqx_types) and isinstance(x, eqx_types)))
    if act_format is not None and not is_module_tree:
        raise ValueError("act_format: activation quantization applies to layers (a Flax NNX "
                         "or Equinox model), not to a plain parameter tree; got "
                         f"{type(tree).__name__}")
    if skipped:
        warnings.warn(f"quantize_params: left {len(skipped)} kernel(s) unquantized: "
                      + ", ".join(skipped), stacklevel=2)
    return _prepared(out) if prepare else out


def _prepared(tree):
    """Every QArray of a pytree through :func:`jax_fp4.prepare`."""
    from ..ops import prepare

    return jax.tree_util.tree_map(lambda x: prepare(x) if isinstance(x, QArray) else x, tree,
                                  is_leaf=lambda x: isinstance(x, QArray))


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
    if af.family not in ("nvfp4", "mx"):
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
        ts = act_tensor_scale(x, act_scale) if af.family == "nvfp4" else None
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
