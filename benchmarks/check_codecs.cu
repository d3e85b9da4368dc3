// Exhaustive check of the quantize kernels' fast codecs against csrc/codecs.h, on the GPU
// (the FMAs and conversions the kernels run):
//   - codebook_encode_cells (elements.cuh) == codebook_code(codebook_position(s, 1)) for
//     every float32 s but NaN, nf4 and bnb_fp4;
//   - e2m1_magnitude_biased (elements.cuh) == e2m1_encode(clamp(a, -6, 6)) for every a >= 0
//     (finite or +Inf), and e2m1_pack8 == nvfp4_encode of each element, packed, on 2^32
//     hashed 8-element groups (signs, zeros, both ends of the range);
//   - nvfp4_scale_fast<false> (kernels.cuh) == nvfp4_scale_code / nvfp4_elem_mult for every
//     finite amax >= 0, and nvfp4_scale_fast<true> for every finite amax and a set of tensor
//     scales (both edges of its fast range, 2^-120 .. 2^100, and beyond);
//   - int4_code_biased (elements.cuh) == int4_encode for every bf16 x and every bf16 / f16
//     scale of the range int4_params gives (s >= 6.6e-7), every z, wherever the kernel
//     takes it (|x| RN(1/s) < kInt4FastLimit); f32 x and s on 2^34 hashed pairs;
//   - int4_params_fast (kernels.cuh) == int4_params for every d / 15 it divides, every
//     pair min <= max of finite bf16 or f16 values and each scale type, and hashed f32
//     pairs; int4_keys / key_min / int4_range (elements.cuh) == block_minmax on hashed
//     blocks of 32 bf16 / f16 / f32 elements with zeros, infinities and NaNs.
// Not built by default:
//   cmake --build BUILD_DIR --target check_codecs && BUILD_DIR/check_codecs [SUBSTRING]
// Prints the cases checked and the mismatches; exits 1 on any mismatch.
#include <cstdio>
#include <cstring>

#include "cuda/quant/kernels.cuh"

namespace jf4 {
namespace cuda {
namespace check {

struct Counts {
  unsigned long long checked, bad;
  uint32_t first_a, first_b;
};

__device__ void record(Counts* c, bool ok, uint32_t a, uint32_t b) {
  if (ok) return;
  if (atomicAdd(&c->bad, 1ull) == 0) {
    c->first_a = a;
    c->first_b = b;
  }
}

__device__ uint32_t mix(uint64_t v) {  // splitmix64, upper half
  v += 0x9e3779b97f4a7c15ull;
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ull;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((v ^ (v >> 31)) >> 32);
}

__global__ void e2m1_check(Counts* c) {
  unsigned long long n = 0;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t a = blockIdx.x * blockDim.x + threadIdx.x; a <= kInfBits; a += stride) {
    const uint32_t got = e2m1_magnitude_biased(u2f(a)) - kE2m1Bias;
    record(c, got == e2m1_encode(clampf(u2f(a), -6.0f, 6.0f)), a, got);
    ++n;
  }
  atomicAdd(&c->checked, n);
}

// Elements of magnitude 2^-6 .. 2^4 (some +-0), multipliers in [0.5, 2).
__global__ void e2m1_pack_check(uint64_t groups, Counts* c) {
  unsigned long long n = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t g = blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
    float v[8];
    uint32_t want = 0;
    const float mult = u2f(0x3f000000u | (mix(9 * g) >> 8));
    for (int i = 0; i < 8; ++i) {
      const uint32_t h = mix(9 * g + 1 + i);
      const uint32_t e = (h >> 23) % 12u, sign = h & 0x80000000u;  // e = 11: a signed zero
      v[i] = u2f(e == 11u ? sign : sign | (121u + e) << 23 | (h & 0x7fffffu));
      want |= nvfp4_encode(v[i], mult) << (4 * i);
    }
    record(c, e2m1_pack8(v, mult) == want, f2u(v[0]), f2u(mult));
    ++n;
  }
  atomicAdd(&c->checked, n);
}

// Every float32 s but NaN, as x with multiplier 1.
template <int FMT>
__global__ void codebook_check(Counts* c) {
  __shared__ float2 cells[kCodebookCells];
  build_codebook_cells<FMT>(cells);
  __syncthreads();
  unsigned long long n = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
    const uint32_t sb = static_cast<uint32_t>(i);
    if ((sb & kAbsMask) > kInfBits) continue;
    const uint32_t got = codebook_encode_cells(u2f(sb), 1.0f, cells);
    record(c, got == codebook_code<FMT>(codebook_position<FMT>(u2f(sb), 1.0f)), sb, got);
    ++n;
  }
  atomicAdd(&c->checked, n);
}

// amax over all finite non-negative float32 bit patterns, one tensor scale per launch.
template <bool TWO_LEVEL>
__global__ void nvfp4_scale_check(float ts, Counts* c) {
  __shared__ Tables t;
  build_encode_tables<kNVFP4>(t);
  __syncthreads();
  unsigned long long n = 0;
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t a = blockIdx.x * blockDim.x + threadIdx.x; a < kInfBits; a += stride) {
    float mult;
    const uint32_t sc = nvfp4_scale_fast<TWO_LEVEL>(a, ts, t, &mult);
    const uint32_t sc_ref = nvfp4_scale_code<TWO_LEVEL>(u2f(a), ts);
    const float mult_ref = nvfp4_elem_mult<TWO_LEVEL>(sc_ref, ts);
    record(c, sc == sc_ref && f2u(mult) == f2u(mult_ref), a, f2u(ts));
    ++n;
  }
  atomicAdd(&c->checked, n);
}

__device__ void check_int4(float x, float s, Counts* c, unsigned long long* n) {
  const float r = 1.0f / s;
  if (!(fabsf(x) * r < kInt4FastLimit)) return;  // the kernel takes int4_encode there
  for (int z = 0; z < 16; ++z) {
    const float zf = static_cast<float>(z);
    record(c, int4_code_biased(x, s, r, zf - kRne) - kE2m1Bias == int4_encode(x, s, zf), f2u(x),
           f2u(s) ^ static_cast<uint32_t>(z));
    ++*n;
  }
}

// Check::run(a, b, c, &n) for every 16-bit pattern a and every b in [b_lo, b_hi), both
// read as bf16 or f16 values.
template <bool BF16, typename Check>
__global__ void every_pair16(uint32_t b_lo, uint32_t b_hi, Counts* c) {
  unsigned long long n = 0;
  const uint64_t total = static_cast<uint64_t>(b_hi - b_lo) << 16;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    const uint32_t ab = i & 0xffffu, bb = b_lo + static_cast<uint32_t>(i >> 16);
    Check::run(BF16 ? bf16_to_f32(ab) : f16_to_f32(ab), BF16 ? bf16_to_f32(bb) : f16_to_f32(bb),
               c, &n);
  }
  atomicAdd(&c->checked, n);
}

struct Int4EncodeCheck {  // a = x (finite), b = the scale
  __device__ static void run(float x, float s, Counts* c, unsigned long long* n) {
    if ((f2u(x) & kAbsMask) < kInfBits) check_int4(x, s, c, n);
  }
};

// Hashed float32 pairs: x any finite value, s in [2^-21, 2^126).
__global__ void int4_check32(uint64_t pairs, Counts* c) {
  unsigned long long n = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += stride) {
    const uint32_t xb = mix(2 * i), h = mix(2 * i + 1);
    const uint32_t sb = ((h >> 23) % 147u + 106u) << 23 | (h & 0x7fffffu);
    const float x = u2f(xb);
    if ((xb & kAbsMask) >= kInfBits) continue;
    check_int4(x, u2f(sb), c, &n);
  }
  atomicAdd(&c->checked, n);
}

// d / 15 for every float32 d in [1e-5, 2^127) (int4_params_fast's range for it).
__global__ void div15_check(Counts* c) {
  unsigned long long n = 0;
  const uint32_t lo = f2u(1e-5f), hi = f2u(0x1p127f);
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t b = lo + blockIdx.x * blockDim.x + threadIdx.x; b < hi; b += stride) {
    const float d = u2f(b);
    record(c, f2u(div_markstein(d, 15.0f, 1.0f / 15.0f)) == f2u(d / 15.0f), b, 0u);
    ++n;
  }
  atomicAdd(&c->checked, n);
}

__device__ void check_params(float mn, float mx, Counts* c, unsigned long long* n) {
  for (int st = 0; st < 3; ++st) {
    float r;
    const Int4Params got = int4_params_fast(mn, mx, st, &r);
    const Int4Params want = int4_params(mn, mx, st);
    record(c,
           got.scale_bits == want.scale_bits && f2u(got.s) == f2u(want.s) &&
               f2u(got.z) == f2u(want.z) && f2u(r) == f2u(1.0f / want.s),
           f2u(mn), f2u(mx));
    ++*n;
  }
}

struct Int4ParamsCheck {  // a = min, b = max: every ordered pair of finite values
  __device__ static void run(float a, float b, Counts* c, unsigned long long* n) {
    if (a <= b && isfinite(a) && isfinite(b)) check_params(a, b, c, n);
  }
};

// Hashed finite float32 pairs, ordered.
__global__ void int4_params_check32(uint64_t pairs, Counts* c) {
  unsigned long long n = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < pairs; i += stride) {
    const float a = u2f(mix(2 * i)), b = u2f(mix(2 * i + 1));
    if (!isfinite(a) || !isfinite(b)) continue;
    check_params(fminf(a, b), fmaxf(a, b), c, &n);
  }
  atomicAdd(&c->checked, n);
}

// A hashed element: mostly finite values of every magnitude, some +-0, +-Inf and NaNs.
__device__ uint32_t hashed_bits32(uint64_t h64) {
  const uint32_t h = mix(h64), kind = h % 64u, sign = h & 0x80000000u;
  if (kind == 0) return sign;                                      // +-0
  if (kind == 1) return sign | kInfBits;                           // +-Inf
  if (kind == 2) return sign | kInfBits | 1u | (h >> 9 & 0x3fffffu);  // NaN
  return h ^ (kind & 1u ? 0u : 0x40000000u);  // any float, many large magnitudes
}

// int4_keys of two 16-element chunks, reduced by key_min, against block_minmax of the 32.
template <typename L>
__global__ void int4_keys_check(uint64_t blocks, Counts* c) {
  using S = typename L::storage;
  unsigned long long n = 0;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t g = blockIdx.x * blockDim.x + threadIdx.x; g < blocks; g += stride) {
    alignas(16) S x[2 * kChunk];
    float f[2 * kChunk];
    const bool specials = g % 4u == 0;  // a quarter of the blocks may hold zeros, Inf, NaN
    for (int i = 0; i < 2 * kChunk; ++i) {
      uint32_t b = specials ? hashed_bits32(33 * g + i) : mix(33 * g + i);
      if constexpr (sizeof(S) == 2) {
        b >>= 16;  // random bits: about one element in 256 is an Inf or NaN
        x[i] = static_cast<S>(b);
        f[i] = L::scalar_bits(b);
      } else {
        x[i] = u2f(b);
        f[i] = u2f(b);
      }
    }
    uint32_t k0[2] = {0u, 0u}, k1[2] = {0u, 0u};
    typename L::Raw r0, r1;  // the kernels' loads are global-memory only
    memcpy(&r0, x, sizeof(r0));
    memcpy(&r1, x + kChunk, sizeof(r1));
    L::int4_keys(r0, k0);
    L::int4_keys(r1, k1);
    for (int w = 0; w < L::kKeyWords; ++w) k0[w] = L::key_min(k0[w], k1[w]);
    float mn, mx;
    const bool finite = L::int4_range(k0, &mn, &mx);
    int32_t kmin, kmax;
    uint32_t amax;
    block_minmax(f, 2 * kChunk, &kmin, &kmax, &amax);
    const bool want_finite = !bits_nonfinite(amax);
    // -0 and +0 are interchangeable as the min or max (int4_params gives both the same)
    const bool ok = finite == want_finite &&
                    (!finite || (mn == f32_from_order_key(kmin) && mx == f32_from_order_key(kmax)));
    record(c, ok, static_cast<uint32_t>(g), f2u(mn));
    ++n;
  }
  atomicAdd(&c->checked, n);
}

int report(const char* what, Counts* c) {
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("%s: CUDA error %s\n", what, cudaGetErrorString(e));
    return 1;
  }
  std::printf("%-44s checked %14llu  mismatches %llu", what, c->checked, c->bad);
  if (c->bad) std::printf("  (first: 0x%08x / 0x%08x)", c->first_a, c->first_b);
  std::printf("\n");
  const int bad = c->bad != 0;
  *c = Counts{};
  return bad;
}

}  // namespace check
}  // namespace cuda
}  // namespace jf4

int main(int argc, char** argv) {
  using namespace jf4;
  using namespace jf4::cuda;
  using namespace jf4::cuda::check;
  Counts* c = nullptr;
  cudaMallocManaged(&c, sizeof(Counts));
  *c = Counts{};
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int grid = sms * 8, block = 256;
  int bad = 0;
  // check_codecs [SUBSTRING]: only the checks whose label contains SUBSTRING
  const char* only = argc > 1 ? argv[1] : nullptr;
  auto check = [&](const char* what, auto launch) {
    if (only && !std::strstr(what, only)) return;
    launch();
    bad |= report(what, c);
  };

  check("e2m1 magnitude, every a >= 0", [&] { e2m1_check<<<grid, block>>>(c); });
  check("e2m1 pack of 8, hashed groups",
        [&] { e2m1_pack_check<<<grid, block>>>(1ull << 32, c); });
  check("nf4 code, every s", [&] { codebook_check<kNF4><<<grid, block>>>(c); });
  check("bnb_fp4 code, every s", [&] { codebook_check<kBNB_FP4><<<grid, block>>>(c); });
  check("nvfp4 one level, every amax",
        [&] { nvfp4_scale_check<false><<<grid, block>>>(1.0f, c); });
  const float tss[] = {0x1p-120f, 0x1.000002p-120f, 1.0f / 2688.0f, 0.37f, 1.0f, 3.0f,
                       1.1754944e-38f * 0x1p10f, 2688.0f, 0x1.fffffep99f, 0x1p100f,
                       0x1.000002p100f, 0x1p120f, 3.4028235e38f};
  for (float ts : tss) {
    char what[64];
    std::snprintf(what, sizeof(what), "nvfp4 two level, every amax, ts %a", ts);
    check(what, [&] { nvfp4_scale_check<true><<<grid, block>>>(ts, c); });
  }
  // bf16 scales from 2^-21 (0x3500) to the largest finite (0x7f7f); f16 from the
  // smallest subnormal to 65504 (0x7bff).
  check("int4, every bf16 x and bf16 scale",
        [&] { every_pair16<true, Int4EncodeCheck><<<grid, block>>>(0x3500u, 0x7f80u, c); });
  check("int4, every f16 x and f16 scale",
        [&] { every_pair16<false, Int4EncodeCheck><<<grid, block>>>(0x0001u, 0x7c00u, c); });
  check("int4, hashed f32 x and scale",
        [&] { int4_check32<<<grid, block>>>(1ull << 34, c); });
  check("int4 d / 15, every d", [&] { div15_check<<<grid, block>>>(c); });
  check("int4 params, every bf16 min <= max",
        [&] { every_pair16<true, Int4ParamsCheck><<<grid, block>>>(0u, 0x10000u, c); });
  check("int4 params, every f16 min <= max",
        [&] { every_pair16<false, Int4ParamsCheck><<<grid, block>>>(0u, 0x10000u, c); });
  check("int4 params, hashed f32 pairs",
        [&] { int4_params_check32<<<grid, block>>>(1ull << 32, c); });
  check("int4 block min / max, hashed bf16 blocks",
        [&] { int4_keys_check<Io16<true>><<<grid, block>>>(1ull << 28, c); });
  check("int4 block min / max, hashed f16 blocks",
        [&] { int4_keys_check<Io16<false>><<<grid, block>>>(1ull << 28, c); });
  check("int4 block min / max, hashed f32 blocks",
        [&] { int4_keys_check<IoF32><<<grid, block>>>(1ull << 28, c); });
  std::printf(bad ? "FAILED\n" : "all equal\n");
  return bad;
}
