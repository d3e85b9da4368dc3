// CPU kernels: row pieces of the canonical (R, K) problem, built from codecs.h.
// Each piece is a run of whole blocks of one row; the hot loops are simple
// element-wise loops over float32 scratch buffers so that the compiler vectorises them.
#ifndef JAX_FP4_CSRC_CPU_KERNELS_H_
#define JAX_FP4_CSRC_CPU_KERNELS_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../codecs.h"
#include "../sr_codecs.h"
#include "compute.h"
#include "problem.h"

namespace jf4 {
namespace cpu {
inline namespace JF4_ISA_TAG {

// ---------------------------------------------------------------------------------
// Element types of x / y buffers.
// ---------------------------------------------------------------------------------
struct F32T {
  using storage = float;
};
struct BF16T {
  using storage = uint16_t;
};
struct F16T {
  using storage = uint16_t;
};

template <typename T>
inline void load_f32(const typename T::storage* __restrict__ in, int64_t n, float* __restrict__ out) {
  if constexpr (std::is_same_v<T, F32T>) {
    std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
  } else if constexpr (std::is_same_v<T, BF16T>) {
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
  }
}

template <typename T>
inline void store_f32(const float* __restrict__ in, int64_t n, typename T::storage* __restrict__ out) {
  if constexpr (std::is_same_v<T, F32T>) {
    std::memcpy(out, in, static_cast<size_t>(n) * sizeof(float));
  } else if constexpr (std::is_same_v<T, BF16T>) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_f16(in[i]);
  }
}

template <typename F>
inline bool dispatch_float_type(FloatType t, F&& f) {
  switch (t) {
    case FloatType::kF32: return f(F32T{});
    case FloatType::kBF16: return f(BF16T{});
    case FloatType::kF16: return f(F16T{});
  }
  return false;
}

template <typename F>
inline bool dispatch_fmt(int fmt, F&& f) {
  switch (fmt) {
    case kNVFP4: return f(std::integral_constant<int, kNVFP4>{});
    case kMXFP4: return f(std::integral_constant<int, kMXFP4>{});
    case kMXFP6_E2M3: return f(std::integral_constant<int, kMXFP6_E2M3>{});
    case kMXFP6_E3M2: return f(std::integral_constant<int, kMXFP6_E3M2>{});
    case kMXFP8_E4M3: return f(std::integral_constant<int, kMXFP8_E4M3>{});
    case kMXFP8_E5M2: return f(std::integral_constant<int, kMXFP8_E5M2>{});
    case kNF4: return f(std::integral_constant<int, kNF4>{});
    case kBNB_FP4: return f(std::integral_constant<int, kBNB_FP4>{});
    case kINT4: return f(std::integral_constant<int, kINT4>{});
    default: return false;
  }
}

// The default block size of each format (specialised at compile time).
template <int FMT>
constexpr int default_block() {
  return FMT == kNVFP4 ? 16 : (FMT == kNF4 || FMT == kBNB_FP4) ? 64 : FMT == kINT4 ? 128 : 32;
}

// Calls f(std::integral_constant<int, BS>) with BS = bs when bs is the format's default
// block size, else BS = 0 (runtime block size).
template <int FMT, typename F>
inline void with_block_size(int64_t bs, F&& f) {
  if (bs == default_block<FMT>())
    f(std::integral_constant<int, default_block<FMT>()>{});
  else
    f(std::integral_constant<int, 0>{});
}

// Bytes per packed row of codes, and per stored scale.
inline int64_t row_bytes(const Problem& p) { return p.K * p.bits / 8; }

inline int scale_bytes(const Problem& p) {
  if (p.fmt == kNF4 || p.fmt == kBNB_FP4) return 4;
  if (p.fmt == kINT4) return p.scale_type == kScaleF32 ? 4 : 2;
  return 1;
}

inline void store_scale(void* base, int64_t idx, int nbytes, uint32_t bits) {
  uint8_t* p = static_cast<uint8_t*>(base) + idx * nbytes;
  if (nbytes == 1) {
    *p = static_cast<uint8_t>(bits);
  } else if (nbytes == 2) {
    const uint16_t v = static_cast<uint16_t>(bits);
    std::memcpy(p, &v, 2);
  } else {
    std::memcpy(p, &bits, 4);
  }
}
inline uint32_t load_scale(const void* base, int64_t idx, int nbytes) {
  const uint8_t* p = static_cast<const uint8_t*>(base) + idx * nbytes;
  if (nbytes == 1) return *p;
  if (nbytes == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Heap buffer (uninitialised) owned by this ISA's code (no std container instantiations
// shared with other ISA variants).
template <typename T>
class Buf {
 public:
  explicit Buf(int64_t n) : p_(new T[static_cast<size_t>(n > 0 ? n : 1)]) {}
  ~Buf() { delete[] p_; }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  T* data() const { return p_; }
  T& operator[](int64_t i) const { return p_[i]; }

 private:
  T* p_;
};

// Per-piece scratch for block parameters.
struct BlockScratch {
  explicit BlockScratch(int64_t max_blocks) : a(max_blocks), b(max_blocks), m(max_blocks), z(max_blocks) {}
  Buf<uint32_t> a;  // abs-max bits
  Buf<int32_t> b;   // INT4: min key
  Buf<float> m;     // element multiplier / decode factor
  Buf<float> z;     // INT4: max (phase 1), then zero point
};

// Runs fn(begin, end) over [0, n) on the thread pool (see run_parallel).
template <typename Fn>
inline void parallel_for(void* pool, int64_t n, int64_t grain, Fn& fn) {
  run_parallel(pool, n, grain, static_cast<void*>(&fn),
               [](void* ctx, int64_t b, int64_t e) { (*static_cast<Fn*>(ctx))(b, e); });
}

// Quantizes nblk blocks of float32 input x into unpacked codes and scale bits (and
// INT4 zeros), in three phases that each vectorise: block statistics, block
// parameters (across blocks), element encoding (within a block). `ts_ok == false`
// marks an NVFP4 two-level row whose tensor scale is unusable. BS != 0 is the block
// size as a compile-time constant. `rand` (one uint32 per element, or null for round to
// nearest even) selects stochastic rounding of the elements (sr_codecs.h); the block
// scales are the same either way.
template <int FMT, int BS>
inline void quantize_blocks(const float* __restrict__ x, int64_t nblk, int64_t bs, const Problem& p,
                            float ts, bool ts_ok, uint8_t* __restrict__ codes,
                            uint32_t* __restrict__ scale_bits, uint8_t* __restrict__ zeros,
                            BlockScratch& sc, const uint32_t* __restrict__ rand = nullptr) {
  const int n = BS != 0 ? BS : static_cast<int>(bs);
  uint32_t* __restrict__ amax = sc.a.data();
  float* __restrict__ mult = sc.m.data();
  // Phase 1: block statistics.
  if constexpr (FMT == kINT4) {
    int32_t* __restrict__ kmin = sc.b.data();
    for (int64_t j = 0; j < nblk; ++j) {
      int32_t lo, hi;
      block_minmax(x + j * n, n, &lo, &hi, &amax[j]);
      kmin[j] = lo;
      sc.z[j] = f32_from_order_key(hi);  // max, as float (temporarily)
    }
  } else {
    for (int64_t j = 0; j < nblk; ++j) amax[j] = block_absmax_bits(x + j * n, n);
  }
  // Phase 2: block parameters (element-wise over blocks).
  if constexpr (FMT == kNVFP4) {
    if (p.two_level) {
      for (int64_t j = 0; j < nblk; ++j) {
        const uint32_t c = nvfp4_scale_code<true>(u2f(amax[j]), ts);
        mult[j] = nvfp4_elem_mult<true>(c, ts);
        scale_bits[j] = (bits_nonfinite(amax[j]) || !ts_ok) ? kE4M3NaN : c;
      }
    } else {
      for (int64_t j = 0; j < nblk; ++j) {
        const uint32_t c = nvfp4_scale_code<false>(u2f(amax[j]), 0.0f);
        mult[j] = nvfp4_elem_mult<false>(c, 0.0f);
        scale_bits[j] = bits_nonfinite(amax[j]) ? kE4M3NaN : c;
      }
    }
  } else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
    for (int64_t j = 0; j < nblk; ++j) {
      mult[j] = codebook_mult(amax[j]);
      scale_bits[j] = bits_nonfinite(amax[j]) ? kQuietNaNBits : amax[j];
    }
  } else if constexpr (FMT == kINT4) {
    const int st = p.scale_type;
    const uint32_t nan_bits = scale_nan_bits(st);
    for (int64_t j = 0; j < nblk; ++j) {
      const Int4Params q = int4_params(f32_from_order_key(sc.b[j]), sc.z[j], st);
      const bool bad = bits_nonfinite(amax[j]);
      mult[j] = q.s;
      sc.z[j] = bad ? 0.0f : q.z;
      scale_bits[j] = bad ? nan_bits : q.scale_bits;
      zeros[j] = static_cast<uint8_t>(static_cast<int32_t>(sc.z[j]));
    }
  } else {
    const bool rceil = p.rceil;
    for (int64_t j = 0; j < nblk; ++j) {
      const uint32_t c = mx_scale_code<FMT>(amax[j], rceil);
      mult[j] = e8m0_inverse(c);
      scale_bits[j] = bits_nonfinite(amax[j]) ? kE8M0NaN : c;
    }
  }
  // Phase 3: elements.
  auto encode = [&](float v, float m, float z) -> uint8_t {
    if constexpr (FMT == kNVFP4) {
      return static_cast<uint8_t>(nvfp4_encode(v, m));
    } else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
      return static_cast<uint8_t>(codebook_position<FMT>(v, m));
    } else if constexpr (FMT == kINT4) {
      return static_cast<uint8_t>(int4_encode(v, m, z));
    } else {
      return static_cast<uint8_t>(mx_encode<FMT>(v, m));
    }
  };
  const float* __restrict__ zf = sc.z.data();
  int64_t j = 0;
  if (rand != nullptr) {
    // Stochastic rounding: scalar per element (the random bits make every element's
    // threshold different); MX takes the scale code, the others the multiplier.
    for (; j < nblk; ++j) {
      const float* __restrict__ xb = x + j * n;
      const uint32_t* __restrict__ rb = rand + j * n;
      uint8_t* __restrict__ cb = codes + j * n;
      const float m = mult[j];
      for (int i = 0; i < n; ++i) {
        if constexpr (FMT == kNVFP4) {
          cb[i] = static_cast<uint8_t>(nvfp4_encode_sr(xb[i], m, rb[i]));
        } else if constexpr (FMT == kNF4 || FMT == kBNB_FP4) {
          cb[i] = static_cast<uint8_t>(codebook_position_sr<FMT>(xb[i], m, rb[i]));
        } else if constexpr (FMT == kINT4) {
          cb[i] = static_cast<uint8_t>(int4_encode_sr(xb[i], m, zf[j], rb[i]));
        } else {
          cb[i] = static_cast<uint8_t>(mx_encode_sr<FMT>(xb[i], scale_bits[j], rb[i]));
        }
      }
    }
  }
  if constexpr (BS == 16) {
    // Two blocks per iteration: a 16-element loop is too short for the vectoriser
    // (it picks 32 byte-lanes for the uint8 output).
    for (; j + 1 < nblk; j += 2) {
      const float* __restrict__ xb = x + j * 16;
      uint8_t* __restrict__ cb = codes + j * 16;
      const float m0 = mult[j], m1 = mult[j + 1];
      const float z0 = FMT == kINT4 ? zf[j] : 0.0f, z1 = FMT == kINT4 ? zf[j + 1] : 0.0f;
      for (int i = 0; i < 32; ++i) cb[i] = encode(xb[i], i < 16 ? m0 : m1, i < 16 ? z0 : z1);
    }
  }
  for (; j < nblk; ++j) {
    const float* __restrict__ xb = x + j * n;
    uint8_t* __restrict__ cb = codes + j * n;
    const float m = mult[j];
    const float z = FMT == kINT4 ? zf[j] : 0.0f;
    for (int i = 0; i < n; ++i) cb[i] = encode(xb[i], m, z);
  }
  if constexpr (FMT == kBNB_FP4) {  // sorted position -> code index
    const int64_t total = nblk * n;
    for (int64_t i = 0; i < total; ++i) codes[i] = static_cast<uint8_t>(codebook_code<FMT>(codes[i]));
  }
  // Non-finite blocks (and unusable NVFP4 tensor scales): zero codes.
  for (int64_t j = 0; j < nblk; ++j) {
    if (bits_nonfinite(amax[j]) || (FMT == kNVFP4 && p.two_level && !ts_ok))
      std::memset(codes + j * n, 0, static_cast<size_t>(n));
  }
}

// Element value lookup table (code byte -> float), built once per format.
template <int FMT>
inline const float* elem_lut() {
  static const std::array<float, 256> lut = [] {
    std::array<float, 256> t{};
    for (uint32_t c = 0; c < 256; ++c) t[c] = elem_value<FMT>(c);
    return t;
  }();
  return lut.data();
}

// Decodes nblk blocks of unpacked codes into float32: y = value(code) * factor
// (INT4: (code - zero) * s). 4-bit formats multiply a 16-entry table per block
// (the same products, computed once); others look up the element value.
template <int FMT, int BS>
inline void decode_blocks(const uint8_t* __restrict__ codes, int64_t nblk, int64_t bs,
                          const Problem& p, float ts, const uint32_t* __restrict__ scale_bits,
                          const uint8_t* __restrict__ zeros, float* __restrict__ y,
                          BlockScratch& sc) {
  const int n = BS != 0 ? BS : static_cast<int>(bs);
  const float* __restrict__ lut = elem_lut<FMT>();
  float* __restrict__ f = sc.m.data();
  const bool two = p.two_level;
  const int st = p.scale_type;
  for (int64_t j = 0; j < nblk; ++j) f[j] = block_factor<FMT>(scale_bits[j], two, ts, st);
  constexpr bool kFourBit = elem_bits(FMT) == 4;
  for (int64_t j = 0; j < nblk; ++j) {
    const uint8_t* __restrict__ cb = codes + j * n;
    float* __restrict__ yb = y + j * n;
    const float fj = f[j];
    if constexpr (kFourBit) {
      float t[16];
      if constexpr (FMT == kINT4) {
        const float z = static_cast<float>(zeros[j]);
        for (int c = 0; c < 16; ++c) t[c] = (lut[c] - z) * fj;
      } else {
        for (int c = 0; c < 16; ++c) t[c] = lut[c] * fj;
      }
      for (int i = 0; i < n; ++i) yb[i] = t[cb[i] & 15];
    } else {
      for (int i = 0; i < n; ++i) yb[i] = lut[cb[i]] * fj;
    }
  }
}

// ---------------------------------------------------------------------------------
// Work partition: units of whole blocks of one row. When a block does not start on a
// byte boundary of the packed row (odd INT4 groups, 6-bit blocks not a multiple of 4)
// the unit is a whole row.
// ---------------------------------------------------------------------------------
struct Partition {
  int64_t blocks_per_unit;  // 1 or nb
  int64_t n_units;
  int64_t max_piece_blocks;  // blocks processed per scratch fill
};

inline Partition make_partition(const Problem& p) {
  Partition t;
  const bool aligned = (p.bs * p.bits) % 8 == 0;
  t.blocks_per_unit = aligned ? 1 : p.nb;
  t.n_units = aligned ? p.R * p.nb : p.R;
  const int64_t target = 4096;  // elements per scratch fill
  t.max_piece_blocks = aligned ? std::max<int64_t>(1, target / p.bs) : p.nb;
  return t;
}

// Calls fn(r, j0, j1) for every piece (row r, blocks [j0, j1)) of units [ub, ue).
template <typename Fn>
inline void for_each_piece(const Problem& p, const Partition& t, int64_t ub, int64_t ue, Fn&& fn) {
  int64_t g = ub * t.blocks_per_unit;
  const int64_t ge = ue * t.blocks_per_unit;
  while (g < ge) {
    const int64_t r = g / p.nb;
    const int64_t j0 = g % p.nb;
    const int64_t j1 = std::min<int64_t>({p.nb, j0 + t.max_piece_blocks, j0 + (ge - g)});
    fn(r, j0, j1);
    g += j1 - j0;
  }
}

inline int64_t grain_units(const Problem& p, const Partition& t) {
  // ~32K elements per chunk at least, so small problems stay on one thread.
  const int64_t elems_per_unit = t.blocks_per_unit * p.bs;
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, elems_per_unit));
}

inline void pack(int bits, const uint8_t* c, int64_t n, uint8_t* out) {
  if (bits == 4) pack_codes<4>(c, n, out);
  else if (bits == 6) pack_codes<6>(c, n, out);
  else pack_codes<8>(c, n, out);
}
inline void unpack(int bits, const uint8_t* in, int64_t n, uint8_t* c) {
  if (bits == 4) unpack_codes<4>(in, n, c);
  else if (bits == 6) unpack_codes<6>(in, n, c);
  else unpack_codes<8>(in, n, c);
}

}  // inline namespace JF4_ISA_TAG
}  // namespace cpu
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CPU_KERNELS_H_
