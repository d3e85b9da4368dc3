// Tensor-map (TMA descriptor) construction for the wgmma kernel (launch.cu, launch_wgmma):
// cuTensorMapEncodeTiled, obtained from the driver through the runtime, so the library
// needs no libcuda link. Host code.
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_TMA_H_
#define JAX_FP4_CSRC_CUDA_WMATMUL_TMA_H_

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace jf4 {
namespace cuda {

// A tensor map of `rank` dimensions (dims[0] innermost, strides[i] the byte stride of
// dims[i + 1]) for boxes of box[0] x ... elements, zero fill out of bounds.
// cuTensorMapEncodeTiled comes from the driver through the runtime (no libcuda link).
cudaError_t tensor_map(CUtensorMap* map, CUtensorMapDataType type, const void* base, int rank,
                       const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                       CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion);

// A 2-D tensor map over a row-major (rows, cols) array for tiles of box_rows x box_cols.
cudaError_t tensor_map_2d(CUtensorMap* map, CUtensorMapDataType type, const void* base,
                          int64_t rows, int64_t cols, int64_t row_bytes, int box_rows,
                          int box_cols, CUtensorMapSwizzle swizzle,
                          CUtensorMapL2promotion promotion);

}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_TMA_H_
