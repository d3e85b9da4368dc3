"""Training with 4-bit weights in Flax: QLoRA adapters on a frozen quantized base and
quantization-aware training (QAT), for NNX and Linen.

NNX:

* :class:`LoRALinear` wraps a :class:`~jax_fp4.nn.flax.QuantizedLinear` (or an
  ``nnx.Linear``) and adds adapters held in ``nnx.LoRAParam`` variables, so
  ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` and ``nnx.DiffState(0, nnx.LoRAParam)``
  train them alone; :func:`add_lora` wraps a model's quantized layers; :func:`merge_lora`
  folds the adapters back into float ``nnx.Linear`` layers or into re-quantized ones.
* :class:`QATLinear` trains a float kernel through its quantized value
  (:func:`jax_fp4.nn.qat.qat_linear`); :func:`qat_model` swaps a model's ``nnx.Linear``
  layers for it and :func:`convert` turns the trained model into ``QuantizedLinear`` layers
  whose forward is bit-identical.

Linen: :class:`LoRADense` (params ``kernel`` QArray, ``bias``, ``lora_a``, ``lora_b``;
split them with :func:`split_lora`) and :class:`QATDense` (params ``kernel`` float,
``bias``; :func:`convert_params` gives the :class:`~jax_fp4.nn.flax.QuantizedDense` params).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx.nn.linear import default_bias_init, default_kernel_init

from ..formats import get_format
from ..qarray import QArray
from . import lora as L
from . import params as P
from .flax import QuantizedLinear, _set_module
from .qat import QATConfig, convert_weight, qat_linear

__all__ = ["LoRALinear", "add_lora", "merge_lora", "lora_param_count", "QATLinear",
           "qat_model", "convert", "LoRADense", "split_lora", "QATDense", "convert_params"]


# ----------------------------------------------------------------------------- NNX LoRA
class LoRALinear(nnx.Module):
    """A frozen dense layer plus a LoRA update: ``base(x) + dropout(x) @ A @ B * alpha/rank``.

    Args:
      base: a :class:`~jax_fp4.nn.flax.QuantizedLinear` (QLoRA) or an ``nnx.Linear``; its
        variables stay ``nnx.Param`` (frozen under an optimizer with ``wrt=nnx.LoRAParam``).
      rank, alpha, dropout: LoRA rank r, scaling numerator (scale = alpha / r) and dropout
        rate on the adapter input (active unless ``model.eval()`` / deterministic).
      rngs: ``nnx.Rngs`` with a ``params`` stream (A's init) and, for dropout, a
        ``dropout`` stream.
      param_dtype: dtype of A and B (default float32).

    Attributes: ``base``, ``lora_a`` (in, r) and ``lora_b`` (r, out) ``nnx.LoRAParam``
    (A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0), ``scale``.
    Call: x (..., in) -> (..., out) in the base layer's output dtype.
    Raises: TypeError / ValueError for bad rank, alpha or dropout.
    """

    def __init__(self, base, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0, *,
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.scale = L.check_lora_options(rank, alpha, dropout)
        self.base = base
        self.rank, self.alpha = rank, float(alpha)
        n_in, n_out = base.in_features, base.out_features
        self.lora_a = nnx.LoRAParam(L.lora_a_init(rngs.params(), (n_in, rank), param_dtype,
                                                  fan_in=n_in))
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, n_out), param_dtype))
        self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else nnx.data(None)
        self.in_features, self.out_features = n_in, n_out

    def __call__(self, x):
        y = self.base(x)
        h = self.dropout(x) if self.dropout is not None else x
        h = jnp.asarray(h, y.dtype)
        return y + L.lora_delta(h, self.lora_a.get_value(), self.lora_b.get_value(),
                                self.scale, contract_axis=0)


def _default_lora_target(name, m):
    return isinstance(m, QuantizedLinear)


def add_lora(model: nnx.Module, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0, *,
             rngs: nnx.Rngs, filter: Optional[Callable[[str, Any], bool]] = None,
             inplace: bool = False) -> nnx.Module:
    """Wrap a model's dense layers in :class:`LoRALinear`.

    Args:
      model: an NNX model, typically quantized with :func:`jax_fp4.nn.quantize_params`.
      rank, alpha, dropout, rngs: as :class:`LoRALinear`.
      filter: ``(dotted path, layer) -> bool`` choosing layers among the QuantizedLinear /
        ``nnx.Linear`` ones (default: every QuantizedLinear).
      inplace: modify ``model`` itself instead of a clone.
    Returns:
      the model with adapters (B = 0: same outputs as before).
    Raises:
      ValueError: no layer selected.
    """
    L.check_lora_options(rank, alpha, dropout)
    pred = filter or _default_lora_target
    if not inplace:
        model = nnx.clone(model)
    targets = [(p, m) for p, m in nnx.iter_modules(model)
               if p and isinstance(m, (QuantizedLinear, nnx.Linear))
               and pred(".".join(map(str, p)), m)]
    if not targets:
        raise ValueError("model: no layer selected for LoRA (filter matched no "
                         "QuantizedLinear / nnx.Linear)")
    for path, m in targets:
        _set_module(model, path, LoRALinear(m, rank, alpha, dropout, rngs=rngs))
    return model


def merge_lora(model: nnx.Module, requantize: Union[bool, str] = False, *,
               inplace: bool = False) -> nnx.Module:
    """Fold each :class:`LoRALinear` into one dense layer with W' = W + A @ B * scale.

    Args:
      model: an NNX model with LoRALinear layers.
      requantize: False: float ``nnx.Linear`` layers (W decoded in float32, kernel in the
        base's dtype); True: :class:`~jax_fp4.nn.flax.QuantizedLinear` in the base's format,
        block size and tensor-scale mode; a format name: QuantizedLinear in that format.
      inplace: modify ``model`` itself instead of a clone.
    Returns:
      the merged model.
    """
    if not inplace:
        model = nnx.clone(model)
    targets = [(p, m) for p, m in nnx.iter_modules(model) if p and isinstance(m, LoRALinear)]
    for path, m in targets:
        base = m.base
        kernel = base.kernel.get_value()
        w = L.merge(kernel, m.lora_a.get_value(), m.lora_b.get_value(), m.scale,
                    contract_axis=0, requantize_to=requantize)
        bias = base.bias.get_value() if base.bias is not None else None
        if isinstance(w, QArray):
            new = QuantizedLinear(base.in_features, base.out_features, use_bias=bias is not None,
                                  kernel=w, bias=bias, format=w.format,
                                  block_size=w.block_size, name=getattr(base, "name", ""))
        else:
            new = nnx.Linear(base.in_features, base.out_features, use_bias=bias is not None,
                             rngs=nnx.Rngs(0), param_dtype=w.dtype)
            new.kernel.set_value(w)
            if bias is not None:
                new.bias.set_value(bias)
        _set_module(model, path, new)
    return model


def lora_param_count(model) -> tuple:
    """(adapter parameters, all parameters) of an NNX model; a QArray counts its logical
    elements."""
    def count(state):
        leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, QArray))
        return sum(int(jnp.size(x)) if not isinstance(x, QArray) else x.size for x in leaves)

    return count(nnx.state(model, nnx.LoRAParam)), count(nnx.state(model, nnx.Param))


# ----------------------------------------------------------------------------- NNX QAT
class QATLinear(nnx.Module):
    """A dense layer trained through its quantized weight (:mod:`jax_fp4.nn.qat`).

    Args:
      in_features, out_features, use_bias, param_dtype, kernel_init, bias_init, rngs: as
        ``flax.nnx.Linear``; kernel / bias: optional initial values instead of the inits.
      format, block_size, tensor_scale, scale_rounding, scale_dtype, ste, act_format: the
        :class:`jax_fp4.nn.qat.QATConfig`.
      name: carried to the converted layer.

    Attributes: ``kernel`` float (in, out) ``nnx.Param``, ``bias`` (out,) or None, ``cfg``.
    Call: x (..., in) -> (..., out), the value of ``x @ fake_quantize(kernel, axis=0) + b``
    computed as the converted :class:`~jax_fp4.nn.flax.QuantizedLinear` computes it.
    """

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 param_dtype=jnp.float32, kernel_init=default_kernel_init,
                 bias_init=default_bias_init, rngs: Optional[nnx.Rngs] = None,
                 kernel=None, bias=None, format: str = "nvfp4",
                 block_size: Optional[int] = None, tensor_scale="auto",
                 scale_rounding: str = "floor", scale_dtype=None, ste: str = "identity",
                 act_format: Optional[str] = None, name: str = ""):
        self.cfg = QATConfig(format, block_size, tensor_scale, scale_rounding, scale_dtype,
                             ste, act_format)
        if kernel is None:
            kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        self.kernel = nnx.Param(jnp.asarray(kernel))
        if use_bias and bias is None:
            bias = bias_init(rngs.params(), (out_features,), param_dtype)
        self.bias = nnx.Param(jnp.asarray(bias)) if use_bias else nnx.data(None)
        self.in_features, self.out_features = in_features, out_features
        self.name = name

    @classmethod
    def from_linear(cls, linear: nnx.Linear, format: str = "nvfp4", **kwargs):
        bias = linear.bias.get_value() if linear.bias is not None else None
        return cls(linear.in_features, linear.out_features, use_bias=bias is not None,
                   kernel=linear.kernel.get_value(), bias=bias, format=format, **kwargs)

    def __call__(self, x):
        kernel = self.kernel.get_value()
        bias = self.bias.get_value() if self.bias is not None else None
        dtype = jnp.result_type(x.dtype, kernel.dtype, *(() if bias is None else (bias.dtype,)))
        return qat_linear(jnp.asarray(x, dtype), kernel,
                          None if bias is None else bias.astype(dtype), self.cfg,
                          contract_axis=0)

    def to_quantized(self) -> QuantizedLinear:
        """The deployed :class:`~jax_fp4.nn.flax.QuantizedLinear` (same forward, bit for
        bit)."""
        c = self.cfg
        bias = self.bias.get_value() if self.bias is not None else None
        return QuantizedLinear(
            self.in_features, self.out_features, use_bias=bias is not None,
            kernel=convert_weight(self.kernel.get_value(), c, 0), bias=bias, format=c.format,
            block_size=c.block_size, act_format=c.act_format, act_mode="fake",
            name=self.name)


def qat_model(model: nnx.Module, format: str = "nvfp4", *,
              filter: Optional[Callable[[str, Any], bool]] = None, inplace: bool = False,
              **kwargs) -> nnx.Module:
    """Replace a model's ``nnx.Linear`` layers by :class:`QATLinear` (kwargs: its
    quantization options). filter: ``(dotted path, layer) -> bool`` (default: every
    Linear outside ``embed`` paths whose in_features fits the block size)."""
    cfg = QATConfig(format, kwargs.get("block_size"))
    bs = cfg.block_size or get_format(cfg.format).default_block
    if not inplace:
        model = nnx.clone(model)
    targets = []
    for path, m in nnx.iter_modules(model):
        if type(m) is not nnx.Linear or not path:
            continue
        name = ".".join(map(str, path))
        ok = filter(name, m) if filter else P.default_filter(f"{name}.kernel",
                                                             m.kernel.get_value())
        if ok and m.in_features % bs == 0:
            targets.append((path, m, name))
    for path, m, name in targets:
        _set_module(model, path, QATLinear.from_linear(m, format, name=name, **kwargs))
    return model


def convert(model: nnx.Module, *, inplace: bool = False) -> nnx.Module:
    """Replace every :class:`QATLinear` by its :meth:`QATLinear.to_quantized` layer."""
    if not inplace:
        model = nnx.clone(model)
    targets = [(p, m) for p, m in nnx.iter_modules(model) if p and isinstance(m, QATLinear)]
    for path, m in targets:
        _set_module(model, path, m.to_quantized())
    return model


# ----------------------------------------------------------------------------- Linen
class LoRADense(nn.Module):
    """Linen :class:`~jax_fp4.nn.flax.QuantizedDense` (weight-only) plus a LoRA update.

    Attributes: ``features``, ``use_bias``, ``kernel_init``, ``bias_init``, ``format``
    (default "nf4", as QLoRA), ``block_size``, ``tensor_scale``; ``rank``, ``alpha``,
    ``dropout``.
    Params: ``kernel`` (QArray (in, features), frozen by convention), ``bias``, ``lora_a``
    (in, rank), ``lora_b`` (rank, features); split trainable from frozen with
    :func:`split_lora`. Dropout draws from the ``dropout`` rng unless ``deterministic``.
    Call: ``(x, deterministic=True)``, x (..., in) -> (..., features).
    """

    features: int
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    format: str = "nf4"
    block_size: Optional[int] = None
    tensor_scale: Any = "auto"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        from .flax import quantized_init

        scale = L.check_lora_options(self.rank, self.alpha, self.dropout)
        n_in = x.shape[-1]
        kernel = self.param("kernel", quantized_init(self.kernel_init, self.format,
                                                     block_size=self.block_size,
                                                     tensor_scale=self.tensor_scale),
                            (n_in, self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,)) if self.use_bias else None
        a = self.param("lora_a", lambda k, s: L.lora_a_init(k, s, fan_in=n_in),
                       (n_in, self.rank))
        b = self.param("lora_b", nn.initializers.zeros_init(), (self.rank, self.features))
        y = P.linear(x, kernel, bias, contract_axis=0)
        h = nn.Dropout(self.dropout)(x, deterministic=deterministic) if self.dropout else x
        return y + L.lora_delta(h.astype(y.dtype), a, b, scale, contract_axis=0)


def split_lora(params) -> tuple:
    """Split a Linen params tree into (adapters, frozen): the leaves named ``lora_a`` /
    ``lora_b`` and everything else, each a tree of the same structure with None where the
    other has a leaf; :func:`combine` (``jax_fp4.nn.flax_train.combine``) joins them."""
    def pick(want):
        def f(path, leaf):
            is_lora = P.path_str(path).rsplit(".", 1)[-1] in ("lora_a", "lora_b")
            return leaf if is_lora == want else None
        return jax.tree_util.tree_map_with_path(f, params,
                                                is_leaf=lambda x: isinstance(x, QArray))
    return pick(True), pick(False)


def combine(adapters, frozen):
    """Inverse of :func:`split_lora`."""
    return jax.tree_util.tree_map(lambda a, f: f if a is None else a, adapters, frozen,
                                  is_leaf=lambda x: x is None or isinstance(x, QArray))


class QATDense(nn.Module):
    """Linen dense layer trained through its quantized kernel (:mod:`jax_fp4.nn.qat`).

    Attributes: ``features``, ``use_bias``, ``kernel_init``, ``bias_init``, ``param_dtype``
    and the :class:`~jax_fp4.nn.qat.QATConfig` fields (``format``, ``block_size``,
    ``tensor_scale``, ``scale_rounding``, ``scale_dtype``, ``ste``, ``act_format``).
    Params: ``kernel`` float (in, features), ``bias``. :func:`convert_params` gives the
    params of the :class:`~jax_fp4.nn.flax.QuantizedDense` with the same options, whose
    forward is bit-identical.
    """

    features: int
    use_bias: bool = True
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    param_dtype: Any = jnp.float32
    format: str = "nvfp4"
    block_size: Optional[int] = None
    tensor_scale: Any = "auto"
    scale_rounding: str = "floor"
    scale_dtype: Any = None
    ste: str = "identity"
    act_format: Optional[str] = None

    def config(self) -> QATConfig:
        return QATConfig(self.format, self.block_size, self.tensor_scale,
                         self.scale_rounding, self.scale_dtype, self.ste, self.act_format)

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features),
                            self.param_dtype)
        bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
                if self.use_bias else None)
        dtype = jnp.result_type(x.dtype, kernel.dtype)
        return qat_linear(jnp.asarray(x, dtype), kernel,
                          None if bias is None else bias.astype(dtype), self.config(),
                          contract_axis=0)


def convert_params(params, module: QATDense):
    """QATDense params -> QuantizedDense params (every ``kernel`` leaf quantized along axis
    0 with ``module``'s options)."""
    cfg = module.config()

    def f(path, leaf):
        if P.path_str(path).rsplit(".", 1)[-1] == "kernel" and not isinstance(leaf, QArray):
            return convert_weight(leaf, cfg, 0)
        return leaf

    return jax.tree_util.tree_map_with_path(f, params)
