"""Quantized layers and parameter quantization for Flax (NNX, Linen) and Equinox.

* :func:`quantize_params` (framework-neutral, :mod:`jax_fp4.nn.params`): 2-D kernels of any
  pytree -> QArrays blocked along the contraction axis ("kernel" -> axis 0, Flax (in, out);
  "weight" -> axis 1, PyTorch / Equinox (out, in)).
* :mod:`jax_fp4.nn.flax`: NNX ``QuantizedLinear``, ``quantize_model``, ``calibrate``; Linen
  ``QuantizedDense``, ``quantized_init``, ``promote_dtype``. Needs ``flax``.
* :mod:`jax_fp4.nn.equinox`: ``QuantizedLinear``, ``calibrate``. Needs ``equinox``.

The framework modules are imported on first use, so ``import jax_fp4.nn`` needs neither.
"""
import importlib

from .params import contraction_axis, default_filter, linear, path_str, transpose_2d
from .quantize import quantize_params

__all__ = ["quantize_params", "default_filter", "contraction_axis", "path_str", "linear",
           "transpose_2d", "calibrate", "flax", "equinox"]


def __getattr__(name):
    if name in ("flax", "equinox"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def calibrate(model, batches, forward=None, **kwargs):
    """Calibrate activation scales of a Flax NNX model (in place; returns {name: amax}) or
    an Equinox model (returns (new model, {name: amax})); see
    :func:`jax_fp4.nn.flax.calibrate` and :func:`jax_fp4.nn.equinox.calibrate`.

    Raises:
      TypeError: a model that is neither an NNX module nor an Equinox pytree.
    """
    import sys

    if "flax" in sys.modules:
        from flax import nnx

        if isinstance(model, nnx.Module):
            from .flax import calibrate as cal

            return cal(model, batches, forward, **kwargs)
    if "equinox" in sys.modules:
        from .equinox import calibrate as cal

        return cal(model, batches, forward, **kwargs)
    raise TypeError(f"model: expected a Flax NNX module or an Equinox model, got "
                    f"{type(model).__name__}")
