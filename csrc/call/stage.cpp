// A stage's buffers on its device, from upload to gradient download: the native side of
// roundpipe/stage.py (ResidentStage). Each piece in Python would cost more than the work behind it:
// the upload from the arena with the parameter and gradient views, the binding of the copies in
// place of the layers' parameters and back, the check for copies changed in place, which trained
// copies a backward reached (GradReach), and the gradients' download into the arena.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "gradients/gradients.h"
#include "executor/copy_engine.h"
#include "executor/event.h"
#include "memory/host_arena.h"
#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

// Which of a stage's trained parameter copies received a gradient. A parameter that no backward
// reaches (an expert no token was routed to, a head the loss ignores) keeps .grad None in plain
// PyTorch, and optimizers skip it; the stage's gradient buffer cannot tell such a parameter from
// one whose gradient is zero, so each copy's AccumulateGrad node, made here and held for the
// stage's lifetime (every microbatch's graph then uses the same one), flags its copy when it runs.
class GradReach {
 public:
  explicit GradReach(const std::vector<at::Tensor>& tensors) : reached_(tensors.size(), 0) {
    accumulators_.reserve(tensors.size());
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      std::shared_ptr<void> accumulator =
          torch_internals::flag_accumulation(tensors[i], &reached_[i]);
      if (accumulator) accumulators_.push_back(std::move(accumulator));
    }
  }

  // Indices into the tensors of those an AccumulateGrad ran for.
  std::vector<std::int64_t> reached() const {
    std::vector<std::int64_t> indices;
    for (std::size_t i = 0; i < reached_.size(); ++i) {
      if (reached_[i] != 0) indices.push_back(static_cast<std::int64_t>(i));
    }
    return indices;
  }

 private:
  // Written by the thread that runs the backward passes (the caller's, or the engine's), read
  // once they are done.
  std::vector<std::uint8_t> reached_;
  std::vector<std::shared_ptr<void>> accumulators_;
};

// Below this size a virtual CPU device's stage buffer comes from the C heap: a mapping of its own
// would cost two system calls and a page fault per page for memory the heap reuses at once.
constexpr std::int64_t kOwnArenaBytes = std::int64_t{1} << 20;

// A stage's flat uint8 buffer of `bytes` bytes on `device`. A virtual CPU device's is host memory,
// from kOwnArenaBytes up an arena of its own, returned to the operating system when the stage is
// done (the C heap would keep a freed buffer of this size resident).
at::Tensor stage_buffer(std::int64_t bytes, c10::Device device, bool zero) {
  TORCH_CHECK(bytes >= 0, "stage_buffer: bytes must be >= 0, got ", bytes);
  if (device.is_cpu() && bytes >= kOwnArenaBytes) {
    return memory::allocate_host_arena(bytes, memory::PinMode::kOff, zero);
  }
  const auto options = at::TensorOptions().dtype(at::kByte).device(device);
  if (!zero || !device.is_cpu()) {
    return zero ? at::zeros({bytes}, options) : at::empty({bytes}, options);
  }
  at::Tensor buffer = at::empty({bytes}, options);
  std::memset(buffer.data_ptr(), 0, static_cast<std::size_t>(bytes));  // zero_() dispatches
  return buffer;
}

// What roundpipe.stage.ResidentStage makes of a stage, in one call (per stage, each piece in
// Python costs more than the work behind it):
//   - the parameter buffer, bytes [param_begin, param_end) of the parameter arena's layout; with
//     the `arena` given, its byte `runs` copied in on device `device_index`'s parameter lane once
//     `fence` completed (`uploaded`: the last copy's event, which covers them all; a recorded
//     event when there are none). Without it (parameters in storages of their own) the caller
//     copies them in and `uploaded` is None;
//   - the views of `params` in it at byte `offsets` (typed_views, requiring grad as they do);
//   - with `with_grads`, the gradient buffer of bytes [grad_begin, grad_end), whose views at
//     `grad_offsets` become the .grad of the views of params[trained]: zeroed, or with
//     `grad_arena` given, a copy of those bytes of it, made on the parameter lane after the
//     parameters' (the gradients that earlier calls accumulated: the stage's layers add theirs
//     to them one microbatch after the other, as plain PyTorch adds each backward's into .grad;
//     `uploaded` then covers the copy too). On CUDA the pageable arena is copied through the
//     engine's page-locked bounce buffers. The GradReach of those views tells which of them a
//     backward reached.
// Returns (buffer, uploaded, views, grad buffer or None, GradReach or None).
py::tuple upload_stage(int device_index, c10::Device device, const std::optional<at::Tensor>& arena,
                       std::int64_t param_begin, std::int64_t param_end,
                       const std::vector<std::pair<std::int64_t, std::int64_t>>& runs,
                       const executor::EventPtr& fence, const std::vector<std::int64_t>& offsets,
                       const std::vector<at::Tensor>& params, bool with_grads,
                       std::int64_t grad_begin, std::int64_t grad_end,
                       const std::vector<std::int64_t>& grad_offsets,
                       const std::vector<std::int64_t>& trained,
                       const std::optional<at::Tensor>& grad_arena) {
  TORCH_CHECK(
      0 <= param_begin && param_begin <= param_end && (!arena || param_end <= arena->numel()),
      "upload_stage: bytes [", param_begin, ", ", param_end, ") are not within the arena of ",
      arena ? arena->numel() : 0, " bytes");
  TORCH_CHECK(arena || runs.empty(), "upload_stage: runs to copy need the arena they are in");
  TORCH_CHECK(grad_begin <= grad_end, "upload_stage: grad_begin ", grad_begin, " is past grad_end ",
              grad_end);
  TORCH_CHECK(grad_offsets.size() == trained.size(), "upload_stage: got ", grad_offsets.size(),
              " gradient offsets for ", trained.size(), " trained parameters");
  for (const auto& [begin, end] : runs) {
    TORCH_CHECK(param_begin <= begin && begin <= end && end <= param_end, "upload_stage: run [",
                begin, ", ", end, ") is not within the stage's bytes [", param_begin, ", ",
                param_end, ")");
  }
  TORCH_CHECK(!grad_arena || (with_grads && 0 <= grad_begin && grad_end <= grad_arena->numel()),
              "upload_stage: gradient bytes [", grad_begin, ", ", grad_end,
              ") to copy need with_grads and must be within the gradient arena of ",
              grad_arena ? grad_arena->numel() : 0, " bytes");
  at::Tensor buffer = stage_buffer(param_end - param_begin, device, /*zero=*/false);
  executor::EventPtr uploaded;
  if (arena) {
    py::gil_scoped_release no_gil;
    executor::CopyEngine& engine = executor::copy_engine(device_index);
    for (const auto& [begin, end] : runs) {
      uploaded = engine.copy(buffer.slice(0, begin - param_begin, end - param_begin),
                             arena->slice(0, begin, end), executor::Lane::kParameter, fence);
    }
    if (!uploaded) uploaded = executor::record_event(device_index);
  }
  std::vector<at::Tensor> views =
      cut_typed(buffer, param_begin, offsets, params, Cut::kOwnLikeGrad);
  py::object grad_buffer = py::none();
  py::object reach = py::none();
  if (with_grads) {
    at::Tensor grads = stage_buffer(grad_end - grad_begin, device, /*zero=*/!grad_arena);
    std::vector<at::Tensor> likes;
    std::vector<at::Tensor> targets;
    likes.reserve(trained.size());
    targets.reserve(trained.size());
    for (const std::int64_t i : trained) {
      TORCH_CHECK(0 <= i && i < static_cast<std::int64_t>(views.size()),
                  "upload_stage: trained index ", i, " is not one of the ", views.size(),
                  " parameters");
      likes.push_back(params[static_cast<std::size_t>(i)]);
      targets.push_back(views[static_cast<std::size_t>(i)]);
    }
    set_grads(targets, cut_typed(grads, grad_begin, grad_offsets, likes, Cut::kOwn));
    reach = py::cast(std::make_shared<GradReach>(targets));
    if (grad_arena && grads.numel() > 0) {
      const at::Tensor source = grad_arena->slice(0, grad_begin, grad_end);
      py::gil_scoped_release no_gil;
      executor::CopyEngine& engine = executor::copy_engine(device_index);
      executor::EventPtr copied =
          grads.is_cuda() ? engine.upload_pageable({grads}, {source}, nullptr)
                          : engine.copy(grads, source, executor::Lane::kParameter, nullptr);
      // Without the parameter arena the caller's copies come after this one on the same lane,
      // and their event covers it.
      if (arena) uploaded = std::move(copied);
    }
    grad_buffer = py::cast(grads);
  }
  return py::make_tuple(buffer, uploaded, views, grad_buffer, reach);
}

// owner._parameters[name] = tensor for each (owner, name, tensor) of `owners`, `names` and
// `tensors`: what roundpipe.stage.ResidentStage.bound does to put a stage's device copies in
// place of its layers' parameters and back (a Python loop costs more than the stores). Returns what
// each entry held before, in order, for the binding back. On an error (a module without that
// parameter: KeyError; one whose _parameters is no mapping: TypeError) the entries already
// replaced are put back first.
py::list rebind_parameters(const py::sequence& owners, const py::sequence& names,
                           const py::sequence& tensors) {
  const std::size_t size = owners.size();
  TORCH_CHECK(names.size() == size && tensors.size() == size, "rebind_parameters: got ", size,
              " owners, ", names.size(), " names and ", tensors.size(),
              " tensors; pass one of each per binding");
  static const py::str key("_parameters");
  std::vector<py::object> dicts;
  std::vector<py::object> before;
  dicts.reserve(size);
  before.reserve(size);
  try {
    for (std::size_t i = 0; i < size; ++i) {
      const py::object owner = owners[i];
      py::object parameters = owner.attr(key);
      if (!PyMapping_Check(parameters.ptr())) {
        throw py::type_error(std::string("rebind_parameters: ") + Py_TYPE(owner.ptr())->tp_name +
                             "._parameters is no mapping");
      }
      const py::object name = names[i];
      py::object held = parameters[name];
      parameters[name] = tensors[i];
      dicts.push_back(std::move(parameters));
      before.push_back(std::move(held));
    }
  } catch (...) {
    const py::error_scope pending;  // the error stays aside while the bindings go back
    for (std::size_t i = 0; i < before.size(); ++i) {
      if (PyObject_SetItem(dicts[i].ptr(), py::object(names[i]).ptr(), before[i].ptr()) != 0) {
        PyErr_Clear();
      }
    }
    throw;
  }
  py::list result(size);
  for (std::size_t i = 0; i < size; ++i) result[i] = std::move(before[i]);
  return result;
}

// Indices of the `tensors` whose version counter moved off 0: changed in place since they were
// made (roundpipe.stage.ResidentStage checks a stage's parameter copies with it).
std::vector<std::int64_t> changed_in_place(const std::vector<at::Tensor>& tensors) {
  std::vector<std::int64_t> changed;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i]._version() != 0) changed.push_back(static_cast<std::int64_t>(i));
  }
  return changed;
}

// What roundpipe.stage.ResidentStage.download_grads issues: for each byte run
// (begin, end, dtype) of the gradient arena `arena`, the stage's gradients at those bytes of its
// buffer `grads` (which starts at arena byte `first_byte`) accumulated into the arena, as `dtype`
// (or with `replace`, copied over what is there: the buffer started from it), on device
// `device_index`'s copy engine once the work issued to the device so far completed; through the
// same bytes of `staging` when given (CUDA). Returns the events, one per run.
std::vector<executor::EventPtr> download_grads(
    int device_index, const at::Tensor& arena, const at::Tensor& grads, std::int64_t first_byte,
    const std::vector<std::tuple<std::int64_t, std::int64_t, at::ScalarType>>& runs,
    const std::optional<at::Tensor>& staging, bool replace) {
  for (const auto& [begin, end, dtype] : runs) {
    TORCH_CHECK(0 <= first_byte && first_byte <= begin && begin <= end &&
                    end - first_byte <= grads.numel() && end <= arena.numel(),
                "download_grads: run [", begin, ", ", end, ") is not within the stage's bytes [",
                first_byte, ", ", first_byte + grads.numel(), ") of the arena of ", arena.numel(),
                " bytes");
  }
  std::vector<executor::EventPtr> events;
  events.reserve(runs.size());
  py::gil_scoped_release no_gil;
  executor::CopyEngine& engine = executor::copy_engine(device_index);
  const executor::EventPtr after = executor::record_event(device_index);
  for (const auto& [begin, end, dtype] : runs) {
    std::optional<at::Tensor> through;
    if (staging) through = staging->slice(0, begin, end).view(dtype);
    const at::Tensor dst = arena.slice(0, begin, end).view(dtype);
    const at::Tensor src = grads.slice(0, begin - first_byte, end - first_byte).view(dtype);
    events.push_back(replace ? engine.download(dst, src, after, through)
                             : engine.accumulate(dst, src, after, through));
  }
  return events;
}

}  // namespace

void bind_stage_io(py::module_& m) {
  py::class_<GradReach, std::shared_ptr<GradReach>>(
      m, "GradReach", "Flags which of `tensors` (leaves) an AccumulateGrad node ran for.")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("tensors"))
      .def("reached", &GradReach::reached,
           "Indices of the tensors that received a gradient since construction.");
  m.def("upload_stage", &upload_stage, py::arg("device_index"), py::arg("device"), py::arg("arena"),
        py::arg("param_begin"), py::arg("param_end"), py::arg("runs"), py::arg("fence"),
        py::arg("offsets"), py::arg("params"), py::arg("with_grads"), py::arg("grad_begin"),
        py::arg("grad_end"), py::arg("grad_offsets"), py::arg("trained"),
        py::arg("grad_arena") = py::none(),
        "A stage's buffers, filled from the parameter arena when given: (buffer, uploaded event "
        "or None, parameter views, gradient buffer or None, GradReach of the trained views or "
        "None); the gradient views become the trained views' .grad, and start from grad_arena's "
        "bytes when given (else zero).");
  m.def("rebind_parameters", &rebind_parameters, py::arg("owners"), py::arg("names"),
        py::arg("tensors"),
        "owner._parameters[name] = tensor per binding; returns what each held before (on an "
        "error the entries already replaced are put back).");
  m.def("changed_in_place", &changed_in_place, py::arg("tensors"),
        "Indices of the tensors whose version counter is no longer 0.");
  m.def("download_grads", &download_grads, py::arg("device_index"), py::arg("arena"),
        py::arg("grads"), py::arg("first_byte"), py::arg("runs"), py::arg("staging"),
        py::arg("replace") = false,
        "Accumulate a stage's gradient buffer into the gradient arena (with replace: copy it "
        "over), one (begin, end, dtype) byte run at a time on the device's copy engine; returns "
        "the events.");
}

}  // namespace roundpipe::bindings
