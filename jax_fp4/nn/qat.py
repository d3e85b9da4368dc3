"""Quantization-aware training (QAT): a dense layer whose float weight trains through its
quantized value, framework-neutral arithmetic.

Forward: the weight W is quantized (:func:`jax_fp4.quantize`, the same options a
:class:`~jax_fp4.nn.flax.QuantizedLinear` is built with) and the layer runs exactly the
computation of the deployed quantized layer, :func:`jax_fp4.nn.params.linear` on that
QArray. Its value is the fake-quantized (QDQ) forward ``x @ fake_quantize(W) + b``, and the
QArray the trained layer converts to (:func:`convert_weight`) gives the same forward bit for
bit, because it is the same program on the same codes.

Backward: the straight-through estimator of :func:`jax_fp4.fake_quantize` (``ste``
"identity": dL/dW = dL/d(QDQ(W)) wherever W is finite; "clipped": also zero where W
saturated its block), dL/dx through the dequantized weight as in the W4A16 matmul, and
activations (``act_format``) fake-quantized with the identity STE.

``contract_axis`` is 0 for Flax kernels (in, out) and 1 for Equinox / PyTorch weights
(out, in), as in :func:`jax_fp4.nn.params.linear`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from ..formats import get_format
from ..ops import fake_quantize, quantize
from . import params as P

__all__ = ["QATConfig", "qat_linear", "convert_weight"]


@dataclasses.dataclass(frozen=True)
class QATConfig:
    """How a QAT layer quantizes: weight ``format`` with :func:`jax_fp4.quantize` options
    (``block_size``, ``tensor_scale`` ("auto" = two-level NVFP4, None = one level; nvfp4
    only), ``scale_rounding`` (MX), ``scale_dtype`` (int4)), the ``ste`` of
    :func:`jax_fp4.fake_quantize`, and activations (``act_format`` None / "nvfp4" / an MX
    format, fake-quantized with a dynamic per-call tensor scale for NVFP4)."""

    format: str = "nvfp4"
    block_size: Optional[int] = None
    tensor_scale: Optional[str] = "auto"
    scale_rounding: str = "floor"
    scale_dtype: Optional[str] = None
    ste: str = "identity"
    act_format: Optional[str] = None

    def __post_init__(self):
        f = get_format(self.format)
        object.__setattr__(self, "format", f.name)
        if self.tensor_scale not in (None, "auto"):
            raise ValueError(f"tensor_scale: expected None or 'auto' for QAT, got "
                             f"{self.tensor_scale!r}")
        if self.ste not in ("identity", "clipped"):
            raise ValueError(f"ste: expected 'identity' or 'clipped', got {self.ste!r}")
        P.check_act_options(f.name, self.act_format, "fake", self.block_size)

    def quant_kwargs(self):
        _, kw = P._quant_kwargs(self.format, self.block_size, self.tensor_scale,
                                self.scale_rounding, self.scale_dtype)
        return kw


def convert_weight(w, cfg: QATConfig, contract_axis: int):
    """The trained float weight as the QArray the deployed layer holds (blocked along
    ``contract_axis``)."""
    return quantize(jnp.asarray(w), cfg.format, axis=contract_axis, **cfg.quant_kwargs())


def _forward(x, q, bias, cfg, contract_axis):
    return P.linear(x, q, bias, contract_axis=contract_axis, act_format=cfg.act_format,
                    act_mode="fake")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _qat(x, w, bias, cfg, contract_axis):
    return _forward(x, convert_weight(w, cfg, contract_axis), bias, cfg, contract_axis)


def _qat_fwd(x, w, bias, cfg, contract_axis):
    q = convert_weight(w, cfg, contract_axis)
    y, vjp_xb = jax.vjp(lambda x_, b_: _forward(x_, q, b_, cfg, contract_axis), x, bias)
    return y, (vjp_xb, x, w)


def _qat_bwd(cfg, contract_axis, res, g):
    vjp_xb, x, w = res
    dx, db = vjp_xb(g)
    # dL/dQDQ(W) = x^T g (Flax (K, N)) or g^T x (Equinox (N, K)), on the activations the
    # matmul saw (fake-quantized when act_format is set)
    xa = x
    if cfg.act_format is not None:
        af = get_format(cfg.act_format)
        ts = P.act_tensor_scale(x, None) if af.has_tensor_scale else None
        xa = fake_quantize(x, af.name, axis=-1, tensor_scale=ts)
    k = x.shape[-1]
    x2 = xa.reshape(-1, k).astype(jnp.float32)
    g2 = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    dqdq = x2.T @ g2 if contract_axis == 0 else g2.T @ x2
    kw = cfg.quant_kwargs()
    _, ste_vjp = jax.vjp(lambda v: fake_quantize(v, cfg.format, axis=contract_axis,
                                                 ste=cfg.ste, **kw), w)
    (dw,) = ste_vjp(dqdq.astype(w.dtype))
    return dx, dw, db


_qat.defvjp(_qat_fwd, _qat_bwd)


def qat_linear(x, w, bias, cfg: QATConfig, *, contract_axis: int = 0):
    """The QAT dense layer (module docstring).

    Args:
      x: (..., K) float array.
      w: float weight, (K, N) for contract_axis=0 (Flax) or (N, K) for 1 (Equinox); K a
        multiple of the block size.
      bias: (N,) array or None.
      cfg: :class:`QATConfig`.
    Returns:
      (..., N) array of x's dtype: ``jax_fp4.nn.params.linear(x, convert_weight(w), bias)``.
    """
    return _qat(x, w, bias, cfg, contract_axis)
