// The canonical (R, K) problem of one FFI call, shared by the handlers and every
// per-ISA compute variant.
#ifndef JAX_FP4_CSRC_CPU_PROBLEM_H_
#define JAX_FP4_CSRC_CPU_PROBLEM_H_

#include <cstdint>

namespace jf4 {
namespace cpu {

// ---------------------------------------------------------------------------------
// Problem description (validated by the handler).
// ---------------------------------------------------------------------------------
// (compute.cc only takes it by const reference: no constructor is emitted per ISA.)
struct Problem {
  int fmt = 0;             // format id
  int64_t bs = 0;          // block size
  int64_t R = 0;           // rows
  int64_t K = 0;           // elements per row
  int64_t nb = 0;          // blocks per row
  int bits = 4;            // element bits
  bool rceil = false;      // MX scale rounding
  bool two_level = false;  // NVFP4 with per-row tensor scale
  int scale_type = 0;      // ScaleType (codecs.h): INT4 scales storage
  bool swizzled = false;   // quantize: scales in the 128x4 layout (codecs.h scale_offset)
};

}  // namespace cpu
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CPU_PROBLEM_H_
