// roundpipe._C's gradient part (csrc/gradients/): typed views of flat buffers and their .grad.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

#include "bindings/bindings.h"
#include "gradients/gradients.h"

namespace py = pybind11;

namespace roundpipe::bindings {

void bind_gradients(py::module_& m) {
  m.def(
      "typed_views",
      [](const at::Tensor& buffer, std::int64_t first_byte,
         const std::vector<std::int64_t>& offsets, const std::vector<at::Tensor>& likes,
         bool like_requires_grad) {
        return gradients::cut_typed(
            buffer, first_byte, offsets, likes,
            like_requires_grad ? gradients::Cut::kOwnLikeGrad : gradients::Cut::kView);
      },
      py::arg("buffer"), py::arg("first_byte"), py::arg("offsets"), py::arg("likes"),
      py::arg("like_requires_grad") = false,
      "Views of the uint8 buffer at byte offsets[i] - first_byte, laid out like likes[i] "
      "(contiguous); with like_requires_grad, requiring grad as likes[i] does.");
  m.def("set_grads", &gradients::set_grads, py::arg("tensors"), py::arg("grads"),
        "tensors[i].grad = grads[i] (same shape, dtype and device).");
}

}  // namespace roundpipe::bindings
