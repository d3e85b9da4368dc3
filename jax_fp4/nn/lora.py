"""LoRA on a frozen 4-bit base (QLoRA), framework-neutral arithmetic.

QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"; the peft /
bitsandbytes ``Linear4bit`` + ``LoraLayer`` pair): a dense layer keeps its weight W as a
frozen :class:`~jax_fp4.QArray` (NF4 by default) and learns a low-rank update

    y = x @ W + b + dropout(x) @ A @ B * (alpha / rank)

with A (in, rank) drawn as ``torch.nn.Linear``'s default (Kaiming uniform, a = sqrt(5):
U(-1/sqrt(in), 1/sqrt(in))) and B (rank, out) zero, so training starts at the base model.
Only A and B receive gradients; W is decoded block by block inside the matmul
(:func:`jax_fp4.dot_general`), never stored dequantized.

Layout conventions follow the host framework: Flax stores A (in, rank), B (rank, out)
(``flax.nnx.LoRA``); Equinox / PyTorch (peft) store ``lora_A`` (rank, in), ``lora_B``
(out, rank). ``contract_axis`` says which: 0 for Flax (kernel (in, out)), 1 for Equinox
(weight (out, in)), as in :func:`jax_fp4.nn.params.linear`.

The layers live in :mod:`jax_fp4.nn.flax_train` (NNX ``LoRALinear``, Linen ``LoRADense``)
and :mod:`jax_fp4.nn.equinox_train` (``LoRALinear``).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import jax
import jax.numpy as jnp

from ..formats import get_format
from ..ops import dequantize, quantize
from ..qarray import QArray

__all__ = ["lora_a_init", "lora_delta", "merged_weight", "requantize", "check_lora_options"]


def check_lora_options(rank, alpha, dropout) -> float:
    """Validate LoRA hyper-parameters; returns the scale alpha / rank.

    Raises:
      TypeError: rank not an int.
      ValueError: rank < 1, alpha not finite, dropout outside [0, 1).
    """
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank: expected an int, got {type(rank).__name__}")
    if rank < 1:
        raise ValueError(f"rank: expected >= 1, got {rank}")
    if not math.isfinite(float(alpha)):
        raise ValueError(f"alpha: expected a finite number, got {alpha!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout: expected a rate in [0, 1), got {dropout!r}")
    return float(alpha) / rank


def lora_a_init(key, shape, dtype=jnp.float32, *, fan_in: int):
    """LoRA A init of peft / ``torch.nn.Linear``: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    lim = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -lim, lim)


def lora_delta(x, a, b, scale: float, *, contract_axis: int = 0):
    """The LoRA branch ``x @ A @ B * scale`` (Flax layout, contract_axis=0: A (in, r),
    B (r, out)) or ``x @ A^T @ B^T * scale`` (Equinox / peft layout, contract_axis=1:
    A (r, in), B (out, r)). x (..., in) -> (..., out) in x's dtype (A, B cast to it)."""
    a = a.astype(x.dtype)
    b = b.astype(x.dtype)
    if contract_axis == 0:
        h = x @ a
        return (h @ b) * jnp.asarray(scale, x.dtype)
    h = x @ a.T
    return (h @ b.T) * jnp.asarray(scale, x.dtype)


def merged_weight(base, a, b, scale: float, *, contract_axis: int = 0, dtype=None):
    """The dense weight ``W + A @ B * scale`` (Flax (in, out)) or ``W + B @ A * scale``
    (Equinox (out, in)), with W a QArray (decoded in float32) or a float array.

    Returns: float array shaped like ``base`` in ``dtype`` (default: the base's dtype)."""
    dtype = jnp.dtype(dtype or base.dtype)
    w = dequantize(base, jnp.float32) if isinstance(base, QArray) else jnp.asarray(
        base, jnp.float32)
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    d = a32 @ b32 if contract_axis == 0 else b32 @ a32
    return (w + d * jnp.float32(scale)).astype(dtype)


def requantize(w, like: QArray, format: Optional[str] = None) -> QArray:
    """Quantize the dense weight ``w`` the way ``like`` was quantized: same blocked axis,
    block size, one- / two-level NVFP4 (tensor scale "auto"), INT4 scale dtype; ``format``
    overrides the format (its default block size then applies when it differs)."""
    f = get_format(format or like.format)
    kw = {}
    if f.name == like.format:
        kw["block_size"] = like.block_size
        if f.scale_dtype_per_call:
            kw["scale_dtype"] = like.scales.dtype
        if f.has_tensor_scale and like.tensor_scale is not None:
            kw["tensor_scale"] = "auto"
    elif f.has_tensor_scale:
        kw["tensor_scale"] = "auto"
    return quantize(jnp.asarray(w, like.dtype), f.name, axis=like.axis, **kw)


def merge(base, a, b, scale: float, *, contract_axis: int,
          requantize_to: Union[bool, str] = False):
    """``merged_weight`` (float, requantize_to=False) or its :func:`requantize` (True: the
    base's format; a format name: that format). A float base with requantize_to=True stays
    float."""
    w = merged_weight(base, a, b, scale, contract_axis=contract_axis)
    if requantize_to is False or (requantize_to is True and not isinstance(base, QArray)):
        return w
    if isinstance(base, QArray):
        return requantize(w, base, None if requantize_to is True else requantize_to)
    return quantize(w, get_format(requantize_to).name, axis=contract_axis)
