"""Exact float32 building blocks shared by the seed ports (see jax_fp4.reference for why
products and quotients go through integer emulation on XLA)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .. import layout
from ..formats import E2M1, E4M3, MiniFloat, decode_table
from ..reference import _bits, _div, _float, _ldexp, _mul_exact, encode, to_f32_bits

F32 = jnp.float32
__all__ = ["F32", "ru", "f32", "amax_blocks", "mul", "div", "ldexp", "e4m3_code_rne_sat",
           "minifloat_code", "e8m0_rceil", "decode", "swizzle", "unswizzle", "check_2d",
           "check_dtype", "encode", "E2M1", "E4M3"]


def ru(a: int, b: int) -> int:
    """ceil(a / b) * b."""
    return -(-a // b) * b


def f32(x):
    """Exact widening of f32/bf16/f16 to float32 (subnormals kept)."""
    return _float(to_f32_bits(jnp.asarray(x)))


def amax_blocks(x32, block):
    """max |x| of each run of ``block`` elements along the last axis (integer max: exact)."""
    b = _bits(x32).reshape(*x32.shape[:-1], x32.shape[-1] // block, block) & 0x7FFFFFFF
    return _float(jnp.max(b, axis=-1))


mul, div, ldexp = _mul_exact, _div, _ldexp


def e4m3_code_rne_sat(s):
    """E4M3 code (uint8) of non-negative float32 ``s``: RNE, saturating at 448, no lower
    clamp (subnormal and zero scales stay)."""
    s = jnp.minimum(s, F32(448.0))
    return encode(_bits(s), E4M3).astype(jnp.uint8)


def minifloat_code(x32, mf: MiniFloat, k=0):
    """Code of x * 2**k in ``mf``: RNE, saturating at the largest finite value, sign kept
    (a negative value that rounds to zero gives the negative-zero code)."""
    return encode(_bits(x32), mf, k).astype(jnp.uint8)


def e8m0_rceil(s):
    """Smallest E8M0 code c in [0, 254] with 2**(c-127) >= s (s >= 0 float32); NaN -> 255."""
    b = _bits(s)
    e = (b >> 23).astype(jnp.int32) & 0xFF
    frac = (b & 0x7FFFFF) != 0
    normal = jnp.minimum(e + frac.astype(jnp.int32), 254)
    # subnormal s (e == 0): 2**-127 >= s exactly when s <= 2**-127 (bits 0x400000)
    tiny = (b > 0x400000).astype(jnp.int32)
    c = jnp.where(e == 0, tiny, normal)
    return jnp.where(jnp.isnan(s), 255, c).astype(jnp.uint8)


def decode(codes, mf: MiniFloat):
    """float32 value of each element code."""
    return jnp.asarray(decode_table(mf))[codes.astype(jnp.int32)]


def swizzle(scales_u8, rows: int, cols: int):
    """(rows, cols) uint8 scales -> (ru(rows, 128), ru(cols, 4)) in the 128x4 layout
    (SEEDS_API.md SWZ), padding 0."""
    return layout.to_blocked(scales_u8).reshape(ru(rows, 128), ru(cols, 4))


def unswizzle(sw, rows: int, cols: int):
    return layout.from_blocked(jnp.asarray(sw).reshape(-1), (rows, cols))


def check_2d(name, a):
    if getattr(a, "ndim", None) != 2:
        raise ValueError(f"{name}: expected a 2-D array, got shape {getattr(a, 'shape', None)}")


def check_dtype(name, a, dtypes):
    ok = tuple(jnp.dtype(d) for d in dtypes)
    if jnp.dtype(a.dtype) not in ok:
        raise TypeError(f"{name}: expected dtype {' or '.join(d.name for d in ok)}, got "
                        f"{jnp.dtype(a.dtype).name}")


def as_u8(a):
    """Raw bytes of a uint8 / float8 array as uint8."""
    a = jnp.asarray(a)
    return a if a.dtype == jnp.uint8 else lax.bitcast_convert_type(a, jnp.uint8)
