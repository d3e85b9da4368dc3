// Stochastic rounding (SR) of the elements for jax_fp4_quantize_sr_v1 (csrc/README.md):
// the encoders of csrc/sr_codecs.h, shared with the CPU kernel, which state the rule of
// jax_fp4/reference.py quantize_2d(..., rand=...) bit for bit. The block scale and the
// element multiplier are those of round-to-nearest quantize (quantize_chunk); only the
// element's rounding differs. This header adds the one adapter the CUDA kernel needs: a
// codebook element's code (sr_codecs.h gives its sorted position, which codecs.h's
// codebook_code maps as for round-to-nearest).
// Finite inputs only: quantize_chunk gives a block with a NaN / Inf the NaN scale and
// zero codes before any element is encoded. Needs IEEE float32 arithmetic (no FTZ, IEEE
// division, no FMA contraction: the build's -fmad=false).
#ifndef JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_
#define JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_

#include <cstdint>

#include "../../codecs.h"
#include "../../sr_codecs.h"

namespace jf4 {
namespace cuda {
namespace {

template <int FMT>
JF4_HD uint32_t codebook_encode_sr(float x, float mult, uint32_t rand) {
  return codebook_code<FMT>(codebook_position_sr<FMT>(x, mult, rand));
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_QUANT_STOCHASTIC_CUH_
