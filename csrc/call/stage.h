// A stage's buffers on its device, from upload to gradient download: the native side of
// roundpipe/call/stage.py (ResidentStage). Each piece in Python would cost more than the work
// behind it: the upload from the arena with the parameter and gradient views, the binding of the
// copies in place of the layers' parameters and back, the check for copies changed in place,
// which trained copies a backward reached (GradReach), and the gradients' download into the arena.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "executor/event.h"

namespace roundpipe::call {

// Which of a stage's trained parameter copies received a gradient. A parameter that no backward
// reaches (an expert no token was routed to, a head the loss ignores) keeps .grad None in plain
// PyTorch, and optimizers skip it; the stage's gradient buffer cannot tell such a parameter from
// one whose gradient is zero, so each copy's AccumulateGrad node, made here and held for the
// stage's lifetime (every microbatch's graph then uses the same one), flags its copy when it runs.
class GradReach {
 public:
  explicit GradReach(const std::vector<at::Tensor>& tensors);

  // Indices into the tensors of those an AccumulateGrad ran for.
  std::vector<std::int64_t> reached() const;

 private:
  // Written by the thread that runs the backward passes (the caller's, or the engine's), read
  // once they are done.
  std::vector<std::uint8_t> reached_;
  std::vector<std::shared_ptr<void>> accumulators_;
};

// What upload_stage makes of a stage.
struct StageBuffers {
  at::Tensor buffer;
  executor::EventPtr uploaded;  // null without the arena
  std::vector<at::Tensor> views;
  std::optional<at::Tensor> grads;   // without with_grads: none
  std::shared_ptr<GradReach> reach;  // without with_grads: null
};

// What roundpipe.call.stage.ResidentStage makes of a stage, in one call (per stage, each piece in
// Python costs more than the work behind it):
//   - the parameter buffer, bytes [param_begin, param_end) of the parameter arena's layout; with
//     the `arena` given, its byte `runs` copied in on device `device_index`'s parameter lane once
//     `fence` completed (`uploaded`: the last copy's event, which covers them all; a recorded
//     event when there are none). Without it (parameters in storages of their own) the caller
//     copies them in and `uploaded` is null;
//   - the views of `params` in it at byte `offsets` (gradients::cut_typed, requiring grad as they
//     do);
//   - with `with_grads`, the gradient buffer of bytes [grad_begin, grad_end), whose views at
//     `grad_offsets` become the .grad of the views of params[trained]: zeroed, or with
//     `grad_arena` given, a copy of those bytes of it, made on the parameter lane after the
//     parameters' (the gradients that earlier calls accumulated: the stage's layers add theirs
//     to them one microbatch after the other, as plain PyTorch adds each backward's into .grad;
//     `uploaded` then covers the copy too). On CUDA the pageable arena is copied through the
//     engine's page-locked bounce buffers. The GradReach of those views tells which of them a
//     backward reached.
// Called with the GIL, which it releases around the copies.
StageBuffers upload_stage(int device_index, c10::Device device,
                          const std::optional<at::Tensor>& arena, std::int64_t param_begin,
                          std::int64_t param_end,
                          const std::vector<std::pair<std::int64_t, std::int64_t>>& runs,
                          const executor::EventPtr& fence, const std::vector<std::int64_t>& offsets,
                          const std::vector<at::Tensor>& params, bool with_grads,
                          std::int64_t grad_begin, std::int64_t grad_end,
                          const std::vector<std::int64_t>& grad_offsets,
                          const std::vector<std::int64_t>& trained,
                          const std::optional<at::Tensor>& grad_arena);

// owner._parameters[name] = tensor for each (owner, name, tensor) of `owners`, `names` and
// `tensors`: what roundpipe.call.stage.ResidentStage.bound does to put a stage's device copies in
// place of its layers' parameters and back (a Python loop costs more than the stores). Returns
// what each entry held before, in order, for the binding back. On an error (a module without that
// parameter: KeyError; one whose parameters are no mapping: TypeError) the entries already
// replaced are put back first. Called with the GIL.
pybind11::list rebind_parameters(const pybind11::sequence& owners, const pybind11::sequence& names,
                                 const pybind11::sequence& tensors);

// Indices of the `tensors` whose version counter moved off 0: changed in place since they were
// made (roundpipe.call.stage.ResidentStage checks a stage's parameter copies with it).
std::vector<std::int64_t> changed_in_place(const std::vector<at::Tensor>& tensors);

// What roundpipe.call.stage.ResidentStage.download_grads issues: for each byte run
// (begin, end, dtype) of the gradient arena `arena`, the stage's gradients at those bytes of its
// buffer `grads` (which starts at arena byte `first_byte`) accumulated into the arena, as `dtype`
// (or with `replace`, copied over what is there: the buffer started from it), on device
// `device_index`'s copy engine once the work issued to the device so far completed; through the
// same bytes of `staging` when given (CUDA). Returns the events, one per run. Called with the
// GIL, which it releases.
std::vector<executor::EventPtr> download_grads(
    int device_index, const at::Tensor& arena, const at::Tensor& grads, std::int64_t first_byte,
    const std::vector<std::tuple<std::int64_t, std::int64_t, at::ScalarType>>& runs,
    const std::optional<at::Tensor>& staging, bool replace);

}  // namespace roundpipe::call
