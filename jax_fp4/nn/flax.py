"""Flax layers with quantized kernels: NNX :class:`QuantizedLinear`, Linen
:class:`QuantizedDense`, and the helpers to quantize and calibrate existing models.

Kernels follow Flax's (in_features, out_features) convention and are
:class:`~jax_fp4.QArray` s blocked along axis 0 (the contraction axis). See
:func:`jax_fp4.nn.params.linear` for the arithmetic of each mode:

* weight-only (W4A16, ``act_format=None``): the kernel is decoded to the activation dtype
  inside :func:`jax_fp4.dot_general`, products accumulate in float32;
* activations quantized (``act_format="nvfp4"`` or an MX format): ``act_mode="fake"``
  fake-quantizes the input, ``act_mode="scaled"`` runs the block-scaled
  :func:`jax_fp4.scaled_matmul` (W4A4 / W8A8). NVFP4 activations use a per-tensor scale
  calibrated with :func:`calibrate` (or a dynamic amax/2688 per call until calibrated).

Plain ``flax.linen.Dense`` also takes QArray kernels when given
``dot_general=jax_fp4.dot_general``, ``promote_dtype=jax_fp4.nn.flax.promote_dtype`` and
``kernel_init=jax_fp4.nn.flax.quantized_init(...)`` (the init must produce a QArray so
Linen's parameter shape check sees the same structure); :class:`QuantizedDense` packages
that and adds activation quantization.
"""
from __future__ import annotations

import weakref
from types import MappingProxyType
from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from .. import ops
from ..formats import get_format
from ..qarray import QArray
from ..sharding import with_out_sharding
from . import params as P

__all__ = ["QuantizedLinear", "QuantStat", "quantize_model", "calibrate", "activation_amax",
           "QuantizedDense", "quantized_init", "promote_dtype", "dot_general"]


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                out_sharding=None):
    """:func:`jax_fp4.dot_general` with the ``out_sharding`` keyword that
    ``flax.nnx.Linear`` passes."""
    return ops.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                           preferred_element_type=preferred_element_type,
                           out_sharding=out_sharding)


class QuantStat(nnx.Variable):
    """Activation statistics of a quantized layer (``act_amax``, ``act_scale``): a
    separate Variable type so ``nnx.state(model, QuantStat)`` selects them and optimizers
    filtering on ``nnx.Param`` leave them alone."""


def _quantize_kernel(w, format, block_size, tensor_scale, scale_rounding, scale_dtype):
    f, kw = P._quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype)
    return ops.quantize(jnp.asarray(w), f.name, axis=0, **kw)


class QuantizedLinear(nnx.Module):
    """Drop-in for ``flax.nnx.Linear`` with a quantized (in, out) kernel.

    Takes ``nnx.Linear``'s constructor arguments, plus:

    Args:
      format: weight format (any of :data:`jax_fp4.FORMAT_NAMES`; default "nvfp4").
      block_size, tensor_scale, scale_rounding, scale_dtype: as :func:`jax_fp4.quantize`
        (tensor_scale "auto" = two-level NVFP4, the default; ignored for other formats).
      act_format: None (weight-only W4A16) or "nvfp4" / an MX format for the activations.
      act_mode: "fake" (fake-quantized activations, any weight format) or "scaled"
        (block-scaled matmul; weights and activations both nvfp4 or both MX).
      kernel: optional (in, out) float array or QArray to use instead of ``kernel_init``
        (``rngs`` is then only needed for the bias); bias: optional (out,) array.
      name: label used by :func:`calibrate` / :func:`activation_amax`.
      dot_general: called as ``dot_general(x, kernel_qarray, dims, precision=...,
        preferred_element_type=...)`` in weight-only and "fake" modes (default
        :func:`jax_fp4.dot_general`).
      promote_dtype: applied to ``(inputs, None, bias)`` (the kernel stays a QArray).

    Attributes:
      kernel: ``nnx.Param`` holding a QArray of logical shape (in, out), blocked along 0.
      bias: ``nnx.Param`` (out,) or None.
      act_amax, act_scale: :class:`QuantStat` float32 scalars when ``act_format`` is set
        (``act_scale`` 0 = not calibrated: dynamic per-call scale).

    Call: ``layer(x)`` with x (..., in) -> (..., out), dtype ``dtype`` or the promoted
    dtype of x, bias and the kernel's dtype.
    Raises (constructor): ValueError for an unknown format, in_features not a multiple
    of the block size, or activation options that do not combine (see
    :func:`jax_fp4.nn.params.linear`).
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype=None, param_dtype=jnp.float32, precision=None,
                 kernel_init=default_kernel_init, bias_init=default_bias_init,
                 dot_general: Optional[Callable] = None, promote_dtype=None,
                 preferred_element_type=None, rngs: Optional[nnx.Rngs] = None,
                 kernel_metadata=MappingProxyType({}), bias_metadata=MappingProxyType({}),
                 format: str = "nvfp4", block_size: Optional[int] = None,
                 tensor_scale="auto", scale_rounding: str = "floor", scale_dtype=None,
                 act_format: Optional[str] = None, act_mode: str = "fake",
                 kernel=None, bias=None, name: str = ""):
        fmt = get_format(format)
        P.check_act_options(fmt.name, act_format, act_mode, block_size)
        if kernel is None:
            if rngs is None:
                raise TypeError("rngs: required to initialize the kernel (or pass kernel=)")
            kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        if not isinstance(kernel, QArray):
            if tuple(kernel.shape) != (in_features, out_features):
                raise ValueError(f"kernel: expected shape {(in_features, out_features)}, got "
                                 f"{tuple(kernel.shape)}")
            kernel = _quantize_kernel(kernel, fmt.name, block_size, tensor_scale,
                                      scale_rounding, scale_dtype)
        elif kernel.shape != (in_features, out_features) or kernel.axis != 0:
            raise ValueError(f"kernel: expected a QArray of shape {(in_features, out_features)} "
                             f"blocked along axis 0, got {kernel!r}")
        elif kernel.format != fmt.name:
            raise ValueError(f"kernel: format {kernel.format!r} differs from format="
                             f"{fmt.name!r}")
        self.kernel = nnx.Param(kernel, **kernel_metadata)
        if use_bias:
            if bias is None:
                if rngs is None:
                    raise TypeError("rngs: required to initialize the bias (or pass bias=)")
                bias = bias_init(rngs.params(), (out_features,), param_dtype)
            self.bias = nnx.Param(jnp.asarray(bias), **bias_metadata)
        else:
            self.bias = nnx.data(None)
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.dot_general = dot_general
        self.promote_dtype = promote_dtype
        self.preferred_element_type = preferred_element_type
        self.format = fmt.name
        self.act_format = None if act_format is None else get_format(act_format).name
        self.act_mode = act_mode
        self.name = name
        self.calibrating = False
        if act_format is not None:
            self.act_amax = QuantStat(jnp.zeros((), jnp.float32))
            self.act_scale = QuantStat(jnp.zeros((), jnp.float32))
        else:
            self.act_amax = nnx.data(None)
            self.act_scale = nnx.data(None)

    @classmethod
    def from_linear(cls, linear: nnx.Linear, format: str = "nvfp4", **kwargs):
        """A QuantizedLinear with ``linear``'s kernel quantized (and its bias, dtype,
        precision and preferred_element_type); ``kwargs`` as the constructor."""
        bias = linear.bias.get_value() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, use_bias=bias is not None,
                   dtype=linear.dtype, param_dtype=linear.param_dtype,
                   precision=linear.precision,
                   preferred_element_type=getattr(linear, "preferred_element_type", None),
                   kernel=linear.kernel.get_value(), bias=bias, format=format, **kwargs)

    def __call__(self, inputs, out_sharding=None):
        """y = inputs @ kernel (+ bias); ``out_sharding`` (as ``nnx.Linear``): the result
        laid out as it (jax_fp4.sharding.with_out_sharding)."""
        return with_out_sharding(self._apply(inputs), out_sharding)

    def _apply(self, inputs):
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        inputs = jnp.asarray(inputs)
        dtype = self.dtype
        if dtype is None:
            dtype = jnp.result_type(inputs.dtype, kernel.dtype,
                                    *(() if bias is None else (bias.dtype,)))
        if self.promote_dtype is not None:
            inputs, _, bias = self.promote_dtype((inputs, None, bias), dtype=dtype)
        else:
            inputs = inputs.astype(dtype)
            bias = None if bias is None else bias.astype(dtype)
        act_format, act_scale = self.act_format, None
        if act_format is not None:
            if self.calibrating:
                amax = jnp.max(jnp.abs(inputs)).astype(jnp.float32)
                self.act_amax.set_value(jnp.maximum(self.act_amax.get_value(), amax))
                act_format = None  # calibrate on the float activations
            else:
                act_scale = self.act_scale.get_value()
        if self.dot_general is not None and act_format is None:
            y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())),
                                 precision=self.precision,
                                 preferred_element_type=self.preferred_element_type or dtype)
            return y if bias is None else y + bias.astype(y.dtype)
        return P.linear(inputs, kernel, bias, contract_axis=0, act_format=act_format,
                        act_mode=self.act_mode, act_scale=act_scale, precision=self.precision,
                        preferred_element_type=self.preferred_element_type)


def _set_module(root, path, module):
    """Put ``module`` at ``path`` (attribute names and list indices) inside ``root``."""
    node = root
    for k in path[:-1]:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    if isinstance(path[-1], int):
        node[path[-1]] = module
    else:
        setattr(node, path[-1], module)


def quantize_model(model: nnx.Module, format: str = "nvfp4", *, filter: P.Filter = None,
                   block_size: Optional[int] = None, tensor_scale="auto",
                   scale_rounding: str = "floor", scale_dtype=None, strict: bool = False,
                   act_format: Optional[str] = None, act_mode: str = "fake",
                   inplace: bool = False) -> nnx.Module:
    """Replace the ``nnx.Linear`` layers of an NNX model by :class:`QuantizedLinear`.

    Args:
      model: any ``nnx.Module``.
      format, block_size, tensor_scale, scale_rounding, scale_dtype, strict: as
        :func:`jax_fp4.nn.quantize_params`.
      filter: which layers: applied to ``(f"{path}.kernel", kernel)`` exactly as in
        :func:`jax_fp4.nn.quantize_params` (default: every Linear outside ``embed`` paths).
      act_format, act_mode: activation quantization of the new layers
        (:class:`QuantizedLinear`).
      inplace: modify ``model`` itself instead of a clone (``nnx.clone``).
    Returns:
      the quantized model (``model`` itself when ``inplace``). Layer ``name`` s are the
      dotted paths, e.g. ``"layers.0.query"``.
    Raises:
      ValueError: as :func:`quantize_params`.
    """
    f = get_format(format)
    P.check_act_options(f.name, act_format, act_mode, block_size)
    pred = P._make_filter(filter)
    if not inplace:
        model = nnx.clone(model)
    bs = f.default_block if block_size is None else block_size
    targets, skipped = [], []
    for path, m in nnx.iter_modules(model):
        if type(m) is not nnx.Linear or not path:
            continue
        name = ".".join(str(p) for p in path)
        if not pred(f"{name}.kernel", m.kernel.get_value()):
            continue
        if m.in_features % bs:
            if strict:
                raise ValueError(f"{name}.kernel: in_features {m.in_features} is not a "
                                 f"multiple of the {f.name} block size {bs}")
            skipped.append(f"{name}.kernel (K={m.in_features} not a multiple of {bs})")
            continue
        targets.append((path, m, name))
    for path, m, name in targets:
        q = QuantizedLinear.from_linear(
            m, f.name, block_size=block_size, tensor_scale=tensor_scale,
            scale_rounding=scale_rounding, scale_dtype=scale_dtype, act_format=act_format,
            act_mode=act_mode, name=name)
        _set_module(model, path, q)
    if skipped:
        import warnings

        warnings.warn(f"quantize_model: left {len(skipped)} layer(s) unquantized: "
                      + ", ".join(skipped), stacklevel=2)
    return model


def _act_layers(model):
    return [(".".join(map(str, p)), m) for p, m in nnx.iter_modules(model)
            if isinstance(m, QuantizedLinear) and m.act_format is not None]


def calibrate(model: nnx.Module, batches: Iterable, forward: Optional[Callable] = None,
              *, jit: bool = True) -> dict:
    """Calibrate the activation scales of a model's :class:`QuantizedLinear` layers.

    Runs ``forward(model, batch)`` on every batch with those layers in calibration mode
    (they record the running max |x| of their input in ``act_amax`` and compute in full
    precision on their activations), then sets each NVFP4 layer's ``act_scale`` to
    ``jax_fp4.tensor_scale_from_amax(act_amax)`` (amax/2688, the decode-scale convention of
    torchao / ModelOpt ``input_scale``). MX activations need no per-tensor scale (their
    amax is still recorded). Modifies ``model`` in place.

    Args:
      model: NNX model containing QuantizedLinear layers with ``act_format`` set.
      batches: iterable of inputs (any pytree ``forward`` accepts).
      forward: ``(model, batch) -> anything``; default ``model(batch)``.
      jit: run ``forward`` under ``nnx.jit``.
    Returns:
      {layer name: amax (float)} for the calibrated layers.
    Raises:
      ValueError: the model has no layer with activation quantization, or no batch ran.
    """
    layers = _act_layers(model)
    if not layers:
        raise ValueError("model: no QuantizedLinear layer has act_format set; nothing to "
                         "calibrate")
    fwd = forward or _call
    step = _jitted(fwd) if jit else fwd
    for _, m in layers:
        m.act_amax.set_value(jnp.zeros((), jnp.float32))
        m.calibrating = True
    n = 0
    try:
        for batch in batches:
            jax.block_until_ready(step(model, batch))
            n += 1
    finally:
        for _, m in layers:
            m.calibrating = False
    if n == 0:
        raise ValueError("batches: empty; calibration needs at least one batch")
    out = {}
    for path, m in layers:
        amax = m.act_amax.get_value()
        if get_format(m.act_format).has_tensor_scale:
            m.act_scale.set_value(ops.tensor_scale_from_amax(amax).astype(jnp.float32))
        out[m.name or path] = float(amax)
    return out


def _call(m, b):
    return m(b)


_JITTED = weakref.WeakKeyDictionary()


def _jitted(fwd):
    """One ``nnx.jit`` wrapper per forward function, so repeated calibrations of models
    with the same structure reuse the compiled program."""
    try:
        step = _JITTED.get(fwd)
        if step is None:
            step = _JITTED[fwd] = nnx.jit(fwd)
        return step
    except TypeError:  # not weak-referenceable
        return nnx.jit(fwd)


def activation_amax(model: nnx.Module) -> dict:
    """{layer name: (amax, act_scale)} of the model's activation-quantized layers."""
    return {m.name or p: (float(m.act_amax.get_value()), float(m.act_scale.get_value()))
            for p, m in _act_layers(model)}


# ----------------------------------------------------------------------------- Linen
def promote_dtype(*args, dtype=None, inexact=True):
    """``flax.linen.dtypes.promote_dtype`` that passes QArrays through unchanged.

    The target dtype is ``dtype`` or the promotion of the array arguments' dtypes and the
    QArrays' (dequantize) dtypes; arrays are cast to it, QArrays and None are returned as
    they are.
    """
    if dtype is None:
        dts = [a.dtype for a in args if a is not None]
        dtype = jnp.result_type(*dts) if dts else jnp.float32
        if inexact and not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    return [a if a is None or isinstance(a, QArray) else jnp.asarray(a, dtype)
            for a in args]


def quantized_init(init: Callable, format: str = "nvfp4", *, axis: int = 0,
                   block_size: Optional[int] = None, tensor_scale="auto",
                   scale_rounding: str = "floor", scale_dtype=None) -> Callable:
    """Wrap an initializer ``(key, shape, dtype) -> array`` so it returns a QArray
    quantized along ``axis`` (0: Flax (in, out) kernels). Use as a Linen
    ``kernel_init`` so the parameter shape check sees the QArray structure."""
    f, kw = P._quant_kwargs(format, block_size, tensor_scale, scale_rounding, scale_dtype)

    def qinit(key, shape, dtype=jnp.float32):
        return ops.quantize(init(key, shape, dtype), f.name, axis=axis, **kw)

    return qinit


class QuantizedDense(nn.Module):
    """Flax Linen ``Dense`` with a quantized (in, features) kernel blocked along axis 0.

    Attributes: those of ``flax.linen.Dense`` (features, use_bias, dtype, param_dtype,
    precision, kernel_init, bias_init) plus ``format``, ``block_size``, ``tensor_scale``,
    ``scale_rounding``, ``scale_dtype`` (the kernel's quantization, as
    :func:`jax_fp4.quantize`) and ``act_format`` / ``act_mode`` (activations, as
    :class:`QuantizedLinear`).

    Params: ``kernel`` (a QArray) and ``bias``; params from a float ``nn.Dense`` model
    become loadable with :func:`jax_fp4.nn.quantize_params` (same format options).
    With ``act_format``, the ``quant_stats`` collection holds ``act_amax``: apply with
    ``mutable=["quant_stats"]`` to calibrate (the layer then records max |x| and computes
    on float activations); NVFP4 uses amax/2688 as the activation tensor scale once
    act_amax > 0, a dynamic per-call scale before.

    Call: x (..., in) -> (..., features).
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    format: str = "nvfp4"
    block_size: Optional[int] = None
    tensor_scale: Any = "auto"
    scale_rounding: str = "floor"
    scale_dtype: Any = None
    act_format: Optional[str] = None
    act_mode: str = "fake"

    @nn.compact
    def __call__(self, inputs):
        P.check_act_options(get_format(self.format).name, self.act_format, self.act_mode,
                            self.block_size)
        kernel = self.param(
            "kernel", quantized_init(self.kernel_init, self.format, block_size=self.block_size,
                                     tensor_scale=self.tensor_scale,
                                     scale_rounding=self.scale_rounding,
                                     scale_dtype=self.scale_dtype),
            (jnp.shape(inputs)[-1], self.features), self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        act_format, act_scale = self.act_format, None
        if act_format is not None:
            amax = self.variable("quant_stats", "act_amax", lambda: jnp.zeros((), jnp.float32))
            if self.is_mutable_collection("quant_stats") and not self.is_initializing():
                amax.value = jnp.maximum(amax.value,
                                         jnp.max(jnp.abs(inputs)).astype(jnp.float32))
                act_format = None  # calibration pass: float activations
            else:
                act_scale = jnp.where(amax.value > 0,
                                      ops.tensor_scale_from_amax(amax.value), 0.0)
        return P.linear(inputs, kernel, bias, contract_axis=0, act_format=act_format,
                        act_mode=self.act_mode, act_scale=act_scale, precision=self.precision)
