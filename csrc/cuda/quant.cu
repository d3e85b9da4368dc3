// CUDA FFI handlers for quantize / dequantize / fake-quantize (csrc/README.md contract).
//
// Memory-bound kernels: one thread owns a chunk of 8 consecutive elements (half an NVFP4
// block, a quarter of an MX block, 1/G of a codebook/INT4 group), so a warp's 16-byte
// loads and stores of bf16/f16 cover 512 contiguous bytes; the G = block_size/8 threads of
// a quantization block reduce the block statistics with warp shuffles (G <= 32) or through
// shared memory (G up to 512 = block size 4096). Codes leave as one 4/6/8-byte store. The per-element and per-block arithmetic is
// csrc/codecs.h, shared with the CPU kernels, so both match the reference bit for bit.
// Element indices are 64-bit (tensors above 2^31 elements).
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

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
using cpu::validate_ts;
using cpu::validate_x;
namespace {

constexpr int kChunk = 8;      // elements per thread
constexpr int kThreads = 512;  // threads per CTA

// ------------------------------------------------------------------ element I/O
template <typename T>
struct Io;
template <>
struct Io<float> {
  using storage = float;
  __device__ static void load(const float* p, float* v) {
    const float4* q = reinterpret_cast<const float4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float4 f = __ldg(q + i);
      v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
  }
  __device__ static void store(float* p, const float* v) {
    float4* q = reinterpret_cast<float4*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) q[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  }
};
// bf16 / f16 as raw uint16 (conversion through codecs.h: exact, RNE, subnormals kept).
template <bool BF16>
struct Io16 {
  using storage = uint16_t;
  __device__ static float to_f32(uint32_t h) { return BF16 ? bf16_to_f32(h) : f16_to_f32(h); }
  __device__ static uint32_t from_f32(float f) { return BF16 ? f32_to_bf16(f) : f32_to_f16(f); }
  __device__ static void load(const uint16_t* p, float* v) {
    const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 1; ++i) {
      uint4 w = __ldg(q + i);
      uint32_t a[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[8 * i + 2 * j] = to_f32(a[j] & 0xffffu);
        v[8 * i + 2 * j + 1] = to_f32(a[j] >> 16);
      }
    }
  }
  __device__ static void store(uint16_t* p, const float* v) {
    uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int i = 0; i < 1; ++i) {
      uint32_t a[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        a[j] = from_f32(v[8 * i + 2 * j]) | (from_f32(v[8 * i + 2 * j + 1]) << 16);
      q[i] = make_uint4(a[0], a[1], a[2], a[3]);
    }
  }
};

// ------------------------------------------------------------------ code packing
// 8 codes of `bits` bits -> little-endian bit stream of `bits` bytes at p (4/6/8 B).
template <int BITS>
__device__ void store_codes(uint8_t* p, const uint32_t* c) {
  if constexpr (BITS == 4) {
    uint32_t w = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) w |= (c[i] & 15u) << (4 * i);
    *reinterpret_cast<uint32_t*>(p) = w;
  } else if constexpr (BITS == 6) {
    uint32_t lo = 0, hi = 0;  // 48 bits: elements 0..4 (+2 bits of 5) in lo, rest in hi
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int bit = 6 * i;
      const uint32_t v = c[i] & 63u;
      if (bit < 32) lo |= v << bit;
      if (bit + 6 > 32) hi |= bit >= 32 ? v << (bit - 32) : v >> (32 - bit);
    }
    uint16_t* q = reinterpret_cast<uint16_t*>(p);  // 6 bytes at a 2-byte aligned address
    q[0] = static_cast<uint16_t>(lo);
    q[1] = static_cast<uint16_t>(lo >> 16);
    q[2] = static_cast<uint16_t>(hi);
  } else {
    uint32_t w[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      w[i] = (c[4 * i] & 255u) | ((c[4 * i + 1] & 255u) << 8) | ((c[4 * i + 2] & 255u) << 16) |
             ((c[4 * i + 3] & 255u) << 24);
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  }
}

template <int BITS>
__device__ void load_codes(const uint8_t* p, uint32_t* c) {
  if constexpr (BITS == 4) {
    const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(p));
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = (w >> (4 * i)) & 15u;
  } else if constexpr (BITS == 6) {
    const uint16_t* q = reinterpret_cast<const uint16_t*>(p);
    const uint32_t lo = __ldg(q) | (static_cast<uint32_t>(__ldg(q + 1)) << 16);
    const uint32_t hi = __ldg(q + 2);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int bit = 6 * i;
      uint32_t v = bit < 32 ? lo >> bit : hi >> (bit - 32);
      if (bit < 32 && bit + 6 > 32) v |= hi << (32 - bit);
      c[i] = v & 63u;
    }
  } else {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] = ((i < 4 ? w.x : w.y) >> (8 * (i % 4))) & 255u;
  }
}

// ------------------------------------------------------------------ group reductions
// Reduce over the G threads of a quantization block (G a power of two, aligned groups).
template <typename Op>
__device__ uint32_t group_reduce(uint32_t v, int G, Op op, uint32_t* smem) {
  const int lanes = G < 32 ? G : 32;
  for (int o = lanes / 2; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (G <= 32) return v;
  // G in {64, 128, 256}: combine the G/32 warps of the group through shared memory.
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

struct Params {
  int64_t n_chunks;   // total elements / 16
  int64_t K;          // row length
  int64_t nb;         // blocks per row
  int bs;             // block size
  int G;              // threads per block (bs / 8)
  bool two_level;
  bool rceil;
  int st;             // INT4 scale storage type
};

template <int FMT>
__device__ void quantize_chunk_scaled(const float* v, const Params& p, int64_t row,
                                      const float* ts, uint32_t* smem, uint32_t amax,
                                      uint32_t* codes, uint32_t* scale_bits);

// Per-chunk state computed by the quantize stage: codes and (for the group leader) scale.
template <int FMT>
__device__ void quantize_chunk(const float* v, const Params& p, int64_t chunk, const float* ts,
                               uint32_t* smem, uint32_t* codes, uint32_t* scale_bits,
                               uint32_t* zero) {
  const int64_t e0 = chunk * kChunk;
  const int64_t row = e0 / p.K;
  uint32_t amax = 0;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const uint32_t a = f2u(v[i]) & kAbsMask;
    amax = a > amax ? a : amax;
  }
  if constexpr (FMT == kINT4) {
    uint32_t kmin = 0x7fffffffu, kmax = 0x80000000u;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const uint32_t k = static_cast<uint32_t>(f32_order_key(v[i]));
      kmin = MinI()(kmin, k);
      kmax = MaxI()(kmax, k);
    }
    amax = group_reduce(amax, p.G, MaxU(), smem);
    kmin = group_reduce(kmin, p.G, MinI(), smem);
    kmax = group_reduce(kmax, p.G, MaxI(), smem);
    if (bits_nonfinite(amax)) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) codes[i] = 0;
      *scale_bits = scale_nan_bits(p.st);
      *zero = 0;
      return;
    }
    const Int4Params q = int4_params(f32_from_order_key(static_cast<int32_t>(kmin)),
                                     f32_from_order_key(static_cast<int32_t>(kmax)), p.st);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) codes[i] = int4_encode(v[i], q.s, q.z);
    *scale_bits = q.scale_bits;
    *zero = static_cast<uint32_t>(static_cast<int32_t>(q.z));
  } else {
    quantize_chunk_scaled<FMT>(v, p, row, ts, smem, amax, codes, scale_bits);
  }
}

// NVFP4, MX and codebooks: one statistic (amax), then encode.
template <int FMT>
__device__ void quantize_chunk_scaled(const float* v, const Params& p, int64_t row,
                                      const float* ts, uint32_t* smem, uint32_t amax,
                                      uint32_t* codes, uint32_t* scale_bits) {
  amax = group_reduce(amax, p.G, MaxU(), smem);
  bool bad = bits_nonfinite(amax);
  float tsr = 0.0f;
  if constexpr (FMT == kNVFP4) {
    if (p.two_level) {
      tsr = ts[row];
      bad = bad || nvfp4_bad_tensor_scale(tsr);
    }
  }
  if (bad) {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) codes[i] = 0;
    *scale_bits = FMT == kNVFP4 ? kE4M3NaN : (is_mx(FMT) ? kE8M0NaN : kQuietNaNBits);
    return;
  }
  if constexpr (FMT == kNVFP4) {
    const uint32_t sc = p.two_level ? nvfp4_scale_code<true>(u2f(amax), tsr)
                                    : nvfp4_scale_code<false>(u2f(amax), tsr);
    const float r = p.two_level ? nvfp4_elem_mult<true>(sc, tsr) : nvfp4_elem_mult<false>(sc, tsr);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) codes[i] = nvfp4_encode(v[i], r);
    *scale_bits = sc;
  } else if constexpr (is_mx(FMT)) {
    const uint32_t sc = mx_scale_code<FMT>(amax, p.rceil);
    const float mult = e8m0_inverse(sc);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) codes[i] = mx_encode<FMT>(v[i], mult) & 0xffu;
    *scale_bits = sc;
  } else {
    const float mult = codebook_mult(amax);
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      codes[i] = codebook_code<FMT>(codebook_position<FMT>(v[i], mult));
    *scale_bits = amax;
  }
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

// Decode one chunk into v (float32).
template <int FMT>
__device__ void decode_chunk(const uint32_t* c, uint32_t scale_bits, uint32_t zero, float tsr,
                             const Params& p, const float* table, float* v) {
  const float f = block_factor<FMT>(scale_bits, p.two_level, tsr, p.st);
  if constexpr (is_codebook(FMT)) {
    // shared-memory copy of the code table: divergent __constant__ reads serialise
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = table[c[i] & 15u] * f;
  } else if constexpr (FMT == kINT4) {
    const float z = static_cast<float>(zero);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = (static_cast<float>(c[i]) - z) * f;
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) v[i] = elem_value<FMT>(c[i]) * f;
  }
}

template <int FMT>
constexpr int kBits = elem_bits(FMT);

// Codebook formats: the 16 code values into shared memory (one barrier per CTA).
template <int FMT>
__device__ void load_table(float* table) {
  if constexpr (is_codebook(FMT)) {
    if (threadIdx.x < 16) table[threadIdx.x] = elem_value<FMT>(threadIdx.x);
    __syncthreads();
  }
}

// Grid-stride over chunks; every thread of a CTA runs the same number of iterations so
// the shared-memory reduction's barriers are uniform (threads past the end idle).
template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads) quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    uint8_t* __restrict__ codes, void* __restrict__ scales, uint8_t* __restrict__ zeros,
    Params p, int sbytes) {
  __shared__ uint32_t smem[kThreads / 32];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < p.n_chunks;
       base += stride) {
    const int64_t chunk = base + threadIdx.x;
    const bool live = chunk < p.n_chunks;  // n_chunks is a multiple of G: groups are whole
    float v[kChunk];
    if (live) L::load(x + chunk * kChunk, v);
    else for (int i = 0; i < kChunk; ++i) v[i] = 0.0f;
    uint32_t c[kChunk], sb = 0, z = 0;
    quantize_chunk<FMT>(v, p, live ? chunk : 0, ts, smem, c, &sb, &z);
    if (!live) continue;
    store_codes<kBits<FMT>>(codes + chunk * kBits<FMT>, c);
    if (chunk % p.G == 0) {
      const int64_t blk = chunk / p.G;
      store_scale(scales, blk, sbytes, sb);
      if (FMT == kINT4) zeros[blk] = static_cast<uint8_t>(z);
    }
  }
}

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(
    const uint8_t* __restrict__ codes, const void* __restrict__ scales,
    const uint8_t* __restrict__ zeros, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p, int sbytes) {
  __shared__ float table[16];
  load_table<FMT>(table);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
       chunk < p.n_chunks; chunk += stride) {
    uint32_t c[kChunk];
    load_codes<kBits<FMT>>(codes + chunk * kBits<FMT>, c);
    const int64_t blk = chunk / p.G;
    const uint32_t sb = load_scale(scales, blk, sbytes);
    const uint32_t z = FMT == kINT4 ? __ldg(zeros + blk) : 0u;
    const float tsr = (FMT == kNVFP4 && p.two_level) ? __ldg(ts + (chunk * kChunk) / p.K) : 0.f;
    float v[kChunk];
    decode_chunk<FMT>(c, sb, z, tsr, p, table, v);
    L::store(y + chunk * kChunk, v);
  }
}

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads) fake_quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p) {
  __shared__ uint32_t smem[kThreads / 32];
  __shared__ float table[16];
  load_table<FMT>(table);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads; base < p.n_chunks;
       base += stride) {
    const int64_t chunk = base + threadIdx.x;
    const bool live = chunk < p.n_chunks;
    float v[kChunk];
    if (live) L::load(x + chunk * kChunk, v);
    else for (int i = 0; i < kChunk; ++i) v[i] = 0.0f;
    uint32_t c[kChunk], sb = 0, z = 0;
    quantize_chunk<FMT>(v, p, live ? chunk : 0, ts, smem, c, &sb, &z);
    if (!live) continue;
    // every thread of the group computed the same scale: decode locally
    const float tsr = (FMT == kNVFP4 && p.two_level) ? ts[(chunk * kChunk) / p.K] : 0.f;
    decode_chunk<FMT>(c, sb, z, tsr, p, table, v);
    L::store(y + chunk * kChunk, v);
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

int grid_for(int64_t n_chunks) {
  static int sms = [] {
    int dev = 0, n = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n > 0 ? n : 132;
  }();
  const int64_t ctas = (n_chunks + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * 4 * 8;  // 8 waves of 2048 threads/SM
  return static_cast<int>(ctas < cap ? ctas : cap);
}

Params make_params(const Problem& p) {
  Params q;
  q.n_chunks = p.R * p.K / kChunk;
  q.K = p.K;
  q.nb = p.nb;
  q.bs = static_cast<int>(p.bs);
  q.G = static_cast<int>(p.bs / kChunk);
  q.two_level = p.two_level;
  q.rceil = p.rceil;
  q.st = p.scale_type;
  return q;
}

// The CUDA kernels need block_size = 8 * G with G a power of two <= 512 (the Python
// lowering sends other INT4 group sizes to the reference path).
ffi::Error check_cuda_block(const std::string& where, const Problem& p) {
  const int64_t g = p.bs / kChunk;
  if (p.bs % kChunk != 0 || g < 1 || g > kThreads || (g & (g - 1)) != 0)
    return invalid(where, "the CUDA kernels need block_size = 8 * 2^k <= 4096, got " +
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
    case ffi::DataType::F32: return f(Io<float>{});
    case ffi::DataType::BF16: return f(Io16<true>{});
    case ffi::DataType::F16: return f(Io16<false>{});
    default: return ffi::Error::InvalidArgument("jax_fp4: unsupported dtype");
  }
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                        ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::AnyBuffer> zeros, int32_t fmt, int64_t block_size,
                        int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_quantize_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, *codes, *scales, *zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  const Params q = make_params(p);
  if (q.n_chunks == 0) return ffi::Error::Success();
  const int sb = scale_bytes(p);
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      quantize_kernel<decltype(F)::value, LT><<<grid_for(q.n_chunks), kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<uint8_t*>(codes->untyped_data()), scales->untyped_data(),
          static_cast<uint8_t*>(zeros->untyped_data()), q, sb);
      return launched(where);
    });
  });
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
  const Params q = make_params(p);
  if (q.n_chunks == 0) return ffi::Error::Success();
  const int sb = scale_bytes(p);
  return with_fmt(fmt, [&](auto F) {
    return with_io(y->element_type(), [&](auto L) {
      using LT = decltype(L);
      dequantize_kernel<decltype(F)::value, LT><<<grid_for(q.n_chunks), kThreads, 0, stream>>>(
          static_cast<const uint8_t*>(codes.untyped_data()), scales.untyped_data(),
          static_cast<const uint8_t*>(zeros.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<typename LT::storage*>(y->untyped_data()), q, sb);
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
  const Params q = make_params(p);
  if (q.n_chunks == 0) return ffi::Error::Success();
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      fake_quantize_kernel<decltype(F)::value, LT><<<grid_for(q.n_chunks), kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<typename LT::storage*>(y->untyped_data()), q);
      return launched(where);
    });
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV1Cuda, jf4::cuda::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"));

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
                                  .Attr<int32_t>("two_level"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FakeQuantizeV1Cuda, jf4::cuda::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"));
