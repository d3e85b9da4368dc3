// CPU FFI handler symbols. module.cc registers every entry of JAX_FP4_CPU_HANDLERS
// for platform "cpu" (target name, C symbol).
#ifndef JAX_FP4_CSRC_CPU_HANDLERS_H_
#define JAX_FP4_CSRC_CPU_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

#define JAX_FP4_CPU_HANDLERS(X)                          \
  X("jax_fp4_quantize_v2", JaxFp4QuantizeV2Cpu)          \
  X("jax_fp4_quantize_sr_v1", JaxFp4QuantizeSrV1Cpu)     \
  X("jax_fp4_dequantize_v1", JaxFp4DequantizeV1Cpu)      \
  X("jax_fp4_fake_quantize_v1", JaxFp4FakeQuantizeV1Cpu)

#define JAX_FP4_DECLARE_(target, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
JAX_FP4_CPU_HANDLERS(JAX_FP4_DECLARE_)
#undef JAX_FP4_DECLARE_

#endif  // JAX_FP4_CSRC_CPU_HANDLERS_H_
