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

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

#define JAX_FP4_CUDA_HANDLERS(X)                         \
  X("jax_fp4_quantize_v2", JaxFp4QuantizeV2Cuda)         \
  X("jax_fp4_quantize_sr_v1", JaxFp4QuantizeSrV1Cuda)    \
  X("jax_fp4_dequantize_v1", JaxFp4DequantizeV1Cuda)     \
  X("jax_fp4_fake_quantize_v1", JaxFp4FakeQuantizeV1Cuda) \
  X("jax_fp4_wmatmul_v3", JaxFp4WMatmulV3Cuda)      \
  X("jax_fp4_tensor_scale_v1", JaxFp4TensorScaleV1Cuda) \
  X("jax_fp4_all_reduce_v1", JaxFp4AllReduceV1Cuda)

#define JAX_FP4_DECLARE_(target, symbol) XLA_FFI_DECLARE_HANDLER_SYMBOL(symbol);
JAX_FP4_CUDA_HANDLERS(JAX_FP4_DECLARE_)
#undef JAX_FP4_DECLARE_

namespace jf4 {
namespace cuda {
// The buffers of one all-reduce call site (csrc/cuda/collective/all_reduce.cu) on every
// GPU of `groups` (device ordinals, each group in rank order), `max_elements` float32
// elements per message. Returns the channel id (> 0); 0 with `error` empty where some
// pair of GPUs has no peer access (the caller keeps XLA's all-reduce), 0 with `error`
// set where a CUDA call failed or the groups are malformed.
int64_t AllReduceSetup(const std::vector<std::vector<int>>& groups, int64_t max_elements,
                       std::string* error);
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_HANDLERS_H_
