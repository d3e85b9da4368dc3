// The FFI handler of jax_fp4_wmatmul_v3 (csrc/README.md): validates the buffers and
// attributes against the contract (InvalidArgument naming the buffer, never an abort),
// fills WParams (and WMembers: one weight, or the weights of a grouped call) and hands
// the call to launch_wmatmul (launch.h). No kernel is compiled here.
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "../../codecs.h"
#include "../../cpu/validate.h"
#include "../../ffi_util.h"
#include "../handlers.h"
#include "launch.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
using cpu::Problem;
using cpu::validate_problem;
using cpu::validate_quantized;
using cpu::validate_ts;
namespace {

// One weight of the call (weight i of a grouped call): codes (N, K / 2) of the call's K,
// scales, zeros and ts validated against the format and layout; its Problem in *p.
ffi::Error ValidateWeight(const std::string& where, const ffi::AnyBuffer& codes,
                          const ffi::AnyBuffer& scales, const ffi::AnyBuffer& zeros,
                          const ffi::AnyBuffer& ts, int32_t fmt, int64_t block_size,
                          int32_t two_level, int64_t K, int64_t tile_m, int32_t tiled, Problem* p) {
  if (codes.dimensions().size() != 2 || 2 * codes.dimensions()[1] != K)
    return invalid(where, "buffer `codes` must be 2-D (N, " + std::to_string(K / 2) +
                              ") (K = " + std::to_string(K) + "), got shape " + dims_str(codes.dimensions()));
  if (tiled && (codes.dimensions()[0] % kWgRows != 0 || K % kWgStepK != 0))
    return invalid(where, "attribute `tiled` = 1 (the prepared weight layout) needs N and K "
                          "multiples of 128, got codes shape " + dims_str(codes.dimensions()));
  if (tile_m > 0 && codes.dimensions()[0] >= (int64_t{1} << 31))
    return invalid(where, "the wgmma kernel (tile_m > 0) needs N < 2^31 (tensor memory "
                          "accelerator coordinates), got N = " + std::to_string(codes.dimensions()[0]));
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, 0, two_level,
                                       codes.dimensions()[0], K, p));
  JF4_RETURN_IF_ERROR(validate_quantized(where, p, codes, scales, zeros));
  // the per-tensor scale: one per weight row, or one for the whole weight
  JF4_RETURN_IF_ERROR(check_dtype(where, "ts", ts.element_type(), {ffi::DataType::F32}));
  if (ts.dimensions().size() != 1 || (ts.dimensions()[0] != p->R && ts.dimensions()[0] != 1))
    return invalid(where, "buffer `ts` must be 1-D of N = " + std::to_string(p->R) +
                              " or 1 elements, got shape " + dims_str(ts.dimensions()));
  if (tiled) {  // the layouts jax_fp4.layout.tileable makes (wg_tiled_side_bytes)
    const int64_t per_step = block_size > kWgStepK ? 0 : kWgStepK / block_size;
    // (the bytes of scale_bytes<FMT>, for the fmt known here at run time)
    const int64_t esize = fmt == kNF4 || fmt == kBNB_FP4 || (fmt == kINT4 && p->scale_type == kScaleF32) ? 4
                          : fmt == kINT4 ? 2 : 1;
    const int64_t row = per_step * (esize + (fmt == kINT4 ? 1 : 0));
    if (per_step == 0 || kWgRows * row > kWgTiledSide)
      return invalid(where, "attribute `tiled` = 1 (the prepared weight layout) needs block_size <= 128 "
                            "and at most " + std::to_string(kWgTiledSide / kWgRows) + " scale and zero-point "
                            "bytes per row and 128 k, got block_size = " + std::to_string(block_size) +
                                " with " + std::to_string(row));
  }
  return ffi::Error::Success();
}

// `weights`: codes, scales, zeros, ts of each of 1 .. kMaxMembers weights (a grouped call:
// WMembers, launch.h); the output's columns are theirs in order.
ffi::Error WMatmulImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::RemainingArgs weights,
                       ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t block_size,
                       int32_t two_level, int64_t splits, int64_t tile_m, int64_t cluster,
                       int32_t tiled) {
  const std::string where = "jax_fp4_wmatmul (CUDA)";
  JF4_RETURN_IF_ERROR(check_dtype(where, "x", x.element_type(),
                                  {ffi::DataType::BF16, ffi::DataType::F16}));
  if (fmt != kNVFP4 && fmt != kMXFP4 && fmt != kNF4 && fmt != kBNB_FP4 && fmt != kINT4)
    return invalid(where, "attribute `fmt` = " + std::to_string(fmt) +
                              " has no fused kernel (nvfp4, mxfp4, nf4, bnb_fp4, int4 only)");
  if (tile_m != 0 && tile_m != 8 && tile_m != 16 && tile_m != 32 && tile_m != 64 && tile_m != 128 && tile_m != 256)
    return invalid(where, "attribute `tile_m` = " + std::to_string(tile_m) +
                              " must be 0 (mma.sync kernels) or 8, 16, 32, 64, 128, 256 (wgmma kernel)");
  if (cluster != 1 && !(cluster == 2 && tile_m == 256))
    return invalid(where, "attribute `cluster` = " + std::to_string(cluster) +
                              " must be 1, or 2 with tile_m = 256 (got tile_m = " +
                              std::to_string(tile_m) + ")");
  if (tiled != 0 && tiled != 1)
    return invalid(where, "attribute `tiled` = " + std::to_string(tiled) + " must be 0 or 1");
  if (tiled && tile_m == 0)
    return invalid(where, "attribute `tiled` = 1 (the prepared weight layout) needs the wgmma "
                          "kernel (tile_m > 0), got tile_m = 0");
  const size_t n_bufs = weights.size();
  if (n_bufs == 0 || n_bufs % 4 != 0 || n_bufs / 4 > kMaxMembers)
    return invalid(where, "after `x` the call takes 4 buffers (codes, scales, zeros, ts) for each of 1 to " +
                              std::to_string(kMaxMembers) + " weights, got " + std::to_string(n_bufs) + " buffers");
  const int members = static_cast<int>(n_bufs / 4);
  if (members > 1 && !(tiled && cluster == 1))
    return invalid(where, "a call of " + std::to_string(members) + " weights needs the prepared "
                          "layout (tiled = 1) and cluster = 1, got tiled = " + std::to_string(tiled) +
                              ", cluster = " + std::to_string(cluster));
  std::optional<ffi::AnyBuffer> bufs[4 * kMaxMembers];
  for (size_t i = 0; i < n_bufs; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = weights.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    bufs[i].emplace(*b);
  }
  if (bufs[0]->dimensions().size() != 2)
    return invalid(where, "buffer `codes` must be 2-D (N, K/2), got shape " + dims_str(bufs[0]->dimensions()));
  const int64_t K = 2 * bufs[0]->dimensions()[1];
  // the wgmma kernel takes x permuted within 128-k blocks and zero-padded to them
  const int64_t x_cols = tile_m > 0 ? (K + kWgStepK - 1) / kWgStepK * kWgStepK : K;
  if (x.dimensions().size() != 2 || x.dimensions()[1] != x_cols)
    return invalid(where, "buffer `x` must be 2-D (M, " + std::to_string(x_cols) +
                              ") for K = " + std::to_string(K) + " and tile_m = " +
                              std::to_string(tile_m) + ", got shape " + dims_str(x.dimensions()));
  // M = the output's rows; the wgmma kernel's x may have M rounded up to tile_m (zero rows,
  // primitives.wmatmul_x_layout), so that no activation box reaches past x's rows
  if (out->dimensions().size() != 3)
    return invalid(where, "result `out` must be 3-D (splits, M, N), got shape " + dims_str(out->dimensions()));
  const int64_t M = out->dimensions()[1];
  const int64_t x_rows = x.dimensions()[0];
  const int64_t m_tiled = tile_m > 0 ? (M + tile_m - 1) / tile_m * tile_m : M;
  if (x_rows != M && x_rows != m_tiled)
    return invalid(where, "buffer `x` must have the output's M = " + std::to_string(M) + " rows" +
                              (tile_m > 0 ? ", or M rounded up to tile_m (" + std::to_string(m_tiled) + ")"
                                          : std::string()) +
                              ", got " + std::to_string(x_rows));
  if (tile_m > 0 && x_rows >= (int64_t{1} << 31))
    return invalid(where, "the wgmma kernel (tile_m > 0) needs M < 2^31 (tensor memory "
                          "accelerator coordinates), got M = " + std::to_string(x_rows));
  if ((fmt == kNVFP4 && block_size != 16) || (fmt == kMXFP4 && block_size != 32))
    return invalid(where, "attribute `block_size` = " + std::to_string(block_size) +
                              ": the fused kernel decodes nvfp4 in blocks of 16 and mxfp4 in "
                              "blocks of 32 (the formats' specs)");
  if (K % 32 != 0 || K >= (int64_t{1} << 31) || block_size < 16 ||
      (block_size & (block_size - 1)) != 0)
    return invalid(where, "the fused kernel needs K a multiple of 32, K < 2^31 and a power-of-two "
                          "block_size >= 16, got K = " + std::to_string(K) + ", block_size = " +
                              std::to_string(block_size));
  Problem p;
  WMembers g = {};
  g.count = members;
  int64_t n_total = 0;
  int ts_stride = 0;
  for (int i = 0; i < members; ++i) {
    const std::string wi = members > 1 ? where + ", weight " + std::to_string(i) : where;
    const ffi::AnyBuffer &codes = *bufs[4 * i], &scales = *bufs[4 * i + 1], &zeros = *bufs[4 * i + 2],
                         &ts = *bufs[4 * i + 3];
    Problem pi;
    JF4_RETURN_IF_ERROR(ValidateWeight(wi, codes, scales, zeros, ts, fmt, block_size, two_level, K,
                                       tile_m, tiled, &pi));
    const int stride = ts.dimensions()[0] == pi.R && pi.R > 1 ? 1 : 0;
    if (i == 0) {
      p = pi;
      ts_stride = stride;
    } else if (pi.scale_type != p.scale_type || stride != ts_stride) {
      return invalid(wi, "the weights of one call need the same scale dtype and the same form of "
                         "`ts` (one per row, or one for all) as weight 0");
    }
    n_total += pi.R;
    g.end[i] = n_total;
    g.codes[i] = static_cast<const uint8_t*>(codes.untyped_data());
    g.scales[i] = scales.untyped_data();
    g.zeros[i] = static_cast<const uint8_t*>(zeros.untyped_data());
    g.ts[i] = static_cast<const float*>(ts.untyped_data());
  }
  if (tile_m > 0 && n_total >= (int64_t{1} << 31))
    return invalid(where, "the wgmma kernel (tile_m > 0) needs N < 2^31 (tensor memory "
                          "accelerator coordinates), got N = " + std::to_string(n_total));
  const int64_t step = step_k(M, tile_m);
  const int64_t n_steps = (K + step - 1) / step;
  if (splits < 1 || splits > 65535 || (n_steps > 0 && splits > n_steps))
    return invalid(where, "attribute `splits` = " + std::to_string(splits) +
                              " must be in [1, min(65535, ceil(K / " + std::to_string(step) +
                              "))]");
  if (splits == 1)
    JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(),
                                    {ffi::DataType::F32, x.element_type()}));
  else
    JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(), {ffi::DataType::F32}));
  JF4_RETURN_IF_ERROR(check_shape(where, "out", out->dimensions(), {splits, M, n_total}));
  if (M == 0 || n_total == 0) return ffi::Error::Success();
  if (K == 0) {
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    return e == cudaSuccess ? ffi::Error::Success()
                            : ffi::Error::Internal(where + ": " + cudaGetErrorString(e));
  }
  WParams w;
  w.M = M;
  w.x_rows = x_rows;
  w.N = n_total;
  w.K = K;
  w.K32 = static_cast<int>(K);
  w.nb = p.nb;
  w.bs = static_cast<int>(block_size);
  w.bs_shift = 0;
  while ((int64_t{1} << w.bs_shift) < block_size) ++w.bs_shift;
  w.n_steps = n_steps;
  w.steps_per_split = (n_steps + splits - 1) / splits;
  w.two_level = p.two_level;
  w.ts_stride = ts_stride;
  w.st = p.scale_type;
  w.out_f32 = out->element_type() == ffi::DataType::F32;
  w.scale_boxes = 0;  // launch_wgmma decides
  w.stage_codes = 0;  // launch_wgmma decides
  w.tiled = tiled;
  w.cluster = static_cast<int>(cluster);
  w.g = g;
  const cudaError_t e = launch_wmatmul(
      fmt, x.element_type() == ffi::DataType::BF16, stream,
      static_cast<const uint16_t*>(x.untyped_data()), g.codes[0], g.scales[0], g.zeros[0], g.ts[0],
      out->untyped_data(), w, static_cast<int>(splits), tile_m);
  if (e == cudaErrorNoKernelImageForDevice && tile_m > 0)
    return ffi::Error::InvalidArgument(
        "jax_fp4_wmatmul (CUDA): attribute `tile_m` = " + std::to_string(tile_m) +
        " asks for the wgmma kernel, which needs a compute capability 9.0 GPU and a build for "
        "sm_90a (CUDAARCHS containing 90a); use tile_m = 0");
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_fp4_wmatmul (CUDA): ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

auto WMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::AnyBuffer>()  // x (M, K) bf16/f16 (tile_m > 0: (M or M rounded up to tile_m, K128), permuted)
      .RemainingArgs()        // per weight (1 .. kMaxMembers): codes (N_i, K/2) u8, scales
                              // (N_i, K/bs), zeros (N_i, K/bs) u8 or (0,), ts (N_i,) or (1,)
                              // f32 (tiled: codes and scales in the prepared layout)
      .Ret<ffi::AnyBuffer>()  // partial sums (S, M, N = sum N_i) f32, or x's dtype when S = 1
      .Attr<int32_t>("fmt")
      .Attr<int64_t>("block_size")
      .Attr<int32_t>("two_level")
      .Attr<int64_t>("splits")
      .Attr<int64_t>("tile_m")
      .Attr<int64_t>("cluster")
      .Attr<int32_t>("tiled");
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4WMatmulV3Cuda, jf4::cuda::WMatmulImpl,
                              jf4::cuda::WMatmulBinding(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
