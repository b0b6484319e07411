// torch.autograd.backward for the pipeline's Python path (pytrees, traced or NVTX-marked calls)
// and the local backward's switch and counters: the Python face of the local backward, which
// lives in the door to torch's internals (torch_internals/torch_internals.h).
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "bindings/bindings.h"
#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

// torch.autograd.backward(outputs, grads) without its Python entry (argument normalisation and
// shape checks in Python, a large part of a small backward's host time): run_backward, which runs
// the pass on the calling thread where torch's engine would change nothing and hands any other
// graph to the engine; gradients accumulated into the leaves, the graph freed. A shape mismatch is
// still refused, by the engine's own check of the root gradients.
void backward(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(outputs.size() == grads.size(), "backward: got ", outputs.size(), " outputs but ",
              grads.size(), " gradients; pass one gradient per output");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].defined() && grads[i].defined(),
                "backward: outputs and gradients must be tensors, got None at index ", i);
  }
  const torch_internals::BackwardScope scope;
  // The engine refuses to run with the GIL held (its worker threads take it for Python nodes).
  py::gil_scoped_release no_gil;
  torch_internals::run_backward(outputs, grads, scope);
  END_HANDLE_TH_ERRORS_PYBIND
}

}  // namespace

void bind_backward(py::module_& m) {
  torch_internals::init_local_backward();
  m.def("backward", &backward, py::arg("outputs"), py::arg("grads"),
        "torch.autograd.backward(outputs, grads) without the GIL, on the calling thread where "
        "torch's engine would change nothing (see run_backward), else through the engine: one "
        "defined gradient per output; errors are raised as torch.autograd.backward raises them.");
  m.def(
      "local_backward_enabled", &torch_internals::local_backward_enabled,
      "Whether backward passes of recomputed segments may run on the calling thread: a torch "
      "release they were checked on (2.11 to 2.13) with graph exec groups, and "
      "ROUNDPIPE_LOCAL_BACKWARD not 0 when roundpipe was imported; else torch's engine runs all.");
  m.def("backward_counts", &torch_internals::backward_counts,
        "(passes run on the calling thread, passes run by torch's engine) since the process "
        "started: every backward of a recomputed segment and every _C.backward counts once.");
}

}  // namespace roundpipe::bindings
