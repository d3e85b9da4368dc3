// Quantize / dequantize / fake-quantize kernels (quant.cu), device side, part 2: chunk
// indexing (RowCursor), the block-statistics reductions over a block's threads, one
// chunk's quantization (quantize_chunk: block scale as csrc/codecs.h, then the elements
// round to nearest or, SR, stochastically: stochastic.cuh) and the kernels. Invariant:
// every thread of a CTA runs the same number of grid-stride steps (the group reductions
// may hold barriers).
#ifndef JAX_FP4_CSRC_CUDA_QUANT_KERNELS_CUH_
#define JAX_FP4_CSRC_CUDA_QUANT_KERNELS_CUH_

#include "elements.cuh"
#include "stochastic.cuh"

namespace jf4 {
namespace cuda {
namespace {

// ------------------------------------------------------------------ indexing
struct Params {
  int64_t n_chunks;  // R * K / 8
  int64_t cpr;       // chunks per row (K / 16)
  double inv_cpr;    // 1 / cpr, for row = chunk / cpr without a 64-bit divide
  int64_t srow, scol;  // the grid stride in chunks as (rows, chunks) = divmod(stride, cpr)
  int64_t nb;        // blocks per row
  int G;             // threads per block (block_size / 8), a power of two
  int log2G;
  bool two_level;
  bool rceil;
  bool swizzled;     // quantize: scales in the 128x4 layout
  bool rows;         // chunks' rows and columns needed (two-level row scales, swizzled)
  int st;            // INT4 scale storage type
  int sbytes;        // bytes per stored scale
};

// chunk / cpr for chunk < 2^50: double estimate, corrected by one step either way.
__device__ __forceinline__ int64_t row_of(int64_t chunk, const Params& p) {
  int64_t q = static_cast<int64_t>(static_cast<double>(chunk) * p.inv_cpr);
  const int64_t r = chunk - q * p.cpr;
  q += r < 0 ? -1 : (r >= p.cpr ? 1 : 0);
  return q;
}

// Row and chunk-in-row of a thread's chunk, moved along the grid stride with adds only
// (one division when the kernel starts); (0, 0) throughout where p.rows is false.
struct RowCursor {
  int64_t row = 0, col = 0;
  __device__ RowCursor(int64_t chunk, const Params& p) {
    if (!p.rows) return;
    row = row_of(chunk, p);
    col = chunk - row * p.cpr;
  }
  __device__ void advance(const Params& p) {
    if (!p.rows) return;
    row += p.srow;
    col += p.scol;
    if (col >= p.cpr) {
      col -= p.cpr;
      ++row;
    }
  }
};

// Index of the scale of the block holding chunk `chunk` (at `at`) in the scales buffer
// (linear or 128x4 swizzled).
__device__ __forceinline__ int64_t scale_slot(int64_t chunk, const RowCursor& at,
                                              const Params& p) {
  return p.swizzled ? scale_offset(at.row, at.col >> p.log2G, p.nb, true) : chunk >> p.log2G;
}

// Bytes per stored scale: E4M3 / E8M0 bytes, f32 absmax, INT4 in its storage type.
template <int FMT>
__device__ __forceinline__ int scale_bytes_of(const Params& p) {
  return FMT == kINT4 ? p.sbytes : (is_codebook(FMT) ? 4 : 1);
}

__device__ void store_scale(void* scales, int64_t idx, int sbytes, uint32_t bits) {
  if (sbytes == 1) static_cast<uint8_t*>(scales)[idx] = static_cast<uint8_t>(bits);
  else if (sbytes == 2) static_cast<uint16_t*>(scales)[idx] = static_cast<uint16_t>(bits);
  else static_cast<uint32_t*>(scales)[idx] = bits;
}
__device__ uint32_t load_scale(const void* scales, int64_t idx, int sbytes) {
  if (sbytes == 1) return __ldg(static_cast<const uint8_t*>(scales) + idx);
  if (sbytes == 2) return __ldg(static_cast<const uint16_t*>(scales) + idx);
  return __ldg(static_cast<const uint32_t*>(scales) + idx);
}

// ------------------------------------------------------------------ group reductions
// Reduce over the G = 2^log2G threads of a quantization block (aligned groups): a
// butterfly over the xor offsets below G, entered at the first one (the same in every
// thread) and straight from there.
template <typename Op>
__device__ uint32_t group_reduce(uint32_t v, const Params& p, Op op, uint32_t* smem) {
  const int G = p.G;
  auto step = [&](int o) { v = op(v, __shfl_xor_sync(0xffffffffu, v, o)); };
  switch (p.log2G < 5 ? p.log2G : 5) {
    case 5: step(16); [[fallthrough]];
    case 4: step(8); [[fallthrough]];
    case 3: step(4); [[fallthrough]];
    case 2: step(2); [[fallthrough]];
    case 1: step(1); [[fallthrough]];
    default: break;
  }
  if (G <= 32) return v;
  // G in {64, ..., 512}: combine the G/32 warps of the group through shared memory.
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) smem[warp] = v;
  __syncthreads();
  const int first = warp & ~(G / 32 - 1);
  uint32_t r = smem[first];
  for (int w = 1; w < G / 32; ++w) r = op(r, smem[first + w]);
  return r;
}

struct MaxU {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};
template <typename L>
struct KeyMin {  // INT4's order-key words (elements.cuh int4_keys)
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return L::key_min(a, b); }
};

// ------------------------------------------------------------------ block statistics
// One chunk's share of its block's statistics, before the group reduction: the absmax
// bits or, for INT4, the order-key words of its min and max (elements.cuh int4_keys).
struct ChunkStats {
  uint32_t amax;
  uint32_t key[2];
};
template <int FMT, typename L>
__device__ __forceinline__ ChunkStats chunk_stats(const typename L::Raw& raw) {
  ChunkStats st{0u, {0u, 0u}};
  if constexpr (FMT == kINT4) L::int4_keys(raw, st.key);
  else st.amax = L::amax_bits(raw);
  return st;
}

// == int4_params(mn, mx, st) for finite mn <= mx, with r = RN(1 / s). The divisions as
// div_markstein steps where they are exact: d / 15 (d >= 1e-5 and below 2^127: a normal
// quotient), and mn / s where |mn| r < kInt4FastLimit (nothing overflows; a quotient
// below the normal range rounds to 0 either way). benchmarks/check_codecs.cu compares
// every d and every pair of 16-bit min and max.
__device__ __forceinline__ Int4Params int4_params_fast(float mn, float mx, int st, float* r) {
  const float d = mx - mn;
  Int4Params q;
  if (!(d < 0x1p127f)) {
    q = int4_params(mn, mx, st);
    *r = 1.0f / q.s;
    return q;
  }
  q.scale_bits = scale_to_bits(div_markstein(maxf(d, 1e-5f), 15.0f, 1.0f / 15.0f), st);
  if (st == kScaleF16 && q.scale_bits == 0x7c00u) q.scale_bits = kF16MaxBits;
  q.s = scale_from_bits(q.scale_bits, st);
  *r = 1.0f / q.s;
  const float m = fabsf(mn) * *r < kInt4FastLimit ? div_markstein(mn, q.s, *r) : mn / q.s;
  q.z = clampf(-rint_small(clampf(m, -64.0f, 64.0f)), 0.0f, 15.0f);
  return q;
}

// == nvfp4_scale_code<TWO_LEVEL>(amax, ts), returning nvfp4_elem_mult<TWO_LEVEL> of it in
// *mult, with its three IEEE divisions as div_markstein steps where those are exact:
// - amax / 6 with RN(1/6). A quotient below the normal range is off by at most a few units
//   of 2^-149, and t is clamped up to 2^-6 either way (two levels: t / ts <= 2^-126 / 2^-120).
// - t / ts with RN(1/ts) for ts <= 2^100 (1/ts and (1/ts) / s normal); a product t / ts
//   that is not finite (or above 2^100) is clamped to 448 either way. Rows with a larger
//   ts take the IEEE divisions.
// - 1 / s and (1/ts) / s with s and RN(1/s) from the per-CTA table of positive E4M3 codes.
template <bool TWO_LEVEL>
__device__ __forceinline__ uint32_t nvfp4_scale_fast(uint32_t amax, float ts, const Tables& t,
                                                     float* mult) {
  if (TWO_LEVEL && !(ts <= 0x1p100f)) {
    const uint32_t sc = nvfp4_scale_code<true>(u2f(amax), ts);
    *mult = nvfp4_elem_mult<true>(sc, ts);
    return sc;
  }
  constexpr float kRcp6 = 0x1.555556p-3f;  // RN(1/6)
  float q = div_markstein(u2f(amax), 6.0f, kRcp6);
  float rts = 0.0f;
  if (TWO_LEVEL) {
    rts = 1.0f / ts;
    const float q0 = q * rts;
    q = q0 <= 0x1p100f ? div_markstein(q, ts, rts) : q0;
  }
  const uint32_t sc = e4m3_encode(clampf(q, 0x1p-6f, 448.0f));
  const float2 e = t.e4m3[sc];  // (s, RN(1 / s))
  *mult = TWO_LEVEL ? div_markstein(rts, e.x, e.y) : e.y;
  return sc;
}

// ------------------------------------------------------------------ quantize one chunk
// Packed codes (pack16's layout), scale bits and INT4 zero point of one chunk; every
// thread of the block's group gets the same scale. st: this chunk's statistics
// (chunk_stats, before the group reduction); tsr: the row's tensor scale (NVFP4
// two-level). SR: the elements round stochastically with the chunk's 16 random words `rnd`
// (stochastic.cuh), else to nearest; the block scale is the same either way.
template <int FMT, typename L, bool SR = false>
__device__ uint4 quantize_chunk(const float* v, ChunkStats st, float tsr, const Params& p,
                                Tables& t, const float2* cells, uint32_t* scale_bits,
                                uint32_t* zero, const uint32_t* rnd = nullptr) {
  *zero = 0;
  uint32_t amax = st.amax;
  uint32_t codes[kChunk];
  if constexpr (FMT == kINT4) {
#pragma unroll
    for (int w = 0; w < L::kKeyWords; ++w)
      st.key[w] = group_reduce(st.key[w], p, KeyMin<L>(), t.red);
    float mn, mx, r;
    if (!L::int4_range(st.key, &mn, &mx)) {
      *scale_bits = scale_nan_bits(p.st);
      return make_uint4(0u, 0u, 0u, 0u);
    }
    const Int4Params q = int4_params_fast(mn, mx, p.st, &r);
    *scale_bits = q.scale_bits;
    *zero = static_cast<uint32_t>(static_cast<int32_t>(q.z));
    if (!SR && fmaxf(-mn, mx) * r < kInt4FastLimit) {
      const float zc = q.z - kRne;
      auto code = [&](const float* e) {
        return [=](int i) { return int4_code_biased(e[i], q.s, r, zc); };
      };
      return make_uint4(pack8_biased(code(v)), pack8_biased(code(v + 8)), 0u, 0u);
    }
#pragma unroll
    for (int i = 0; i < kChunk; ++i)
      codes[i] = SR ? int4_encode_sr(v[i], q.s, q.z, rnd[i]) : int4_encode(v[i], q.s, q.z);
    return pack16<kBits<FMT>>(codes);
  } else {
    amax = group_reduce(amax, p, MaxU(), t.red);
    bool bad = bits_nonfinite(amax);
    if (FMT == kNVFP4 && p.two_level) bad = bad || nvfp4_bad_tensor_scale(tsr);
    if (bad) {
      *scale_bits = FMT == kNVFP4 ? kE4M3NaN : (is_mx(FMT) ? kE8M0NaN : kQuietNaNBits);
      return make_uint4(0u, 0u, 0u, 0u);
    }
    float mult;
    if constexpr (FMT == kNVFP4) {
      *scale_bits = p.two_level ? nvfp4_scale_fast<true>(amax, tsr, t, &mult)
                                : nvfp4_scale_fast<false>(amax, tsr, t, &mult);
    } else if constexpr (is_mx(FMT)) {
      const uint32_t sc = mx_scale_code<FMT>(amax, p.rceil);
      mult = e8m0_inverse(sc);
      *scale_bits = sc;
    } else {
      mult = codebook_mult(amax);
      *scale_bits = amax;
    }
    if constexpr (SR) {
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        if constexpr (FMT == kNVFP4) codes[i] = nvfp4_encode_sr(v[i], mult, rnd[i]);
        else if constexpr (is_mx(FMT)) codes[i] = mx_encode_sr<FMT>(v[i], *scale_bits, rnd[i]);
        else codes[i] = codebook_encode_sr<FMT>(v[i], mult, rnd[i]);
      }
      return pack16<kBits<FMT>>(codes);
    } else {
      return encode16<FMT>(v, mult, cells);
    }
  }
}

// The row tensor scale of a live chunk (NVFP4 two-level; 0 otherwise).
template <int FMT>
__device__ __forceinline__ float chunk_ts(const float* ts, int64_t row, bool live,
                                          const Params& p) {
  return (FMT == kNVFP4 && p.two_level && live) ? __ldg(ts + row) : 0.0f;
}

// ------------------------------------------------------------------ kernels
// Grid-stride loop over chunks, software-pipelined: load(chunk, at) -> Raw of the
// thread's next chunk is issued before body(chunk, at, raw) runs for this one, so 2 x 32
// bytes of bf16 input per thread are in flight (`at`: the chunk's row and column).
// STEPS = 2 runs two steps per iteration, so that the two buffers trade roles without
// register copies; dequantize, whose time is its stores, keeps one step (two slowed its
// write stream).
// load() must return a harmless value past the end; every thread of a CTA runs the same
// number of steps (the exit tests are uniform over the CTA), so a body may hold barriers.
template <typename Raw, int STEPS = 2, typename Load, typename Body>
__device__ __forceinline__ void for_each_chunk(const Params& p, Load load, Body body) {
  static_assert(STEPS == 1 || STEPS == 2, "one or two steps per iteration");
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t chunk = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  RowCursor at(chunk, p);
  Raw a = load(chunk, at);
  for (; chunk - threadIdx.x < p.n_chunks; chunk += STEPS * stride) {
    RowCursor at1 = at;
    at1.advance(p);
    const Raw b = load(chunk + stride, at1);
    body(chunk, at, a);
    at = at1;
    if constexpr (STEPS == 1) {
      a = b;
    } else {
      if (chunk + stride - threadIdx.x >= p.n_chunks) break;
      at.advance(p);
      a = load(chunk + 2 * stride, at);
      body(chunk + stride, at1, b);
    }
  }
}

// x chunk, or zeros past the end.
template <typename L>
__device__ __forceinline__ typename L::Raw load_x(const typename L::storage* x, int64_t chunk,
                                                  int64_t n_chunks) {
  return chunk < n_chunks ? L::load(x + chunk * kChunk) : typename L::Raw{};
}

// SR: stochastic rounding with rand (R, K) uint32, one word per element in x's order
// (jax_fp4_quantize_sr_v1); else rand is unused (nullptr).
template <int FMT, typename L, bool SR = false>
__global__ void __launch_bounds__(kThreads, 2) quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    const uint32_t* __restrict__ rand, uint8_t* __restrict__ codes, void* __restrict__ scales,
    uint8_t* __restrict__ zeros, Params p) {
  constexpr bool kCells = is_codebook(FMT) && !SR;
  __shared__ Tables t;
  __shared__ float2 cells[kCells ? kCodebookCells : 1];
  build_encode_tables<FMT>(t);
  if constexpr (kCells) build_codebook_cells<FMT>(cells);
  __syncthreads();
  for_each_chunk<typename L::Raw>(
      p, [&](int64_t c, const RowCursor&) { return load_x<L>(x, c, p.n_chunks); },
      [&](int64_t chunk, const RowCursor& at, const typename L::Raw& raw) {
        const bool live = chunk < p.n_chunks;  // n_chunks is a multiple of G: whole groups
        float v[kChunk];
        L::to_f32(raw, v);
        uint32_t sb, z;
        uint32_t r[SR ? kChunk : 1] = {};
        if constexpr (SR) {
          if (live) {  // 64 bytes per chunk: 16-byte aligned in XLA's buffers
            const uint4* rp = reinterpret_cast<const uint4*>(rand + chunk * kChunk);
#pragma unroll
            for (int i = 0; i < kChunk / 4; ++i) {
              const uint4 w = __ldcs(rp + i);  // read once
              r[4 * i] = w.x;
              r[4 * i + 1] = w.y;
              r[4 * i + 2] = w.z;
              r[4 * i + 3] = w.w;
            }
          }
        }
        const uint4 pk = quantize_chunk<FMT, L, SR>(v, chunk_stats<FMT, L>(raw),
                                                 chunk_ts<FMT>(ts, at.row, live, p), p, t,
                                                 cells, &sb, &z, r);
        if (!live) return;
        store_packed<kBits<FMT>>(codes + chunk * kChunkBytes<FMT>, pk);
        if ((chunk & (p.G - 1)) == 0) {
          const int64_t blk = chunk >> p.log2G;
          store_scale(scales, scale_slot(chunk, at, p), scale_bytes_of<FMT>(p), sb);
          if (FMT == kINT4) zeros[blk] = static_cast<uint8_t>(z);
        }
      });
}

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads, 2) fake_quantize_kernel(
    const typename L::storage* __restrict__ x, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p) {
  __shared__ Tables t;
  __shared__ float2 cells[is_codebook(FMT) ? kCodebookCells : 1];
  build_encode_tables<FMT>(t);
  build_codebook_cells<FMT>(cells);
  build_decode_table<FMT>(t);
  __syncthreads();
  for_each_chunk<typename L::Raw>(
      p, [&](int64_t c, const RowCursor&) { return load_x<L>(x, c, p.n_chunks); },
      [&](int64_t chunk, const RowCursor& at, const typename L::Raw& raw) {
        const bool live = chunk < p.n_chunks;
        float v[kChunk];
        L::to_f32(raw, v);
        const float tsr = chunk_ts<FMT>(ts, at.row, live, p);
        uint32_t sb, z;
        const uint4 pk =
            quantize_chunk<FMT, L>(v, chunk_stats<FMT, L>(raw), tsr, p, t, cells, &sb, &z);
        if (!live) return;
        // every thread of the group holds the block's scale: decode locally
        decode16<FMT>(pk, block_factor<FMT>(sb, p.two_level, tsr, p.st),
                     static_cast<float>(z), t, v);
        L::store(y + chunk * kChunk, v);
      });
}

// What dequantize reads for one chunk: packed codes, scale bits, zero point, row scale.
struct Coded {
  uint4 pk;
  uint32_t sb, z;
  float tsr;
};

// Dequantize handles two chunks per thread and step, one in each half of the tensor:
// twice the loads in flight per thread (the kernel runs at one CTA per SM, where
// write-heavy streams reach the most DRAM bandwidth, benchmarks/log/NOTES.md).
struct Coded2 {
  Coded c[2];
};

template <int FMT, typename L>
__global__ void __launch_bounds__(kThreads, 1) dequantize_kernel(
    const uint8_t* __restrict__ codes, const void* __restrict__ scales,
    const uint8_t* __restrict__ zeros, const float* __restrict__ ts,
    typename L::storage* __restrict__ y, Params p) {
  __shared__ Tables t;
  build_decode_table<FMT>(t);
  __syncthreads();
  const int64_t half = (p.n_chunks + 1) / 2;
  auto load_one = [&](int64_t chunk, int64_t row) {
    Coded c{make_uint4(0, 0, 0, 0), 0, 0, 0.0f};
    if (chunk < p.n_chunks) {
      c.pk = load_packed<kBits<FMT>>(codes + chunk * kChunkBytes<FMT>);
      const int64_t blk = chunk >> p.log2G;
      c.sb = load_scale(scales, blk, scale_bytes_of<FMT>(p));
      if (FMT == kINT4) c.z = __ldg(zeros + blk);
      c.tsr = chunk_ts<FMT>(ts, row, true, p);
    }
    return c;
  };
  auto decode_one = [&](int64_t chunk, const Coded& c) {
    if (chunk >= p.n_chunks) return;
    float v[kChunk];
    decode16<FMT>(c.pk, block_factor<FMT>(c.sb, p.two_level, c.tsr, p.st),
                  static_cast<float>(c.z), t, v);
    L::store(y + chunk * kChunk, v);
  };
  Params first_half = p;
  first_half.n_chunks = half;
  const bool rows = FMT == kNVFP4 && p.two_level;
  for_each_chunk<Coded2, 1>(
      first_half,
      [&](int64_t chunk, const RowCursor& at) {
        const int64_t c2 = chunk + half;
        return Coded2{{load_one(chunk < half ? chunk : p.n_chunks, at.row),
                       load_one(chunk < half ? c2 : p.n_chunks, rows ? row_of(c2, p) : 0)}};
      },
      [&](int64_t chunk, const RowCursor&, const Coded2& c) {
        if (chunk >= half) return;
        decode_one(chunk, c.c[0]);
        decode_one(chunk + half, c.c[1]);
      });
}

// max |x| over the tensor as float32 bits (codecs.h block_absmax_bits over everything),
// atomically max-ed into *out (zeroed before the launch): the per-tensor amax of NVFP4
// tensor_scale="auto", one read of x. tensor_scale_kernel then turns it into the scale.
template <typename L>
__global__ void __launch_bounds__(kThreads) amax_kernel(const typename L::storage* __restrict__ x,
                                                        int64_t n, uint32_t* __restrict__ out) {
  __shared__ uint32_t red[kThreads / 32];
  const int64_t n_chunks = n / kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t m = 0;
  for (; c + 3 * stride < n_chunks; c += 4 * stride) {
    typename L::Raw r[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) r[u] = L::load(x + (c + u * stride) * kChunk);
#pragma unroll
    for (int u = 0; u < 4; ++u) m = max(m, L::amax_bits(r[u]));
  }
  for (; c < n_chunks; c += stride) m = max(m, L::amax_bits(L::load(x + c * kChunk)));
  if (blockIdx.x == 0 && threadIdx.x < n - n_chunks * kChunk) {  // the last n % 8 elements
    m = max(m, f2u(L::scalar(x + n_chunks * kChunk + threadIdx.x)) & kAbsMask);
  }
  m = __reduce_max_sync(0xffffffffu, m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, red[w]);
    atomicMax(out, m);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace jf4

#endif  // JAX_FP4_CSRC_CUDA_QUANT_KERNELS_CUH_
