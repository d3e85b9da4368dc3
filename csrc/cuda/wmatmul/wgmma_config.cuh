// W4A16 kernels (launch.h): the wgmma kernel's configuration: tile and stage sizes, which
// table and how many stages per (FMT, BITS, BN), the shared-memory layout of a stage, and
// the PTX wrappers (wgmma fences, mbarriers, the split-K cluster reduction) it uses. Its
// constexpr functions are __host__ __device__: launch.cu (launch_wgmma) sizes the launch with them,
// so host and kernel agree on the layout by construction.
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_CONFIG_CUH_
#define JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_CONFIG_CUH_

#include "../wgmma.cuh"
#include "decode.cuh"

namespace jf4 {
namespace cuda {
namespace {

// ---- wgmma kernel (sm_90a; on Hopper from M = 1: primitives.wmatmul_tile_m) ----
//
// Warpgroup MMA with the weight as A from registers (decoded exactly as above) and the
// activations as B from shared memory (Machete's arrangement on Hopper: the decoded
// weight never leaves registers). A CTA is two warpgroups over 128 weight rows (warpgroup
// wg: rows 64 wg + 16 warp + {g, g + 8}, lane t owning k [32 t, 32 t + 32) of each per
// 128-k step, as in the staged kernel) and BN activation rows; per 128-k step each
// warpgroup issues 8 wgmma m64nBNk16, BN = 8 .. 256 (the caller's tile_m: 8 for M <= 8,
// where n8 beats n16: half the B tile to copy and multiply). The
// MMA sums over k, so the activations must sit in shared memory in the lane's k order:
// the caller passes x pre-permuted within each 128-k block (jax_fp4/prims/wmatmul.py,
// wmatmul_x_layout), so that plain tile copies do.
//
// Pipeline. The tensor memory accelerator copies each step's BN x 128 activation tile
// (two 64-k boxes, zero past M) into the 128-byte-swizzled K-major layout that the wgmma
// descriptor names, and the step's weight codes (128 rows x 64 bytes, zero past N and K)
// behind it, completing on the stage's `full` mbarrier; wg_stages<FMT, BITS, BN> stages. The copies
// carry L2 hints: the codes, read once, are evicted first, the activations, which every
// CTA re-reads, last (without them the codes pushed x out of L2 and the kernel read
// markedly more DRAM bytes than the weight). A
// warpgroup keeps one wgmma group in flight across steps, so the stage of step s - 1
// may still be read during step s. Once a warp's first wgmma group of step s is issued
// and the group before it done, the warp is done with step s - 1 and arrives on that
// stage's `empty` mbarrier; the stage is refilled with step s - 1 + stages once all eight
// have (no CTA barrier: the warpgroups drift apart, and the copies run up to stages - 1
// steps ahead). A stage may hold wg_sub<FMT, BITS, BN> = 2 consecutive steps (activation
// tiles, then codes, one per step, then one scale box for both), filled by one `full`
// barrier and released once, after the first group of its successor's first step; its
// codes come as one 3-D box and its scales as one box 32 bytes wide (launch_wgmma). Who refills
// (wg_producer<BN>; benchmarks/log/NOTES.md has the comparisons):
//  - BN <= 128: thread 0, between its own wgmma groups (no CTA barrier per step, and no
//    producer warpgroup taking registers and issue slots from the consumers).
//  - BN = 256: a third, producer warpgroup (CUTLASS's warp-specialized kernels): one
//    lane waits on the `empty` barriers and issues the copies, its warpgroup gives its
//    registers to the two consumer warpgroups (setmaxnreg 40 / 232), leaves after its
//    last copy, and the consumers' epilogue synchronises on named barrier 1. A CTA
//    barrier per step would keep only stages - 2 = 1 step of copies ahead (three stages
//    of 72 KB fill the SM).
//    Where the caller asks (attribute `cluster` = 2, primitives.wmatmul_cluster), the
//    BN = 256 kernel runs in clusters of two CTAs on adjacent 128-row weight tiles with
//    the same activation tile: each producer copies one 64-k box of it into both CTAs'
//    stage (TMA multicast), so the pair reads x from L2 once. A stage is then refilled
//    only once the consumers of both CTAs released it: each producer, after its own
//    `empty` barrier, arrives on its own and the other CTA's `pair` barrier and waits on
//    its own. (It pays where the copies, not the MMAs, bound the kernel:
//    primitives.wmatmul_cluster.)
// Each lane reads its two 16-byte code chunks of a step from the stage (a warp reads 512
// contiguous bytes), which beat codes loaded by the lanes into registers for every format
// but nvfp4 at large M, where they were close. The block scales (and INT4 zero points) come one of two
// ways: as scale boxes in the stage (wg_boxes<FMT, BITS, BN> and launch_wgmma's checks on
// the scale rows), one more tensor copy of the 128 rows x 16 aligned bytes that hold the
// step's blocks, read by the lanes from shared memory; or loaded by the lanes from global
// memory wg_depth<BN> steps ahead into registers (the scale rows' addresses pinned in
// registers). The stage index and parity are carried from step to step. The epilogue
// moves the accumulators through shared memory so that each warp stores whole rows of
// the output.
constexpr int kWgThreads = 256;
constexpr int kWgGroupM = 8;   // CTA raster: kWgGroupM activation tiles per weight tile run
constexpr int kOutStride = kWgRows + 4;  // epilogue floats per activation row (no conflicts)

// 128-k steps per stage (wg_sub) and stages (wg_stages) are defined below wg_words.

// steps of weight chunks loaded ahead: 2 where the registers allow (more loads in flight;
// deeper does not help once the .L2::128B line prefetch brings the next step's half)
template <int BN>
__host__ __device__ constexpr int wg_depth() { return BN >= 128 ? 1 : 2; }
template <int BN>  // a third warpgroup that only refills the stages (see Pipeline above)
__host__ __device__ constexpr bool wg_producer() { return BN >= 256; }
template <int BN>  // threads per CTA: two warpgroups (+ the producer warpgroup)
__host__ __device__ constexpr int wg_threads() { return kWgThreads + (wg_producer<BN>() ? 128 : 0); }
constexpr int kWgProducerRegs = 40, kWgConsumerRegs = 232;  // 128 x 40 + 256 x 232 <= 64K
// Clusters of two CTAs along the weight rows that share the activation tile (TMA multicast,
// see Pipeline above): the kernels with a producer warpgroup can run in them; the caller
// decides per call (attribute `cluster`, primitives.wmatmul_cluster).
template <int BN>
__host__ __device__ constexpr bool wg_can_multicast() { return wg_producer<BN>(); }
// The table path's table (fill_table, decode_word), by tile width:
// - BN = 8, 16, 128: the wide pair table (32 copies, 64 KB), one PRMT per address, beside
//   3 stages: the fewest decode instructions.
// - BN = 32, 64: 16 pair-table copies (32 KB), where 64 KB would cost a CTA per SM or a
//   stage.
// - BN = 256: the lane table (2 KB); its 3 stages of 73 KB leave no room for a pair table
//   (the wide table with 2 stages lost at large M).
// - INT4's table path: the lane table, its scale and zero-point boxes leave no room.
// (The measurements behind these choices: benchmarks/log/NOTES.md.)
template <int FMT, int BN>
__host__ __device__ constexpr int wg_copies() {
  return FMT == kINT4 || BN >= 256 ? kLaneTable : BN == 32 || BN == 64 ? kCopies : kWideCopies;
}
// Code words (of each of a lane's two rows) decoded per wgmma group: 2, or 1 at BN = 256
// and for the table path at BN = 8 (with its loads ahead, below), but INT4's (with one
// word there ptxas serializes its wgmmas, C7513). More words per group hold more
// registers and hide less latency; fewer issue more groups: 2 was fastest.
template <int FMT, int BITS, int BN>
__host__ __device__ constexpr int wg_words() { return BN >= 256 || (!BITS && FMT != kINT4 && BN == 8) ? 1 : 2; }
// Whether the table path loads a group's table values before issuing the wgmmas of the
// group before (the group's multiplies after them; table_load / table_finish): at BN = 256,
// and at BN = 8 where it has one word per group: there the loads' latency hides behind
// the wgmmas; with two words per group (BN = 16-128) the extra live registers cost more
// than they hide.
template <int FMT, int BN>
__host__ __device__ constexpr bool wg_table_ahead() { return BN == 256 || (BN == 8 && wg_words<FMT, false, BN>() == 1); }
// 128-k steps per stage: 2 for the bit path at BN <= 64, for the prepared bit path at
// BN = 128, the table path at BN = 8 and the prepared table path at BN = 32, else 1. A
// stage of two steps is waited for, released and refilled once.
// - BN = 8 to 32, 3 stages of two (6 steps ahead); linear INT4 with its scale and
//   zero-point boxes 2 stages of two at BN = 32, where 3 do not fit.
// - BN = 64 and 128, 2 stages of two: the same 4 steps ahead as 4 stages of one, half the
//   barrier waits, releases and copies (linear INT4's boxes fit since the shared memory
//   lost its 1 KB alignment slack).
// - The prepared table path at BN = 32, 2 stages of two instead of 4 of one; at BN = 8, 2
//   stages of two beside the wide table. At BN = 16 and 64 the table leaves no room for
//   them. (Each was faster than what it replaced: benchmarks/log/NOTES.md.)
template <int FMT, int BITS, int BN, bool TILED = false>
__host__ __device__ constexpr int wg_sub() {
  return (BITS && BN <= 64) || (!BITS && FMT != kINT4 && BN == 8) || (TILED && (BITS ? BN == 128 : BN == 32))
             ? 2
             : 1;
}
// 4 stages where they fit, else 3: at BN = 256; at BN = 64 for the table path, whose 16
// table copies (wg_copies) fit beside 3 stages at two CTAs per SM, not beside 4; and for
// stages of two steps at BN = 16, 32. Beside the wide pair table (64 KB, wg_copies): 3, or
// 2 of two steps at BN = 8. The bit path at BN = 8: 3 (6 steps ahead instead of 8: fewer
// bytes in flight streamed faster; 5 and 2 stages were slower). Stages of two steps at
// BN = 64 and 128 (wg_sub), the prepared table path's at BN = 32 and linear INT4's at
// BN = 32: 2 (a third would not fit: two CTAs per SM at BN <= 64, the SM at 128). Other
// stage counts and steps per stage at BN = 8 to 64 were slower (benchmarks/log/NOTES.md).
template <int FMT, int BITS, int BN, bool TILED = false>
__host__ __device__ constexpr int wg_stages() {
  if constexpr (!BITS && wg_copies<FMT, BN>() == kWideCopies) return BN == 8 ? 2 : 3;
  if constexpr (BITS && BN == 8) return 3;
  constexpr bool kTwo = wg_sub<FMT, BITS, BN, TILED>() > 1;
  if constexpr (kTwo && (BN == 64 || BN == 128 || !BITS || (FMT == kINT4 && !TILED && BN == 32))) return 2;
  return BN >= 256 || BN == 64 || (kTwo && BN >= 16) ? 3 : 4;
}
// L2 cache policies (CUTLASS's CacheHintSm90): the activations, which every CTA re-reads,
// stay; the weight codes, read once, go first
constexpr uint64_t kEvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
constexpr uint64_t kEvictLast = 0x14F0000000000000ull;
constexpr int kWgCodeBytes = kWgRows * kWgStepK / 2;  // a step's weight codes: 128 rows x 64 B
constexpr int kWgBoxCols = 16;  // a step's scale / zero-point box: 128 rows x 16 bytes (TMA's minimum)
template <int BN>  // a step's activation tile: BN rows x 128 k
__host__ __device__ constexpr int wg_x_bytes() { return BN * kWgStepK * 2; }
template <int BN>  // CTAs per SM the kernel is built for (launch bounds)
__host__ __device__ constexpr int wg_ctas() { return BN >= 128 ? 1 : 2; }
template <int FMT, int BITS, int BN>  // a stage's box width: 16 bytes per step it holds
__host__ __device__ constexpr int wg_box_cols() { return kWgBoxCols * wg_sub<FMT, BITS, BN>(); }
template <int FMT, int BITS, int BN>  // a stage's scale box, and INT4's zero-point box
__host__ __device__ constexpr int wg_side_bytes() { return (FMT == kINT4 ? 2 : 1) * kWgRows * wg_box_cols<FMT, BITS, BN>(); }
// The dynamic shared memory, from its base (1024-aligned: the 128-byte TMA swizzle's atom,
// by the `.align 1024` of its declaration): the stages (the epilogue's tile reuses them),
// the table path's table (the lane table 2 KB-aligned at run time: 1 KB more room), then
// the `full`, `empty` and `pair` mbarriers, 8 bytes per stage each. No alignment slack and
// no static shared memory: a CTA takes what this says plus the 1 KB reserved per CTA
// (kSmemReserved), which is what decides two CTAs per SM at BN <= 64.
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_table_off(int stage_bytes) {
  const int pipe = wg_stages<FMT, BITS, BN, TILED>() * stage_bytes;
  const int epi = BN * kOutStride * 4;
  return ((pipe > epi ? pipe : epi) + 1023) / 1024 * 1024;
}
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_bar_off(int stage_bytes) {
  return wg_table_off<FMT, BN, BITS, TILED>(stage_bytes) +
         (BITS ? 0 : table_bytes<wg_copies<FMT, BN>()>() +
                     (wg_copies<FMT, BN>() == kLaneTable ? kLaneTableAlign - 1024 : 0));
}
template <int FMT, int BN, int BITS, bool TILED = false>
__host__ __device__ constexpr int wg_smem_for(int stage_bytes) {
  return wg_bar_off<FMT, BN, BITS, TILED>(stage_bytes) + 3 * 8 * wg_stages<FMT, BITS, BN, TILED>();
}
constexpr int kSmemReserved = 1024;  // shared memory the driver reserves per CTA (sm_80 on)
template <int FMT, int BN, int BITS, bool TILED = false>  // wg_ctas CTAs fit an SM (228 KB)
__host__ __device__ constexpr bool wg_fits(int stage_bytes) {
  return wg_ctas<BN>() * (wg_smem_for<FMT, BN, BITS, TILED>(stage_bytes) + kSmemReserved) <= 228 * 1024;
}
// The prepared ("tiled") weight layout of jax_fp4.prepare (jax_fp4/layout.py, tile_rows):
// the codes (128 rows x 64 bytes), scales (128 rows x tile_srow bytes) and INT4 zero
// points (128 rows x tile_zrow bytes) of each 128-row x 128-k tile stored contiguously,
// the tiles ordered [row tile][step]; N % 128 == 0 and K % 128 == 0, nvfp4 and mxfp4 in
// their spec blocks (16, 32), int4 / nf4 / bnb_fp4 in blocks of 16..128 whose scales and
// zero points per step fit kWgTiledSide (jax_fp4.layout.tileable). A stage's codes,
// scales and zero points are then 1-D bulk copies of contiguous bytes (cp.async.bulk) that
// land in the stage as [step][row][bytes]: no tensor maps, no 64-byte row pieces 4-14 KB
// apart in DRAM (the offline re-layout of Marlin-style W4A16 kernels). The kernel's TILED
// instance reads this layout.
template <int FMT>  // a row's scale bytes per 128-k step: 8 E4M3 (nvfp4), 4 E8M0 (mxfp4), or
__host__ __device__ constexpr int wg_tile_scale_row() {  // 0: by block size and scale dtype (p.tile_srow)
  return FMT == kNVFP4 ? 8 : FMT == kMXFP4 ? 4 : 0;
}
template <int FMT, int BITS, int BN>  // a stage's room for them (1024-aligned, as the stages)
__host__ __device__ constexpr int wg_tiled_side_bytes() {
  return wg_sub<FMT, BITS, BN, true>() *
         (wg_tile_scale_row<FMT>() ? (kWgRows * wg_tile_scale_row<FMT>() + 1023) / 1024 * 1024 : kWgTiledSide);
}
// Whether the stages carry the scale boxes (see Pipeline below): BN <= 128 (BN = 256 is
// bound by the tensor cores, and its three stages fill the SM), for nvfp4 only at BN <= 32
// with stages of two steps (elsewhere its one 2-byte lane load per row and step is as
// fast), and only where the boxes do not cost a CTA per SM (wg_fits).
template <int FMT, int BITS, int BN>
__host__ __device__ constexpr bool wg_boxes() {
  return BN <= 128 && (FMT != kNVFP4 || BN <= 32) &&
         wg_fits<FMT, BN, BITS>(wg_sub<FMT, BITS, BN>() * (wg_x_bytes<BN>() + kWgCodeBytes) +
                                wg_side_bytes<FMT, BITS, BN>());
}
// stage = [activation tiles | weight codes | scale boxes or prepared scales], the first
// two one per step it holds; the last the scale boxes' room (where they fit) in the linear
// layout's instance, the prepared scales' in the TILED one
template <int FMT, int BITS, int BN, bool TILED>
__host__ __device__ constexpr int wg_stage_bytes() {
  return wg_sub<FMT, BITS, BN, TILED>() * (wg_x_bytes<BN>() + kWgCodeBytes) +
         (TILED ? wg_tiled_side_bytes<FMT, BITS, BN>() : wg_boxes<FMT, BITS, BN>() ? wg_side_bytes<FMT, BITS, BN>() : 0);
}
static_assert(wg_boxes<kINT4, true, 8>() && wg_boxes<kINT4, true, 16>() && wg_boxes<kINT4, true, 32>() &&
                  wg_boxes<kINT4, true, 64>(),
              "linear INT4's stages of two (wg_sub) are measured with its scale and zero-point boxes");
template <int FMT, int BITS, int BN, bool TILED>
__host__ __device__ constexpr int wg_smem_bytes() {
  return wg_smem_for<FMT, BN, BITS, TILED>(wg_stage_bytes<FMT, BITS, BN, TILED>());
}

// n bytes of shared memory, zero-extended
template <int N>
__device__ __forceinline__ uint32_t lds_bytes(const uint8_t* a) {
  if constexpr (N == 1) return *a;
  else if constexpr (N == 2) return *reinterpret_cast<const uint16_t*>(a);
  else return *reinterpret_cast<const uint32_t*>(a);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Registers the compiler must not read or move across this point (CUTLASS's
// warpgroup_fence_operand): the accumulators after the last wgmma.wait_group, the A
// fragments before wgmma.fence (ptxas serializes the wgmmas if an input register is
// defined between the fence and the wgmma).
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (*r)[4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

// Matrix descriptor of a K-major, 128-byte-swizzled operand (PTX ISA 9.7.15.5.1.2):
// start address, leading byte offset (unused with this swizzle: 1), stride byte offset
// 1024 (8 rows of 128 B), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3ffffu) >> 4) | (uint64_t{1} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

template <bool CLUSTER = false>  // CLUSTER: acquire what other CTAs of the cluster released
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    if constexpr (CLUSTER)
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    else
      asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_CONFIG_CUH_
