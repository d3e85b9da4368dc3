// CUDA FFI handler symbols, defined in csrc/cuda/*.cu (compiled only when CMake finds
// a CUDA toolkit and there are CUDA sources; module.cc is then built with
// -DJAX_FP4_WITH_CUDA). module.cc registers every entry of JAX_FP4_CUDA_HANDLERS for
// platform "CUDA".
//
// To add a CUDA handler: define it in a .cu file with
//   XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV2Cuda, Impl,
//       ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()...);
// (same args / rets / attrs as the CPU handler, csrc/README.md) and add one line
//   X("jax_fp4_quantize_v2", JaxFp4QuantizeV2Cuda)
// to the list below.
#ifndef JAX_FP4_CSRC_CUDA_HANDLERS_H_
#define JAX_FP4_CSRC_CUDA_HANDLERS_H_

#include "xla/ffi/api/ffi.h"

#define JAX_FP4_CUDA_HANDLERS(X)                         \
  X("jax_fp4_quantize_v2", JaxFp4QuantizeV2Cuda)         \
  X("jax_fp4_quantize_sr_v1", JaxFp4QuantizeSrV1Cuda)    \
  X("jax_fp4_dequantize_v1", JaxFp4DequantizeV1Cuda)     \
  X("jax_fp4_fake_quantize_v1", JaxFp4FakeQuantizeV1Cuda) \
  X("jax_fp4_wmatmul_v3", JaxFp4WMatmulV3Cuda)      \
  X("jax_fp4_tensor_scale_v1", JaxFp4TensorScaleV1Cuda)

#define JAX_FP4_DECLARE_(target, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
JAX_FP4_CUDA_HANDLERS(JAX_FP4_DECLARE_)
#undef JAX_FP4_DECLARE_

#endif  // JAX_FP4_CSRC_CUDA_HANDLERS_H_
