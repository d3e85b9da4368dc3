"""Equinox layer with a quantized weight: :class:`QuantizedLinear`, and :func:`calibrate`.

Weights follow Equinox / PyTorch's (out_features, in_features) convention and are
:class:`~jax_fp4.QArray` s blocked along axis 1 (the contraction axis); the codes are
stored (out, in*bits/8), as ModelOpt / compressed-tensors checkpoints store them. The
arithmetic of each mode is :func:`jax_fp4.nn.params.linear`.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Iterable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .. import ops
from ..formats import get_format
from ..qarray import QArray
from . import params as P

__all__ = ["QuantizedLinear", "calibrate", "activation_amax"]


class QuantizedLinear(eqx.Module):
    """Drop-in for ``equinox.nn.Linear`` with a quantized (out, in) weight.

    Args:
      in_features, out_features: ints (``"scalar"`` is not supported).
      use_bias: whether to add a bias.
      dtype: parameter dtype for initialization (default float32).
      key: PRNG key for ``equinox.nn.Linear``'s uniform(-1/sqrt(in), 1/sqrt(in)) init;
        not needed when ``weight`` (and ``bias``) are given.
      format, block_size, tensor_scale, scale_rounding, scale_dtype: the weight's
        quantization (as :func:`jax_fp4.quantize`; tensor_scale "auto" = two-level NVFP4).
      act_format, act_mode: activation quantization (None = weight-only W4A16; "nvfp4" or
        an MX format; mode "fake" or "scaled", see :func:`jax_fp4.nn.params.linear`).
      weight: optional (out, in) float array or QArray blocked along axis 1; bias:
        optional (out,) array.
      name: label used by :func:`calibrate`.

    Fields: ``weight`` (QArray), ``bias`` (array or None), ``act_scale`` (float32 scalar
    NVFP4 activation tensor scale, 0 = dynamic per call; None without act_format).

    Call: ``layer(x)`` with x (in,) -> (out,) like ``equinox.nn.Linear`` (also accepts
    (..., in) -> (..., out)); ``key`` is accepted and ignored.
    Raises (constructor): ValueError for a bad format / block size / activation options,
    TypeError when neither key nor weight is given.
    """

    weight: QArray
    bias: Optional[jax.Array]
    act_scale: Optional[jax.Array]
    in_features: int = eqx.field(static=True)
    out_features: int = eqx.field(static=True)
    use_bias: bool = eqx.field(static=True)
    act_format: Optional[str] = eqx.field(static=True)
    act_mode: str = eqx.field(static=True)
    name: str = eqx.field(static=True)
    calibrating: bool = eqx.field(static=True)

    def __init__(self, in_features: int, out_features: int, use_bias: bool = True,
                 dtype=None, *, key=None, format: str = "nvfp4",
                 block_size: Optional[int] = None, tensor_scale="auto",
                 scale_rounding: str = "floor", scale_dtype=None,
                 act_format: Optional[str] = None, act_mode: str = "fake",
                 weight=None, bias=None, name: str = "", act_scale=None,
                 calibrating: bool = False):
        if not (isinstance(in_features, int) and isinstance(out_features, int)):
            raise TypeError("in_features, out_features: expected ints ('scalar' is not "
                            f"supported), got {in_features!r}, {out_features!r}")
        fmt = get_format(format)
        P.check_act_options(fmt.name, act_format, act_mode, block_size)
        dtype = jnp.float32 if dtype is None else dtype
        lim = 1 / math.sqrt(in_features)
        if weight is None or (use_bias and bias is None):
            if key is None:
                raise TypeError("key: required to initialize the weight/bias (or pass "
                                "weight= and bias=)")
            wkey, bkey = jax.random.split(key)
        if weight is None:
            weight = jax.random.uniform(wkey, (out_features, in_features), dtype, -lim, lim)
        if isinstance(weight, QArray):
            if weight.shape != (out_features, in_features) or weight.axis != 1:
                raise ValueError(f"weight: expected a QArray of shape "
                                 f"{(out_features, in_features)} blocked along axis 1, got "
                                 f"{weight!r}")
        else:
            if tuple(weight.shape) != (out_features, in_features):
                raise ValueError(f"weight: expected shape {(out_features, in_features)}, got "
                                 f"{tuple(weight.shape)}")
            f, kw = P._quant_kwargs(fmt.name, block_size, tensor_scale, scale_rounding,
                                    scale_dtype)
            weight = ops.quantize(jnp.asarray(weight), f.name, axis=1, **kw)
        if use_bias and bias is None:
            bias = jax.random.uniform(bkey, (out_features,), dtype, -lim, lim)
        self.weight = weight
        self.bias = jnp.asarray(bias) if use_bias else None
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.act_format = None if act_format is None else get_format(act_format).name
        self.act_mode = act_mode
        self.name = name
        self.calibrating = calibrating
        if act_format is None:
            self.act_scale = None
        else:
            self.act_scale = (jnp.zeros((), jnp.float32) if act_scale is None
                              else jnp.asarray(act_scale, jnp.float32))

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, format: str = "nvfp4", **kwargs):
        """Quantize an ``equinox.nn.Linear`` (weight (out, in), blocked along axis 1)."""
        return cls(linear.in_features, linear.out_features, linear.use_bias,
                   weight=linear.weight, bias=linear.bias, format=format, **kwargs)

    def __call__(self, x, *, key=None):
        x = jnp.asarray(x)
        act_format = self.act_format
        if act_format is not None and self.calibrating:
            jax.debug.callback(_record, self.name,
                               jnp.max(jnp.abs(x)).astype(jnp.float32))
            act_format = None
        return P.linear(x, self.weight, self.bias, contract_axis=1, act_format=act_format,
                        act_mode=self.act_mode, act_scale=self.act_scale)


_LOCK = threading.Lock()
_AMAX: dict = {}


def _record(name, amax):
    v = float(np.max(np.asarray(amax)))
    with _LOCK:
        _AMAX[name] = max(_AMAX.get(name, 0.0), v)


def _is_qlin(x):
    return isinstance(x, QuantizedLinear)


def calibrate(model, batches: Iterable, forward: Optional[Callable] = None, *,
              jit: bool = True):
    """Calibrate the activation scales of an Equinox model's :class:`QuantizedLinear`.

    Runs ``forward(model, batch)`` over ``batches`` with the activation-quantized layers
    in calibration mode (they report max |x| of their input through
    ``jax.debug.callback`` and compute on float activations), then returns a new model
    whose NVFP4 layers have ``act_scale = jax_fp4.tensor_scale_from_amax(amax)``
    (amax/2688). Layers are told apart by ``name`` (set by
    :func:`jax_fp4.nn.quantize_params` to the layer path; unnamed layers get their path).

    Args:
      model: an Equinox model (pytree) containing QuantizedLinear layers.
      batches: iterable of inputs.
      forward: ``(model, batch) -> anything``; default ``model(batch)``.
      jit: run ``forward`` under ``equinox.filter_jit``.
    Returns:
      (calibrated model, {layer name: amax}).
    Raises:
      ValueError: no layer has act_format, duplicate layer names, or no batch ran.
    """
    names = []

    def mark(path, layer):
        if not _is_qlin(layer) or layer.act_format is None:
            return layer
        name = layer.name or P.path_str(path)
        names.append(name)
        return _replace(layer, name=name, calibrating=True)

    cal = jax.tree_util.tree_map_with_path(mark, model, is_leaf=_is_qlin)
    if not names:
        raise ValueError("model: no QuantizedLinear layer has act_format set; nothing to "
                         "calibrate")
    if len(set(names)) != len(names):
        raise ValueError(f"model: layer names must be unique for calibration, got {names}")
    fwd = forward or (lambda m, b: m(b))
    step = eqx.filter_jit(fwd) if jit else fwd
    with _LOCK:
        for n in names:
            _AMAX.pop(n, None)
    count = 0
    for batch in batches:
        jax.block_until_ready(step(cal, batch))
        count += 1
    jax.effects_barrier()
    if count == 0:
        raise ValueError("batches: empty; calibration needs at least one batch")
    with _LOCK:
        amax = {n: _AMAX.pop(n, 0.0) for n in names}

    def finish(layer):
        if not _is_qlin(layer) or layer.act_format is None:
            return layer
        a = jnp.float32(amax[layer.name])
        scale = (ops.tensor_scale_from_amax(a) if get_format(layer.act_format).has_tensor_scale
                 else jnp.zeros((), jnp.float32))
        return _replace(layer, calibrating=False, act_scale=jnp.asarray(scale, jnp.float32))

    return jax.tree_util.tree_map(finish, cal, is_leaf=_is_qlin), amax


def _replace(layer: QuantizedLinear, **changes) -> QuantizedLinear:
    kw = dict(weight=layer.weight, bias=layer.bias, name=layer.name,
              act_scale=layer.act_scale, calibrating=layer.calibrating)
    kw.update(changes)
    return QuantizedLinear(layer.in_features, layer.out_features, layer.use_bias,
                           format=layer.weight.format, block_size=layer.weight.block_size,
                           act_format=layer.act_format, act_mode=layer.act_mode, **kw)


def activation_amax(model) -> dict:
    """{layer name: act_scale} of an Equinox model's activation-quantized layers."""
    out = {}
    for layer in jax.tree_util.tree_leaves(model, is_leaf=_is_qlin):
        if _is_qlin(layer) and layer.act_format is not None:
            out[layer.name] = float(layer.act_scale)
    return out
