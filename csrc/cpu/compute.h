// Entry points of the CPU compute, built once per instruction set: csrc/cpu/compute.cc
// is compiled with -DJF4_ISA_NS=base and, on x86-64, again with -DJF4_ISA_NS=avx2 and
// AVX2 flags. handlers.cc validates the buffers and picks the variant at run time.
// Only plain types cross this boundary (no XLA or std templates), so that nothing
// compiled for one ISA can be merged into another by the linker.
#ifndef JAX_FP4_CSRC_CPU_COMPUTE_H_
#define JAX_FP4_CSRC_CPU_COMPUTE_H_

#include <cstdint>

#include "problem.h"

namespace jf4 {
namespace cpu {

enum class FloatType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Runs fn(ctx, begin, end) over [0, n) in chunks of at least `grain` items on XLA's
// intra-op thread pool (`pool` is an xla::ffi::ThreadPool*, may be null), each chunk
// with IEEE subnormals enabled. Defined in handlers.cc (baseline ISA).
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
void run_parallel(void* pool, int64_t n, int64_t grain, void* ctx, RangeFn fn);

// x / y have element type `type`; ts is (R,) f32; rand is null (round to nearest even)
// or (R, K) uint32 random bits (stochastic rounding, csrc/sr_codecs.h). Return false for
// an unsupported format or type (the handlers validate first, so this does not happen).
#define JF4_DECLARE_CPU_COMPUTE(ns)                                                        \
  namespace ns {                                                                           \
  bool quantize(void* pool, const Problem& p, FloatType type, const void* x,               \
                const float* ts, const uint32_t* rand, uint8_t* codes, void* scales,       \
                uint8_t* zeros);                                                           \
  bool dequantize(void* pool, const Problem& p, FloatType type, const uint8_t* codes,      \
                  const void* scales, const uint8_t* zeros, const float* ts, void* y);     \
  bool fake_quantize(void* pool, const Problem& p, FloatType type, const void* x,          \
                     const float* ts, void* y);                                            \
  }

JF4_DECLARE_CPU_COMPUTE(base)
#if defined(JF4_HAVE_AVX2_VARIANT)
JF4_DECLARE_CPU_COMPUTE(avx2)
#endif
#undef JF4_DECLARE_CPU_COMPUTE

}  // namespace cpu
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CPU_COMPUTE_H_
