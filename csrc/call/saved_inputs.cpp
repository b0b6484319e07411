#include "call/saved_inputs.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <optional>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace roundpipe::bindings {

void bind_call_state(py::module_& m) {
  py::class_<RngStates, std::shared_ptr<RngStates>>(
      m, "RngStates",
      "The CPU generator states a call's forward layers were seeded with, kept for their "
      "recompute (at most 4096).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def_property_readonly("kept", &RngStates::kept, "How many states are kept.");
  py::class_<KeptInputs, std::shared_ptr<KeptInputs>>(
      m, "KeptInputs",
      "The lone-tensor layer inputs a call's forward stages keep for its recompute, per (layer, "
      "microbatch).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def(
          "find",
          [](const KeptInputs& kept, std::int64_t layer,
             std::int64_t microbatch) -> std::optional<at::Tensor> {
            const at::Tensor& input = kept.find(layer, microbatch);
            if (!input.defined()) return std::nullopt;
            return input;
          },
          py::arg("layer"), py::arg("microbatch"),
          "The input kept for (layer, microbatch), or None.")
      .def("covers", &KeptInputs::covers, py::arg("first"), py::arg("stop"),
           py::arg("microbatches"), py::arg("per_layer"),
           "Whether the inputs of layers [first, stop)'s segments (the first layer's, or with "
           "per_layer each layer's) are kept for each of `microbatches`.");
}

}  // namespace roundpipe::bindings
