// CUDA FFI handlers for the fused W4A16 matmul (csrc/README.md: jax_fp4_wmatmul_v3, v2, v1).
//
//   partial[z, m, n] = sum_{k in split z} x[m, k] * w[n, k]
//
// x (M, K) bf16/f16; w (N, K) a 4-bit QArray blocked along K (nvfp4 with or without the
// per-tensor scale, mxfp4, nf4, bnb_fp4, int4); partial (S, M, N) float32, summed over
// the S K-splits by the caller (jax_fp4/primitives.py), or x's dtype when S = 1. Each
// weight element is decoded inside the main loop -- no dequantized weight reaches HBM --
// to the reference's value rounded once to x's dtype, except NVFP4's per-tensor scale,
// which multiplies the float32 accumulator instead (the W4A16 tolerance contract,
// docs/spec.md), and multiplied on the tensor cores (float32 accumulation). How it is
// decoded (bit path / table path) is described above decode_word.
//
// Tiling. The weight plays the MMA's A operand (16 rows x 16 k per warp, row-major =
// (N, K) storage) and the activations its B operand, so decode (M = 1) uses the tensor
// cores too. Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of each of its
// 16-row tiles. The MMA sums over k, so any k order works if A and B agree: a lane loads
// 32 contiguous k of a row as one 16-byte chunk and feeds them as its fragment's k
// slots; the activations are fed in the same order. Three kernels, see their comments:
// the direct kernel (mma.sync, M <= 16, x read from global memory), the staged kernel
// (mma.sync, M > 16, x staged in shared memory) and the wgmma kernel (sm_90a, chosen by
// the caller through `tile_m`, x pre-permuted by the caller and staged by the tensor
// memory accelerator). grid.z splits K so that small-N shapes still fill the GPU.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "../codecs.h"
#include "../cpu/validate.h"
#include "../ffi_util.h"
#include "handlers.h"
#include "wgmma.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
using cpu::Problem;
using cpu::validate_problem;
using cpu::validate_quantized;
using cpu::validate_ts;
namespace {

constexpr int kWarps = 4;                             // warps per CTA (both kernels)
constexpr int kRowTiles = 2;                          // 16-row weight tiles per warp
constexpr int kRowsPerCta = kWarps * kRowTiles * 16;  // 128
constexpr int kStepK = 128;                           // k per super-step (staged kernel)
constexpr int kXStride = 320;  // bytes per staged activation row: 256 + 64 (no bank conflicts)
constexpr int kCopies = 16;    // pair-table copies (direct kernel, wgmma at BN = 32 / 64,
                               // wg_copies): lane l reads copy l % 16, which lies in bank
                               // pair l % 16: conflict-free
constexpr int kWideCopies = 32;  // wide pair-table copies (wgmma kernel, wg_copies): lane l
                                 // reads copy l, 256-byte rows addressed by one PRMT
constexpr int kLaneTable = 0;  // `COPIES` of the lane table (see decode_word): where
                               // shared memory, not instructions, bounds the decode

struct WParams {
  int64_t M, N, K;
  int64_t x_rows;          // wgmma kernel: rows of x, M or M rounded up to tile_m (zero rows)
  int K32;                 // K as int (K < 2^31 is checked by the handler)
  int64_t nb;              // scale blocks per weight row
  int bs;                  // block size: a power of two >= 16
  int bs_shift;            // log2(bs)
  int64_t n_steps;         // ceil(K / step): step = 128 k (staged) or kDirectStepK (direct)
  int64_t steps_per_split;
  int two_level;           // NVFP4 with a per-tensor scale: applied to the accumulator
  int ts_stride;           // ts holds one scale per weight row (1) or one for all (0)
  int st;                  // INT4 scale storage type
  int out_f32;             // output float32 (else x's dtype: one split only)
  int scale_boxes;         // wgmma kernel: the scales come by TMA with the stages
  int stage_codes;         // wgmma kernel: a stage's codes come as one 3-D box (launch_wgmma)
  int tiled;               // wgmma kernel: codes and scales in the prepared layout (launch_wgmma
                           // picks the kernel instance)
  int tile_srow;           // prepared layout: scale bytes per row and 128-k step, and INT4's
  int tile_zrow;           // zero-point bytes (launch_wgmma; wg_tile_scale_row)
  int cluster;             // wgmma kernel at BN = 256: CTAs per cluster, 1 or 2 (x multicast)
  int split_reduce;        // wgmma kernel: the K-splits of a tile form one cluster along z and
                           // sum their partials in it (launch_wgmma); else one output per split
};

// The decode paths a format has (use_bit_path; described above decode_word).
template <int FMT>
constexpr bool kHasBitPath = FMT == kNVFP4 || FMT == kINT4 || FMT == kMXFP4;
template <int FMT>
constexpr bool kHasTablePath = FMT != kNVFP4 && FMT != kMXFP4;

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
// (nvfp4 8192 x 28672, M = 16: 83 -> 73 us; the direct kernel, which reads whole lines,
// and the scale loads did not change; benchmarks/log/NOTES.md).
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

// The kernels' BITS: 0 the table path, 1 the bit path, kBitsSplit INT4's bit path with the
// scale split in two bf16 factors (f16 scales, bf16 x).
constexpr int kBitsSplit = 2;
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
// of words. The mma.sync kernels always apply it (a vote and branch made them 0-3% slower:
// they are bound by their loads).
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

__device__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// Staged kernel (M > 16). MT: 8-row activation tiles per CTA (M chunk = 8 * MT).
// Lane (g, t) owns k [32t, 32t + 32) of weight rows g, g + 8 of each of its tiles per
// 128-k super-step; activations are staged per super-step in shared memory in the lane's
// fragment order (bit path: pair-permuted on the way), zero past M and K.
template <int FMT, bool BF16, int BITS, int MT>
__global__ void __launch_bounds__(kWarps * 32) wmatmul_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, void* __restrict__ out, const WParams p) {
  constexpr int MC = 8 * MT;
  // the lane table at its 2 KB alignment inside twice its size (alignment computed, not
  // left to __align__ on the static array)
  __shared__ __align__(16) float2 table_raw[BITS ? 1 : 2 * table_bytes<kLaneTable>() / 8];
  float2* table = align_shared(table_raw, kLaneTableAlign);
  __shared__ __align__(16) uint8_t xs[MC * kXStride];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = lane_table_base(table, lane);
  if constexpr (!BITS) fill_table<FMT, kLaneTable>(table, tid, kWarps * 32);

  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MC;
  const int64_t n_warp = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp * kRowTiles * 16;
  // rows [rt][h]: g (+8 for h = 1) of tile rt; rows past N are neither loaded nor stored
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp + g, p);
  float tsv[kRowTiles][2];
  load_tensor_scales(ts, n_warp + g, p, tsv);

  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  float acc[kRowTiles][MT][4];
  zero<kRowTiles * MT * 4>(&acc[0][0][0]);

  Chunk next[kRowTiles][2];
  if (step_begin < step_end) {
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        load_chunk<FMT, BITS>(next[rt][h], rows, 2 * rt + h, step_begin * kStepK + 32 * t,
                        step_begin * kStepK + 32 * t < p.K, p);
  }

  for (int step = step_begin; step < step_end; ++step) {
    Chunk cur[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) cur[rt][h] = next[rt][h];

    const int k0 = step * kStepK;
    __syncthreads();  // every warp is done reading the previous super-step's activations
    for (int i = tid; i < MC * 16; i += kWarps * 32) {
      const int m = i >> 4, piece = i & 15;  // piece = 8 elements = physical (t, s2)
      const int64_t gm = m0 + m, k = k0 + 8 * piece;
      const bool valid = gm < p.M && k < p.K;
      uint8_t* dst = xs + m * kXStride + (piece & 3) * 64 + (piece >> 2) * 16;
      if constexpr (BITS) {
        const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(x + gm * p.K + k))
                              : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(dst) = x_pairs<true>(v);
      } else {
        cp_async16(dst, valid ? static_cast<const void*>(x + gm * p.K + k) : x, valid);
      }
    }
    if constexpr (!BITS) asm volatile("cp.async.commit_group;\n" ::);
    if (step + 1 < step_end) {
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          load_chunk<FMT, BITS>(next[rt][h], rows, 2 * rt + h, (step + 1) * kStepK + 32 * t,
                          (step + 1) * kStepK + 32 * t < p.K, p);
    }
    if constexpr (!BITS) asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();

    Dec d[kRowTiles][2][2];  // [tile][row half][16-element half of the chunk]
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(cur[rt][h], p, d[rt][h]);

#pragma unroll
    for (int s2 = 0; s2 < 4; ++s2) {  // physical elements [8 s2, 8 s2 + 8) of the chunk
      uint4 xb[MT];
#pragma unroll
      for (int j = 0; j < MT; ++j)
        xb[j] = *reinterpret_cast<const uint4*>(xs + (8 * j + g) * kXStride + s2 * 64 + t * 16);
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt) {
        const uint32_t w[2] = {word_of(cur[rt][0].q, s2), word_of(cur[rt][1].q, s2)};
        const Dec dd[2] = {d[rt][0][s2 >> 1], d[rt][1][s2 >> 1]};
        tile_step<FMT, BF16, BITS, MT, kLaneTable>(acc[rt], w, dd, xb, table, copy);
      }
    }
  }

#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile<BF16, MT>(out, acc[rt], kAccScale<FMT, BF16, BITS>, tsv[rt], n_warp + rt * 16, m0, g, t, p);
}

// Decode kernel (M <= 16): each warp owns kRowTiles 16-row weight tiles (lane (g, t):
// rows g, g + 8 of each) and runs over K in super-steps of kDirectStepK; in a step lane t
// owns the kDirectL contiguous 32-k chunks [kDirectL * 32 t, +kDirectL * 32) of each of
// its rows, so each row is read in runs of kDirectStepK / 2 bytes. The chunk registers
// roll: as soon as chunk j of a step is decoded, its register slot loads chunk j of the
// next step, so up to kDirectL - 1 chunks per row stay in flight while the warp decodes. The
// activations come straight from global memory (L1-resident), no shared memory for x and
// no barriers; the kRowTiles tiles share each activation fragment.
constexpr int kDirectL = 2;
constexpr int kDirectRowsPerCta = kRowsPerCta;        // 128
constexpr int kDirectStepK = 4 * 32 * kDirectL;       // 256

template <int FMT, bool BF16, int BITS, int MT>
__global__ void __launch_bounds__(kWarps * 32, 4) wmatmul_direct_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, void* __restrict__ out, const WParams p) {
  __shared__ __align__(16) float2 table[BITS ? 1 : 256 * kCopies];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = 8 * (lane & (kCopies - 1));
  if constexpr (!BITS) {
    fill_table<FMT, kCopies>(table, tid, kWarps * 32);
    __syncthreads();
  }

  const int64_t n_warp = static_cast<int64_t>(blockIdx.x) * kDirectRowsPerCta +
                         warp * kRowTiles * 16;
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp + g, p);
  float tsv[kRowTiles][2];
  load_tensor_scales(ts, n_warp + g, p, tsv);
  // activation rows of the lane's B fragments (clamped: columns past M are not stored)
  const uint16_t* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t m = 8 * mt + g;
    xrow[mt] = x + (m < p.M ? m : p.M - 1) * p.K;
  }
  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  float acc[kRowTiles][MT][4];
  zero<kRowTiles * MT * 4>(&acc[0][0][0]);

  const int lane_k = 32 * kDirectL * t;  // the lane's first k in a step
  const bool rows_inside = n_warp + kRowTiles * 16 <= p.N;
  Chunk c[kRowTiles][2][kDirectL];
  if (step_begin < step_end) {
#pragma unroll
    for (int j = 0; j < kDirectL; ++j)
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          load_chunk<FMT, BITS>(c[rt][h][j], rows, 2 * rt + h, step_begin * kDirectStepK + lane_k + 32 * j,
                          step_begin * kDirectStepK + lane_k + 32 * j < p.K32, p);
  }

  for (int step = step_begin; step < step_end; ++step) {
#pragma unroll
    for (int j = 0; j < kDirectL; ++j) {
      const int kj = step * kDirectStepK + lane_k + 32 * j;
      const bool kvalid = kj < p.K32;  // lanes past K feed zero activations
      uint4 xb[4][MT];
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          xb[s2][mt] = x_pairs<BITS>(kvalid ? __ldg(reinterpret_cast<const uint4*>(xrow[mt] + kj + 8 * s2))
                                            : make_uint4(0, 0, 0, 0));
      Dec d[kRowTiles][2][2];
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(c[rt][h][j], p, d[rt][h]);
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt) {
          const uint32_t w[2] = {word_of(c[rt][0][j].q, s2), word_of(c[rt][1][j].q, s2)};
          const Dec dd[2] = {d[rt][0][s2 >> 1], d[rt][1][s2 >> 1]};
          tile_step<FMT, BF16, BITS, MT, kCopies>(acc[rt], w, dd, xb[s2], table, copy);
        }
      if (step + 1 < step_end) {  // the slot, now decoded, loads the next step's chunk j
        const int kn = kj + kDirectStepK;
        if (rows_inside && (step + 2) * kDirectStepK <= p.K32) {  // warp-uniform: no checks
#pragma unroll
          for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              load_chunk<FMT, BITS, false>(c[rt][h][j], rows, 2 * rt + h, kn, true, p);
        } else {
#pragma unroll
          for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              load_chunk<FMT, BITS>(c[rt][h][j], rows, 2 * rt + h, kn, kn < p.K32, p);
        }
      }
    }
  }

#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile<BF16, MT>(out, acc[rt], kAccScale<FMT, BF16, BITS>, tsv[rt], n_warp + rt * 16, 0, g, t, p);
}

// ---- wgmma kernel (sm_90a; on Hopper from M = 1: primitives.wmatmul_tile_m) ----
//
// Warpgroup MMA with the weight as A from registers (decoded exactly as above) and the
// activations as B from shared memory (Machete's arrangement on Hopper: the decoded
// weight never leaves registers). A CTA is two warpgroups over 128 weight rows (warpgroup
// wg: rows 64 wg + 16 warp + {g, g + 8}, lane t owning k [32 t, 32 t + 32) of each per
// 128-k step, as in the staged kernel) and BN activation rows; per 128-k step each
// warpgroup issues 8 wgmma m64nBNk16, BN = 8 .. 256 (the caller's tile_m: 8 for M <= 8,
// where n8 beats n16: half the B tile to copy and multiply). The
// MMA sums over k, so the activations must sit in shared memory in the lane's k order:
// the caller passes x pre-permuted within each 128-k block (jax_fp4/primitives.py,
// wmatmul_x_layout), so that plain tile copies do.
//
// Pipeline. The tensor memory accelerator copies each step's BN x 128 activation tile
// (two 64-k boxes, zero past M) into the 128-byte-swizzled K-major layout that the wgmma
// descriptor names, and the step's weight codes (128 rows x 64 bytes, zero past N and K)
// behind it, completing on the stage's `full` mbarrier; wg_stages<FMT, BITS, BN> stages. The copies
// carry L2 hints: the codes, read once, are evicted first, the activations, which every
// CTA re-reads, last (without them the codes pushed x out of L2 and the kernel read
// markedly more DRAM bytes than the weight). A
// warpgroup keeps one wgmma group in flight across steps, so the stage of step s - 1
// may still be read during step s. Once a warp's first wgmma group of step s is issued
// and the group before it done, the warp is done with step s - 1 and arrives on that
// stage's `empty` mbarrier; the stage is refilled with step s - 1 + stages once all eight
// have (no CTA barrier: the warpgroups drift apart, and the copies run up to stages - 1
// steps ahead). A stage may hold wg_sub<FMT, BITS, BN> = 2 consecutive steps (activation
// tiles, then codes, one per step, then one scale box for both), filled by one `full`
// barrier and released once, after the first group of its successor's first step; its
// codes come as one 3-D box and its scales as one box 32 bytes wide (launch_wgmma). Who refills (wg_producer<BN>, chosen by measurement):
//  - BN <= 128: thread 0, between its own wgmma groups (M = 16..128: 4-14% faster than a
//    CTA barrier per step; a producer warpgroup was 3-10% slower at BN = 128).
//  - BN = 256: a third, producer warpgroup (CUTLASS's warp-specialized kernels): one
//    lane waits on the `empty` barriers and issues the copies, its warpgroup gives its
//    registers to the two consumer warpgroups (setmaxnreg 40 / 232), leaves after its
//    last copy, and the consumers' epilogue synchronises on named barrier 1. A CTA
//    barrier per step would keep only stages - 2 = 1 step of copies ahead (three stages
//    of 72 KB fill the SM).
//    Where the caller asks (attribute `cluster` = 2, primitives.wmatmul_cluster), the
//    BN = 256 kernel runs in clusters of two CTAs on adjacent 128-row weight tiles with
//    the same activation tile: each producer copies one 64-k box of it into both CTAs'
//    stage (TMA multicast), so the pair reads x from L2 once. A stage is then refilled
//    only once the consumers of both CTAs released it: each producer, after its own
//    `empty` barrier, arrives on its own and the other CTA's `pair` barrier and waits on
//    its own. (It pays where the copies, not the MMAs, bound the kernel:
//    primitives.wmatmul_cluster.)
// Each lane reads its two 16-byte code chunks of a step from the stage (a warp reads 512
// contiguous bytes), which beat codes loaded by the lanes into registers for every format
// but nvfp4 at large M, where they were close. The block scales (and INT4 zero points) come one of two
// ways: as scale boxes in the stage (wg_boxes<FMT, BITS, BN> and launch_wgmma's checks on
// the scale rows), one more tensor copy of the 128 rows x 16 aligned bytes that hold the
// step's blocks, read by the lanes from shared memory; or loaded by the lanes from global
// memory wg_depth<BN> steps ahead into registers (the scale rows' addresses pinned in
// registers). The stage index and parity are carried from step to step. The epilogue
// moves the accumulators through shared memory so that each warp stores whole rows of
// the output.
constexpr int kWgThreads = 256;
constexpr int kWgRows = 128;   // weight rows per CTA
constexpr int kWgStepK = 128;  // k per step
constexpr int kWgGroupM = 8;   // CTA raster: kWgGroupM activation tiles per weight tile run
constexpr int kOutStride = kWgRows + 4;  // epilogue floats per activation row (no conflicts)

// 128-k steps per stage (wg_sub) and stages (wg_stages) are defined below wg_words.

// steps of weight chunks loaded ahead: 2 where the registers allow (M = 16: 5-8% faster
// than 1; without the .L2::128B line prefetch, 2-4 were no faster)
template <int BN>
__host__ __device__ constexpr int wg_depth() { return BN >= 128 ? 1 : 2; }
template <int BN>  // a third warpgroup that only refills the stages (see Pipeline above)
__host__ __device__ constexpr bool wg_producer() { return BN >= 256; }
template <int BN>  // threads per CTA: two warpgroups (+ the producer warpgroup)
__host__ __device__ constexpr int wg_threads() { return kWgThreads + (wg_producer<BN>() ? 128 : 0); }
constexpr int kWgProducerRegs = 40, kWgConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 64K
// Clusters of two CTAs along the weight rows that share the activation tile (TMA multicast,
// see Pipeline above): the kernels with a producer warpgroup can run in them; the caller
// decides per call (attribute `cluster`, primitives.wmatmul_cluster).
template <int BN>
__host__ __device__ constexpr bool wg_can_multicast() { return wg_producer<BN>(); }
// The table path's table (fill_table, decode_word), by tile width:
// - BN = 8, 16, 128: the wide pair table (32 copies, 64 KB), one PRMT per address, beside
//   3 stages: the fewest decode instructions.
// - BN = 32, 64: 16 pair-table copies (32 KB), where 64 KB would cost a CTA per SM or a
//   stage.
// - BN = 256: the lane table (2 KB); its 3 stages of 73 KB leave no room for a pair table
//   (the wide table with 2 stages lost at large M).
// - INT4's table path: the lane table, its scale and zero-point boxes leave no room.
// (The measurements behind these choices: benchmarks/log/NOTES.md.)
template <int FMT, int BN>
__host__ __device__ constexpr int wg_copies() {
  return FMT == kINT4 || BN >= 256 ? kLaneTable : BN == 32 || BN == 64 ? kCopies : kWideCopies;
}
// Code words (of each of a lane's two rows) decoded per wgmma group: 2, or 1 at BN = 256
// and for the table path at BN = 8 (with its loads ahead, below), but INT4's (with one
// word there ptxas serializes its wgmmas, C7513). More words per group hold more
// registers and hide less latency; fewer issue more groups: 2 was fastest.
template <int FMT, int BITS, int BN>
__host__ __device__ constexpr int wg_words() { return BN >= 256 || (!BITS && FMT != kINT4 && BN == 8) ? 1 : 2; }
// Whether the table path loads a group's table values before issuing the wgmmas of the
// group before (the group's multiplies after them; table_load / table_finish): at BN = 256,
// and at BN = 8 where it has one word per group: there the loads' latency hides behind
// the wgmmas; with two words per group (BN = 16-128) the extra live registers cost more
// than they hide.
template <int FMT, int BN>
__host__ __device__ constexpr bool wg_table_ahead() { return BN == 256 || (BN == 8 && wg_words<FMT, false, BN>() == 1); }
// 128-k steps per stage: 2 for the bit path at BN <= 64, for the prepared bit path at
// BN = 128, the table path at BN = 8 and the prepared table path at BN = 32, else 1. A
// stage of two steps is waited for, released and refilled once.
// - BN = 8 to 32, 3 stages of two (6 steps ahead); linear INT4 with its scale and
//   zero-point boxes 2 stages of two at BN = 32, where 3 do not fit.
// - BN = 64 and 128, 2 stages of two: the same 4 steps ahead as 4 stages of one, half the
//   barrier waits, releases and copies (linear INT4's boxes fit since the shared memory
//   lost its 1 KB alignment slack).
// - The prepared table path at BN = 32, 2 stages of two instead of 4 of one; at BN = 8, 2
//   stages of two beside the wide table. At BN = 16 and 64 the table leaves no room for
//   them. (Each was faster than what it replaced: benchmarks/log/NOTES.md.)
template <int FMT, int BITS, int BN, bool TILED = false>
__host__ __device__ constexpr int wg_sub() {
  return (BITS && BN <= 64) || (!BITS && FMT != kINT4 && BN == 8) || (TILED && (BITS ? BN == 128 : BN == 32))
             ? 2
             : 1;
}
// 4 stages where they fit, else 3: at BN = 256; at BN = 64 for the table path, whose 16
// table copies (wg_copies) fit beside 3 stages at two CTAs per SM, not beside 4; and for
// stages of two steps at BN = 16, 32. Beside the wide pair table (64 KB, wg_copies): 3, or
// 2 of two steps at BN = 8. The bit path at BN = 8: 3 (6 steps ahead instead of 8: fewer
// bytes in flight streamed faster; 5 and 2 stages were slower). Stages of two steps at
// BN = 64 and 128 (wg_sub), the prepared table path's at BN = 32 and linear INT4's at
// BN = 32: 2 (a third would not fit: two CTAs per SM at BN <= 64, the SM at 128). Other
// stage counts and steps per stage at BN = 8 to 64 were slower (benchmarks/log/NOTES.md).
template <int FMT, int BITS, int BN, bool TILED = false>
__host__ __device__ constexpr int wg_stages() {
  if constexpr (!BITS && wg_copies<FMT, BN>() == kWideCopies) return BN == 8 ? 2 : 3;
  if constexpr (BITS && BN == 8) return 3;
  constexpr bool kTwo = wg_sub<FMT, BITS, BN, TILED>() > 1;
  if constexpr (kTwo && (BN == 64 || BN == 128 || !BITS || (FMT == kINT4 && !TILED && BN == 32))) return 2;
  return BN >= 256 || BN == 64 || (kTwo && BN >= 16) ? 3 : 4;
}
// L2 cache policies (CUTLASS's CacheHintSm90): the activations, which every CTA re-reads,
// stay; the weight codes, read once, go first
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
constexpr uint64_t kEvictLast = 0x14F0000000000000ull;
constexpr int kWgCodeBytes = kWgRows * kWgStepK / 2;  // a step's weight codes: 128 rows x 64 B
constexpr int kWgBoxCols = 16;  // a step's scale / zero-point box: 128 rows x 16 bytes (TMA's minimum)
template <int BN>  // a step's activation tile: BN rows x 128 k
__host__ __device__ constexpr int wg_x_bytes() { return BN * kWgStepK * 2; }
template <int BN>  // CTAs per SM the kernel is built for (launch bounds)
__host__ __device__ constexpr int wg_ctas() { return BN >= 128 ? 1 : 2; }
template <int FMT, int BITS, int BN>  // a stage's box width: 16 bytes per step it holds
__host__ __device__ constexpr int wg_box_cols() { return kWgBoxCols * wg_sub<FMT, BITS, BN>(); }
template <int FMT, int BITS, int BN>  // a stage's scale box, and INT4's zero-point box
__host__ __device__ constexpr int wg_side_bytes() { return (FMT == kINT4 ? 2 : 1) * kWgRows * wg_box_cols<FMT, BITS, BN>(); }
// The dynamic shared memory, from its base (1024-aligned: the 128-byte TMA swizzle's atom,
// by the `.align 1024` of its declaration): the stages (the epilogue's tile reuses them),
// the table path's table (the lane table 2 KB-aligned at run time: 1 KB more room), then
// the `full`, `empty` and `pair` mbarriers, 8 bytes per stage each. No alignment slack and
// no static shared memory: a CTA takes what this says plus the 1 KB reserved per CTA
// (kSmemReserved), which is what decides two CTAs per SM at BN <= 64.
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_table_off(int stage_bytes) {
  const int pipe = wg_stages<FMT, BITS, BN, TILED>() * stage_bytes;
  const int epi = BN * kOutStride * 4;
  return ((pipe > epi ? pipe : epi) + 1023) / 1024 * 1024;
}
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_bar_off(int stage_bytes) {
  return wg_table_off<FMT, BN, BITS, TILED>(stage_bytes) +
         (BITS ? 0 : table_bytes<wg_copies<FMT, BN>()>() +
                     (wg_copies<FMT, BN>() == kLaneTable ? kLaneTableAlign - 1024 : 0));
}
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_smem_for(int stage_bytes) {
  return wg_bar_off<FMT, BN, BITS, TILED>(stage_bytes) + 3 * 8 * wg_stages<FMT, BITS, BN, TILED>();
}
constexpr int kSmemReserved = 1024;  // shared memory the driver reserves per CTA (sm_80 on)
template <int FMT, int BN, int BITS, bool TILED = false>  // wg_ctas CTAs fit an SM (228 KB)
__host__ __device__ constexpr bool wg_fits(int stage_bytes) {
  return wg_ctas<BN>() * (wg_smem_for<FMT, BN, BITS, TILED>(stage_bytes) + kSmemReserved) <= 228 * 1024;
}
// The prepared ("tiled") weight layout of jax_fp4.prepare (jax_fp4/layout.py, tile_rows):
// the codes (128 rows x 64 bytes), scales (128 rows x tile_srow bytes) and INT4 zero
// points (128 rows x tile_zrow bytes) of each 128-row x 128-k tile stored contiguously,
// the tiles ordered [row tile][step]; N % 128 == 0 and K % 128 == 0, nvfp4 and mxfp4 in
// their spec blocks (16, 32), int4 / nf4 / bnb_fp4 in blocks of 16..128 whose scales and
// zero points per step fit kWgTiledSide (jax_fp4.layout.tileable). A stage's codes,
// scales and zero points are then 1-D bulk copies of contiguous bytes (cp.async.bulk) that
// land in the stage as [step][row][bytes]: no tensor maps, no 64-byte row pieces 4-14 KB
// apart in DRAM (the offline re-layout of Marlin-style W4A16 kernels). The kernel's TILED
// instance reads this layout.
template <int FMT>  // a row's scale bytes per 128-k step: 8 E4M3 (nvfp4), 4 E8M0 (mxfp4), or
__host__ __device__ constexpr int wg_tile_scale_row() {  // 0: by block size and scale dtype (p.tile_srow)
  return FMT == kNVFP4 ? 8 : FMT == kMXFP4 ? 4 : 0;
}
// a step's scales and zero points at most (int4 / nf4 / bnb_fp4; jax_fp4.layout.tileable):
// int4 in groups of 128 with 2-byte scales take 384 bytes, nf4 in blocks of 64 1 KB
constexpr int kWgTiledSide = 2048;
template <int FMT, int BITS, int BN>  // a stage's room for them (1024-aligned, as the stages)
__host__ __device__ constexpr int wg_tiled_side_bytes() {
  return wg_sub<FMT, BITS, BN, true>() *
         (wg_tile_scale_row<FMT>() ? (kWgRows * wg_tile_scale_row<FMT>() + 1023) / 1024 * 1024 : kWgTiledSide);
}
// Whether the stages carry the scale boxes (see Pipeline below): BN <= 128 (BN = 256 is
// bound by the tensor cores, and its three stages fill the SM), for nvfp4 only at BN <= 32
// with stages of two steps (elsewhere its one 2-byte lane load per row and step is as
// fast), and only where the boxes do not cost a CTA per SM (wg_fits).
template <int FMT, int BITS, int BN>
__host__ __device__ constexpr bool wg_boxes() {
  return BN <= 128 && (FMT != kNVFP4 || BN <= 32) &&
         wg_fits<FMT, BN, BITS>(wg_sub<FMT, BITS, BN>() * (wg_x_bytes<BN>() + kWgCodeBytes) +
                                wg_side_bytes<FMT, BITS, BN>());
}
// stage = [activation tiles | weight codes | scale boxes or prepared scales], the first
// two one per step it holds; the last the scale boxes' room (where they fit) in the linear
// layout's instance, the prepared scales' in the TILED one
template <int FMT, int BITS, int BN, bool TILED>
__host__ __device__ constexpr int wg_stage_bytes() {
  return wg_sub<FMT, BITS, BN, TILED>() * (wg_x_bytes<BN>() + kWgCodeBytes) +
         (TILED ? wg_tiled_side_bytes<FMT, BITS, BN>() : wg_boxes<FMT, BITS, BN>() ? wg_side_bytes<FMT, BITS, BN>() : 0);
}
static_assert(wg_boxes<kINT4, true, 8>() && wg_boxes<kINT4, true, 16>() && wg_boxes<kINT4, true, 32>() &&
                  wg_boxes<kINT4, true, 64>(),
              "linear INT4's stages of two (wg_sub) are measured with its scale and zero-point boxes");
template <int FMT, int BITS, int BN, bool TILED>
__host__ __device__ constexpr int wg_smem_bytes() {
  return wg_smem_for<FMT, BN, BITS, TILED>(wg_stage_bytes<FMT, BITS, BN, TILED>());
}

// n bytes of shared memory, zero-extended
template <int N>
__device__ __forceinline__ uint32_t lds_bytes(const uint8_t* a) {
  if constexpr (N == 1) return *a;
  else if constexpr (N == 2) return *reinterpret_cast<const uint16_t*>(a);
  else return *reinterpret_cast<const uint32_t*>(a);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Registers the compiler must not read or move across this point (CUTLASS's
// warpgroup_fence_operand): the accumulators after the last wgmma.wait_group, the A
// fragments before wgmma.fence (ptxas serializes the wgmmas if an input register is
// defined between the fence and the wgmma).
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (*r)[4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

// Matrix descriptor of a K-major, 128-byte-swizzled operand (PTX ISA 9.7.15.5.1.2):
// start address, leading byte offset (unused with this swizzle: 1), stride byte offset
// 1024 (8 rows of 128 B), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3ffffu) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

template <bool CLUSTER = false>  // CLUSTER: acquire what other CTAs of the cluster released
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    if constexpr (CLUSTER)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    else
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// TILED: the weight in the prepared layout (a second instance: with the layout a runtime
// flag, the linear layout's step loop grew and ran 1-4% slower on the harness)
// The most K-splits summed in one cluster: the portable cluster size.
constexpr int kWgMaxClusterSplits = 8;

// The K-splits of one output tile run as one cluster along grid z (launch_wgmma: cluster
// dims (1, 1, splits), splits <= 8, never with x multicast), each CTA's float32 partial in
// its shared memory `tile` (kOutStride floats per activation row). After a cluster barrier
// CTA r sums every split's value of its share of the tile's outputs, in split order (the
// result does not depend on scheduling), and stores them; a second barrier keeps every
// CTA's shared memory alive until the others have read it. One launch, no workspace and
// no partial sums in HBM. Only the consumer threads arrive: the producer warpgroup has
// exited, and barrier.cluster waits for the non-exited threads (PTX ISA, barrier.cluster).
template <bool BF16, int BN>
__device__ __forceinline__ void wg_reduce_splits(const float* tile, void* out, int m0,
                                                 int64_t n_cta, int tid, const WParams& p) {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  uint32_t rank, nranks;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(nranks));
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(tile));
  uint32_t peer[kWgMaxClusterSplits];
#pragma unroll
  for (int q = 0; q < kWgMaxClusterSplits; ++q)
    if (q < static_cast<int>(nranks))
      asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(peer[q]) : "r"(base), "r"(q));
  const bool vec = p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 15u) == 0;
  const int per = vec ? 4 : 1;  // outputs per thread and store, as the plain epilogue
  for (int idx = tid + static_cast<int>(rank) * kWgThreads; idx < BN * kWgRows / per;
       idx += static_cast<int>(nranks) * kWgThreads) {
    const int m = idx / (kWgRows / per), n = per * (idx % (kWgRows / per));
    if (m0 + m >= p.M || n_cta + n >= p.N) continue;
    const uint32_t off = 4u * static_cast<uint32_t>(m * kOutStride + n);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < kWgMaxClusterSplits; ++q) {
      if (q >= static_cast<int>(nranks)) break;
      if (vec) {
        float4 w;
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                     : "=f"(w.x), "=f"(w.y), "=f"(w.z), "=f"(w.w) : "r"(peer[q] + off));
        v.x += w.x, v.y += w.y, v.z += w.z, v.w += w.w;
      } else {
        float w;
        asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(w) : "r"(peer[q] + off));
        v.x += w;
      }
    }
    const int64_t o = (m0 + m) * p.N + n_cta + n;
    if (vec) store_out4<BF16>(out, o, v, p);
    else store_out<BF16>(out, o, v.x, p);
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

template <int FMT, bool BF16, int BITS, int BN, bool TILED>
__global__ void __launch_bounds__(wg_threads<BN>(), wg_ctas<BN>()) wmatmul_wgmma_kernel(
    const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap s_map, const __grid_constant__ CUtensorMap z_map,
    const uint8_t* __restrict__ codes, const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, void* __restrict__ out, const WParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kStages = wg_stages<FMT, BITS, BN, TILED>();
  constexpr bool kProducer = wg_producer<BN>();
  constexpr int kWords = wg_words<FMT, BITS, BN>();
  constexpr bool kAhead = !BITS && wg_table_ahead<FMT, BN>();
  constexpr int kStage = wg_stage_bytes<FMT, BITS, BN, TILED>();
  constexpr int kSub = wg_sub<FMT, BITS, BN, TILED>();  // steps per stage
  static_assert(kSub <= 2, "a stage's scale box covers two steps' bytes (launch_wgmma)");
  // where in a stage: step h's activation tile, its codes, the boxes (width kBoxCols)
  constexpr int kX = wg_x_bytes<BN>(), kCodes = kSub * kX, kSide = kSub * (kX + kWgCodeBytes);
  constexpr int kBoxCols = wg_box_cols<FMT, BITS, BN>();
  // the scales come with the stages: boxes (launch_wgmma: where the scale rows allow), or
  // the prepared layout's bulk copies
  constexpr bool kSideScales = wg_boxes<FMT, BITS, BN>() || TILED;
  constexpr bool tiled = TILED;
  const bool boxes = (wg_boxes<FMT, BITS, BN>() && p.scale_boxes) || tiled;
  // the layout of wg_smem_for; the base's 1024-byte alignment, which the 128-byte swizzle
  // needs, is the declaration's (PTX ISA 5.4.5: `.align` gives the variable's address; the
  // compiler relies on it too and folds a run-time check of it away). The base is still
  // taken as the run-time address rounded up to 1024, the same address: with the symbol's
  // address itself ptxas scheduled the prepared INT4 kernels at 8- and 16-row tiles worse.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // full[j]: stage j holds its steps; empty[j]: every warp is done with stage j (release);
  // pair[j]: ... in every CTA of the cluster
  const uint32_t full_addr = smem_addr + wg_bar_off<FMT, BN, BITS, TILED>(kStage);
  const uint32_t empty_addr = full_addr + 8 * kStages, pair_addr = empty_addr + 8 * kStages;
  constexpr bool kLane = wg_copies<FMT, BN>() == kLaneTable;
  float2* table = align_shared(reinterpret_cast<float2*>(smem + wg_table_off<FMT, BN, BITS, TILED>(kStage)),
                               kLane ? kLaneTableAlign : 16);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = kLane ? lane_table_base(table, lane) : 8 * (lane & (wg_copies<FMT, BN>() - 1));
  if constexpr (!BITS) if (tid < kWgThreads) fill_table<FMT, wg_copies<FMT, BN>()>(table, tid, kWgThreads);
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full_addr + 8 * i));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(empty_addr + 8 * i),
                   "n"(kWgThreads / 32));
      if constexpr (wg_can_multicast<BN>())  // the producers of both CTAs of a cluster
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;\n" ::"r"(pair_addr + 8 * i));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // CTAs in the cluster: 1, or 2 sharing the activation tile (launch_wgmma, p.cluster)
  uint32_t ncl = 1;
  if constexpr (wg_can_multicast<BN>()) asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(ncl));
  // raster: runs of kWgGroupM activation tiles per weight tile (per ncl adjacent weight
  // tiles, one cluster), so the CTAs resident at once share both operands in L2; a
  // cluster's CTAs (rank = blockIdx.x % ncl, PTX ISA %cluster_ctarank) share m0
  const int64_t m_tiles = (p.M + BN - 1) / BN;
  const int64_t n_tiles = ((p.N + kWgRows - 1) / kWgRows + ncl - 1) / ncl;
  const uint32_t rank = blockIdx.x % ncl;
  const int64_t id = blockIdx.x / ncl;
  const int64_t group = id / (kWgGroupM * n_tiles);
  const int64_t gm0 = group * kWgGroupM;
  const int64_t gsize = min(static_cast<int64_t>(kWgGroupM), m_tiles - gm0);
  const int64_t rem = id - group * kWgGroupM * n_tiles;
  const int m0 = static_cast<int>((gm0 + rem % gsize) * BN);  // M < 2^31 (TMA coordinate)
  const int64_t n_cta = ((rem / gsize) * ncl + rank) * kWgRows;  // may be >= N: all zeros

  const int wrow = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // lane's first row in the CTA
  const int64_t n_warp = n_cta + wrow - g;
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp + g, p);
  float tsv[1][2];  // one 16-row tile per warp
  load_tensor_scales<1>(ts, n_warp + g, p, tsv);
  const bool rows_inside = n_warp + 16 <= p.N;

  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  // step `step`, the h-th of stage j, zero past M, N and K, arriving on full[j]; one thread
  // issues it: its activation tile (two 64-k boxes) and weight codes (128 rows x 64
  // bytes; for h = 0 with p.stage_codes, the stage's kSub steps of codes as one 3-D box),
  // and for h = 0 the stage's scale / zero-point boxes (128 rows x the kBoxCols bytes from
  // the 16-byte boundary at or before the stage's first block: a box must start on one,
  // and the stage's kSub <= 2 steps' bytes fit, launch_wgmma). In the prepared layout
  // (tiled) the stage's codes, scales and INT4 zero points instead, for h = 0, as one bulk
  // copy each (one per step for a stage reaching past K, whose steps past K repeat the
  // last: K % 128 == 0 and N % 128 == 0, so no step is partial; a weight tile past N,
  // cluster rounding, is not copied). In a cluster of two, CTA r copies box r of the
  // activation tile into stage j of both CTAs (TMA multicast, arriving on each one's
  // full[j]): the pair reads the tile from L2 once.
  // a prepared step's scale / zero-point bytes per row (nvfp4 / mxfp4: known at compile
  // time) and per tile; the zero points follow the stage's scales
  const int srow = !tiled ? kBoxCols : wg_tile_scale_row<FMT>() ? wg_tile_scale_row<FMT>() : p.tile_srow;
  const int zrow = !tiled ? kBoxCols : FMT == kINT4 ? p.tile_zrow : 0;
  const int tile_sbytes = kWgRows * srow, tile_zbytes = kWgRows * zrow;
  const int64_t tile0 = (n_cta / kWgRows) * p.n_steps;  // the CTA's weight tile's first step
  const uint8_t* tile_codes = codes + tile0 * kWgCodeBytes;
  const uint8_t* tile_scales = static_cast<const uint8_t*>(scales) + tile0 * tile_sbytes;
  const uint8_t* tile_zeros = zeros + tile0 * tile_zbytes;
  // bytes a stage receives
  const uint32_t stage_tx = tiled ? kSub * (kX + (n_cta < p.N ? kWgCodeBytes + tile_sbytes + tile_zbytes : 0))
                                  : boxes ? kSide + wg_side_bytes<FMT, BITS, BN>() : kSide;
  auto copy_step = [&](int step, uint32_t j, int h) {
    const uint32_t bar = full_addr + 8 * j, stage = smem_addr + j * kStage, dst = stage + h * kX;
    auto copy = [&](uint32_t to, const CUtensorMap* map, int c0, int c1, uint64_t hint) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
          " [%0], [%1, {%2, %3}], [%4], %5;\n"
          ::"r"(to), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(hint) : "memory");
    };
    const int n = static_cast<int>(n_cta);
    if (wg_can_multicast<BN>() && ncl > 1) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
          ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n"
          ::"r"(dst + rank * (BN * 128)), "l"(&x_map), "r"(step * kWgStepK + 64 * static_cast<int>(rank)),
          "r"(m0), "r"(bar), "h"(static_cast<uint16_t>(3)), "l"(kEvictLast) : "memory");
    } else {
      copy(dst, &x_map, step * kWgStepK, m0, kEvictLast);
      copy(dst + BN * 128, &x_map, step * kWgStepK + 64, m0, kEvictLast);
    }
    if constexpr (tiled) {
      auto bulk = [&](uint32_t to, const uint8_t* from, int bytes) {  // read once: evict first
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;\n"
            ::"r"(to), "l"(from), "r"(bytes), "r"(bar), "l"(kEvictFirst) : "memory");
      };
      if (h == 0 && n_cta < p.N) {
        const uint32_t zdst = stage + kSide + kSub * tile_sbytes;  // the stage's zero points
        if (step + kSub <= p.n_steps) {
          bulk(stage + kCodes, tile_codes + static_cast<int64_t>(step) * kWgCodeBytes, kSub * kWgCodeBytes);
          bulk(stage + kSide, tile_scales + static_cast<int64_t>(step) * tile_sbytes, kSub * tile_sbytes);
          if constexpr (FMT == kINT4) bulk(zdst, tile_zeros + static_cast<int64_t>(step) * tile_zbytes, kSub * tile_zbytes);
        } else {
#pragma unroll
          for (int hh = 0; hh < kSub; ++hh) {
            const int64_t s = min(static_cast<int64_t>(step + hh), p.n_steps - 1);
            bulk(stage + kCodes + hh * kWgCodeBytes, tile_codes + s * kWgCodeBytes, kWgCodeBytes);
            bulk(stage + kSide + hh * tile_sbytes, tile_scales + s * tile_sbytes, tile_sbytes);
            if constexpr (FMT == kINT4) bulk(zdst + hh * tile_zbytes, tile_zeros + s * tile_zbytes, tile_zbytes);
          }
        }
      }
    } else if (kSub == 1 || !p.stage_codes) {
      copy(stage + kCodes + h * kWgCodeBytes, &w_map, step * (kWgStepK / 2), n, kEvictFirst);
    } else if (h == 0) {  // w_map 3-D: (64 bytes, rows, 64-byte column blocks)
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
          " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
          ::"r"(stage + kCodes), "l"(&w_map), "r"(0), "r"(n), "r"(step), "r"(bar), "l"(kEvictFirst) : "memory");
    }
    if constexpr (wg_boxes<FMT, BITS, BN>()) {
      if (boxes && !tiled && h == 0) {  // a scale row's 128-byte line serves 8-16 steps: normal eviction
        const int b0 = (step * kWgStepK) >> p.bs_shift;
        copy(stage + kSide, &s_map, (b0 * scale_bytes<FMT>(p)) & ~15, n, kEvictNormal);
        if constexpr (FMT == kINT4) copy(stage + kSide + kWgRows * kBoxCols, &z_map, b0 & ~15, n, kEvictNormal);
      }
    }
  };
  // stage j <- the kSub steps from step0 (a step past the split's end is copied, the next
  // split's or zeros past K, and not used)
  auto stage_step = [&](int step0, uint32_t j) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 ::"r"(full_addr + 8 * j), "r"(stage_tx)
                 : "memory");
#pragma unroll
    for (int h = 0; h < kSub; ++h) copy_step(step0 + h, j, h);
  };
  // The lane's two rows (g, g + 8) with their scale / zero-point row addresses pinned in
  // registers: otherwise the compiler recomputes the 64-bit row addresses every step.
  Rows lrows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lrows[h] = rows;
    lrows[h].scales = rows.scales + h * rows.scale_stride;
    lrows[h].zeros = rows.zeros + h * rows.zero_stride;
    lrows[h].n0 = rows.n0 + 8 * h;
    asm volatile("" : "+l"(lrows[h].scales), "+l"(lrows[h].zeros));
  }
  // steps before fast_end are whole 128-k steps of rows inside N: no bounds checks
  const int fast_end = rows_inside ? min(step_end, p.K32 / kWgStepK) : step_begin;
  // the scales (and zero points) of a step; its codes come with the stage
  auto load_step = [&](Chunk (&c)[2], int step) {
    const int k = step * kWgStepK + 32 * t;
    if (step < fast_end) {  // warp-uniform
#pragma unroll
      for (int h = 0; h < 2; ++h) load_chunk<FMT, BITS, false, false>(c[h], lrows[h], 0, k, true, p);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) load_chunk<FMT, BITS, true, false>(c[h], lrows[h], 0, k, k < p.K32, p);
    }
  };

  float acc[BN / 2];
  zero<BN / 2>(acc);
  // the eight consumer warps (all of the CTA but the producer warpgroup, which has left)
  auto consumer_sync = [] {
    if constexpr (wg_producer<BN>()) asm volatile("bar.sync 1, %0;\n" ::"n"(kWgThreads) : "memory");
    else __syncthreads();
  };

  if (wg_can_multicast<BN>() && ncl > 1)  // both CTAs' barriers initialised before any copy or remote arrive
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  else
    __syncthreads();  // barriers initialised (and the decode table filled)
  if constexpr (kProducer) {
    if (warp >= kWgThreads / 32) {  // the producer warpgroup: one lane refills each stage
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWgProducerRegs));
      if (tid == kWgThreads) {  // once the eight consumer warps released its previous step
        uint32_t j = 0, use = 0;
        uint32_t peer_pair = 0;  // the other CTA's pair barriers
        if (ncl > 1)
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(peer_pair) : "r"(pair_addr), "r"(rank ^ 1u));
        for (int step = step_begin; step < step_end; step += kSub) {
          if (use > 0) {
            mbar_wait(empty_addr + 8 * j, (use - 1) & 1u);
            // In a cluster the copies write stage j of both CTAs: pass the release on to
            // both producers and wait for the other CTA's. (The producers do this, not
            // the consumer warps: a remote arrive between their wgmmas made ptxas
            // serialize them, C7513.) Only before a refill, which the other producer waits
            // for, so no CTA exits with a remote arrive pending on it.
            if (ncl > 1) {
              asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(pair_addr + 8 * j) : "memory");
              asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n"
                           ::"r"(peer_pair + 8 * j) : "memory");
              mbar_wait<true>(pair_addr + 8 * j, (use - 1) & 1u);
            }
          }
          stage_step(step, j);
          if (++j == kStages) {
            j = 0;
            ++use;
          }
        }
      }
      return;  // the consumers' epilogue synchronises on named barrier 1
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWgConsumerRegs));
  } else if (tid == 0) {
    for (int i = 0; i < kStages; ++i)
      if (step_begin + kSub * i < step_end) stage_step(step_begin + kSub * i, i);
  }
  // the scales of the next kDepth steps, in a ring indexed at compile time (the step loop
  // is unrolled kDepth times, so no register move waits on a load early, and covers whole
  // stages: at BN = 128 the prepared layout's stages of two steps, its scales in the stages)
  constexpr int kDepth = wg_depth<BN>() > kSub ? wg_depth<BN>() : kSub;
  static_assert(kDepth % kSub == 0, "the step loop's unroll must cover whole stages");
  Chunk ring[kDepth][2];
#pragma unroll
  for (int i = 0; i < kDepth; ++i)
    if (!boxes && step_begin + i < step_end) load_step(ring[i], step_begin + i);

  // the stage of `step` and the parity of its fill, carried (no division per step)
  uint32_t js = 0, par = 0;
  const uint64_t desc0 = sw128_desc(smem_addr);
  const uint8_t* wc0 = smem + kCodes + wrow * 64 + 16 * t;
  // the lane's scale rows in a stage's box, and its first block counted from the step's
  // first block (blocks longer than a step: 0)
  // (srow / zrow: bytes per row of the scales / zero points)
  const uint8_t* sb0 = smem + kSide + wrow * srow;
  const uint8_t* zb0 = smem + kSide + (tiled ? kSub * tile_sbytes : kWgRows * kBoxCols) + wrow * zrow;
  const int lane_block = (32 * t) >> p.bs_shift;
  for (int s0 = step_begin; s0 < step_end; s0 += kDepth)
#pragma unroll
  for (int u = 0; u < kDepth; ++u) {
    const int step = s0 + u;
    if (step >= step_end) break;
    Chunk cur[2] = {ring[u][0], ring[u][1]};
    if (!boxes && step + kDepth < step_end) load_step(ring[u], step + kDepth);
    // descriptor of the stage; a k16 slice adds its byte offset / 16 to the address field
    // (addresses stay below 2^18, so the 14-bit field never carries)
    const int hs = u % kSub;  // the step's place in its stage
    const uint64_t desc = desc0 + js * (kStage >> 4) + ((hs * kX) >> 4);
    if (hs == 0) mbar_wait(full_addr + 8 * js, par);
    if constexpr (kSideScales) {
      if (boxes) {  // the step's first block, counted from its stage's box (copy_step), or
                    // the step's scales in the prepared layout
        const int b0 = (step * kWgStepK) >> p.bs_shift, b0s = ((step - hs) * kWgStepK) >> p.bs_shift;
        const int size = scale_bytes<FMT>(p);
        const uint8_t* sb = sb0 + js * kStage + (tiled ? hs * tile_sbytes : b0 * size - ((b0s * size) & ~15));
        const uint8_t* zb = zb0 + js * kStage + (tiled ? hs * tile_zbytes : b0 - (b0s & ~15));
#pragma unroll
        for (int h = 0; h < 2; ++h)
          chunk_scales<FMT, BITS>(
              cur[h],
              [&](auto n, int off) { return lds_bytes<decltype(n)::value>(sb + h * 8 * srow + off); },
              [&](auto n, int off) { return lds_bytes<decltype(n)::value>(zb + h * 8 * zrow + off); },
              lane_block, p.bs == 16, p);
      }
    }
    Dec d[2][2];
    const bool fixup = mx_scale_fixup<FMT, BITS>(cur);
#pragma unroll
    for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(cur[h], p, d[h]);
    // the lane's code chunks: rows wrow and wrow + 8, k [32 t, 32 t + 32) (a warp reads 512
    // contiguous bytes: no bank conflicts)
    const uint8_t* wc = wc0 + js * kStage + hs * kWgCodeBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) cur[h].q = *reinterpret_cast<const uint4*>(wc + h * 8 * 64);
    // groups of kWords code words: decode them (A of 2 kWords wgmmas), issue the
    // wgmmas as one group, then wait for the group before. One group in flight, not
    // more: the next step rewrites this step's A registers (the same PTX registers in
    // every iteration), which is safe only once their wgmmas are done (PTX ISA:
    // wgmma.mma_async inputs may not change before the wgmma.wait_group that covers it;
    // two in flight failed the GPU tests).
    // kAhead: the table values of a group's words (tv), loaded before the wgmmas of the
    // group before
    float tv[kAhead ? kWords : 1][2][8];
    auto group_loads = [&](int w0) {
#pragma unroll
      for (int w = 0; w < kWords; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h) table_load<wg_copies<FMT, BN>()>(word_of(cur[h].q, w0 + w), table, copy, tv[w][h]);
    };
    if constexpr (kAhead) group_loads(0);
#pragma unroll
    for (int w0 = 0; w0 < 4; w0 += kWords) {
      uint32_t a[2 * kWords][4];
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        const int s2 = w0 + w;
        uint32_t r[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kAhead)
            table_finish<FMT, BF16>(tv[w][h], d[h][s2 >> 1], r[h]);
          else
            decode_word<FMT, BF16, BITS, wg_copies<FMT, BN>(), false>(word_of(cur[h].q, s2), d[h][s2 >> 1],
                                                                     table, copy, r[h]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          a[2 * w + hh][0] = r[0][2 * hh];
          a[2 * w + hh][1] = r[1][2 * hh];
          a[2 * w + hh][2] = r[0][2 * hh + 1];
          a[2 * w + hh][3] = r[1][2 * hh + 1];
        }
      }
      // MXFP4's second scale factor, where a lane's scale is > 2: one branch around its
      // multiplies, the decode itself the same in every case (as fast as a branch between
      // two decodes, and one decode to maintain)
      if (fixup) {
#pragma unroll
        for (int i = 0; i < 2 * kWords; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) a[i][j] = mx_fix<BF16>(a[i][j], d[j & 1][0]);  // row j & 1
      }
      if constexpr (kAhead) if (w0 + kWords < 4) group_loads(w0 + kWords);
      fence_regs<2 * kWords>(a);
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < 2 * kWords; ++i) {
        const int ks = 2 * w0 + i;  // k16 slice of the step: atom ks / 4, 32 B each
        wgmma_rs<BN, BF16>(acc, a[i], desc + (((ks >> 2) * BN * 128 + (ks & 3) * 32) >> 4));
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (w0 == 0 && hs == 0 && step > step_begin) {
        // this warp is done with the stage before (steps step - kSub .. step - 1; only the
        // group just issued is in flight): release it; thread 0 (or the producer
        // warpgroup) refills it once every warp has
        const uint32_t jp = js ? js - 1 : kStages - 1, pp = js ? par : par ^ 1u;
        if (lane == 0)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"::"r"(empty_addr + 8 * jp) : "memory");
        if (!kProducer && tid == 0 && step + kSub * (kStages - 1) < step_end) {
          mbar_wait(empty_addr + 8 * jp, pp);
          stage_step(step + kSub * (kStages - 1), jp);
        }
      }
    }
    if (hs == kSub - 1 && ++js == kStages) {
      js = 0;
      par ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence_regs<BN / 2>(acc);
  consumer_sync();  // the pipeline's shared memory becomes the epilogue's

  // accumulator (wgmma D fragment): acc[4 j + 2 h + e] = (weight row g + 8 h of the
  // warp's 16, activation row 8 j + 2 t + e)
  float* tile = reinterpret_cast<float*>(smem);
  const float scale = kAccScale<FMT, BF16, BITS>;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        tile[(8 * j + 2 * t + e) * kOutStride + wrow + 8 * h] = acc[4 * j + 2 * h + e] * scale * tsv[0][h];
  consumer_sync();
  if (p.split_reduce) {  // the cluster's K-splits sum their tiles (wg_reduce_splits)
    wg_reduce_splits<BF16, BN>(tile, out, m0, n_cta, tid, p);
    return;
  }
  const int64_t z_off = static_cast<int64_t>(blockIdx.z) * p.M * p.N;
  if (p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 15u) == 0) {
    // four outputs per lane and store: a warp reads 512 contiguous bytes of a tile row
    // (LDS.128, no conflicts) and writes 2 x 128 (f32) or 2 x 64 bytes (x's dtype) of
    // an output row; with N % 4 == 0 four outputs lie wholly inside or outside N and
    // each store is aligned (at BN = 256: 32 stores per thread instead of 128)
    for (int idx = tid; idx < BN * kWgRows / 4; idx += kWgThreads) {
      const int m = idx / (kWgRows / 4), n = 4 * (idx % (kWgRows / 4));
      if (m0 + m >= p.M || n_cta + n >= p.N) continue;
      const float4 v = *reinterpret_cast<const float4*>(tile + m * kOutStride + n);
      store_out4<BF16>(out, z_off + (m0 + m) * p.N + n_cta + n, v, p);
    }
  } else {
    for (int idx = tid; idx < BN * kWgRows; idx += kWgThreads) {
      const int m = idx / kWgRows, n = idx % kWgRows;
      if (m0 + m >= p.M || n_cta + n >= p.N) continue;
      store_out<BF16>(out, z_off + (m0 + m) * p.N + n_cta + n, tile[m * kOutStride + n], p);
    }
  }
#else
  __trap();  // built without sm_90a: the handler never launches this (prepare_wgmma)
#endif
}

// tile_m > 0: the wgmma kernel with tile_m activation rows per CTA; else M <= 16: the
// direct kernel, larger M: the staged kernel, 64 rows of x per grid.y.
bool direct_path(int64_t M) { return M <= 16; }
int64_t step_k(int64_t M, int64_t tile_m) {
  return tile_m > 0 ? kWgStepK : direct_path(M) ? kDirectStepK : kStepK;
}

// Which bit path is exact for this call (see the decode comment above): 0 none (the table
// path), 1, or kBitsSplit.
template <int FMT, bool BF16>
int use_bit_path(const WParams& p) {
  if constexpr (!kHasBitPath<FMT>) return 0;
  if (FMT == kINT4) return p.st == (BF16 ? kScaleBF16 : kScaleF16) ? 1 : BF16 && p.st == kScaleF16 ? kBitsSplit : 0;
  return 1;
}

// The wgmma kernel instance runs here only if its sm_90a code was built and the device is
// compute capability 9.0 (an sm_90a cubin loads on nothing else). Also raises its
// dynamic shared-memory limit.
template <class Kernel>
cudaError_t prepare_wgmma_on_device(Kernel kernel, int smem_bytes) {
  int dev = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) return e;
  cudaFuncAttributes attr;
  e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return e;
  if (major != 9 || minor != 0 || attr.binaryVersion != 90) return cudaErrorNoKernelImageForDevice;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// prepare_wgmma_on_device once per (kernel, device): a function attribute is set for the
// current device only, so a process that runs the kernel on several GPUs (sharded
// programs) prepares it on each; a launch on an unprepared device fails with
// cudaErrorInvalidValue.
template <class Kernel>
cudaError_t prepare_wgmma(Kernel kernel, int smem_bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, cudaError_t> prepared;
  int dev = 0;
  const cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  std::lock_guard<std::mutex> lock(mu);
  auto it = prepared.find(key);
  if (it == prepared.end()) it = prepared.emplace(key, prepare_wgmma_on_device(kernel, smem_bytes)).first;
  return it->second;
}

// A tensor map of `rank` dimensions (dims[0] innermost, strides[i] the byte stride of
// dims[i + 1]) for boxes of box[0] x ... elements, zero fill out of bounds.
// cuTensorMapEncodeTiled comes from the driver through the runtime (no libcuda link).
cudaError_t tensor_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, int rank,
                       const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                       CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                         cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode(map, type, rank, const_cast<void*>(base), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A 2-D tensor map over a row-major (rows, cols) array for tiles of box_rows x box_cols.
cudaError_t tensor_map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* base,
                          int64_t rows, int64_t cols, int64_t row_bytes, int box_rows,
                          int box_cols, CUtensorMapSwizzle swizzle,
                          CUtensorMapL2promotion promotion) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return tensor_map(map, type, base, 2, dims, strides, box, swizzle, promotion);
}

template <int FMT, bool BF16, int BITS, int BN>
cudaError_t launch_wgmma(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                         const void* sp, const uint8_t* zp, const float* tp, void* out,
                         const WParams& p, int splits) {
  const bool tiled = p.tiled;
  auto kernel = tiled ? wmatmul_wgmma_kernel<FMT, BF16, BITS, BN, true>
                      : wmatmul_wgmma_kernel<FMT, BF16, BITS, BN, false>;
  constexpr int kSmemLinear = wg_smem_bytes<FMT, BITS, BN, false>();
  constexpr int kSmemTiled = wg_smem_bytes<FMT, BITS, BN, true>();
  static_assert(kSmemLinear <= 227 * 1024 && kSmemTiled <= 227 * 1024,
                "the stages, epilogue and table must fit an SM's shared memory");
  static_assert(wg_fits<FMT, BN, BITS, false>(wg_stage_bytes<FMT, BITS, BN, false>()) &&
                    wg_fits<FMT, BN, BITS, true>(wg_stage_bytes<FMT, BITS, BN, true>()),
                "the CTAs per SM the kernel is built for must fit an SM's shared memory");
  const cudaError_t ready = prepare_wgmma(kernel, tiled ? kSmemTiled : kSmemLinear);
  if (ready != cudaSuccess) return ready;
  // x permuted (M, K128): boxes of BN rows x 64 k into the 128-byte swizzle the wgmma
  // descriptor names; codes (N, K / 2) bytes: boxes of 128 rows x 64 bytes (K % 32 == 0,
  // so rows are 16-byte aligned)
  CUtensorMap x_map, w_map;
  const int64_t k128 = p.n_steps * kWgStepK;
  cudaError_t e = tensor_map_2d(&x_map, BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                xp, p.x_rows, k128, 2 * k128, BN, 64, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  // A stage of kSub > 1 steps takes its codes as one 3-D box where K is whole steps: the
  // codes seen as (64 bytes, rows, 64-byte column blocks), box (64, 128, kSub), land as
  // [step][row][64 bytes], the layout of kSub 2-D boxes, in one copy, with one scale box
  // per stage instead of one per step: fewer copies to issue and wait for. Else (a
  // partial last step, which the 3-D box
  // would not zero-fill: its 64-byte blocks lie inside the row) one 2-D box of 128 rows x
  // 64 bytes per step.
  WParams q = p;
  constexpr int kSub = wg_sub<FMT, BITS, BN>();
  q.stage_codes = !tiled && kSub > 1 && p.K % kWgStepK == 0;
  CUtensorMap s_map = {}, z_map = {};
  if (tiled) {  // the prepared layout: 1-D bulk copies (WMatmulImpl checked the shapes)
    w_map = {};
    q.scale_boxes = 0;
    q.tile_srow = (kWgStepK >> p.bs_shift) * scale_bytes<FMT>(p);
    q.tile_zrow = FMT == kINT4 ? kWgStepK >> p.bs_shift : 0;
    if (p.bs > kWgStepK || (wg_tile_scale_row<FMT>() && q.tile_srow != wg_tile_scale_row<FMT>()) ||
        kWgRows * (q.tile_srow + q.tile_zrow) > wg_tiled_side_bytes<FMT, BITS, BN>() / wg_sub<FMT, BITS, BN, true>())
      return cudaErrorInvalidValue;  // not a layout of jax_fp4.layout.tileable
    if (reinterpret_cast<uintptr_t>(cp) % 16 != 0 || reinterpret_cast<uintptr_t>(sp) % 16 != 0 ||
        (FMT == kINT4 && reinterpret_cast<uintptr_t>(zp) % 16 != 0))
      return cudaErrorMisalignedAddress;
  } else if (e == cudaSuccess && q.stage_codes) {
    const cuuint64_t dims[3] = {kWgStepK / 2, static_cast<cuuint64_t>(p.N), static_cast<cuuint64_t>(p.K / kWgStepK)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.K / 2), kWgStepK / 2};
    const cuuint32_t box[3] = {kWgStepK / 2, kWgRows, kSub};
    e = tensor_map(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, cp, 3, dims, strides, box,
                   CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  } else if (e == cudaSuccess) {
    e = tensor_map_2d(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, cp, p.N, p.K / 2, p.K / 2, kWgRows,
                      kWgStepK / 2, CU_TENSOR_MAP_SWIZZLE_NONE,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  }
  if (e != cudaSuccess) return e;
  if (!tiled) {
    // Scale (and zero-point) boxes of 128 rows x 16 bytes per step of a stage, where the
    // stages have room, TMA can address the rows (row bytes % 16 == 0) and a step's scale
    // bytes, a power of two, fit in 16 (then they never straddle two aligned 16-byte boxes;
    // all but 32-bit scales in blocks of 16, and a stage's two steps' bytes lie within 32
    // bytes from the boundary before the first); else the lanes load the scales from
    // global memory.
    const int esize = scale_bytes<FMT>(p);
    const int lane_end = ((96 >> p.bs_shift) + (p.bs == 16 ? 2 : 1)) * esize;  // lane t = 3
    q.scale_boxes = wg_boxes<FMT, BITS, BN>() && (p.nb * esize) % 16 == 0 && lane_end <= kWgBoxCols &&
                    (FMT != kINT4 || p.nb % 16 == 0) && reinterpret_cast<uintptr_t>(sp) % 16 == 0 &&
                    (FMT != kINT4 || reinterpret_cast<uintptr_t>(zp) % 16 == 0);
    if (q.scale_boxes) {
      e = tensor_map_2d(&s_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, sp, p.N, p.nb * esize, p.nb * esize,
                        kWgRows, wg_box_cols<FMT, BITS, BN>(), CU_TENSOR_MAP_SWIZZLE_NONE,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
      if (e == cudaSuccess && FMT == kINT4)
        e = tensor_map_2d(&z_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, zp, p.N, p.nb, p.nb, kWgRows,
                          wg_box_cols<FMT, BITS, BN>(), CU_TENSOR_MAP_SWIZZLE_NONE,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
      if (e != cudaSuccess) return e;
    }
  }
  // clusters of p.cluster CTAs (jax_fp4/primitives.py, wmatmul_cluster), the weight tiles
  // rounded up to whole clusters (the kernel's raster)
  const int cluster_ctas = wg_can_multicast<BN>() && p.cluster == 2 ? 2 : 1;
  const int64_t n_tiles = ((p.N + kWgRows - 1) / kWgRows + cluster_ctas - 1) / cluster_ctas * cluster_ctas;
  const int64_t tiles = ((p.M + BN - 1) / BN) * n_tiles;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles), 1, static_cast<unsigned>(splits));
  cfg.blockDim = dim3(wg_threads<BN>());
  cfg.dynamicSmemBytes = tiled ? kSmemTiled : kSmemLinear;
  cfg.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_ctas;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = p.split_reduce ? splits : 1;  // the K-splits of a tile (wg_reduce_splits)
  cfg.attrs = &cluster;
  cfg.numAttrs = cluster_ctas > 1 || p.split_reduce ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, x_map, w_map, s_map, z_map, cp, sp, zp, tp, out, q);
}

template <int FMT, bool BF16, int BITS>
cudaError_t launch_kernel(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                          const void* sp, const uint8_t* zp, const float* tp, void* out,
                          const WParams& p, int splits, int64_t tile_m) {
  switch (tile_m) {
    case 8: return launch_wgmma<FMT, BF16, BITS, 8>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 16: return launch_wgmma<FMT, BF16, BITS, 16>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 32: return launch_wgmma<FMT, BF16, BITS, 32>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 64: return launch_wgmma<FMT, BF16, BITS, 64>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 128: return launch_wgmma<FMT, BF16, BITS, 128>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 256: return launch_wgmma<FMT, BF16, BITS, 256>(stream, xp, cp, sp, zp, tp, out, p, splits);
    default: break;
  }
  if (direct_path(p.M)) {
    const dim3 grid(static_cast<unsigned>((p.N + kDirectRowsPerCta - 1) / kDirectRowsPerCta), 1,
                    static_cast<unsigned>(splits));
    if (p.M <= 8)
      wmatmul_direct_kernel<FMT, BF16, BITS, 1><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_direct_kernel<FMT, BF16, BITS, 2><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  } else {
    const int mt = p.M <= 32 ? 4 : 8;
    const dim3 grid(static_cast<unsigned>((p.N + kRowsPerCta - 1) / kRowsPerCta),
                    static_cast<unsigned>((p.M + 8 * mt - 1) / (8 * mt)),
                    static_cast<unsigned>(splits));
    if (mt == 4)
      wmatmul_kernel<FMT, BF16, BITS, 4><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_kernel<FMT, BF16, BITS, 8><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  }
  return cudaGetLastError();
}

// The kernel instance of the call's decode path (use_bit_path).
template <int FMT, bool BF16>
cudaError_t launch_decode(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                          const void* sp, const uint8_t* zp, const float* tp, void* out,
                          const WParams& p, int splits, int64_t tile_m) {
  switch (use_bit_path<FMT, BF16>(p)) {
    case 0:  // (NVFP4 and MXFP4 always take their bit path)
      if constexpr (kHasTablePath<FMT>) return launch_kernel<FMT, BF16, 0>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
      break;
    case 1:
      if constexpr (kHasBitPath<FMT>) return launch_kernel<FMT, BF16, 1>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
      break;
    default:
      if constexpr (FMT == kINT4 && BF16)
        return launch_kernel<FMT, BF16, kBitsSplit>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
  }
  return cudaErrorInvalidValue;  // (use_bit_path gives no other path)
}

template <int FMT, bool BF16>
ffi::Error launch_fmt(cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& codes,
                      const ffi::AnyBuffer& scales, const ffi::AnyBuffer& zeros,
                      const ffi::AnyBuffer& ts, void* out, const WParams& p, int splits,
                      int64_t tile_m) {
  const cudaError_t e = launch_decode<FMT, BF16>(
      stream, static_cast<const uint16_t*>(x.untyped_data()), static_cast<const uint8_t*>(codes.untyped_data()),
      scales.untyped_data(), static_cast<const uint8_t*>(zeros.untyped_data()),
      static_cast<const float*>(ts.untyped_data()), out, p, splits, tile_m);
  if (e == cudaErrorNoKernelImageForDevice && tile_m > 0)
    return ffi::Error::InvalidArgument(
        "jax_fp4_wmatmul (CUDA): attribute `tile_m` = " + std::to_string(tile_m) +
        " asks for the wgmma kernel, which needs a compute capability 9.0 GPU and a build for "
        "sm_90a (CUDAARCHS containing 90a); use tile_m = 0");
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_fp4_wmatmul (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

template <bool BF16>
ffi::Error launch(int fmt, cudaStream_t stream, const ffi::AnyBuffer& x, const ffi::AnyBuffer& codes,
                  const ffi::AnyBuffer& scales, const ffi::AnyBuffer& zeros,
                  const ffi::AnyBuffer& ts, void* out, const WParams& p, int splits,
                  int64_t tile_m) {
  switch (fmt) {
    case kNVFP4: return launch_fmt<kNVFP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits, tile_m);
    case kMXFP4: return launch_fmt<kMXFP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits, tile_m);
    case kNF4: return launch_fmt<kNF4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits, tile_m);
    case kBNB_FP4: return launch_fmt<kBNB_FP4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits, tile_m);
    default: return launch_fmt<kINT4, BF16>(stream, x, codes, scales, zeros, ts, out, p, splits, tile_m);
  }
}

ffi::Error WMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                       ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer ts,
                       ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t block_size,
                       int32_t two_level, int64_t splits, int64_t tile_m, int64_t cluster,
                       int32_t tiled) {
  const std::string where = "jax_fp4_wmatmul (CUDA)";
  JF4_RETURN_IF_ERROR(check_dtype(where, "x", x.element_type(),
                                  {ffi::DataType::BF16, ffi::DataType::F16}));
  if (fmt != kNVFP4 && fmt != kMXFP4 && fmt != kNF4 && fmt != kBNB_FP4 && fmt != kINT4)
    return invalid(where, "attribute `fmt` = " + std::to_string(fmt) +
                              " has no fused kernel (nvfp4, mxfp4, nf4, bnb_fp4, int4 only)");
  if (tile_m != 0 && tile_m != 8 && tile_m != 16 && tile_m != 32 && tile_m != 64 && tile_m != 128 && tile_m != 256)
    return invalid(where, "attribute `tile_m` = " + std::to_string(tile_m) +
                              " must be 0 (mma.sync kernels) or 8, 16, 32, 64, 128, 256 (wgmma kernel)");
  if (cluster != 1 && !(cluster == 2 && tile_m == 256))
    return invalid(where, "attribute `cluster` = " + std::to_string(cluster) +
                              " must be 1, or 2 with tile_m = 256 (got tile_m = " +
                              std::to_string(tile_m) + ")");
  if (codes.dimensions().size() != 2)
    return invalid(where, "buffer `codes` must be 2-D (N, K/2), got shape " + dims_str(codes.dimensions()));
  const int64_t K = 2 * codes.dimensions()[1];
  if (tiled != 0 && tiled != 1)
    return invalid(where, "attribute `tiled` = " + std::to_string(tiled) + " must be 0 or 1");
  if (tiled && (tile_m == 0 || codes.dimensions()[0] % kWgRows != 0 || K % kWgStepK != 0))
    return invalid(where, "attribute `tiled` = 1 (the prepared weight layout) needs the wgmma "
                          "kernel (tile_m > 0) and N and K multiples of 128, got tile_m = " +
                              std::to_string(tile_m) + ", codes shape " + dims_str(codes.dimensions()));
  // the wgmma kernel takes x permuted within 128-k blocks and zero-padded to them
  const int64_t x_cols = tile_m > 0 ? (K + kWgStepK - 1) / kWgStepK * kWgStepK : K;
  if (x.dimensions().size() != 2 || x.dimensions()[1] != x_cols)
    return invalid(where, "buffer `x` must be 2-D (M, " + std::to_string(x_cols) +
                              ") for K = " + std::to_string(K) + " and tile_m = " +
                              std::to_string(tile_m) + ", got shape " + dims_str(x.dimensions()));
  // M = the output's rows; the wgmma kernel's x may have M rounded up to tile_m (zero rows,
  // primitives.wmatmul_x_layout), so that no activation box reaches past x's rows
  if (out->dimensions().size() != 3)
    return invalid(where, "result `out` must be 3-D (splits, M, N), got shape " + dims_str(out->dimensions()));
  const int64_t M = out->dimensions()[1];
  const int64_t x_rows = x.dimensions()[0];
  const int64_t m_tiled = tile_m > 0 ? (M + tile_m - 1) / tile_m * tile_m : M;
  if (x_rows != M && x_rows != m_tiled)
    return invalid(where, "buffer `x` must have the output's M = " + std::to_string(M) + " rows" +
                              (tile_m > 0 ? ", or M rounded up to tile_m (" + std::to_string(m_tiled) + ")"
                                          : std::string()) +
                              ", got " + std::to_string(x_rows));
  if (tile_m > 0 && (x_rows >= (int64_t{1} << 31) || codes.dimensions()[0] >= (int64_t{1} << 31)))
    return invalid(where, "the wgmma kernel (tile_m > 0) needs M < 2^31 and N < 2^31 (tensor "
                          "memory accelerator coordinates), got M = " + std::to_string(x_rows) +
                              ", N = " + std::to_string(codes.dimensions()[0]));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, 0, two_level,
                                       codes.dimensions()[0], K, &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  // the per-tensor scale: one per weight row, or one for the whole weight
  JF4_RETURN_IF_ERROR(check_dtype(where, "ts", ts.element_type(), {ffi::DataType::F32}));
  if (ts.dimensions().size() != 1 || (ts.dimensions()[0] != p.R && ts.dimensions()[0] != 1))
    return invalid(where, "buffer `ts` must be 1-D of N = " + std::to_string(p.R) +
                              " or 1 elements, got shape " + dims_str(ts.dimensions()));
  if ((fmt == kNVFP4 && block_size != 16) || (fmt == kMXFP4 && block_size != 32))
    return invalid(where, "attribute `block_size` = " + std::to_string(block_size) +
                              ": the fused kernel decodes nvfp4 in blocks of 16 and mxfp4 in "
                              "blocks of 32 (the formats' specs)");
  if (K % 32 != 0 || K >= (int64_t{1} << 31) || block_size < 16 ||
      (block_size & (block_size - 1)) != 0)
    return invalid(where, "the fused kernel needs K a multiple of 32, K < 2^31 and a power-of-two "
                          "block_size >= 16, got K = " + std::to_string(K) + ", block_size = " +
                              std::to_string(block_size));
  if (tiled) {  // the layouts jax_fp4.layout.tileable makes (wg_tiled_side_bytes)
    const int64_t per_step = block_size > kWgStepK ? 0 : kWgStepK / block_size;
    // (the bytes of scale_bytes<FMT>, for the fmt known here at run time)
    const int64_t esize = fmt == kNF4 || fmt == kBNB_FP4 || (fmt == kINT4 && p.scale_type == kScaleF32) ? 4
                          : fmt == kINT4 ? 2 : 1;
    const int64_t row = per_step * (esize + (fmt == kINT4 ? 1 : 0));
    if (per_step == 0 || kWgRows * row > kWgTiledSide)
      return invalid(where, "attribute `tiled` = 1 (the prepared weight layout) needs block_size <= 128 "
                            "and at most " + std::to_string(kWgTiledSide / kWgRows) + " scale and zero-point "
                            "bytes per row and 128 k, got block_size = " + std::to_string(block_size) +
                                " with " + std::to_string(row));
  }
  const int64_t step = step_k(M, tile_m);
  const int64_t n_steps = (K + step - 1) / step;
  if (splits < 1 || splits > 65535 || (n_steps > 0 && splits > n_steps))
    return invalid(where, "attribute `splits` = " + std::to_string(splits) +
                              " must be in [1, min(65535, ceil(K / " + std::to_string(step) +
                              "))]");
  // out (1, M, N) with splits > 1: the wgmma kernel sums the K-splits of a tile in their
  // cluster (wg_reduce_splits); else (splits, M, N), one partial per split
  const bool split_reduce = splits > 1 && out->dimensions().size() == 3 && out->dimensions()[0] == 1;
  if (split_reduce && (tile_m == 0 || tile_m > 128 || splits > kWgMaxClusterSplits || cluster != 1))
    return invalid(where, "result `out` of shape (1, M, N) with `splits` = " + std::to_string(splits) +
                              " (the K-splits summed in the kernel) needs the wgmma kernel with "
                              "tile_m <= 128, splits <= " + std::to_string(kWgMaxClusterSplits) +
                              " and cluster = 1, got tile_m = " + std::to_string(tile_m) +
                              ", cluster = " + std::to_string(cluster));
  if (splits == 1 || split_reduce)
    JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(),
                                    {ffi::DataType::F32, x.element_type()}));
  else
    JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(), {ffi::DataType::F32}));
  JF4_RETURN_IF_ERROR(check_shape(where, "out", out->dimensions(),
                                  {split_reduce ? 1 : splits, M, p.R}));
  if (M == 0 || p.R == 0) return ffi::Error::Success();
  if (K == 0) {
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(where + ": " + cudaGetErrorString(e));
  }
  WParams w;
  w.M = M;
  w.x_rows = x_rows;
  w.N = p.R;
  w.K = K;
  w.K32 = static_cast<int>(K);
  w.nb = p.nb;
  w.bs = static_cast<int>(block_size);
  w.bs_shift = 0;
  while ((int64_t{1} << w.bs_shift) < block_size) ++w.bs_shift;
  w.n_steps = n_steps;
  w.steps_per_split = (n_steps + splits - 1) / splits;
  w.two_level = p.two_level;
  w.ts_stride = ts.dimensions()[0] == p.R && p.R > 1 ? 1 : 0;
  w.st = p.scale_type;
  w.out_f32 = out->element_type() == ffi::DataType::F32;
  w.scale_boxes = 0;  // launch_wgmma decides
  w.stage_codes = 0;  // launch_wgmma decides
  w.tiled = tiled;
  w.cluster = static_cast<int>(cluster);
  w.split_reduce = split_reduce ? 1 : 0;
  void* o = out->untyped_data();
  return x.element_type() == ffi::DataType::BF16
             ? launch<true>(fmt, stream, x, codes, scales, zeros, ts, o, w, static_cast<int>(splits), tile_m)
             : launch<false>(fmt, stream, x, codes, scales, zeros, ts, o, w, static_cast<int>(splits), tile_m);
}

// jax_fp4_wmatmul_v1 / v2: v3 without the `cluster` (clusters of 1) and `tiled` (the
// linear layout) attributes, for artifacts that name them
ffi::Error WMatmulV1Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                         ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer ts,
                         ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t block_size,
                         int32_t two_level, int64_t splits, int64_t tile_m) {
  return WMatmulImpl(stream, x, codes, scales, zeros, ts, out, fmt, block_size, two_level, splits,
                     tile_m, 1, 0);
}
ffi::Error WMatmulV2Impl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                         ffi::AnyBuffer scales, ffi::AnyBuffer zeros, ffi::AnyBuffer ts,
                         ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t block_size,
                         int32_t two_level, int64_t splits, int64_t tile_m, int64_t cluster) {
  return WMatmulImpl(stream, x, codes, scales, zeros, ts, out, fmt, block_size, two_level, splits,
                     tile_m, cluster, 0);
}

auto WMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()  // x (M, K) bf16/f16 (tile_m > 0: (M or M rounded up to tile_m, K128), permuted)
      .Arg<ffi::AnyBuffer>()  // codes (N, K/2) u8 (tiled: the prepared layout)
      .Arg<ffi::AnyBuffer>()  // scales (N, K/bs) (tiled: the prepared layout)
      .Arg<ffi::AnyBuffer>()  // zeros (N, K/bs) u8 or (0,)
      .Arg<ffi::AnyBuffer>()  // ts (N,) or (1,) f32
      .Ret<ffi::AnyBuffer>()  // partial sums (S, M, N) f32, or x's dtype when S = 1; or the
                              // sum (1, M, N) in f32 / x's dtype (the kernel sums S > 1 splits)
      .Attr<int32_t>("fmt")
      .Attr<int64_t>("block_size")
      .Attr<int32_t>("two_level")
      .Attr<int64_t>("splits")
      .Attr<int64_t>("tile_m");
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4WMatmulV1Cuda, jf4::cuda::WMatmulV1Impl,
                              jf4::cuda::WMatmulBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4WMatmulV2Cuda, jf4::cuda::WMatmulV2Impl,
                              jf4::cuda::WMatmulBinding().Attr<int64_t>("cluster"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4WMatmulV3Cuda, jf4::cuda::WMatmulImpl,
                              jf4::cuda::WMatmulBinding().Attr<int64_t>("cluster").Attr<int32_t>("tiled"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
