// Standalone driver for the W4A16 CUDA kernels (csrc/cuda/wmatmul/), without JAX: for
// Nsight Compute, which crashes at the exit of a profiled jax process (benchmarks/log/NOTES.md), and for
// quick sweeps of kernel variants (build several binaries with different -D or source
// copies, carry them to the GPU, no pip build there). It links the kernels' units and
// calls their launch entry point (csrc/cuda/wmatmul/launch.h, launch_wmatmul) on random
// bits: timing only -- the results are checked through JAX by tests/test_cuda_matmul.py,
// not here. The wgmma kernel takes x already in its permuted layout; random bits need no
// permutation.
//
// Build (either; the second needs no XLA headers and no Python):
//   cmake --build BUILD_DIR --target wmatmul_harness      (a CUDA build dir of the project)
//   nvcc -std=c++17 -O3 -fmad=false --expt-relaxed-constexpr \
//        -gencode=arch=compute_90a,code=sm_90a -Icsrc -diag-suppress 940,2473 \
//        benchmarks/wmatmul_harness.cu csrc/cuda/wmatmul/launch.cu \
//        csrc/cuda/wmatmul/tma.cu -o wmatmul_harness
//   (benchmarks/device_check.sh harness does the latter on the GPU machine.)
//   ./wmatmul_harness FMT K N M TILE_M SPLITS [REPS [CLUSTER]]   FMT: nvfp4 mxfp4 nf4 int4
//        int4f16 (int4 with f16 scales: AWQ's, with bf16 x);
//        TILE_M 0 = the mma.sync kernels, 8/16/32/64/128/256 = the wgmma kernel; SPLITS as
//        jax_fp4.prims._launch_plan.wmatmul_splits(M, N, K, ...) gives them; CLUSTER 2:
//        TILE_M 256 in 2-CTA clusters that multicast x (primitives.wmatmul_cluster);
//        env JF4_PAD_X=1: x rows padded to TILE_M as JAX pads them; JF4_TILED=1: the
//        prepared weight layout (jax_fp4.prepare); JF4_F16_X=1: x (the same bits) as f16
//   ./wmatmul_harness roof                             read-only stream and D2D copy
//   ncu --set full -k regex:wmatmul --launch-skip 3 --launch-count 1 -o rep \
//        ./wmatmul_harness nvfp4 8192 28672 16 32 1 5
//
// Time per launch: cudaEvent time over REPS back-to-back launches / REPS, rotating over
// enough weight copies (>= 256 MiB together, >= 128 MiB of scales) that no launch finds
// its weight or scales in L2. Weight (N, K) with the
// formats' usual block sizes (nvfp4 16, mxfp4 32, nf4 64, int4 128 with bf16 scales), x
// bf16 (JF4_F16_X: f16), one-level nvfp4. Without the split reduction and x permutation that the JAX path
// adds (bench_matmul.py measures those too).
#include "cuda/wmatmul/launch.h"

#include <algorithm>
#include <string>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

// an environment flag: set to anything but "0"
bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v && std::strcmp(v, "0") != 0;
}

__global__ void fill_bytes(uint8_t* p, size_t n, uint32_t seed, uint32_t mask, uint32_t base) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = static_cast<uint8_t>((h & mask) | base);
  }
}
__global__ void fill_u16(uint16_t* p, size_t n, uint32_t seed, uint32_t mask, uint32_t base) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13;
    p[i] = static_cast<uint16_t>((h & mask) | base);
  }
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) p[i] = v;
}
__global__ void read_stream(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *sink = acc;
}

template <class F>
float time_us(F f, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f(i);
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f(i);
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  return 1000.f * ms / reps;
}

int roof() {
  const size_t bytes = size_t(1) << 30;
  uint8_t *a, *b;
  uint32_t* sink;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  CK(cudaMalloc(&sink, 4));
  fill_bytes<<<1024, 256>>>(a, bytes, 1, 0xff, 0);
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const float tr = time_us([&](int) { read_stream<<<sms * 8, 512>>>(reinterpret_cast<const uint4*>(a), bytes / 16, sink); }, 10);
  const float tc = time_us([&](int) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  std::printf("roof: read-only stream %.0f GB/s, D2D copy %.0f GB/s (read+write counted once)\n",
              bytes / tr / 1e3, bytes / tc / 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace jf4;
  using namespace jf4::cuda;
  if (argc >= 2 && std::strcmp(argv[1], "roof") == 0) return roof();
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s FMT K N M TILE_M SPLITS [REPS [CLUSTER]] | roof\n", argv[0]);
    return 2;
  }
  const std::string fmt_name = argv[1];
  const int64_t K = std::atoll(argv[2]), N = std::atoll(argv[3]), M = std::atoll(argv[4]);
  const int64_t tile_m = std::atoll(argv[5]);
  const int splits = std::atoi(argv[6]);
  const int reps = argc > 7 ? std::atoi(argv[7]) : 20;
  const int cluster = argc > 8 ? std::atoi(argv[8]) : 1;
  int fmt, bs, esize;
  if (fmt_name == "nvfp4") fmt = kNVFP4, bs = 16, esize = 1;
  else if (fmt_name == "mxfp4") fmt = kMXFP4, bs = 32, esize = 1;
  else if (fmt_name == "nf4") fmt = kNF4, bs = 64, esize = 4;
  else if (fmt_name == "int4" || fmt_name == "int4f16") fmt = kINT4, bs = 128, esize = 2;
  else { std::fprintf(stderr, "unknown format %s\n", fmt_name.c_str()); return 2; }

  WParams p{};
  p.M = M; p.N = N; p.K = K; p.K32 = static_cast<int>(K);
  // JF4_PAD_X=1: x with M rounded up to TILE_M rows (as primitives.wmatmul_x_layout pads it)
  p.x_rows = tile_m > 0 && env_flag("JF4_PAD_X") ? (M + tile_m - 1) / tile_m * tile_m : M;
  p.nb = K / bs; p.bs = bs;
  while ((1 << p.bs_shift) < bs) ++p.bs_shift;
  const int64_t step = step_k(M, tile_m);
  p.n_steps = (K + step - 1) / step;
  p.steps_per_split = (p.n_steps + splits - 1) / splits;
  p.two_level = 0;
  p.st = fmt_name == "int4f16" ? kScaleF16 : kScaleBF16;  // int4f16: AWQ's f16 scales, bf16 x
  p.out_f32 = splits > 1;
  p.cluster = cluster;
  // JF4_TILED=1: the prepared weight layout (jax_fp4.prepare; N and K multiples of 128):
  // random bits need no re-layout either
  p.tiled = env_flag("JF4_TILED") ? 1 : 0;
  const bool f16_x = env_flag("JF4_F16_X");  // x's bits as f16 (int4: f16 scales as well)
  if (f16_x) p.st = kScaleF16;

  const size_t code_bytes = size_t(N) * K / 2, scale_bytes = size_t(N) * p.nb * esize;
  const size_t per_copy = code_bytes + scale_bytes + size_t(N) * p.nb;
  // enough copies that neither the weights (>= 256 MiB) nor their scales alone (>= 128 MiB,
  // 2.5x the H100's L2) are found in L2 by a later launch: the scale boxes are copied with
  // normal eviction, and with two copies of 8192 x 28672 nvfp4 (15 MB of scales each) the
  // scales stayed in L2 between launches (benchmarks/log/NOTES.md)
  const size_t ceil_div_w = ((size_t(256) << 20) + per_copy - 1) / per_copy;
  const size_t ceil_div_s = ((size_t(128) << 20) + scale_bytes - 1) / scale_bytes;
  // (no more than the launches, 3 warm-up + reps: a sanitizer run of a small weight with
  // REPS 2 would otherwise fill thousands of copies under instrumentation)
  const int copies = static_cast<int>(std::max<size_t>(1, std::min<size_t>(std::max(ceil_div_w, ceil_div_s), 3 + reps)));
  std::vector<uint8_t*> codes(copies), scales(copies), zeros(copies);
  for (int c = 0; c < copies; ++c) {
    CK(cudaMalloc(&codes[c], code_bytes));
    CK(cudaMalloc(&scales[c], scale_bytes));
    CK(cudaMalloc(&zeros[c], size_t(N) * p.nb));
    fill_bytes<<<1024, 256>>>(codes[c], code_bytes, 7 + c, 0xff, 0);
    if (fmt == kNVFP4) fill_bytes<<<1024, 256>>>(scales[c], scale_bytes, 9 + c, 0x0f, 0x30);
    else if (fmt == kMXFP4) fill_bytes<<<1024, 256>>>(scales[c], scale_bytes, 9 + c, 0x07, 0x78);
    else if (fmt == kNF4) fill_f32<<<1024, 256>>>(reinterpret_cast<float*>(scales[c]), scale_bytes / 4, 0.5f);
    else fill_u16<<<1024, 256>>>(reinterpret_cast<uint16_t*>(scales[c]), scale_bytes / 2, 9 + c, 0x7f, 0x3c00);
    fill_bytes<<<1024, 256>>>(zeros[c], size_t(N) * p.nb, 11 + c, 0x0f, 0);
  }
  const int64_t x_cols = tile_m > 0 ? p.n_steps * step : K;
  uint16_t* x;
  float* ts;
  void* out;
  CK(cudaMalloc(&x, size_t(p.x_rows) * x_cols * 2));
  CK(cudaMalloc(&ts, size_t(N) * 4));
  CK(cudaMalloc(&out, size_t(splits) * M * N * 4));
  fill_u16<<<1024, 256>>>(x, size_t(p.x_rows) * x_cols, 3, 0xff, 0x3f00);  // bf16 in [0.5, 1)
  fill_f32<<<1024, 256>>>(ts, N, 1.f);
  CK(cudaDeviceSynchronize());

  auto launch_one = [&](int i) {
    const int c = i % copies;
    const cudaError_t e = launch_wmatmul(fmt, !f16_x, 0, x, codes[c], scales[c], zeros[c], ts, out, p,
                                         splits, tile_m);
    CK(e);
  };
  const float us = time_us(launch_one, reps);
  CK(cudaDeviceSynchronize());
  const double floor_bytes = double(per_copy - (fmt == kINT4 ? 0 : size_t(N) * p.nb));
  std::printf("%s K=%lld N=%lld M=%lld tile_m=%lld splits=%d cluster=%d: %.1f us, %.0f GB/s of weight\n",
              fmt_name.c_str(), (long long)K, (long long)N, (long long)M, (long long)tile_m,
              splits, cluster, us, floor_bytes / us / 1e3);
  return 0;
}
