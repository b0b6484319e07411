// What one pipelined call keeps from its forward stages for the recompute of its backward stages,
// per (layer, microbatch): the CPU generator states its layers were seeded with (RngStates) and
// their lone-tensor inputs on virtual CPU devices (KeptInputs): the native side of
// roundpipe/call/saved_inputs.py. Made per call by the pipeline (roundpipe/call/pipeline.py),
// filled and read by the layer loop (layer_loop.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "torch_internals/torch_internals.h"

namespace roundpipe::call {

// One T per (layer, microbatch) of a call, default-constructed until set (RngStates,
// KeptInputs).
template <class T>
class CallSlots {
 public:
  CallSlots(const char* owner, std::int64_t layers, std::int64_t microbatches)
      : layers_(layers), microbatches_(microbatches), slots_(count(owner, layers, microbatches)) {}

  // layers x microbatches, checked before anything is allocated.
  static std::size_t count(const char* owner, std::int64_t layers, std::int64_t microbatches) {
    TORCH_CHECK(layers >= 0 && microbatches >= 0, owner, ": layers (", layers,
                ") and microbatches (", microbatches, ") must be >= 0");
    TORCH_CHECK(microbatches == 0 || layers <= kMaxSlots / microbatches, owner, ": layers (",
                layers, ") x microbatches (", microbatches, ") is over ", kMaxSlots,
                " (layer, microbatch) slots");
    return static_cast<std::size_t>(layers * microbatches);
  }
  static constexpr std::int64_t kMaxSlots = std::int64_t{1} << 32;

  // The slot of (layer, microbatch), or null when the call has none.
  T* find(std::int64_t layer, std::int64_t microbatch) {
    if (layer < 0 || layer >= layers_ || microbatch < 0 || microbatch >= microbatches_) {
      return nullptr;
    }
    return &slots_[static_cast<std::size_t>(layer * microbatches_ + microbatch)];
  }
  const T* find(std::int64_t layer, std::int64_t microbatch) const {
    return const_cast<CallSlots*>(this)->find(layer, microbatch);
  }

 private:
  std::int64_t layers_;
  std::int64_t microbatches_;
  std::vector<T> slots_;
};

// The CPU generator states of one call's forward layers, kept for their recompute: seeding the
// CPU generator (a Mersenne Twister) computes its 624 words one after another, paid again in
// recompute for the same (layer, microbatch), where a copy of the state the forward started from
// is one block copy. At most kMaxStates (10 MB) are kept, in
// one block reserved up front (a state is 2.5 KB, past the C heap's per-thread caches: one
// allocation each would go through its slow path every time). A recompute whose state was not
// kept reseeds, which gives the same state.
class RngStates {
 public:
  static constexpr std::size_t kMaxStates = 4096;

  RngStates(std::int64_t layers, std::int64_t microbatches)
      : slots_("RngStates", layers, microbatches) {
    states_.reserve(std::min<std::size_t>(
        kMaxStates, static_cast<std::size_t>(layers) * static_cast<std::size_t>(microbatches)));
  }

  // Keeps `state` for (layer, microbatch), unless the call has no such slot or kMaxStates are
  // kept already.
  void keep(std::int64_t layer, std::int64_t microbatch, const torch_internals::CpuRngState& state);
  // The state kept for (layer, microbatch), or null.
  const torch_internals::CpuRngState* find(std::int64_t layer, std::int64_t microbatch) const {
    const std::uint32_t* slot = slots_.find(layer, microbatch);
    return slot != nullptr && *slot != 0 ? &states_[*slot - 1] : nullptr;
  }
  std::size_t kept() const { return states_.size(); }

 private:
  CallSlots<std::uint32_t> slots_;  // 1 + the state's index in states_; 0: none kept
  std::vector<torch_internals::CpuRngState> states_;
};

// The layer inputs one call's forward stages keep for the recompute of its backward stages, where
// each is a lone tensor on a virtual CPU device (the call keeps the others in Python): a
// private copy per (layer, microbatch), held here rather than as a Python tensor in a dict. With
// layer grain that is one input per layer x microbatch living from the forward to the backward:
// as Python objects they outlived the garbage collector's young generations, each of which
// walks its survivors again, and were promoted to the oldest, whose full collections walk every
// object of the process.
class KeptInputs {
 public:
  KeptInputs(std::int64_t layers, std::int64_t microbatches)
      : inputs_("KeptInputs", layers, microbatches) {}

  // Keeps `input` for (layer, microbatch); IndexError when the call has no such slot.
  void keep(std::int64_t layer, std::int64_t microbatch, at::Tensor input);
  // The input kept for (layer, microbatch); undefined when none is.
  const at::Tensor& find(std::int64_t layer, std::int64_t microbatch) const {
    static const at::Tensor none;
    const at::Tensor* slot = inputs_.find(layer, microbatch);
    return slot != nullptr ? *slot : none;
  }
  // Whether, for each of `microbatches`, the inputs of the segments of layers [first, stop) are
  // kept: layer first's, or with `per_layer` each layer's.
  bool covers(std::int64_t first, std::int64_t stop, const std::vector<std::int64_t>& microbatches,
              bool per_layer) const;

 private:
  CallSlots<at::Tensor> inputs_;
};

}  // namespace roundpipe::call
