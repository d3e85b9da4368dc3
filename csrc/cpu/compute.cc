// CPU compute of the three targets, for one instruction set (namespace JF4_ISA_NS).
#include "compute.h"
#include "kernels.h"


namespace jf4 {
namespace cpu {
namespace JF4_ISA_NS {
namespace {

// Per-thread buffers for one piece (up to t.max_piece_blocks blocks of one row).
struct PieceBufs {
  PieceBufs(const Problem& p, const Partition& t)
      : f(t.max_piece_blocks * p.bs), c(t.max_piece_blocks * p.bs), s(t.max_piece_blocks),
        z(t.max_piece_blocks), scratch(t.max_piece_blocks) {}
  Buf<float> f;       // elements in float32
  Buf<uint8_t> c;     // codes, one per element
  Buf<uint32_t> s;    // scale bits, one per block
  Buf<uint8_t> z;     // INT4 zero points (fake-quantize only)
  BlockScratch scratch;
};

// Row r's NVFP4 per-tensor scale (two-level only; 0 otherwise) and, when `ok` is given,
// whether quantize may use it (csrc/codecs.h nvfp4_bad_tensor_scale).
template <int FMT>
float row_tensor_scale(const Problem& p, const float* ts, int64_t r, bool* ok = nullptr) {
  const bool two_level = FMT == kNVFP4 && p.two_level;
  const float tsr = two_level ? ts[r] : 0.0f;
  if (ok) *ok = !two_level || !nvfp4_bad_tensor_scale(tsr);
  return tsr;
}

// Quantizes blocks [j0, j1) of row r into b.c (codes) and b.s (scale bits); INT4 zero
// points go to `zeros` (one per block). `rand`: the (R, K) random bits of stochastic
// rounding, or null (round to nearest even). Returns the piece's element count. Shared by
// quantize and fake-quantize.
template <int FMT, typename T>
int64_t quantize_piece(const Problem& p, PieceBufs& b, const typename T::storage* x,
                       const float* ts, int64_t r, int64_t j0, int64_t j1, uint8_t* zeros,
                       const uint32_t* rand = nullptr) {
  const int64_t nblk = j1 - j0;
  const int64_t n = nblk * p.bs;
  bool ts_ok;
  const float tsr = row_tensor_scale<FMT>(p, ts, r, &ts_ok);
  load_f32<T>(x + r * p.K + j0 * p.bs, n, b.f.data());
  with_block_size<FMT>(p.bs, [&](auto bs_c) {
    quantize_blocks<FMT, decltype(bs_c)::value>(b.f.data(), nblk, p.bs, p, tsr, ts_ok,
                                                b.c.data(), b.s.data(), zeros, b.scratch,
                                                rand ? rand + r * p.K + j0 * p.bs : nullptr);
  });
  return n;
}

template <int FMT, typename T>
void quantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                    const typename T::storage* x, const float* ts, const uint32_t* rand,
                    uint8_t* codes, void* scales, uint8_t* zeros) {
  PieceBufs b(p, t);
  const int sbytes = scale_bytes(p);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t n = quantize_piece<FMT, T>(p, b, x, ts, r, j0, j1,
                                             FMT == kINT4 ? zeros + r * p.nb + j0 : nullptr,
                                             rand);
    for (int64_t j = 0; j < j1 - j0; ++j)
      store_scale(scales, scale_offset(r, j0 + j, p.nb, p.swizzled), sbytes, b.s[j]);
    pack(p.bits, b.c.data(), n, codes + r * row_bytes(p) + j0 * p.bs * p.bits / 8);
  });
}

template <int FMT, typename T>
void dequantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                      const uint8_t* codes, const void* scales, const uint8_t* zeros,
                      const float* ts, typename T::storage* y) {
  PieceBufs b(p, t);
  const int sbytes = scale_bytes(p);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t nblk = j1 - j0;
    const int64_t n = nblk * p.bs;
    const int64_t e0 = j0 * p.bs;
    const float tsr = row_tensor_scale<FMT>(p, ts, r);  // decode uses it as given
    unpack(p.bits, codes + r * row_bytes(p) + e0 * p.bits / 8, n, b.c.data());
    for (int64_t j = 0; j < nblk; ++j) b.s[j] = load_scale(scales, r * p.nb + j0 + j, sbytes);
    with_block_size<FMT>(p.bs, [&](auto bs_c) {
      decode_blocks<FMT, decltype(bs_c)::value>(b.c.data(), nblk, p.bs, p, tsr, b.s.data(),
                                                FMT == kINT4 ? zeros + r * p.nb + j0 : nullptr,
                                                b.f.data(), b.scratch);
    });
    store_f32<T>(b.f.data(), n, y + r * p.K + e0);
  });
}

template <int FMT, typename T>
void fake_quantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                         const typename T::storage* x, const float* ts, typename T::storage* y) {
  PieceBufs b(p, t);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t n = quantize_piece<FMT, T>(p, b, x, ts, r, j0, j1, b.z.data());
    const float tsr = row_tensor_scale<FMT>(p, ts, r);
    with_block_size<FMT>(p.bs, [&](auto bs_c) {
      decode_blocks<FMT, decltype(bs_c)::value>(b.c.data(), j1 - j0, p.bs, p, tsr, b.s.data(),
                                                b.z.data(), b.f.data(), b.scratch);
    });
    store_f32<T>(b.f.data(), n, y + r * p.K + j0 * p.bs);
  });
}

}  // namespace

bool quantize(void* pool, const Problem& p, FloatType dtype, const void* x,
              const float* ts, const uint32_t* rand, uint8_t* codes, void* scales,
              uint8_t* zeros) {
  const Partition t = make_partition(p);
  return dispatch_fmt(p.fmt, [&](auto fmt_c) {
    constexpr int FMT = decltype(fmt_c)::value;
    return dispatch_float_type(dtype, [&](auto type_c) {
      using T = decltype(type_c);
      const auto* xp = static_cast<const typename T::storage*>(x);
      auto body = [&](int64_t ub, int64_t ue) {
        quantize_units<FMT, T>(p, t, ub, ue, xp, ts, rand, codes, scales, zeros);
      };
      parallel_for(pool, t.n_units, grain_units(p, t), body);
      return true;
    });
  });
}

bool dequantize(void* pool, const Problem& p, FloatType dtype,
                      const uint8_t* codes, const void* scales, const uint8_t* zeros,
                      const float* ts, void* y) {
  const Partition t = make_partition(p);
  return dispatch_fmt(p.fmt, [&](auto fmt_c) {
    constexpr int FMT = decltype(fmt_c)::value;
    return dispatch_float_type(dtype, [&](auto type_c) {
      using T = decltype(type_c);
      auto* yp = static_cast<typename T::storage*>(y);
      auto body = [&](int64_t ub, int64_t ue) {
        dequantize_units<FMT, T>(p, t, ub, ue, codes, scales, zeros, ts, yp);
      };
      parallel_for(pool, t.n_units, grain_units(p, t), body);
      return true;
    });
  });
}

bool fake_quantize(void* pool, const Problem& p, FloatType dtype,
                         const void* x, const float* ts, void* y) {
  Partition t = make_partition(p);
  // No packing here: any block boundary works as a piece boundary.
  t.blocks_per_unit = 1;
  t.n_units = p.R * p.nb;
  t.max_piece_blocks = std::max<int64_t>(1, 4096 / p.bs);
  return dispatch_fmt(p.fmt, [&](auto fmt_c) {
    constexpr int FMT = decltype(fmt_c)::value;
    return dispatch_float_type(dtype, [&](auto type_c) {
      using T = decltype(type_c);
      const auto* xp = static_cast<const typename T::storage*>(x);
      auto* yp = static_cast<typename T::storage*>(y);
      auto body = [&](int64_t ub, int64_t ue) {
        fake_quantize_units<FMT, T>(p, t, ub, ue, xp, ts, yp);
      };
      parallel_for(pool, t.n_units, grain_units(p, t), body);
      return true;
    });
  });
}

}  // namespace JF4_ISA_NS
}  // namespace cpu
}  // namespace jf4
