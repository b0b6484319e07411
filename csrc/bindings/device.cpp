#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "device/registry.h"
#ifdef ROUNDPIPE_WITH_CUDA
#include "device/cuda_devices.h"
#endif

namespace py = pybind11;

namespace roundpipe::bindings {

void bind_devices(py::module_& m) {
  using device::Registry;
#ifdef ROUNDPIPE_WITH_CUDA
  // Installing the provider only records function pointers; CUDA is first touched at a query.
  Registry::instance().set_cuda_provider(device::cuda_provider());
#endif
  m.def(
      "configure_devices",
      [](std::optional<std::string> kind, std::optional<int> num_cpu_devices,
         std::optional<int> num_cuda_devices) {
        std::optional<std::string_view> kind_view;
        if (kind) kind_view = *kind;
        Registry::instance().configure(kind_view, num_cpu_devices, num_cuda_devices);
      },
      py::arg("kind") = py::none(), py::arg("num_cpu_devices") = py::none(),
      py::arg("num_cuda_devices") = py::none());
  m.def("device_kind",
        [] { return std::string(device::device_kind_name(Registry::instance().kind())); });
  m.def("device_count", [] { return Registry::instance().count(); });
  m.def(
      "device_physical_index", [](int index) { return Registry::instance().physical_index(index); },
      py::arg("index"));
  m.def("cuda_logical_devices", [] { return Registry::instance().cuda_logical_devices(); });
  m.def(
      "device_total_memory", [](int index) { return Registry::instance().total_memory(index); },
      py::arg("index"));
}

}  // namespace roundpipe::bindings
