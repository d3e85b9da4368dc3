// The W4A16 launch: from (format, x's dtype) to the decode path's kernel instance
// (use_bit_path), then to the wgmma kernel (tile_m = 8 .. 256, launch_wgmma.cu) or the
// mma.sync kernels (tile_m = 0, launch_mma_sync.cu). Host code only; no kernel is
// compiled here, so this unit is cheap to rebuild.
#include "launch.h"

namespace jf4 {
namespace cuda {
namespace {

template <int FMT, bool BF16, int BITS>
cudaError_t launch_kernel(JF4_WMATMUL_ARGS, const WParams& p, int splits, int64_t tile_m) {
  switch (tile_m) {
    case 8:
    case 16:
    case 32:
    case 64:
    case 128:
    case 256: return launch_wgmma_tile<FMT, BF16, BITS>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
    default: return launch_mma_sync<FMT, BF16, BITS>(stream, xp, cp, sp, zp, tp, out, p, splits);
  }
}

// The kernel instance of the call's decode path (use_bit_path).
template <int FMT, bool BF16>
cudaError_t launch_decode(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                          const void* sp, const uint8_t* zp, const float* tp, void* out,
                          const WParams& p, int splits, int64_t tile_m) {
  switch (use_bit_path<FMT, BF16>(p)) {
    case 0:  // (NVFP4 and MXFP4 always take their bit path)
      if constexpr (kHasTablePath<FMT>) return launch_kernel<FMT, BF16, 0>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
      break;
    case 1:
      if constexpr (kHasBitPath<FMT>) return launch_kernel<FMT, BF16, 1>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
      break;
    default:
      if constexpr (FMT == kINT4 && BF16)
        return launch_kernel<FMT, BF16, kBitsSplit>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
  }
  return cudaErrorInvalidValue;  // (use_bit_path gives no other path)
}

template <bool BF16>
cudaError_t launch_dtype(int fmt, JF4_WMATMUL_ARGS, const WParams& p, int splits, int64_t tile_m) {
  switch (fmt) {
    case kNVFP4: return launch_decode<kNVFP4, BF16>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
    case kMXFP4: return launch_decode<kMXFP4, BF16>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
    case kNF4: return launch_decode<kNF4, BF16>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
    case kBNB_FP4: return launch_decode<kBNB_FP4, BF16>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
    default: return launch_decode<kINT4, BF16>(stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
  }
}

}  // namespace

cudaError_t launch_wmatmul(int fmt, bool bf16, JF4_WMATMUL_ARGS, const WParams& p, int splits,
                           int64_t tile_m) {
  return bf16 ? launch_dtype<true>(fmt, stream, xp, cp, sp, zp, tp, out, p, splits, tile_m)
              : launch_dtype<false>(fmt, stream, xp, cp, sp, zp, tp, out, p, splits, tile_m);
}

}  // namespace cuda
}  // namespace jf4
