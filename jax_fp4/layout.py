"""Bit packing of element codes and the 128x4 scale swizzle (pure jnp).

Packing (DESIGN.md section 3): codes form a little-endian bit stream along the last axis;
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
# wgmma kernel (csrc/cuda/wmatmul.cu, wg_tileable): rows in tiles of TILE_ROWS, K in steps
# of TILE_K; a (rows, cols) buffer of codes or scales with `per_step` = its columns per
# TILE_K elements (64 code bytes of 4-bit elements, TILE_K / block_size scales) is stored
# tile by tile, [row tile][k step][row in tile][per_step], so that each tile's bytes are
# contiguous (one 1-D bulk copy). The array keeps its shape: only bytes move.
TILE_ROWS = 128
TILE_K = 128


def tile_rows(a, per_step: int):
    """Reorder the last two axes (rows, cols) of ``a`` into the prepared layout.

    Args:
      a: (..., rows, cols) array, rows % TILE_ROWS == 0, cols % per_step == 0.
      per_step: columns per TILE_K elements of K (64 for 4-bit codes in bytes,
        TILE_K // block_size for scales).
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


def tile_weight(codes, scales, block_size: int):
    """A 4-bit weight's packed codes (..., N, K/2) uint8 and block scales (..., N,
    K/block_size) into the prepared layout (:func:`tile_rows` of each)."""
    return tile_rows(codes, TILE_K // 2), tile_rows(scales, TILE_K // block_size)


def untile_weight(codes, scales, block_size: int):
    """Inverse of :func:`tile_weight`."""
    return untile_rows(codes, TILE_K // 2), untile_rows(scales, TILE_K // block_size)
