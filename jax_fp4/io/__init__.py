"""Checkpoints: pytrees of arrays and QArrays as safetensors files (no pickle).

See :mod:`jax_fp4.io.safetensors` for the on-disk layout. Needs the ``safetensors``
package (``pip install safetensors``, or the ``demo`` extra).
"""
from .atomic import atomic_write
from .safetensors import CheckpointError, describe, load, read_header, save, verify

__all__ = ["save", "load", "describe", "read_header", "verify", "CheckpointError",
           "atomic_write"]
