"""The format registry: every number format jax-fp4 knows, as static data.

Each :class:`Format` carries what the reference path, the kernels and the public API need
to know about a format: element bits and codec, block size rules, the scale's dtype and
the FFI id. The bit-level semantics live in :mod:`jax_fp4.reference` (and
``csrc/codecs.h``); this module only describes.

Conventions: docs/spec.md section 3 (the project's spec), after OCP Microscaling v1.0 (MX),
NVIDIA NVFP4 (torchao ``nvfp4_quantize``), bitsandbytes 0.50 (NF4, FP4) and AutoAWQ (INT4).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class MiniFloat:
    """A sign + ``ebits`` exponent + ``mbits`` mantissa float with no Inf/NaN codes used.

    ``max_code`` is the magnitude code of the largest finite value (saturation target).
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max_code: int
    np_dtype: object  # the ml_dtypes dtype with the same encoding (decode tables, tests)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def max_value(self) -> float:
        return float(decode_table(self)[self.max_code])

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two <= max_value (OCP MX ``emax_elem``)."""
        return int(np.floor(np.log2(self.max_value)))


E2M1 = MiniFloat("e2m1", 2, 1, 1, 0x7, ml_dtypes.float4_e2m1fn)
E2M3 = MiniFloat("e2m3", 2, 3, 1, 0x1F, ml_dtypes.float6_e2m3fn)
E3M2 = MiniFloat("e3m2", 3, 2, 3, 0x1F, ml_dtypes.float6_e3m2fn)
E4M3 = MiniFloat("e4m3", 4, 3, 7, 0x7E, ml_dtypes.float8_e4m3fn)
E5M2 = MiniFloat("e5m2", 5, 2, 15, 0x7B, ml_dtypes.float8_e5m2)


def decode_table(mf: MiniFloat) -> np.ndarray:
    """float32 value of every code 0 .. 2**bits - 1 of ``mf`` (from ml_dtypes)."""
    # ml_dtypes stores 4/6-bit floats one per byte, the code in the low bits.
    return np.arange(1 << mf.bits, dtype=np.uint8).view(mf.np_dtype).astype(np.float32)


# bitsandbytes 0.50 code tables (functional.get_4bit_type), float32.
NF4_TABLE = np.array(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=np.float32)
_FP4_POS = np.array([0, 0.0625, 8, 12, 4, 6, 2, 3], dtype=np.float32) / np.float32(12)
BNB_FP4_TABLE = np.concatenate([_FP4_POS, np.float32([0.0]), -_FP4_POS[1:]]).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Format:
    """Static description of one quantization format.

    Attributes:
      name: registry key (``"nvfp4"``, ``"mxfp4"``, ...).
      fid: the ``fmt`` attribute of the FFI targets (csrc/README.md).
      family: ``"nvfp4" | "mx" | "codebook" | "int4"``.
      bits: bits per element code (4, 6 or 8).
      elem: the element :class:`MiniFloat` (None for codebook and int formats).
      default_block: block (group) size used when the caller gives none.
      scale_dtype: dtype of the per-block scale (None: chosen per call, int4).
      table: float32 code table (codebook formats).
    """

    name: str
    fid: int
    family: str
    bits: int
    default_block: int
    elem: Optional[MiniFloat] = None
    scale_dtype: object = None
    table: Optional[np.ndarray] = None

    @property
    def has_zeros(self) -> bool:
        """Whether blocks carry a uint8 zero point (INT4, asymmetric; AutoAWQ)."""
        return self.family == "int4"

    @property
    def has_tensor_scale(self) -> bool:
        """Whether a float32 per-tensor scale may multiply the block scales (NVFP4's
        two-level scaling)."""
        return self.family == "nvfp4"

    @property
    def minifloat_scales(self) -> bool:
        """Whether block scales are 8-bit float codes stored as uint8 bits (E4M3 for
        NVFP4, E8M0 for MX), bounding each block's range at max_elem * scale."""
        return self.family in ("nvfp4", "mx")

    @property
    def has_scale_rounding(self) -> bool:
        """Whether the block scale's rounding is a choice ("floor" or "rceil": OCP MX)."""
        return self.family == "mx"

    @property
    def scale_dtype_per_call(self) -> bool:
        """Whether the block scales' dtype is chosen per call (INT4: x's dtype by default,
        or any float dtype; the others have one fixed scale dtype, ``scale_dtype``)."""
        return self.scale_dtype is None

    def default_scale_dtype(self, x_dtype):
        """The block-scale dtype a call chooses when given none: x's dtype where it is
        chosen per call (INT4), else None (the format's fixed ``scale_dtype``)."""
        return np.dtype(x_dtype) if self.scale_dtype_per_call else None

    @property
    def nan_scale(self):
        """The block scale that marks a block holding NaN or Inf: the NaN code of the
        scale's minifloat (E4M3 0x7F, E8M0 0xFF), else a float NaN."""
        return {"nvfp4": 0x7F, "mx": 0xFF}.get(self.family, np.nan)

    @property
    def scale_bits_dtype(self):
        """The dtype of the block-scale bits (float8_e4m3fn, float8_e8m0fnu) for
        minifloat scales, else None."""
        return self.scale_dtype if self.minifloat_scales else None

    def scale_buffer_dtype(self, scale_dtype=None) -> np.dtype:
        """dtype of the block-scale buffer of the FFI / reference layout (csrc/README.md):
        uint8 bits for NVFP4 / MX, float32 absmax for codebooks, ``scale_dtype`` for INT4
        (chosen per call).

        Raises:
          ValueError: INT4 without ``scale_dtype``."""
        if self.family == "int4":
            if scale_dtype is None:
                raise ValueError("scale_dtype: int4 group scales need a dtype, got None")
            return np.dtype(scale_dtype)
        return np.dtype(np.float32) if self.family == "codebook" else np.dtype(np.uint8)

    @property
    def data_dtype(self):
        """dtype of ``QArray.data``: the float8 dtype for MXFP8, packed uint8 otherwise."""
        return self.elem.np_dtype if self.bits == 8 else np.dtype(np.uint8)

    def check_block_size(self, block_size: int, k: Optional[int] = None) -> None:
        """Raise ValueError if ``block_size`` is not allowed (for blocked-axis length k)."""
        bs = block_size
        if self.family == "nvfp4" and bs != 16:
            raise ValueError(f"block_size: nvfp4 uses blocks of 16, got {bs}")
        if self.family == "mx" and bs != 32:
            raise ValueError(f"block_size: {self.name} uses blocks of 32 (OCP MX), got {bs}")
        if self.family == "codebook" and not (32 <= bs <= 4096 and bs & (bs - 1) == 0):
            raise ValueError(
                f"block_size: {self.name} needs a power of two in [32, 4096], got {bs}")
        if self.family == "int4" and bs < 1:
            raise ValueError(f"block_size: int4 group size must be >= 1, got {bs}")
        if k is not None and k % bs:
            raise ValueError(
                f"x: the blocked axis has length {k}, which is not a multiple of "
                f"block_size {bs} for format {self.name!r}")
        if k is not None and (k * self.bits) % 8:
            raise ValueError(
                f"x: the blocked axis has length {k}; {self.name} packs {self.bits}-bit codes "
                f"into bytes, so it must be a multiple of {8 // np.gcd(8, self.bits)}")


_FORMATS = {}


def _register(f: Format) -> None:
    _FORMATS[f.name] = f


_register(Format("nvfp4", 0, "nvfp4", 4, 16, E2M1, ml_dtypes.float8_e4m3fn))
_register(Format("mxfp4", 1, "mx", 4, 32, E2M1, ml_dtypes.float8_e8m0fnu))
_register(Format("mxfp6_e2m3", 2, "mx", 6, 32, E2M3, ml_dtypes.float8_e8m0fnu))
_register(Format("mxfp6_e3m2", 3, "mx", 6, 32, E3M2, ml_dtypes.float8_e8m0fnu))
_register(Format("mxfp8_e4m3", 4, "mx", 8, 32, E4M3, ml_dtypes.float8_e8m0fnu))
_register(Format("mxfp8_e5m2", 5, "mx", 8, 32, E5M2, ml_dtypes.float8_e8m0fnu))
_register(Format("nf4", 6, "codebook", 4, 64, None, np.dtype(np.float32), NF4_TABLE))
_register(Format("bnb_fp4", 7, "codebook", 4, 64, None, np.dtype(np.float32), BNB_FP4_TABLE))
_register(Format("int4", 8, "int4", 4, 128, None, None))

FORMAT_NAMES = tuple(_FORMATS)


def get_format(name) -> Format:
    """Look up a format by name (or pass a :class:`Format` through).

    Raises:
      ValueError: unknown name, listing the known ones.
    """
    if isinstance(name, Format):
        return name
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"format: unknown format {name!r}; expected one of {', '.join(FORMAT_NAMES)}"
        ) from None
