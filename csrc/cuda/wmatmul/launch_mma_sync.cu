// Launch of the mma.sync kernels (tile_m = 0): the direct kernel for M <= 16 (1 or 2
// 8-row activation tiles), else the staged kernel (4 or 8 tiles per grid.y). Explicitly
// instantiates launch_mma_sync for JF4_WMATMUL_INSTANCES.
#include "launch.h"
#include "mma_sync.cuh"

namespace jf4 {
namespace cuda {

template <int FMT, bool BF16, int BITS>
cudaError_t launch_mma_sync(JF4_WMATMUL_ARGS, const WParams& p, int splits) {
  if (direct_path(p.M)) {
    const dim3 grid(static_cast<unsigned>((p.N + kDirectRowsPerCta - 1) / kDirectRowsPerCta), 1,
                    static_cast<unsigned>(splits));
    if (p.M <= 8)
      wmatmul_direct_kernel<FMT, BF16, BITS, 1><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_direct_kernel<FMT, BF16, BITS, 2><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  } else {
    const int mt = p.M <= 32 ? 4 : 8;
    const dim3 grid(static_cast<unsigned>((p.N + kRowsPerCta - 1) / kRowsPerCta),
                    static_cast<unsigned>((p.M + 8 * mt - 1) / (8 * mt)),
                    static_cast<unsigned>(splits));
    if (mt == 4)
      wmatmul_kernel<FMT, BF16, BITS, 4><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
    else
      wmatmul_kernel<FMT, BF16, BITS, 8><<<grid, kWarps * 32, 0, stream>>>(xp, cp, sp, zp, tp, out, p);
  }
  return cudaGetLastError();
}

#define JF4_INSTANCE_(FMT, BF16, BITS) \
  template cudaError_t launch_mma_sync<FMT, BF16, BITS>(JF4_WMATMUL_ARGS, const WParams&, int);
JF4_WMATMUL_INSTANCES(JF4_INSTANCE_)
#undef JF4_INSTANCE_

}  // namespace cuda
}  // namespace jf4
