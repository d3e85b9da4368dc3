// W4A16 kernels (launch.h): the wgmma kernel (sm_90a only; the body compiles to a trap
// elsewhere and the launch refuses it there, prepare_wgmma). Pipeline, tiles and
// invariants: the comment at the top of wgmma_config.cuh. Launched by launch.cu (launch_wgmma).
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_KERNEL_CUH_
#define JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_KERNEL_CUH_

#include "wgmma_config.cuh"

namespace jf4 {
namespace cuda {
namespace {

// TILED: the weight in the prepared layout, a second instance (with the layout a runtime
// flag, the linear layout's step loop would grow)
template <int FMT, bool BF16, int BITS, int BN, bool TILED>
__global__ void __launch_bounds__(wg_threads<BN>(), wg_ctas<BN>()) wmatmul_wgmma_kernel(
    const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap s_map, const __grid_constant__ CUtensorMap z_map,
    void* __restrict__ out, const WParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kStages = wg_stages<FMT, BITS, BN, TILED>();
  constexpr bool kProducer = wg_producer<BN>();
  constexpr int kWords = wg_words<FMT, BITS, BN>();
  constexpr bool kAhead = !BITS && wg_table_ahead<FMT, BN>();
  constexpr int kStage = wg_stage_bytes<FMT, BITS, BN, TILED>();
  constexpr int kSub = wg_sub<FMT, BITS, BN, TILED>();  // steps per stage
  static_assert(kSub <= 2, "a stage's scale box covers two steps' bytes (launch_wgmma)");
  // where in a stage: step h's activation tile, its codes, the boxes (width kBoxCols)
  constexpr int kX = wg_x_bytes<BN>(), kCodes = kSub * kX, kSide = kSub * (kX + kWgCodeBytes);
  constexpr int kBoxCols = wg_box_cols<FMT, BITS, BN>();
  // the scales come with the stages: boxes (launch_wgmma: where the scale rows allow), or
  // the prepared layout's bulk copies
  constexpr bool kSideScales = wg_boxes<FMT, BITS, BN>() || TILED;
  constexpr bool tiled = TILED;
  const bool boxes = (wg_boxes<FMT, BITS, BN>() && p.scale_boxes) || tiled;
  // the layout of wg_smem_for; the base's 1024-byte alignment, which the 128-byte swizzle
  // needs, is the declaration's (PTX ISA 5.4.5: `.align` gives the variable's address; the
  // compiler relies on it too and folds a run-time check of it away). The base is still
  // taken as the run-time address rounded up to 1024, the same address: with the symbol's
  // address itself ptxas scheduled the prepared INT4 kernels at 8- and 16-row tiles worse.
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  uint8_t* smem = smem_raw + (((raw_addr + 1023u) & ~1023u) - raw_addr);
  const uint32_t smem_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  // full[j]: stage j holds its steps; empty[j]: every warp is done with stage j (release);
  // pair[j]: ... in every CTA of the cluster
  const uint32_t full_addr = smem_addr + wg_bar_off<FMT, BN, BITS, TILED>(kStage);
  const uint32_t empty_addr = full_addr + 8 * kStages, pair_addr = empty_addr + 8 * kStages;
  constexpr bool kLane = wg_copies<FMT, BN>() == kLaneTable;
  float2* table = align_shared(reinterpret_cast<float2*>(smem + wg_table_off<FMT, BN, BITS, TILED>(kStage)),
                               kLane ? kLaneTableAlign : 16);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = kLane ? lane_table_base(table, lane) : 8 * (lane & (wg_copies<FMT, BN>() - 1));
  if constexpr (!BITS) if (tid < kWgThreads) fill_table<FMT, wg_copies<FMT, BN>()>(table, tid, kWgThreads);
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < kStages; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full_addr + 8 * i));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(empty_addr + 8 * i),
                   "n"(kWgThreads / 32));
      if constexpr (wg_can_multicast<BN>())  // the producers of both CTAs of a cluster
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 2;\n" ::"r"(pair_addr + 8 * i));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // CTAs in the cluster: 1, or 2 sharing the activation tile (launch_wgmma, p.cluster)
  uint32_t ncl = 1;
  if constexpr (wg_can_multicast<BN>()) asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(ncl));
  // raster: runs of kWgGroupM activation tiles per weight tile (per ncl adjacent weight
  // tiles, one cluster), so the CTAs resident at once share both operands in L2; a
  // cluster's CTAs (rank = blockIdx.x % ncl, PTX ISA %cluster_ctarank) share m0
  const int64_t m_tiles = (p.M + BN - 1) / BN;
  const int64_t n_tiles = ((p.N + kWgRows - 1) / kWgRows + ncl - 1) / ncl;
  const uint32_t rank = blockIdx.x % ncl;
  const int64_t id = blockIdx.x / ncl;
  const int64_t group = id / (kWgGroupM * n_tiles);
  const int64_t gm0 = group * kWgGroupM;
  const int64_t gsize = min(static_cast<int64_t>(kWgGroupM), m_tiles - gm0);
  const int64_t rem = id - group * kWgGroupM * n_tiles;
  const int m0 = static_cast<int>((gm0 + rem % gsize) * BN);  // M < 2^31 (TMA coordinate)
  const int64_t n_cta = ((rem / gsize) * ncl + rank) * kWgRows;  // may be >= N: all zeros

  // the member weight (WMembers) that holds the CTA's weight tile, and the tile's first
  // row in it: indexed at compile time, so the parameters are read in place
  const uint8_t* codes = p.g.codes[0];
  const void* scales = p.g.scales[0];
  const uint8_t* zeros = p.g.zeros[0];
  const float* ts = p.g.ts[0];
  int64_t n_base = 0;
#pragma unroll
  for (int i = 1; i < kMaxMembers; ++i)
    if (i < p.g.count && n_cta >= p.g.end[i - 1]) {
      codes = p.g.codes[i];
      scales = p.g.scales[i];
      zeros = p.g.zeros[i];
      ts = p.g.ts[i];
      n_base = p.g.end[i - 1];
    }

  const int wrow = (warp >> 2) * 64 + (warp & 3) * 16 + g;  // lane's first row in the CTA
  const int64_t n_warp = n_cta + wrow - g;
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp - n_base + g, p);
  float tsv[1][2];  // one 16-row tile per warp
  load_tensor_scales<1>(ts, n_warp - n_base + g, p, tsv);
  const bool rows_inside = n_warp + 16 <= p.N;

  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  // step `step`, the h-th of stage j, zero past M, N and K, arriving on full[j]; one thread
  // issues it: its activation tile (two 64-k boxes) and weight codes (128 rows x 64
  // bytes; for h = 0 with p.stage_codes, the stage's kSub steps of codes as one 3-D box),
  // and for h = 0 the stage's scale / zero-point boxes (128 rows x the kBoxCols bytes from
  // the 16-byte boundary at or before the stage's first block: a box must start on one,
  // and the stage's kSub <= 2 steps' bytes fit, launch_wgmma). In the prepared layout
  // (tiled) the stage's codes, scales and INT4 zero points instead, for h = 0, as one bulk
  // copy each (one per step for a stage reaching past K, whose steps past K repeat the
  // last: K % 128 == 0 and N % 128 == 0, so no step is partial; a weight tile past N,
  // cluster rounding, is not copied). In a cluster of two, CTA r copies box r of the
  // activation tile into stage j of both CTAs (TMA multicast, arriving on each one's
  // full[j]): the pair reads the tile from L2 once.
  // a prepared step's scale / zero-point bytes per row (nvfp4 / mxfp4: known at compile
  // time) and per tile; the zero points follow the stage's scales
  const int srow = !tiled ? kBoxCols : wg_tile_scale_row<FMT>() ? wg_tile_scale_row<FMT>() : p.tile_srow;
  const int zrow = !tiled ? kBoxCols : FMT == kINT4 ? p.tile_zrow : 0;
  const int tile_sbytes = kWgRows * srow, tile_zbytes = kWgRows * zrow;
  const int64_t tile0 = ((n_cta - n_base) / kWgRows) * p.n_steps;  // the CTA's weight tile's first step
  const uint8_t* tile_codes = codes + tile0 * kWgCodeBytes;
  const uint8_t* tile_scales = static_cast<const uint8_t*>(scales) + tile0 * tile_sbytes;
  const uint8_t* tile_zeros = zeros + tile0 * tile_zbytes;
  // bytes a stage receives
  const uint32_t stage_tx = tiled ? kSub * (kX + (n_cta < p.N ? kWgCodeBytes + tile_sbytes + tile_zbytes : 0))
                                  : boxes ? kSide + wg_side_bytes<FMT, BITS, BN>() : kSide;
  auto copy_step = [&](int step, uint32_t j, int h) {
    const uint32_t bar = full_addr + 8 * j, stage = smem_addr + j * kStage, dst = stage + h * kX;
    auto copy = [&](uint32_t to, const CUtensorMap* map, int c0, int c1, uint64_t hint) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
          " [%0], [%1, {%2, %3}], [%4], %5;\n"
          ::"r"(to), "l"(map), "r"(c0), "r"(c1), "r"(bar), "l"(hint) : "memory");
    };
    const int n = static_cast<int>(n_cta);
    if (wg_can_multicast<BN>() && ncl > 1) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
          ".L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n"
          ::"r"(dst + rank * (BN * 128)), "l"(&x_map), "r"(step * kWgStepK + 64 * static_cast<int>(rank)),
          "r"(m0), "r"(bar), "h"(static_cast<uint16_t>(3)), "l"(kEvictLast) : "memory");
    } else {
      copy(dst, &x_map, step * kWgStepK, m0, kEvictLast);
      copy(dst + BN * 128, &x_map, step * kWgStepK + 64, m0, kEvictLast);
    }
    if constexpr (tiled) {
      auto bulk = [&](uint32_t to, const uint8_t* from, int bytes) {  // read once: evict first
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1], %2, [%3], %4;\n"
            ::"r"(to), "l"(from), "r"(bytes), "r"(bar), "l"(kEvictFirst) : "memory");
      };
      if (h == 0 && n_cta < p.N) {
        const uint32_t zdst = stage + kSide + kSub * tile_sbytes;  // the stage's zero points
        if (step + kSub <= p.n_steps) {
          bulk(stage + kCodes, tile_codes + static_cast<int64_t>(step) * kWgCodeBytes, kSub * kWgCodeBytes);
          bulk(stage + kSide, tile_scales + static_cast<int64_t>(step) * tile_sbytes, kSub * tile_sbytes);
          if constexpr (FMT == kINT4) bulk(zdst, tile_zeros + static_cast<int64_t>(step) * tile_zbytes, kSub * tile_zbytes);
        } else {
#pragma unroll
          for (int hh = 0; hh < kSub; ++hh) {
            const int64_t s = min(static_cast<int64_t>(step + hh), p.n_steps - 1);
            bulk(stage + kCodes + hh * kWgCodeBytes, tile_codes + s * kWgCodeBytes, kWgCodeBytes);
            bulk(stage + kSide + hh * tile_sbytes, tile_scales + s * tile_sbytes, tile_sbytes);
            if constexpr (FMT == kINT4) bulk(zdst + hh * tile_zbytes, tile_zeros + s * tile_zbytes, tile_zbytes);
          }
        }
      }
    } else if (kSub == 1 || !p.stage_codes) {
      copy(stage + kCodes + h * kWgCodeBytes, &w_map, step * (kWgStepK / 2), n, kEvictFirst);
    } else if (h == 0) {  // w_map 3-D: (64 bytes, rows, 64-byte column blocks)
      asm volatile(
          "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
          " [%0], [%1, {%2, %3, %4}], [%5], %6;\n"
          ::"r"(stage + kCodes), "l"(&w_map), "r"(0), "r"(n), "r"(step), "r"(bar), "l"(kEvictFirst) : "memory");
    }
    if constexpr (wg_boxes<FMT, BITS, BN>()) {
      if (boxes && !tiled && h == 0) {  // a scale row's 128-byte line serves 8-16 steps: normal eviction
        const int b0 = (step * kWgStepK) >> p.bs_shift;
        copy(stage + kSide, &s_map, (b0 * scale_bytes<FMT>(p)) & ~15, n, kEvictNormal);
        if constexpr (FMT == kINT4) copy(stage + kSide + kWgRows * kBoxCols, &z_map, b0 & ~15, n, kEvictNormal);
      }
    }
  };
  // stage j <- the kSub steps from step0 (a step past the split's end is copied, the next
  // split's or zeros past K, and not used)
  auto stage_step = [&](int step0, uint32_t j) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                 ::"r"(full_addr + 8 * j), "r"(stage_tx)
                 : "memory");
#pragma unroll
    for (int h = 0; h < kSub; ++h) copy_step(step0 + h, j, h);
  };
  // The lane's two rows (g, g + 8) with their scale / zero-point row addresses pinned in
  // registers: otherwise the compiler recomputes the 64-bit row addresses every step.
  Rows lrows[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lrows[h] = rows;
    lrows[h].scales = rows.scales + h * rows.scale_stride;
    lrows[h].zeros = rows.zeros + h * rows.zero_stride;
    lrows[h].n0 = rows.n0 + 8 * h;
    asm volatile("" : "+l"(lrows[h].scales), "+l"(lrows[h].zeros));
  }
  // steps before fast_end are whole 128-k steps of rows inside N: no bounds checks
  const int fast_end = rows_inside ? min(step_end, p.K32 / kWgStepK) : step_begin;
  // the scales (and zero points) of a step; its codes come with the stage
  auto load_step = [&](Chunk (&c)[2], int step) {
    const int k = step * kWgStepK + 32 * t;
    if (step < fast_end) {  // warp-uniform
#pragma unroll
      for (int h = 0; h < 2; ++h) load_chunk<FMT, BITS, false, false>(c[h], lrows[h], 0, k, true, p);
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) load_chunk<FMT, BITS, true, false>(c[h], lrows[h], 0, k, k < p.K32, p);
    }
  };

  float acc[BN / 2];
  zero<BN / 2>(acc);
  // the eight consumer warps (all of the CTA but the producer warpgroup, which has left)
  auto consumer_sync = [] {
    if constexpr (wg_producer<BN>()) asm volatile("bar.sync 1, %0;\n" ::"n"(kWgThreads) : "memory");
    else __syncthreads();
  };

  if (wg_can_multicast<BN>() && ncl > 1)  // both CTAs' barriers initialised before any copy or remote arrive
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  else
    __syncthreads();  // barriers initialised (and the decode table filled)
  if constexpr (kProducer) {
    if (warp >= kWgThreads / 32) {  // the producer warpgroup: one lane refills each stage
      asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kWgProducerRegs));
      if (tid == kWgThreads) {  // once the eight consumer warps released its previous step
        uint32_t j = 0, use = 0;
        uint32_t peer_pair = 0;  // the other CTA's pair barriers
        if (ncl > 1)
          asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(peer_pair) : "r"(pair_addr), "r"(rank ^ 1u));
        for (int step = step_begin; step < step_end; step += kSub) {
          if (use > 0) {
            mbar_wait(empty_addr + 8 * j, (use - 1) & 1u);
            // In a cluster the copies write stage j of both CTAs: pass the release on to
            // both producers and wait for the other CTA's. (The producers do this, not
            // the consumer warps: a remote arrive between their wgmmas made ptxas
            // serialize them, C7513.) Only before a refill, which the other producer waits
            // for, so no CTA exits with a remote arrive pending on it.
            if (ncl > 1) {
              asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(pair_addr + 8 * j) : "memory");
              asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n"
                           ::"r"(peer_pair + 8 * j) : "memory");
              mbar_wait<true>(pair_addr + 8 * j, (use - 1) & 1u);
            }
          }
          stage_step(step, j);
          if (++j == kStages) {
            j = 0;
            ++use;
          }
        }
      }
      return;  // the consumers' epilogue synchronises on named barrier 1
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWgConsumerRegs));
  } else if (tid == 0) {
    for (int i = 0; i < kStages; ++i)
      if (step_begin + kSub * i < step_end) stage_step(step_begin + kSub * i, i);
  }
  // the scales of the next kDepth steps, in a ring indexed at compile time (the step loop
  // is unrolled kDepth times, so no register move waits on a load early, and covers whole
  // stages: at BN = 128 the prepared layout's stages of two steps, its scales in the stages)
  constexpr int kDepth = wg_depth<BN>() > kSub ? wg_depth<BN>() : kSub;
  static_assert(kDepth % kSub == 0, "the step loop's unroll must cover whole stages");
  Chunk ring[kDepth][2];
#pragma unroll
  for (int i = 0; i < kDepth; ++i)
    if (!boxes && step_begin + i < step_end) load_step(ring[i], step_begin + i);

  // the stage of `step` and the parity of its fill, carried (no division per step)
  uint32_t js = 0, par = 0;
  const uint64_t desc0 = sw128_desc(smem_addr);
  const uint8_t* wc0 = smem + kCodes + wrow * 64 + 16 * t;
  // the lane's scale rows in a stage's box, and its first block counted from the step's
  // first block (blocks longer than a step: 0)
  // (srow / zrow: bytes per row of the scales / zero points)
  const uint8_t* sb0 = smem + kSide + wrow * srow;
  const uint8_t* zb0 = smem + kSide + (tiled ? kSub * tile_sbytes : kWgRows * kBoxCols) + wrow * zrow;
  const int lane_block = (32 * t) >> p.bs_shift;
  for (int s0 = step_begin; s0 < step_end; s0 += kDepth)
#pragma unroll
  for (int u = 0; u < kDepth; ++u) {
    const int step = s0 + u;
    if (step >= step_end) break;
    Chunk cur[2] = {ring[u][0], ring[u][1]};
    if (!boxes && step + kDepth < step_end) load_step(ring[u], step + kDepth);
    // descriptor of the stage; a k16 slice adds its byte offset / 16 to the address field
    // (addresses stay below 2^18, so the 14-bit field never carries)
    const int hs = u % kSub;  // the step's place in its stage
    const uint64_t desc = desc0 + js * (kStage >> 4) + ((hs * kX) >> 4);
    if (hs == 0) mbar_wait(full_addr + 8 * js, par);
    if constexpr (kSideScales) {
      if (boxes) {  // the step's first block, counted from its stage's box (copy_step), or
                    // the step's scales in the prepared layout
        const int b0 = (step * kWgStepK) >> p.bs_shift, b0s = ((step - hs) * kWgStepK) >> p.bs_shift;
        const int size = scale_bytes<FMT>(p);
        const uint8_t* sb = sb0 + js * kStage + (tiled ? hs * tile_sbytes : b0 * size - ((b0s * size) & ~15));
        const uint8_t* zb = zb0 + js * kStage + (tiled ? hs * tile_zbytes : b0 - (b0s & ~15));
#pragma unroll
        for (int h = 0; h < 2; ++h)
          chunk_scales<FMT, BITS>(
              cur[h],
              [&](auto n, int off) { return lds_bytes<decltype(n)::value>(sb + h * 8 * srow + off); },
              [&](auto n, int off) { return lds_bytes<decltype(n)::value>(zb + h * 8 * zrow + off); },
              lane_block, p.bs == 16, p);
      }
    }
    Dec d[2][2];
    const bool fixup = mx_scale_fixup<FMT, BITS>(cur);
#pragma unroll
    for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(cur[h], p, d[h]);
    // the lane's code chunks: rows wrow and wrow + 8, k [32 t, 32 t + 32) (a warp reads 512
    // contiguous bytes: no bank conflicts)
    const uint8_t* wc = wc0 + js * kStage + hs * kWgCodeBytes;
#pragma unroll
    for (int h = 0; h < 2; ++h) cur[h].q = *reinterpret_cast<const uint4*>(wc + h * 8 * 64);
    // groups of kWords code words: decode them (A of 2 kWords wgmmas), issue the
    // wgmmas as one group, then wait for the group before. One group in flight, not
    // more: the next step rewrites this step's A registers (the same PTX registers in
    // every iteration), which is safe only once their wgmmas are done (PTX ISA:
    // wgmma.mma_async inputs may not change before the wgmma.wait_group that covers it;
    // two in flight failed the GPU tests).
    // kAhead: the table values of a group's words (tv), loaded before the wgmmas of the
    // group before
    float tv[kAhead ? kWords : 1][2][8];
    auto group_loads = [&](int w0) {
#pragma unroll
      for (int w = 0; w < kWords; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h) table_load<wg_copies<FMT, BN>()>(word_of(cur[h].q, w0 + w), table, copy, tv[w][h]);
    };
    if constexpr (kAhead) group_loads(0);
#pragma unroll
    for (int w0 = 0; w0 < 4; w0 += kWords) {
      uint32_t a[2 * kWords][4];
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        const int s2 = w0 + w;
        uint32_t r[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kAhead)
            table_finish<FMT, BF16>(tv[w][h], d[h][s2 >> 1], r[h]);
          else
            decode_word<FMT, BF16, BITS, wg_copies<FMT, BN>(), false>(word_of(cur[h].q, s2), d[h][s2 >> 1],
                                                                     table, copy, r[h]);
        }
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          a[2 * w + hh][0] = r[0][2 * hh];
          a[2 * w + hh][1] = r[1][2 * hh];
          a[2 * w + hh][2] = r[0][2 * hh + 1];
          a[2 * w + hh][3] = r[1][2 * hh + 1];
        }
      }
      // MXFP4's second scale factor, where a lane's scale is > 2: one branch around its
      // multiplies, the decode itself the same in every case (as fast as a branch between
      // two decodes, and one decode to maintain)
      if (fixup) {
#pragma unroll
        for (int i = 0; i < 2 * kWords; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) a[i][j] = mx_fix<BF16>(a[i][j], d[j & 1][0]);  // row j & 1
      }
      if constexpr (kAhead) if (w0 + kWords < 4) group_loads(w0 + kWords);
      fence_regs<2 * kWords>(a);
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < 2 * kWords; ++i) {
        const int ks = 2 * w0 + i;  // k16 slice of the step: atom ks / 4, 32 B each
        wgmma_rs<BN, BF16>(acc, a[i], desc + (((ks >> 2) * BN * 128 + (ks & 3) * 32) >> 4));
      }
      wgmma_commit();
      wgmma_wait<1>();
      if (w0 == 0 && hs == 0 && step > step_begin) {
        // this warp is done with the stage before (steps step - kSub .. step - 1; only the
        // group just issued is in flight): release it; thread 0 (or the producer
        // warpgroup) refills it once every warp has
        const uint32_t jp = js ? js - 1 : kStages - 1, pp = js ? par : par ^ 1u;
        if (lane == 0)
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n"::"r"(empty_addr + 8 * jp) : "memory");
        if (!kProducer && tid == 0 && step + kSub * (kStages - 1) < step_end) {
          mbar_wait(empty_addr + 8 * jp, pp);
          stage_step(step + kSub * (kStages - 1), jp);
        }
      }
    }
    if (hs == kSub - 1 && ++js == kStages) {
      js = 0;
      par ^= 1u;
    }
  }
  wgmma_wait<0>();
  fence_regs<BN / 2>(acc);
  consumer_sync();  // the pipeline's shared memory becomes the epilogue's

  // accumulator (wgmma D fragment): acc[4 j + 2 h + e] = (weight row g + 8 h of the
  // warp's 16, activation row 8 j + 2 t + e)
  float* tile = reinterpret_cast<float*>(smem);
  const float scale = kAccScale<FMT, BF16, BITS>;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        tile[(8 * j + 2 * t + e) * kOutStride + wrow + 8 * h] = acc[4 * j + 2 * h + e] * scale * tsv[0][h];
  consumer_sync();
  const int64_t z_off = static_cast<int64_t>(blockIdx.z) * p.M * p.N;
  if (p.N % 4 == 0 && (reinterpret_cast<uintptr_t>(out) & 15u) == 0) {
    // four outputs per lane and store: a warp reads 512 contiguous bytes of a tile row
    // (LDS.128, no conflicts) and writes 2 x 128 (f32) or 2 x 64 bytes (x's dtype) of
    // an output row; with N % 4 == 0 four outputs lie wholly inside or outside N and
    // each store is aligned (at BN = 256: 32 stores per thread instead of 128)
    for (int idx = tid; idx < BN * kWgRows / 4; idx += kWgThreads) {
      const int m = idx / (kWgRows / 4), n = 4 * (idx % (kWgRows / 4));
      if (m0 + m >= p.M || n_cta + n >= p.N) continue;
      const float4 v = *reinterpret_cast<const float4*>(tile + m * kOutStride + n);
      store_out4<BF16>(out, z_off + (m0 + m) * p.N + n_cta + n, v, p);
    }
  } else {
    for (int idx = tid; idx < BN * kWgRows; idx += kWgThreads) {
      const int m = idx / kWgRows, n = idx % kWgRows;
      if (m0 + m >= p.M || n_cta + n >= p.N) continue;
      store_out<BF16>(out, z_off + (m0 + m) * p.N + n_cta + n, tile[m * kOutStride + n], p);
    }
  }
#else
  __trap();  // built without sm_90a: the handler never launches this (prepare_wgmma)
#endif
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_WGMMA_KERNEL_CUH_
