// Quantize / dequantize / fake-quantize kernels (quant.cu), device side, part 1: the chunk
// size, element loads and stores for f32 / bf16 / f16 (Io*), code packing, the
// shared-memory decode / encode tables and the per-element codecs (hardware conversions
// where they are the spec's rounding, else fast forms equal to csrc/codecs.h on the inputs
// they receive). Device code in an anonymous namespace, included by quant.cu (and by
// benchmarks/check_codecs.cu, which checks the fast forms exhaustively).
#ifndef JAX_FP4_CSRC_CUDA_QUANT_ELEMENTS_CUH_
#define JAX_FP4_CSRC_CUDA_QUANT_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include <cstdint>

#include "../../codecs.h"

namespace jf4 {
namespace cuda {
namespace {

constexpr int kChunk = 16;     // elements per thread and chunk
constexpr int kThreads = 512;  // threads per CTA

// ------------------------------------------------------------------ element I/O
// A chunk of 16 x / y elements (one NVFP4 block, half an MX block) moves as NW raw
// 16-byte words. Widening to float32 is exact; narrowing uses the hardware
// round-to-nearest-even conversion (cvt.rn), which is the codecs.h rounding (f32_to_bf16 /
// f32_to_f16); only NaN payloads may differ, and the spec does not fix those. amax_bits
// is codecs.h block_absmax_bits of the chunk (max of |x| bits: NaN > Inf > finite),
// taken on the packed words with the DPX 3-way min/max.
// INT4's block statistics are order keys (codecs.h f32_order_key, or its 16-bit form for
// 16-bit inputs: -0 just below +0, a NaN beyond the infinity of its sign): int4_keys gives
// a chunk's (kmin, ~kmax) in kKeyWords words, so that one signed minimum per word
// (key_min) reduces both over a block, and int4_range turns the reduced words back into
// the block's min and max, or false where the block holds a NaN or an Inf (it gets the
// NaN scale). A min or max of -0 for +0 gives int4_params the same scale and zero point.
template <int NW>
struct Raw {
  uint4 w[NW];
};

struct IoF32 {
  using storage = float;
  using Raw = jf4::cuda::Raw<4>;
  __device__ static Raw load(const float* p) {
    Raw r;
#pragma unroll
    for (int i = 0; i < 4; ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(p) + i);
    return r;
  }
  __device__ static void to_f32(const Raw& r, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[4 * i] = u2f(r.w[i].x);
      v[4 * i + 1] = u2f(r.w[i].y);
      v[4 * i + 2] = u2f(r.w[i].z);
      v[4 * i + 3] = u2f(r.w[i].w);
    }
  }
  __device__ static uint32_t amax_bits(const Raw& r) {
    const uint32_t m = kAbsMask;
    uint32_t a = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      a = __vimax3_u32(a, __vimax3_u32(r.w[i].x & m, r.w[i].y & m, r.w[i].z & m), r.w[i].w & m);
    return a;
  }
  static constexpr int kKeyWords = 2;
  __device__ static void int4_keys(const Raw& r, uint32_t* k) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(r.w);
    int32_t lo = f32_order_key(u2f(w[0])), hi = lo;
#pragma unroll
    for (int i = 1; i < kChunk; ++i) {
      const int32_t key = f32_order_key(u2f(w[i]));
      lo = min(lo, key);
      hi = max(hi, key);
    }
    k[0] = static_cast<uint32_t>(lo);
    k[1] = ~static_cast<uint32_t>(hi);
  }
  __device__ static uint32_t key_min(uint32_t a, uint32_t b) {
    return static_cast<uint32_t>(min(static_cast<int32_t>(a), static_cast<int32_t>(b)));
  }
  __device__ static bool int4_range(const uint32_t* k, float* mn, float* mx) {
    const int32_t lo = static_cast<int32_t>(k[0]), hi = ~static_cast<int32_t>(k[1]);
    constexpr int32_t kInfKey = static_cast<int32_t>(kInfBits);  // -Inf's key: -1 - kInfKey
    *mn = f32_from_order_key(lo);
    *mx = f32_from_order_key(hi);
    return lo >= -kInfKey && hi < kInfKey;
  }
  __device__ static float scalar(const float* p) { return *p; }
  __device__ static void store(float* p, const float* v) {
    float4* q = reinterpret_cast<float4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
};

template <bool BF16>
struct Io16 {
  using storage = uint16_t;
  using Raw = jf4::cuda::Raw<2>;
  __device__ static Raw load(const uint16_t* p) {
    Raw r;
    r.w[0] = __ldg(reinterpret_cast<const uint4*>(p));
    r.w[1] = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    return r;
  }
  __device__ static void to_f32(const Raw& r, float* v) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t w[4] = {r.w[i].x, r.w[i].y, r.w[i].z, r.w[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float* o = v + 8 * i + 2 * j;
        if constexpr (BF16) {
          o[0] = u2f(w[j] << 16);
          o[1] = u2f(w[j] & 0xffff0000u);
        } else {
          const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
          o[0] = f.x;
          o[1] = f.y;
        }
      }
    }
  }
  __device__ static uint32_t amax_bits(const Raw& r) {
    const uint32_t m = 0x7fff7fffu;  // |x| of both halves; 16-bit bit order = value order
    const uint32_t a = __vimax3_u16x2(r.w[0].x & m, r.w[0].y & m, r.w[0].z & m);
    const uint32_t b = __vimax3_u16x2(r.w[0].w & m, r.w[1].x & m, r.w[1].y & m);
    const uint32_t h2 = __vimax3_u16x2(a, b, __vimax3_u16x2(r.w[1].z & m, r.w[1].w & m, 0u));
    const uint32_t h = max(h2 & 0xffffu, h2 >> 16);
    if constexpr (BF16) return h << 16;
    return f2u(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
  }
  // One word: (kmin, ~kmax) as 16-bit keys. The min and max run on the packed pairs
  // (min.NaN / max.NaN: a NaN gives the canonical NaN, positive, so its key lands beyond
  // +Inf's in kmax); the two halves' keys then meet in one packed minimum.
  static constexpr int kKeyWords = 1;
  __device__ static void int4_keys(const Raw& r, uint32_t* k) {
    using T2 = typename std::conditional<BF16, __nv_bfloat162, __half2>::type;
    const T2* h = reinterpret_cast<const T2*>(r.w);
    T2 lo = h[0], hi = h[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) {
      lo = __hmin2_nan(lo, h[i]);
      hi = __hmax2_nan(hi, h[i]);
    }
    const uint32_t klo = keys16(*reinterpret_cast<const uint32_t*>(&lo));
    const uint32_t nkhi = ~keys16(*reinterpret_cast<const uint32_t*>(&hi));
    k[0] = __vmins2(__byte_perm(klo, nkhi, 0x5410u), __byte_perm(klo, nkhi, 0x7632u));
  }
  __device__ static uint32_t key_min(uint32_t a, uint32_t b) { return __vmins2(a, b); }
  __device__ static bool int4_range(const uint32_t* k, float* mn, float* mx) {
    const int32_t lo = static_cast<int16_t>(k[0] & 0xffffu);
    const int32_t hi = ~static_cast<int32_t>(static_cast<int16_t>(k[0] >> 16));
    constexpr int32_t kInfKey = BF16 ? 0x7f80 : 0x7c00;  // -Inf's key: -1 - kInfKey
    *mn = scalar_bits((lo ^ ((lo >> 31) & 0x7fff)) & 0xffff);
    *mx = scalar_bits((hi ^ ((hi >> 31) & 0x7fff)) & 0xffff);
    return lo >= -kInfKey && hi < kInfKey;
  }
  // 16-bit order keys of both halves: b ^ 0x7fff where b is negative (prmt's sign
  // replication gives each half's sign as 0xffff).
  __device__ static uint32_t keys16(uint32_t b) {
    uint32_t sign;
    asm("prmt.b32 %0, %1, 0, 0xbb99;" : "=r"(sign) : "r"(b));
    return b ^ (sign & 0x7fff7fffu);
  }
  __device__ static float scalar_bits(uint32_t b) {
    return BF16 ? u2f(b << 16) : __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  __device__ static float scalar(const uint16_t* p) { return scalar_bits(*p); }
  __device__ static void store(uint16_t* p, const float* v) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* o = v + 8 * i + 2 * j;
        if constexpr (BF16) {
          const __nv_bfloat162 h = __floats2bfloat162_rn(o[0], o[1]);
          w[j] = *reinterpret_cast<const uint32_t*>(&h);
        } else {
          const __half2 h = __floats2half2_rn(o[0], o[1]);
          w[j] = *reinterpret_cast<const uint32_t*>(&h);
        }
      }
      reinterpret_cast<uint4*>(p)[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
};

// ------------------------------------------------------------------ code packing
// 16 codes of BITS bits <-> little-endian bit stream in a uint4 (8 / 12 / 16 bytes
// used), stored as one 8-byte, three 4-byte or one 16-byte access.
template <int BITS>
__device__ uint4 pack16(const uint32_t* c) {
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const int bit = BITS * i, k = bit / 32, o = bit % 32;
    w[k] |= c[i] << o;
    if (o + BITS > 32) w[k + 1] |= c[i] >> (32 - o);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int BITS>
__device__ void store_packed(uint8_t* p, uint4 w) {
  if constexpr (BITS == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w.x, w.y);
  } else if constexpr (BITS == 6) {  // 4-byte aligned
    uint32_t* q = reinterpret_cast<uint32_t*>(p);
    q[0] = w.x;
    q[1] = w.y;
    q[2] = w.z;
  } else {
    *reinterpret_cast<uint4*>(p) = w;
  }
}

template <int BITS>
__device__ uint4 load_packed(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    return make_uint4(v.x, v.y, 0u, 0u);
  } else if constexpr (BITS == 6) {
    const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
    return make_uint4(__ldg(q), __ldg(q + 1), __ldg(q + 2), 0u);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}

// ------------------------------------------------------------------ tables
// Per-CTA shared-memory tables, built once from codecs.h:
//  - decode: element values; 4-bit formats as float2 pairs indexed by a code byte
//    (two elements per lookup), 6- and 8-bit formats one float per code;
//  - NVFP4 quantize: each positive E4M3 scale and its correctly rounded reciprocal;
//  - codebook quantize: the cell table (build_codebook_cells below), a shared array of its
//    own.
template <int FMT>
constexpr int kBits = elem_bits(FMT);
template <int FMT>
constexpr int kChunkBytes = kChunk * elem_bits(FMT) / 8;  // packed codes of one chunk

struct Tables {
  float dec[512];
  float2 e4m3[128];  // NVFP4 quantize: (s, RN(1 / s)) of each positive E4M3 code
  uint32_t red[kThreads / 32];
};

template <int FMT>
__device__ void build_decode_table(Tables& t) {
  if constexpr (kBits<FMT> == 4) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
      t.dec[2 * i] = elem_value<FMT>(i & 15u);
      t.dec[2 * i + 1] = elem_value<FMT>(i >> 4);
    }
  } else {
    for (int i = threadIdx.x; i < (1 << kBits<FMT>); i += blockDim.x) t.dec[i] = elem_value<FMT>(i);
  }
}

template <int FMT>
__device__ void build_encode_tables(Tables& t) {
  if constexpr (FMT == kNVFP4) {
    for (int c = threadIdx.x; c < 128; c += blockDim.x) {
      const float s = e4m3_decode(c);
      t.e4m3[c] = make_float2(s, 1.0f / s);
    }
  }
}

// Codebook quantize (nf4, bnb_fp4) by table: the float line cut into the 2048 cells of floats
// that share their top 11 bits (sign, exponent, 2 mantissa bits), each an interval of values.
// No cell holds two boundaries of either codebook, so a cell's entry is the boundary B inside
// it (or +Inf) and the codes of the positions below and above it: the code of s is byte
// (s > B) of the entry's code word. kCodebookCells entries of 8 bytes, 16 KB.
constexpr int kCodebookCells = 2048;

template <int FMT>
__device__ void build_codebook_cells(float2* cells) {
  if constexpr (is_codebook(FMT)) {
    for (int i = threadIdx.x; i < kCodebookCells; i += blockDim.x) {
      const float a = u2f(static_cast<uint32_t>(i) << 21);
      const float b = u2f(static_cast<uint32_t>(i) << 21 | 0x1fffffu);
      const float lo = fminf(a, b), hi = fmaxf(a, b);  // the cells of Inf / NaN: unused
      // boundaries below the cell, by binary search (the 15 boundaries ascend); the next
      // one is the cell's boundary if it lies inside
      uint32_t below = 0;
#pragma unroll
      for (uint32_t step = 8; step > 0; step >>= 1)
        if (Codebook<FMT>::bound(below + step - 1) < lo) below += step;
      const float next = below < 15 ? Codebook<FMT>::bound(below) : u2f(kInfBits);
      const float bound = next <= hi ? next : u2f(kInfBits);
      const uint32_t codes = codebook_code<FMT>(below) | codebook_code<FMT>(below + 1u) << 8;
      cells[i] = make_float2(bound, u2f(codes));
    }
  }
}

// ------------------------------------------------------------------ element codecs
// sm_89+ converts float32 pairs to E4M3 / E5M2 in hardware.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
constexpr bool kHwFp8 = true;
#else
constexpr bool kHwFp8 = false;
#endif

// Fast forms of the codecs.h element encoders, equal to them on the inputs they get here
// (finite x, finite multiplier > 0; the kernels give non-finite blocks the NaN scale
// first). benchmarks/check_codecs.cu compares them with codecs.h over every input that
// decides them; the GPU tests check the kernels bit for bit against the reference. They
// keep to the FP32 pipe where they can: the integer pipe issues at half its rate on
// sm_80-sm_90 and bounded the quantize kernels before.

// E2M1 (nvfp4_encode(x, mult) == mx_encode<kMXFP4>(x, mult)) on the FMA pipe. The
// magnitude code of a = |x| mult, clamped to 6 and rounded to nearest even, is the minimum
// of RNE(2a), RNE(a) + 2 and RNE(a / 2) + 4, saturated at 7: each is the code on the grid of
// one binade range ([0, 2): steps of 0.5, [2, 4): 1, [4, 8): 2) extended to every a, and an
// extension lies at or above the true code outside its range (RNE is monotone and
// RNE(v + 2) = RNE(v) + 2). Each term is one multiply-add to 2^23 (+2, +4): the exact sum
// rounds once to an integer, ties to even, in the mantissa of a float in [2^23, 2^24), so
// the term is that float's bits minus kE2m1Bias and the minimum an integer one.
// benchmarks/check_codecs.cu compares every a with codecs.h's e2m1_encode.
constexpr uint32_t kE2m1Bias = 0x4b000000u;  // bits of 2^23

__device__ __forceinline__ uint32_t e2m1_magnitude_biased(float a) {
  const uint32_t r0 = f2u(fmaf(a, 2.0f, 0x1p23f));
  const uint32_t r1 = f2u(a + 0x1.000004p23f);              // 2^23 + 2
  const uint32_t r2 = f2u(fmaf(a, 0.5f, 0x1.000008p23f));   // 2^23 + 4
  return __vimin3_u32(r0, r1, min(r2, kE2m1Bias + 7u));
}

// 8 codes below 16, each biased by 2^23 (the bits of a float in [2^23, 2^23 + 16)), as
// one little-endian nibble word: the biased codes accumulate times 16^i by multiply-adds
// (the FMA pipe); the bias terms of nibbles 2..7 leave the 32-bit word and those of
// nibbles 0 and 1 are subtracted up front. code_biased(i) gives code i.
template <typename CodeBiased>
__device__ __forceinline__ uint32_t pack8_biased(CodeBiased code_biased) {
  uint32_t acc = 0u - (kE2m1Bias + (kE2m1Bias << 4));
#pragma unroll
  for (int i = 0; i < 8; ++i) acc += code_biased(i) << (4 * i);
  return acc;
}

// 8 elements' E2M1 codes as one little-endian nibble word (sign in bit 3 of each nibble):
// the magnitudes by pack8_biased; the sign bits gather from each float's top byte with
// byte permutes: odd elements' land in bit 7 of their byte, even elements' in bit 7 and
// then shift to bit 3.
__device__ __forceinline__ uint32_t e2m1_pack8(const float* v, float mult) {
  const uint32_t acc =
      pack8_biased([&](int i) { return e2m1_magnitude_biased(fabsf(v[i]) * mult); });
  auto top_bytes = [&](int i) {  // the top bytes of elements i, i + 2, i + 4, i + 6
    return __byte_perm(__byte_perm(f2u(v[i]), f2u(v[i + 2]), 0x73u),
                       __byte_perm(f2u(v[i + 4]), f2u(v[i + 6]), 0x73u), 0x5410u);
  };
  return acc | (top_bytes(1) & 0x80808080u) | ((top_bytes(0) >> 4) & 0x08080808u);
}

// Correctly rounded a / b from r = RN(1 / b) by one Markstein step (Markstein 1990; Muller
// et al., Handbook of Floating-Point Arithmetic, "Markstein's theorem"): q0 = RN(a r) is
// within one ulp of a / b, the remainder a - q0 b is exact in one FMA, and
// RN(q0 + (a - q0 b) r) = RN(a / b) wherever a / b is a normal number and nothing
// overflows. Three instructions instead of the division's checked sequence; callers keep
// the operands in that range or take the IEEE division.
__device__ __forceinline__ float div_markstein(float a, float b, float r) {
  const float q0 = a * r;
  return fmaf(fmaf(-q0, b, a), r, q0);
}

// == int4_encode(x, s, z) + 2^23 as float bits (pack8_biased's form), for finite x with
// |x| r < kInt4FastLimit, r = RN(1 / s) and zc = z - 1.5 2^23, on the FMA pipe:
// - q = x / s by div_markstein (nothing overflows below the limit; a quotient below the
//   normal range rounds to integer 0 either way);
// - t = q + 1.5 2^23 is RNE(q) + 1.5 2^23 exactly for |q| < 2^22, where the ulp is 1;
//   beyond, t >= 2^24 or t <= 2^23, and the clamp below takes it to 15 or 0 as codecs.h's;
// - t + zc = RNE(q) + z exactly (both integers below 2^25);
// - g = sat((t + zc) RN(1/15)), the saturating multiply: 0 below 0, 1 above 15, and for
//   an integer n in [0, 15] within 2^-23 n of n / 15, so 15 g + 2^23 rounds to 2^23 + n:
//   the clamp to [0, 15] on the FMA pipe.
constexpr float kInt4FastLimit = 0x1p100f;
constexpr float kRne = 0x1.8p23f;  // 1.5 2^23: adding it rounds |q| < 2^22 to an integer

__device__ __forceinline__ uint32_t int4_code_biased(float x, float s, float r, float zc) {
  const float t = div_markstein(x, s, r) + kRne;
  const float g = __saturatef((t + zc) * (1.0f / 15.0f));
  return f2u(fmaf(g, 15.0f, 0x1p23f));
}

// == codebook_code<FMT>(codebook_position<FMT>(x, mult)) from the cell table: the number of
// boundaries below s = x mult is the cell's count below, plus one where s > B, i.e. where
// the sign bit of B - s is set (B - s is +0 for s == B). The cell index and that bit come
// from high halves of products (IMAD.HI, on the FMA pipe), the code from one byte permute.
// The clamp to [-1, 1] of the spec does not change the count: every boundary lies inside.
__device__ __forceinline__ uint32_t codebook_encode_cells(float x, float mult,
                                                          const float2* cells) {
  const float s = x * mult;
  const float2 c = cells[__umulhi(f2u(s), kCodebookCells)];
  const uint32_t above = __umulhi(f2u(c.x - s), 2u);
  return __byte_perm(f2u(c.y), 0u, 0x4440u + above);
}

// Packed codes of the 16 elements of a chunk (NVFP4, MX, codebooks) from the block
// multiplier.
template <int FMT>
__device__ uint4 encode16(const float* v, float mult, const float2* cells) {
  if constexpr (FMT == kNVFP4 || FMT == kMXFP4) {
    return make_uint4(e2m1_pack8(v, mult), e2m1_pack8(v + 8, mult), 0u, 0u);
  } else {
    uint32_t c[kChunk];
    if constexpr (is_codebook(FMT)) {  // codes < 16 accumulate as e2m1_pack8's
      uint32_t w[2] = {0u, 0u};
#pragma unroll
      for (int i = 0; i < kChunk; ++i)
        w[i / 8] += codebook_encode_cells(v[i], mult, cells) << (4 * (i % 8));
      return make_uint4(w[0], w[1], 0u, 0u);
    } else if constexpr ((FMT == kMXFP8_E4M3 || FMT == kMXFP8_E5M2) && kHwFp8) {
      // cvt.rn.satfinite.{e4m3,e5m2}x2.f32: RNE, saturating to the largest finite value,
      // i.e. mx_encode's clamp + encode.
#pragma unroll
      for (int i = 0; i < kChunk; i += 2) {
        const __nv_fp8x2_storage_t pr = __nv_cvt_float2_to_fp8x2(
            make_float2(v[i] * mult, v[i + 1] * mult), __NV_SATFINITE,
            FMT == kMXFP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
        c[i] = pr & 0xffu;
        c[i + 1] = pr >> 8;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) c[i] = mx_encode<FMT>(v[i], mult) & 0xffu;
    }
    return pack16<kBits<FMT>>(c);
  }
}

// y = elem_value(code) * f, or (code - z) * f for INT4 (codecs.h decode) for the 16
// codes of a packed chunk, through the shared-memory table.
template <int FMT>
__device__ void decode16(uint4 pk, float f, float z, const Tables& t, float* v) {
  const uint32_t w[4] = {pk.x, pk.y, pk.z, pk.w};
  if constexpr (kBits<FMT> == 4) {
    const float2* pairs = reinterpret_cast<const float2*>(t.dec);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float2 e = pairs[(w[k / 4] >> (8 * (k % 4))) & 0xffu];
      v[2 * k] = e.x;
      v[2 * k + 1] = e.y;
    }
  } else if constexpr ((FMT == kMXFP8_E4M3 || FMT == kMXFP8_E5M2) && kHwFp8) {
    // cvt.rn.f16x2.{e4m3,e5m2}x2 and f16 -> f32: exact, the table's values
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(w[k / 2] >> (16 * (k % 2))),
          FMT == kMXFP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
      const float2 f = __half22float2(__half2(h));
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int bit = kBits<FMT> * i, k = bit / 32, o = bit % 32;
      uint32_t c = w[k] >> o;
      if (o + kBits<FMT> > 32) c |= w[k + 1] << (32 - o);
      v[i] = t.dec[c & ((1u << kBits<FMT>) - 1u)];
    }
  }
#pragma unroll
  for (int i = 0; i < kChunk; ++i) v[i] = FMT == kINT4 ? (v[i] - z) * f : v[i] * f;
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_QUANT_ELEMENTS_CUH_
