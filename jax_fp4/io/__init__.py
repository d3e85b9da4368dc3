"""Checkpoints: pytrees of arrays and QArrays as safetensors files (no pickle).

See :mod:`jax_fp4.io.safetensors` for the on-disk layout. Needs the ``safetensors``
package (``pip install safetensors``, or the ``demo`` extra). :func:`load` and :func:`save`
also read and write the checkpoint conventions of the PyTorch ecosystem
(compressed-tensors, ModelOpt, bitsandbytes, AutoAWQ, GPTQ, LightX2V; see
:mod:`jax_fp4.io.conventions` and docs/interop.md).
"""
from . import conventions
from .atomic import atomic_write
from .safetensors import CheckpointError, describe, read_header, verify
from .safetensors import load as _load_native
from .safetensors import save as _save_native
from .conventions import CONVENTIONS, detect


def load(path, target=None, *, strict: bool = True, convention: str = "auto"):
    """Read a checkpoint: a jax-fp4 safetensors file (see
    :func:`jax_fp4.io.safetensors.load`; ``target`` and ``strict`` apply to it only) or,
    with ``convention`` "auto" or a name from :data:`CONVENTIONS`, a file or HF model
    directory of another convention (:func:`jax_fp4.io.conventions.load`).

    Raises:
      ValueError: ``target`` given for a foreign convention; see the two functions above.
    """
    if target is not None or convention == "jax_fp4":
        if convention not in ("auto", "jax_fp4"):
            raise ValueError(f"target: only supported for convention 'jax_fp4', got "
                             f"{convention!r}")
        if convention == "auto" and detect(path) != "jax_fp4":
            raise ValueError(f"target: {path} is a {detect(path)} checkpoint; load it without "
                             "a target")
        return _load_native(path, target, strict=strict)
    return conventions.load(path, convention)


def save(path, tree, *, metadata=None, convention: str = "jax_fp4", config=None):
    """Write a pytree: by default as a jax-fp4 safetensors file
    (:func:`jax_fp4.io.safetensors.save`), else in ``convention``
    (:func:`jax_fp4.io.conventions.save`)."""
    if convention == "jax_fp4" and config is None:
        return _save_native(path, tree, metadata=metadata)
    return conventions.save(path, tree, convention, metadata=metadata, config=config)


__all__ = ["save", "load", "describe", "read_header", "verify", "detect", "CheckpointError",
           "CONVENTIONS", "conventions", "atomic_write"]
