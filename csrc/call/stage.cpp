#include "call/stage.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "executor/copy_engine.h"
#include "executor/event.h"
#include "gradients/gradients.h"
#include "memory/host_arena.h"
#include "torch_internals/modules.h"
#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::call {
namespace {

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

}  // namespace

GradReach::GradReach(const std::vector<at::Tensor>& tensors) : reached_(tensors.size(), 0) {
  accumulators_.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    std::shared_ptr<void> accumulator =
        torch_internals::flag_accumulation(tensors[i], &reached_[i]);
    if (accumulator) accumulators_.push_back(std::move(accumulator));
  }
}

std::vector<std::int64_t> GradReach::reached() const {
  std::vector<std::int64_t> indices;
  for (std::size_t i = 0; i < reached_.size(); ++i) {
    if (reached_[i] != 0) indices.push_back(static_cast<std::int64_t>(i));
  }
  return indices;
}

StageBuffers upload_stage(int device_index, c10::Device device,
                          const std::optional<at::Tensor>& arena, std::int64_t param_begin,
                          std::int64_t param_end,
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
      gradients::cut_typed(buffer, param_begin, offsets, params, gradients::Cut::kOwnLikeGrad);
  std::optional<at::Tensor> grad_buffer;
  std::shared_ptr<GradReach> reach;
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
    gradients::set_grads(targets, gradients::cut_typed(grads, grad_begin, grad_offsets, likes,
                                                       gradients::Cut::kOwn));
    reach = std::make_shared<GradReach>(targets);
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
    grad_buffer = std::move(grads);
  }
  return {std::move(buffer), std::move(uploaded), std::move(views), std::move(grad_buffer),
          std::move(reach)};
}

py::list rebind_parameters(const py::sequence& owners, const py::sequence& names,
                           const py::sequence& tensors) {
  const std::size_t size = owners.size();
  TORCH_CHECK(names.size() == size && tensors.size() == size, "rebind_parameters: got ", size,
              " owners, ", names.size(), " names and ", tensors.size(),
              " tensors; pass one of each per binding");
  std::vector<py::object> dicts;
  std::vector<py::object> before;
  dicts.reserve(size);
  before.reserve(size);
  try {
    for (std::size_t i = 0; i < size; ++i) {
      const py::object owner = owners[i];
      py::object parameters = torch_internals::parameter_slots(owner);
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

std::vector<std::int64_t> changed_in_place(const std::vector<at::Tensor>& tensors) {
  std::vector<std::int64_t> changed;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i]._version() != 0) changed.push_back(static_cast<std::int64_t>(i));
  }
  return changed;
}

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

}  // namespace roundpipe::call
