// Shape/dtype validation of the FFI contract (csrc/README.md), shared by the handlers.
#ifndef JAX_FP4_CSRC_CPU_VALIDATE_H_
#define JAX_FP4_CSRC_CPU_VALIDATE_H_

#include <string>

#include "../codecs.h"
#include "../ffi_util.h"
#include "problem.h"

namespace jf4 {
namespace cpu {

// fmt / block_size / flags and the logical (R, K).
inline ffi::Error validate_problem(const std::string& where, int32_t fmt, int64_t block_size,
                                   int32_t rceil, int32_t two_level, int64_t R, int64_t K,
                                   Problem* p) {
  if (fmt < 0 || fmt >= kNumFmts)
    return invalid(where, "attribute `fmt` = " + std::to_string(fmt) + " is not a format id (0..8)");
  if (block_size < 1)
    return invalid(where, "attribute `block_size` = " + std::to_string(block_size) + " must be >= 1");
  if (rceil != 0 && rceil != 1)
    return invalid(where, "attribute `rceil` = " + std::to_string(rceil) + " must be 0 or 1");
  if (two_level != 0 && two_level != 1)
    return invalid(where, "attribute `two_level` = " + std::to_string(two_level) + " must be 0 or 1");
  if (R < 0 || K < 0) return invalid(where, "negative dimension");
  if (K % block_size != 0)
    return invalid(where, "K = " + std::to_string(K) + " is not a multiple of block_size = " +
                              std::to_string(block_size));
  const int bits = elem_bits(fmt);
  if ((K * bits) % 8 != 0)
    return invalid(where, "K = " + std::to_string(K) + " does not pack into whole bytes at " +
                              std::to_string(bits) + " bits per element");
  p->fmt = fmt;
  p->bs = block_size;
  p->R = R;
  p->K = K;
  p->nb = K / block_size;
  p->bits = bits;
  p->rceil = rceil != 0;
  p->two_level = (fmt == kNVFP4) && two_level != 0;
  return ffi::Error::Success();
}

// codes / scales / zeros buffers against the problem; sets p->scale_type for INT4.
inline ffi::Error validate_quantized(const std::string& where, Problem* p,
                                     const ffi::AnyBuffer& codes, const ffi::AnyBuffer& scales,
                                     const ffi::AnyBuffer& zeros) {
  if (!is_byte_dtype(codes.element_type()))
    return check_dtype(where, "codes", codes.element_type(), {ffi::DataType::U8});
  JF4_RETURN_IF_ERROR(check_shape(where, "codes", codes.dimensions(), {p->R, p->K * p->bits / 8}));
  if (p->swizzled) {  // (ceil(R/128)*32, ceil(nb/4)*16) bytes, jax_fp4.layout.swizzled_shape
    JF4_RETURN_IF_ERROR(check_shape(where, "scales", scales.dimensions(),
                                    {(p->R + 127) / 128 * 32, (p->nb + 3) / 4 * 16}));
  } else {
    JF4_RETURN_IF_ERROR(check_shape(where, "scales", scales.dimensions(), {p->R, p->nb}));
  }
  const ffi::DataType st = scales.element_type();
  if (p->fmt == kNF4 || p->fmt == kBNB_FP4) {
    JF4_RETURN_IF_ERROR(check_dtype(where, "scales", st, {ffi::DataType::F32}));
  } else if (p->fmt == kINT4) {
    JF4_RETURN_IF_ERROR(check_dtype(where, "scales", st,
                                    {ffi::DataType::BF16, ffi::DataType::F16, ffi::DataType::F32}));
    p->scale_type = st == ffi::DataType::BF16 ? kScaleBF16 : (st == ffi::DataType::F16 ? kScaleF16 : kScaleF32);
  } else if (!is_byte_dtype(st)) {
    return check_dtype(where, "scales", st, {ffi::DataType::U8});
  }
  if (p->fmt == kINT4) {
    JF4_RETURN_IF_ERROR(check_dtype(where, "zeros", zeros.element_type(), {ffi::DataType::U8}));
    JF4_RETURN_IF_ERROR(check_shape(where, "zeros", zeros.dimensions(), {p->R, p->nb}));
  } else if (zeros.element_count() != 0) {
    return invalid(where, "buffer `zeros` has shape " + dims_str(zeros.dimensions()) +
                              ", expected (0,) for this format");
  }
  return ffi::Error::Success();
}

// Attribute `swizzled` of quantize: 0 (scales (R, nb)) or 1 (the 128x4 layout).
inline ffi::Error validate_swizzled(const std::string& where, int32_t swizzled, Problem* p) {
  if (swizzled != 0 && swizzled != 1)
    return invalid(where, "attribute `swizzled` = " + std::to_string(swizzled) + " must be 0 or 1");
  p->swizzled = swizzled != 0;
  return ffi::Error::Success();
}

inline ffi::Error validate_ts(const std::string& where, const Problem& p, const ffi::AnyBuffer& ts) {
  JF4_RETURN_IF_ERROR(check_dtype(where, "ts", ts.element_type(), {ffi::DataType::F32}));
  return check_shape(where, "ts", ts.dimensions(), {p.R});
}

inline ffi::Error validate_x(const std::string& where, const char* name, const ffi::AnyBuffer& x) {
  JF4_RETURN_IF_ERROR(check_dtype(where, name, x.element_type(),
                                  {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16}));
  if (x.dimensions().size() != 2)
    return invalid(where, std::string("buffer `") + name + "` must be 2-D (R, K), got shape " +
                              dims_str(x.dimensions()));
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CPU_VALIDATE_H_
