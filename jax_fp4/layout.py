"""Bit packing of element codes and the 128x4 scale swizzle (pure jnp).

Packing (docs/spec.md section 3): codes form a little-endian bit stream along the last axis;
element i occupies bits [i*b, i*b+b) of the row's bytes. For b = 4, element 2j is the low
nibble of byte j (PTX ``cvt.*.e2m1x2``, CUTLASS, torchao ``pack_uint4``, ModelOpt); for
b = 6, four elements fill three bytes.

Swizzle: the 128x4 tiled scale layout read by cuBLASLt, CUTLASS, ``torch._scaled_mm`` and
Blackwell block-scaled tensor cores; identical to torchao ``to_blocked``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax


def pack(codes, bits: int):
    """Pack integer codes (..., K) (values < 2**bits) into uint8 (..., K*bits/8).

    Args:
      codes: unsigned integer array, last axis K with K*bits % 8 == 0.
      bits: 4, 6 or 8.
    Returns:
      uint8 array (..., K*bits//8).
    """
    c = codes.astype(jnp.uint8)
    if bits == 8:
        return c
    k = c.shape[-1]
    if bits == 4:
        c = c.reshape(*c.shape[:-1], k // 2, 2)
        return (c[..., 0] & 0xF) | (c[..., 1] << 4)
    if bits == 6:
        c = c.reshape(*c.shape[:-1], k // 4, 4) & 0x3F
        e0, e1, e2, e3 = (c[..., i] for i in range(4))
        b0 = e0 | (e1 << 6)
        b1 = (e1 >> 2) | (e2 << 4)
        b2 = (e2 >> 4) | (e3 << 2)
        return jnp.stack([b0, b1, b2], axis=-1).reshape(*c.shape[:-2], k * 3 // 4)
    raise ValueError(f"bits: expected 4, 6 or 8, got {bits}")


def unpack(data, bits: int):
    """Inverse of :func:`pack`: uint8 (..., K*bits/8) -> uint8 codes (..., K)."""
    d = data.astype(jnp.uint8)
    if bits == 8:
        return d
    if bits == 4:
        out = jnp.stack([d & 0xF, d >> 4], axis=-1)
        return out.reshape(*d.shape[:-1], d.shape[-1] * 2)
    if bits == 6:
        d = d.reshape(*d.shape[:-1], d.shape[-1] // 3, 3)
        b0, b1, b2 = d[..., 0], d[..., 1], d[..., 2]
        e0 = b0 & 0x3F
        e1 = (b0 >> 6) | ((b1 & 0xF) << 2)
        e2 = (b1 >> 4) | ((b2 & 0x3) << 4)
        e3 = b2 >> 2
        out = jnp.stack([e0, e1, e2, e3], axis=-1)
        return out.reshape(*d.shape[:-2], d.shape[-2] * 4)
    raise ValueError(f"bits: expected 4, 6 or 8, got {bits}")


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    """2-D shape of the swizzled scales of a (rows, cols) linear scale matrix:
    (ceil(rows/128)*32, ceil(cols/4)*16) — the same bytes as the flat :func:`to_blocked`."""
    return (math.ceil(rows / 128) * 32, math.ceil(cols / 4) * 16)


def to_blocked(scales):
    """Swizzle a 2-D (rows, cols) scale matrix into the 128x4 tiled layout.

    Rows are zero-padded to a multiple of 128 and columns to a multiple of 4; scale
    (m, k) lands at flat offset (m//128)*nK*512 + (k//4)*512 + (m%32)*16
    + ((m%128)//32)*4 + k%4 with nK = ceil(cols/4) (torchao ``to_blocked``; cuBLAS
    "1D block scaling factors layout").

    Args:
      scales: (rows, cols) array of any dtype.
    Returns:
      flat array of length ceil(rows/128)*128*ceil(cols/4)*4, same dtype.
    Raises:
      ValueError: scales is not 2-D.
    """
    if scales.ndim != 2:
        raise ValueError(f"scales: expected a 2-D (rows, cols) array, got shape {scales.shape}")
    rows, cols = scales.shape
    nr, nk = math.ceil(rows / 128), math.ceil(cols / 4)
    # Pad the raw bytes: float8_e8m0fnu has no 0.0 (jnp.pad's 0 would become NaN 0xFF).
    bits = jnp.dtype(f"uint{8 * scales.dtype.itemsize}")
    s = lax.bitcast_convert_type(scales, bits) if scales.dtype != bits else scales
    s = jnp.pad(s, ((0, nr * 128 - rows), (0, nk * 4 - cols)))
    s = lax.bitcast_convert_type(s, scales.dtype) if scales.dtype != bits else s
    # (rb, m4, m32, cb, k4) -> (rb, cb, m32, m4, k4)
    s = s.reshape(nr, 4, 32, nk, 4).transpose(0, 3, 2, 1, 4)
    return s.reshape(-1)


def from_blocked(blocked, shape):
    """Inverse of :func:`to_blocked`.

    Args:
      blocked: the swizzled scales, flat or 2-D (any shape with the right size).
      shape: (rows, cols) of the linear scale matrix to recover.
    Returns:
      (rows, cols) array, the padding dropped.
    Raises:
      ValueError: blocked has the wrong number of elements for ``shape``.
    """
    rows, cols = (int(d) for d in shape)
    nr, nk = math.ceil(rows / 128), math.ceil(cols / 4)
    if blocked.size != nr * nk * 512:
        raise ValueError(
            f"blocked: expected {nr * nk * 512} elements for a swizzled ({rows}, {cols}) "
            f"scale matrix, got {blocked.size} (shape {blocked.shape})")
    s = blocked.reshape(nr, nk, 32, 4, 4).transpose(0, 3, 2, 1, 4)
    return s.reshape(nr * 128, nk * 4)[:rows, :cols]


# The prepared ("tiled") weight layout of :func:`jax_fp4.prepare`, read by the fused W4A16
# wgmma kernel (csrc/cuda/wmatmul/wgmma_config.cuh, wg_tiled_side_bytes): rows in tiles of TILE_ROWS, K in
# steps of TILE_K; a (rows, cols) buffer of codes, scales or zero points with `per_step` =
# its columns per TILE_K elements (64 code bytes of 4-bit elements, TILE_K / block_size
# scales or zero points) is stored tile by tile, [row tile][k step][row in tile][per_step],
# so that each tile's bytes are contiguous (one 1-D bulk copy). The array keeps its shape:
# only bytes move.
TILE_ROWS = 128
TILE_K = 128
# A step's scale and zero-point bytes the kernel has room for (wmatmul/wgmma_config.cuh kWgTiledSide), for
# the formats whose block size and scale dtype vary (int4, nf4, bnb_fp4).
TILED_SIDE_BYTES = 2048
_SPEC_BLOCK = {"nvfp4": 16, "mxfp4": 32}  # the kernel decodes these in their spec blocks


def tileable(format: str, block_size: int, scale_dtype, rows: int, k: int) -> bool:
    """Whether a weight has a prepared layout (:func:`jax_fp4.prepare` applies).

    Args:
      format: the QArray's format name.
      block_size: its block (group) size.
      scale_dtype: dtype of its block scales.
      rows: rows of its stored data (``data.shape[-2]``, N of an (N, K) weight).
      k: length of its blocked axis.
    Returns:
      True for rows % 128 == 0 and k % 128 == 0 with nvfp4 (block 16) or mxfp4 (block 32),
      or with int4 / nf4 / bnb_fp4 in power-of-two blocks of 16..128 whose scales (and int4
      zero points, one byte each) per row and 128 k take at most TILED_SIDE_BYTES / 128
      bytes: int4 in groups of 64 or 128 with any scale dtype, or of 32 with 2-byte
      scales; nf4 / bnb_fp4 in blocks of 32..128. False otherwise.
    """
    if rows % TILE_ROWS or k % TILE_K:
        return False
    if format in _SPEC_BLOCK:
        return block_size == _SPEC_BLOCK[format]
    if format not in ("int4", "nf4", "bnb_fp4") or block_size & (block_size - 1):
        return False
    if not 16 <= block_size <= TILE_K:
        return False
    row = TILE_K // block_size * (jnp.dtype(scale_dtype).itemsize + (format == "int4"))
    return TILE_ROWS * row <= TILED_SIDE_BYTES


def tile_rows(a, per_step: int):
    """Reorder the last two axes (rows, cols) of ``a`` into the prepared layout.

    Args:
      a: (..., rows, cols) array, rows % TILE_ROWS == 0, cols % per_step == 0.
      per_step: columns per TILE_K elements of K (64 for 4-bit codes in bytes,
        TILE_K // block_size for scales and zero points).
    Returns:
      array of a's shape and dtype, element (r, c) moved to tile (r // 128, c // per_step),
      row r % 128, column c % per_step of that tile.
    """
    *lead, rows, cols = a.shape
    t = a.reshape(*lead, rows // TILE_ROWS, TILE_ROWS, cols // per_step, per_step)
    return jnp.swapaxes(t, -3, -2).reshape(a.shape)


def untile_rows(a, per_step: int):
    """Inverse of :func:`tile_rows`."""
    *lead, rows, cols = a.shape
    t = a.reshape(*lead, rows // TILE_ROWS, cols // per_step, TILE_ROWS, per_step)
    return jnp.swapaxes(t, -3, -2).reshape(a.shape)


def _move_weight(move, codes, scales, zeros, block_size):
    per_block = TILE_K // block_size
    return (move(codes, TILE_K // 2), move(scales, per_block),
            # int4 zero points are shaped as the scales; other formats have none (None, or an
            # empty placeholder in the primitives' buffers)
            zeros if zeros is None or zeros.ndim < 2 else move(zeros, per_block))


def tile_weight(codes, scales, zeros, block_size: int):
    """A 4-bit weight's packed codes (..., N, K/2) uint8, block scales (..., N, K/block_size)
    and int4 zero points (shaped as the scales; or None / a 1-D placeholder, passed through)
    into the prepared layout (:func:`tile_rows` of each). Returns (codes, scales, zeros)."""
    return _move_weight(tile_rows, codes, scales, zeros, block_size)


def untile_weight(codes, scales, zeros, block_size: int):
    """Inverse of :func:`tile_weight`."""
    return _move_weight(untile_rows, codes, scales, zeros, block_size)
