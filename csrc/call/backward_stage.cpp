#include "call/backward_stage.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::call {

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

}  // namespace roundpipe::call
