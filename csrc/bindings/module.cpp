#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "common/cpu_features.h"

#ifndef ROUNDPIPE_CUDA_VERSION
#define ROUNDPIPE_CUDA_VERSION ""
#endif
#ifndef ROUNDPIPE_SIMD_COMPILED
#define ROUNDPIPE_SIMD_COMPILED "scalar"
#endif

namespace py = pybind11;

namespace {

// What this binary was built with; roundpipe/__init__.py compares torch_version with the running
// torch and refuses to load a build made for another one.
py::dict build_info() {
  py::dict info;
  info["version"] = ROUNDPIPE_VERSION;
  info["torch_version"] = ROUNDPIPE_TORCH_VERSION;
#ifdef ROUNDPIPE_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
  info["cuda_version"] = ROUNDPIPE_CUDA_VERSION;
  info["compiler"] = ROUNDPIPE_COMPILER;
  info["cxx_standard"] = __cplusplus;
  info["simd_compiled"] = ROUNDPIPE_SIMD_COMPILED;
  info["simd_detected"] =
      std::string(roundpipe::simd_level_name(roundpipe::detect_cpu_simd_level()));
  info["simd_active"] = std::string(roundpipe::simd_level_name(roundpipe::active_simd_level()));
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "RoundPipe native core (see roundpipe/_C.pyi for the typed surface).";
  m.def("build_info", &build_info,
        "Package version, torch version built against, CUDA on/off, compiler and SIMD levels.");
  roundpipe::bindings::bind_devices(m);
  roundpipe::bindings::bind_runtime(m);
  roundpipe::bindings::bind_scheduler(m);
  roundpipe::bindings::bind_optim(m);
  roundpipe::bindings::bind_gradients(m);
  roundpipe::bindings::bind_call(m);
}
