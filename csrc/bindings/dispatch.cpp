// Bindings of the pipeline's per-stage work that Python would pay for per layer x microbatch or per
// parameter: the loop over a stage's layers, the backward of a recomputed stage and the typed views
// of a stage's buffers.
//
// At short sequences a device finishes a layer in about a millisecond, so the host's Python work
// around each layer caps throughput (benchmarks/overhead_cpu.py, the dispatch table). These calls
// replace a Python entry point that costs more than the native work behind it.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/Event.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/local_backward.h"
#include "bindings/module_call.h"
#include "executor/copy_engine.h"
#include "executor/event.h"
#include "memory/host_arena.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

// torch.autograd.backward(outputs, grads) without its Python entry (argument normalisation and
// shape checks in Python, a large part of a small backward's host time): run_backward, which runs
// the pass on the calling thread where torch's engine would change nothing and hands any other
// graph to the engine (torch's PythonEngine, so Python hooks and custom Functions behave as under
// torch.autograd.backward); gradients accumulated into the leaves, the graph freed. A shape
// mismatch is still refused, by the engine's own check of the root gradients.
void backward(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& grads) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(outputs.size() == grads.size(), "backward: got ", outputs.size(), " outputs but ",
              grads.size(), " gradients; pass one gradient per output");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    TORCH_CHECK(outputs[i].defined() && grads[i].defined(),
                "backward: outputs and gradients must be tensors, got None at index ", i);
  }
  const BackwardScope scope;
  // The engine refuses to run with the GIL held (its worker threads take it for Python nodes).
  py::gil_scoped_release no_gil;
  run_backward(outputs, grads, scope);
  END_HANDLE_TH_ERRORS_PYBIND
}

// How typed_views cuts a tensor out of the buffer: a view (as_strided, through the dispatcher), or
// a tensor of its own on the buffer's storage (no autograd view of it), requiring grad when its
// `like` does or never.
enum class Cut { kView, kOwnLikeGrad, kOwn };

// Views of the uint8 `buffer` laid out like `likes[i]` (dtype, shape, strides), at byte
// offsets[i] - first_byte: what roundpipe.memory.typed_view makes one at a time, cut with
// as_strided from one view of the buffer per dtype; or, with `cut` kOwnLikeGrad or kOwn, tensors
// of their own on its storage (a stage's parameter copies, requiring grad exactly when their
// `like` does; its gradient views, which are only ever a .grad).
std::vector<at::Tensor> cut_typed(const at::Tensor& buffer, std::int64_t first_byte,
                                  const std::vector<std::int64_t>& offsets,
                                  const std::vector<at::Tensor>& likes, Cut cut) {
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
    // Written so that no sum or product can overflow: offsets come from the caller (the
    // difference is taken only once both are known to be non-negative).
    const bool ordered = first_byte >= 0 && offsets[i] >= first_byte;
    const std::int64_t start = ordered ? offsets[i] - first_byte : 0;
    const bool inside = ordered && start <= buffer.numel() &&
                        like.numel() <= (buffer.numel() - start) / size && start % size == 0;
    TORCH_CHECK(inside, "typed_views: offsets[", i, "] = ", offsets[i], " (", like.numel(), " x ",
                size, " bytes) does not lie aligned inside the buffer of ", buffer.numel(),
                " bytes starting at byte ", first_byte);
    if (cut != Cut::kView) {
      // To autograd a tensor of its own, not a view of the buffer, as a parameter is: ops on a
      // view of a leaf that requires grad, made in no-grad mode, require grad only when the
      // leaf is no view (weight.t() inside nn.Linear), and kernels choose by that (matmul folds
      // a strided 3-D input when the weight requires grad). Made directly on the buffer's
      // storage (what empty + set_ make, without a pass through the dispatcher for each).
      TORCH_CHECK((buffer.storage_offset() + start) % size == 0, "typed_views: offsets[", i,
                  "] is not aligned to its ", size, "-byte elements in the buffer's storage");
      auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()),
                                                       buffer.key_set(), like.dtype());
      impl->set_sizes_and_strides(like.sizes(), like.strides(),
                                  (buffer.storage_offset() + start) / size);
      at::Tensor own(std::move(impl));
      if (cut == Cut::kOwnLikeGrad && like.requires_grad()) own.set_requires_grad(true);
      views.push_back(std::move(own));
      continue;
    }
    auto base = typed.find(like.scalar_type());
    if (base == typed.end()) {
      const std::int64_t whole = buffer.numel() / size * size;
      base = typed.emplace(like.scalar_type(), buffer.slice(0, 0, whole).view(like.scalar_type()))
                 .first;
    }
    // as_strided's offset counts from the start of the storage, not of the buffer.
    views.push_back(base->second.as_strided(like.sizes(), like.strides(),
                                            base->second.storage_offset() + start / size));
  }
  return views;
}

// cut_typed for Python: views, or with `like_requires_grad` tensors of their own requiring grad
// as their likes do.
std::vector<at::Tensor> typed_views(const at::Tensor& buffer, std::int64_t first_byte,
                                    const std::vector<std::int64_t>& offsets,
                                    const std::vector<at::Tensor>& likes, bool like_requires_grad) {
  return cut_typed(buffer, first_byte, offsets, likes,
                   like_requires_grad ? Cut::kOwnLikeGrad : Cut::kView);
}

// tensors[i].grad = grads[i] for views cut by typed_views (a Python `.grad =` per parameter costs
// its own checks and a call through the tensor's Python type). Shape, dtype and device must match,
// as the Python setter demands.
void set_grads(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(tensors.size() == grads.size(), "set_grads: got ", tensors.size(), " tensors but ",
              grads.size(), " gradients; pass one gradient per tensor");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor tensor = tensors[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK(tensor.sizes() == grad.sizes() && tensor.scalar_type() == grad.scalar_type() &&
                    tensor.device() == grad.device(),
                "set_grads: grads[", i, "] (", grad.scalar_type(), " ", grad.sizes(), " on ",
                grad.device(), ") does not match tensors[", i, "] (", tensor.scalar_type(), " ",
                tensor.sizes(), " on ", tensor.device(), ")");
    tensor.mutable_grad() = grad;
  }
}

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
      auto accumulator = torch::autograd::impl::grad_accumulator(tensors[i]);
      if (!accumulator) {  // does not require grad: nothing can reach it
        continue;
      }
      accumulator->add_post_hook(std::make_unique<ReachedFlag>(&reached_[i]));
      accumulators_.push_back(std::move(accumulator));
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
  std::vector<decltype(torch::autograd::impl::grad_accumulator(at::Tensor()))> accumulators_;
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

// What roundpipe.pipeline.ResidentStage makes of a stage, in one call (per stage, each piece in
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
// `tensors`: what roundpipe.pipeline.ResidentStage.bound does to put a stage's device copies in
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
// made (roundpipe.pipeline.ResidentStage checks a stage's parameter copies with it).
std::vector<std::int64_t> changed_in_place(const std::vector<at::Tensor>& tensors) {
  std::vector<std::int64_t> changed;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i]._version() != 0) changed.push_back(static_cast<std::int64_t>(i));
  }
  return changed;
}

// What roundpipe.pipeline.ResidentStage.download_grads issues: for each byte run
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

// A timing event recorded on a CUDA device's compute stream, read by the model's timer once it
// completed (roundpipe.timer.TimingEvent: query() and elapsed_time(end) in milliseconds).
class TimingMark {
 public:
  explicit TimingMark(const c10::Stream& stream)
      : event_(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT) {
    event_.record(stream);
  }
  bool query() const { return event_.query(); }
  double elapsed_time(const TimingMark& end) const { return event_.elapsedTime(end.event_); }

 private:
  c10::Event event_;
};

// The autograd node behind a recomputed segment's input: it keeps the gradient that reaches it and
// ends the pass there. The input is then not a leaf, as a layer's input is in plain PyTorch: a
// layer may change it in place without a copy first, and the pass runs one node for it where a
// leaf that requires grad behind a clone would run two (CloneBackward and AccumulateGrad).
class InputGrad final : public torch::autograd::Node {
 public:
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    grad_ = std::move(grads.at(0));
    return {};
  }
  std::string name() const override { return "roundpipe::InputGrad"; }
  // The gradient that reached the input; undefined when none did.
  at::Tensor take() { return std::exchange(grad_, {}); }

 private:
  at::Tensor grad_;
};

// make_node<T>() builds whichever pointer Edge takes (NodeRef, local_backward.h).

template <class T>
NodeRef make_node() {
  if constexpr (std::is_same_v<NodeRef, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<T>();
  } else {
    return c10::make_intrusive<T>();
  }
}

// `tensor` cut from the graph that made it, requiring grad as it did: a new tensor on the same
// memory whose history is one InputGrad node. A forward stage of a training call runs its layers in
// grad mode, as plain PyTorch does (layers may branch on it, kernels choose by requires_grad), but
// keeps no graph: the recompute builds it. Cut after each layer, an output keeps none of the
// layer's saved tensors alive, and the next layer sees an input that requires grad and is no leaf,
// so it may change it in place as plain PyTorch's activations allow.
at::Tensor graph_cut(const at::Tensor& tensor) {
  at::Tensor cut = tensor.detach();
  if (tensor.requires_grad() && (cut.is_floating_point() || cut.is_complex())) {
    torch::autograd::create_gradient_edge(cut, make_node<InputGrad>());
  }
  return cut;
}

// Whether no two elements of `tensor` share memory: with its dimensions ordered by stride, each
// stride steps past everything the smaller ones reach.
bool elements_apart(const at::Tensor& tensor) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of dims with size > 1
  for (std::int64_t dim = 0; dim < tensor.dim(); ++dim) {
    if (tensor.size(dim) > 1) dims.emplace_back(tensor.stride(dim), tensor.size(dim));
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t reach = 0;  // the furthest element the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

// An uninitialised tensor like `tensor` on `device`, laid out and placed as it is: its strides
// (on the host whenever its elements do not overlap, so a strided view stays one; on a CUDA
// device when they are dense; else contiguous), and its first element as far past an alignment
// boundary as tensor's: 64 bytes on the host (what torch's CPU allocator aligns to), 512 on a
// CUDA device (the caching allocator's), counted from the start of tensor's storage when it
// comes from the host (where plain PyTorch would have moved the whole batch). Matrix kernels
// choose their code path by the layout and alignment of their operands (MKL rounds a GEMM with
// a 16-byte-misaligned input differently), so a microbatch view of the user's batch, or a view a
// layer returned, and the copy a layer gets of it must agree for the layer to round as it does
// in plain PyTorch.
at::Tensor empty_placed(const at::Tensor& tensor, c10::Device device) {
  const auto item = static_cast<std::uintptr_t>(tensor.element_size());
  const std::uintptr_t boundary = device.is_cuda() ? 512 : 64;
  const auto address = tensor.device().type() == device.type()
                           ? reinterpret_cast<std::uintptr_t>(tensor.data_ptr())
                           : static_cast<std::uintptr_t>(tensor.storage_offset()) * item;
  std::uintptr_t skew = address % boundary;
  if (skew % item != 0) skew = 0;
  const bool strided =
      device.is_cuda() ? tensor.is_non_overlapping_and_dense() : elements_apart(tensor);
  const auto options = tensor.options().device(device);
  if (tensor.numel() == 0) return at::empty(tensor.sizes(), options);
  const auto strides = strided ? c10::DimVector(tensor.strides().begin(), tensor.strides().end())
                               : c10::contiguous_strides(tensor.sizes());
  std::int64_t span = 1;  // elements from the first to the last, inclusive
  for (std::size_t dim = 0; dim < strides.size(); ++dim)
    span += (tensor.size(dim) - 1) * strides[dim];
  const auto shift = static_cast<std::int64_t>(skew / item);
  return at::empty({span + shift}, options).as_strided(tensor.sizes(), strides, shift);
}

// A copy of `tensor` that autograd does not know of, as tensor.detach().clone() (without the
// detached alias and the autograd layer of the dispatch in between), placed as `tensor` is
// (empty_placed).
at::Tensor plain_copy(const at::Tensor& tensor) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor copy = empty_placed(tensor, tensor.device());
  copy.copy_(tensor);
  return copy;
}

// Host-clock layer times as the model's timer folds them: the layers, and the seconds of each.
class HostTimes {
 public:
  using Taken = std::pair<std::vector<std::int64_t>, std::vector<double>>;
  void add(std::int64_t layer, double seconds) {
    taken_.first.push_back(layer);
    taken_.second.push_back(seconds);
  }
  Taken take() { return std::exchange(taken_, {}); }

 private:
  Taken taken_;
};

// splitmix64's finaliser of (call, layer, microbatch): every random draw of layer l for microbatch
// m comes from generators seeded with it, the same whatever the plan, stage boundaries or device;
// `fresh` gives recompute a stream of its own when it must not replay the forward's draws.
std::uint64_t layer_seed(std::uint64_t call_seed, std::int64_t layer, std::int64_t microbatch,
                         bool fresh) {
  std::uint64_t x = call_seed ^ (static_cast<std::uint64_t>(layer) * 0x9E3779B97F4A7C15ULL) ^
                    (static_cast<std::uint64_t>(microbatch) * 0xC2B2AE3D27D4EB4FULL);
  if (fresh) x ^= 0x165667B19E3779F9ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return (x ^ (x >> 31)) >> 1;
}

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
// CPU generator (a Mersenne Twister) computes its 624 words one after another, about a
// microsecond, paid again in recompute for the same (layer, microbatch), where a copy of the
// state the forward started from costs a tenth of that. At most kMaxStates (10 MB) are kept, in
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

  void keep(std::int64_t layer, std::int64_t microbatch, const at::mt19937& state) {
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
  // The state kept for (layer, microbatch), or null.
  const at::mt19937* find(std::int64_t layer, std::int64_t microbatch) const {
    const std::uint32_t* slot = slots_.find(layer, microbatch);
    return slot != nullptr && *slot != 0 ? &states_[*slot - 1] : nullptr;
  }
  std::size_t kept() const { return states_.size(); }

 private:
  CallSlots<std::uint32_t> slots_;  // 1 + the state's index in states_; 0: none kept
  std::vector<at::mt19937> states_;
};

// The layer inputs one call's forward stages keep for the recompute of its backward stages, where
// each is a lone tensor on a virtual CPU device (roundpipe.pipeline.Call keeps the others): a
// private copy per (layer, microbatch), held here rather than as a Python tensor in a dict. With
// layer grain that is one input per layer x microbatch living from the forward to the backward:
// as Python objects they outlived the garbage collector's young generations, each of which
// walks its survivors again, and were promoted to the oldest, whose full collections walk every
// object of the process.
class KeptInputs {
 public:
  KeptInputs(std::int64_t layers, std::int64_t microbatches)
      : inputs_("KeptInputs", layers, microbatches) {}

  void keep(std::int64_t layer, std::int64_t microbatch, at::Tensor input) {
    at::Tensor* slot = inputs_.find(layer, microbatch);
    if (slot == nullptr) {
      throw py::index_error("KeptInputs: the call has no layer " + std::to_string(layer) +
                            " x microbatch " + std::to_string(microbatch));
    }
    *slot = std::move(input);
  }
  // The input kept for (layer, microbatch); undefined when none is.
  const at::Tensor& find(std::int64_t layer, std::int64_t microbatch) const {
    static const at::Tensor none;
    const at::Tensor* slot = inputs_.find(layer, microbatch);
    return slot != nullptr ? *slot : none;
  }
  // Whether, for each of `microbatches`, the inputs of the segments of layers [first, stop) are
  // kept: layer first's, or with `per_layer` each layer's.
  bool covers(std::int64_t first, std::int64_t stop, const std::vector<std::int64_t>& microbatches,
              bool per_layer) const {
    const std::int64_t last = per_layer ? stop : std::min(first + 1, stop);
    for (const std::int64_t microbatch : microbatches) {
      for (std::int64_t layer = first; layer < last; ++layer) {
        if (!find(layer, microbatch).defined()) return false;
      }
    }
    return first < stop;
  }

 private:
  CallSlots<at::Tensor> inputs_;
};

// The layer calls of one stage of one pipelined call (roundpipe.pipeline._LayerCalls): for each
// layer of a run, reseed the generators, point the recompute context at the layer, call the module
// (inside its NVTX range, when ranges are marked) and time it. What is the same for every layer x
// microbatch of the stage is given once, here.
class LayerLoop {
 public:
  LayerLoop(py::list modules, std::uint64_t call_seed, bool fresh,
            std::vector<at::Generator> generators, py::object context, py::object mark,
            const std::string& timing, std::int64_t device_index,
            std::shared_ptr<RngStates> rng_states, bool replay, py::object cut)
      : modules_(std::move(modules)),
        call_seed_(call_seed),
        fresh_(fresh),
        generators_(std::move(generators)),
        context_(std::move(context)),
        mark_(std::move(mark)),
        rng_states_(std::move(rng_states)),
        replay_(replay),
        cut_(std::move(cut)),
        enter_(context_.attr("__enter__")),
        exit_(context_.attr("__exit__")) {
    TORCH_CHECK(timing == "off" || timing == "host" || timing == "device",
                "LayerLoop: timing must be 'off', 'host' or 'device', got '", timing, "'");
    TORCH_CHECK(!(replay && fresh), "LayerLoop: replay needs the forward's stream (fresh=False)");
    if (timing == "host") timing_ = Timing::kHost;
    if (timing == "device") {
      timing_ = Timing::kDevice;
      const c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
      stream_.emplace(c10::impl::getDeviceGuardImpl(device.type())->getStream(device));
    }
  }

  // Runs layers [first, stop) on `value` for `microbatch` and returns the last one's output; layer
  // 0 takes `value` as (args, kwargs). The context's `layer` names the layer that raised, if one
  // did.
  py::object run(std::int64_t first, std::int64_t stop, std::int64_t microbatch, py::object value) {
    check_layers("run", first, stop);
    const py::int_ mb(microbatch);
    for (std::int64_t layer = first; layer < stop; ++layer)
      value = step(layer, microbatch, mb, value);
    return value;
  }

  // run over microbatches first_microbatch, first_microbatch + 1, ... (values[i] the input of
  // the i-th), keeping the input of each layer in `keep` (ascending, within [first, stop)) for
  // the backward pass: with `kept` given a lone tensor is kept there (a private detached copy,
  // requiring grad as the input did), anything else by keeper(layer, microbatch, input). Returns
  // the outputs. The context's `layer` and `microbatch` name the layer that raised, if one did.
  py::list run_keeping(std::int64_t first, std::int64_t stop, std::int64_t first_microbatch,
                       const py::list& values, const std::vector<std::int64_t>& keep,
                       const std::shared_ptr<KeptInputs>& kept, const py::object& keeper) {
    check_layers("run_keeping", first, stop);
    for (std::size_t i = 0; i < keep.size(); ++i) {
      TORCH_CHECK(first <= keep[i] && keep[i] < stop && (i == 0 || keep[i - 1] < keep[i]),
                  "LayerLoop.run_keeping: keep must list layers of [", first, ", ", stop,
                  ") in ascending order");
    }
    // Held here: a layer may change the caller's list while the loop runs.
    std::vector<py::object> inputs;
    inputs.reserve(values.size());
    for (const py::handle input : values)
      inputs.push_back(py::reinterpret_borrow<py::object>(input));
    py::list outputs;
    std::int64_t microbatch = first_microbatch;
    for (py::object& value : inputs) {
      const py::int_ mb(microbatch);
      auto next = keep.begin();
      for (std::int64_t layer = first; layer < stop; ++layer) {
        const bool keeping = next != keep.end() && *next == layer;
        if (keeping) {
          point(layer, mb);
          if (kept && THPVariable_Check(value.ptr())) {
            // Requiring grad as the input did: the recompute's input then does too.
            const at::Tensor& tensor = THPVariable_Unpack(value.ptr());
            at::Tensor copy = plain_copy(tensor);
            if (tensor.requires_grad()) copy.set_requires_grad(true);
            kept->keep(layer, microbatch, std::move(copy));
          } else {
            keeper(layer, mb, value);
          }
          ++next;
        }
        value = step(layer, microbatch, mb, value, /*pointed=*/keeping);
      }
      outputs.append(std::move(value));
      ++microbatch;
    }
    return outputs;
  }

  // Recompute + backward, in grad mode, of layers [first, stop) (first > 0) for `microbatch`, from
  // saved inputs: one segment over all of them from inputs[0] (stage grain), or with `per_layer`
  // one per layer, last layer first, from inputs[i], the input of layer first + i (layer grain).
  // saved[i] is what inputs[i] was uploaded from, given when a later recompute may start from it
  // again (a retained graph; empty otherwise): an input that shares its memory is then copied, so
  // that a layer changing its input in place cannot change what that recompute starts from. A
  // floating-point input gets an InputGrad node, which collects the input's gradient.
  // `grad` is the gradient of the last output (None: none reached it); an output that is not a
  // tensor is backpropagated by `fallback(output, [grad])`. Returns the gradient of layer first's
  // input, or None. On an error, `failure` tells the phase and the layers of the failing segment.
  py::object recompute_backward(std::int64_t first, std::int64_t stop, std::int64_t microbatch,
                                const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& saved,
                                std::optional<at::Tensor> grad, bool per_layer,
                                const py::object& fallback) {
    check_recompute("recompute_backward", first, stop);
    const std::size_t segments = per_layer ? static_cast<std::size_t>(stop - first) : 1;
    TORCH_CHECK(inputs.size() == segments && (saved.empty() || saved.size() == segments),
                "LayerLoop.recompute_backward: got ", inputs.size(), " inputs and ", saved.size(),
                " saved values for ", segments, " segments");
    // Entered once: between the segments the context is only marked not running (LayerCall).
    call_python(enter_);
    try {
      grad = recompute_segments(first, stop, microbatch, inputs, saved, std::move(grad), per_layer,
                                fallback);
    } catch (...) {
      leave_after_failure();
      throw;
    }
    leave_context();
    if (!grad.has_value() || !grad->defined()) return py::none();
    return py::cast(*grad);
  }

  // recompute_backward for each of `microbatches` in turn (grads[i] the gradient of the last
  // output of the i-th), from the inputs `kept` holds (see KeptInputs::covers), which stay as
  // they are when `retained` (a later recompute may start from them again: each is copied
  // first). Returns the input gradients, in the same order.
  py::list recompute_backward_kept(std::int64_t first, std::int64_t stop,
                                   const std::vector<std::int64_t>& microbatches,
                                   const KeptInputs& kept, bool retained,
                                   const std::vector<std::optional<at::Tensor>>& grads,
                                   bool per_layer, const py::object& fallback) {
    check_recompute("recompute_backward_kept", first, stop);
    TORCH_CHECK(grads.size() == microbatches.size(), "LayerLoop.recompute_backward_kept: got ",
                grads.size(), " gradients for ", microbatches.size(), " microbatches");
    TORCH_CHECK(kept.covers(first, stop, microbatches, per_layer),
                "LayerLoop.recompute_backward_kept: the inputs of layers [", first, ", ", stop,
                ") are not kept for every microbatch asked for");
    py::list results;
    call_python(enter_);
    try {
      std::vector<at::Tensor> inputs;
      for (std::size_t i = 0; i < microbatches.size(); ++i) {
        inputs.clear();
        for (std::int64_t layer = first; layer < (per_layer ? stop : first + 1); ++layer)
          inputs.push_back(kept.find(layer, microbatches[i]));
        const std::optional<at::Tensor> grad = recompute_segments(
            first, stop, microbatches[i], inputs, retained ? inputs : std::vector<at::Tensor>{},
            grads[i], per_layer, fallback);
        if (grad.has_value() && grad->defined()) {
          results.append(py::cast(*grad));
        } else {
          results.append(py::none());
        }
      }
    } catch (...) {
      leave_after_failure();
      throw;
    }
    leave_context();
    return results;
  }

  // The phase ("recompute" or "backward"), layers [first, stop) and microbatch of the segment
  // recompute_backward (or recompute_backward_kept) was in when it last raised.
  std::tuple<std::string, std::int64_t, std::int64_t, std::int64_t> failure() const {
    return {failure_.phase, failure_.first, failure_.stop, failure_.microbatch};
  }

  // The backward times recompute_backward took since the last call on the host clock, each
  // segment's split evenly over its layers: (layers, seconds).
  HostTimes::Taken take_backward_host_times() { return backward_host_.take(); }
  // The same on a device: (first, stop, start, end).
  std::vector<std::tuple<std::int64_t, std::int64_t, std::shared_ptr<TimingMark>,
                         std::shared_ptr<TimingMark>>>
  take_backward_device_times() {
    return std::exchange(backward_device_, {});
  }

  // The host times taken since the last call, one per layer run, in order: (layers, seconds).
  HostTimes::Taken take_host_times() { return host_times_.take(); }
  // The device timing events recorded since the last call: (layer, start, end) per layer run, in
  // order.
  std::vector<std::tuple<std::int64_t, std::shared_ptr<TimingMark>, std::shared_ptr<TimingMark>>>
  take_device_times() {
    return std::exchange(device_times_, {});
  }

 private:
  enum class Timing { kOff, kHost, kDevice };

  void check_layers(const char* method, std::int64_t first, std::int64_t stop) const {
    const auto size = static_cast<std::int64_t>(modules_.size());
    TORCH_CHECK(0 <= first && first <= stop && stop <= size, "LayerLoop.", method, ": layers [",
                first, ", ", stop, ") are not within the ", size, " layers");
  }

  // Recompute starts from a kept input: never layer 0, which takes the call's (args, kwargs).
  void check_recompute(const char* method, std::int64_t first, std::int64_t stop) const {
    const auto size = static_cast<std::int64_t>(modules_.size());
    TORCH_CHECK(0 < first && first < stop && stop <= size, "LayerLoop.", method, ": layers [",
                first, ", ", stop, ") are not within layers 1 to ", size - 1);
  }

  // The segments of recompute_backward for one microbatch, last first, with the context entered;
  // returns the gradient of layer first's input.
  std::optional<at::Tensor> recompute_segments(std::int64_t first, std::int64_t stop,
                                               std::int64_t microbatch,
                                               const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& saved,
                                               std::optional<at::Tensor> grad, bool per_layer,
                                               const py::object& fallback) {
    const py::int_ mb(microbatch);
    for (std::int64_t end = stop; end > first;) {
      const std::int64_t begin = per_layer ? end - 1 : first;
      const auto index = static_cast<std::size_t>(begin - first);
      grad = segment(begin, end, microbatch, mb, inputs[index],
                     saved.empty() ? nullptr : &saved[index], grad, fallback);
      end = begin;
    }
    return grad;
  }

  void leave_after_failure() {
    // The engine may rethrow with the Python error still set: keep it aside meanwhile.
    const py::error_scope pending;
    set_running(true);
    leave_context();
  }

  // Seeds `generator` with `seed` for (layer, microbatch). A CPU generator replaying a forward
  // takes the state that forward kept instead (what seeding makes: that engine, no cached normal
  // sample); recording one, it keeps the seeded state.
  void reseed(at::Generator& generator, std::uint64_t seed, std::int64_t layer,
              std::int64_t microbatch) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    if (!rng_states_ || !generator.device().is_cpu()) {
      generator.set_current_seed(seed);
      return;
    }
    auto* cpu = at::check_generator<at::CPUGeneratorImpl>(generator);
    const at::mt19937* kept = replay_ ? rng_states_->find(layer, microbatch) : nullptr;
    if (kept != nullptr) {
      cpu->set_engine(*kept);
      cpu->set_next_float_normal_sample(std::nullopt);
      cpu->set_next_double_normal_sample(std::nullopt);
      return;
    }
    generator.set_current_seed(seed);
    if (!replay_) rng_states_->keep(layer, microbatch, cpu->engine());
  }

  // One segment of recompute_backward: layers [begin, end) recomputed in grad mode from
  // `stage_input` (copied first when `saved`, what it was uploaded from, is given and shares its
  // memory), then backpropagated from `grad`. Returns the gradient of the input, or nullopt when
  // none reached it.
  std::optional<at::Tensor> segment(std::int64_t begin, std::int64_t end, std::int64_t microbatch,
                                    const py::int_& mb, const at::Tensor& stage_input,
                                    const at::Tensor* saved, std::optional<at::Tensor> grad,
                                    const py::object& fallback) {
    const bool copy = saved != nullptr && shares_memory(stage_input, *saved);
    // Either way a tensor of its own for autograd: the same bytes, none of the input's history.
    at::Tensor input = copy ? plain_copy(stage_input) : stage_input.variable_data();
    NodeRef input_grad;
    // As in the forward (and plain PyTorch): an input that did not require grad there (the
    // output of parameter-free layers on the user's input) does not here either.
    if (stage_input.requires_grad() && (input.is_floating_point() || input.is_complex())) {
      input_grad = make_node<InputGrad>();
      torch::autograd::create_gradient_edge(input, input_grad);
    }
    failure_ = {"recompute", begin, end, microbatch};
    py::object output = py::cast(input);
    {
      at::AutoGradMode grad_mode(true);
      for (std::int64_t layer = begin; layer < end; ++layer) {
        output = step(layer, microbatch, mb, output);
      }
    }
    failure_ = {"backward", begin, end, microbatch};
    const bool has_grad = grad.has_value() && grad->defined();
    const auto start = std::chrono::steady_clock::now();
    std::shared_ptr<TimingMark> start_mark;
    if (timing_ == Timing::kDevice) start_mark = std::make_shared<TimingMark>(*stream_);
    set_running(false);
    if (THPVariable_Check(output.ptr())) {
      const at::Tensor result = THPVariable_Unpack(output.ptr());
      if (result.requires_grad() && has_grad) {
        const BackwardScope scope;
        py::gil_scoped_release no_gil;
        run_backward({result}, {*grad}, scope);
      }
    } else {
      py::list grads;
      grads.append(has_grad ? py::cast(*grad) : py::none());
      fallback(output, grads);
    }
    set_running(true);
    if (timing_ == Timing::kHost) {
      // Split evenly over the segment's layers.
      const double share =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
          static_cast<double>(end - begin);
      for (std::int64_t layer = begin; layer < end; ++layer) backward_host_.add(layer, share);
    } else if (timing_ == Timing::kDevice) {
      backward_device_.emplace_back(begin, end, std::move(start_mark),
                                    std::make_shared<TimingMark>(*stream_));
    }
    if (!input_grad) return std::nullopt;
    return static_cast<InputGrad&>(*input_grad).take();
  }

  void set_running(bool running) { context_.attr(running_key_) = py::bool_(running); }

  // callable(*args) through the vectorcall protocol (pybind's call packs a tuple first).
  template <class... Args>
  static py::object call_python(const py::handle& callable, const Args&... args) {
    PyObject* argv[] = {nullptr, args.ptr()...};
    PyObject* result = PyObject_Vectorcall(
        callable.ptr(), argv + 1, sizeof...(Args) | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
    if (result == nullptr) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(result);
  }

  void leave_context() const { call_python(exit_, py::none(), py::none(), py::none()); }

  static bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
    return a.device() == b.device() && a.numel() > 0 && a.data_ptr() == b.data_ptr();
  }

  // One layer: reseed the generators, point the context at the layer, call it.
  // (`pointed`: the context already points at the layer.)
  py::object step(std::int64_t layer, std::int64_t microbatch, const py::int_& mb,
                  const py::object& value, bool pointed = false) {
    const std::uint64_t seed = layer_seed(call_seed_, layer, microbatch, fresh_);
    for (at::Generator& generator : generators_) reseed(generator, seed, layer, microbatch);
    if (!pointed) point(layer, mb);
    context_.attr(saved_key_) = py::bool_(false);
    py::object output = call(layer, mb, value);
    if (cut_.is_none()) return output;
    if (THPVariable_Check(output.ptr())) {
      const at::Tensor& tensor = THPVariable_Unpack(output.ptr());
      return tensor.requires_grad() ? py::cast(graph_cut(tensor)) : output;
    }
    return call_python(cut_, output);
  }

  // Points the context at (layer, microbatch): what a failure from here on names.
  void point(std::int64_t layer, const py::int_& mb) {
    context_.attr(layer_key_) = py::int_(layer);
    context_.attr(microbatch_key_) = mb;
  }

  py::object call(std::int64_t layer, const py::int_& mb, const py::object& value) {
    const py::handle module = modules_[static_cast<std::size_t>(layer)];
    py::object range;
    if (!mark_.is_none()) {
      range = mark_(layer, mb);
      range.attr("__enter__")();
    }
    std::shared_ptr<TimingMark> start_mark;
    const auto start = std::chrono::steady_clock::now();
    if (timing_ == Timing::kDevice) start_mark = std::make_shared<TimingMark>(*stream_);
    py::object result;
    try {
      if (layer == 0) {
        const py::tuple pair = value.cast<py::tuple>();
        TORCH_CHECK(pair.size() == 2, "LayerLoop.run: layer 0 takes (args, kwargs)");
        result = module(*pair[0], **pair[1]);
      } else {
        result = call_python(module_call_.callee(module), value);
      }
    } catch (...) {
      if (range) range.attr("__exit__")(py::none(), py::none(), py::none());
      throw;
    }
    if (timing_ == Timing::kHost) {
      host_times_.add(
          layer, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    } else if (timing_ == Timing::kDevice) {
      device_times_.emplace_back(layer, std::move(start_mark),
                                 std::make_shared<TimingMark>(*stream_));
    }
    if (range) range.attr("__exit__")(py::none(), py::none(), py::none());
    return result;
  }

  py::list modules_;
  std::uint64_t call_seed_;
  bool fresh_;
  std::vector<at::Generator> generators_;
  py::object context_;
  py::object mark_;
  // Forward loops keep the CPU generator's seeded states in rng_states_; recompute loops
  // (replay_) start from them.
  std::shared_ptr<RngStates> rng_states_;
  bool replay_;
  // Given: each layer's output is cut from its graph (graph_cut; cut_(output) for a pytree).
  py::object cut_;
  // Bound once: a lookup by C string builds the name's Python string on every call.
  py::object enter_, exit_;
  ModuleCall module_call_;
  py::str layer_key_{"layer"}, microbatch_key_{"microbatch"}, saved_key_{"saved"},
      running_key_{"running"};
  Timing timing_ = Timing::kOff;
  std::optional<c10::Stream> stream_;
  HostTimes host_times_;
  struct Failure {
    const char* phase = "";
    std::int64_t first = 0;
    std::int64_t stop = 0;
    std::int64_t microbatch = 0;
  } failure_;
  HostTimes backward_host_;
  std::vector<std::tuple<std::int64_t, std::int64_t, std::shared_ptr<TimingMark>,
                         std::shared_ptr<TimingMark>>>
      backward_device_;
  std::vector<std::tuple<std::int64_t, std::shared_ptr<TimingMark>, std::shared_ptr<TimingMark>>>
      device_times_;
};

}  // namespace

void bind_dispatch(py::module_& m) {
  py::class_<TimingMark, std::shared_ptr<TimingMark>>(
      m, "TimingMark", "A timing event on a CUDA device's compute stream (see LayerLoop).")
      .def("query", &TimingMark::query, "Whether the event completed.")
      .def("elapsed_time", &TimingMark::elapsed_time, py::arg("end"),
           "Milliseconds from this event to `end` (both completed).");
  py::class_<RngStates, std::shared_ptr<RngStates>>(
      m, "RngStates",
      "The CPU generator states a call's forward layers were seeded with, kept for their "
      "recompute (at most 4096).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def_property_readonly("kept", &RngStates::kept, "How many states are kept.");
  py::class_<KeptInputs, std::shared_ptr<KeptInputs>>(
      m, "KeptInputs",
      "The lone-tensor layer inputs a call's forward stages keep for its recompute, per (layer, "
      "microbatch).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def(
          "find",
          [](const KeptInputs& kept, std::int64_t layer,
             std::int64_t microbatch) -> std::optional<at::Tensor> {
            const at::Tensor& input = kept.find(layer, microbatch);
            if (!input.defined()) return std::nullopt;
            return input;
          },
          py::arg("layer"), py::arg("microbatch"),
          "The input kept for (layer, microbatch), or None.")
      .def("covers", &KeptInputs::covers, py::arg("first"), py::arg("stop"),
           py::arg("microbatches"), py::arg("per_layer"),
           "Whether the inputs of layers [first, stop)'s segments (the first layer's, or with "
           "per_layer each layer's) are kept for each of `microbatches`.");
  py::class_<GradReach, std::shared_ptr<GradReach>>(
      m, "GradReach", "Flags which of `tensors` (leaves) an AccumulateGrad node ran for.")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("tensors"))
      .def("reached", &GradReach::reached,
           "Indices of the tensors that received a gradient since construction.");
  py::class_<LayerLoop>(m, "LayerLoop",
                        "The layer calls of one stage: reseed, recompute context, NVTX range, "
                        "module call and timing per layer, in one native loop.")
      .def(py::init<py::list, std::uint64_t, bool, std::vector<at::Generator>, py::object,
                    py::object, const std::string&, std::int64_t, std::shared_ptr<RngStates>, bool,
                    py::object>(),
           py::arg("modules"), py::arg("call_seed"), py::arg("fresh"), py::arg("generators"),
           py::arg("context"), py::arg("mark"), py::arg("timing"), py::arg("device_index"),
           py::arg("rng_states") = nullptr, py::arg("replay") = false, py::arg("cut") = py::none())
      .def("run", &LayerLoop::run, py::arg("first"), py::arg("stop"), py::arg("microbatch"),
           py::arg("value"), "Runs layers [first, stop) on value; returns the last output.")
      .def("run_keeping", &LayerLoop::run_keeping, py::arg("first"), py::arg("stop"),
           py::arg("first_microbatch"), py::arg("values"), py::arg("keep"), py::arg("kept"),
           py::arg("keeper"),
           "run over consecutive microbatches, keeping the inputs of the layers in keep for "
           "backward (lone tensors in `kept`, if given; the others by keeper(layer, microbatch, "
           "input)); returns the outputs.")
      .def("recompute_backward", &LayerLoop::recompute_backward, py::arg("first"), py::arg("stop"),
           py::arg("microbatch"), py::arg("inputs"), py::arg("saved"), py::arg("grad"),
           py::arg("per_layer"), py::arg("fallback"),
           "Recompute + backward of layers [first, stop) from their saved inputs (`saved`: what "
           "they were uploaded from, when a later recompute may start from it again, else []); "
           "returns the gradient of the first layer's input or None.")
      .def("recompute_backward_kept", &LayerLoop::recompute_backward_kept, py::arg("first"),
           py::arg("stop"), py::arg("microbatches"), py::arg("kept"), py::arg("retained"),
           py::arg("grads"), py::arg("per_layer"), py::arg("fallback"),
           "recompute_backward for each of `microbatches` from the inputs `kept` holds (copied "
           "first when `retained`); returns the input gradients.")
      .def_property_readonly("failure", &LayerLoop::failure,
                             "(phase, first, stop, microbatch) of the segment "
                             "recompute_backward last raised in.")
      .def("take_backward_host_times", &LayerLoop::take_backward_host_times,
           "(layers, seconds) of the backwards since the last call, each split evenly over its "
           "layers.")
      .def("take_backward_device_times", &LayerLoop::take_backward_device_times,
           "(first, stop, start, end) TimingMarks of each backward since the last call.")
      .def("take_host_times", &LayerLoop::take_host_times,
           "(layers, seconds) of the layer runs since the last call, in order.")
      .def("take_device_times", &LayerLoop::take_device_times,
           "(layer, start, end) TimingMarks of each layer run since the last call, in order.");
  m.def("empty_placed", &empty_placed, py::arg("tensor"), py::arg("device"),
        "An uninitialised tensor like `tensor` on `device` whose first element sits as far past "
        "an alignment boundary (64 bytes on the host, 512 on CUDA) as tensor's: copies a layer "
        "takes round as the original would.");
  m.def("graph_cut", &graph_cut, py::arg("tensor"),
        "tensor.detach() requiring grad as tensor does, through one node of its own (no leaf): "
        "what a forward stage's layer passes on in grad mode without keeping its graph.");
  m.def("plain_copy", &plain_copy, py::arg("tensor"),
        "tensor.detach().clone(), placed as `tensor` is (see empty_placed).");
  m.def("set_grads", &set_grads, py::arg("tensors"), py::arg("grads"),
        "tensors[i].grad = grads[i] (same shape, dtype and device).");
  m.def("layer_seed", &layer_seed, py::arg("call_seed"), py::arg("layer"), py::arg("microbatch"),
        py::arg("fresh"),
        "The seed of the generators for (call, layer, microbatch) (splitmix64 finaliser).");
  m.def("backward", &backward, py::arg("outputs"), py::arg("grads"),
        "torch.autograd.backward(outputs, grads) without the GIL, on the calling thread where "
        "torch's engine would change nothing (see run_backward), else through the engine: one "
        "defined gradient per output; errors are raised as torch.autograd.backward raises them.");
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
  m.def("typed_views", &typed_views, py::arg("buffer"), py::arg("first_byte"), py::arg("offsets"),
        py::arg("likes"), py::arg("like_requires_grad") = false,
        "Views of the uint8 buffer at byte offsets[i] - first_byte, laid out like likes[i] "
        "(contiguous); with like_requires_grad, requiring grad as likes[i] does.");
}

}  // namespace roundpipe::bindings
