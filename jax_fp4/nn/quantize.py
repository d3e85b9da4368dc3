"""Parameter quantization of whole models: :func:`quantize_params` on a plain pytree, a
Flax NNX ``State`` or module, or an Equinox model (the leaf rules: :mod:`jax_fp4.nn.params`;
the module rules: :mod:`jax_fp4.nn.flax`, :mod:`jax_fp4.nn.equinox`; other rounding
methods: :mod:`jax_fp4.ptq`). The framework modules are imported only for trees of theirs.
"""
from __future__ import annotations

import sys
import warnings
from typing import Optional

import jax

from ..qarray import QArray
from ..tree_paths import path_str
from .params import Filter, _fits_block, _make_filter, _quant_kwargs, _quantize_leaf

__all__ = ["quantize_params"]


def quantize_params(tree, format: str = "nvfp4", *, filter: Filter = None, axis=None,
                    block_size: Optional[int] = None, tensor_scale="auto",
                    scale_rounding: str = "floor", scale_dtype=None, strict: bool = False,
                    act_format: Optional[str] = None, act_mode: str = "fake",
                    prepare: Optional[bool] = None, method: str = "rtn", calibration=None,
                    ptq_options: Optional[dict] = None, stacked: bool = False):
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
        quantized (more with ``stacked``).
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
        kernel, which reads that layout as it is, runs on the default device (an sm_90
        GPU and a build for sm_90a), else not. A weight whose contraction axis is split
        over devices stays linear either way (:func:`jax_fp4.prepare`).
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
      stacked: plain trees and NNX ``State``, method "rtn": also quantize selected float
        leaves of more than 2 axes as layers' kernels stacked on their leading axes (the
        parameters of a model scanned over its layers: Linen ``nn.scan``, ``nnx.scan``,
        MaxText's scanned layers), each layer on its own (``jax.vmap`` of
        :func:`jax_fp4.quantize`; nvfp4: one tensor scale per layer, as per-layer
        checkpoints hold) into one QArray whose leaves keep the leading axes, so that
        ``lax.scan`` hands each layer its own 2-D QArray. ``axis`` then applies to each
        layer's kernel (the last two axes). Without it such leaves stay float, with a
        warning (convolution kernels are the other kind of leaf it names).
    Returns:
      a pytree of the same structure with QArray leaves (or a new module).
    Raises:
      ValueError: unknown format; a contraction axis that cannot be inferred; with
        ``strict``, a kernel that does not block evenly; ``act_format`` for a plain tree;
        ``stacked`` with a method other than "rtn".
      TypeError: a filter of the wrong type.
    """
    f, kw = _quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    if prepare is None:
        from ..prims.wmatmul import prepared_layout_native

        prepare = prepared_layout_native()
    if method != "rtn" or calibration is not None or ptq_options is not None:
        if stacked:
            raise ValueError(f"stacked: stacked layers are rounded to nearest only (method "
                             f"'rtn', no calibration or ptq_options), got method={method!r}"
                             + (", a calibration" if calibration is not None else "")
                             + (", ptq_options" if ptq_options is not None else ""))
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
            if stacked:
                raise ValueError("stacked: applies to parameter trees (e.g. nnx.state(model)), "
                                 "not to an NNX module, whose nnx.Linear layers are replaced")
            from .flax import quantize_model

            model = quantize_model(tree, format, filter=filter, block_size=block_size,
                                   tensor_scale=tensor_scale, scale_rounding=scale_rounding,
                                   scale_dtype=scale_dtype, strict=strict,
                                   act_format=act_format, act_mode=act_mode)
            if prepare:
                nnx.update(model, _prepared(nnx.state(model)))
            return model
    pred = _make_filter(filter, stacked)
    # what stacked=True would add, to warn about (a user's callable filter is not asked
    # about leaves it was never given)
    stacks = (_make_filter(filter, True) if not stacked and (filter is None or
                                                             isinstance(filter, str)) else None)
    skipped: list = []
    unstacked: list = []
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
        if isinstance(leaf, QArray):
            return leaf
        if not pred(p, leaf):
            if stacks is not None and stacks(p, leaf):
                unstacked.append(f"{p} {tuple(leaf.shape)}")
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
    if unstacked:
        warnings.warn(f"quantize_params: left {len(unstacked)} selected leaf / leaves of more "
                      f"than 2 axes unquantized (layers stacked by a scanned model: pass "
                      f"stacked=True; convolution kernels stay float): "
                      + ", ".join(unstacked), stacklevel=2)
    return _prepared(out) if prepare else out


def _prepared(tree):
    """Every QArray of a pytree through :func:`jax_fp4.prepare`."""
    from ..ops import prepare

    return jax.tree_util.tree_map(lambda x: prepare(x) if isinstance(x, QArray) else x, tree,
                                  is_leaf=lambda x: isinstance(x, QArray))
