// The W4A16 launch: every kernel instance is compiled here, in one translation unit,
// instantiated in the order of the dispatch below (format, x's dtype, decode path
// (use_bit_path), then tile_m: the wgmma kernel for 8 .. 256 (prepare_wgmma, tensor maps,
// cluster shape), else the direct (M <= 16) or staged mma.sync kernel). Keep the kernels
// in one unit: NVVM's unrolling and hoisting decisions depend on what else the unit
// holds, so splitting the two kernel families into separate units changes the generated
// code of some instances (seen on the staged table-path and INT4 kernels).
#include <map>
#include <mutex>
#include <utility>

#include "launch.h"
#include "mma_sync.cuh"
#include "tma.h"
#include "wgmma_kernel.cuh"

namespace jf4 {
namespace cuda {
namespace {

// The wgmma kernel instance runs here only if its sm_90a code was built and the device is
// compute capability 9.0 (an sm_90a cubin loads on nothing else). Also raises its
// dynamic shared-memory limit.
template <class Kernel>
cudaError_t prepare_wgmma_on_device(Kernel kernel, int smem_bytes) {
  int dev = 0, major = 0, minor = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
  if (e != cudaSuccess) return e;
  cudaFuncAttributes attr;
  e = cudaFuncGetAttributes(&attr, kernel);
  if (e != cudaSuccess) return e;
  if (major != 9 || minor != 0 || attr.binaryVersion != 90) return cudaErrorNoKernelImageForDevice;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
}

// prepare_wgmma_on_device once per (kernel, device): a function attribute is set for the
// current device only, so a process that runs the kernel on several GPUs (sharded
// programs) prepares it on each; a launch on an unprepared device fails with
// cudaErrorInvalidValue.
template <class Kernel>
cudaError_t prepare_wgmma(Kernel kernel, int smem_bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, cudaError_t> prepared;
  int dev = 0;
  const cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  std::lock_guard<std::mutex> lock(mu);
  auto it = prepared.find(key);
  if (it == prepared.end()) it = prepared.emplace(key, prepare_wgmma_on_device(kernel, smem_bytes)).first;
  return it->second;
}

template <int FMT, bool BF16, int BITS, int BN>
cudaError_t launch_wgmma(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                         const void* sp, const uint8_t* zp, const float* tp, void* out,
                         const WParams& p, int splits) {
  const bool tiled = p.tiled;
  auto kernel = tiled ? wmatmul_wgmma_kernel<FMT, BF16, BITS, BN, true>
                      : wmatmul_wgmma_kernel<FMT, BF16, BITS, BN, false>;
  constexpr int kSmemLinear = wg_smem_bytes<FMT, BITS, BN, false>();
  constexpr int kSmemTiled = wg_smem_bytes<FMT, BITS, BN, true>();
  static_assert(kSmemLinear <= 227 * 1024 && kSmemTiled <= 227 * 1024,
                "the stages, epilogue and table must fit an SM's shared memory");
  static_assert(wg_fits<FMT, BN, BITS, false>(wg_stage_bytes<FMT, BITS, BN, false>()) &&
                    wg_fits<FMT, BN, BITS, true>(wg_stage_bytes<FMT, BITS, BN, true>()),
                "the CTAs per SM the kernel is built for must fit an SM's shared memory");
  const cudaError_t ready = prepare_wgmma(kernel, tiled ? kSmemTiled : kSmemLinear);
  if (ready != cudaSuccess) return ready;
  // x permuted (M, K128): boxes of BN rows x 64 k into the 128-byte swizzle the wgmma
  // descriptor names; codes (N, K / 2) bytes: boxes of 128 rows x 64 bytes (K % 32 == 0,
  // so rows are 16-byte aligned)
  CUtensorMap x_map, w_map;
  const int64_t k128 = p.n_steps * kWgStepK;
  cudaError_t e = tensor_map_2d(&x_map, BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                                xp, p.x_rows, k128, 2 * k128, BN, 64, CU_TENSOR_MAP_SWIZZLE_128B,
                                CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
  // A stage of kSub > 1 steps takes its codes as one 3-D box where K is whole steps: the
  // codes seen as (64 bytes, rows, 64-byte column blocks), box (64, 128, kSub), land as
  // [step][row][64 bytes], the layout of kSub 2-D boxes, in one copy, with one scale box
  // per stage instead of one per step: fewer copies to issue and wait for. Else (a
  // partial last step, which the 3-D box
  // would not zero-fill: its 64-byte blocks lie inside the row) one 2-D box of 128 rows x
  // 64 bytes per step.
  WParams q = p;
  if (q.g.count == 0) {  // one weight: the call's
    q.g.count = 1;
    q.g.end[0] = p.N;
    q.g.codes[0] = cp;
    q.g.scales[0] = sp;
    q.g.zeros[0] = zp;
    q.g.ts[0] = tp;
  }
  if (q.g.count > 1 && (!tiled || p.cluster != 1)) return cudaErrorInvalidValue;  // (WMembers)
  constexpr int kSub = wg_sub<FMT, BITS, BN>();
  q.stage_codes = !tiled && kSub > 1 && p.K % kWgStepK == 0;
  CUtensorMap s_map = {}, z_map = {};
  if (tiled) {  // the prepared layout: 1-D bulk copies (WMatmulImpl checked the shapes)
    w_map = {};
    q.scale_boxes = 0;
    q.tile_srow = (kWgStepK >> p.bs_shift) * scale_bytes<FMT>(p);
    q.tile_zrow = FMT == kINT4 ? kWgStepK >> p.bs_shift : 0;
    if (p.bs > kWgStepK || (wg_tile_scale_row<FMT>() && q.tile_srow != wg_tile_scale_row<FMT>()) ||
        kWgRows * (q.tile_srow + q.tile_zrow) > wg_tiled_side_bytes<FMT, BITS, BN>() / wg_sub<FMT, BITS, BN, true>())
      return cudaErrorInvalidValue;  // not a layout of jax_fp4.layout.tileable
    for (int i = 0; i < q.g.count; ++i)
      if (reinterpret_cast<uintptr_t>(q.g.codes[i]) % 16 != 0 ||
          reinterpret_cast<uintptr_t>(q.g.scales[i]) % 16 != 0 ||
          (FMT == kINT4 && reinterpret_cast<uintptr_t>(q.g.zeros[i]) % 16 != 0))
        return cudaErrorMisalignedAddress;
  } else if (e == cudaSuccess && q.stage_codes) {
    const cuuint64_t dims[3] = {kWgStepK / 2, static_cast<cuuint64_t>(p.N), static_cast<cuuint64_t>(p.K / kWgStepK)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.K / 2), kWgStepK / 2};
    const cuuint32_t box[3] = {kWgStepK / 2, kWgRows, kSub};
    e = tensor_map(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, cp, 3, dims, strides, box,
                   CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  } else if (e == cudaSuccess) {
    e = tensor_map_2d(&w_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, cp, p.N, p.K / 2, p.K / 2, kWgRows,
                      kWgStepK / 2, CU_TENSOR_MAP_SWIZZLE_NONE,
                      CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
  }
  if (e != cudaSuccess) return e;
  if (!tiled) {
    // Scale (and zero-point) boxes of 128 rows x 16 bytes per step of a stage, where the
    // stages have room, TMA can address the rows (row bytes % 16 == 0) and a step's scale
    // bytes, a power of two, fit in 16 (then they never straddle two aligned 16-byte boxes;
    // all but 32-bit scales in blocks of 16, and a stage's two steps' bytes lie within 32
    // bytes from the boundary before the first); else the lanes load the scales from
    // global memory.
    const int esize = scale_bytes<FMT>(p);
    const int lane_end = ((96 >> p.bs_shift) + (p.bs == 16 ? 2 : 1)) * esize;  // lane t = 3
    q.scale_boxes = wg_boxes<FMT, BITS, BN>() && (p.nb * esize) % 16 == 0 && lane_end <= kWgBoxCols &&
                    (FMT != kINT4 || p.nb % 16 == 0) && reinterpret_cast<uintptr_t>(sp) % 16 == 0 &&
                    (FMT != kINT4 || reinterpret_cast<uintptr_t>(zp) % 16 == 0);
    if (q.scale_boxes) {
      e = tensor_map_2d(&s_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, sp, p.N, p.nb * esize, p.nb * esize,
                        kWgRows, wg_box_cols<FMT, BITS, BN>(), CU_TENSOR_MAP_SWIZZLE_NONE,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
      if (e == cudaSuccess && FMT == kINT4)
        e = tensor_map_2d(&z_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, zp, p.N, p.nb, p.nb, kWgRows,
                          wg_box_cols<FMT, BITS, BN>(), CU_TENSOR_MAP_SWIZZLE_NONE,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
      if (e != cudaSuccess) return e;
    }
  }
  // clusters of p.cluster CTAs (jax_fp4/prims/_launch_plan.py, wmatmul_cluster), the weight tiles
  // rounded up to whole clusters (the kernel's raster)
  const int cluster_ctas = wg_can_multicast<BN>() && p.cluster == 2 ? 2 : 1;
  const int64_t n_tiles = ((p.N + kWgRows - 1) / kWgRows + cluster_ctas - 1) / cluster_ctas * cluster_ctas;
  const int64_t tiles = ((p.M + BN - 1) / BN) * n_tiles;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(tiles), 1, static_cast<unsigned>(splits));
  cfg.blockDim = dim3(wg_threads<BN>());
  cfg.dynamicSmemBytes = tiled ? kSmemTiled : kSmemLinear;
  cfg.stream = stream;
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cluster_ctas;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cfg.attrs = &cluster;
  cfg.numAttrs = cluster_ctas > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, x_map, w_map, s_map, z_map, out, q);
}


template <int FMT, bool BF16, int BITS>
cudaError_t launch_kernel(cudaStream_t stream, const uint16_t* xp, const uint8_t* cp,
                          const void* sp, const uint8_t* zp, const float* tp, void* out,
                          const WParams& p, int splits, int64_t tile_m) {
  switch (tile_m) {
    case 8: return launch_wgmma<FMT, BF16, BITS, 8>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 16: return launch_wgmma<FMT, BF16, BITS, 16>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 32: return launch_wgmma<FMT, BF16, BITS, 32>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 64: return launch_wgmma<FMT, BF16, BITS, 64>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 128: return launch_wgmma<FMT, BF16, BITS, 128>(stream, xp, cp, sp, zp, tp, out, p, splits);
    case 256: return launch_wgmma<FMT, BF16, BITS, 256>(stream, xp, cp, sp, zp, tp, out, p, splits);
    default: break;
  }
  if (p.g.count > 1) return cudaErrorInvalidValue;  // grouped calls: the wgmma kernel only
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
