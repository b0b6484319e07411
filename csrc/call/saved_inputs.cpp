#include "call/saved_inputs.h"

#include <pybind11/pybind11.h>

#include <string>
#include <utility>

namespace roundpipe::call {

void RngStates::keep(std::int64_t layer, std::int64_t microbatch,
                     const torch_internals::CpuRngState& state) {
  std::uint32_t* slot = slots_.find(layer, microbatch);
  if (slot == nullptr) return;
  if (*slot != 0) {
    states_[*slot - 1] = state;
    return;
  }
  if (states_.size() >= kMaxStates) return;
  states_.push_back(state);
  *slot = static_cast<std::uint32_t>(states_.size());
}

void KeptInputs::keep(std::int64_t layer, std::int64_t microbatch, at::Tensor input) {
  at::Tensor* slot = inputs_.find(layer, microbatch);
  if (slot == nullptr) {
    throw pybind11::index_error("KeptInputs: the call has no layer " + std::to_string(layer) +
                                " x microbatch " + std::to_string(microbatch));
  }
  *slot = std::move(input);
}

bool KeptInputs::covers(std::int64_t first, std::int64_t stop,
                        const std::vector<std::int64_t>& microbatches, bool per_layer) const {
  const std::int64_t last = per_layer ? stop : std::min(first + 1, stop);
  for (const std::int64_t microbatch : microbatches) {
    for (std::int64_t layer = first; layer < last; ++layer) {
      if (!find(layer, microbatch).defined()) return false;
    }
  }
  return first < stop;
}

}  // namespace roundpipe::call
