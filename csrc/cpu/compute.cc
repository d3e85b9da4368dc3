// CPU compute of the three targets, for one instruction set (namespace JF4_ISA_NS).
#include "compute.h"
#include "kernels.h"


namespace jf4 {
namespace cpu {
namespace JF4_ISA_NS {
namespace {

template <int FMT, typename T>
void quantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                    const typename T::storage* x, const float* ts, uint8_t* codes, void* scales,
                    uint8_t* zeros) {
  const int64_t piece = t.max_piece_blocks * p.bs;
  Buf<float> fbuf(piece);
  Buf<uint8_t> cbuf(piece);
  Buf<uint32_t> sbuf(t.max_piece_blocks);
  BlockScratch scratch(t.max_piece_blocks);
  const int sbytes = scale_bytes(p);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t nblk = j1 - j0;
    const int64_t n = nblk * p.bs;
    const int64_t e0 = j0 * p.bs;
    float tsr = 0.0f;
    bool ts_ok = true;
    if (FMT == kNVFP4 && p.two_level) {
      tsr = ts[r];
      ts_ok = !nvfp4_bad_tensor_scale(tsr);
    }
    load_f32<T>(x + r * p.K + e0, n, fbuf.data());
    with_block_size<FMT>(p.bs, [&](auto bs_c) {
      quantize_blocks<FMT, decltype(bs_c)::value>(fbuf.data(), nblk, p.bs, p, tsr, ts_ok,
                                                  cbuf.data(), sbuf.data(),
                                                  FMT == kINT4 ? zeros + r * p.nb + j0 : nullptr,
                                                  scratch);
    });
    for (int64_t j = 0; j < nblk; ++j) store_scale(scales, r * p.nb + j0 + j, sbytes, sbuf[j]);
    pack(p.bits, cbuf.data(), n, codes + r * row_bytes(p) + e0 * p.bits / 8);
  });
}

template <int FMT, typename T>
void dequantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                      const uint8_t* codes, const void* scales, const uint8_t* zeros,
                      const float* ts, typename T::storage* y) {
  const int64_t piece = t.max_piece_blocks * p.bs;
  Buf<float> fbuf(piece);
  Buf<uint8_t> cbuf(piece);
  Buf<uint32_t> sbuf(t.max_piece_blocks);
  BlockScratch scratch(t.max_piece_blocks);
  const int sbytes = scale_bytes(p);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t nblk = j1 - j0;
    const int64_t n = nblk * p.bs;
    const int64_t e0 = j0 * p.bs;
    const float tsr = (FMT == kNVFP4 && p.two_level) ? ts[r] : 0.0f;
    unpack(p.bits, codes + r * row_bytes(p) + e0 * p.bits / 8, n, cbuf.data());
    for (int64_t j = 0; j < nblk; ++j) sbuf[j] = load_scale(scales, r * p.nb + j0 + j, sbytes);
    with_block_size<FMT>(p.bs, [&](auto bs_c) {
      decode_blocks<FMT, decltype(bs_c)::value>(cbuf.data(), nblk, p.bs, p, tsr, sbuf.data(),
                                                FMT == kINT4 ? zeros + r * p.nb + j0 : nullptr,
                                                fbuf.data(), scratch);
    });
    store_f32<T>(fbuf.data(), n, y + r * p.K + e0);
  });
}

template <int FMT, typename T>
void fake_quantize_units(const Problem& p, const Partition& t, int64_t ub, int64_t ue,
                         const typename T::storage* x, const float* ts, typename T::storage* y) {
  const int64_t piece = t.max_piece_blocks * p.bs;
  Buf<float> fbuf(piece);
  Buf<uint8_t> cbuf(piece);
  Buf<uint32_t> sbuf(t.max_piece_blocks);
  Buf<uint8_t> zbuf(t.max_piece_blocks);
  BlockScratch scratch(t.max_piece_blocks);
  for_each_piece(p, t, ub, ue, [&](int64_t r, int64_t j0, int64_t j1) {
    const int64_t nblk = j1 - j0;
    const int64_t n = nblk * p.bs;
    const int64_t e0 = j0 * p.bs;
    float tsr = 0.0f;
    bool ts_ok = true;
    if (FMT == kNVFP4 && p.two_level) {
      tsr = ts[r];
      ts_ok = !nvfp4_bad_tensor_scale(tsr);
    }
    load_f32<T>(x + r * p.K + e0, n, fbuf.data());
    with_block_size<FMT>(p.bs, [&](auto bs_c) {
      constexpr int BS = decltype(bs_c)::value;
      quantize_blocks<FMT, BS>(fbuf.data(), nblk, p.bs, p, tsr, ts_ok, cbuf.data(), sbuf.data(),
                               zbuf.data(), scratch);
      decode_blocks<FMT, BS>(cbuf.data(), nblk, p.bs, p, tsr, sbuf.data(), zbuf.data(),
                             fbuf.data(), scratch);
    });
    store_f32<T>(fbuf.data(), n, y + r * p.K + e0);
  });
}

}  // namespace

bool quantize(void* pool, const Problem& p, FloatType dtype, const void* x,
                    const float* ts, uint8_t* codes, void* scales, uint8_t* zeros) {
  const Partition t = make_partition(p);
  return dispatch_fmt(p.fmt, [&](auto fmt_c) {
    constexpr int FMT = decltype(fmt_c)::value;
    return dispatch_float_type(dtype, [&](auto type_c) {
      using T = decltype(type_c);
      const auto* xp = static_cast<const typename T::storage*>(x);
      auto body = [&](int64_t ub, int64_t ue) {
        quantize_units<FMT, T>(p, t, ub, ue, xp, ts, codes, scales, zeros);
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
