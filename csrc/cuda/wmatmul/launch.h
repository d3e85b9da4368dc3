// The fused W4A16 matmul kernels (csrc/README.md: jax_fp4_wmatmul_v3), host interface:
// WParams (one call's problem, passed by value to every kernel), the launch geometry that
// the host code and the kernels share, the decode-path rule (use_bit_path) and the launch
// entry points. Host-only (no device code): the FFI handler (ffi.cu) and
// benchmarks/wmatmul_harness.cu include it and link the kernels' units.
//
//   partial[z, m, n] = sum_{k in split z} x[m, k] * w[n, k]
//
// x (M, K) bf16/f16; w (N, K) a 4-bit QArray blocked along K (nvfp4 with or without the
// per-tensor scale, mxfp4, nf4, bnb_fp4, int4); partial (S, M, N) float32, summed over
// the S K-splits by the caller (jax_fp4/prims/wmatmul.py), or x's dtype when S = 1. Each
// weight element is decoded inside the main loop -- no dequantized weight reaches HBM --
// to the reference's value rounded once to x's dtype, except NVFP4's per-tensor scale,
// which multiplies the float32 accumulator instead (the W4A16 tolerance contract,
// docs/spec.md), and multiplied on the tensor cores (float32 accumulation). How it is
// decoded (bit path / table path) is described above decode_word.
//
// Tiling. The weight plays the MMA's A operand (16 rows x 16 k per warp, row-major =
// (N, K) storage) and the activations its B operand, so decode (M = 1) uses the tensor
// cores too. Lane (g, t) = (lane / 4, lane % 4) holds rows g and g + 8 of each of its
// 16-row tiles. The MMA sums over k, so any k order works if A and B agree: a lane loads
// 32 contiguous k of a row as one 16-byte chunk and feeds them as its fragment's k
// slots; the activations are fed in the same order. Three kernels, see their comments:
// the direct kernel (mma.sync, M <= 16, x read from global memory), the staged kernel
// (mma.sync, M > 16, x staged in shared memory) and the wgmma kernel (sm_90a, chosen by
// the caller through `tile_m`, x pre-permuted by the caller and staged by the tensor
// memory accelerator). grid.z splits K so that small-N shapes still fill the GPU.
//
// Files (csrc/cuda/wmatmul/): common.cuh (weight loads, packed half arithmetic, stores),
// decode.cuh (E2M1 / E4M3 / E8M0 / codebook / INT4 decode into MMA fragments),
// mma_sync.cuh (the direct and staged kernels), wgmma_config.cuh (the wgmma kernel's
// tiles, stages and barriers), wgmma_kernel.cuh (the wgmma kernel), tma.h / tma.cu
// (tensor maps), launch.cu (the dispatch and launches: the one unit that compiles the
// kernels), ffi.cu (the FFI handler).
// Invariants: the .cuh files hold device code in an anonymous namespace and are included
// by launch.cu only, so every kernel is compiled once, in one unit (see launch.cu for why
// one); moving code between these files must not change the kernels: they are the same
// templates, instantiated the same way.
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_LAUNCH_H_
#define JAX_FP4_CSRC_CUDA_WMATMUL_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

#include "../../codecs.h"

namespace jf4 {
namespace cuda {

// Launch geometry shared by the host code and the kernels.
constexpr int kWarps = 4;                             // warps per CTA (both kernels)
constexpr int kRowTiles = 2;                          // 16-row weight tiles per warp
constexpr int kRowsPerCta = kWarps * kRowTiles * 16;  // 128
constexpr int kStepK = 128;                           // k per super-step (staged kernel)
// Decode kernel (mma_sync.cuh): kDirectL contiguous 32-k chunks per lane and row per
// super-step of kDirectStepK.
constexpr int kDirectL = 2;
constexpr int kDirectRowsPerCta = kRowsPerCta;        // 128
constexpr int kDirectStepK = 4 * 32 * kDirectL;       // 256
// wgmma kernel (wgmma_config.cuh)
constexpr int kWgRows = 128;   // weight rows per CTA
constexpr int kWgStepK = 128;  // k per step
// a step's scales and zero points at most (int4 / nf4 / bnb_fp4; jax_fp4.layout.tileable):
// int4 in groups of 128 with 2-byte scales take 384 bytes, nf4 in blocks of 64 1 KB
constexpr int kWgTiledSide = 2048;

// The weights of one call. One, or for a grouped call (the wgmma kernel on prepared
// weights only: ffi.cu) up to kMaxMembers weights of the same format, K and layout that
// share x -- q / k / v, gate / up -- read as one weight whose rows are theirs in order:
// member i holds the rows [end[i - 1], end[i]) (end[-1] = 0; whole 128-row tiles, so a
// CTA's weight tile lies in one member) and writes the output columns of those rows.
constexpr int kMaxMembers = 4;
struct WMembers {
  int count;  // 0: launch_wgmma fills member 0 from the call's pointers
  int64_t end[kMaxMembers];
  const uint8_t* codes[kMaxMembers];
  const void* scales[kMaxMembers];
  const uint8_t* zeros[kMaxMembers];
  const float* ts[kMaxMembers];
};

struct WParams {
  int64_t M, N, K;
  int64_t x_rows;          // wgmma kernel: rows of x, M or M rounded up to tile_m (zero rows)
  int K32;                 // K as int (K < 2^31 is checked by the handler)
  int64_t nb;              // scale blocks per weight row
  int bs;                  // block size: a power of two >= 16
  int bs_shift;            // log2(bs)
  int64_t n_steps;         // ceil(K / step): step = 128 k (staged) or kDirectStepK (direct)
  int64_t steps_per_split;
  int two_level;           // NVFP4 with a per-tensor scale: applied to the accumulator
  int ts_stride;           // ts holds one scale per weight row (1) or one for all (0)
  int st;                  // INT4 scale storage type
  int out_f32;             // output float32 (else x's dtype: one split only)
  int scale_boxes;         // wgmma kernel: the scales come by TMA with the stages
  int stage_codes;         // wgmma kernel: a stage's codes come as one 3-D box (launch_wgmma)
  int tiled;               // wgmma kernel: codes and scales in the prepared layout (launch_wgmma
                           // picks the kernel instance)
  int tile_srow;           // prepared layout: scale bytes per row and 128-k step, and INT4's
  int tile_zrow;           // zero-point bytes (launch_wgmma; wg_tile_scale_row)
  int cluster;             // wgmma kernel at BN = 256: CTAs per cluster, 1 or 2 (x multicast)
  WMembers g;              // wgmma kernel: the weights (N = their rows' sum)
};

// The decode paths a format has (use_bit_path; described above decode_word).
template <int FMT>
constexpr bool kHasBitPath = FMT == kNVFP4 || FMT == kINT4 || FMT == kMXFP4;
template <int FMT>
constexpr bool kHasTablePath = FMT != kNVFP4 && FMT != kMXFP4;

// The kernels' BITS: 0 the table path, 1 the bit path, kBitsSplit INT4's bit path with the
// scale split in two bf16 factors (f16 scales, bf16 x).
constexpr int kBitsSplit = 2;

// tile_m > 0: the wgmma kernel with tile_m activation rows per CTA; else M <= 16: the
// direct kernel, larger M: the staged kernel, 64 rows of x per grid.y.
inline bool direct_path(int64_t M) { return M <= 16; }
inline int64_t step_k(int64_t M, int64_t tile_m) {
  return tile_m > 0 ? kWgStepK : direct_path(M) ? kDirectStepK : kStepK;
}

// Which bit path is exact for this call (see the decode comment above): 0 none (the table
// path), 1, or kBitsSplit.
template <int FMT, bool BF16>
inline int use_bit_path(const WParams& p) {
  if constexpr (!kHasBitPath<FMT>) return 0;
  if (FMT == kINT4) return p.st == (BF16 ? kScaleBF16 : kScaleF16) ? 1 : BF16 && p.st == kScaleF16 ? kBitsSplit : 0;
  return 1;
}

// Pointers of one call: x (M or x_rows, K or K128) bf16 / f16 bits, the weight's codes,
// scales, zero points and per-tensor scale(s) (a grouped call: its first member's; the
// others in p.g), the output; all device memory.
#define JF4_WMATMUL_ARGS                                                                  \
  cudaStream_t stream, const uint16_t *xp, const uint8_t *cp, const void *sp,             \
      const uint8_t *zp, const float *tp, void *out

// Launches the kernel of the call (format, x's dtype, decode path, tile_m) on `stream`.
// cudaErrorNoKernelImageForDevice: tile_m > 0 without an sm_90a build or GPU
// (prepare_wgmma); cudaErrorInvalidValue / cudaErrorMisalignedAddress: a prepared
// (`tiled`) weight that is not a layout of jax_fp4.layout.tileable, or a grouped call
// (p.g.count > 1) outside the wgmma kernel's prepared layout at one CTA per cluster. `p`
// as WMatmulImpl (ffi.cu) fills it, the arguments already validated.
cudaError_t launch_wmatmul(int fmt, bool bf16, JF4_WMATMUL_ARGS, const WParams& p, int splits,
                           int64_t tile_m);

}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_LAUNCH_H_
