// Quantize / dequantize / fake-quantize kernels (quant.cu), device side, part 1: the chunk
// size, element loads and stores for f32 / bf16 / f16 (Io*), code packing, the
// shared-memory decode / encode tables and the per-element codecs (hardware conversions
// where they are the spec's rounding, else fast forms equal to csrc/codecs.h on the inputs
// they receive). Device code in an anonymous namespace, included by quant.cu only.
#ifndef JAX_FP4_CSRC_CUDA_QUANT_ELEMENTS_CUH_
#define JAX_FP4_CSRC_CUDA_QUANT_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

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
  __device__ static float scalar(const uint16_t* p) {
    return BF16 ? bf16_to_f32(*p) : __half2float(__ushort_as_half(*p));
  }
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
//  - codebook quantize: the 15 boundaries (+Inf as a 16th) and the position -> code order.
template <int FMT>
constexpr int kBits = elem_bits(FMT);
template <int FMT>
constexpr int kChunkBytes = kChunk * elem_bits(FMT) / 8;  // packed codes of one chunk

struct Tables {
  float dec[512];
  alignas(16) float bnd[16];
  uint32_t order[16];
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
  if constexpr (is_codebook(FMT)) {
    if (threadIdx.x < 16) {
      t.bnd[threadIdx.x] = threadIdx.x < 15 ? Codebook<FMT>::bound(threadIdx.x) : u2f(kInfBits);
      t.order[threadIdx.x] = Codebook<FMT>::order(threadIdx.x);
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
// first). The GPU tests check them bit for bit against the reference.

// == nvfp4_encode(x, mult) == mx_encode<kMXFP4>(x, mult): E2M1 code of
// clamp(x * mult, -6, 6), round to nearest even, sign kept. |x * mult| >= 1 rounds on
// the float32 bit pattern (1 mantissa bit); below 1 the E2M1 grid is 0.5, and adding
// 2^22 (ulp 0.5) rounds to it; codes above 7 saturate.
__device__ __forceinline__ uint32_t e2m1_encode_fast(float x, float mult) {
  const float a = fabsf(x) * mult;
  const uint32_t b = f2u(a);
  const uint32_t nrm = ((b + 0x1fffffu + ((b >> 22) & 1u)) >> 22) - 252u;
  const uint32_t sub = f2u(a + 4194304.0f) - 0x4a800000u;
  const uint32_t c = min(b >= 0x3f800000u ? nrm : sub, 7u);
  return c | ((f2u(x) >> 28) & 8u);
}

// == codebook_code<FMT>(codebook_position<FMT>(x, mult)): the number of boundaries below
// x * mult, by binary search: two levels against boundaries held in registers (b.x = B3,
// b.y = B7, b.z = B11), two against one float4 of the 16-entry table (B15 = +Inf). The
// clamp to [-1, 1] of the spec does not change the count: every boundary lies inside.
template <int FMT>
__device__ __forceinline__ uint32_t codebook_encode_fast(float x, float mult, float4 b,
                                                          const Tables& t) {
  const float s = x * mult;
  const bool p1 = s > b.y;
  const bool p2 = s > (p1 ? b.z : b.x);
  uint32_t n = (p1 ? 8u : 0u) + (p2 ? 4u : 0u);
  const float4 q = reinterpret_cast<const float4*>(t.bnd)[n >> 2];  // B[n .. n+3]
  const bool p3 = s > q.y;
  n += p3 ? 2u : 0u;
  n += s > (p3 ? q.z : q.x) ? 1u : 0u;
  return FMT == kNF4 ? n : t.order[n];
}

// Codes of the 16 elements of a chunk (NVFP4, MX, codebooks) from the block multiplier.
template <int FMT>
__device__ void encode16(const float* v, float mult, float4 b, const Tables& t, uint32_t* c) {
  if constexpr (FMT == kNVFP4 || FMT == kMXFP4) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) c[i] = e2m1_encode_fast(v[i], mult);
  } else if constexpr (is_codebook(FMT)) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) c[i] = codebook_encode_fast<FMT>(v[i], mult, b, t);
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
