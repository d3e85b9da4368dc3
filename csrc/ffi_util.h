// Helpers of the FFI handlers: argument checks that return ffi::Error (never abort)
// and an IEEE floating-point environment guard. Used by the handler translation units
// only (baseline ISA); the per-ISA compute (csrc/cpu/compute.cc) does not include it.
#ifndef JAX_FP4_CSRC_FFI_UTIL_H_
#define JAX_FP4_CSRC_FFI_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "codecs.h"  // JF4_ISA_TAG
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#define JF4_HAVE_MXCSR 1
#endif
#if defined(__aarch64__)
#define JF4_HAVE_FPCR 1
#endif

namespace jf4 {
namespace ffi = ::xla::ffi;
inline namespace JF4_ISA_TAG {

// ---------------------------------------------------------------------------------
// Floating-point environment: XLA:CPU runs handlers with FTZ/DAZ set; the spec is
// exact IEEE (subnormal operands and results). Clears FTZ and DAZ (and selects
// round-to-nearest) for the guard's lifetime, then restores the caller's state.
// ---------------------------------------------------------------------------------
class IeeeFpGuard {
 public:
  IeeeFpGuard() {
#if defined(JF4_HAVE_MXCSR)
    saved_ = _mm_getcsr();
    // bit 15 FTZ, bit 6 DAZ, bits 13-14 rounding control (00 = nearest).
    const unsigned int want = saved_ & ~((1u << 15) | (1u << 6) | (3u << 13));
    if (want != saved_) _mm_setcsr(want);
#elif defined(JF4_HAVE_FPCR)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    // bit 24 FZ, bits 22-23 RMode (00 = nearest).
    const uint64_t want = fpcr & ~((1ull << 24) | (3ull << 22));
    if (want != fpcr) __asm__ __volatile__("msr fpcr, %0" : : "r"(want));
#endif
  }
  ~IeeeFpGuard() {
#if defined(JF4_HAVE_MXCSR)
    if (_mm_getcsr() != saved_) _mm_setcsr(saved_);
#elif defined(JF4_HAVE_FPCR)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeFpGuard(const IeeeFpGuard&) = delete;
  IeeeFpGuard& operator=(const IeeeFpGuard&) = delete;

 private:
#if defined(JF4_HAVE_MXCSR)
  unsigned int saved_ = 0;
#elif defined(JF4_HAVE_FPCR)
  uint64_t saved_ = 0;
#endif
};

// ---------------------------------------------------------------------------------
// Argument checks.
// ---------------------------------------------------------------------------------
inline const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F8E4M3FN: return "float8_e4m3fn";
    case ffi::DataType::F8E5M2: return "float8_e5m2";
    case ffi::DataType::F8E8M0FNU: return "float8_e8m0fnu";
    case ffi::DataType::PRED: return "bool";
    default: return "unsupported dtype";
  }
}

// A shape as text, "(200, 128)". With std::string only: the same function through
// std::ostringstream crashed the process (segfault) when a CUDA handler built an error
// message with it under jax 0.11.2's CUDA plugin (benchmarks/log/NOTES.md); the
// stream's template code is instantiated in the extension and exported as weak symbols,
// which another library loaded in that process can interpose.
inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

inline ffi::Error invalid(const std::string& where, const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_fp4 " + where + ": " + msg);
}

// Checks rank and exact dimensions.
inline ffi::Error check_shape(const std::string& where, const char* name,
                              ffi::AnyBuffer::Dimensions got, std::vector<int64_t> want) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = got[i] == want[i];
  if (ok) return ffi::Error::Success();
  ffi::AnyBuffer::Dimensions w(want.data(), want.size());
  return invalid(where, std::string("buffer `") + name + "` has shape " + dims_str(got) +
                            ", expected " + dims_str(w));
}

// Byte-width-compatible dtype check: float8 codes may arrive as their float8 dtype or
// as uint8 (same bytes).
inline bool is_byte_dtype(ffi::DataType t) {
  return t == ffi::DataType::U8 || t == ffi::DataType::S8 || t == ffi::DataType::F8E4M3FN ||
         t == ffi::DataType::F8E5M2 || t == ffi::DataType::F8E8M0FNU;
}

inline ffi::Error check_dtype(const std::string& where, const char* name, ffi::DataType got,
                              std::initializer_list<ffi::DataType> want) {
  for (auto w : want)
    if (got == w) return ffi::Error::Success();
  std::string exp;
  for (auto w : want) exp += (exp.empty() ? "" : " | ") + std::string(dtype_name(w));
  return invalid(where, std::string("buffer `") + name + "` has dtype " + dtype_name(got) +
                            ", expected " + exp);
}

#define JF4_RETURN_IF_ERROR(expr)            \
  do {                                       \
    ::xla::ffi::Error jf4_err_ = (expr);     \
    if (jf4_err_.failure()) return jf4_err_; \
  } while (0)

}  // inline namespace JF4_ISA_TAG
}  // namespace jf4

#endif  // JAX_FP4_CSRC_FFI_UTIL_H_
