// W4A16 kernels (launch.h): decoding one 32-bit code word (8 elements of a weight row)
// into 4 MMA A-fragment registers, exactly: the bit path (E2M1 bits placed into bf16 / f16,
// INT4 by the magic-number trick, E4M3 / E8M0 block scales) and the table path (codebook
// formats, two-level nvfp4, INT4 with other scale dtypes: shared-memory tables), the
// activation pairing that matches it (x_pairs) and the mma.sync m16n8k16 step.
// Invariant: each element equals the reference's float32 value rounded once to x's dtype
// (docs/spec.md section 3), except NVFP4's per-tensor scale, applied to the accumulator.
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_DECODE_CUH_
#define JAX_FP4_CSRC_CUDA_WMATMUL_DECODE_CUH_

#include "common.cuh"

namespace jf4 {
namespace cuda {
namespace {

// ---- Decoding one code word (8 elements of one weight row) into 4 MMA A registers ----
//
// out[0], out[1] are the (k 2t, 2t+1) and (k 2t+8, 2t+9) registers of the first of two
// m16n8k16 steps, out[2], out[3] those of the second. The MMA sums over k, so which
// physical elements form a register pair is free as long as the activations (B) use the
// same pairing (x_pairs below):
// - table path: register i = the two elements of code byte i, physical (2i, 2i+1);
// - bit path:   register p = physical (p, p+4), so that one shift and one LOP3 place both
//               nibbles of a pair (nibble p in bits 4p.., nibble p+4 in bits 4p+16..).
//
// Bit path (nvfp4, mxfp4, int4 with scales in x's dtype or f16 scales with bf16
// x): the element value v and the block scale s are exact in x's dtype (or in factors that
// are) and v * s is exact in float32, so packed multiplies whose last alone rounds give
// the reference's float32 product rounded to x's dtype (docs/spec.md section 3, "Dequantize to
// bf16/f16").
// E2M1: magnitude bits (e1 e0 m) go to the dtype's lowest exponent bits and top mantissa
// bit (bf16 bits 8:6, f16 bits 11:9) and the sign to bit 15: those bits are the value
// v * 2^-126 (bf16) or v * 2^-14 (f16) including the subnormal codes 0 and 0.5, so one
// multiply by s times 2^126 / 2^14 gives v s where that factor is finite: nvfp4 folds part
// of it into the accumulator (kFold below); mxfp4 multiplies once where its E8M0 scale is
// <= 2 and by further factors above (make_decs, and in the wgmma kernel a warp vote,
// mx_scale_fixup). INT4: (128 + q) in bf16 /
// (1024 + q) in f16 by OR-ing q into the mantissa of 128 / 1024 (Marlin's magic-number
// trick), minus (128 + z) exactly, times s. INT4 with f16 scales and bf16 x (AWQ's scales
// in a bf16 model; BITS = kBitsSplit): s = hi + lo, hi its top 8 significant bits (a bf16)
// and lo the other 3 (exact in bf16), so (q - z) lo is exact (<= 7 bits) and one FMA
// (q - z) hi + (q - z) lo rounds (q - z) s once, as the reference's float32 product (exact:
// 4 x 11 bits) rounded to bf16.
// Table path (everything else): the float32 value of each code from a per-CTA table in
// shared memory, then the reference's float32 arithmetic and one rounding. Three layouts,
// all free of bank conflicts:
// - pair table (COPIES = kCopies = 16, 32 KB): byte b -> (value of low nibble, value of
//   high nibble) at 128 b + 8 c for copy c, one LDS.64 per two elements; lane l reads copy
//   l % 16 in bank pair l % 16. Its address: one shift and one LOP3 (the table's address,
//   warp-uniform, folds into the load as [R + UR]);
// - wide pair table (COPIES = kWideCopies = 32, 64 KB): the same entries at 256 b + 8 c,
//   lane l reads copy l: the address is one PRMT of the code word and 8 l;
// - lane table (COPIES = kLaneTable, 2 KB aligned to 2 KB): code c of lane l at float
//   32 c + l, so lane l reads only bank l whatever its codes: one shift, one LOP3 and one
//   LDS.32 per element, twice the loads of the pair tables and the same bytes.
// The pair tables take fewer instructions (an SM issues the decode's instructions at about
// the same rate whatever they are: time follows their count), the lane table less shared
// memory; wg_copies chooses per tile width, the direct kernel has 16
// copies, the staged kernel the lane table.

// (a & mask) | (b & ~mask) as one LOP3 (written out: the compiler would otherwise mask
// the sign words itself and spend a second LOP3 per pair).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xe4;\n" : "=r"(d) : "r"(a), "r"(b), "n"(MASK));
  return d;
}

template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_bits(uint32_t a) {  // kept apart from the shifts below
  uint32_t d;
  asm("and.b32 %0, %1, %2;\n" : "=r"(d) : "r"(a), "n"(MASK));
  return d;
}

template <bool BF16>
__device__ __forceinline__ void e2m1_bits(uint32_t w, uint32_t p[4]) {
  // signs of the odd nibbles (bits 7, 15, 23, 31) and of the even ones moved there
  const uint32_t hi = and_bits<0x80808080u>(w), lo = and_bits<0x80808080u>(w << 4);
  if constexpr (BF16) {
    // The sign words carry only sign bits; those of the neighbouring pairs land on bits
    // 7 / 23, which the magnitude mask takes from the other operand: one LOP3 per pair.
    constexpr uint32_t kMag = 0x01c001c0u;
    p[0] = select_bits<kMag>(w << 6, lo << 8);
    p[1] = select_bits<kMag>(w << 2, hi << 8);
    p[2] = select_bits<kMag>(w >> 2, lo);
    p[3] = select_bits<kMag>(w >> 6, hi);
  } else {
    constexpr uint32_t kMag = 0x0e000e00u, kSign = 0x80008000u;
    p[0] = ((w << 9) & kMag) | ((lo << 8) & kSign);
    p[1] = ((w << 5) & kMag) | ((hi << 8) & kSign);
    p[2] = ((w << 1) & kMag) | (lo & kSign);
    p[3] = ((w >> 3) & kMag) | (hi & kSign);
  }
}

template <bool BF16>
constexpr uint32_t kInt4Magic = BF16 ? 0x43004300u : 0x64006400u;  // 128 / 1024
// nvfp4 (either level) folds the placement's factor into the scale and the float32
// accumulator, one multiply per pair. bf16 x: the 2^126 as s * 2^117 (<= 448 * 2^117,
// finite in bf16) and 2^9: the MMA sees w * 2^-9 (exact: |w| >= 2^-10, so w * 2^-9 stays a
// normal bf16). f16 x: the 2^14 as s * 2^6 (<= 28672, finite in f16) and 2^8: the MMA sees
// w * 2^-8, exact (w = v s is a multiple of 2^-10 below 2688, so w * 2^-8 is a multiple of
// f16's least subnormal 2^-24 below 10.5). The sum is the same up to the accumulator's
// subnormal range (|x w| < 2^-117 / 2^-118).
template <int FMT, bool BF16, int BITS>
constexpr bool kFold = BITS && FMT == kNVFP4;
template <int FMT, bool BF16, int BITS>
constexpr float kAccScale = kFold<FMT, BF16, BITS> ? (BF16 ? 512.0f : 256.0f) : 1.0f;

// The E4M3 bytes 0 and 1 of `bits` in float32 (one cvt.rn.f16x2.e4m3x2 on sm_89+).
__device__ __forceinline__ void e4m3x2_decode(uint32_t bits, float* lo, float* hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits & 0xffffu),
                                                   __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  *lo = f.x;
  *hi = f.y;
#else
  *lo = e4m3_decode(bits & 0xffu);
  *hi = e4m3_decode(bits >> 8);
#endif
}

// Decode constants of one (row, 16-element half of a chunk).
struct Dec {
  uint32_t s2, z2;  // bit path: scale pair, INT4 (magic + z) pair, MXFP4 second factor
  uint32_t t2;      // a third factor: kBitsSplit's scale low part, MXFP4 with f16 x's last
  float s, z;       // table path
};

template <int FMT, bool BF16, int BITS>
__device__ __forceinline__ Dec make_dec(uint32_t sbits, uint32_t zbits, const WParams& p) {
  static_assert(!BITS || FMT == kINT4, "make_decs decodes the other bit-path scales itself");
  Dec d;
  if constexpr (BITS == kBitsSplit) {  // INT4, f16 scales, bf16 x: hi + lo (see above)
    const float s = __half2float(__ushort_as_half(static_cast<unsigned short>(sbits & 0xffffu)));
    const uint32_t sb = __float_as_uint(s);
    // lo = s - hi, exact; +-0 with s's sign where s is a bf16 (so that a zero product keeps
    // the reference's sign) or not finite (hi alone then gives inf / NaN as s does)
    const float lo = isfinite(s) ? s - __uint_as_float(sb & 0xffff0000u) : 0.0f;
    const uint32_t lob = (__float_as_uint(lo) & 0x7fffffffu) | (sb & 0x80000000u);
    d.s2 = (isnan(s) ? 0x7fffu : sb >> 16) * 0x10001u;
    d.t2 = (lob >> 16) * 0x10001u;
    d.z2 = ((kInt4Magic<BF16> & 0xffffu) + zbits) * 0x10001u;
  } else if constexpr (BITS) {  // INT4, scales stored in x's dtype: their bits
    d.s2 = (sbits & 0xffffu) * 0x10001u;
    d.z2 = ((kInt4Magic<BF16> & 0xffffu) + zbits) * 0x10001u;  // 128 + z / 1024 + z: exact
  } else {
    d.s = scale_value<FMT>(sbits, p);
    d.z = static_cast<float>(zbits);
  }
  return d;
}

// Whether the wgmma kernel must apply MXFP4's second scale factor to a step's words
// (make_decs: 2^(e - 128) for E8M0 scales e > 128): some lane's block scale of either of
// its rows is > 2, by a warp vote, so that skipping it is one warp-uniform branch per group
// of words. The mma.sync kernels always apply it (they are bound by their loads, so the
// vote and branch would cost more than the multiply they skip).
template <int FMT, int BITS>
__device__ __forceinline__ bool mx_scale_fixup(const Chunk (&c)[2]) {
  if constexpr (FMT == kMXFP4 && BITS)
    return !__all_sync(0xffffffffu, (c[0].s & 0xffu) <= 128u && (c[1].s & 0xffu) <= 128u);
  else
    return false;
}

// Both halves of a chunk.
template <int FMT, bool BF16, int BITS>
__device__ __forceinline__ void make_decs(const Chunk& c, const WParams& p, Dec d[2]) {
  if constexpr (FMT == kNVFP4 && BITS) {
    float s0, s1;
    e4m3x2_decode(c.s, &s0, &s1);
    if constexpr (kFold<FMT, BF16, BITS>) {
      s0 *= BF16 ? 0x1p117f : 0x1p6f;
      s1 *= BF16 ? 0x1p117f : 0x1p6f;
    }
    d[0].s2 = pack2<BF16>(s0, s0);  // exact: 4 significant bits, in range (kFold)
    d[1].s2 = pack2<BF16>(s1, s1);
  } else if constexpr (FMT == kMXFP4 && BITS && !BF16) {
    // f16 x: the placed bits are v * 2^-14. With T = e - 127: times s2 = 2^clamp(T + 14,
    // -24, 15), they are v * 2^T rounded once for T in [-38, 1] (v * 2^-14 * 2^-24 is the
    // least f16 subnormal at v = 0.5, exact), and +-0 below, as the reference's v * 2^T
    // rounds to f16 there (< 2^-25); for T > 1 (e > 128, mx_scale_fixup): 2 v exactly, then
    // times z2 = 2^min(T - 1, 15) (NaN for 255), rounded once for T <= 16, and times t2 =
    // 2^15 for T > 16, where every v != 0 overflows to inf as in the reference (2 v 2^30).
    const int e = static_cast<int>(c.s & 0xffu), t = e - 127;
    const int es = t + 14 < -24 ? -24 : t + 14 > 15 ? 15 : t + 14;  // s2's exponent
    d[0].s2 = (es >= -14 ? static_cast<uint32_t>(es + 15) << 10 : 1u << (es + 24)) * 0x10001u;
    d[0].z2 = e <= 128 ? 0x3c003c00u : e == 255 ? 0x7e007e00u
                                                : (static_cast<uint32_t>((t - 1 < 15 ? t - 1 : 15) + 15) << 10) * 0x10001u;
    d[0].t2 = e > 143 && e != 255 ? 0x78007800u : 0x3c003c00u;
    d[1] = d[0];
  } else if constexpr (FMT == kMXFP4 && BITS) {
    // E8M0 code e: 2^(e - 127) (255: NaN). The placed bits are v * 2^-126; times s2 =
    // 2^(min(e, 128) - 1), a normal bf16, they are v * 2^(min(e, 128) - 127) exactly
    // (>= 2^-128 with two significant bits: a bf16 subnormal at worst), and times z2 =
    // 2^(e - 128) for e > 128 (NaN for 255), else 1, v * 2^(e - 127), as exact as the
    // reference's float32 product. Where a warp's scales are all <= 2 (e <= 128: blocks
    // whose absmax is below 8, as in trained weights) the wgmma kernel skips the
    // multiply by 1 (mx_scale_fixup): one multiply per pair, as nvfp4's.
    const uint32_t e = c.s & 0xffu;
    d[0].s2 = ((e < 128u ? e : 128u) + 126u) * 0x800080u;
    d[0].z2 = e <= 128u ? 0x3f803f80u : e == 255u ? 0x7fc07fc0u : (e - 1u) * 0x800080u;
    d[1] = d[0];
  } else if constexpr (FMT == kINT4 && BITS) {  // s1, z >> 8 repeat s, z unless bs == 16
    d[0] = make_dec<FMT, BF16, BITS>(c.s, c.z & 0xffu, p);
    d[1] = make_dec<FMT, BF16, BITS>(c.s1, c.z >> 8, p);
  } else if constexpr (FMT == kINT4) {
    d[0] = make_dec<FMT, BF16, BITS>(c.s, c.z & 0xffu, p);
    d[1] = p.bs == 16 ? make_dec<FMT, BF16, BITS>(c.s1, c.z >> 8, p) : d[0];
  } else {
    d[0] = d[1] = make_dec<FMT, BF16, BITS>(c.s, 0, p);
  }
}

// MXFP4's factors after s2 where a block scale is > 2 (make_decs): z2, and t2 for f16 x.
template <bool BF16>
__device__ __forceinline__ uint32_t mx_fix(uint32_t a, const Dec& d) {
  a = hmul2<BF16>(a, d.z2);
  if constexpr (!BF16) a = hmul2<BF16>(a, d.t2);
  return a;
}

// w << s, or w >> -s for s < 0 (|s| < 32; s a constant once the caller's loop is unrolled)
__device__ __forceinline__ uint32_t shift_left(uint32_t w, int s) { return s >= 0 ? w << s : w >> -s; }

// Table path: the values of byte i of code word w (low nibble, high nibble) from the table
// (table_pair), scaled (INT4: after its zero point) into a bf16 / f16 pair, each product
// rounded once as the reference rounds it (finish_pair). decode_word does both per byte;
// the wgmma kernel's table_load / table_finish split them to issue a group's loads ahead
// of the multiplies of the group before (wg_table_ahead).
template <int COPIES>
__device__ __forceinline__ void table_pair(uint32_t w, int i, const float2* table, uint32_t copy, float& lo,
                                           float& hi) {
  if constexpr (COPIES == kLaneTable) {
    // copy = lane_table_base: the nibble to address bits 7-10 by one shift, then one
    // LOP3 masks it and ORs in the 2 KB-aligned table's address + 4 l (volatile: the
    // load stays after the barrier that follows fill_table)
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(lo) : "r"(select_bits<0x780u>(shift_left(w, 7 - 8 * i), copy)));
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(hi) : "r"(select_bits<0x780u>(shift_left(w, 3 - 8 * i), copy)));
  } else {
    // copy = 8 c for the lane's copy c. Wide table (c = l < 32): one PRMT takes byte i of
    // w to bits 8-15 and 8 c to bits 0-7 (the bytes above from 8 c's zero byte 1); 16
    // copies: the byte to bits 7-14 by one shift, then one LOP3 masks it and ORs in 8 c.
    // The table's address is warp-uniform and folds into the load ([R + UR]); volatile:
    // the load stays after the barrier that follows fill_table.
    static_assert(COPIES == kCopies || COPIES == kWideCopies, "pair-table rows of 128 / 256 bytes");
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(table));
    const uint32_t off = COPIES == kWideCopies ? __byte_perm(w, copy, 0x5504u | (i << 4))
                                               : select_bits<0x7f80u>(shift_left(w, 7 - 8 * i), copy);
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(lo), "=f"(hi) : "r"(base + off));
  }
}
template <int FMT, bool BF16>
__device__ __forceinline__ uint32_t finish_pair(float lo, float hi, const Dec& d) {
  if constexpr (FMT == kINT4) {
    lo = __fsub_rn(lo, d.z);
    hi = __fsub_rn(hi, d.z);
  }
  return pack2<BF16>(__fmul_rn(lo, d.s), __fmul_rn(hi, d.s));
}
// v[2 i], v[2 i + 1] = the table values of byte i of w
template <int COPIES>
__device__ __forceinline__ void table_load(uint32_t w, const float2* table, uint32_t copy, float v[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) table_pair<COPIES>(w, i, table, copy, v[2 * i], v[2 * i + 1]);
}
template <int FMT, bool BF16>
__device__ __forceinline__ void table_finish(const float v[8], const Dec& d, uint32_t out[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = finish_pair<FMT, BF16>(v[2 * i], v[2 * i + 1], d);
}

// FIX = false: an MXFP4 bit-path word without its second scale factor, which the caller
// applies to its group of words where mx_scale_fixup says (the wgmma kernel).
template <int FMT, bool BF16, int BITS, int COPIES, bool FIX = true>
__device__ __forceinline__ void decode_word(uint32_t w, const Dec& d, const float2* table,
                                            uint32_t copy, uint32_t out[4]) {
  if constexpr (BITS && FMT == kINT4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t q;  // (w >> 4i) & 0x000f000f | magic as one LOP3 (the magic in a register)
      asm("lop3.b32 %0, %1, %2, %3, 0xea;\n"
          : "=r"(q) : "r"(w >> (4 * i)), "n"(0x000f000fu), "r"(kInt4Magic<BF16>));
      const uint32_t qz = hsub2<BF16>(q, d.z2);
      out[i] = BITS == kBitsSplit ? hfma2<BF16>(qz, d.s2, hmul2<BF16>(qz, d.t2)) : hmul2<BF16>(qz, d.s2);
    }
  } else if constexpr (BITS) {
    e2m1_bits<BF16>(w, out);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // nvfp4: the scale absorbs the placement's factor (kFold); mxfp4: see make_decs
      out[i] = hmul2<BF16>(out[i], d.s2);
      if constexpr (FMT == kMXFP4 && FIX) out[i] = mx_fix<BF16>(out[i], d);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // each byte's loads, then its multiplies (all loads
                                   // first ran slower: more registers live)
      float lo, hi;
      table_pair<COPIES>(w, i, table, copy, lo, hi);
      out[i] = finish_pair<FMT, BF16>(lo, hi, d);
    }
  }
}

// Activations for one code word's 8 physical k (natural order in X) -> the B registers
// of the two MMA steps in the pairing of decode_word.
template <int BITS>
__device__ __forceinline__ uint4 x_pairs(uint4 X) {
  if constexpr (BITS)  // (x0,x4) (x1,x5) (x2,x6) (x3,x7)
    return make_uint4(__byte_perm(X.x, X.z, 0x5410), __byte_perm(X.x, X.z, 0x7632),
                      __byte_perm(X.y, X.w, 0x5410), __byte_perm(X.y, X.w, 0x7632));
  else
    return X;
}

// Bytes of the table path's table with COPIES copies (kLaneTable: the lane table).
template <int COPIES>
__host__ __device__ constexpr int table_bytes() { return COPIES == kLaneTable ? 16 * 32 * 4 : 256 * COPIES * 8; }
constexpr int kLaneTableAlign = 2048;  // the lane table's alignment (its address + 4 l by OR)

// p rounded up to a multiple of `align` bytes in the shared window
template <class T>
__device__ __forceinline__ T* align_shared(T* p, uint32_t align) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  return reinterpret_cast<T*>(reinterpret_cast<uint8_t*>(p) + (((a + align - 1) & ~(align - 1)) - a));
}

// `copy` of the lane table for lane `lane`: the 2 KB-aligned table's shared-window address
// + 4 lane (decode_word ORs the code's 128 c into bits 7-10)
__device__ __forceinline__ uint32_t lane_table_base(const float2* table, int lane) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(table)) | (static_cast<uint32_t>(lane) << 2);
}

template <int FMT, int COPIES>
__device__ void fill_table(float2* table, int tid, int nthreads) {
  if constexpr (COPIES == kLaneTable) {
    for (int i = tid; i < 16 * 32; i += nthreads)
      reinterpret_cast<float*>(table)[i] = code_value<FMT>(static_cast<uint32_t>(i) / 32);
  } else {
    for (int i = tid; i < 256 * COPIES; i += nthreads) {
      const uint32_t byte = static_cast<uint32_t>(i) / COPIES;
      table[i] = make_float2(code_value<FMT>(byte & 15u), code_value<FMT>(byte >> 4));
    }
  }
}

template <bool BF16>
__device__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One 16-row tile times MT 8-column activation tiles for one code word per row half:
// w[h] is the word of row g (h = 0) / g + 8 (h = 1), d[h] its decode constants, xb[mt]
// the activation pairs (x_pairs) of the same 8 physical k.
template <int FMT, bool BF16, int BITS, int MT, int COPIES>
__device__ __forceinline__ void tile_step(float (*acc)[4], const uint32_t w[2], const Dec d[2],
                                          const uint4* xb, const float2* table, uint32_t copy) {
  uint32_t r[2][4];
  decode_word<FMT, BF16, BITS, COPIES>(w[0], d[0], table, copy, r[0]);
  decode_word<FMT, BF16, BITS, COPIES>(w[1], d[1], table, copy, r[1]);
  const uint32_t a0[4] = {r[0][0], r[1][0], r[0][1], r[1][1]};
  const uint32_t a1[4] = {r[0][2], r[1][2], r[0][3], r[1][3]};
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    mma16816<BF16>(acc[mt], a0, xb[mt].x, xb[mt].y);
    mma16816<BF16>(acc[mt], a1, xb[mt].z, xb[mt].w);
  }
}

__device__ __forceinline__ uint32_t word_of(const uint4& q, int s2) {
  return s2 == 0 ? q.x : s2 == 1 ? q.y : s2 == 2 ? q.z : q.w;
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_DECODE_CUH_
