"""Training with 4-bit weights in Equinox: QLoRA adapters on a frozen quantized base and
quantization-aware training (QAT).

* :class:`LoRALinear` wraps a :class:`~jax_fp4.nn.equinox.QuantizedLinear` (or an
  ``equinox.nn.Linear``) with peft-layout adapters ``lora_a`` (rank, in), ``lora_b``
  (out, rank); :func:`add_lora` wraps a model's quantized layers, :func:`lora_filter` is
  the ``eqx.partition`` filter spec that selects the adapters alone, :func:`merge_lora`
  folds them back (float ``equinox.nn.Linear`` or re-quantized).
* :class:`QATLinear` trains a float (out, in) weight through its quantized value;
  :func:`qat_model` swaps ``equinox.nn.Linear`` layers for it and :func:`convert` gives
  ``QuantizedLinear`` layers with a bit-identical forward.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp

from ..formats import get_format
from ..qarray import QArray
from . import lora as L
from . import params as P
from .equinox import QuantizedLinear
from .qat import QATConfig, convert_weight, qat_linear

__all__ = ["LoRALinear", "add_lora", "lora_filter", "merge_lora", "QATLinear", "qat_model",
           "convert"]


class LoRALinear(eqx.Module):
    """A frozen dense layer plus a LoRA update:
    ``base(x) + dropout(x) @ lora_a^T @ lora_b^T * alpha / rank``.

    Args:
      base: :class:`~jax_fp4.nn.equinox.QuantizedLinear` (QLoRA) or ``equinox.nn.Linear``.
      rank, alpha, dropout: LoRA rank, scale numerator (scale = alpha / rank), dropout rate
        on the adapter input (applied when the call gets a ``key``).
      key: PRNG key for lora_a's init.

    Fields: ``base``, ``lora_a`` (rank, in) ~ U(-1/sqrt(in), 1/sqrt(in)), ``lora_b``
    (out, rank) = 0, static ``scale``, ``dropout``.
    Call: ``layer(x, *, key=None)``, x (..., in) -> (..., out).
    """

    base: Any
    lora_a: jax.Array
    lora_b: jax.Array
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(self, base, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0, *,
                 key, dtype=jnp.float32, lora_a=None, lora_b=None):
        self.scale = L.check_lora_options(rank, alpha, dropout)
        self.dropout = float(dropout)
        self.base = base
        n_in, n_out = base.in_features, base.out_features
        self.lora_a = (L.lora_a_init(key, (rank, n_in), dtype, fan_in=n_in)
                       if lora_a is None else lora_a)
        self.lora_b = jnp.zeros((n_out, rank), dtype) if lora_b is None else lora_b

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    def __call__(self, x, *, key=None):
        y = self.base(x)
        h = jnp.asarray(x, y.dtype)
        if self.dropout and key is not None:
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, h.shape)
            h = jnp.where(keep, h / (1.0 - self.dropout), 0).astype(h.dtype)
        return y + L.lora_delta(h, self.lora_a, self.lora_b, self.scale, contract_axis=1)


def _is_layer(x):
    return isinstance(x, (LoRALinear, QuantizedLinear, eqx.nn.Linear, QATLinear))


def add_lora(model, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0, *, key,
             filter: Optional[Callable[[str, Any], bool]] = None):
    """A copy of an Equinox model whose layers chosen by ``filter`` (``(dotted path,
    layer) -> bool``; default: every QuantizedLinear) are wrapped in :class:`LoRALinear`.

    Raises: ValueError when no layer is selected."""
    L.check_lora_options(rank, alpha, dropout)
    pred = filter or (lambda name, m: isinstance(m, QuantizedLinear))
    counter = [0]

    def wrap(path, m):
        if isinstance(m, (QuantizedLinear, eqx.nn.Linear)) and pred(P.path_str(path), m):
            counter[0] += 1
            return LoRALinear(m, rank, alpha, dropout, key=jax.random.fold_in(key, counter[0]))
        return m

    out = jax.tree_util.tree_map_with_path(wrap, model, is_leaf=_is_layer)
    if not counter[0]:
        raise ValueError("model: no layer selected for LoRA (filter matched no "
                         "QuantizedLinear / equinox.nn.Linear)")
    return out


def lora_filter(model):
    """The ``eqx.partition`` filter spec selecting the adapters (``lora_a``, ``lora_b``)
    and nothing else: ``train, frozen = eqx.partition(model, lora_filter(model))``."""
    spec = jax.tree_util.tree_map(lambda _: False, model,
                                  is_leaf=lambda x: isinstance(x, QArray))

    def mark(m):
        if isinstance(m, LoRALinear):
            return eqx.tree_at(lambda t: (t.lora_a, t.lora_b), m, replace=(True, True))
        return m

    return jax.tree_util.tree_map(mark, spec, is_leaf=lambda x: isinstance(x, LoRALinear))


def merge_lora(model, requantize: Union[bool, str] = False):
    """Fold each :class:`LoRALinear` into one dense layer, W' = W + B @ A * scale.

    requantize: False: ``equinox.nn.Linear`` with the float merged weight; True:
    :class:`~jax_fp4.nn.equinox.QuantizedLinear` in the base's format, block size and
    tensor-scale mode; a format name: QuantizedLinear in that format."""
    def fold(m):
        if not isinstance(m, LoRALinear):
            return m
        base = m.base
        w = L.merge(base.weight, m.lora_a, m.lora_b, m.scale, contract_axis=1,
                    requantize_to=requantize)
        bias = base.bias
        if isinstance(w, QArray):
            return QuantizedLinear(base.in_features, base.out_features, bias is not None,
                                   weight=w, bias=bias, format=w.format,
                                   block_size=w.block_size, name=getattr(base, "name", ""))
        lin = eqx.nn.Linear(base.in_features, base.out_features, bias is not None,
                            key=jax.random.key(0), dtype=w.dtype)
        lin = eqx.tree_at(lambda t: t.weight, lin, w)
        if bias is not None:
            lin = eqx.tree_at(lambda t: t.bias, lin, bias)
        return lin

    return jax.tree_util.tree_map(fold, model, is_leaf=lambda x: isinstance(x, LoRALinear))


class QATLinear(eqx.Module):
    """An Equinox dense layer trained through its quantized (out, in) weight
    (:mod:`jax_fp4.nn.qat`).

    Args: ``weight`` (out, in) float, ``bias`` (out,) or None, and the
    :class:`~jax_fp4.nn.qat.QATConfig` options; ``name`` goes to the converted layer.
    Call: ``layer(x, *, key=None)``, x (..., in) -> (..., out) = the value of
    ``x @ fake_quantize(weight, axis=1)^T + b`` computed as the converted
    :class:`~jax_fp4.nn.equinox.QuantizedLinear` computes it.
    """

    weight: jax.Array
    bias: Optional[jax.Array]
    cfg: QATConfig = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, weight, bias=None, *, format: str = "nvfp4",
                 block_size: Optional[int] = None, tensor_scale="auto",
                 scale_rounding: str = "floor", scale_dtype=None, ste: str = "identity",
                 act_format: Optional[str] = None, name: str = ""):
        self.cfg = QATConfig(format, block_size, tensor_scale, scale_rounding, scale_dtype,
                             ste, act_format)
        self.weight = jnp.asarray(weight)
        self.bias = None if bias is None else jnp.asarray(bias)
        self.name = name

    @property
    def in_features(self):
        return self.weight.shape[1]

    @property
    def out_features(self):
        return self.weight.shape[0]

    @classmethod
    def from_linear(cls, linear: eqx.nn.Linear, format: str = "nvfp4", **kwargs):
        return cls(linear.weight, linear.bias, format=format, **kwargs)

    def __call__(self, x, *, key=None):
        return qat_linear(jnp.asarray(x), self.weight, self.bias, self.cfg, contract_axis=1)

    def to_quantized(self) -> QuantizedLinear:
        c = self.cfg
        return QuantizedLinear(self.in_features, self.out_features, self.bias is not None,
                               weight=convert_weight(self.weight, c, 1), bias=self.bias,
                               format=c.format, block_size=c.block_size,
                               act_format=c.act_format, act_mode="fake", name=self.name)


def qat_model(model, format: str = "nvfp4", *,
              filter: Optional[Callable[[str, Any], bool]] = None, **kwargs):
    """A copy of an Equinox model whose ``equinox.nn.Linear`` layers (chosen by
    ``filter(dotted path, layer)``, default all whose in_features fits the block size)
    are :class:`QATLinear` (kwargs: its quantization options)."""
    bs = kwargs.get("block_size") or get_format(format).default_block

    def swap(path, m):
        if (isinstance(m, eqx.nn.Linear) and m.in_features % bs == 0
                and (filter is None or filter(P.path_str(path), m))):
            return QATLinear.from_linear(m, format, name=P.path_str(path), **kwargs)
        return m

    return jax.tree_util.tree_map_with_path(swap, model, is_leaf=_is_layer)


def convert(model):
    """Replace every :class:`QATLinear` by its :meth:`QATLinear.to_quantized` layer."""
    return jax.tree_util.tree_map(
        lambda m: m.to_quantized() if isinstance(m, QATLinear) else m, model,
        is_leaf=lambda x: isinstance(x, QATLinear))
