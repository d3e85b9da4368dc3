// nanobind module jax_fp4._native: hands the FFI handler symbols to Python.
//   registrations() -> {target_name: {platform: capsule}}   (platform "cpu" / "CUDA")
//   build_info()    -> {"version", "cuda", "cuda_archs", "compiler", ...}
//   format_table()  -> [{"fid", "name", "bits", "mx", "codebook", "values"}, ...]: the format
//                      ids and element decodes of codecs.h, which jax_fp4/_ext.py checks
//                      against jax_fp4/formats.py at load
//   all_reduce_setup(groups, max_elements) -> channel id (CUDA builds only): the buffers of
//                      one in-graph all-reduce call site (csrc/cuda/collective/all_reduce.cu)
// jax_fp4/_ext.py registers the capsules with jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "codecs.h"
#include "cpu/handlers.h"
#ifdef JAX_FP4_WITH_CUDA
#include "cuda/handlers.h"
#endif

namespace nb = nanobind;

#ifndef JAX_FP4_VERSION
#define JAX_FP4_VERSION "0.0.0"
#endif
#ifndef JAX_FP4_CUDA_ARCHS
#define JAX_FP4_CUDA_ARCHS ""
#endif
#ifndef JAX_FP4_CXX_COMPILER
#define JAX_FP4_CXX_COMPILER "unknown"
#endif
#ifndef JAX_FP4_CUDA_COMPILER
#define JAX_FP4_CUDA_COMPILER ""
#endif
#ifndef JAX_FP4_BUILD_TYPE
#define JAX_FP4_BUILD_TYPE ""
#endif

namespace {

void add_target(nb::dict& regs, const char* target, const char* platform, void* fn) {
  nb::str key(target);
  if (!regs.contains(key)) regs[key] = nb::dict();
  nb::dict per_platform = nb::borrow<nb::dict>(regs[key]);
  per_platform[platform] = nb::capsule(fn);
}

nb::dict registrations() {
  nb::dict regs;
#define JAX_FP4_ADD_CPU_(target, symbol) \
  add_target(regs, target, "cpu", reinterpret_cast<void*>(&symbol));
  JAX_FP4_CPU_HANDLERS(JAX_FP4_ADD_CPU_)
#undef JAX_FP4_ADD_CPU_
#ifdef JAX_FP4_WITH_CUDA
#define JAX_FP4_ADD_CUDA_(target, symbol) \
  add_target(regs, target, "CUDA", reinterpret_cast<void*>(&symbol));
  JAX_FP4_CUDA_HANDLERS(JAX_FP4_ADD_CUDA_)
#undef JAX_FP4_ADD_CUDA_
#endif
  return regs;
}

nb::dict build_info() {
  nb::dict info;
  info["version"] = JAX_FP4_VERSION;
#ifdef JAX_FP4_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_archs"] = JAX_FP4_CUDA_ARCHS;
  info["cuda_compiler"] = JAX_FP4_CUDA_COMPILER;
  info["compiler"] = JAX_FP4_CXX_COMPILER;
  info["build_type"] = JAX_FP4_BUILD_TYPE;
  const std::string api = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["xla_ffi_api"] = nb::str(api.c_str());
  return info;
}

// The float value of every element code of format FMT, as the kernels decode it.
template <int FMT>
nb::list element_values() {
  nb::list values;
  for (uint32_t c = 0; c < (1u << jf4::elem_bits(FMT)); ++c) {
    if constexpr (jf4::is_codebook(FMT)) {
      values.append(jf4::Codebook<FMT>::value(c));
    } else if constexpr (FMT == jf4::kINT4) {
      values.append(static_cast<float>(c));
    } else if constexpr (FMT == jf4::kNVFP4) {
      values.append(jf4::e2m1_decode(c));
    } else {
      values.append(jf4::MxElem<FMT>::decode(c));
    }
  }
  return values;
}

template <int FMT>
void add_format(nb::list& table, const char* name) {
  nb::dict f;
  f["fid"] = FMT;
  f["name"] = name;
  f["bits"] = jf4::elem_bits(FMT);
  f["mx"] = jf4::is_mx(FMT);
  f["codebook"] = jf4::is_codebook(FMT);
  f["values"] = element_values<FMT>();
  table.append(f);
}

nb::list format_table() {
  nb::list table;
  add_format<jf4::kNVFP4>(table, "nvfp4");
  add_format<jf4::kMXFP4>(table, "mxfp4");
  add_format<jf4::kMXFP6_E2M3>(table, "mxfp6_e2m3");
  add_format<jf4::kMXFP6_E3M2>(table, "mxfp6_e3m2");
  add_format<jf4::kMXFP8_E4M3>(table, "mxfp8_e4m3");
  add_format<jf4::kMXFP8_E5M2>(table, "mxfp8_e5m2");
  add_format<jf4::kNF4>(table, "nf4");
  add_format<jf4::kBNB_FP4>(table, "bnb_fp4");
  add_format<jf4::kINT4>(table, "int4");
  static_assert(jf4::kNumFmts == 9, "format_table: list every format of codecs.h");
  return table;
}

#ifdef JAX_FP4_WITH_CUDA
// 0: some pair of the GPUs has no peer access (the caller keeps XLA's all-reduce).
int64_t all_reduce_setup(const std::vector<std::vector<int>>& groups, int64_t max_elements) {
  std::string error;
  const int64_t id = jf4::cuda::AllReduceSetup(groups, max_elements, &error);
  if (!error.empty()) throw std::runtime_error(error);
  return id;
}
#endif

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax-fp4 compiled XLA FFI handlers (see csrc/README.md)";
  m.def("registrations", &registrations,
        "{target_name: {platform: PyCapsule(XLA_FFI_Handler*)}} for every built handler.");
  m.def("build_info", &build_info, "Build configuration of the extension.");
  m.def("format_table", &format_table,
        "The format ids, element bits, families and element code values of codecs.h.");
#ifdef JAX_FP4_WITH_CUDA
  m.def("all_reduce_setup", &all_reduce_setup, nb::arg("groups"), nb::arg("max_elements"),
        "Buffers of one in-graph all-reduce call site on every GPU of `groups` (CUDA device "
        "ordinals, each group in rank order): its channel id, or 0 without peer access.");
#endif
}
