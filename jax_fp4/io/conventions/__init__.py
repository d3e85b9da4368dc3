"""Checkpoint conventions of the PyTorch ecosystem: detect, load and save.

One module per convention (``compressed_tensors``, ``modelopt``, ``bnb``, ``awq``,
``gptq``, ``lightx2v``), each with ``detect(ckpt)``, ``load(ckpt)`` and ``save(flat)``;
this package picks one and turns the rest of the checkpoint into plain arrays. See
docs/interop.md for the tensor layouts and how each maps onto QArrays.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ...qarray import QArray
from .. import safetensors as _st
from ..safetensors import CheckpointError
from . import awq, bnb, compressed_tensors, gptq, lightx2v, modelopt
from ._common import CONFIG_META_KEY, read_checkpoint

NATIVE = "jax_fp4"
#: auto-detection order: config-declared conventions first, then tensor names
_MODULES = (compressed_tensors, modelopt, bnb, lightx2v, awq, gptq)
CONVENTIONS = (NATIVE,) + tuple(m.NAME for m in _MODULES)
_BY_NAME = {m.NAME: m for m in _MODULES}
_QUANT_METHODS = {"compressed-tensors": compressed_tensors, "modelopt": modelopt,
                  "bitsandbytes": bnb, "awq": awq, "gptq": gptq}

__all__ = ["CONVENTIONS", "detect", "load", "save"]


def _check_convention(convention, allow_auto):
    names = CONVENTIONS + (("auto",) if allow_auto else ())
    if convention not in names:
        raise ValueError(f"convention: expected one of {', '.join(names)}, got {convention!r}")


def _native_file(path) -> bool:
    if os.path.isdir(path):
        return False
    _, meta, _ = _st.read_header(path)
    raw = meta.get(_st.METADATA_KEY)
    return bool(raw) and raw != "{}"


def detect(path) -> str:
    """The convention of a checkpoint file or HF model directory.

    Order: a jax-fp4 file (QArray metadata); config.json's ``quantization_config.quant_method``
    (or ``hf_quant_config.json`` for ModelOpt); then tensor names and shapes
    (``weight_packed`` -> compressed-tensors, ``weight_scale_2`` -> modelopt,
    ``quant_state.bitsandbytes__*`` -> bitsandbytes, ``weight_global_scale`` beside a uint8
    ``weight`` -> lightx2v, ``qweight`` -> awq when packed along the output axis, else gptq);
    otherwise "jax_fp4" (plain tensors).

    Raises:
      FileNotFoundError: no such path; CheckpointError: corrupt file, or a config naming a
      quant_method jax-fp4 does not read.
    """
    path = os.fspath(path)
    if _native_file(path):
        return NATIVE
    return _detect(read_checkpoint(path))


def _detect(ckpt) -> str:
    qm = ckpt.quantization_config.get("quant_method")
    if qm is not None:
        if qm not in _QUANT_METHODS:
            raise CheckpointError(f"{ckpt.where}: quantization_config.quant_method {qm!r} is "
                                  f"not supported (jax-fp4 reads {', '.join(_QUANT_METHODS)})")
        return _QUANT_METHODS[qm].NAME
    for m in _MODULES:
        if m.detect(ckpt):
            return m.NAME
    return NATIVE


def _to_jax(a):
    a = np.asarray(a)
    if a.dtype.itemsize == 8 and a.dtype.kind in "iuf" and not jax.config.jax_enable_x64:
        return a  # kept as NumPy so nothing is silently narrowed
    return jnp.asarray(a)


def load(path, convention: str = "auto") -> Dict[str, Any]:
    """Read a checkpoint of any supported convention into {name: array | QArray}.

    Args:
      path: a safetensors file, or a Hugging Face model directory (``model.safetensors``
        or shards listed in ``model.safetensors.index.json``, with ``config.json`` /
        ``hf_quant_config.json``).
      convention: "auto" (see :func:`detect`) or one of :data:`CONVENTIONS`.
    Returns:
      {tensor name: jax array or QArray}. Each quantized Linear ``p`` becomes one QArray
      ``p.weight`` of logical shape (out, in) blocked along axis 1 whose dequantized values
      are the source library's own (docs/interop.md); other tensors are returned as they
      are stored.
    Raises:
      FileNotFoundError: no such path. CheckpointError: corrupt or inconsistent input, a
      tensor missing or of the wrong dtype/shape (naming it, expected vs found); nothing
      is returned half-way.
    """
    _check_convention(convention, True)
    path = os.fspath(path)
    if convention == NATIVE or (convention == "auto" and _native_file(path)):
        return _st.load(path)
    ckpt = read_checkpoint(path)
    name = _detect(ckpt) if convention == "auto" else convention
    if name == NATIVE:
        if os.path.isdir(path):
            return {k: _to_jax(v) for k, v in ckpt.tensors.items()}
        return _st.load(path)
    quantized = _BY_NAME[name].load(ckpt)
    if not quantized:
        raise CheckpointError(f"{path}: no quantized Linear of the {name} convention found")
    out = dict(quantized)
    for k, v in ckpt.tensors.items():  # what the convention left: plain tensors
        if k in out:
            raise CheckpointError(f"{path}: tensor {k!r} is both stored and produced by "
                                  f"dequantizing a {name} layer")
        out[k] = _to_jax(v)
    return out


def _flatten(tree) -> Dict[str, Any]:
    from ...tree_paths import path_str

    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, QArray))[0]
    flat = {}
    for p, leaf in leaves:
        name = path_str(p)
        if not name:
            raise ValueError("tree: expected a container of arrays, got a bare leaf")
        if name in flat:
            raise ValueError(f"tree: two leaves map to the tensor name {name!r}")
        flat[name] = leaf
    return flat


def save(path, tree, convention: str = NATIVE, *, metadata: Optional[Dict[str, str]] = None,
         config: Optional[dict] = None) -> None:
    """Write ``tree`` in a checkpoint convention.

    Args:
      path: for "jax_fp4", a file (exactly :func:`jax_fp4.io.safetensors.save`). For the
        other conventions: a path ending in ``.safetensors`` writes that one file (the
        ``quantization_config`` goes into its header metadata); any other path is a
        directory receiving ``model.safetensors``, ``config.json`` (``config`` with the
        convention's ``quantization_config``) and, for ModelOpt, ``hf_quant_config.json``.
      tree: pytree of arrays and QArrays; each QArray must be a quantized Linear
        ``<module>.weight`` of shape (out, in) blocked along axis 1, in a format the
        convention stores (docs/interop.md).
      convention: one of :data:`CONVENTIONS`.
      metadata: extra header metadata (str -> str).
      config: the model's config.json contents (e.g. the architecture), merged.
    Raises:
      ValueError / TypeError: unknown convention; a QArray the convention cannot store
      (wrong format, layout, scale dtype, missing tensor scale), naming it.
    """
    _check_convention(convention, False)
    if convention == NATIVE:
        if config is not None:
            raise ValueError("config: only foreign conventions write config.json")
        return _st.save(path, tree, metadata=metadata)
    tensors, qc, files = _BY_NAME[convention].save(_flatten(tree))
    path = os.fspath(path)
    meta = {"format": "pt", **(metadata or {})}
    if path.endswith(".safetensors"):
        if qc is not None:
            meta[CONFIG_META_KEY] = json.dumps(qc, sort_keys=True)
        _st.save(path, tensors, metadata=meta)
        return
    os.makedirs(path, exist_ok=True)
    _st.save(os.path.join(path, "model.safetensors"), tensors, metadata=meta)
    cfg = dict(config or {})
    if qc is not None:
        cfg["quantization_config"] = qc
    files = {"config.json": cfg, **files}
    for fname, content in files.items():
        with open(os.path.join(path, fname), "w") as fh:
            json.dump(content, fh, indent=2, sort_keys=True)
