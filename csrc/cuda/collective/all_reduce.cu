// jax_fp4_all_reduce_v1 (csrc/README.md): the sum of float32 partials over a group of GPUs
// of this process, as one kernel inside XLA's command buffer (CUDA graph).
//
// Why: XLA's all-reduce (NCCL) leaves the command buffer, so a tensor-parallel decode step
// becomes one graph per all-reduce plus the collective's own launch and stream waits; at
// decode sizes (kilobytes) that costs more than the matmuls it follows (measurements:
// benchmarks/RESULTS.md). Serving engines (vLLM, TensorRT-LLM) use a one-shot all-reduce
// over peer memory for the same reason; this is that kernel for one process that drives
// several GPUs, the way JAX runs a mesh of local devices.
//
// Protocol: NCCL's "LL" (low latency) one. Each value travels as one 64-bit word, its
// float32 bits in the low half and the call's epoch in the high half. A 64-bit store is
// single-copy atomic, so a reader that sees the epoch sees the value: no fence, no
// separate flag, one one-way trip over NVLink / PCIe per call.
//
// A *channel* is one call site (all_reduce_setup, called when the program is partitioned).
// On every GPU of its groups it owns, in that GPU's memory,
//   words:    2 phases x R ranks x cap uint64, written by the peers;
//   counters: kMaxBlocks uint32, the epoch block b of this GPU last completed.
// Block b of a call on rank q (epoch e = counter[b] + 1, phase e & 1):
//   1. stores (value, e) of its slice of q's partial into every peer's words[phase][q];
//   2. for each value of the slice, polls its own words[phase][r] of every peer r until
//      the word carries e, and sums over ranks 0..R-1 in rank order (its own partial from
//      the input) in float32, then writes the output dtype;
//   3. stores counter[b] = e.
// Every rank adds the same values in the same order, so all ranks hold bit-identical sums.
// Phases alternate so that a peer one call ahead never overwrites what this block still
// reads: the peer's call e + 2 (the next to write phase e & 1) starts after its call e + 1
// ended, which needed this block's values of call e + 1, stored after its call e ended.
// A slot's epochs (e, e + 2, ...) differ, so a stale word is never taken for a new one.
// The same call site never runs twice at once on one GPU (one stream per program), and
// different call sites own different channels, so XLA may run them concurrently.
// A peer that never arrives (a program that is not SPMD across the group) would leave the
// polls spinning: after kTimeoutNs the kernel traps, an error XLA reports, not a hang.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "../../ffi_util.h"
#include "../handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jf4 {
namespace cuda {
namespace {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;
constexpr int kThreads = 512;
constexpr int kPerThread = 8;  // values per thread: n <= kMaxBlocks * kThreads * kPerThread
constexpr int64_t kMaxElements = int64_t{kMaxBlocks} * kThreads * kPerThread;
constexpr unsigned long long kTimeoutNs = 20ull * 1000 * 1000 * 1000;

struct AllReduceArgs {
  const float* in;
  void* out;
  int64_t n;
  int64_t cap;
  int rank;
  int ranks;
  const uint64_t* my_words;
  uint32_t* counters;
  uint64_t* peer_words[kMaxRanks];  // each rank's words (mine included, unused)
};

__device__ __forceinline__ void store_word(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_word(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The value of the word at p once it carries `epoch`.
__device__ __forceinline__ float await_value(const uint64_t* p, uint32_t epoch) {
  uint64_t w = load_word(p);
  if (static_cast<uint32_t>(w >> 32) != epoch) {
    const unsigned long long t0 = global_ns();
    do {
      __nanosleep(20);
      if (global_ns() - t0 > kTimeoutNs) __trap();  // a peer never arrived
      w = load_word(p);
    } while (static_cast<uint32_t>(w >> 32) != epoch);
  }
  return __uint_as_float(static_cast<uint32_t>(w));
}

template <typename Out>
__device__ __forceinline__ Out from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

template <typename Out>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(AllReduceArgs a) {
  const int b = blockIdx.x;
  const int64_t per = (a.n + gridDim.x - 1) / gridDim.x;
  const int64_t lo = b * per, hi = lo + per < a.n ? lo + per : a.n;
  __shared__ uint32_t epoch_s;
  if (threadIdx.x == 0) epoch_s = a.counters[b] + 1;
  float v[kPerThread];  // this rank's values, loaded while thread 0 reads the counter
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = lo + threadIdx.x + int64_t{j} * kThreads;
    v[j] = i < hi ? a.in[i] : 0.0f;
  }
  __syncthreads();
  const uint32_t epoch = epoch_s;
  const int64_t phase = static_cast<int64_t>(epoch & 1) * a.ranks * a.cap;
  // 1. (value, epoch) into every peer's words[phase][rank]
  for (int r = 0; r < a.ranks; ++r) {
    if (r == a.rank) continue;
    uint64_t* dst = a.peer_words[r] + phase + a.rank * a.cap;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t i = lo + threadIdx.x + int64_t{j} * kThreads;
      if (i < hi) store_word(dst + i, uint64_t{epoch} << 32 | __float_as_uint(v[j]));
    }
  }
  // 2. the sum in rank order, as the peers' values arrive
  Out* out = static_cast<Out*>(a.out);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int64_t i = lo + threadIdx.x + int64_t{j} * kThreads;
    if (i >= hi) continue;
    float s = 0.0f;
    for (int q = 0; q < a.ranks; ++q) {
      const float x = q == a.rank ? v[j] : await_value(a.my_words + phase + q * a.cap + i, epoch);
      s = q == 0 ? x : s + x;
    }
    out[i] = from_f32<Out>(s);
  }
  // 3. (read by this block's next call only, after this kernel ended)
  if (threadIdx.x == 0) a.counters[b] = epoch;
}

// ------------------------------------------------------------------ channels (host)
struct Member {  // one GPU of one group of a channel
  int rank = 0;
  std::vector<int> group;  // the group's device ordinals, in rank order
};

struct Channel {
  int64_t cap = 0;                      // values per (phase, rank) slot
  std::map<int, Member> members;        // by device ordinal
  std::map<int, uint64_t*> words;       // by device ordinal
  std::map<int, uint32_t*> counters;
};

std::mutex g_mu;
std::map<int64_t, Channel> g_channels;
// Channel ids start at a random point of each process, so that an executable compiled in
// another process (a persistent compilation cache) names no channel of this one and its
// call fails with the "not set up" error instead of borrowing another call site's buffers.
int64_t g_next_channel = 0;

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

ffi::Error AllReduceImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer in,
                         ffi::Result<ffi::AnyBuffer> out, int64_t channel) {
  const std::string where = "jax_fp4_all_reduce (CUDA)";
  JF4_RETURN_IF_ERROR(check_dtype(where, "in", in.element_type(), {ffi::DataType::F32}));
  JF4_RETURN_IF_ERROR(check_dtype(where, "out", out->element_type(),
                                  {ffi::DataType::F32, ffi::DataType::BF16, ffi::DataType::F16}));
  const int64_t n = static_cast<int64_t>(in.element_count());
  if (static_cast<int64_t>(out->element_count()) != n)
    return invalid(where, "buffers `in` and `out` must have as many elements, got " +
                              std::to_string(n) + " and " + std::to_string(out->element_count()));
  AllReduceArgs a{};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_channels.find(channel);
    if (it == g_channels.end())
      return invalid(where, "attribute `channel` = " + std::to_string(channel) +
                                " was not set up in this process (all_reduce_setup runs when the "
                                "program is partitioned; a program compiled in another process "
                                "cannot run this all-reduce)");
    const Channel& c = it->second;
    auto m = c.members.find(device);
    if (m == c.members.end())
      return invalid(where, "device " + std::to_string(device) + " is in no group of channel " +
                                std::to_string(channel));
    if (n > c.cap)
      return invalid(where, "buffer `in` has " + std::to_string(n) + " elements, channel " +
                                std::to_string(channel) + " holds " + std::to_string(c.cap));
    a.cap = c.cap;
    a.rank = m->second.rank;
    a.ranks = static_cast<int>(m->second.group.size());
    a.my_words = c.words.at(device);
    a.counters = c.counters.at(device);
    for (int r = 0; r < a.ranks; ++r) a.peer_words[r] = c.words.at(m->second.group[r]);
  }
  a.in = static_cast<const float*>(in.untyped_data());
  a.out = out->untyped_data();
  a.n = n;
  if (n == 0) return ffi::Error::Success();
  const int64_t per_block = int64_t{kThreads} * kPerThread;
  const int blocks = static_cast<int>((n + per_block - 1) / per_block);  // <= kMaxBlocks: n <= cap
  switch (out->element_type()) {
    case ffi::DataType::BF16: all_reduce_kernel<__nv_bfloat16><<<blocks, kThreads, 0, stream>>>(a); break;
    case ffi::DataType::F16: all_reduce_kernel<__half><<<blocks, kThreads, 0, stream>>>(a); break;
    default: all_reduce_kernel<float><<<blocks, kThreads, 0, stream>>>(a); break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(where + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

int64_t AllReduceSetup(const std::vector<std::vector<int>>& groups, int64_t max_elements,
                       std::string* error) {
  if (groups.empty() || max_elements < 1 || max_elements > kMaxElements) {
    *error = "all_reduce_setup: needs at least one group and 1 <= max_elements <= " +
             std::to_string(kMaxElements) + ", got " + std::to_string(groups.size()) +
             " groups, max_elements = " + std::to_string(max_elements);
    return 0;
  }
  int prev = 0;
  cudaGetDevice(&prev);
  Channel c;
  c.cap = max_elements;
  for (const auto& g : groups) {
    if (g.size() < 2 || g.size() > static_cast<size_t>(kMaxRanks)) {
      *error = "all_reduce_setup: a group has " + std::to_string(g.size()) +
               " devices, expected 2 to " + std::to_string(kMaxRanks);
      return 0;
    }
    for (int d : g)
      for (int p : g) {
        if (d == p) continue;
        int ok = 0;
        if (cudaDeviceCanAccessPeer(&ok, d, p) != cudaSuccess || !ok) return 0;  // no peer access
      }
    for (size_t r = 0; r < g.size(); ++r) {
      if (c.members.count(g[r])) {
        *error = "all_reduce_setup: device " + std::to_string(g[r]) + " is in two groups";
        return 0;
      }
      c.members[g[r]] = Member{static_cast<int>(r), g};
    }
  }
  std::string err;
  for (const auto& [d, m] : c.members) {
    cudaError_t e = cudaSetDevice(d);
    for (int p : m.group) {
      if (e != cudaSuccess || p == d) continue;
      e = cudaDeviceEnablePeerAccess(p, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();
        e = cudaSuccess;
      }
    }
    uint64_t* words = nullptr;
    uint32_t* counters = nullptr;
    const size_t bytes = sizeof(uint64_t) * 2 * static_cast<size_t>(c.cap) * m.group.size();
    if (e == cudaSuccess) e = cudaMalloc(&words, bytes);
    if (e == cudaSuccess) e = cudaMalloc(&counters, kMaxBlocks * sizeof(uint32_t));
    // epoch 0 in every word and counter: the first call's epoch is 1
    if (e == cudaSuccess) e = cudaMemset(words, 0, bytes);
    if (e == cudaSuccess) e = cudaMemset(counters, 0, kMaxBlocks * sizeof(uint32_t));
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (words) c.words[d] = words;
    if (counters) c.counters[d] = counters;
    if (e != cudaSuccess) {
      err = cuda_error(("all_reduce_setup on device " + std::to_string(d)).c_str(), e);
      break;
    }
  }
  cudaSetDevice(prev);
  if (!err.empty()) {
    for (auto& [d, p] : c.words) cudaFree(p);
    for (auto& [d, p] : c.counters) cudaFree(p);
    *error = err;
    return 0;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_next_channel == 0)
    g_next_channel = 1 + (static_cast<int64_t>(std::random_device{}()) << 20);
  const int64_t id = g_next_channel++;
  g_channels.emplace(id, std::move(c));
  return id;
}

}  // namespace cuda
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4AllReduceV1Cuda, jf4::cuda::AllReduceImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // in: this device's float32 partials
                                  .Ret<ffi::AnyBuffer>()  // out: their sum, f32 / bf16 / f16
                                  .Attr<int64_t>("channel"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
