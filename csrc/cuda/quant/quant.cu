// CUDA FFI handlers for quantize / dequantize / fake-quantize and quantize with stochastic rounding
// (csrc/README.md contract).
//
// Memory-bound kernels: one thread owns a chunk of 16 consecutive elements (an NVFP4
// block, half an MX block, 1/G of a codebook/INT4 group) and loads the next chunk of its
// grid-stride loop before it encodes this one; the G = block_size/16 threads of a
// quantization block reduce the block statistics with warp shuffles (G <= 32) or through
// shared memory (G up to 256 = block size 4096). Codes leave as one 8/12/16-byte store.
// The per-block arithmetic is csrc/codecs.h, shared with the CPU kernels; per element,
// hardware conversions and the fast encoders below that equal the codecs.h ones, so the
// kernels match the reference bit for bit. Element indices are 64-bit (tensors above
// 2^31 elements). Design log and measurements: benchmarks/log/NOTES.md.
//
// This unit holds the launch and the FFI handlers; the device code is elements.cuh,
// stochastic.cuh and kernels.cuh (this directory).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>

#include <cstdint>
#include <string>
#include <utility>

#include "../../codecs.h"
#include "../../cpu/kernels.h"
#include "../../cpu/validate.h"
#include "../../ffi_util.h"
#include "../handlers.h"
#include "kernels.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
using cpu::dispatch_fmt;
using cpu::Problem;
using cpu::scale_bytes;
using cpu::validate_problem;
using cpu::validate_quantized;
using cpu::validate_swizzled;
using cpu::validate_ts;
using cpu::validate_x;
namespace {

// ------------------------------------------------------------------ launch
// Calls f(std::integral_constant<int, FMT>) -> ffi::Error for the runtime format id.
template <typename F>
ffi::Error with_fmt(int fmt, F&& f) {
  ffi::Error err = ffi::Error::InvalidArgument("jax_fp4: unknown fmt");
  dispatch_fmt(fmt, [&](auto fmt_c) {
    err = f(fmt_c);
    return true;
  });
  return err;
}

// CTAs for n_chunks chunks (one per thread and step), capped at ctas_per_sm per SM
// (grid-stride beyond that; the choice per kernel: benchmarks/log/NOTES.md): quantize and
// fake-quantize (2 resident CTAs per SM) take 8 waves (16 per SM); dequantize, whose
// traffic is mostly writes, a single CTA per SM.
// The SM count is read once per device (a process may run on several GPUs).
int grid_for(int64_t n_chunks, int ctas_per_sm) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> sm_count[kMaxDevices];
  int dev = 0;
  cudaGetDevice(&dev);
  int sms = dev >= 0 && dev < kMaxDevices ? sm_count[dev].load(std::memory_order_relaxed) : 0;
  if (sms == 0) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (sms <= 0) sms = 132;
    if (dev >= 0 && dev < kMaxDevices) sm_count[dev].store(sms, std::memory_order_relaxed);
  }
  const int64_t ctas = (n_chunks + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * ctas_per_sm;
  return static_cast<int>(ctas < cap ? ctas : cap);
}

Params make_params(const Problem& p) {
  Params q;
  q.n_chunks = p.R * p.K / kChunk;
  q.cpr = p.K / kChunk;
  q.inv_cpr = q.cpr > 0 ? 1.0 / static_cast<double>(q.cpr) : 0.0;
  q.srow = q.scol = 0;  // set with the grid (set_stride)
  q.nb = p.nb;
  q.G = static_cast<int>(p.bs / kChunk);
  q.log2G = 0;
  while ((1 << q.log2G) < q.G) ++q.log2G;
  q.two_level = p.two_level;
  q.rceil = p.rceil;
  q.swizzled = p.swizzled;
  q.rows = p.swizzled || p.two_level;
  q.st = p.scale_type;
  q.sbytes = scale_bytes(p);
  return q;
}

// The grid stride (gridDim.x * kThreads chunks) as (rows, chunks).
Params with_stride(Params q, int grid) {
  const int64_t stride = static_cast<int64_t>(grid) * kThreads;
  q.srow = q.cpr > 0 ? stride / q.cpr : 0;
  q.scol = stride - q.srow * q.cpr;
  return q;
}

// The CUDA kernels need block_size = 16 * G with G a power of two <= 256 (the Python
// lowering sends other INT4 group sizes to the reference path).
ffi::Error check_cuda_block(const std::string& where, const Problem& p) {
  const int64_t g = p.bs / kChunk;
  if (p.bs % kChunk != 0 || g < 1 || g > 256 || (g & (g - 1)) != 0)
    return invalid(where, "the CUDA kernels need block_size = 16 * 2^k <= 4096, got " +
                              std::to_string(p.bs));
  return ffi::Error::Success();
}

ffi::Error launched(const std::string& where) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal("jax_fp4 " + where + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Calls f(Io) for the x/y element type.
template <typename F>
ffi::Error with_io(ffi::DataType t, F&& f) {
  switch (t) {
    case ffi::DataType::F32: return f(IoF32{});
    case ffi::DataType::BF16: return f(Io16<true>{});
    case ffi::DataType::F16: return f(Io16<false>{});
    default: return ffi::Error::InvalidArgument("jax_fp4: unsupported dtype");
  }
}

// Quantize x (both targets): rand null: round to nearest (jax_fp4_quantize_v2); else the
// (R, K) uint32 words of stochastic rounding (jax_fp4_quantize_sr_v1, linear scales).
ffi::Error quantize(const std::string& where, cudaStream_t stream, const ffi::AnyBuffer& x,
                    const ffi::AnyBuffer& ts, const uint32_t* rand, ffi::AnyBuffer& codes,
                    ffi::AnyBuffer& scales, ffi::AnyBuffer& zeros, int32_t fmt,
                    int64_t block_size, int32_t rceil, int32_t two_level, int32_t swizzled) {
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_swizzled(where, swizzled, &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for(p.R * p.K / kChunk, 16);
  const Params q = with_stride(make_params(p), grid);
  // The 128x4 layout's padding (rows past R, scale columns past nb) holds zero bytes.
  if (p.swizzled && (p.R % 128 != 0 || p.nb % 4 != 0) &&
      cudaMemsetAsync(scales.untyped_data(), 0, scales.size_bytes(), stream) != cudaSuccess)
    return launched(where);
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      auto kernel = rand ? quantize_kernel<decltype(F)::value, LT, true>
                         : quantize_kernel<decltype(F)::value, LT, false>;
      kernel<<<grid, kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()), rand,
          static_cast<uint8_t*>(codes.untyped_data()), scales.untyped_data(),
          static_cast<uint8_t*>(zeros.untyped_data()), q);
      return launched(where);
    });
  });
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                        ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::AnyBuffer> zeros, int32_t fmt, int64_t block_size,
                        int32_t rceil, int32_t two_level, int32_t swizzled) {
  return quantize("jax_fp4_quantize_v2 (CUDA)", stream, x, ts, nullptr, *codes, *scales, *zeros,
                  fmt, block_size, rceil, two_level, swizzled);
}

// jax_fp4_quantize_sr_v1: quantize with stochastic rounding of the elements; `rand` (R, K)
// uint32, one word per element of x (jax_fp4/stochastic.py); scales linear.
ffi::Error QuantizeSrImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                          ffi::AnyBuffer rand, ffi::Result<ffi::AnyBuffer> codes,
                          ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> zeros,
                          int32_t fmt, int64_t block_size, int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_quantize_sr_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  JF4_RETURN_IF_ERROR(check_dtype(where, "rand", rand.element_type(), {ffi::DataType::U32}));
  JF4_RETURN_IF_ERROR(check_shape(where, "rand", rand.dimensions(),
                                  {x.dimensions()[0], x.dimensions()[1]}));
  return quantize(where, stream, x, ts, static_cast<const uint32_t*>(rand.untyped_data()), *codes,
                  *scales, *zeros, fmt, block_size, rceil, two_level, 0);
}

// Quantize's results and attributes after its arguments (x, ts for v2; x, ts, rand for
// quantize_sr v1); v2 adds the attribute `swizzled`.
template <class Binding>
auto quantize_binding(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()  // codes
      .template Ret<ffi::AnyBuffer>()      // scales
      .template Ret<ffi::AnyBuffer>()      // zeros
      .template Attr<int32_t>("fmt")
      .template Attr<int64_t>("block_size")
      .template Attr<int32_t>("rceil")
      .template Attr<int32_t>("two_level");
}
auto QuantizeArgs() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()   // x
      .Arg<ffi::AnyBuffer>();  // ts
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer zeros, ffi::AnyBuffer ts, ffi::Result<ffi::AnyBuffer> y,
                          int32_t fmt, int64_t block_size, int32_t two_level) {
  const std::string where = "jax_fp4_dequantize_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "y", *y));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, 0, two_level,
                                       y->dimensions()[0], y->dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for((p.R * p.K / kChunk + 1) / 2, 1);  // two chunks per thread
  const Params q = with_stride(make_params(p), grid);
  return with_fmt(fmt, [&](auto F) {
    return with_io(y->element_type(), [&](auto L) {
      using LT = decltype(L);
      dequantize_kernel<decltype(F)::value, LT>
          <<<grid, kThreads, 0, stream>>>(
              static_cast<const uint8_t*>(codes.untyped_data()), scales.untyped_data(),
              static_cast<const uint8_t*>(zeros.untyped_data()),
              static_cast<const float*>(ts.untyped_data()),
              static_cast<typename LT::storage*>(y->untyped_data()), q);
      return launched(where);
    });
  });
}

ffi::Error FakeQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                            ffi::Result<ffi::AnyBuffer> y, int32_t fmt, int64_t block_size,
                            int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_fake_quantize_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p;
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_cuda_block(where, p));
  if (y->element_type() != x.element_type())
    return invalid(where, "buffer `y` must have the dtype of `x`");
  // INT4 fake-quant keeps the group scale in x's dtype (scale_dtype default)
  p.scale_type = x.element_type() == ffi::DataType::BF16 ? kScaleBF16
                 : x.element_type() == ffi::DataType::F16 ? kScaleF16 : kScaleF32;
  if (p.R * p.K == 0) return ffi::Error::Success();
  const int grid = grid_for(p.R * p.K / kChunk, 16);
  const Params q = with_stride(make_params(p), grid);
  return with_fmt(fmt, [&](auto F) {
    return with_io(x.element_type(), [&](auto L) {
      using LT = decltype(L);
      fake_quantize_kernel<decltype(F)::value, LT><<<grid, kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()),
          static_cast<const float*>(ts.untyped_data()),
          static_cast<typename LT::storage*>(y->untyped_data()), q);
      return launched(where);
    });
  });
}

__global__ void tensor_scale_kernel(uint32_t* bits) {
  *reinterpret_cast<float*>(bits) = nvfp4_tensor_scale_from_amax(*bits);
}

// tensor_scale: x (R, K) f32/bf16/f16 -> () f32, the NVFP4 per-tensor scale of x
// (codecs.h nvfp4_tensor_scale_from_amax of max |x|), csrc/README.md.
ffi::Error TensorScaleImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out) {
  const std::string where = "jax_fp4_tensor_scale_v1 (CUDA)";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  if (out->element_type() != ffi::DataType::F32 || out->element_count() != 1)
    return invalid(where, "buffer `out` must be a float32 scalar");
  if (cudaMemsetAsync(out->untyped_data(), 0, sizeof(uint32_t), stream) != cudaSuccess)
    return launched(where);
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t n_chunks = n / kChunk;
  uint32_t* bits = static_cast<uint32_t*>(out->untyped_data());
  return with_io(x.element_type(), [&](auto L) {
    using LT = decltype(L);
    if (n > 0)
      amax_kernel<LT><<<std::max(1, grid_for((n_chunks + 3) / 4, 16)), kThreads, 0, stream>>>(
          static_cast<const typename LT::storage*>(x.untyped_data()), n, bits);
    tensor_scale_kernel<<<1, 1, 0, stream>>>(bits);
    return launched(where);
  });
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV2Cuda, jf4::cuda::QuantizeImpl,
                              jf4::cuda::quantize_binding(jf4::cuda::QuantizeArgs()).Attr<int32_t>("swizzled"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeSrV1Cuda, jf4::cuda::QuantizeSrImpl,
                              jf4::cuda::quantize_binding(jf4::cuda::QuantizeArgs().Arg<ffi::AnyBuffer>()),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4DequantizeV1Cuda, jf4::cuda::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("two_level"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FakeQuantizeV1Cuda, jf4::cuda::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4TensorScaleV1Cuda, jf4::cuda::TensorScaleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
