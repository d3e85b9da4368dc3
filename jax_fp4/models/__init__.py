"""Reference models written with jax-fp4 layers (need ``flax``; the MiniLM loader also
``safetensors`` and ``tokenizers``).

* :mod:`jax_fp4.models.minilm`: BERT encoder in Flax NNX with the all-MiniLM-L6-v2
  sentence-embedding pipeline (mean pooling + L2 normalise).
"""
import importlib

__all__ = ["minilm"]


def __getattr__(name):
    if name == "minilm":
        return importlib.import_module(f"{__name__}.minilm")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
