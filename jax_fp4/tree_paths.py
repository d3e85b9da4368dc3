"""Dotted names of pytree leaves and the contraction axis their names imply: the naming
conventions shared by parameter quantization (:mod:`jax_fp4.nn`), sharding rules
(:mod:`jax_fp4.sharding`) and checkpoints (:mod:`jax_fp4.io`).

Conventions (which axis is contracted):
  * a leaf named ``kernel`` is a Flax kernel, shaped (in_features, out_features)
    (``flax.nnx.Linear``, ``flax.linen.Dense``): blocked along axis 0;
  * a leaf named ``weight`` is a PyTorch / Equinox weight, shaped (out_features,
    in_features) (``torch.nn.Linear``, ``equinox.nn.Linear``, Hugging Face checkpoints):
    blocked along axis 1.
"""
from __future__ import annotations

from typing import Optional

__all__ = ["path_str", "contraction_axis"]


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
