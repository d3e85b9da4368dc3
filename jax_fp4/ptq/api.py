"""quantize_params(..., method=...) beyond round-to-nearest: the driver that picks the
statistics, folds AWQ scales and quantizes each selected kernel with its method."""
from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from ..qarray import QArray
from ._common import QuantSpec
from .awq import apply_scales, bert_groups, search_scales
from .calibration import Calibration, LayerStats, collect_stats, stats_from_activations
from .group import quantize_group

__all__ = ["METHODS", "CALIBRATED", "quantize_params_ptq"]

#: post-training quantization methods of quantize_params
METHODS = ("rtn", "mse", "gptq", "awq", "awq+gptq")
#: the methods that need calibration statistics
CALIBRATED = ("gptq", "awq", "awq+gptq")
_OPTIONS = ("damp", "act_order", "scale_search", "awq_groups", "sequential", "progress")


def _check_options(method, options):
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    options = dict(options or {})
    bad = set(options) - set(_OPTIONS)
    if bad:
        raise ValueError(f"ptq_options: unknown keys {sorted(bad)}; expected some of "
                         f"{_OPTIONS}")
    return options


def _stats_of(calibration, model=None, progress=True) -> Dict[str, LayerStats]:
    if calibration is None:
        return {}
    if isinstance(calibration, Calibration):
        if model is None:
            raise ValueError("calibration: a Calibration (batches, forward) needs a Flax NNX "
                             "model; for a parameter tree pass {kernel path: activations "
                             "or LayerStats}")
        return collect_stats(model, calibration.batches, calibration.forward,
                             calibration.mask, progress=progress)
    if isinstance(calibration, dict):
        return stats_from_activations(calibration)
    raise TypeError(f"calibration: expected None, a jax_fp4.ptq.Calibration or a dict "
                    f"{{kernel path: activations | LayerStats}}, got "
                    f"{type(calibration).__name__}")


def _ptq_flat(flat, selected, spec, method, stats, options, progress=True):
    """Quantize the ``selected`` {path: axis} entries of ``flat`` {path: array}; returns
    the new dict (AWQ also rescales the groups' producers)."""
    _check_stats(selected, method, stats)
    flat, stats = _fold_awq(flat, selected, spec, method, stats, options)
    return _quantize_flat(flat, selected, spec, method, stats, options, progress)


def _check_stats(selected, method, stats):
    missing = [p for p in selected if p not in stats]
    if missing and method in ("gptq", "awq+gptq"):
        raise ValueError(f"calibration: no input statistics for {missing[:3]} "
                         f"({len(missing)} kernel(s)); GPTQ needs every quantized layer's: "
                         "select only the layers the calibration pass reaches (filter= / "
                         "jax-fp4 quantize --filter REGEX)")


def _fold_awq(flat, selected, spec, method, stats, options):
    """AWQ ("awq", "awq+gptq"): search each group's channel scales and fold them; returns
    (flat, stats) with the kernels, producers and the kernels' input statistics scaled."""
    stats = dict(stats)
    if method not in ("awq", "awq+gptq"):
        return flat, stats
    axes = dict(selected)
    for g in options.get("awq_groups") or ():
        if not all(p in selected and p in stats for p in g.kernels):
            continue
        if not all(p in flat for p, _ in g.producers):
            raise ValueError(f"awq_groups: producer paths {[p for p, _ in g.producers]} "
                             "not all in the tree")
        s, _, _ = search_scales([flat[p] for p in g.kernels], [axes[p] for p in g.kernels],
                                stats[g.kernels[0]], spec)
        flat = apply_scales(flat, g, s, axes)
        for p in g.kernels:
            stats[p] = stats[p].scaled_inputs(s)
    return flat, stats


def _quantize_flat(flat, selected, spec, method, stats, options, progress, bar=None):
    """Quantize the ``selected`` entries of ``flat`` (AWQ already folded): one jitted call
    per (shape, axis, dtype); returns the new dict."""
    groups: dict = {}
    for p, ax in selected.items():
        groups.setdefault((tuple(np.shape(flat[p])), ax, jnp.dtype(flat[p].dtype)), []).append(p)
    own_bar = bar is None and progress
    if own_bar:
        bar = _bar(len(selected), method)
    out = dict(flat)
    for (_, ax, _), paths in groups.items():
        st = [stats[p] for p in paths] if all(p in stats for p in paths) else None
        # awq+gptq: GPTQ of the AWQ-scaled weights with the scaled inputs' statistics
        qs = quantize_group([flat[p] for p in paths], ax, spec,
                            "gptq" if method == "awq+gptq" else method, st,
                            damp=options.get("damp", 0.01),
                            act_order=options.get("act_order", False),
                            scale_search=options.get("scale_search", "mse"))
        out.update(zip(paths, qs))
        if bar is not None:
            bar.update(len(paths))
    if own_bar and bar is not None:
        bar.close()
    return out


def _bar(total, method):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"quantize ({method})", unit="layer", file=sys.stderr,
                leave=False)


def quantize_params_ptq(tree, format, *, method, calibration, options, filter, axis,
                        block_size, tensor_scale, scale_rounding, scale_dtype, strict,
                        act_format, act_mode, progress=True):
    """:func:`jax_fp4.nn.quantize_params` for ``method`` other than "rtn" (its docstring)."""
    from ..nn import params as P

    options = _check_options(method, options)
    spec = QuantSpec.make(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    if "flax" in sys.modules:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            return _ptq_nnx(tree, spec, method, calibration, options, filter, strict,
                            act_format, act_mode, options.get("progress", progress))
    if "equinox" in sys.modules:
        import equinox as eqx

        if any(isinstance(x, eqx.Module) for x in jax.tree_util.tree_leaves(
                tree, is_leaf=lambda x: isinstance(x, eqx.Module))):
            raise ValueError(f"method: {method!r} takes a parameter tree or a Flax NNX "
                             "model; quantize an Equinox model's weights as a tree "
                             "(equinox.partition) or use method='rtn'")
    if act_format is not None:
        raise ValueError("act_format: activation quantization applies to layers (a Flax NNX "
                         f"model), not to a plain parameter tree; got {type(tree).__name__}")
    pred = P._make_filter(filter)
    flat, selected, skipped = {}, {}, []
    for path, leaf in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: isinstance(x, QArray)):
        p = P.path_str(path)
        flat[p] = leaf
        if isinstance(leaf, QArray) or not pred(p, leaf):
            continue
        ax = P._resolve_axis(axis, p, leaf)
        if P._fits_block(p, f"contraction axis {ax} has length", leaf.shape[ax], spec.format,
                         spec.block_size, strict, skipped):
            selected[p] = ax
    stats = _stats_of(calibration) if method in CALIBRATED else {}
    new = _ptq_flat(flat, selected, spec, method, stats, options,
                    options.get("progress", progress))
    if skipped:
        warnings.warn(f"quantize_params: left {len(skipped)} kernel(s) unquantized: "
                      + ", ".join(skipped), stacklevel=3)
    return jax.tree_util.tree_map_with_path(lambda path, x: new[P.path_str(path)], tree,
                                            is_leaf=lambda x: isinstance(x, QArray))


def _ptq_nnx(model, spec, method, calibration, options, filter, strict, act_format,
             act_mode, progress):
    from flax import nnx

    from ..models.minilm import BertModel
    from ..nn import params as P
    from ..nn.flax import QuantizedLinear, _set_module

    P.check_act_options(spec.name, act_format, act_mode, spec.block_size)
    if (method in ("awq", "awq+gptq") and "awq_groups" not in options
            and isinstance(model, BertModel)):
        options["awq_groups"] = bert_groups(model.config.num_hidden_layers, "flax")
    pred = P._make_filter(filter)
    sequential = (options.get("sequential", True) and method in ("gptq", "awq+gptq")
                  and isinstance(calibration, Calibration))
    if sequential:  # several passes over the batches
        calibration = dataclasses.replace(calibration, batches=list(calibration.batches))
    stats = _stats_of(calibration, model, progress) if method in CALIBRATED else {}
    model = nnx.clone(model)
    linears, selected, skipped = {}, {}, []
    for path, m in nnx.iter_modules(model):
        if type(m) is not nnx.Linear or not path:
            continue
        name = ".".join(map(str, path))
        kp = f"{name}.kernel"
        if not pred(kp, m.kernel.get_value()):
            continue
        if P._fits_block(kp, "in_features", m.in_features, spec.format, spec.block_size,
                         strict, skipped):
            linears[kp] = (path, m, name)
            selected[kp] = 0
    state = nnx.state(model, nnx.Param)
    flat = {P.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    _check_stats(selected, method, stats)
    flat, stats = _fold_awq(flat, selected, spec, method, stats, options)
    # the float model with AWQ's scales folded: the same function
    nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: flat[P.path_str(p)],
                                                       state))
    if sequential:
        stages = _stages([p for p in stats if p in selected])
    else:
        stages = [list(selected)]
    bar = _bar(len(selected), method) if progress else None
    for i, stage in enumerate(stages):
        if i:  # the inputs of this stage as the already quantized stages produce them
            stats.update(collect_stats(model, calibration.batches, calibration.forward,
                                       calibration.mask, progress=False, paths=stage))
        new = _quantize_flat(flat, {p: 0 for p in stage}, spec, method, stats, options,
                             progress, bar)
        for kp in stage:
            path, m, name = linears[kp]
            bias = m.bias.get_value() if m.bias is not None else None
            q = QuantizedLinear(m.in_features, m.out_features, use_bias=bias is not None,
                                dtype=m.dtype, param_dtype=m.param_dtype,
                                precision=m.precision,
                                preferred_element_type=getattr(m, "preferred_element_type",
                                                               None),
                                kernel=new[kp], bias=bias, format=spec.name,
                                block_size=spec.block_size, act_format=act_format,
                                act_mode=act_mode, name=name)
            _set_module(model, path, q)
    if bar is not None:
        bar.close()
    if skipped:
        warnings.warn(f"quantize_params: left {len(skipped)} layer(s) unquantized: "
                      + ", ".join(skipped), stacklevel=3)
    return model


def _stages(paths):
    """Sequential GPTQ's stages: the kernel paths (in the forward pass's call order) grouped
    by their prefix up to the first list index ("layers.3"; a path without one is its own
    stage), so each block of a layer stack is one stage, in call order."""
    stages: dict = {}
    for p in paths:
        parts = p.split(".")
        i = next((j for j, x in enumerate(parts) if x.isdigit()), None)
        stages.setdefault(p if i is None else ".".join(parts[:i + 1]), []).append(p)
    return list(stages.values())
