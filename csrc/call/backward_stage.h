// torch.autograd.backward for the pipeline's Python path (pytrees, traced or NVTX-marked calls):
// the native side of roundpipe/call/backward_stage.py. The local backward it runs where it can
// lives in the door to torch's internals (torch_internals/torch_internals.h), as do its switch
// and counters.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace roundpipe::call {

// torch.autograd.backward(outputs, grads) without its Python entry (argument normalisation and
// shape checks in Python, a large part of a small backward's host time): run_backward, which runs
// the pass on the calling thread where torch's engine would change nothing and hands any other
// graph to the engine; gradients accumulated into the leaves, the graph freed. A shape mismatch is
// still refused, by the engine's own check of the root gradients. Called with the GIL, which it
// releases for the pass; errors are raised as torch.autograd.backward raises them.
void backward(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads);

}  // namespace roundpipe::call
