"""The pure-jnp reference implementation of every format: the definition of jax-fp4.

Everything here implements docs/spec.md section 3 exactly, on the canonical 2-D view used by
the primitives and the FFI kernels (csrc/README.md): ``x`` is ``(R, K)`` with the blocked
axis last and ``K % block_size == 0``. The CPU and CUDA kernels must match these functions
bit for bit; tests use them as the oracle, and any platform without our kernels (TPU,
ROCm, GPUs without the extension) runs them.

Exactness on XLA. XLA flushes float32 subnormal operands and results to zero (XLA:CPU sets
FTZ/DAZ), while the spec is exact IEEE-754 binary32 arithmetic. So nothing here lets a
subnormal reach a floating-point instruction whose result matters: comparisons and
maxima run on the integer bit patterns, powers of two are applied by exponent arithmetic,
element rounding is integer round-to-nearest-even, products that can be subnormal go
through :func:`_mul_exact`, a small integer emulation of an IEEE float32 multiply, and
every division through :func:`_div` (XLA:GPU's f32 division is not correctly rounded).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import layout
from .formats import E2M1, E4M3, Format, MiniFloat, decode_table, get_format

F32 = jnp.float32
U32 = jnp.uint32
I32 = jnp.int32

# IEEE binary32 / binary16 as MiniFloats for the shared rounding routine. max_code is the
# code of +Inf, so an overflow rounds to Inf as IEEE does.
_F32_FMT = MiniFloat("f32", 8, 23, 127, 0x7F800000, np.float32)
_F16_FMT = MiniFloat("f16", 5, 10, 15, 0x7C00, np.float16)

TENSOR_SCALE_MIN = 2.0 ** -120  # smallest valid NVFP4 per-tensor (decode) scale
NVFP4_AMAX_DIVISOR = 448.0 * 6.0  # E4M3 max * E2M1 max = 2688
_NAN_BITS = 0x7FC00000


# --------------------------------------------------------------------------- bit tools
def _bits(x):
    """float32 -> uint32 bit pattern."""
    return lax.bitcast_convert_type(x.astype(F32), U32)


def _float(b):
    """uint32 bit pattern -> float32."""
    return lax.bitcast_convert_type(b.astype(U32), F32)


def to_f32_bits(x):
    """Exact conversion of an f32/bf16/f16 array to float32 bit patterns (uint32).

    bf16 is widened by a shift (no arithmetic, so subnormals survive on every backend).
    """
    if x.dtype == jnp.bfloat16:
        return lax.bitcast_convert_type(x, jnp.uint16).astype(U32) << 16
    if x.dtype not in (jnp.float32, jnp.float16):
        raise TypeError(f"x: expected float32, bfloat16 or float16, got {x.dtype}")
    return _bits(x.astype(F32))


def _ordered_key(b):
    """Monotone map of float32 bits to int32 (for finite values; -0.0 and +0.0 equal)."""
    mag = (b & 0x7FFFFFFF).astype(I32)
    return jnp.where((b >> 31) == 1, -mag, mag)


def _from_ordered_key(k):
    return jnp.where(k < 0, (-k).astype(U32) | jnp.uint32(0x80000000), k.astype(U32))


def _decompose(a):
    """Finite non-negative float32 bits -> (sig, e) with value = sig * 2**e.

    ``sig`` is normalised to [2**23, 2**24) (subnormals too), or 0 for zero.
    """
    ef = (a >> 23).astype(I32)
    m = a & 0x7FFFFF
    sig = jnp.where(ef == 0, m, m | 0x800000)
    e = jnp.where(ef == 0, -149, ef - 150)
    lz = jnp.clip(lax.clz(sig).astype(I32) - 8, 0, 24)
    return sig << lz.astype(U32), e - lz


def _shr_rne(hi, lo, sh):
    """Round (hi + lo/2**24) / 2**sh to the nearest integer, ties to even.

    hi < 2**24, lo < 2**24 (the bits below hi), sh >= 0 (clamped to 31).
    """
    sh = jnp.clip(sh, 0, 31).astype(U32)
    q = hi >> sh
    rem = hi & ((jnp.uint32(1) << sh) - 1)
    half = jnp.where(sh > 0, jnp.uint32(1) << jnp.maximum(sh, 1) - 1, 0)
    # remainder vs one half, with lo as the bits below: for sh == 0 the half is lo == 2**23.
    above = jnp.where(sh > 0, (rem > half) | ((rem == half) & (lo > 0)), lo > 0x800000)
    tie = jnp.where(sh > 0, (rem == half) & (lo == 0), lo == 0x800000)
    return q + (above | (tie & ((q & 1) == 1))).astype(U32)


def _shr_stochastic(hi, lo, sh, rand):
    """Stochastic rounding of (hi + lo/2**24) / 2**sh to an integer: up exactly when
    ``rand`` < floor(2**32 * the discarded fraction), down otherwise (so up with the
    fraction's probability, to within 2**-32, for uniform uint32 ``rand``).

    The fraction's top 32 bits are rem * 2**(32 - sh) + lo * 2**(8 - sh) (shifts right
    where the exponent is negative); hi < 2**24, lo < 2**24, sh >= 0. Shifts past 31 are
    spelled out (a value far below one unit keeps its small probability, never a clamped
    shift's larger one): for sh >= 24, q = 0 and the fraction is the whole value.
    """
    sh = jnp.clip(sh, 0, 63).astype(U32)
    s31 = jnp.minimum(sh, 31)
    q = hi >> s31  # 0 for sh >= 24
    rem = hi & ((jnp.uint32(1) << s31) - 1)  # == hi for sh >= 24
    rem_part = jnp.where(sh == 0, 0, jnp.where(
        sh < 32, rem << (jnp.uint32(32) - jnp.clip(sh, 1, 31)),
        hi >> jnp.minimum(jnp.maximum(sh, 32) - jnp.uint32(32), 31)))
    lo_part = jnp.where(sh <= 8, lo << (jnp.uint32(8) - jnp.minimum(sh, 8)),
                        lo >> jnp.minimum(jnp.maximum(sh, 8) - jnp.uint32(8), 31))
    frac32 = rem_part | lo_part  # disjoint bits: rem_part's lowest is 2**(32 - sh)
    return q + (rand < frac32).astype(U32)


def _round_to(sign, hi, lo, e, fmt: MiniFloat, rand=None):
    """Round ±(hi + lo/2**24) * 2**e to ``fmt`` (RNE, or stochastically on the magnitude
    with uint32 ``rand``: :func:`_shr_stochastic`), saturating at ``fmt.max_code``.

    hi is 0 or normalised to [2**23, 2**24). Returns the code with the sign in the top bit
    (uint32). One mechanism for element encoding, exact power-of-two scaling and products.
    """
    m = fmt.mbits
    top = e + 23  # exponent of hi's leading bit
    e_t = jnp.where(hi == 0, fmt.emin, jnp.maximum(top, fmt.emin))
    sh = (e_t - m) - e
    q = _shr_rne(hi, lo, sh) if rand is None else _shr_stochastic(hi, lo, sh, rand)
    mag = ((e_t + fmt.bias - 1).astype(U32) << m) + q
    mag = jnp.minimum(mag, jnp.uint32(fmt.max_code))
    return mag | (sign.astype(U32) << (fmt.bits - 1))


def encode(b, fmt: MiniFloat, k=0, rand=None):
    """Code of (float32 bits ``b``) * 2**k in the minifloat ``fmt``: RNE (or stochastic
    rounding with uint32 ``rand`` of b's shape), saturating.

    Finite inputs only (callers mask non-finite blocks). The sign is kept (-0.0 -> sign
    bit set), so a negative value that rounds to zero gives the negative-zero code.
    """
    sig, e = _decompose(b & 0x7FFFFFFF)
    return _round_to(b >> 31, sig, jnp.uint32(0), e + k, fmt, rand)


def _ldexp(v, k):
    """v * 2**k exactly as IEEE would (RNE if the result is subnormal); v finite f32."""
    return _float(encode(_bits(v), _F32_FMT, k))


def _mul_exact(a, b):
    """IEEE-754 binary32 a*b (RNE, subnormal operands and results exact).

    XLA flushes subnormals, so the products that can meet one (decode of tiny scales,
    NF4 scaling of tiny or huge blocks) are computed on 12-bit limbs of the significands.
    NaN/Inf operands fall back to the plain product (IEEE non-finite rules).
    """
    ba, bb = _bits(a), _bits(b)
    sa, ea = _decompose(ba & 0x7FFFFFFF)
    sb, eb = _decompose(bb & 0x7FFFFFFF)
    a1, a0 = sa >> 12, sa & 0xFFF
    b1, b0 = sb >> 12, sb & 0xFFF
    t0, t1, t2 = a0 * b0, a1 * b0 + a0 * b1, a1 * b1
    lo_full = t0 + ((t1 & 0xFFF) << 12)
    lo = lo_full & 0xFFFFFF
    hi = t2 + (t1 >> 12) + (lo_full >> 24)  # product = hi * 2**24 + lo, hi in [2**22, 2**24)
    small = hi < 0x800000
    hi = jnp.where(small, (hi << 1) | (lo >> 23), hi)
    lo = jnp.where(small, (lo << 1) & 0xFFFFFF, lo)
    e = ea + eb + 24 - small.astype(I32)
    zero = (sa == 0) | (sb == 0)
    hi = jnp.where(zero, 0, hi)
    lo = jnp.where(zero, 0, lo)
    exact = _float(_round_to((ba ^ bb) >> 31, hi, lo, e, _F32_FMT))
    return jnp.where(jnp.isfinite(a) & jnp.isfinite(b), exact, a * b)


def _div(a, b):
    """IEEE-754 binary32 a / b, correctly rounded (RNE; subnormal operands and results).

    Neither backend's division can be used as is: XLA:GPU emits ``div.full.f32`` (off by
    an ulp in about a quarter of the quotients), XLA:CPU flushes subnormals and turns a
    division by a constant or broadcast into a reciprocal multiply. So the significands
    are divided by restoring long division (26 quotient bits plus a sticky remainder) and
    rounded by :func:`_round_to`. Zero, Inf and NaN operands take the plain quotient.
    """
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    a, b = jnp.broadcast_arrays(a, b)
    ba, bb = _bits(a), _bits(b)
    sa, ea = _decompose(ba & 0x7FFFFFFF)
    sb, eb = _decompose(bb & 0x7FFFFFFF)
    sb = jnp.maximum(sb, 1)  # b == 0 takes the plain quotient below
    q = (sa >= sb).astype(U32)
    rem = sa - q * sb

    def step(_, carry):
        rem, q = carry
        rem = rem << 1
        bit = rem >= sb
        return rem - jnp.where(bit, sb, 0), (q << 1) | bit.astype(U32)

    rem, q = lax.fori_loop(0, 25, step, (rem, q))  # q in [2**24, 2**26), rem < sb
    two = q >= (1 << 25)
    nx = jnp.where(two, 2, 1).astype(U32)  # quotient bits below the 24 kept
    hi = q >> nx
    extra = q & ((jnp.uint32(1) << nx) - 1)
    lo = (extra << (24 - nx)) | (rem != 0).astype(U32)
    e = ea - eb - 25 + nx.astype(I32)
    exact = _float(_round_to((ba ^ bb) >> 31, jnp.where(sa == 0, 0, hi),
                             jnp.where(sa == 0, 0, lo), e, _F32_FMT))
    b_zero = (bb & 0x7FFFFFFF) == 0
    ok = jnp.isfinite(a) & jnp.isfinite(b) & ~b_zero
    # x / 0 for a nonzero (maybe subnormal) finite x is a signed Inf; 0/0 and NaN stay NaN
    inf = _float((((ba ^ bb) >> 31) << 31) | 0x7F800000)
    special = jnp.where(b_zero & jnp.isfinite(a) & (sa != 0), inf, a / b)
    return jnp.where(ok, exact, special)


def round_f32_to(y, dtype):
    """Round float32 ``y`` to ``dtype`` (float32, bfloat16, float16) to nearest even.

    Integer arithmetic, so subnormal inputs and results are exact on every backend; NaN
    stays NaN, overflow goes to ±Inf.
    """
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return y.astype(F32)
    b = _bits(y)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    sign = b >> 31
    if dtype == jnp.bfloat16:
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = jnp.where(nan, (sign << 15) | 0x7FC0, r)
        return lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)
    if dtype == jnp.float16:
        a = b & 0x7FFFFFFF
        sig, e = _decompose(jnp.minimum(a, 0x7F7FFFFF))
        r = _round_to(sign, sig, jnp.uint32(0), e, _F16_FMT)
        r = jnp.where(a == 0x7F800000, (sign << 15) | 0x7C00, r)
        r = jnp.where(nan, (sign << 15) | 0x7E00, r)
        return lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.float16)
    raise TypeError(f"dtype: expected float32, bfloat16 or float16, got {dtype}")


@functools.lru_cache(maxsize=None)
def _table(mf: MiniFloat):
    return decode_table(mf)


def _decode_minifloat(codes, mf: MiniFloat):
    return jnp.asarray(_table(mf))[codes.astype(I32)]


# --------------------------------------------------------------------------- scales
def tensor_scale_from_amax(amax):
    """NVFP4 per-tensor *decode* scale from a tensor's absolute maximum.

    pts = amax / 2688 (float32 divide; 2688 = E4M3 max 448 * E2M1 max 6), as torchao
    ``per_tensor_amax_to_scale`` and ModelOpt ``weight_scale_2``; amax == 0 gives 1.0, and
    the result is at least 2**-120 (smaller scales overflow the element reciprocal; only
    tensors with amax < 2688 * 2**-120 differ from torchao). NaN/Inf amax gives NaN/Inf.
    """
    amax = jnp.asarray(amax, F32)
    pts = jnp.maximum(_div(amax, NVFP4_AMAX_DIVISOR), F32(TENSOR_SCALE_MIN))
    return jnp.where((_bits(amax) & 0x7FFFFFFF) == 0, F32(1.0), pts)  # exact for subnormals


def amax(x):
    """max |x| over all elements as float32, exact for subnormals (integer max); NaN wins."""
    b = to_f32_bits(x) & 0x7FFFFFFF
    return _float(jnp.max(b, initial=jnp.uint32(0)))


def _e8m0_floor(amax_b, emax: int):
    return jnp.clip((amax_b >> 23).astype(I32) - emax, 0, 254)


def _e8m0_rceil(amax_b, mf: MiniFloat):
    """NVIDIA RCEIL: code of the power-of-two ceiling of q = f32(amax / max_elem)."""
    max_elem = mf.max_value
    lo = np.float32(max_elem * 2.0 ** -127)  # L: q <= 2**-126 exactly when amax <= 2L
    t2 = np.nextafter(np.nextafter(lo, np.float32(np.inf)), np.float32(np.inf))
    q = _bits(_div(_float(amax_b), max_elem))
    ef = (q >> 23).astype(I32)
    normal_code = jnp.minimum(ef + ((q & 0x7FFFFF) != 0).astype(I32), 254)
    # amax <= 2L: q is subnormal (or 2**-126); q > 2**-127 <=> amax >= next(next(L)).
    tiny_code = (amax_b >= _bits(jnp.asarray(t2))).astype(I32)
    return jnp.where(amax_b > _bits(jnp.asarray(np.float32(2 * lo))), normal_code, tiny_code)


# --------------------------------------------------------------------------- quantize
def _blocks(x, block_size):
    r, k = x.shape
    return to_f32_bits(x).reshape(r, k // block_size, block_size)


def _empty_outputs(f: Format, r, k, block_size, scale_dtype):
    nb = k // block_size
    codes = jnp.zeros((r, k * f.bits // 8), jnp.uint8)
    zeros = jnp.zeros((r, nb) if f.has_zeros else (0,), jnp.uint8)
    return codes, jnp.zeros((r, nb), f.scale_buffer_dtype(scale_dtype)), zeros


def quantize_2d(x, fmt, block_size, *, tensor_scale=None, rceil=False, scale_dtype=None,
                rand=None):
    """Quantize the canonical 2-D view, returning the FFI buffers (csrc/README.md).

    Args:
      x: (R, K) float32 / bfloat16 / float16, blocked along K (K % block_size == 0).
      fmt: format name or :class:`~jax_fp4.formats.Format`.
      block_size: elements per block (group).
      tensor_scale: NVFP4 only: None (one level) or (R,) float32 decode scale per row
        (the per-tensor scale broadcast to rows).
      rceil: MX only: scale rounding "rceil" instead of "floor".
      scale_dtype: INT4 only: dtype of the group scales (default x.dtype).
      rand: None (round to nearest even) or (R, K) uint32 random bits: stochastic rounding
        of the elements (block scales are chosen as always). Element i rounds away from
        the lower neighbour exactly when rand[i] < floor(2**32 * t), t in [0, 1) its
        position between the two neighbours on the scaled grid (minifloats: the discarded
        bits of x * 1/scale, :func:`_shr_stochastic`; INT4: the fraction of x / s;
        codebooks: (v - lo) / (hi - lo) of v = x / absmax, correctly rounded).
    Returns:
      codes: (R, K*bits/8) uint8, packed little-endian (float8 bytes for MXFP8).
      scales: (R, K/block_size): uint8 bits of E4M3 (nvfp4) or E8M0 (MX), float32 absmax
        (nf4, bnb_fp4), or scale_dtype (int4).
      zeros: (R, K/block_size) uint8 zero points for int4, else an empty (0,) uint8.
    """
    f = get_format(fmt)
    r, k = x.shape
    f.check_block_size(block_size, k)
    if scale_dtype is None:
        scale_dtype = f.default_scale_dtype(x.dtype)
    if x.size == 0:
        return _empty_outputs(f, r, k, block_size, scale_dtype)
    xb = _blocks(x, block_size)
    rb = None if rand is None else jnp.asarray(rand, U32).reshape(xb.shape)
    amax_b = jnp.max(xb & 0x7FFFFFFF, axis=-1)  # integer max: exact, NaN/Inf visible
    bad = amax_b >= 0x7F800000
    zeros = jnp.zeros((0,), jnp.uint8)
    if f.family == "nvfp4":
        codes, scales = _quantize_nvfp4(xb, amax_b, tensor_scale, rb)
    elif f.family == "mx":
        codes, scales = _quantize_mx(xb, amax_b, f.elem, rceil, rb)
    elif f.family == "codebook":
        codes, scales = _quantize_codebook(xb, amax_b, f.table, rb)
    else:
        codes, scales, zeros = _quantize_int4(xb, jnp.dtype(scale_dtype), rb)
        zeros = jnp.where(bad, 0, zeros).astype(jnp.uint8)
    scales = jnp.where(bad, jnp.asarray(f.nan_scale, scales.dtype), scales)
    codes = jnp.where(bad[..., None], 0, codes).astype(jnp.uint8)
    return layout.pack(codes.reshape(r, k), f.bits), scales, zeros


def _quantize_nvfp4(xb, amax_b, tensor_scale, rand=None):
    amax = _float(amax_b)
    if tensor_scale is None:
        s_f = jnp.clip(_div(amax, 6.0), F32(2.0 ** -6), F32(448.0))
    else:
        pts = jnp.asarray(tensor_scale, F32)[:, None]
        s_f = jnp.clip(_div(_div(amax, 6.0), pts), F32(2.0 ** -6), F32(448.0))
    s_code = encode(_bits(s_f), E4M3).astype(jnp.uint8)
    return _encode_nvfp4(xb, s_code, tensor_scale, rand), _mask_nvfp4_scales(s_code, tensor_scale)


def _mask_nvfp4_scales(s_code, tensor_scale):
    """An invalid per-tensor scale (NaN, Inf, < 2**-120) makes every block scale NaN."""
    if tensor_scale is None:
        return s_code
    pts = jnp.asarray(tensor_scale, F32)[:, None]
    valid = jnp.isfinite(pts) & (pts >= F32(TENSOR_SCALE_MIN))
    return jnp.where(valid, s_code, jnp.uint8(0x7F))


def _encode_nvfp4(xb, s_code, tensor_scale, rand=None):
    s = _decode_minifloat(s_code, E4M3)
    if tensor_scale is None:
        recip = _div(1.0, s)
    else:
        pts = jnp.asarray(tensor_scale, F32)[:, None]
        recip = _div(_div(1.0, pts), s)
    p = _bits(_mul_exact(_float(xb), recip[..., None]))
    codes = encode((p & 0x7FFFFFFF) | (xb & jnp.uint32(0x80000000)), E2M1, rand=rand)  # sign of x, also for -0.0
    if tensor_scale is not None:
        valid = jnp.isfinite(pts) & (pts >= F32(TENSOR_SCALE_MIN))
        codes = jnp.where(valid[..., None], codes, 0)
    return codes


def _quantize_mx(xb, amax_b, mf: MiniFloat, rceil, rand=None):
    code = _e8m0_rceil(amax_b, mf) if rceil else _e8m0_floor(amax_b, mf.emax)
    return _encode_mx(xb, code, mf, rand), code.astype(jnp.uint8)


def _encode_mx(xb, code, mf: MiniFloat, rand=None):
    return encode(xb, mf, (127 - code.astype(I32))[..., None], rand)


@functools.lru_cache(maxsize=None)
def _bucket_tables(table_bytes: bytes):
    """Boundaries (as ordered int keys) and the sorted-position -> code map of a codebook."""
    table = np.frombuffer(table_bytes, np.float32)
    order = np.argsort(table, kind="stable")
    srt = table[order]
    mid = ((srt[:-1] + srt[1:]) / np.float32(2)).astype(np.float32)  # f32 (a+b)/2
    mb = mid.view(np.uint32)
    keys = np.where(mb >> 31 == 1, -(mb & 0x7FFFFFFF).astype(np.int64), mb).astype(np.int32)
    return keys, order.astype(np.uint8)


def bucketize(scaled, table):
    """Code index of each float32 ``scaled`` in a codebook (torch.bucketize, right=False).

    Counts the midpoints strictly below the value (an exact midpoint goes to the lower
    code), compared as integer keys so subnormals are exact; stable sort for equal entries.
    """
    keys, order = _bucket_tables(np.asarray(table, np.float32).tobytes())
    k = _ordered_key(_bits(scaled))
    idx = jnp.sum(k[..., None] > jnp.asarray(keys), axis=-1)
    return jnp.asarray(order)[idx]


def _quantize_codebook(xb, amax_b, table, rand=None):
    absmax = _float(amax_b)
    return _encode_codebook(xb, absmax, table, rand), absmax


def _encode_codebook(xb, absmax, table, rand=None):
    a = _float(jnp.maximum(_bits(absmax) & 0x7FFFFFFF, _bits(jnp.float32(1e-38))))  # exact
    recip = _div(1.0, a)
    scaled = _mul_exact(_float(xb), recip[..., None])  # clamp(-1, 1) is implied by bucketize
    if rand is None:
        return bucketize(scaled, table)
    return _codebook_stochastic(scaled, table, rand)


def _codebook_stochastic(v, table, rand):
    """Stochastic rounding of v in [-1, 1] between its two codebook neighbours lo <= v <
    hi: hi exactly when rand < floor(2**32 * _div(v - lo, hi - lo)) (v == lo, and v at
    the top entry, stay)."""
    tab = np.asarray(table, np.float32)
    order = np.argsort(tab, kind="stable")
    srt = jnp.asarray(tab[order])
    keys = _ordered_key(_bits(jnp.asarray(tab[order])))
    kv = _ordered_key(_bits(v))
    i = jnp.clip(jnp.sum(kv[..., None] >= keys, axis=-1) - 1, 0, len(tab) - 1)  # lo index
    j = jnp.minimum(i + 1, len(tab) - 1)
    lo, hi = srt[i], srt[j]
    t = _div(v - lo, jnp.where(j > i, hi - lo, F32(1.0)))
    thr = jnp.where(t >= 1.0, jnp.uint32(0xFFFFFFFF),
                    _ldexp(jnp.clip(t, 0.0, 1.0), 32).astype(jnp.uint32))
    up = (j > i) & (rand < thr)
    return jnp.asarray(order.astype(np.uint8))[jnp.where(up, j, i)]


INT4_WIDE_RANGE = 2.0 ** 127  # blocks with max - min >= this take the wide-block rule
_F16_MAX = 65504.0


def _quantize_int4(xb, scale_dtype, rand=None):
    """AutoAWQ min/max rule, plus the wide-block rule (docs/spec.md section 3, INT4).

    Normal block (max - min < 2**127 in float32): s = max(max - min, 1e-5) / 15 rounded to
    scale_dtype (float16 saturating at 65504 instead of overflowing to Inf),
    z = clip(-rint(min / s), 0, 15). Wide block (max - min >= 2**127 or overflowing):
    s = max(max, -min) / 8 rounded toward zero to scale_dtype (float16: 65504), z = 8 if
    -min >= max else 7, so that every code decodes to a finite (q - z) * s, |q - z| <= 8.
    Either way q = clip(rint(x / s) + z, 0, 15), or with `rand` (uint32 per element)
    stochastic rounding: floor(x / s) + 1 exactly when rand < floor(2**32 * frac).
    """
    key = _ordered_key(xb)
    mn = _float(_from_ordered_key(jnp.min(key, axis=-1)))
    mx = _float(_from_ordered_key(jnp.max(key, axis=-1)))
    s_store, z = int4_scale_zero(mn, mx, scale_dtype)
    return _encode_int4(xb, s_store, z, rand), s_store, z


def int4_scale_zero(mn, mx, scale_dtype):
    """INT4 group scale (rounded to ``scale_dtype``) and uint8 zero point for groups
    spanning [mn, mx] (float32 arrays of one shape): AutoAWQ's asymmetric rule
    s = max(mx - mn, 1e-5) / 15, z = clip(-round(mn / s), 0, 15) (docs/spec.md section 3),
    and the wide-block rule where mx - mn overflows (docs/spec.md section 3, INT4)."""
    d = mx - mn
    wide = ~(d < F32(INT4_WIDE_RANGE))
    f16 = jnp.dtype(scale_dtype) == jnp.float16
    # normal blocks
    s32 = _div(jnp.maximum(jnp.where(wide, F32(1.0), d), F32(1e-5)), 15.0)
    s_norm = round_f32_to(s32, scale_dtype)
    if f16:
        s_norm = jnp.where(jnp.isinf(s_norm), jnp.float16(_F16_MAX), s_norm)
    # wide blocks: max(max, -min) >= 2**126, so the division by 8 is exact in float32
    m = jnp.where(wide, jnp.maximum(mx, -mn), F32(1.0))
    sw_bits = _bits(m) - jnp.uint32(3 << 23)
    if f16:
        s_wide = jnp.full(m.shape, _F16_MAX, jnp.float16)
    elif jnp.dtype(scale_dtype) == jnp.bfloat16:
        s_wide = lax.bitcast_convert_type((sw_bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    else:
        s_wide = _float(sw_bits)
    s_store = jnp.where(wide, s_wide.astype(s_norm.dtype), s_norm)
    s = s_store.astype(F32)
    z_norm = jnp.clip(-jnp.round(_div(mn, s)), 0, 15)
    z_wide = jnp.where(-mn >= mx, F32(8.0), F32(7.0))
    return s_store, jnp.where(wide, z_wide, z_norm).astype(jnp.uint8)


def _encode_int4(xb, s_store, z, rand=None):
    s = s_store.astype(F32)[..., None]
    v = _div(_float(xb), s)
    if rand is None:
        r = jnp.round(v)
    else:  # floor + 1 exactly when rand < floor(2**32 * frac); frac * 2**32 is exact
        # a subnormal quotient counts as zero (as XLA:CPU's flushing floor treats it), so
        # that every backend agrees; its true probability of moving is below 2**-126
        v = jnp.where(jnp.abs(v) < F32(2.0 ** -126), F32(0.0), v)
        fl = jnp.floor(v)
        r = fl + (rand < _ldexp(v - fl, 32).astype(jnp.uint32)).astype(F32)
    return jnp.clip(r + z.astype(F32)[..., None], 0, 15).astype(jnp.uint8)


def encode_blocks(xb, fmt, scales, zeros=None, *, tensor_scale=None):
    """Element codes of float32-bit blocks for *given* block scales: the encode step of
    :func:`quantize_2d` with its scale computation taken out.

    Args:
      xb: (..., nb, bs) uint32 float32 bit patterns (:func:`to_f32_bits`), finite.
      fmt: format name or Format.
      scales: (..., nb) block scales as :func:`quantize_2d` stores them (uint8 E4M3 /
        E8M0 codes, float32 absmax, int4 scale in its dtype).
      zeros: int4 only: (..., nb) uint8 zero points.
      tensor_scale: nvfp4 only: None or (R,) float32 per-row decode scale (xb 3-D).
    Returns:
      (..., nb, bs) unpacked codes (uint32 or uint8), exactly those :func:`quantize_2d`
      gives when it chooses the same scales.
    """
    f = get_format(fmt)
    if f.family == "nvfp4":
        return _encode_nvfp4(xb, scales, tensor_scale)
    if f.family == "mx":
        return _encode_mx(xb, scales, f.elem)
    if f.family == "codebook":
        return _encode_codebook(xb, scales, f.table)
    return _encode_int4(xb, scales, zeros)


def quantize_2d_with_scales(x, fmt, block_size, scales, zeros=None, *, tensor_scale=None):
    """Quantize the canonical 2-D view with caller-chosen block scales (MSE scale search,
    GPTQ), returning the FFI buffers of :func:`quantize_2d`.

    Args:
      x: (R, K) float32 / bfloat16 / float16, K % block_size == 0.
      scales: (R, K/block_size) in the buffer dtype of :func:`quantize_2d` (uint8 E4M3 or
        E8M0 bits, float32 absmax, the int4 scale dtype).
      zeros: int4: (R, K/block_size) uint8 zero points; ignored otherwise.
      tensor_scale: nvfp4: None or (R,) float32 per-row decode scale.
    Returns:
      (codes, scales, zeros) as :func:`quantize_2d`: with ``scales`` equal to what
      quantize_2d chooses, bit-identical to it. Blocks holding NaN/Inf get the NaN scale
      and zero codes, as there.
    """
    f = get_format(fmt)
    r, k = x.shape
    f.check_block_size(block_size, k)
    xb = _blocks(x, block_size)
    bad = jnp.max(xb & 0x7FFFFFFF, axis=-1) >= 0x7F800000
    if f.has_zeros:
        zeros = jnp.where(bad, 0, jnp.asarray(zeros)).astype(jnp.uint8)
    else:
        zeros = jnp.zeros((0,), jnp.uint8)
    codes = encode_blocks(jnp.where(bad[..., None], 0, xb), f, scales, zeros,
                          tensor_scale=tensor_scale)
    if f.has_tensor_scale:
        scales = _mask_nvfp4_scales(scales, tensor_scale)
    scales = jnp.where(bad, jnp.asarray(f.nan_scale, scales.dtype), scales)
    codes = jnp.where(bad[..., None], 0, codes).astype(jnp.uint8)
    return layout.pack(codes.reshape(r, k), f.bits), scales, zeros


# --------------------------------------------------------------------------- dequantize
def dequantize_2d(codes, scales, zeros, fmt, block_size, k, dtype, *, tensor_scale=None):
    """Dequantize FFI-layout buffers (see :func:`quantize_2d`) to (R, K) ``dtype``.

    The value is computed in float32 (docs/spec.md section 3 decode rules) and rounded to
    ``dtype`` (float32, bfloat16, float16) to nearest even.
    """
    f = get_format(fmt)
    r = codes.shape[0]
    if r * k == 0:
        return jnp.zeros((r, k), dtype)
    if codes.dtype != jnp.uint8:
        codes = lax.bitcast_convert_type(codes, jnp.uint8)
    c = layout.unpack(codes, f.bits).reshape(r, k // block_size, block_size)
    if scales.dtype != jnp.uint8 and f.minifloat_scales:
        scales = lax.bitcast_convert_type(scales, jnp.uint8)
    y = decode_blocks(c, f, scales, zeros, tensor_scale=tensor_scale)
    return round_f32_to(y.reshape(r, k), dtype)


def decode_blocks(c, fmt, scales, zeros=None, *, tensor_scale=None):
    """float32 values of unpacked element codes (DESIGN.md section 3 decode rules).

    Args:
      c: (..., nb, bs) unpacked codes (integers).
      scales: (..., nb) block scales in the buffer dtype (uint8 bits for nvfp4 / MX).
      zeros: int4: (..., nb) zero points.
      tensor_scale: nvfp4: None or (R,) float32 per-row decode scale (c 3-D).
    Returns:
      (..., nb, bs) float32, exact (subnormals included).
    """
    f = get_format(fmt)
    if f.family in ("nvfp4", "mx"):
        v = _decode_minifloat(c, f.elem)
        if f.family == "nvfp4":
            s = _decode_minifloat(scales, E4M3)
            if tensor_scale is not None:
                s = _mul_exact(jnp.asarray(tensor_scale, F32)[:, None], s)
            return _mul_exact(v, s[..., None])
        sc = scales.astype(I32)[..., None]
        # fp8 NaN/Inf element codes stay NaN/Inf (_ldexp assumes a finite value)
        y = jnp.where(jnp.isfinite(v), _ldexp(jnp.where(jnp.isfinite(v), v, 0), sc - 127), v)
        return jnp.where(sc == 255, F32(np.nan), y)
    if f.family == "codebook":
        return _mul_exact(jnp.asarray(f.table)[c.astype(I32)], scales.astype(F32)[..., None])
    q = c.astype(F32) - zeros.astype(F32)[..., None]
    return _mul_exact(q, scales.astype(F32)[..., None])


def fake_quantize_2d(x, fmt, block_size, *, tensor_scale=None, rceil=False, scale_dtype=None,
                     rand=None):
    """QDQ: dequantize(quantize(x)) in x's dtype, (R, K) -> (R, K)."""
    codes, scales, zeros = quantize_2d(x, fmt, block_size, tensor_scale=tensor_scale,
                                       rceil=rceil, scale_dtype=scale_dtype, rand=rand)
    return dequantize_2d(codes, scales, zeros, fmt, block_size, x.shape[1], x.dtype,
                         tensor_scale=tensor_scale)
