// W4A16 kernels (launch.h): the two mma.sync kernels (any sm_80+ GPU): the direct kernel
// (M <= 16, activations from global memory, no barriers) and the staged kernel (M > 16,
// activations staged in shared memory). Launched by launch.cu (tile_m = 0).
#ifndef JAX_FP4_CSRC_CUDA_WMATMUL_MMA_SYNC_CUH_
#define JAX_FP4_CSRC_CUDA_WMATMUL_MMA_SYNC_CUH_

#include "decode.cuh"

namespace jf4 {
namespace cuda {
namespace {

__device__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// Staged kernel (M > 16). MT: 8-row activation tiles per CTA (M chunk = 8 * MT).
// Lane (g, t) owns k [32t, 32t + 32) of weight rows g, g + 8 of each of its tiles per
// 128-k super-step; activations are staged per super-step in shared memory in the lane's
// fragment order (bit path: pair-permuted on the way), zero past M and K.
template <int FMT, bool BF16, int BITS, int MT>
__global__ void __launch_bounds__(kWarps * 32) wmatmul_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, void* __restrict__ out, const WParams p) {
  constexpr int MC = 8 * MT;
  // the lane table at its 2 KB alignment inside twice its size (alignment computed, not
  // left to __align__ on the static array)
  __shared__ __align__(16) float2 table_raw[BITS ? 1 : 2 * table_bytes<kLaneTable>() / 8];
  float2* table = align_shared(table_raw, kLaneTableAlign);
  __shared__ __align__(16) uint8_t xs[MC * kXStride];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = lane_table_base(table, lane);
  if constexpr (!BITS) fill_table<FMT, kLaneTable>(table, tid, kWarps * 32);

  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * MC;
  const int64_t n_warp = static_cast<int64_t>(blockIdx.x) * kRowsPerCta + warp * kRowTiles * 16;
  // rows [rt][h]: g (+8 for h = 1) of tile rt; rows past N are neither loaded nor stored
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp + g, p);
  float tsv[kRowTiles][2];
  load_tensor_scales(ts, n_warp + g, p, tsv);

  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  float acc[kRowTiles][MT][4];
  zero<kRowTiles * MT * 4>(&acc[0][0][0]);

  Chunk next[kRowTiles][2];
  if (step_begin < step_end) {
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        load_chunk<FMT, BITS>(next[rt][h], rows, 2 * rt + h, step_begin * kStepK + 32 * t,
                        step_begin * kStepK + 32 * t < p.K, p);
  }

  for (int step = step_begin; step < step_end; ++step) {
    Chunk cur[kRowTiles][2];
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) cur[rt][h] = next[rt][h];

    const int k0 = step * kStepK;
    __syncthreads();  // every warp is done reading the previous super-step's activations
    for (int i = tid; i < MC * 16; i += kWarps * 32) {
      const int m = i >> 4, piece = i & 15;  // piece = 8 elements = physical (t, s2)
      const int64_t gm = m0 + m, k = k0 + 8 * piece;
      const bool valid = gm < p.M && k < p.K;
      uint8_t* dst = xs + m * kXStride + (piece & 3) * 64 + (piece >> 2) * 16;
      if constexpr (BITS) {
        const uint4 v = valid ? __ldg(reinterpret_cast<const uint4*>(x + gm * p.K + k))
                              : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(dst) = x_pairs<true>(v);
      } else {
        cp_async16(dst, valid ? static_cast<const void*>(x + gm * p.K + k) : x, valid);
      }
    }
    if constexpr (!BITS) asm volatile("cp.async.commit_group;\n" ::);
    if (step + 1 < step_end) {
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          load_chunk<FMT, BITS>(next[rt][h], rows, 2 * rt + h, (step + 1) * kStepK + 32 * t,
                          (step + 1) * kStepK + 32 * t < p.K, p);
    }
    if constexpr (!BITS) asm volatile("cp.async.wait_all;\n" ::);
    __syncthreads();

    Dec d[kRowTiles][2][2];  // [tile][row half][16-element half of the chunk]
#pragma unroll
    for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(cur[rt][h], p, d[rt][h]);

#pragma unroll
    for (int s2 = 0; s2 < 4; ++s2) {  // physical elements [8 s2, 8 s2 + 8) of the chunk
      uint4 xb[MT];
#pragma unroll
      for (int j = 0; j < MT; ++j)
        xb[j] = *reinterpret_cast<const uint4*>(xs + (8 * j + g) * kXStride + s2 * 64 + t * 16);
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt) {
        const uint32_t w[2] = {word_of(cur[rt][0].q, s2), word_of(cur[rt][1].q, s2)};
        const Dec dd[2] = {d[rt][0][s2 >> 1], d[rt][1][s2 >> 1]};
        tile_step<FMT, BF16, BITS, MT, kLaneTable>(acc[rt], w, dd, xb, table, copy);
      }
    }
  }

#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile<BF16, MT>(out, acc[rt], kAccScale<FMT, BF16, BITS>, tsv[rt], n_warp + rt * 16, m0, g, t, p);
}

// Decode kernel (M <= 16): each warp owns kRowTiles 16-row weight tiles (lane (g, t):
// rows g, g + 8 of each) and runs over K in super-steps of kDirectStepK; in a step lane t
// owns the kDirectL contiguous 32-k chunks [kDirectL * 32 t, +kDirectL * 32) of each of
// its rows, so each row is read in runs of kDirectStepK / 2 bytes. The chunk registers
// roll: as soon as chunk j of a step is decoded, its register slot loads chunk j of the
// next step, so up to kDirectL - 1 chunks per row stay in flight while the warp decodes. The
// activations come straight from global memory (L1-resident), no shared memory for x and
// no barriers; the kRowTiles tiles share each activation fragment.

template <int FMT, bool BF16, int BITS, int MT>
__global__ void __launch_bounds__(kWarps * 32, 4) wmatmul_direct_kernel(
    const uint16_t* __restrict__ x, const uint8_t* __restrict__ codes,
    const void* __restrict__ scales, const uint8_t* __restrict__ zeros,
    const float* __restrict__ ts, void* __restrict__ out, const WParams p) {
  __shared__ __align__(16) float2 table[BITS ? 1 : 256 * kCopies];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const uint32_t copy = 8 * (lane & (kCopies - 1));
  if constexpr (!BITS) {
    fill_table<FMT, kCopies>(table, tid, kWarps * 32);
    __syncthreads();
  }

  const int64_t n_warp = static_cast<int64_t>(blockIdx.x) * kDirectRowsPerCta +
                         warp * kRowTiles * 16;
  const Rows rows = make_rows<FMT>(codes, scales, zeros, n_warp + g, p);
  float tsv[kRowTiles][2];
  load_tensor_scales(ts, n_warp + g, p, tsv);
  // activation rows of the lane's B fragments (clamped: columns past M are not stored)
  const uint16_t* xrow[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int64_t m = 8 * mt + g;
    xrow[mt] = x + (m < p.M ? m : p.M - 1) * p.K;
  }
  int step_begin, step_end;
  split_steps(p, &step_begin, &step_end);

  float acc[kRowTiles][MT][4];
  zero<kRowTiles * MT * 4>(&acc[0][0][0]);

  const int lane_k = 32 * kDirectL * t;  // the lane's first k in a step
  const bool rows_inside = n_warp + kRowTiles * 16 <= p.N;
  Chunk c[kRowTiles][2][kDirectL];
  if (step_begin < step_end) {
#pragma unroll
    for (int j = 0; j < kDirectL; ++j)
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          load_chunk<FMT, BITS>(c[rt][h][j], rows, 2 * rt + h, step_begin * kDirectStepK + lane_k + 32 * j,
                          step_begin * kDirectStepK + lane_k + 32 * j < p.K32, p);
  }

  for (int step = step_begin; step < step_end; ++step) {
#pragma unroll
    for (int j = 0; j < kDirectL; ++j) {
      const int kj = step * kDirectStepK + lane_k + 32 * j;
      const bool kvalid = kj < p.K32;  // lanes past K feed zero activations
      uint4 xb[4][MT];
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          xb[s2][mt] = x_pairs<BITS>(kvalid ? __ldg(reinterpret_cast<const uint4*>(xrow[mt] + kj + 8 * s2))
                                            : make_uint4(0, 0, 0, 0));
      Dec d[kRowTiles][2][2];
#pragma unroll
      for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) make_decs<FMT, BF16, BITS>(c[rt][h][j], p, d[rt][h]);
#pragma unroll
      for (int s2 = 0; s2 < 4; ++s2)
#pragma unroll
        for (int rt = 0; rt < kRowTiles; ++rt) {
          const uint32_t w[2] = {word_of(c[rt][0][j].q, s2), word_of(c[rt][1][j].q, s2)};
          const Dec dd[2] = {d[rt][0][s2 >> 1], d[rt][1][s2 >> 1]};
          tile_step<FMT, BF16, BITS, MT, kCopies>(acc[rt], w, dd, xb[s2], table, copy);
        }
      if (step + 1 < step_end) {  // the slot, now decoded, loads the next step's chunk j
        const int kn = kj + kDirectStepK;
        if (rows_inside && (step + 2) * kDirectStepK <= p.K32) {  // warp-uniform: no checks
#pragma unroll
          for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              load_chunk<FMT, BITS, false>(c[rt][h][j], rows, 2 * rt + h, kn, true, p);
        } else {
#pragma unroll
          for (int rt = 0; rt < kRowTiles; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              load_chunk<FMT, BITS>(c[rt][h][j], rows, 2 * rt + h, kn, kn < p.K32, p);
        }
      }
    }
  }

#pragma unroll
  for (int rt = 0; rt < kRowTiles; ++rt)
    store_tile<BF16, MT>(out, acc[rt], kAccScale<FMT, BF16, BITS>, tsv[rt], n_warp + rt * 16, 0, g, t, p);
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_WMATMUL_MMA_SYNC_CUH_
