// CUDA FFI handlers for quantize / dequantize / fake-quantize (csrc/README.md contract).
//
// Memory-bound kernels: one thread owns a chunk of 16 consecutive elements (an NVFP4
// block, half an MX block, 1/G of a codebook/INT4 group) and loads the next chunk of its
// grid-stride loop before it encodes this one; the G = block_size/16 threads of a
// quantization block reduce the block statistics with warp shuffles (G <= 32) or through
// shared memory (G up to 256 = block size 4096). Codes leave as one 8/12/16-byte store.
// The per-block arithmetic is csrc/codecs.h, shared with the CPU kernels; per element,
// hardware conversions and the fast encoders below that equal the codecs.h ones, so the
// kernels match the reference bit for bit. Element indices are 64-bit (tensors above
// 2^31 elements). Design log and measurements: benchmarks/log/NOTES.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include <cstdint>

#include "../codecs.h"
#include "../cpu/kernels.h"
#include "../cpu/validate.h"
#include "../ffi_util.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
using cpu::dispatch_fmt;
using cpu::Problem;
using cpu::scale_bytes;
using cpu::validate_problem;
using cpu::validate_quantized;
using cpu::validate_swizzled;
using cpu::validate_ts;
using cpu::validate_x;
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

// ------------------------------------------------------------------ indexing
struct Params {
  int64_t n_chunks;  // R * K / 8
  int64_t cpr;       // chunks per row (K / 16)
  double inv_cpr;    // 1 / cpr, for row = chunk / cpr without a 64-bit divide
  int64_t srow, scol;  // the grid stride in chunks as (rows, chunks) = divmod(stride, cpr)
  int64_t nb;        // blocks per row
  int G;             // threads per block (block_size / 8), a power of two
  int log2G;
  bool two_level;
  bool rceil;
  bool swizzled;     // quantize: scales in the 128x4 layout
  int st;            // INT4 scale storage type
  int sbytes;        // bytes per stored scale
};

// chunk / cpr for chunk < 2^50: double estimate, corrected by one step either way.
__device__ __forceinline__ int64_t row_of(int64_t chunk, const Params& p) {
  int64_t q = static_cast<int64_t>(static_cast<double>(chunk) * p.inv_cpr);
  const int64_t r = chunk - q * p.cpr;
  q += r < 0 ? -1 : (r >= p.cpr ? 1 : 0);
  return q;
}

// Row and chunk-in-row of a thread's chunk, moved along the grid stride with adds only
// (one division when the kernel starts).
struct RowCursor {
  int64_t row, col;
  __device__ RowCursor(int64_t chunk, const Params& p) : row(row_of(chunk, p)) {
    col = chunk - row * p.cpr;
  }
  __device__ void advance(const Params& p) {
    row += p.srow;
    col += p.scol;
    if (col >= p.cpr) {
      col -= p.cpr;
      ++row;
    }
  }
};

// Index of the scale of the block holding chunk `chunk` (at `at`) in the scales buffer
// (linear or 128x4 swizzled).
__device__ __forceinline__ int64_t scale_slot(int64_t chunk, const RowCursor& at,
                                              const Params& p) {
  return p.swizzled ? scale_offset(at.row, at.col >> p.log2G, p.nb, true) : chunk >> p.log2G;
}

// Bytes per stored scale: E4M3 / E8M0 bytes, f32 absmax, INT4 in its storage type.
template <int FMT>
__device__ __forceinline__ int scale_bytes_of(const Params& p) {
  return FMT == kINT4 ? p.sbytes : (is_codebook(FMT) ? 4 : 1);
}

__device__ void store_scale(void* scales, int64_t idx, int sbytes, uint32_t bits) {
  if (sbytes == 1) static_cast<uint8_t*>(scales)[idx] = static_cast<uint8_t>(bits);
  else if (sbytes == 2) static_cast<uint16_t*>(scales)[idx] = static_cast<uint16_t>(bits);
  else static_cast<uint32_t*>(scales)[idx] = bits;
}
__device__ uint32_t load_scale(const void* scales, int64_t idx, int sbytes) {
  if (sbytes == 1) return __ldg(static_cast<const uint8_t*>(scales) + idx);
  if (sbytes == 2) return __ldg(static_cast<const uint16_t*>(scales) + idx);
  return __ldg(static_cast<const uint32_t*>(scales) + idx);
}

// ------------------------------------------------------------------ group reductions
// Reduce over the G threads of a quantization block (G a power of two, aligned groups).
template <typename Op>
__device__ uint32_t group_reduce(uint32_t v, int G, Op op, uint32_t* smem) {
  const int lanes = G < 32 ? G : 32;
  for (int o = lanes / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (G <= 32) return v;
  // G in {64, ..., 512}: combine the G/32 warps of the group through shared memory.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const int first = warp & ~(G / 32 - 1);
  uint32_t r = smem[first];
  for (int w = 1; w < G / 32; ++w) r = op(r, smem[first + w]);
  return r;
}

struct MaxU { __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; } };
struct MinI {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const {
    return static_cast<int32_t>(a) < static_cast<int32_t>(b) ? a : b;
  }
};
struct MaxI {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const {
    return static_cast<int32_t>(a) > static_cast<int32_t>(b) ? a : b;
  }
};

// ------------------------------------------------------------------ quantize one chunk
// Codes (unpacked), scale bits and INT4 zero point of one chunk; every thread of the
// block's group gets the same scale. amax: this chunk's absmax bits (before the group
// reduction); tsr: the row's tensor scale (NVFP4 two-level).
template <int FMT>
__device__ void quantize_chunk(const float* v, uint32_t amax, float tsr, const Params& p,
                               Tables& t, float4 b, uint32_t* codes, uint32_t* scale_bits,
                               uint32_t* zero) {
  *zero = 0;
  if constexpr (FMT == kINT4) {
    uint32_t kmin = 0x7fffffffu, kmax = 0x80000000u;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const uint32_t k = static_cast<uint32_t>(f32_order_key(v[i]));
      kmin = MinI()(kmin, k);
      kmax = MaxI()(kmax, k);
    }
    amax = group_reduce(amax, p.G, MaxU(), t.red);
    kmin = group_reduce(kmin, p.G, MinI(), t.red);
    kmax = group_reduce(kmax, p.G, MaxI(), t.red);
    if (bits_nonfinite(amax)) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) codes[i] = 0;
      *scale_bits = scale_nan_bits(p.st);
      return;
    }
    const Int4Params q = int4_params(f32_from_order_key(static_cast<int32_t>(kmin)),
                                     f32_from_order_key(static_cast<int32_t>(kmax)), p.st);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) codes[i] = int4_encode(v[i], q.s, q.z);
    *scale_bits = q.scale_bits;
    *zero = static_cast<uint32_t>(static_cast<int32_t>(q.z));
  } else {
    amax = group_reduce(amax, p.G, MaxU(), t.red);
    bool bad = bits_nonfinite(amax);
    if (FMT == kNVFP4 && p.two_level) bad = bad || nvfp4_bad_tensor_scale(tsr);
    if (bad) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) codes[i] = 0;
      *scale_bits = FMT == kNVFP4 ? kE4M3NaN : (is_mx(FMT) ? kE8M0NaN : kQuietNaNBits);
      return;
    }
    float mult;
    if constexpr (FMT == kNVFP4) {
      const uint32_t sc = p.two_level ? nvfp4_scale_code<true>(u2f(amax), tsr)
                                      : nvfp4_scale_code<false>(u2f(amax), tsr);
      mult = p.two_level ? nvfp4_elem_mult<true>(sc, tsr) : nvfp4_elem_mult<false>(sc, tsr);
      *scale_bits = sc;
    } else if constexpr (is_mx(FMT)) {
      const uint32_t sc = mx_scale_code<FMT>(amax, p.rceil);
      mult = e8m0_inverse(sc);
      *scale_bits = sc;
    } else {
      mult = codebook_mult(amax);
      *scale_bits = amax;
    }
    encode16<FMT>(v, mult, b, t, codes);
  }
}

// Codebook boundaries B3, B7, B11 (the first two binary-search levels) in registers.
template <int FMT>
__device__ float4 codebook_b(const Tables& t) {
  if constexpr (is_codebook(FMT)) return make_float4(t.bnd[3], t.bnd[7], t.bnd[11], 0.0f);
  return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// The row tensor scale of a live chunk (NVFP4 two-level; 0 otherwise).
template <int FMT>
__device__ __forceinline__ float chunk_ts(const float* ts, int64_t row, bool live,
                                          const Params& p) {
  return (FMT == kNVFP4 && p.two_level && live) ? __ldg(ts + row) : 0.0f;
}

// ------------------------------------------------------------------ kernels
// Grid-stride loop over chunks, software-pipelined: load(chunk, at) -> Raw of the
// thread's next chunk is issued before body(chunk, at, raw) runs for this one, so 2 x 32
// bytes of bf16 input per thread are in flight (`at`: the chunk's row and column).
// load() must return a harmless value past the end; every thread of a CTA runs the same
// number of steps, so a body may hold barriers.
template <typename Raw, typename Load, typename Body>
__device__ __forceinline__ void for_each_chunk(const Params& p, Load load, Body body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  RowCursor at(chunk, p);
  Raw cur = load(chunk, at);
  for (; chunk - threadIdx.x < p.n_chunks; chunk += stride) {  // uniform over the CTA
    RowCursor at_next = at;
    at_next.advance(p);
    const Raw nxt = load(chunk + stride, at_next);
    body(chunk, at, cur);
    cur = nxt;
    at = at_next;
  }
}

// x chunk, or zeros past the end.
template <typename L>
__device__ __forceinline__ typename L::Raw load_x(const typename L::storage* x, int64_t chunk,
                                                  int64_t n_chunks) {
  return chunk < n_chunks ? L::load(x + chunk * kChunk) : typename L::Raw{};
}

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads, 2) quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    uint8_t* __restrict__ codes, void* __restrict__ scales, uint8_t* __restrict__ zeros,
    Params p) {
  __shared__ Tables t;
  build_encode_tables<FMT>(t);
  __syncthreads();
  const float4 b = codebook_b<FMT>(t);
  for_each_chunk<typename L::Raw>(
      p, [&](int64_t c, const RowCursor&) { return load_x<L>(x, c, p.n_chunks); },
      [&](int64_t chunk, const RowCursor& at, const typename L::Raw& raw) {
        const bool live = chunk < p.n_chunks;  // n_chunks is a multiple of G: whole groups
        float v[kChunk];
        L::to_f32(raw, v);
        uint32_t c[kChunk], sb, z;
        quantize_chunk<FMT>(v, L::amax_bits(raw), chunk_ts<FMT>(ts, at.row, live, p), p, t,
                            b, c, &sb, &z);
        if (!live) return;
        store_packed<kBits<FMT>>(codes + chunk * kChunkBytes<FMT>, pack16<kBits<FMT>>(c));
        if ((chunk & (p.G - 1)) == 0) {
          const int64_t blk = chunk >> p.log2G;
          store_scale(scales, scale_slot(chunk, at, p), scale_bytes_of<FMT>(p), sb);
          if (FMT == kINT4) zeros[blk] = static_cast<uint8_t>(z);
        }
      });
}

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads, 2) fake_quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p) {
  __shared__ Tables t;
  build_encode_tables<FMT>(t);
  build_decode_table<FMT>(t);
  __syncthreads();
  const float4 b = codebook_b<FMT>(t);
  for_each_chunk<typename L::Raw>(
      p, [&](int64_t c, const RowCursor&) { return load_x<L>(x, c, p.n_chunks); },
      [&](int64_t chunk, const RowCursor& at, const typename L::Raw& raw) {
        const bool live = chunk < p.n_chunks;
        float v[kChunk];
        L::to_f32(raw, v);
        const float tsr = chunk_ts<FMT>(ts, at.row, live, p);
        uint32_t c[kChunk], sb, z;
        quantize_chunk<FMT>(v, L::amax_bits(raw), tsr, p, t, b, c, &sb, &z);
        if (!live) return;
        // every thread of the group holds the block's scale: decode locally
        decode16<FMT>(pack16<kBits<FMT>>(c), block_factor<FMT>(sb, p.two_level, tsr, p.st),
                     static_cast<float>(z), t, v);
        L::store(y + chunk * kChunk, v);
      });
}

// What dequantize reads for one chunk: packed codes, scale bits, zero point, row scale.
struct Coded {
  uint4 pk;
  uint32_t sb, z;
  float tsr;
};

// Dequantize handles two chunks per thread and step, one in each half of the tensor:
// twice the loads in flight per thread (the kernel runs at one CTA per SM, where
// write-heavy streams reach the most DRAM bandwidth, benchmarks/log/NOTES.md).
struct Coded2 {
  Coded c[2];
};

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads, 1) dequantize_kernel(
    const uint8_t* __restrict__ codes, const void* __restrict__ scales,
    const uint8_t* __restrict__ zeros, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p) {
  __shared__ Tables t;
  build_decode_table<FMT>(t);
  __syncthreads();
  const int64_t half = (p.n_chunks + 1) / 2;
  auto load_one = [&](int64_t chunk, int64_t row) {
    Coded c{make_uint4(0, 0, 0, 0), 0, 0, 0.0f};
    if (chunk < p.n_chunks) {
      c.pk = load_packed<kBits<FMT>>(codes + chunk * kChunkBytes<FMT>);
      const int64_t blk = chunk >> p.log2G;
      c.sb = load_scale(scales, blk, scale_bytes_of<FMT>(p));
      if (FMT == kINT4) c.z = __ldg(zeros + blk);
      c.tsr = chunk_ts<FMT>(ts, row, true, p);
    }
    return c;
  };
  auto decode_one = [&](int64_t chunk, const Coded& c) {
    if (chunk >= p.n_chunks) return;
    float v[kChunk];
    decode16<FMT>(c.pk, block_factor<FMT>(c.sb, p.two_level, c.tsr, p.st),
                  static_cast<float>(c.z), t, v);
    L::store(y + chunk * kChunk, v);
  };
  Params first_half = p;
  first_half.n_chunks = half;
  const bool rows = FMT == kNVFP4 && p.two_level;
  for_each_chunk<Coded2>(
      first_half,
      [&](int64_t chunk, const RowCursor& at) {
        const int64_t c2 = chunk + half;
        return Coded2{{load_one(chunk < half ? chunk : p.n_chunks, at.row),
                       load_one(chunk < half ? c2 : p.n_chunks, rows ? row_of(c2, p) : 0)}};
      },
      [&](int64_t chunk, const RowCursor&, const Coded2& c) {
        if (chunk >= half) return;
        decode_one(chunk, c.c[0]);
        decode_one(chunk + half, c.c[1]);
      });
}

// max |x| over the tensor as float32 bits (codecs.h block_absmax_bits over everything),
// atomically max-ed into *out (zeroed before the launch): the per-tensor amax of NVFP4
// tensor_scale="auto", one read of x. tensor_scale_kernel then turns it into the scale.
template <typename L>
__global__ void __launch_bounds__(kThreads) amax_kernel(const typename L::storage* __restrict__ x,
                                                        int64_t n, uint32_t* __restrict__ out) {
  __shared__ uint32_t red[kThreads / 32];
  const int64_t n_chunks = n / kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t m = 0;
  for (; c + 3 * stride < n_chunks; c += 4 * stride) {
    typename L::Raw r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = L::load(x + (c + u * stride) * kChunk);
#pragma unroll
    for (int u = 0; u < 4; ++u) m = max(m, L::amax_bits(r[u]));
  }
  for (; c < n_chunks; c += stride) m = max(m, L::amax_bits(L::load(x + c * kChunk)));
  if (blockIdx.x == 0 && threadIdx.x < n - n_chunks * kChunk) {  // the last n % 8 elements
    m = max(m, f2u(L::scalar(x + n_chunks * kChunk + threadIdx.x)) & kAbsMask);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, red[w]);
    atomicMax(out, m);
  }
}

// ------------------------------------------------------------------ launch
// Calls f(std::integral_constant<int, FMT>) -> ffi::Error for the runtime format id.
template <typename F>
ffi::Error with_fmt(int fmt, F&& f) {
  ffi::Error err = ffi::Error::InvalidArgument("jax_fp4: unknown fmt");
  dispatch_fmt(fmt, [&](auto fmt_c) {
    err = f(fmt_c);
    return true;
  });
  return err;
}

// CTAs for n_chunks chunks (one per thread and step), capped at ctas_per_sm per SM
// (grid-stride beyond that). Measured on an H100 (benchmarks/log/NOTES.md): quantize and
// fake-quantize (2 resident CTAs per SM) do best with 8 waves (16 per SM); dequantize,
// whose traffic is 80% writes, with a single CTA per SM.
// The SM count is read once per device (a process may run on several GPUs).
int grid_for(int64_t n_chunks, int ctas_per_sm) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sm_count[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  int sms = dev >= 0 && dev < kMaxDevices ? sm_count[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (sms <= 0) sms = 132;
    if (dev >= 0 && dev < kMaxDevices) sm_count[dev].store(sms, std::memory_order_relaxed);
  }
  const int64_t ctas = (n_chunks + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * ctas_per_sm;
  return static_cast<int>(ctas < cap ? ctas : cap);
}

Params make_params(const Problem& p) {
  Params q;
  q.n_chunks = p.R * p.K / kChunk;
  q.cpr = p.K / kChunk;
  q.inv_cpr = q.cpr > 0 ? 1.0 / static_cast<double>(q.cpr) : 0.0;
  q.srow = q.scol = 0;  // set with the grid (set_stride)
  q.nb = p.nb;
  q.G = static_cast<int>(p.bs / kChunk);
  q.log2G = 0;
  while ((1 << q.log2G) < q.G) ++q.log2G;
  q.two_level = p.two_level;
  q.rceil = p.rceil;
  q.swizzled = p.swizzled;
  q.st = p.scale_type;
  q.sbytes = scale_bytes(p);
  return q;
}

// The grid stride (gridDim.x * kThreads chunks) as (rows, chunks).
Params with_stride(Params q, int grid) {
  const int64_t stride = static_cast<int64_t>(grid) * kThreads;
  q.srow = q.cpr > 0 ? stride / q.cpr : 0;
  q.scol = stride - q.srow * q.cpr;
  return q;
}

// The CUDA kernels need block_size = 16 * G with G a power of two <= 256 (the Python
// lowering sends other INT4 group sizes to the reference path).
ffi::Error check_cuda_block(const std::string& where, const Problem& p) {
  const int64_t g = p.bs / kChunk;
  if (p.bs % kChunk != 0 || g < 1 || g > 256 || (g & (g - 1)) != 0)
    return invalid(where, "the CUDA kernels need block_size = 16 * 2^k <= 4096, got " +
                              std::to_string(p.bs));
  return ffi::Error::Success();
}

ffi::Error launched(const std::string& where) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal("jax_fp4 " + where + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Calls f(Io) for the x/y element type.
template <typename F>
ffi::Error with_io(ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F32: return f(IoF32{});
    case ffi::DataType::BF16: return f(Io16<true>{});
    case ffi::DataType::F16: return f(Io16<false>{});
    default: return ffi::Error::InvalidArgument("jax_fp4: unsupported dtype");
  }
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                        ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::AnyBuffer> zeros, int32_t fmt, int64_t block_size,
                        int32_t rceil, int32_t two_level, int32_t swizzled) {
  const std::string where = "jax_fp4_quantize_v2 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_swizzled(where, swizzled, &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, *codes, *scales, *zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for(p.R * p.K / kChunk, 16);
  const Params q = with_stride(make_params(p), grid);
  // The 128x4 layout's padding (rows past R, scale columns past nb) holds zero bytes.
  if (p.swizzled && (p.R % 128 != 0 || p.nb % 4 != 0) &&
      cudaMemsetAsync(scales->untyped_data(), 0, scales->size_bytes(), stream) != cudaSuccess)
    return launched(where);
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      quantize_kernel<decltype(F)::value, LT><<<grid, kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<uint8_t*>(codes->untyped_data()), scales->untyped_data(),
          static_cast<uint8_t*>(zeros->untyped_data()), q);
      return launched(where);
    });
  });
}

// jax_fp4_quantize_v1 (kept for jax.export artifacts that name it): v2 with linear scales.
ffi::Error QuantizeV1Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                          ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                          ffi::Result<ffi::AnyBuffer> zeros, int32_t fmt, int64_t block_size,
                          int32_t rceil, int32_t two_level) {
  return QuantizeImpl(stream, x, ts, codes, scales, zeros, fmt, block_size, rceil, two_level, 0);
}

// Buffers and attributes shared by quantize v1 and v2 (v2 adds `swizzled`).
auto QuantizeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()  // x
      .Arg<ffi::AnyBuffer>()  // ts
      .Ret<ffi::AnyBuffer>()  // codes
      .Ret<ffi::AnyBuffer>()  // scales
      .Ret<ffi::AnyBuffer>()  // zeros
      .Attr<int32_t>("fmt")
      .Attr<int64_t>("block_size")
      .Attr<int32_t>("rceil")
      .Attr<int32_t>("two_level");
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer zeros, ffi::AnyBuffer ts, ffi::Result<ffi::AnyBuffer> y,
                          int32_t fmt, int64_t block_size, int32_t two_level) {
  const std::string where = "jax_fp4_dequantize_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "y", *y));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, 0, two_level,
                                       y->dimensions()[0], y->dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for((p.R * p.K / kChunk + 1) / 2, 1);  // two chunks per thread
  const Params q = with_stride(make_params(p), grid);
  return with_fmt(fmt, [&](auto F) {
    return with_io(y->element_type(), [&](auto L) {
      using LT = decltype(L);
      dequantize_kernel<decltype(F)::value, LT>
          <<<grid, kThreads, 0, stream>>>(
              static_cast<const uint8_t*>(codes.untyped_data()), scales.untyped_data(),
              static_cast<const uint8_t*>(zeros.untyped_data()),
              static_cast<const float*>(ts.untyped_data()),
              static_cast<typename LT::storage*>(y->untyped_data()), q);
      return launched(where);
    });
  });
}

ffi::Error FakeQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                            ffi::Result<ffi::AnyBuffer> y, int32_t fmt, int64_t block_size,
                            int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_fake_quantize_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (y->element_type() != x.element_type())
    return invalid(where, "buffer `y` must have the dtype of `x`");
  // INT4 fake-quant keeps the group scale in x's dtype (scale_dtype default)
  p.scale_type = x.element_type() == ffi::DataType::BF16 ? kScaleBF16
                 : x.element_type() == ffi::DataType::F16 ? kScaleF16 : kScaleF32;
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for(p.R * p.K / kChunk, 16);
  const Params q = with_stride(make_params(p), grid);
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      fake_quantize_kernel<decltype(F)::value, LT><<<grid, kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<typename LT::storage*>(y->untyped_data()), q);
      return launched(where);
    });
  });
}

__global__ void tensor_scale_kernel(uint32_t* bits) {
  *reinterpret_cast<float*>(bits) = nvfp4_tensor_scale_from_amax(*bits);
}

// tensor_scale: x (R, K) f32/bf16/f16 -> () f32, the NVFP4 per-tensor scale of x
// (codecs.h nvfp4_tensor_scale_from_amax of max |x|), csrc/README.md.
ffi::Error TensorScaleImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const std::string where = "jax_fp4_tensor_scale_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  if (out->element_type() != ffi::DataType::F32 || out->element_count() != 1)
    return invalid(where, "buffer `out` must be a float32 scalar");
  if (cudaMemsetAsync(out->untyped_data(), 0, sizeof(uint32_t), stream) != cudaSuccess)
    return launched(where);
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t n_chunks = n / kChunk;
  uint32_t* bits = static_cast<uint32_t*>(out->untyped_data());
  return with_io(x.element_type(), [&](auto L) {
    using LT = decltype(L);
    if (n > 0)
      amax_kernel<LT><<<std::max(1, grid_for((n_chunks + 3) / 4, 16)), kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()), n, bits);
    tensor_scale_kernel<<<1, 1, 0, stream>>>(bits);
    return launched(where);
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV1Cuda, jf4::cuda::QuantizeV1Impl,
                              jf4::cuda::QuantizeBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV2Cuda, jf4::cuda::QuantizeImpl,
                              jf4::cuda::QuantizeBinding().Attr<int32_t>("swizzled"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4DequantizeV1Cuda, jf4::cuda::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("two_level"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FakeQuantizeV1Cuda, jf4::cuda::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4TensorScaleV1Cuda, jf4::cuda::TensorScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
