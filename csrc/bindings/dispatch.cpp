// Bindings of the pipeline's per-stage work that Python would pay for per layer x microbatch or per
// parameter: the backward of a recomputed stage and the typed views of a stage's buffers.
//
// At short sequences a device finishes a layer in about a millisecond, so the host's Python work
// around each layer caps throughput (benchmarks/overhead_cpu.py, the dispatch table). These two
// calls replace a Python entry point that costs more than the native work behind it.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <map>
#include <vector>

#include "bindings/bindings.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

// torch.autograd.backward(outputs, grads) without its Python entry (argument normalisation and
// shape checks in Python, about 40% of a small backward's host time): the same engine run
// (torch's PythonEngine, so Python hooks and custom Functions behave as under
// torch.autograd.backward), gradients accumulated into the leaves, the graph freed. A shape
// mismatch is still refused, by the engine's own check of the root gradients.
void backward(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(outputs.size() == grads.size(), "backward: got ", outputs.size(), " outputs but ",
              grads.size(), " gradients; pass one gradient per output");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].defined() && grads[i].defined(),
                "backward: outputs and gradients must be tensors, got None at index ", i);
  }
  // The engine refuses to run with the GIL held (its worker threads take it for Python nodes).
  py::gil_scoped_release no_gil;
  torch::autograd::backward(outputs, grads);
  END_HANDLE_TH_ERRORS_PYBIND
}

// Views of the uint8 `buffer` laid out like `likes[i]` (dtype, shape, strides), at byte
// offsets[i] - first_byte: what roundpipe.memory.typed_view makes one at a time, cut with
// as_strided from one view of the buffer per dtype. With `like_requires_grad` every view
// requires grad exactly when its `like` does (a stage's parameter copies).
std::vector<at::Tensor> typed_views(const at::Tensor& buffer, std::int64_t first_byte,
                                    const std::vector<std::int64_t>& offsets,
                                    const std::vector<at::Tensor>& likes, bool like_requires_grad) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "typed_views: buffer must be a contiguous 1-D uint8 tensor, got ",
              buffer.scalar_type(), " with ", buffer.dim(), " dimensions");
  TORCH_CHECK(offsets.size() == likes.size(), "typed_views: got ", offsets.size(), " offsets but ",
              likes.size(), " likes; pass one offset per tensor");
  std::map<at::ScalarType, at::Tensor> typed;
  std::vector<at::Tensor> views;
  views.reserve(likes.size());
  for (std::size_t i = 0; i < likes.size(); ++i) {
    const at::Tensor& like = likes[i];
    TORCH_CHECK(like.is_contiguous(), "typed_views: likes[", i, "] must be contiguous");
    const std::int64_t size = static_cast<std::int64_t>(like.element_size());
    const std::int64_t start = offsets[i] - first_byte;
    TORCH_CHECK(start >= 0 && start % size == 0 && start + like.numel() * size <= buffer.numel(),
                "typed_views: offsets[", i, "] = ", offsets[i], " (", like.numel(), " x ", size,
                " bytes) does not lie aligned inside the buffer of ", buffer.numel(),
                " bytes starting at byte ", first_byte);
    auto base = typed.find(like.scalar_type());
    if (base == typed.end()) {
      const std::int64_t whole = buffer.numel() / size * size;
      base = typed.emplace(like.scalar_type(), buffer.slice(0, 0, whole).view(like.scalar_type()))
                 .first;
    }
    at::Tensor view = base->second.as_strided(like.sizes(), like.strides(), start / size);
    if (like_requires_grad && like.requires_grad()) view.set_requires_grad(true);
    views.push_back(std::move(view));
  }
  return views;
}

}  // namespace

void bind_dispatch(py::module_& m) {
  m.def("backward", &backward, py::arg("outputs"), py::arg("grads"),
        "torch.autograd.backward(outputs, grads) through the engine directly, without the GIL: "
        "one defined gradient per output; errors are raised as torch.autograd.backward raises "
        "them.");
  m.def("typed_views", &typed_views, py::arg("buffer"), py::arg("first_byte"), py::arg("offsets"),
        py::arg("likes"), py::arg("like_requires_grad") = false,
        "Views of the uint8 buffer at byte offsets[i] - first_byte, laid out like likes[i] "
        "(contiguous); with like_requires_grad, requiring grad as likes[i] does.");
}

}  // namespace roundpipe::bindings
