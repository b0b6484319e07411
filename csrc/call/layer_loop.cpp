#include "call/layer_loop.h"

#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <mutex>

#include "call/transfers.h"
#include "torch_internals/torch_internals.h"

namespace roundpipe::call {
namespace {

// callable(*args) through the vectorcall protocol (pybind's call packs a tuple first).
template <class... Args>
py::object call_python(const py::handle& callable, const Args&... args) {
  PyObject* argv[] = {nullptr, args.ptr()...};
  PyObject* result = PyObject_Vectorcall(callable.ptr(), argv + 1,
                                         sizeof...(Args) | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
  if (result == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(result);
}

// Whether `value` is a torch.Tensor (or of a subclass), then unpacked into `tensor`: torch's own
// conversion, which python_variable.h would inline at the price of the autograd headers.
bool unpack_tensor(const py::handle& value, at::Tensor& tensor) {
  py::detail::make_caster<at::Tensor> caster;
  if (!caster.load(value, /*convert=*/false)) return false;
  tensor = std::move(static_cast<at::Tensor&>(caster));
  return true;
}

bool shares_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.device() == b.device() && a.numel() > 0 && a.data_ptr() == b.data_ptr();
}

}  // namespace

std::uint64_t layer_seed(std::uint64_t call_seed, std::int64_t layer, std::int64_t microbatch,
                         bool fresh) {
  std::uint64_t x = call_seed ^ (static_cast<std::uint64_t>(layer) * 0x9E3779B97F4A7C15ULL) ^
                    (static_cast<std::uint64_t>(microbatch) * 0xC2B2AE3D27D4EB4FULL);
  if (fresh) x ^= 0x165667B19E3779F9ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return (x ^ (x >> 31)) >> 1;
}

LayerLoop::LayerLoop(py::list modules, std::uint64_t call_seed, bool fresh,
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
    stream_.emplace(at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(device_index)));
  }
}

py::object LayerLoop::run(std::int64_t first, std::int64_t stop, std::int64_t microbatch,
                          py::object value) {
  check_layers("run", first, stop);
  const py::int_ mb(microbatch);
  for (std::int64_t layer = first; layer < stop; ++layer)
    value = step(layer, microbatch, mb, value);
  return value;
}

py::list LayerLoop::run_keeping(std::int64_t first, std::int64_t stop,
                                std::int64_t first_microbatch, const py::list& values,
                                const std::vector<std::int64_t>& keep,
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
  for (const py::handle input : values) inputs.push_back(py::reinterpret_borrow<py::object>(input));
  py::list outputs;
  std::int64_t microbatch = first_microbatch;
  for (py::object& value : inputs) {
    const py::int_ mb(microbatch);
    auto next = keep.begin();
    for (std::int64_t layer = first; layer < stop; ++layer) {
      const bool keeping = next != keep.end() && *next == layer;
      if (keeping) {
        point(layer, mb);
        at::Tensor tensor;
        if (kept && unpack_tensor(value, tensor)) {
          // Requiring grad as the input did: the recompute's input then does too.
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

py::object LayerLoop::recompute_backward(std::int64_t first, std::int64_t stop,
                                         std::int64_t microbatch,
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

py::list LayerLoop::recompute_backward_kept(std::int64_t first, std::int64_t stop,
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

void LayerLoop::check_layers(const char* method, std::int64_t first, std::int64_t stop) const {
  const auto size = static_cast<std::int64_t>(modules_.size());
  TORCH_CHECK(0 <= first && first <= stop && stop <= size, "LayerLoop.", method, ": layers [",
              first, ", ", stop, ") are not within the ", size, " layers");
}

void LayerLoop::check_recompute(const char* method, std::int64_t first, std::int64_t stop) const {
  const auto size = static_cast<std::int64_t>(modules_.size());
  TORCH_CHECK(0 < first && first < stop && stop <= size, "LayerLoop.", method, ": layers [", first,
              ", ", stop, ") are not within layers 1 to ", size - 1);
}

std::optional<at::Tensor> LayerLoop::recompute_segments(
    std::int64_t first, std::int64_t stop, std::int64_t microbatch,
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& saved,
    std::optional<at::Tensor> grad, bool per_layer, const py::object& fallback) {
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

void LayerLoop::leave_after_failure() {
  // The engine may rethrow with the Python error still set: keep it aside meanwhile.
  const py::error_scope pending;
  set_running(true);
  leave_context();
}

void LayerLoop::reseed(at::Generator& generator, std::uint64_t seed, std::int64_t layer,
                       std::int64_t microbatch) {
  std::lock_guard<std::mutex> lock(generator.mutex());
  if (!rng_states_ || !generator.device().is_cpu()) {
    generator.set_current_seed(seed);
    return;
  }
  const torch_internals::CpuRngState* kept =
      replay_ ? rng_states_->find(layer, microbatch) : nullptr;
  if (kept != nullptr) {
    torch_internals::set_cpu_rng_state(generator, *kept);
    return;
  }
  generator.set_current_seed(seed);
  if (!replay_) rng_states_->keep(layer, microbatch, torch_internals::cpu_rng_state(generator));
}

std::optional<at::Tensor> LayerLoop::segment(std::int64_t begin, std::int64_t end,
                                             std::int64_t microbatch, const py::int_& mb,
                                             const at::Tensor& stage_input, const at::Tensor* saved,
                                             std::optional<at::Tensor> grad,
                                             const py::object& fallback) {
  const bool copy = saved != nullptr && shares_memory(stage_input, *saved);
  // Either way a tensor of its own for autograd: the same bytes, none of the input's history.
  at::Tensor input = copy ? plain_copy(stage_input) : stage_input.variable_data();
  std::shared_ptr<at::Tensor> input_grad;
  // As in the forward (and plain PyTorch): an input that did not require grad there (the
  // output of parameter-free layers on the user's input) does not here either.
  if (stage_input.requires_grad() && (input.is_floating_point() || input.is_complex())) {
    input_grad = torch_internals::collect_grad(input);
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
  at::Tensor result;
  if (unpack_tensor(output, result)) {
    if (result.requires_grad() && has_grad) {
      const torch_internals::BackwardScope scope;
      py::gil_scoped_release no_gil;
      torch_internals::run_backward({result}, {*grad}, scope);
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
  return std::exchange(*input_grad, {});
}

py::object LayerLoop::step(std::int64_t layer, std::int64_t microbatch, const py::int_& mb,
                           const py::object& value, bool pointed) {
  const std::uint64_t seed = layer_seed(call_seed_, layer, microbatch, fresh_);
  for (at::Generator& generator : generators_) reseed(generator, seed, layer, microbatch);
  if (!pointed) point(layer, mb);
  context_.attr(saved_key_) = py::bool_(false);
  py::object output = call(layer, mb, value);
  if (cut_.is_none()) return output;
  at::Tensor tensor;
  if (unpack_tensor(output, tensor)) {
    return tensor.requires_grad() ? py::cast(graph_cut(tensor)) : output;
  }
  return call_python(cut_, output);
}

void LayerLoop::point(std::int64_t layer, const py::int_& mb) {
  context_.attr(layer_key_) = py::int_(layer);
  context_.attr(microbatch_key_) = mb;
}

py::object LayerLoop::call(std::int64_t layer, const py::int_& mb, const py::object& value) {
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

void LayerLoop::leave_context() const { call_python(exit_, py::none(), py::none(), py::none()); }

}  // namespace roundpipe::call
