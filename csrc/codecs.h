// jax-fp4 codecs: the bit-level semantics of docs/spec.md section 3, written once for
// the CPU handlers and the CUDA kernels (every function is __host__ __device__ under
// nvcc). Plain IEEE float32 arithmetic in exactly the order the spec gives; no
// fast-math, no FMA contraction (build with -ffp-contract=off / nvcc -fmad=false) and
// no flush-to-zero (the CPU handlers clear FTZ/DAZ; see ffi_util.h).
//
// Conventions: codes are returned unpacked (one element per uint8); scales are
// returned as the raw bits of their storage type (E4M3 / E8M0 byte, f32 word, bf16 /
// f16 half-word). Packing into the little-endian bit stream is done by the caller
// (pack_row / unpack_row below).
#ifndef JAX_FP4_CSRC_CODECS_H_
#define JAX_FP4_CSRC_CODECS_H_

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#ifdef __CUDACC__
#define JF4_HD __host__ __device__ __forceinline__
#else
#define JF4_HD inline
#endif

// Everything below lives in an inline namespace named after the instruction set the
// translation unit is compiled for (JF4_ISA_NS: base, avx2, ...): the CPU kernels are
// compiled once per ISA and their inline functions must not be merged across ISAs.
#ifndef JF4_ISA_NS
#define JF4_ISA_NS base
#endif
#define JF4_ISA_TAG_(ns) isa_##ns
#define JF4_ISA_TAG_X_(ns) JF4_ISA_TAG_(ns)
#define JF4_ISA_TAG JF4_ISA_TAG_X_(JF4_ISA_NS)

namespace jf4 {
inline namespace JF4_ISA_TAG {

// ---------------------------------------------------------------------------------
// Format ids (attribute `fmt`, csrc/README.md) and per-format constants.
// ---------------------------------------------------------------------------------
enum Fmt : int {
  kNVFP4 = 0,
  kMXFP4 = 1,
  kMXFP6_E2M3 = 2,
  kMXFP6_E3M2 = 3,
  kMXFP8_E4M3 = 4,
  kMXFP8_E5M2 = 5,
  kNF4 = 6,
  kBNB_FP4 = 7,
  kINT4 = 8,
  kNumFmts = 9,
};

// Storage type of INT4 scales (decided by the scales buffer's dtype).
enum ScaleType : int { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2 };

JF4_HD constexpr int elem_bits(int fmt) {
  return (fmt == kMXFP6_E2M3 || fmt == kMXFP6_E3M2)   ? 6
         : (fmt == kMXFP8_E4M3 || fmt == kMXFP8_E5M2) ? 8
                                                      : 4;
}
JF4_HD constexpr bool is_mx(int fmt) { return fmt >= kMXFP4 && fmt <= kMXFP8_E5M2; }
JF4_HD constexpr bool is_codebook(int fmt) { return fmt == kNF4 || fmt == kBNB_FP4; }

// ---------------------------------------------------------------------------------
// Bit casts.
// ---------------------------------------------------------------------------------
JF4_HD uint32_t f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
JF4_HD float u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

constexpr uint32_t kAbsMask = 0x7fffffffu;
constexpr uint32_t kInfBits = 0x7f800000u;
constexpr uint32_t kQuietNaNBits = 0x7fc00000u;

JF4_HD float f32_nan() { return u2f(kQuietNaNBits); }
JF4_HD bool bits_nonfinite(uint32_t abs_bits) { return abs_bits >= kInfBits; }

// Round half to even for |v| <= 2^22 (callers clamp first). Default rounding mode.
JF4_HD float rint_small(float v) {
#ifdef __CUDA_ARCH__
  return rintf(v);
#else
  // (v + 1.5*2^23) lands in [2^23, 2^24) where the ulp is 1: the addition rounds to
  // an integer (RNE); the subtraction is exact. Vectorises without SSE4.1.
  const float magic = 12582912.0f;
  return (v + magic) - magic;
#endif
}

// Clamp written with ordered compares (vectorises to max/min). NaN gives lo, so that
// results computed (and then discarded) for non-finite blocks stay well defined.
JF4_HD float clampf(float v, float lo, float hi) {
  v = v > lo ? v : lo;
  return v < hi ? v : hi;
}
JF4_HD float maxf(float a, float b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------
// 16-bit float conversions (exact; round to nearest even; subnormals kept).
// ---------------------------------------------------------------------------------
JF4_HD float bf16_to_f32(uint16_t h) { return u2f(static_cast<uint32_t>(h) << 16); }

JF4_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;  // quiet NaN, sign and top payload kept
  return static_cast<uint16_t>((u & kAbsMask) > kInfBits ? nan : r);
}

JF4_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Re-biasing by a multiply by 2^112 handles normals and subnormals exactly (the
  // shifted subnormal is an f32 subnormal: needs DAZ off).
  const uint32_t fin = f2u(u2f(em << 13) * 0x1p112f);
  const uint32_t spec = kInfBits | ((em & 0x3ffu) << 13);  // Inf / NaN
  return u2f((em >= 0x7c00u ? spec : fin) | sign);
}

// f32 -> IEEE binary16, round to nearest even, overflow to Inf, NaN stays NaN.
// (Algorithm of the FP16 library by M. Dukhan; needs IEEE arithmetic without FTZ.)
JF4_HD uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  const uint32_t w = f2u(f);
  const float af = u2f(w & kAbsMask);
  float base = (af * scale_to_inf) * scale_to_zero;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = u2f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f2u(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa_bits = bits & 0x00000fffu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

// ---------------------------------------------------------------------------------
// Minifloats: E2M1, E2M3, E3M2, E4M3(fn), E5M2.
// Encode: round to nearest even from float32, saturating to the largest finite value;
// the sign bit is always kept (-0.0 and negatives that round to zero set it).
// ---------------------------------------------------------------------------------
template <int E, int M, int B, uint32_t MAXCODE>
JF4_HD uint32_t encode_minifloat(float x) {
  const uint32_t u = f2u(x);
  const uint32_t sign = (u >> 31) << (E + M);
  const uint32_t a = u & kAbsMask;
  constexpr int D = 23 - M;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - B) << 23;
  // Target-normal range: RNE on the f32 bit pattern (a carry bumps the exponent).
  const uint32_t r = a + ((1u << (D - 1)) - 1u) + ((a >> D) & 1u);
  const uint32_t c_norm = (r >> D) - (static_cast<uint32_t>(127 - B) << M);
  // Target-subnormal range: |x| * 2^(B-1+M) is exact; RNE to an integer in [0, 2^M]
  // (2^M is the smallest normal, which is also its code).
  const float as = u2f(a < kMinNormalBits ? a : kMinNormalBits);
  const float scaled = as * u2f(static_cast<uint32_t>(127 + B - 1 + M) << 23);
  const uint32_t c_sub = static_cast<uint32_t>(static_cast<int32_t>(rint_small(scaled)));
  uint32_t c = a >= kMinNormalBits ? c_norm : c_sub;
  c = c > MAXCODE ? MAXCODE : c;
  // The sign bit is kept (also for -0.0 and negatives that round to zero).
  return c | sign;
}

// Decode of a normal/subnormal minifloat without special values.
template <int E, int M, int B>
JF4_HD float decode_minifloat(uint32_t c) {
  const uint32_t sign = (c >> (E + M)) & 1u;
  const uint32_t e = (c >> M) & ((1u << E) - 1u);
  const uint32_t m = c & ((1u << M) - 1u);
  const float sub = static_cast<float>(m) * u2f(static_cast<uint32_t>(127 + 1 - B - M) << 23);
  const float nrm = u2f(((e + 127u - B) << 23) | (m << (23 - M)));
  const float mag = e == 0 ? sub : nrm;
  return sign ? -mag : mag;
}

JF4_HD uint32_t e2m1_encode(float x) { return encode_minifloat<2, 1, 1, 0x7u>(x); }
JF4_HD uint32_t e2m3_encode(float x) { return encode_minifloat<2, 3, 1, 0x1fu>(x); }
JF4_HD uint32_t e3m2_encode(float x) { return encode_minifloat<3, 2, 3, 0x1fu>(x); }
JF4_HD uint32_t e4m3_encode(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt.rn.satfinite.e4m3x2.f32: the same RNE with saturation to 448 (a NaN input would
  // give NaN instead of 448; no caller passes one, they all clamp first)
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
#else
  return encode_minifloat<4, 3, 7, 0x7eu>(x);
#endif
}
JF4_HD uint32_t e5m2_encode(float x) { return encode_minifloat<5, 2, 15, 0x7bu>(x); }

JF4_HD float e2m1_decode(uint32_t c) { return decode_minifloat<2, 1, 1>(c & 0xfu); }
JF4_HD float e2m3_decode(uint32_t c) { return decode_minifloat<2, 3, 1>(c & 0x3fu); }
JF4_HD float e3m2_decode(uint32_t c) { return decode_minifloat<3, 2, 3>(c & 0x3fu); }
// float8_e4m3fn: no Inf; S.1111.111 is NaN.
JF4_HD float e4m3_decode(uint32_t c) {
  c &= 0xffu;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt.rn.f16x2.e4m3x2 (exact) then f16 -> f32 (exact)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), __NV_E4M3)));
#endif
  return (c & 0x7fu) == 0x7fu ? f32_nan() : decode_minifloat<4, 3, 7>(c);
}
// float8_e5m2: IEEE-like; exponent 31 is Inf (m == 0) or NaN.
JF4_HD float e5m2_decode(uint32_t c) {
  c &= 0xffu;
  const bool special = (c & 0x7cu) == 0x7cu;
  const float spec = (c & 3u) ? f32_nan() : ((c & 0x80u) ? -u2f(kInfBits) : u2f(kInfBits));
  return special ? spec : decode_minifloat<5, 2, 15>(c);
}

// ---------------------------------------------------------------------------------
// E8M0 (float8_e8m0fnu) scales.
// ---------------------------------------------------------------------------------
// 2^(c-127); c = 0 is 2^-127 (an f32 subnormal); c = 255 is NaN.
JF4_HD float e8m0_decode(uint32_t c) {
  c &= 0xffu;
  const float p = u2f(c == 0 ? 0x00400000u : (c << 23));
  return c == 255u ? f32_nan() : p;
}
// 2^(127-c) for c in [0, 254] (the element multiplier of MX quantization).
JF4_HD float e8m0_inverse(uint32_t c) {
  return u2f(c >= 254u ? 0x00400000u : ((254u - c) << 23));
}
// scale_rounding="floor": code = clamp(exponent_field(amax) - emax, 0, 254).
JF4_HD uint32_t e8m0_floor(uint32_t amax_bits, int emax) {
  const int ef = static_cast<int>((amax_bits >> 23) & 0xffu);
  int c = ef - emax;
  c = c < 0 ? 0 : c;
  c = c > 254 ? 254 : c;
  return static_cast<uint32_t>(c);
}
// scale_rounding="rceil": exact power-of-two ceiling of q = f32(amax / max_elem).
JF4_HD uint32_t e8m0_rceil(float amax, float max_elem) {
  const float q = amax / max_elem;
  const uint32_t qb = f2u(q);
  const uint32_t ef = (qb >> 23) & 0xffu;
  uint32_t c = ef + ((qb & 0x7fffffu) != 0u ? 1u : 0u);
  c = c > 254u ? 254u : c;
  const uint32_t c_sub = qb > 0x00400000u ? 1u : 0u;  // q > 2^-127
  return ef > 0u ? c : c_sub;
}

// ---------------------------------------------------------------------------------
// Element codecs per format (MX element type selected by the format id).
// ---------------------------------------------------------------------------------
template <int FMT>
struct MxElem;
template <>
struct MxElem<kMXFP4> {
  static constexpr int emax = 2;
  JF4_HD static float max_elem() { return 6.0f; }
  JF4_HD static uint32_t encode(float v) { return e2m1_encode(v); }
  JF4_HD static float decode(uint32_t c) { return e2m1_decode(c); }
};
template <>
struct MxElem<kMXFP6_E2M3> {
  static constexpr int emax = 2;
  JF4_HD static float max_elem() { return 7.5f; }
  JF4_HD static uint32_t encode(float v) { return e2m3_encode(v); }
  JF4_HD static float decode(uint32_t c) { return e2m3_decode(c); }
};
template <>
struct MxElem<kMXFP6_E3M2> {
  static constexpr int emax = 4;
  JF4_HD static float max_elem() { return 28.0f; }
  JF4_HD static uint32_t encode(float v) { return e3m2_encode(v); }
  JF4_HD static float decode(uint32_t c) { return e3m2_decode(c); }
};
template <>
struct MxElem<kMXFP8_E4M3> {
  static constexpr int emax = 8;
  JF4_HD static float max_elem() { return 448.0f; }
  JF4_HD static uint32_t encode(float v) { return e4m3_encode(v); }
  JF4_HD static float decode(uint32_t c) { return e4m3_decode(c); }
};
template <>
struct MxElem<kMXFP8_E5M2> {
  static constexpr int emax = 15;
  JF4_HD static float max_elem() { return 57344.0f; }
  JF4_HD static uint32_t encode(float v) { return e5m2_encode(v); }
  JF4_HD static float decode(uint32_t c) { return e5m2_decode(c); }
};

// ---------------------------------------------------------------------------------
// Codebooks (NF4: bitsandbytes' values; bnb_fp4: [0, 0.0625, 8, 12, 4, 6, 2, 3]/12,
// negatives for codes 9..15, code 8 = +0.0). Boundaries: float32 midpoints of the
// table sorted with a stable sort; code = kOrder[#boundaries strictly below scaled].
// ---------------------------------------------------------------------------------
#define JF4_NF4_TABLE                                                                   \
  {-0x1p+0f,        -0x1.647362p-1f, -0x1.0cd66p-1f,  -0x1.94654p-2f, -0x1.23449ap-2f, \
   -0x1.7a6a7ep-3f, -0x1.74f0e2p-4f, 0x0p+0f,         0x1.45f5fep-4f, 0x1.4995c6p-3f,  \
   0x1.f809bap-3f,  0x1.5a0674p-2f,  0x1.c3497p-2f,   0x1.200f56p-1f, 0x1.722766p-1f,  \
   0x1p+0f}
#define JF4_NF4_BOUNDS                                                                   \
  {-0x1.b239bp-1f,  -0x1.38a4ep-1f,  -0x1.d709p-2f,  -0x1.5bd4ecp-2f, -0x1.e079d8p-3f,  \
   -0x1.1a7178p-3f, -0x1.74f0e2p-5f, 0x1.45f5fep-5f, 0x1.ec90c4p-4f,  0x1.a0cfcp-3f,    \
   0x1.2b05a8p-2f,  0x1.8ea7f2p-2f,  0x1.00da08p-1f, 0x1.491b5ep-1f,  0x1.b913b4p-1f}
#define JF4_NF4_ORDER {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}
#define JF4_FP4_TABLE                                                                  \
  {0x0p+0f,         0x1.555556p-8f,  0x1.555556p-1f, 0x1p+0f,  0x1.555556p-2f, 0x1p-1f, \
   0x1.555556p-3f,  0x1p-2f,         0x0p+0f,        -0x1.555556p-8f,                   \
   -0x1.555556p-1f, -0x1p+0f,        -0x1.555556p-2f, -0x1p-1f, -0x1.555556p-3f,        \
   -0x1p-2f}
#define JF4_FP4_BOUNDS                                                                   \
  {-0x1.aaaaacp-1f, -0x1.2aaaacp-1f, -0x1.aaaaacp-2f, -0x1.2aaaacp-2f, -0x1.aaaaacp-3f, \
   -0x1.6p-4f,      -0x1.555556p-9f, 0x0p+0f,         0x1.555556p-9f,  0x1.6p-4f,       \
   0x1.aaaaacp-3f,  0x1.2aaaacp-2f,  0x1.aaaaacp-2f,  0x1.2aaaacp-1f,  0x1.aaaaacp-1f}
#define JF4_FP4_ORDER {11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3}

inline constexpr float kNF4Table[16] = JF4_NF4_TABLE;
inline constexpr float kNF4Bounds[15] = JF4_NF4_BOUNDS;
inline constexpr uint8_t kNF4Order[16] = JF4_NF4_ORDER;
inline constexpr float kFP4Table[16] = JF4_FP4_TABLE;
inline constexpr float kFP4Bounds[15] = JF4_FP4_BOUNDS;
inline constexpr uint8_t kFP4Order[16] = JF4_FP4_ORDER;
#ifdef __CUDACC__
static __constant__ float kNF4TableDev[16] = JF4_NF4_TABLE;
static __constant__ float kNF4BoundsDev[15] = JF4_NF4_BOUNDS;
static __constant__ uint8_t kNF4OrderDev[16] = JF4_NF4_ORDER;
static __constant__ float kFP4TableDev[16] = JF4_FP4_TABLE;
static __constant__ float kFP4BoundsDev[15] = JF4_FP4_BOUNDS;
static __constant__ uint8_t kFP4OrderDev[16] = JF4_FP4_ORDER;
#endif
#ifdef __CUDA_ARCH__
#define JF4_CBT(name) name##Dev
#else
#define JF4_CBT(name) name
#endif

template <int FMT>
struct Codebook;
template <>
struct Codebook<kNF4> {
  JF4_HD static float value(uint32_t c) { return JF4_CBT(kNF4Table)[c & 15u]; }
  JF4_HD static float bound(int i) { return JF4_CBT(kNF4Bounds)[i]; }
  JF4_HD static uint32_t order(uint32_t i) { return JF4_CBT(kNF4Order)[i & 15u]; }
};
template <>
struct Codebook<kBNB_FP4> {
  JF4_HD static float value(uint32_t c) { return JF4_CBT(kFP4Table)[c & 15u]; }
  JF4_HD static float bound(int i) { return JF4_CBT(kFP4Bounds)[i]; }
  JF4_HD static uint32_t order(uint32_t i) { return JF4_CBT(kFP4Order)[i & 15u]; }
};

// Number of boundaries strictly below `scaled` (torch.bucketize, right=False).
template <int FMT>
JF4_HD uint32_t bucketize(float scaled) {
  uint32_t n = 0;
#ifdef __CUDA_ARCH__
#pragma unroll
#endif
  for (int i = 0; i < 15; ++i) n += scaled > Codebook<FMT>::bound(i) ? 1u : 0u;
  return n;
}

// ---------------------------------------------------------------------------------
// INT4 scale storage.
// ---------------------------------------------------------------------------------
JF4_HD uint32_t scale_to_bits(float s, int st) {
  return st == kScaleBF16 ? f32_to_bf16(s) : (st == kScaleF16 ? f32_to_f16(s) : f2u(s));
}
JF4_HD float scale_from_bits(uint32_t b, int st) {
  return st == kScaleBF16 ? bf16_to_f32(static_cast<uint16_t>(b))
                          : (st == kScaleF16 ? f16_to_f32(static_cast<uint16_t>(b)) : u2f(b));
}
JF4_HD uint32_t scale_nan_bits(int st) {
  return st == kScaleBF16 ? 0x7fc0u : (st == kScaleF16 ? 0x7e00u : kQuietNaNBits);
}

// ---------------------------------------------------------------------------------
// Block statistics.
// ---------------------------------------------------------------------------------
// max |x| as f32 bits; >= kInfBits means the block holds NaN or +-Inf.
JF4_HD uint32_t block_absmax_bits(const float* __restrict__ x, int n) {
  uint32_t m = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t a = f2u(x[i]) & kAbsMask;
    m = a > m ? a : m;
  }
  return m;
}

// f32 <-> int32 key with the same total order (-0.0 sorts just below +0.0).
JF4_HD int32_t f32_order_key(float f) {
  const int32_t i = static_cast<int32_t>(f2u(f));
  return i ^ ((i >> 31) & 0x7fffffff);
}
JF4_HD float f32_from_order_key(int32_t k) {
  return u2f(static_cast<uint32_t>(k ^ ((k >> 31) & 0x7fffffff)));
}

// ---------------------------------------------------------------------------------
// Quantization, split into a per-block part (scale code and element multiplier, from
// the block statistics) and a per-element encoder, so that kernels can vectorise
// either across blocks or across elements. The *_quantize_block functions below
// compose them for one block.
// A block containing NaN/Inf gets the NaN scale and all-zero codes.
// ---------------------------------------------------------------------------------
constexpr uint32_t kE4M3NaN = 0x7fu;
constexpr uint32_t kE8M0NaN = 0xffu;

// NVFP4 (TWO_LEVEL: ts is the row's decode tensor scale, already checked usable, see
// nvfp4_bad_tensor_scale; an unusable ts makes every block of the row NaN-scaled).
// s = e4m3_rne(clamp(amax/6 [/ts], 2^-6, 448)).
template <bool TWO_LEVEL>
JF4_HD uint32_t nvfp4_scale_code(float amax, float ts) {
  float t = amax / 6.0f;
  if (TWO_LEVEL) t = t / ts;
  return e4m3_encode(clampf(t, 0x1p-6f, 448.0f));
}
// Element multiplier: 1/s (one level) or (1/ts)/s (two levels).
template <bool TWO_LEVEL>
JF4_HD float nvfp4_elem_mult(uint32_t scale_code, float ts) {
  const float s = e4m3_decode(scale_code);
  return TWO_LEVEL ? (1.0f / ts) / s : 1.0f / s;
}
JF4_HD uint32_t nvfp4_encode(float x, float mult) {
  return e2m1_encode(clampf(x * mult, -6.0f, 6.0f));
}
// NVFP4 per-tensor decode scale from the tensor's absmax bits (reference
// tensor_scale_from_amax): amax / 2688 (IEEE division), at least 2^-120; amax == 0 gives
// 1; NaN / Inf amax give NaN / Inf.
JF4_HD float nvfp4_tensor_scale_from_amax(uint32_t amax_bits) {
  if ((amax_bits & kAbsMask) == 0) return 1.0f;
  const float pts = u2f(amax_bits & kAbsMask) / 2688.0f;
  return (pts >= 0x1p-120f || pts != pts) ? pts : 0x1p-120f;
}
JF4_HD bool nvfp4_bad_tensor_scale(float ts) {
  // not finite, or < 2^-120 (negative included)
  return !(ts >= 0x1p-120f) || (f2u(ts) & kAbsMask) >= kInfBits;
}

// MX: E8M0 scale code from the block amax, element multiplier 2^(127-code).
template <int FMT>
JF4_HD uint32_t mx_scale_code(uint32_t amax_bits, bool rceil) {
  using El = MxElem<FMT>;
  const uint32_t c_ceil = e8m0_rceil(u2f(amax_bits), El::max_elem());
  const uint32_t c_floor = e8m0_floor(amax_bits, El::emax);
  return rceil ? c_ceil : c_floor;
}
template <int FMT>
JF4_HD uint32_t mx_encode(float x, float mult) {
  const float me = MxElem<FMT>::max_elem();
  return MxElem<FMT>::encode(clampf(x * mult, -me, me));
}

// Codebooks: multiplier 1/max(absmax, 1e-38); position = #boundaries below scaled.
JF4_HD float codebook_mult(uint32_t amax_bits) { return 1.0f / maxf(u2f(amax_bits), 1e-38f); }
template <int FMT>
JF4_HD uint32_t codebook_position(float x, float mult) {
  return bucketize<FMT>(clampf(x * mult, -1.0f, 1.0f));
}
template <int FMT>
JF4_HD uint32_t codebook_code(uint32_t position) {
  return FMT == kNF4 ? position : Codebook<FMT>::order(position);
}

// INT4 (AutoAWQ rule) from the block min / max. The scale is rounded to its storage
// type first and the rounded value is used. Float16 scales saturate at 65504 instead of
// overflowing. A wide block (max - min >= 2^127, or overflowing) takes s = max(max, -min)/8
// (exact), rounded toward zero to the storage type, and z = 8 if -min >= max else 7, so
// that every code decodes to a finite value (docs/spec.md section 3, INT4; reference
// _quantize_int4).
struct Int4Params {
  uint32_t scale_bits;  // in storage type st
  float s;              // the stored scale as float32
  float z;              // zero point in [0, 15]
};
constexpr uint32_t kF16MaxBits = 0x7bffu;  // 65504
JF4_HD Int4Params int4_params(float mn, float mx, int st) {
  Int4Params p;
  const float d = mx - mn;
  if (!(d < 0x1p127f)) {
    const uint32_t sw = f2u(maxf(mx, -mn)) - (3u << 23);  // m / 8, m >= 2^126
    p.scale_bits = st == kScaleBF16 ? (sw >> 16) : (st == kScaleF16 ? kF16MaxBits : sw);
    p.s = scale_from_bits(p.scale_bits, st);
    p.z = -mn >= mx ? 8.0f : 7.0f;
    return p;
  }
  const float s32 = maxf(d, 1e-5f) / 15.0f;
  p.scale_bits = scale_to_bits(s32, st);
  if (st == kScaleF16 && p.scale_bits == 0x7c00u) p.scale_bits = kF16MaxBits;
  p.s = scale_from_bits(p.scale_bits, st);
  // rint of a value clamped to [-64, 64] gives the same final clamp as the unclamped one.
  p.z = clampf(-rint_small(clampf(mn / p.s, -64.0f, 64.0f)), 0.0f, 15.0f);
  return p;
}
JF4_HD uint32_t int4_encode(float x, float s, float z) {
  const float q = clampf(rint_small(clampf(x / s, -64.0f, 64.0f)) + z, 0.0f, 15.0f);
  return static_cast<uint32_t>(static_cast<int32_t>(q));
}

// min / max of a block as order keys (see f32_order_key) and the abs-max bits.
JF4_HD void block_minmax(const float* __restrict__ x, int n, int32_t* kmin_out,
                         int32_t* kmax_out, uint32_t* amax_bits_out) {
  uint32_t amax_bits = 0;
  int32_t kmin = 0x7fffffff, kmax = -0x7fffffff - 1;
  for (int i = 0; i < n; ++i) {
    const uint32_t a = f2u(x[i]) & kAbsMask;
    amax_bits = a > amax_bits ? a : amax_bits;
    const int32_t k = f32_order_key(x[i]);
    kmin = k < kmin ? k : kmin;
    kmax = k > kmax ? k : kmax;
  }
  *kmin_out = kmin;
  *kmax_out = kmax;
  *amax_bits_out = amax_bits;
}

// --- one block: x[0..n) -> codes[0..n) (unpacked); returns the scale bits ---------
template <bool TWO_LEVEL>
JF4_HD uint32_t nvfp4_quantize_block(const float* __restrict__ x, int n, float ts,
                                     uint8_t* __restrict__ codes) {
  const uint32_t amax_bits = block_absmax_bits(x, n);
  if (bits_nonfinite(amax_bits) || (TWO_LEVEL && nvfp4_bad_tensor_scale(ts))) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    return kE4M3NaN;
  }
  const uint32_t sc = nvfp4_scale_code<TWO_LEVEL>(u2f(amax_bits), ts);
  const float r = nvfp4_elem_mult<TWO_LEVEL>(sc, ts);
  for (int i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(nvfp4_encode(x[i], r));
  return sc;
}

template <int FMT>
JF4_HD uint32_t mx_quantize_block(const float* __restrict__ x, int n, bool rceil,
                                  uint8_t* __restrict__ codes) {
  const uint32_t amax_bits = block_absmax_bits(x, n);
  if (bits_nonfinite(amax_bits)) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    return kE8M0NaN;
  }
  const uint32_t sc = mx_scale_code<FMT>(amax_bits, rceil);
  const float mult = e8m0_inverse(sc);
  for (int i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(mx_encode<FMT>(x[i], mult));
  return sc;
}

// Returns the f32 bits of the stored absmax.
template <int FMT>
JF4_HD uint32_t codebook_quantize_block(const float* __restrict__ x, int n,
                                        uint8_t* __restrict__ codes) {
  const uint32_t amax_bits = block_absmax_bits(x, n);
  if (bits_nonfinite(amax_bits)) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    return kQuietNaNBits;
  }
  const float mult = codebook_mult(amax_bits);
  for (int i = 0; i < n; ++i)
    codes[i] = static_cast<uint8_t>(codebook_code<FMT>(codebook_position<FMT>(x[i], mult)));
  return amax_bits;
}

// Returns the scale bits in storage type `st`; *zero gets z.
JF4_HD uint32_t int4_quantize_block(const float* __restrict__ x, int n, int st,
                                    uint8_t* __restrict__ codes, uint8_t* zero) {
  int32_t kmin, kmax;
  uint32_t amax_bits;
  block_minmax(x, n, &kmin, &kmax, &amax_bits);
  if (bits_nonfinite(amax_bits)) {
    for (int i = 0; i < n; ++i) codes[i] = 0;
    *zero = 0;
    return scale_nan_bits(st);
  }
  const Int4Params p = int4_params(f32_from_order_key(kmin), f32_from_order_key(kmax), st);
  for (int i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(int4_encode(x[i], p.s, p.z));
  *zero = static_cast<uint8_t>(static_cast<int32_t>(p.z));
  return p.scale_bits;
}

// ---------------------------------------------------------------------------------
// Decode: y = elem_value(code) * block_factor (INT4: (code - zero) * s).
// ---------------------------------------------------------------------------------
template <int FMT>
JF4_HD float elem_value(uint32_t c) {
  if constexpr (FMT == kNVFP4) {
    return e2m1_decode(c);
  } else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
    return Codebook<FMT>::value(c);
  } else if constexpr (FMT == kINT4) {
    return static_cast<float>(c & 15u);
  } else {
    return MxElem<FMT>::decode(c);
  }
}

// The per-block decode factor from the stored scale bits.
// NVFP4: s (one level) or f32(ts * s) (two levels); MX: 2^(code-127) (255 -> NaN);
// codebooks: absmax; INT4: s in its storage type.
template <int FMT>
JF4_HD float block_factor(uint32_t scale_bits, bool two_level, float ts, int st) {
  if constexpr (FMT == kNVFP4) {
    const float s = e4m3_decode(scale_bits);
    return two_level ? ts * s : s;
  } else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
    return u2f(scale_bits);
  } else if constexpr (FMT == kINT4) {
    return scale_from_bits(scale_bits, st);
  } else {
    return e8m0_decode(scale_bits);
  }
}

// ---------------------------------------------------------------------------------
// Packing: little-endian bit stream per row; element i at bits [i*b, i*b+b).
// n must make n*b a multiple of 8.
// ---------------------------------------------------------------------------------
template <int BITS>
JF4_HD void pack_codes(const uint8_t* __restrict__ c, int64_t n, uint8_t* __restrict__ out) {
  if (BITS == 8) {
    for (int64_t i = 0; i < n; ++i) out[i] = c[i];
  } else if (BITS == 4) {
    for (int64_t j = 0; j < n / 2; ++j)
      out[j] = static_cast<uint8_t>((c[2 * j] & 0xfu) | ((c[2 * j + 1] & 0xfu) << 4));
  } else {  // 6 bits: 4 elements -> 3 bytes
    for (int64_t j = 0; j < n / 4; ++j) {
      const uint32_t v = (c[4 * j] & 0x3fu) | ((c[4 * j + 1] & 0x3fu) << 6) |
                         ((c[4 * j + 2] & 0x3fu) << 12) | ((c[4 * j + 3] & 0x3fu) << 18);
      out[3 * j] = static_cast<uint8_t>(v);
      out[3 * j + 1] = static_cast<uint8_t>(v >> 8);
      out[3 * j + 2] = static_cast<uint8_t>(v >> 16);
    }
  }
}
template <int BITS>
JF4_HD void unpack_codes(const uint8_t* __restrict__ in, int64_t n, uint8_t* __restrict__ c) {
  if (BITS == 8) {
    for (int64_t i = 0; i < n; ++i) c[i] = in[i];
  } else if (BITS == 4) {
    for (int64_t j = 0; j < n / 2; ++j) {
      c[2 * j] = in[j] & 0xfu;
      c[2 * j + 1] = in[j] >> 4;
    }
  } else {
    for (int64_t j = 0; j < n / 4; ++j) {
      const uint32_t v = in[3 * j] | (static_cast<uint32_t>(in[3 * j + 1]) << 8) |
                         (static_cast<uint32_t>(in[3 * j + 2]) << 16);
      c[4 * j] = v & 0x3fu;
      c[4 * j + 1] = (v >> 6) & 0x3fu;
      c[4 * j + 2] = (v >> 12) & 0x3fu;
      c[4 * j + 3] = (v >> 18) & 0x3fu;
    }
  }
}

// ---------------------------------------------------------------------------------
// The 128x4 scale swizzle (cuBLASLt / CUTLASS / torchao to_blocked).
// m: row, k: scale column, n_col_blocks = ceil(cols / 4).
// ---------------------------------------------------------------------------------
JF4_HD int64_t swizzle_offset(int64_t m, int64_t k, int64_t n_col_blocks) {
  return (m / 128) * n_col_blocks * 512 + (k / 4) * 512 + (m % 32) * 16 +
         ((m % 128) / 32) * 4 + (k % 4);
}
// Offset of the scale of block k of row m (nb blocks per row) in a linear (row-major)
// or 128x4 swizzled scale buffer.
JF4_HD int64_t scale_offset(int64_t m, int64_t k, int64_t nb, bool swizzled) {
  return swizzled ? swizzle_offset(m, k, (nb + 3) / 4) : m * nb + k;
}

}  // inline namespace JF4_ISA_TAG
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CODECS_H_
