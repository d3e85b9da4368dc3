// Stochastic rounding (SR) of the elements: the rules of jax_fp4/reference.py
// quantize_2d(..., rand=...) bit for bit, for the CPU handlers and the CUDA kernels
// (__host__ __device__ under nvcc, like codecs.h). Block scales are those of
// round-to-nearest (codecs.h); only the element encoders differ. Each element takes one
// uint32 `rand` and rounds away from its lower neighbour exactly when
// rand < floor(2^32 * t), t in [0, 1) its position between the two neighbours.
#ifndef JAX_FP4_CSRC_SR_CODECS_H_
#define JAX_FP4_CSRC_SR_CODECS_H_

#include <cmath>
#include <cstdint>

#include "codecs.h"

namespace jf4 {
inline namespace JF4_ISA_TAG {

JF4_HD int clz32(uint32_t v) {
#ifdef __CUDA_ARCH__
  return __clz(static_cast<int>(v));
#else
  return v == 0 ? 32 : __builtin_clz(v);
#endif
}

// Top 32 bits of the fraction discarded by hi / 2^sh (hi < 2^24, sh >= 0): reference
// _shr_stochastic with lo = 0. Shifts past 31 are computed, not clamped, so a value far
// below one unit moves with its own small probability.
JF4_HD uint32_t sr_fraction32(uint32_t hi, int sh) {
  if (sh <= 0) return 0u;
  if (sh < 32) return (hi & ((1u << sh) - 1u)) << (32 - sh);
  return sh < 56 ? hi >> (sh - 32) : 0u;
}

// Code of (float32 bits `bits`) * 2^k in the minifloat E/M/B, stochastically rounded on
// the magnitude, saturating at MAXCODE, sign kept (reference encode / _round_to with
// rand). The value is decomposed exactly (subnormals normalised), so no product is
// rounded before the element rounding. Finite inputs (callers zero non-finite blocks).
template <int E, int M, int B, uint32_t MAXCODE>
JF4_HD uint32_t sr_encode_minifloat(uint32_t bits, int k, uint32_t rand) {
  const uint32_t a = bits & kAbsMask;
  const uint32_t ef = a >> 23;
  uint32_t sig = ef == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
  int e = ef == 0 ? -149 : static_cast<int>(ef) - 150;
  int lz = clz32(sig) - 8;  // normalise sig to [2^23, 2^24); 0 stays 0
  lz = lz < 0 ? 0 : (lz > 24 ? 24 : lz);
  sig <<= lz;
  e = e - lz + k;
  constexpr int kEmin = 1 - B;
  const int top = e + 23;  // exponent of sig's leading bit
  const int e_t = sig == 0 ? kEmin : (top > kEmin ? top : kEmin);
  const int sh = (e_t - M) - e;
  const uint32_t q = (sh >= 24 ? 0u : sig >> sh) + (rand < sr_fraction32(sig, sh) ? 1u : 0u);
  uint32_t mag = (static_cast<uint32_t>(e_t + B - 1) << M) + q;
  mag = mag > MAXCODE ? MAXCODE : mag;
  return mag | ((bits >> 31) << (E + M));
}

template <int FMT>
struct SrElem;
template <>
struct SrElem<kMXFP4> {
  JF4_HD static uint32_t encode(uint32_t b, int k, uint32_t r) {
    return sr_encode_minifloat<2, 1, 1, 0x7u>(b, k, r);
  }
};
template <>
struct SrElem<kNVFP4> : SrElem<kMXFP4> {};
template <>
struct SrElem<kMXFP6_E2M3> {
  JF4_HD static uint32_t encode(uint32_t b, int k, uint32_t r) {
    return sr_encode_minifloat<2, 3, 1, 0x1fu>(b, k, r);
  }
};
template <>
struct SrElem<kMXFP6_E3M2> {
  JF4_HD static uint32_t encode(uint32_t b, int k, uint32_t r) {
    return sr_encode_minifloat<3, 2, 3, 0x1fu>(b, k, r);
  }
};
template <>
struct SrElem<kMXFP8_E4M3> {
  JF4_HD static uint32_t encode(uint32_t b, int k, uint32_t r) {
    return sr_encode_minifloat<4, 3, 7, 0x7eu>(b, k, r);
  }
};
template <>
struct SrElem<kMXFP8_E5M2> {
  JF4_HD static uint32_t encode(uint32_t b, int k, uint32_t r) {
    return sr_encode_minifloat<5, 2, 15, 0x7bu>(b, k, r);
  }
};

// NVFP4: p = x * mult (IEEE product, as round-to-nearest), then SR to E2M1 with x's sign.
JF4_HD uint32_t nvfp4_encode_sr(float x, float mult, uint32_t rand) {
  const uint32_t p = (f2u(x * mult) & kAbsMask) | (f2u(x) & ~kAbsMask);
  return SrElem<kNVFP4>::encode(p, 0, rand);
}

// MX: x * 2^(127 - scale code), exact, then SR to the element type.
template <int FMT>
JF4_HD uint32_t mx_encode_sr(float x, uint32_t scale_code, uint32_t rand) {
  return SrElem<FMT>::encode(f2u(x), 127 - static_cast<int>(scale_code), rand);
}

// Codebooks: v = x * mult (as round-to-nearest, not clamped); lo <= v < hi its sorted
// neighbours (order keys with -0.0 == +0.0); hi when rand < floor(2^32 * (v - lo) / (hi -
// lo)) (a quotient that rounds to 1 takes 2^32 - 1). Returns the sorted position (mapped
// to the code by codebook_code, as round-to-nearest's).
JF4_HD int32_t sr_order_key(float f) {
  const uint32_t u = f2u(f);
  const int32_t mag = static_cast<int32_t>(u & kAbsMask);
  return (u >> 31) ? -mag : mag;
}
template <int FMT>
JF4_HD float codebook_sorted(int i) {
  return Codebook<FMT>::value(Codebook<FMT>::order(static_cast<uint32_t>(i)));
}
template <int FMT>
JF4_HD uint32_t codebook_position_sr(float x, float mult, uint32_t rand) {
  const float v = x * mult;
  const int32_t kv = sr_order_key(v);
  int n = 0;
  for (int i = 0; i < 16; ++i) n += kv >= sr_order_key(codebook_sorted<FMT>(i)) ? 1 : 0;
  const int i = n < 1 ? 0 : n - 1;
  const int j = i < 15 ? i + 1 : 15;
  const float lo = codebook_sorted<FMT>(i), hi = codebook_sorted<FMT>(j);
  const float t = (v - lo) / (j > i ? hi - lo : 1.0f);
  const uint32_t thr =
      t >= 1.0f ? 0xffffffffu : static_cast<uint32_t>(clampf(t, 0.0f, 1.0f) * 0x1p32f);
  return static_cast<uint32_t>(j > i && rand < thr ? j : i);
}

// INT4: v = x / s; floor(v) + 1 when rand < floor(2^32 * (v - floor(v))); plus z, clamped
// to [0, 15]. A subnormal v counts as zero (the reference flushes it). Clamping v to
// [-64, 64] first gives the same final code (|z| <= 15) and keeps floor finite.
JF4_HD uint32_t int4_encode_sr(float x, float s, float z, uint32_t rand) {
  float v = clampf(x / s, -64.0f, 64.0f);
  v = (f2u(v) & kAbsMask) < 0x00800000u ? 0.0f : v;
  const float fl = floorf(v);
  const float t = v - fl;
  const uint32_t thr = t >= 1.0f ? 0xffffffffu : static_cast<uint32_t>(t * 0x1p32f);
  const float q = clampf(fl + (rand < thr ? 1.0f : 0.0f) + z, 0.0f, 15.0f);
  return static_cast<uint32_t>(static_cast<int32_t>(q));
}

}  // inline namespace JF4_ISA_TAG
}  // namespace jf4

#endif  // JAX_FP4_CSRC_SR_CODECS_H_
