"""bitsandbytes 4-bit (SEEDS_API.md 003, the Triton backend): blockwise quantize /
dequantize over the flattened tensor and the quant-state container.

Packing: byte j = code[2j] << 4 | code[2j+1] (first element in the HIGH nibble); blocks of
``blocksize`` run over the flattened tensor. JAX arrays are immutable, so the caller-
allocated outputs of the upstream functions (``absmax``, ``quantized_out``, ``out``) are
accepted for signature compatibility and the results are returned instead.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..formats import NF4_TABLE
from ..reference import round_f32_to
from ._common import F32, amax_blocks, div, f32, mul

__all__ = ["quantize_4bit_blockwise_triton", "dequantize_4bit_impl",
           "dequantize_4bit_impl_passing_code", "QuantState", "quantize_4bit",
           "dequantize_4bit", "FP4_TABLE", "NF4_THRESHOLDS"]

# FP4 thresholds on |y| and the code of each bracket, highest first (SEEDS_API.md 003)
_FP4_T = np.float32([0.8333333, 0.583333, 0.4166667, 0.29166667, 0.20833333, 0.0859375,
                     0.00260417])
_FP4_C = np.uint8([3, 2, 5, 4, 7, 6, 1, 0])
#: the Triton dequantize table (float32 of these literals; 0.00520833 != 1/192)
FP4_TABLE = np.float32([0, 0.00520833, 0.66666667, 1.0, 0.33333333, 0.5, 0.16666667, 0.25])
#: NF4 thresholds: f32 of the float64 midpoints of the NF4 table
NF4_THRESHOLDS = ((NF4_TABLE[:-1].astype(np.float64) + NF4_TABLE[1:]) / 2).astype(np.float32)


def _codes(y, quant_type):
    if quant_type == "fp4":
        t = jnp.abs(y)
        mag = jnp.full(y.shape, 0, jnp.uint8)
        for thr, code in zip(_FP4_T[::-1], _FP4_C[::-1][1:]):  # ascending: later wins
            mag = jnp.where(t > thr, jnp.uint8(code), mag)
        return mag | jnp.where(y < 0, jnp.uint8(8), jnp.uint8(0))
    return jnp.sum(y[..., None] > jnp.asarray(NF4_THRESHOLDS), axis=-1).astype(jnp.uint8)


def quantize_4bit_blockwise_triton(A, blocksize, quant_type, blocks=None, absmax=None,
                                   num_elements=None, quantized_out=None):
    """Blockwise 4-bit quantize of the flattened ``A``.

    Args:
      A: float16/bfloat16/float32 array of any shape (n elements).
      blocksize: power of two; quant_type: "fp4", anything else is NF4 (as upstream).
      blocks, absmax, num_elements, quantized_out: the upstream caller-allocated outputs;
        if given, their sizes are checked (blocks = ceil(n/blocksize), quantized_out >=
        ceil(n/2) bytes) and otherwise ignored.
    Returns:
      (quantized_out uint8 (ceil(n/2),), absmax float32 (blocks,)). y = clamp(x / absmax,
      -1, 1) (true divide in float32); an all-zero block gets the code of 0 (fp4 0x0, nf4
      0x7; undefined upstream); odd n pads the last byte with the code of 0.
    """
    n = math.prod(A.shape)
    nb = -(-n // blocksize)
    if blocksize < 1 or blocksize & (blocksize - 1):
        raise ValueError(f"blocksize: expected a power of two, got {blocksize}")
    if blocks is not None and int(blocks) != nb:
        raise ValueError(f"blocks: expected ceil({n}/{blocksize}) = {nb}, got {blocks}")
    if num_elements is not None and int(num_elements) != n:
        raise ValueError(f"num_elements: expected {n}, got {num_elements}")
    if absmax is not None and math.prod(absmax.shape) != nb:
        raise ValueError(f"absmax: expected {nb} elements, got {math.prod(absmax.shape)}")
    if quantized_out is not None and math.prod(quantized_out.shape) < -(-n // 2):
        raise ValueError(f"quantized_out: needs at least {-(-n // 2)} bytes")
    x = jnp.pad(f32(A).reshape(-1), (0, nb * blocksize - n)).reshape(nb, blocksize)
    am = amax_blocks(x.reshape(-1), blocksize)
    safe = jnp.where(am == 0, 1.0, am)
    y = jnp.clip(div(x, safe[:, None]), -1.0, 1.0)
    codes = _codes(y, quant_type).reshape(-1)[:n]
    if n % 2:
        codes = jnp.concatenate([codes, _codes(jnp.zeros((1,), F32), quant_type)])
    c = codes.reshape(-1, 2)
    return (c[:, 0] << 4) | c[:, 1], am


def _dequant(A, absmax, blocksize, table, out):
    n = math.prod(out.shape)
    b = jnp.asarray(A).reshape(-1)
    if 2 * b.size < n:
        raise ValueError(f"out: {n} elements, but A holds only {2 * b.size}")
    codes = jnp.stack([b >> 4, b & 0xF], -1).reshape(-1)[:n].astype(jnp.int32)
    am = jnp.asarray(absmax, F32).reshape(-1)[jnp.arange(n) // blocksize]
    return round_f32_to(mul(jnp.asarray(table, F32)[codes], am), out.dtype).reshape(out.shape)


def dequantize_4bit_impl(A, absmax, blocksize, quant_type, dtype, out):
    """Decode: value = table[code & 7] * (-1 if code & 8) * absmax[block] (float32, RNE to
    ``out.dtype``; ``dtype`` is unused upstream). fp4 uses :data:`FP4_TABLE` (code 8 gives
    -0.0); nf4 the NF4 table. ``out`` (an array or ``jax.ShapeDtypeStruct``) gives shape
    and dtype; the result is returned (upstream fills ``out`` and returns None)."""
    if quant_type == "fp4":
        table = np.concatenate([FP4_TABLE, -FP4_TABLE]).astype(np.float32)
    else:
        table = NF4_TABLE
    return _dequant(A, absmax, blocksize, table, out)


def dequantize_4bit_impl_passing_code(A, absmax, blocksize, code, dtype, out):
    """As :func:`dequantize_4bit_impl` with a caller's float32 16-entry ``code`` table."""
    return _dequant(A, absmax, blocksize, code, out)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["absmax", "code", "offset", "state2"],
                   meta_fields=["shape", "blocksize", "quant_type", "dtype"])
@dataclasses.dataclass
class QuantState:
    """bitsandbytes' quant-state container (``bitsandbytes.functional.QuantState``): the
    fields a 4-bit tensor needs to be decoded. Double quantization (``offset``,
    ``state2``) is carried but not produced by :func:`quantize_4bit` (SEEDS_API.md is
    silent on it). A pytree: arrays are leaves, shape / blocksize / quant_type / dtype are
    static, so it passes through ``jax.jit``."""

    absmax: Any
    shape: tuple = None
    code: Any = None
    blocksize: int = 64
    quant_type: str = "fp4"
    dtype: Any = jnp.float32
    offset: Optional[Any] = None
    state2: Optional["QuantState"] = None

    @property
    def nested(self) -> bool:
        return self.state2 is not None

    def as_dict(self) -> dict:
        d = {"quant_type": self.quant_type, "absmax": self.absmax, "blocksize": self.blocksize,
             "quant_map": self.code, "dtype": jnp.dtype(self.dtype).name,
             "shape": tuple(self.shape)}
        if self.nested:
            d.update(nested_absmax=self.state2.absmax, nested_blocksize=self.state2.blocksize,
                     nested_quant_map=self.state2.code,
                     nested_dtype=jnp.dtype(self.state2.dtype).name,
                     nested_offset=float(self.offset))
        return d


def quantize_4bit(A, blocksize=64, quant_type="fp4"):
    """-> (packed uint8 (ceil(n/2), 1), QuantState), as ``bitsandbytes.functional``."""
    q, absmax = quantize_4bit_blockwise_triton(A, blocksize, quant_type)
    table = (np.concatenate([FP4_TABLE, -FP4_TABLE]) if quant_type == "fp4" else NF4_TABLE)
    return q.reshape(-1, 1), QuantState(absmax, tuple(A.shape), jnp.asarray(table, F32),
                                        blocksize, quant_type, jnp.dtype(A.dtype))


def dequantize_4bit(A, quant_state: QuantState):
    """Decode with a :class:`QuantState` (nested absmax: code2[absmax] * absmax2[i // bs2]
    + offset, float32)."""
    qs = quant_state
    absmax = jnp.asarray(qs.absmax)
    if qs.nested:
        s2 = qs.state2
        a2 = jnp.asarray(s2.absmax, F32)[jnp.arange(absmax.size) // s2.blocksize]
        absmax = mul(jnp.asarray(s2.code, F32)[absmax.astype(jnp.int32)], a2) + F32(qs.offset)
    out = jnp.zeros(qs.shape, qs.dtype)
    return _dequant(A, absmax, qs.blocksize, qs.code, out)
