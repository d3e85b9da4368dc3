// CUDA FFI handler for the fused W4A16 matmul (csrc/README.md: jax_fp4_wmatmul_v1).
//
//   partial[z, m, n] = sum_{k in split z} x[m, k] * w[n, k]
//
// x (M, K) bf16/f16; w (N, K) a 4-bit QArray blocked along K (nvfp4 with or without the
// per-tensor scale, mxfp4, nf4, bnb_fp4, int4); partial (S, M, N) float32, summed over
// the S K-splits by the caller (jax_fp4/primitives.py). Each weight element is decoded
// exactly as the reference does it (float32 value, rounded to x's dtype to nearest even)
// inside the main loop -- no dequantized weight reaches HBM -- and multiplied on the
// tensor cores (mma.sync m16n8k16, float32 accumulation).
//
// Tiling. The weight plays the MMA's A operand (16 rows x 16 k, row-major = (N, K)
// storage) and the activations its B operand (16 k x 8 m), so decode (M = 1..64) uses the
// tensor cores at any M. A CTA is 4 warps; each warp owns 2 tiles of 16 weight rows and
// all M of its CTA (up to 64: grid.y covers larger M). The K loop runs in super-steps of
// 128 k in which lane (g, t) = (lane / 4, lane % 4) owns the 32 contiguous k
// [32t, 32t + 32) of weight rows g and g + 8: one 16-byte load per row, whole 32-byte
// sectors per 4 lanes. The MMA sums over k, so any k order works if A and B agree: in
// MMA step s (0..7) lane (g, t) feeds logical k {2t, 2t+1, 2t+8, 2t+9} from physical k
// 32t + 4s + {0, 1, 2, 3}. Activations are staged per super-step in shared memory in
// that order (one conflict-free 16-byte read per lane per 2 MMA steps), zero-filled past
// M and K. The next super-step's weight codes and scales are loaded before the current
// one is decoded (register double buffer). That is the staged kernel (M > 16); decode
// sizes (M <= 16) run the direct kernel below: see its comment. grid.z splits K so that small-N shapes still
// fill the GPU; the S partial sums leave as float32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../codecs.h"
#include "../cpu/validate.h"
#include "../ffi_util.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
using cpu::Problem;
using cpu::validate_problem;
using cpu::validate_quantized;
using cpu::validate_ts;
namespace {

constexpr int kWarps = 4;                             // warps per CTA
constexpr int kRowTiles = 2;                          // 16-row weight tiles per warp
constexpr int kRowsPerCta = kWarps * kRowTiles * 16;  // 128
constexpr int kStepK = 128;                           // k per super-step
constexpr int kXStride = 320;  // bytes per staged activation row: 256 + 64 (no bank conflicts)

struct WParams {
  int64_t M, N, K;
  int64_t nb;              // scale blocks per weight row
  int bs;                  // block size: a power of two >= 16
  int bs_shift;            // log2(bs)
  int64_t n_steps;         // ceil(K / step): step = 128 k (staged) or 1024 k (direct)
  int64_t steps_per_split;
  int two_level;
  int st;                  // INT4 scale storage type
};

// Raw bits of one weight row's K-chunk (32 elements) for one super-step.
struct Chunk {
  uint4 q;           // 32 codes, element 2i in the low nibble of byte i
  uint32_t s0, s1;   // scale bits of the chunk's first / second 16 (bs == 16) elements
  uint32_t z0, z1;   // INT4 zero points
};

template <int FMT>
__device__ float code_value(uint32_t c) {
  if constexpr (FMT == kINT4) return static_cast<float>(c);
  else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) return Codebook<FMT>::value(c);
  else return e2m1_decode(c);
}

template <int FMT>
__device__ uint32_t load_scale_bits(const void* scales, int64_t i, int st) {
  if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
    return f2u(__ldg(static_cast<const float*>(scales) + i));
  } else if constexpr (FMT == kINT4) {
    if (st == kScaleF32) return f2u(__ldg(static_cast<const float*>(scales) + i));
    return __ldg(static_cast<const unsigned short*>(scales) + i);
  } else {
    return __ldg(static_cast<const uint8_t*>(scales) + i);
  }
}

// The block scale in float32, as the reference decodes it (DESIGN.md section 3).
template <int FMT>
__device__ float scale_value(uint32_t bits, float ts, const WParams& p) {
  if constexpr (FMT == kNVFP4) {
    const float s = e4m3_decode(bits);
    return p.two_level ? __fmul_rn(ts, s) : s;
  } else if constexpr (FMT == kMXFP4) {
    return e8m0_decode(bits);
  } else if constexpr (FMT == kINT4) {
    return scale_from_bits(bits, p.st);
  } else {
    return u2f(bits);
  }
}

template <int FMT>
__device__ void load_chunk(Chunk& c, const uint8_t* __restrict__ codes,
                           const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
                           int64_t row, int64_t k, const WParams& p) {
  if (k >= p.K) {  // past K: never decoded (the lane's A fragment is zeroed)
    c.q = make_uint4(0, 0, 0, 0);
    c.s0 = c.s1 = c.z0 = c.z1 = 0;
    return;
  }
  c.q = __ldg(reinterpret_cast<const uint4*>(codes + row * (p.K >> 1) + (k >> 1)));
  const int64_t b = row * p.nb + (k >> p.bs_shift);
  c.s0 = load_scale_bits<FMT>(scales, b, p.st);
  c.s1 = p.bs == 16 ? load_scale_bits<FMT>(scales, b + 1, p.st) : c.s0;
  if constexpr (FMT == kINT4) {
    c.z0 = __ldg(zeros + b);
    c.z1 = p.bs == 16 ? __ldg(zeros + b + 1) : c.z0;
  } else {
    c.z0 = c.z1 = 0;
  }
}

template <bool BF16>
__device__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Two weight elements (one code byte) -> x-dtype pair: (v - z) * s in float32, rounded.
template <int FMT, bool BF16>
__device__ uint32_t decode_pair(const float2* table, uint32_t byte, float s, float z) {
  const float2 v = table[byte];
  float lo = v.x, hi = v.y;
  if constexpr (FMT == kINT4) {
    lo = __fsub_rn(lo, z);
    hi = __fsub_rn(hi, z);
  }
  return pack2<BF16>(__fmul_rn(lo, s), __fmul_rn(hi, s));
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

__device__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// MT: 8-row activation tiles per CTA (M chunk = 8 * MT).
template <int FMT, bool BF16, int MT>
__global__ void __launch_bounds__(kWarps * 32) wmatmul_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, float* __restrict__ out, const WParams p) {
  constexpr int MC = 8 * MT;
  __shared__ float2 table[256];  // byte -> (value of low nibble, value of high nibble)
  __shared__ __align__(16) uint8_t xs[MC * kXStride];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  for (int i = tid; i < 256; i += kWarps * 32)
    table[i] = make_float2(code_value<FMT>(i & 15), code_value<FMT>(i >> 4));

  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MC;
  const int64_t n_warp = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp * kRowTiles * 16;
  // rows [rt][h]: g (+8 for h = 1) of tile rt; loads clamp to the last row, stores skip
  int64_t rows[kRowTiles][2];
  float tsv[kRowTiles][2];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n_warp + rt * 16 + h * 8 + g;
      rows[rt][h] = n < p.N ? n : p.N - 1;
      tsv[rt][h] = p.two_level ? __ldg(ts + rows[rt][h]) : 1.0f;
    }

  const int64_t step_begin = static_cast<int64_t>(blockIdx.z) * p.steps_per_split;
  int64_t step_end = step_begin + p.steps_per_split;
  if (step_end > p.n_steps) step_end = p.n_steps;

  float acc[kRowTiles][MT][4];
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[rt][j][e] = 0.0f;

  Chunk next[kRowTiles][2];
  if (step_begin < step_end) {
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        load_chunk<FMT>(next[rt][h], codes, scales, zeros, rows[rt][h],
                        step_begin * kStepK + 32 * t, p);
  }

  for (int64_t step = step_begin; step < step_end; ++step) {
    Chunk cur[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) cur[rt][h] = next[rt][h];

    const int64_t k0 = step * kStepK;
    __syncthreads();  // every warp is done reading the previous super-step's activations
    for (int i = tid; i < MC * 16; i += kWarps * 32) {
      const int m = i >> 4, piece = i & 15;  // piece = 8 elements = physical (t, s2)
      const int64_t gm = m0 + m, k = k0 + 8 * piece;
      const bool valid = gm < p.M && k < p.K;
      cp_async16(xs + m * kXStride + (piece & 3) * 64 + (piece >> 2) * 16,
                 valid ? static_cast<const void*>(x + gm * p.K + k) : x, valid);
    }
    asm volatile("cp.async.commit_group;\n" ::);
    if (step + 1 < step_end) {
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          load_chunk<FMT>(next[rt][h], codes, scales, zeros, rows[rt][h],
                          (step + 1) * kStepK + 32 * t, p);
    }
    asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();

    const bool kvalid = k0 + 32 * t < p.K;
    float s[kRowTiles][2][2], z[kRowTiles][2][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[rt][h][0] = scale_value<FMT>(cur[rt][h].s0, tsv[rt][h], p);
        s[rt][h][1] = scale_value<FMT>(cur[rt][h].s1, tsv[rt][h], p);
        z[rt][h][0] = static_cast<float>(cur[rt][h].z0);
        z[rt][h][1] = static_cast<float>(cur[rt][h].z1);
      }

#pragma unroll
    for (int s2 = 0; s2 < 4; ++s2) {  // physical elements [8 s2, 8 s2 + 8) = MMA steps 2s2, 2s2+1
      uint32_t a[kRowTiles][2][4];
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t w = s2 == 0 ? cur[rt][h].q.x
                             : s2 == 1 ? cur[rt][h].q.y
                             : s2 == 2 ? cur[rt][h].q.z
                                       : cur[rt][h].q.w;
          const float sc = s[rt][h][s2 >> 1], zz = z[rt][h][s2 >> 1];
          // byte b holds physical elements 8 s2 + 2b, +1
          a[rt][0][h] = decode_pair<FMT, BF16>(table, w & 0xffu, sc, zz);
          a[rt][0][2 + h] = decode_pair<FMT, BF16>(table, (w >> 8) & 0xffu, sc, zz);
          a[rt][1][h] = decode_pair<FMT, BF16>(table, (w >> 16) & 0xffu, sc, zz);
          a[rt][1][2 + h] = decode_pair<FMT, BF16>(table, w >> 24, sc, zz);
          if (!kvalid) a[rt][0][h] = a[rt][0][2 + h] = a[rt][1][h] = a[rt][1][2 + h] = 0u;
        }
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const uint4 b = *reinterpret_cast<const uint4*>(xs + (8 * j + g) * kXStride + s2 * 64 + t * 16);
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt) {
          mma16816<BF16>(acc[rt][j], a[rt][0], b.x, b.y);
          mma16816<BF16>(acc[rt][j], a[rt][1], b.z, b.w);
        }
      }
    }
  }

  // D fragment: lane (g, t) holds rows (weight n) g / g + 8, columns (activation m) 2t, 2t+1
  float* o = out + static_cast<int64_t>(blockIdx.z) * p.M * p.N;
#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n_warp + rt * 16 + h * 8 + g;
      if (n >= p.N) continue;
#pragma unroll
      for (int j = 0; j < MT; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t m = m0 + 8 * j + 2 * t + e;
          if (m < p.M) o[m * p.N + n] = acc[rt][j][2 * h + e];
        }
    }
}

// M <= 16 ("decode"): one 16-row weight tile per warp and super-steps of kDirectL x 128 k,
// so that each weight row is read in runs of kDirectL x 64 contiguous bytes issued
// back to back (HBM pages stay open; 64-byte runs per row measured at ~17% of the copy
// roof). Chunk j of lane (g, t) is physical k [128 j + 32 t, +32) of rows g and g + 8;
// all 2 x kDirectL code loads of a step are in flight before the first decode. The
// activation fragments come straight from global memory (L1-resident), no barriers.
constexpr int kDirectL = 8;
constexpr int kDirectWarps = 4;
constexpr int kDirectRowsPerCta = kDirectWarps * 16;  // 64
constexpr int kDirectStepK = 128 * kDirectL;        // 1024

template <int FMT, bool BF16, int MT>
__global__ void __launch_bounds__(kDirectWarps * 32, 3) wmatmul_direct_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, float* __restrict__ out, const WParams p) {
  __shared__ float2 table[256];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  for (int i = tid; i < 256; i += kDirectWarps * 32)
    table[i] = make_float2(code_value<FMT>(i & 15), code_value<FMT>(i >> 4));
  __syncthreads();

  const int64_t n_tile = static_cast<int64_t>(blockIdx.x) * kDirectRowsPerCta + warp * 16;
  int64_t rows[2];
  float tsv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n_tile + h * 8 + g;
    rows[h] = n < p.N ? n : p.N - 1;
    tsv[h] = p.two_level ? __ldg(ts + rows[h]) : 1.0f;
  }
  const int64_t step_begin = static_cast<int64_t>(blockIdx.z) * p.steps_per_split;
  int64_t step_end = step_begin + p.steps_per_split;
  if (step_end > p.n_steps) step_end = p.n_steps;

  float acc[MT][4];
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;

  for (int64_t step = step_begin; step < step_end; ++step) {
    const int64_t k0 = step * kDirectStepK + 32 * t;
    Chunk c[2][kDirectL];
#pragma unroll
    for (int j = 0; j < kDirectL; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        load_chunk<FMT>(c[h][j], codes, scales, zeros, rows[h], k0 + 128 * j, p);

#pragma unroll
    for (int j = 0; j < kDirectL; ++j) {
      if (step * kDirectStepK + 128 * j >= p.K) break;  // warp-uniform: the MMAs need all lanes
      const int64_t kj = k0 + 128 * j;
      const bool kvalid = kj < p.K;  // lanes past K feed zeros (A and B)
      uint4 xd[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int s2 = 0; s2 < 4; ++s2) {
          const int64_t m = 8 * mt + g;
          xd[mt][s2] = m < p.M && kvalid
                           ? __ldg(reinterpret_cast<const uint4*>(x + m * p.K + kj + 8 * s2))
                           : make_uint4(0, 0, 0, 0);
        }
      float sc[2][2], zz[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[h][0] = scale_value<FMT>(c[h][j].s0, tsv[h], p);
        sc[h][1] = scale_value<FMT>(c[h][j].s1, tsv[h], p);
        zz[h][0] = static_cast<float>(c[h][j].z0);
        zz[h][1] = static_cast<float>(c[h][j].z1);
      }
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2) {
        uint32_t a[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t w = s2 == 0 ? c[h][j].q.x : s2 == 1 ? c[h][j].q.y
                             : s2 == 2 ? c[h][j].q.z : c[h][j].q.w;
          const float scv = sc[h][s2 >> 1], zv = zz[h][s2 >> 1];
          a[0][h] = decode_pair<FMT, BF16>(table, w & 0xffu, scv, zv);
          a[0][2 + h] = decode_pair<FMT, BF16>(table, (w >> 8) & 0xffu, scv, zv);
          a[1][h] = decode_pair<FMT, BF16>(table, (w >> 16) & 0xffu, scv, zv);
          a[1][2 + h] = decode_pair<FMT, BF16>(table, w >> 24, scv, zv);
          if (!kvalid) a[0][h] = a[0][2 + h] = a[1][h] = a[1][2 + h] = 0u;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<BF16>(acc[mt], a[0], xd[mt][s2].x, xd[mt][s2].y);
          mma16816<BF16>(acc[mt], a[1], xd[mt][s2].z, xd[mt][s2].w);
        }
      }
    }
  }

  float* o = out + static_cast<int64_t>(blockIdx.z) * p.M * p.N;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n_tile + h * 8 + g;
    if (n >= p.N) continue;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t m = 8 * mt + 2 * t + e;
        if (m < p.M) o[m * p.N + n] = acc[mt][2 * h + e];
      }
  }
}

// M <= 16: the direct kernel; larger M: the staged kernel, 64 rows of x per grid.y.
bool direct_path(int64_t M) { return M <= 16; }
int64_t step_k(int64_t M) { return direct_path(M) ? kDirectStepK : kStepK; }

template <int FMT, bool BF16>
ffi::Error launch_fmt(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& codes,
                      const ffi::AnyBuffer& scales, const ffi::AnyBuffer& zeros,
                      const ffi::AnyBuffer& ts, float* out, const WParams& p, int splits) {
  const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
  const auto* cp = static_cast<const uint8_t*>(codes.untyped_data());
  const auto* zp = static_cast<const uint8_t*>(zeros.untyped_data());
  const auto* tp = static_cast<const float*>(ts.untyped_data());
  const void* sp = scales.untyped_data();
  if (direct_path(p.M)) {
    const dim3 grid(static_cast<unsigned>((p.N + kDirectRowsPerCta - 1) / kDirectRowsPerCta), 1,
                    static_cast<unsigned>(splits));
    if (p.M <= 8)
      wmatmul_direct_kernel<FMT, BF16, 1><<<grid, kDirectWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_direct_kernel<FMT, BF16, 2><<<grid, kDirectWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  } else {
    const int mt = p.M <= 32 ? 4 : 8;
    const dim3 grid(static_cast<unsigned>((p.N + kRowsPerCta - 1) / kRowsPerCta),
                    static_cast<unsigned>((p.M + 8 * mt - 1) / (8 * mt)),
                    static_cast<unsigned>(splits));
    if (mt == 4)
      wmatmul_kernel<FMT, BF16, 4><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_kernel<FMT, BF16, 8><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_fp4_wmatmul_v1 (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

template <bool BF16>
ffi::Error launch(int fmt, cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& codes,
                  const ffi::AnyBuffer& scales, const ffi::AnyBuffer& zeros,
                  const ffi::AnyBuffer& ts, float* out, const WParams& p, int splits) {
  switch (fmt) {
    case kNVFP4: return launch_fmt<kNVFP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits);
    case kMXFP4: return launch_fmt<kMXFP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits);
    case kNF4: return launch_fmt<kNF4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits);
    case kBNB_FP4: return launch_fmt<kBNB_FP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits);
    default: return launch_fmt<kINT4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits);
  }
}

ffi::Error WMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                       ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer ts,
                       ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t block_size,
                       int32_t two_level, int64_t splits) {
  const std::string where = "jax_fp4_wmatmul_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(check_dtype(where, "x", x.element_type(),
                                  {ffi::DataType::BF16, ffi::DataType::F16}));
  if (x.dimensions().size() != 2)
    return invalid(where, "buffer `x` must be 2-D (M, K), got shape " + dims_str(x.dimensions()));
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  if (fmt != kNVFP4 && fmt != kMXFP4 && fmt != kNF4 && fmt != kBNB_FP4 && fmt != kINT4)
    return invalid(where, "attribute `fmt` = " + std::to_string(fmt) +
                              " has no fused kernel (nvfp4, mxfp4, nf4, bnb_fp4, int4 only)");
  if (codes.dimensions().size() != 2)
    return invalid(where, "buffer `codes` must be 2-D (N, K/2), got shape " + dims_str(codes.dimensions()));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, 0, two_level,
                                       codes.dimensions()[0], K, &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  if (K % 32 != 0 || block_size < 16 || (block_size & (block_size - 1)) != 0)
    return invalid(where, "the fused kernel needs K % 32 == 0 and a power-of-two block_size >= "
                          "16, got K = " + std::to_string(K) + ", block_size = " +
                              std::to_string(block_size));
  const int64_t n_steps = (K + step_k(M) - 1) / step_k(M);
  if (splits < 1 || splits > 65535 || (n_steps > 0 && splits > n_steps))
    return invalid(where, "attribute `splits` = " + std::to_string(splits) +
                              " must be in [1, min(65535, ceil(K / " + std::to_string(step_k(M)) +
                              "))]");
  JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(), {ffi::DataType::F32}));
  JF4_RETURN_IF_ERROR(check_shape(where, "out", out->dimensions(), {splits, M, p.R}));
  if (M == 0 || p.R == 0) return ffi::Error::Success();
  if (K == 0) {
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0,
                                          static_cast<size_t>(splits * M * p.R) * sizeof(float), stream);
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(where + ": " + cudaGetErrorString(e));
  }
  WParams w;
  w.M = M;
  w.N = p.R;
  w.K = K;
  w.nb = p.nb;
  w.bs = static_cast<int>(block_size);
  w.bs_shift = 0;
  while ((int64_t{1} << w.bs_shift) < block_size) ++w.bs_shift;
  w.n_steps = n_steps;
  w.steps_per_split = (n_steps + splits - 1) / splits;
  w.two_level = p.two_level;
  w.st = p.scale_type;
  float* o = static_cast<float*>(out->untyped_data());
  return x.element_type() == ffi::DataType::BF16
             ? launch<true>(fmt, stream, x, codes, scales, zeros, ts, o, w, static_cast<int>(splits))
             : launch<false>(fmt, stream, x, codes, scales, zeros, ts, o, w, static_cast<int>(splits));
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4WMatmulV1Cuda, jf4::cuda::WMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x (M, K) bf16/f16
                                  .Arg<ffi::AnyBuffer>()  // codes (N, K/2) u8
                                  .Arg<ffi::AnyBuffer>()  // scales (N, K/bs)
                                  .Arg<ffi::AnyBuffer>()  // zeros (N, K/bs) u8 or (0,)
                                  .Arg<ffi::AnyBuffer>()  // ts (N,) f32
                                  .Ret<ffi::AnyBuffer>()  // partial sums (S, M, N) f32
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("two_level")
                                  .Attr<int64_t>("splits"));
