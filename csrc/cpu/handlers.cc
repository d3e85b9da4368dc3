// The CPU FFI handlers: validate the buffers against csrc/README.md, then run the
// compute variant for this CPU (AVX2 where available on x86-64, else baseline).
#include "handlers.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../ffi_util.h"
#include "compute.h"
#include "validate.h"

namespace jf4 {
namespace cpu {

// ---------------------------------------------------------------------------------
// run_parallel: splits [0, n) into chunks of at least `grain` items on XLA's intra-op
// thread pool (std::threads when the handler has none). The calling thread takes part
// and only waits for chunks that another thread has already claimed, so it cannot
// deadlock on a busy pool; tasks that start after the work is done return at once.
// Every chunk runs under an IeeeFpGuard (XLA:CPU threads run with FTZ/DAZ set).
// ---------------------------------------------------------------------------------
namespace {
struct ParallelState {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t n_chunks = 0;
  int64_t n = 0;
  int64_t chunk = 0;
  void* ctx = nullptr;
  RangeFn fn = nullptr;
  std::mutex mu;
  std::condition_variable cv;

  void work() {
    IeeeFpGuard guard;
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) return;
      const int64_t b = c * chunk;
      fn(ctx, b, std::min(n, b + chunk));
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == n_chunks) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};
}  // namespace

void run_parallel(void* pool_ptr, int64_t n, int64_t grain, void* ctx, RangeFn fn) {
  if (n <= 0) return;
  auto* pool = static_cast<ffi::ThreadPool*>(pool_ptr);
  grain = std::max<int64_t>(grain, 1);
  const int64_t pool_threads = pool ? pool->num_threads() : 0;
  const unsigned hw = std::thread::hardware_concurrency();
  const int64_t workers = std::max<int64_t>(pool_threads > 0 ? pool_threads : (hw ? hw : 1), 1);
  // A few chunks per worker for load balance, none smaller than `grain`.
  const int64_t n_chunks = std::min<int64_t>((n + grain - 1) / grain, workers * 4);
  if (n_chunks <= 1 || workers <= 1) {
    IeeeFpGuard guard;
    fn(ctx, 0, n);
    return;
  }
  auto st = std::make_shared<ParallelState>();
  st->n = n;
  st->chunk = (n + n_chunks - 1) / n_chunks;
  st->n_chunks = (n + st->chunk - 1) / st->chunk;
  st->ctx = ctx;
  st->fn = fn;
  const int64_t helpers = std::min<int64_t>(workers, st->n_chunks) - 1;
  std::vector<std::thread> threads;
  if (pool_threads > 0) {
    for (int64_t i = 0; i < helpers; ++i) pool->Schedule([st]() { st->work(); });
  } else {
    for (int64_t i = 0; i < helpers; ++i) threads.emplace_back([st]() { st->work(); });
  }
  st->work();
  {
    std::unique_lock<std::mutex> lock(st->mu);
    st->cv.wait(lock, [&] { return st->done.load(std::memory_order_acquire) >= st->n_chunks; });
  }
  for (auto& t : threads) t.join();
}

namespace {

FloatType float_type(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? FloatType::kBF16
                                  : (t == ffi::DataType::F16 ? FloatType::kF16 : FloatType::kF32);
}

ffi::Error compute_status(bool ok, const std::string& where) {
  return ok ? ffi::Error::Success() : ffi::Error::Internal(where + ": unsupported format or dtype");
}

bool use_avx2() {
#if defined(JF4_HAVE_AVX2_VARIANT)
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

#if defined(JF4_HAVE_AVX2_VARIANT)
#define JF4_CPU_CALL(fn, ...) (use_avx2() ? avx2::fn(__VA_ARGS__) : base::fn(__VA_ARGS__))
#else
#define JF4_CPU_CALL(fn, ...) base::fn(__VA_ARGS__)
#endif

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                        ffi::Result<ffi::AnyBuffer> codes, ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::AnyBuffer> zeros, int32_t fmt, int64_t block_size,
                        int32_t rceil, int32_t two_level, int32_t swizzled) {
  const std::string where = "jax_fp4_quantize_v2";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p{};
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_swizzled(where, swizzled, &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, *codes, *scales, *zeros));
  if (p.R == 0 || p.K == 0) return ffi::Error::Success();
  // The 128x4 layout's padding (rows past R, scale columns past nb) holds zero bytes.
  if (p.swizzled) std::memset(scales->untyped_data(), 0, scales->size_bytes());
  return compute_status(
      JF4_CPU_CALL(quantize, &pool, p, float_type(x.element_type()), x.untyped_data(),
                   static_cast<const float*>(ts.untyped_data()), /*rand=*/nullptr,
                   static_cast<uint8_t*>(codes->untyped_data()), scales->untyped_data(),
                   static_cast<uint8_t*>(zeros->untyped_data())),
      where);
}

// jax_fp4_quantize_sr_v1: quantize with stochastic rounding of the elements, one uint32
// of `rand` (R, K) per element (jax_fp4/stochastic.py); linear scales, attributes of v1.
ffi::Error QuantizeSrImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                          ffi::AnyBuffer rand, ffi::Result<ffi::AnyBuffer> codes,
                          ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> zeros,
                          int32_t fmt, int64_t block_size, int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_quantize_sr_v1";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p{};
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(check_dtype(where, "rand", rand.element_type(), {ffi::DataType::U32}));
  JF4_RETURN_IF_ERROR(check_shape(where, "rand", rand.dimensions(), {p.R, p.K}));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, *codes, *scales, *zeros));
  if (p.R == 0 || p.K == 0) return ffi::Error::Success();
  return compute_status(
      JF4_CPU_CALL(quantize, &pool, p, float_type(x.element_type()), x.untyped_data(),
                   static_cast<const float*>(ts.untyped_data()),
                   static_cast<const uint32_t*>(rand.untyped_data()),
                   static_cast<uint8_t*>(codes->untyped_data()), scales->untyped_data(),
                   static_cast<uint8_t*>(zeros->untyped_data())),
      where);
}

// The buffers and attributes of quantize (v2 adds `swizzled` below).
auto QuantizeBinding() {
  return xla::ffi::Ffi::Bind()
      .Ctx<xla::ffi::ThreadPool>()
      .Arg<xla::ffi::AnyBuffer>()  // x
      .Arg<xla::ffi::AnyBuffer>()  // ts
      .Ret<xla::ffi::AnyBuffer>()  // codes
      .Ret<xla::ffi::AnyBuffer>()  // scales
      .Ret<xla::ffi::AnyBuffer>()  // zeros
      .Attr<int32_t>("fmt")
      .Attr<int64_t>("block_size")
      .Attr<int32_t>("rceil")
      .Attr<int32_t>("two_level");
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer zeros, ffi::AnyBuffer ts, ffi::Result<ffi::AnyBuffer> y,
                          int32_t fmt, int64_t block_size, int32_t two_level) {
  const std::string where = "jax_fp4_dequantize_v1";
  JF4_RETURN_IF_ERROR(validate_x(where, "y", *y));
  Problem p{};
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, /*rceil=*/0, two_level,
                                       y->dimensions()[0], y->dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  JF4_RETURN_IF_ERROR(validate_quantized(where, &p, codes, scales, zeros));
  if (p.R == 0 || p.K == 0) return ffi::Error::Success();
  return compute_status(
      JF4_CPU_CALL(dequantize, &pool, p, float_type(y->element_type()),
                   static_cast<const uint8_t*>(codes.untyped_data()), scales.untyped_data(),
                   static_cast<const uint8_t*>(zeros.untyped_data()),
                   static_cast<const float*>(ts.untyped_data()), y->untyped_data()),
      where);
}

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer ts,
                            ffi::Result<ffi::AnyBuffer> y, int32_t fmt, int64_t block_size,
                            int32_t rceil, int32_t two_level) {
  const std::string where = "jax_fp4_fake_quantize_v1";
  JF4_RETURN_IF_ERROR(validate_x(where, "x", x));
  Problem p{};
  JF4_RETURN_IF_ERROR(validate_problem(where, fmt, block_size, rceil, two_level,
                                       x.dimensions()[0], x.dimensions()[1], &p));
  JF4_RETURN_IF_ERROR(validate_ts(where, p, ts));
  if (y->element_type() != x.element_type())
    return invalid(where, std::string("buffer `y` has dtype ") + dtype_name(y->element_type()) +
                              ", expected x's dtype " + dtype_name(x.element_type()));
  JF4_RETURN_IF_ERROR(check_shape(where, "y", y->dimensions(), {p.R, p.K}));
  // Fake-quantized INT4 rounds its scales to x's dtype.
  p.scale_type = x.element_type() == ffi::DataType::BF16
                     ? kScaleBF16
                     : (x.element_type() == ffi::DataType::F16 ? kScaleF16 : kScaleF32);
  if (p.R == 0 || p.K == 0) return ffi::Error::Success();
  return compute_status(
      JF4_CPU_CALL(fake_quantize, &pool, p, float_type(x.element_type()), x.untyped_data(),
                   static_cast<const float*>(ts.untyped_data()), y->untyped_data()),
      where);
}

}  // namespace
}  // namespace cpu
}  // namespace jf4

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeV2Cpu, jf4::cpu::QuantizeImpl,
                              jf4::cpu::QuantizeBinding().Attr<int32_t>("swizzled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4QuantizeSrV1Cpu, jf4::cpu::QuantizeSrImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // ts
                                  .Arg<xla::ffi::AnyBuffer>()   // rand
                                  .Ret<xla::ffi::AnyBuffer>()   // codes
                                  .Ret<xla::ffi::AnyBuffer>()   // scales
                                  .Ret<xla::ffi::AnyBuffer>()   // zeros
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4DequantizeV1Cpu, jf4::cpu::DequantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()   // codes
                                  .Arg<xla::ffi::AnyBuffer>()   // scales
                                  .Arg<xla::ffi::AnyBuffer>()   // zeros
                                  .Arg<xla::ffi::AnyBuffer>()   // ts
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("two_level"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFp4FakeQuantizeV1Cpu, jf4::cpu::FakeQuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()   // x
                                  .Arg<xla::ffi::AnyBuffer>()   // ts
                                  .Ret<xla::ffi::AnyBuffer>()   // y
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("block_size")
                                  .Attr<int32_t>("rceil")
                                  .Attr<int32_t>("two_level"));
