// nanobind module jax_fp4._native: hands the FFI handler symbols to Python.
//   registrations() -> {target_name: {platform: capsule}}   (platform "cpu" / "CUDA")
//   build_info()    -> {"version", "cuda", "cuda_archs", "compiler", ...}
// jax_fp4/_ext.py registers the capsules with jax.ffi.register_ffi_target.
#include <nanobind/nanobind.h>

#include <string>

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

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jax-fp4 compiled XLA FFI handlers (see csrc/README.md)";
  m.def("registrations", &registrations,
        "{target_name: {platform: PyCapsule(XLA_FFI_Handler*)}} for every built handler.");
  m.def("build_info", &build_info, "Build configuration of the extension.");
}
