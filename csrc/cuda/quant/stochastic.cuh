// Stochastic rounding (SR) of the elements for jax_fp4_quantize_sr_v1 (csrc/README.md):
// the rule of jax_fp4/reference.py quantize_2d(..., rand=...), bit for bit. The block
// scale and the element multiplier are those of round-to-nearest quantize
// (quantize_chunk); only the element's rounding differs: between its two neighbours
// lo < hi on the scaled grid an element goes to hi exactly when rand < floor(2^32 t),
// t in [0, 1) its position between them, with `rand` the caller's uint32 for it.
//  - minifloats (nvfp4's E2M1 of x * mult; MX elements of x * 2^(127 - scale code), the
//    power of two applied to the exponent, without a rounding): the discarded bits of the
//    significand, clamped to 31 bits of shift (reference _shr_stochastic / _round_to),
//    saturating at the largest finite code, sign kept;
//  - INT4: floor(x / s) + 1 when rand < floor(2^32 frac(x / s)), then + z, clamped to
//    [0, 15] (reference _encode_int4);
//  - codebooks: the sorted table's neighbours lo <= v < hi of v = x * mult (v at the top
//    entry stays), t = (v - lo) / (hi - lo) correctly rounded (reference
//    _codebook_stochastic).
// Finite inputs only: quantize_chunk gives a block with a NaN / Inf the NaN scale and
// zero codes before any element is encoded. Needs IEEE float32 arithmetic (no FTZ, IEEE
// division, no FMA contraction: the build's -fmad=false).
#ifndef JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_
#define JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_

#include <cmath>
#include <cstdint>

#include "../../codecs.h"

namespace jf4 {
namespace cuda {
namespace {

// Host and device (the encoders are checked on the host too): JF4_HD from codecs.h.
JF4_HD int sr_clz(uint32_t v) {
#if defined(__CUDA_ARCH__)
  return __clz(v);
#else
  return v ? __builtin_clz(v) : 32;
#endif
}

// The minifloat parameters of jax_fp4/formats.py (MiniFloat: mbits, bias, max_code, bits).
template <int M, int B, uint32_t MAXCODE, int BITS>
struct SrMini {
  static constexpr int kM = M, kB = B, kBits = BITS;
  static constexpr uint32_t kMax = MAXCODE;
};
using SrE2M1 = SrMini<1, 1, 0x7u, 4>;
template <int FMT>
struct SrElem;
template <>
struct SrElem<kMXFP4> : SrE2M1 {};
template <>
struct SrElem<kMXFP6_E2M3> : SrMini<3, 1, 0x1fu, 6> {};
template <>
struct SrElem<kMXFP6_E3M2> : SrMini<2, 3, 0x1fu, 6> {};
template <>
struct SrElem<kMXFP8_E4M3> : SrMini<3, 7, 0x7eu, 8> {};
template <>
struct SrElem<kMXFP8_E5M2> : SrMini<2, 15, 0x7bu, 8> {};

// Code of (float32 bits b, finite) * 2^k in the minifloat F, rounded stochastically on the
// magnitude with `rand`, saturating; the sign of b is kept (reference encode(b, fmt, k,
// rand)).
template <class F>
JF4_HD uint32_t minifloat_encode_sr(uint32_t b, int k, uint32_t rand) {
  const uint32_t a = b & kAbsMask;
  const int ef = static_cast<int>(a >> 23);
  uint32_t sig = ef == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
  int e = ef == 0 ? -149 : ef - 150;
  // normalise the significand to [2^23, 2^24) (subnormals too); zero stays zero
  int lz = sr_clz(sig) - 8;
  lz = lz < 0 ? 0 : (lz > 24 ? 24 : lz);
  sig <<= lz;
  e = e - lz + k;
  constexpr int kEmin = 1 - F::kB;
  const int top = e + 23;  // exponent of the significand's leading bit
  const int e_t = sig == 0 ? kEmin : (top > kEmin ? top : kEmin);
  int sh = (e_t - F::kM) - e;
  sh = sh < 0 ? 0 : (sh > 31 ? 31 : sh);
  uint32_t q = sig >> sh;
  const uint32_t rem = sig & ((1u << sh) - 1u);
  const uint32_t frac32 = sh > 0 ? rem << (32 - sh) : 0u;  // the discarded bits' top 32
  q += rand < frac32 ? 1u : 0u;
  uint32_t mag = (static_cast<uint32_t>(e_t + F::kB - 1) << F::kM) + q;
  mag = mag < F::kMax ? mag : F::kMax;
  return mag | ((b >> 31) << (F::kBits - 1));
}

// NVFP4: E2M1 of |x| * mult (the float32 product, as round-to-nearest quantize takes it)
// with the sign of x.
JF4_HD uint32_t nvfp4_encode_sr(float x, float mult, uint32_t rand) {
  const uint32_t p = f2u(fabsf(x) * mult) | (f2u(x) & 0x80000000u);
  return minifloat_encode_sr<SrE2M1>(p, 0, rand);
}

// MX: the element of x * 2^(127 - scale_code), scale_code an E8M0 code below 255.
template <int FMT>
JF4_HD uint32_t mx_encode_sr(float x, uint32_t scale_code, uint32_t rand) {
  return minifloat_encode_sr<SrElem<FMT>>(f2u(x), 127 - static_cast<int>(scale_code), rand);
}

// INT4: the code of x with the stored scale s (as float32) and zero point z.
JF4_HD uint32_t int4_encode_sr(float x, float s, float z, uint32_t rand) {
  const float v = x / s;
  const float fl = floorf(v);
  // v - fl in [0, 1) is exact, and so is its product with 2^32 (< 2^32)
  const uint32_t thr = static_cast<uint32_t>((v - fl) * 0x1p32f);
  const float r = fl + (rand < thr ? 1.0f : 0.0f);
  return static_cast<uint32_t>(static_cast<int32_t>(clampf(r + z, 0.0f, 15.0f)));
}

// The reference's _ordered_key: float32 order as int32, -0.0 and +0.0 equal (unlike
// codecs.h f32_order_key, which puts -0.0 below +0.0).
JF4_HD int32_t sr_order_key(float f) {
  const int32_t mag = static_cast<int32_t>(f2u(f) & kAbsMask);
  return (f2u(f) >> 31) ? -mag : mag;
}

// Codebooks: the code of v = x * mult between its sorted-table neighbours (sr_order_key
// compares); equal table entries keep the stable sort's order (Codebook<FMT>::order), as
// the reference's np.argsort(kind="stable").
template <int FMT>
JF4_HD uint32_t codebook_encode_sr(float x, float mult, uint32_t rand) {
  const float v = x * mult;
  const int32_t kv = sr_order_key(v);
  int n = 0;  // table entries <= v
#pragma unroll
  for (int s = 0; s < 16; ++s)
    n += kv >= sr_order_key(Codebook<FMT>::value(Codebook<FMT>::order(s))) ? 1 : 0;
  const int i = n - 1 < 0 ? 0 : n - 1;
  const int j = i + 1 < 15 ? i + 1 : 15;
  const float lo = Codebook<FMT>::value(Codebook<FMT>::order(i));
  const float hi = Codebook<FMT>::value(Codebook<FMT>::order(j));
  const float t = (v - lo) / (j > i ? hi - lo : 1.0f);
  const uint32_t thr = t >= 1.0f ? 0xffffffffu : static_cast<uint32_t>(clampf(t, 0.0f, 1.0f) * 0x1p32f);
  const bool up = j > i && rand < thr;
  return Codebook<FMT>::order(up ? j : i);
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_
