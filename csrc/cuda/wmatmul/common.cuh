// W4A16 kernels (launch.h): device helpers shared by the mma.sync and wgmma kernels: the
// table sizes, a weight row's chunk of codes / scale bits (Chunk, Rows), the weight loads
// (read once: no L1 allocation; zero without touching memory when out of bounds), packed
// bf16 / f16 arithmetic (one rounding per operation), the per-tensor scales and the
// output stores. Device code in an anonymous namespace (see launch.h).
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_COMMON_CUH_
#define JAX_FP4_CSRC_CUDA_WMATMUL_COMMON_CUH_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../../codecs.h"
#include "launch.h"

namespace jf4 {
namespace cuda {
namespace {

constexpr int kXStride = 320;  // bytes per staged activation row: 256 + 64 (no bank conflicts)
constexpr int kCopies = 16;    // pair-table copies (direct kernel, wgmma at BN = 32 / 64,
                               // wg_copies): lane l reads copy l % 16, which lies in bank
                               // pair l % 16: conflict-free
constexpr int kWideCopies = 32;  // wide pair-table copies (wgmma kernel, wg_copies): lane l
                                 // reads copy l, 256-byte rows addressed by one PRMT
constexpr int kLaneTable = 0;  // `COPIES` of the lane table (see decode_word): where
                               // shared memory, not instructions, bounds the decode

// Raw bits of one weight row's K-chunk (32 elements).
struct Chunk {
  uint4 q;       // 32 codes, element 2i in the low nibble of byte i
  uint32_t s;    // scale bits: nvfp4 / mxfp4 = the E4M3 / E8M0 bytes of the chunk's first and
                 // second 16 elements in bytes 0 and 1; other formats = the first 16's scale
  uint32_t s1;   // INT4: the second 16's scale (= s unless block_size == 16)
  uint32_t z;    // INT4 zero points: first 16 in bits 0-7, second 16 in bits 8-15
};

// The weight rows a lane loads: rows n0 + 8 i (i = 2 * tile + half) as base pointers of
// row n0 plus a stride of 8 rows (32-bit offsets within a row: K < 2^31). Rows past N are
// not loaded (their chunks are zero) and not stored.
struct Rows {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* zeros;
  int64_t code_stride, scale_stride, zero_stride;  // bytes per 8 rows
  int64_t n0;
};

// The super-steps [begin, end) of this CTA's K-split (grid.z).
__device__ __forceinline__ void split_steps(const WParams& p, int* begin, int* end) {
  *begin = static_cast<int>(blockIdx.z * p.steps_per_split);
  *end = static_cast<int>(min(*begin + p.steps_per_split, p.n_steps));
}

template <int FMT>
__device__ float code_value(uint32_t c) {
  if constexpr (FMT == kINT4) return static_cast<float>(c);
  else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) return Codebook<FMT>::value(c);
  else return e2m1_decode(c);
}

// Weight loads: codes, scales and zero points are read once, so they do not allocate in
// L1 (ld.global.nc.L1::no_allocate), which keeps L1 for the activations that every warp of
// the SM re-reads. `valid` false gives 0 without touching memory. The 16-byte code loads
// ask L2 to fetch the whole 128-byte line (PTX .L2::128B prefetch size): the wgmma kernel
// reads 64 bytes of a row per step, and the line brings the next step's half with it
// (the direct kernel reads whole lines anyway; benchmarks/log/NOTES.md).
template <bool CHECK>  // CHECK = false: the caller knows the load is in bounds
__device__ __forceinline__ uint4 ld_weight16(const void* ptr, bool valid) {
  uint4 v;
  if constexpr (CHECK)
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
        " mov.b32 %0, 0; mov.b32 %1, 0; mov.b32 %2, 0; mov.b32 %3, 0;\n"
        " @p ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(ptr), "r"(static_cast<int>(valid)));
  else
    asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
  return v;
}

#define JF4_LD_WEIGHT(TYPE)                                                               \
  if constexpr (CHECK)                                                                    \
    asm("{\n .reg .pred p;\n setp.ne.b32 p, %2, 0;\n mov.b32 %0, 0;\n"                   \
        " @p ld.global.nc.L1::no_allocate." TYPE " %0, [%1];\n}\n"                         \
        : "=r"(v) : "l"(ptr), "r"(static_cast<int>(valid)));                             \
  else                                                                                    \
    asm("ld.global.nc.L1::no_allocate." TYPE " %0, [%1];\n" : "=r"(v) : "l"(ptr));

template <int BYTES, bool CHECK>  // 1, 2 or 4 bytes, zero-extended
__device__ __forceinline__ uint32_t ld_weight(const void* ptr, bool valid) {
  uint32_t v;
  if constexpr (BYTES == 4) {
    JF4_LD_WEIGHT("b32")
  } else if constexpr (BYTES == 2) {
    JF4_LD_WEIGHT("u16")
  } else {
    JF4_LD_WEIGHT("u8")
  }
  return v;
}
#undef JF4_LD_WEIGHT

// The block scale in float32, as the reference decodes it (docs/spec.md section 3), for the
// table path (NVFP4 and MXFP4 always take their bit path, use_bit_path).
template <int FMT>
__device__ float scale_value(uint32_t bits, const WParams& p) {
  static_assert(kHasTablePath<FMT>, "NVFP4 and MXFP4 decode by their bit path");
  if constexpr (FMT == kINT4) {
    return scale_from_bits(bits, p.st);
  } else {
    return u2f(bits);
  }
}

// Bytes per stored block scale.
template <int FMT>
__host__ __device__ __forceinline__ int scale_bytes(const WParams& p) {
  return FMT == kNF4 || FMT == kBNB_FP4 ? 4 : FMT == kINT4 ? (p.st == kScaleF32 ? 4 : 2) : 1;
}

template <int FMT>
__device__ __forceinline__ Rows make_rows(const uint8_t* codes, const void* scales,
                                          const uint8_t* zeros, int64_t n0, const WParams& p) {
  const int64_t esize = scale_bytes<FMT>(p);
  Rows r;
  r.codes = codes + n0 * (p.K >> 1);
  r.scales = static_cast<const uint8_t*>(scales) + n0 * p.nb * esize;
  r.zeros = FMT == kINT4 ? zeros + n0 * p.nb : zeros;
  r.code_stride = 8 * (p.K >> 1);
  r.scale_stride = 8 * p.nb * esize;
  r.zero_stride = 8 * p.nb;
  r.n0 = n0;
  return r;
}

// Chunks past K (valid = false) load as zeros (codes 0 and scale bits 0 decode to a
// finite value), and the activations there are zero, so they add nothing.
// CHECK = false: the caller knows the chunk is inside K and the row inside N. CODES =
// false: the scales (and zero points) only; the caller fills c.q (wgmma kernel: from the
// stage the tensor memory accelerator filled).
template <int N>
using Bytes = std::integral_constant<int, N>;

// The scale (and zero-point) bits of a chunk whose first block is block b of its row:
// ld_s(Bytes<n>, offset) / ld_z(Bytes<n>, offset) read n bytes at a byte offset into the
// row's scales / zero points, from global memory or from a stage's scale box. `two`:
// the chunk's second 16 elements have their own block (INT4 with block_size 16).
template <int FMT, int BITS, class LdS, class LdZ>
__device__ __forceinline__ void chunk_scales(Chunk& c, LdS ld_s, LdZ ld_z, int b, bool two,
                                             const WParams& p) {
  c.s1 = c.z = 0;
  if constexpr (FMT == kNVFP4) {  // blocks of 16: both E4M3 scales in one 2-byte load
    c.s = ld_s(Bytes<2>{}, b);
  } else if constexpr (FMT == kMXFP4) {  // blocks of 32: one E8M0 scale
    c.s = ld_s(Bytes<1>{}, b) * 0x101u;
  } else if constexpr (FMT == kINT4) {
    if (BITS || p.st != kScaleF32) {  // the bit path has 16-bit scales
      c.s = ld_s(Bytes<2>{}, 2 * b);
      c.s1 = two ? ld_s(Bytes<2>{}, 2 * b + 2) : c.s;
    } else {
      c.s = ld_s(Bytes<4>{}, 4 * b);
      c.s1 = two ? ld_s(Bytes<4>{}, 4 * b + 4) : c.s;
    }
    const uint32_t z0 = ld_z(Bytes<1>{}, b);
    c.z = z0 | ((two ? ld_z(Bytes<1>{}, b + 1) : z0) << 8);
  } else {
    c.s = ld_s(Bytes<4>{}, 4 * b);
  }
}

template <int FMT, int BITS, bool CHECK = true, bool CODES = true>
__device__ __forceinline__ void load_chunk(Chunk& c, const Rows& rs, int i, int k, bool kvalid,
                                           const WParams& p) {
  const bool valid = !CHECK || (kvalid && rs.n0 + 8 * i < p.N);
  const uint8_t* scales = rs.scales + i * rs.scale_stride;
  const uint8_t* zeros = rs.zeros + i * rs.zero_stride;
  if constexpr (CODES) c.q = ld_weight16<CHECK>(rs.codes + i * rs.code_stride + (k >> 1), valid);
  chunk_scales<FMT, BITS>(
      c, [&](auto n, int off) { return ld_weight<decltype(n)::value, CHECK>(scales + off, valid); },
      [&](auto n, int off) { return ld_weight<decltype(n)::value, CHECK>(zeros + off, valid); },
      k >> p.bs_shift, valid && p.bs == 16, p);
}

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
}

// Packed bf16x2 / f16x2 arithmetic on raw 32-bit registers.
template <bool BF16, class Op>
__device__ __forceinline__ uint32_t packed2(uint32_t a, uint32_t b, Op op) {
  using T = std::conditional_t<BF16, __nv_bfloat162, __half2>;
  const T r = op(*reinterpret_cast<const T*>(&a), *reinterpret_cast<const T*>(&b));
  return *reinterpret_cast<const uint32_t*>(&r);
}
template <bool BF16>
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  return packed2<BF16>(a, b, [](auto x, auto y) { return __hmul2(x, y); });
}
template <bool BF16>
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  return packed2<BF16>(a, b, [](auto x, auto y) { return __hsub2(x, y); });
}
template <bool BF16>
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {  // a b + c, one rounding
  return packed2<BF16>(a, b, [c](auto x, auto y) {
    return __hfma2(x, y, *reinterpret_cast<const decltype(x)*>(&c));
  });
}


// Accumulators start at zero.
template <int N>
__device__ __forceinline__ void zero(float* a) {
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = 0.0f;
}

// The per-tensor scale of each of a lane's rows n0 + 16 rt + 8 h, rt < TILES (1 without
// one). NVFP4's decode leaves it out (every format decodes on its bit path or table
// without it): the epilogue multiplies the float32 accumulator by it, which the W4A16
// tolerance contract allows (docs/spec.md) and which keeps the decode one multiply per pair.
template <int TILES = kRowTiles>
__device__ __forceinline__ void load_tensor_scales(const float* __restrict__ ts, int64_t n0,
                                                   const WParams& p, float (*tsv)[2]) {
#pragma unroll
  for (int rt = 0; rt < TILES; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + rt * 16 + h * 8;
      tsv[rt][h] = p.two_level ? __ldg(ts + (p.ts_stride ? (n < p.N ? n : p.N - 1) : 0)) : 1.0f;
    }
}

// out[o] = v as float32 or rounded to x's dtype (p.out_f32).
template <bool BF16>
__device__ __forceinline__ void store_out(void* out, int64_t o, float v, const WParams& p) {
  if (p.out_f32)
    static_cast<float*>(out)[o] = v;
  else
    static_cast<uint16_t*>(out)[o] = static_cast<uint16_t>(pack2<BF16>(v, 0.0f) & 0xffffu);
}

// out[o .. o + 3] = v (o a multiple of 4: 16 / 8-byte aligned in XLA's buffers).
template <bool BF16>
__device__ __forceinline__ void store_out4(void* out, int64_t o, float4 v, const WParams& p) {
  if (p.out_f32)
    *reinterpret_cast<float4*>(static_cast<float*>(out) + o) = v;
  else
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(out) + o) =
        make_uint2(pack2<BF16>(v.x, v.y), pack2<BF16>(v.z, v.w));
}

// D fragment: lane (g, t) holds rows (weight n) g / g + 8, columns (activation m) 2t, 2t+1.
// scale: the decode's folded factor (kAccScale); rs[h]: row g + 8 h's per-tensor scale.
template <bool BF16, int MT>
__device__ __forceinline__ void store_tile(void* out, const float (*acc)[4], float scale,
                                           const float* rs, int64_t n0, int64_t m0, int g,
                                           int t, const WParams& p) {
  const int64_t z_off = static_cast<int64_t>(blockIdx.z) * p.M * p.N;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t n = n0 + h * 8 + g;
    if (n >= p.N) continue;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t m = m0 + 8 * mt + 2 * t + e;
        if (m < p.M) store_out<BF16>(out, z_off + m * p.N + n, acc[mt][2 * h + e] * scale * rs[h], p);
      }
  }
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_COMMON_CUH_
