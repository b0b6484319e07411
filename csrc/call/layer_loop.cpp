// The layer calls of one stage of one pipelined call: the native side of roundpipe/layer_loop.py
// (LayerCalls). At short sequences a device finishes a layer in about a millisecond, so the
// host's Python work around each layer caps throughput; this loop does per layer x microbatch
// what Python would: reseed, point the recompute context, NVTX range, module call, timing, and
// for a backward stage the recompute + backward of its segments.
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Event.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "call/saved_inputs.h"
#include "call/module_call.h"
#include "call/transfers.h"
#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

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

// The layer calls of one stage of one pipelined call (roundpipe.layer_loop.LayerCalls): for each
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
      stream_.emplace(
          at::accelerator::getCurrentStream(static_cast<c10::DeviceIndex>(device_index)));
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
  // floating-point input gets a node that collects the input's gradient
  // (torch_internals::collect_grad).
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
    const torch_internals::CpuRngState* kept =
        replay_ ? rng_states_->find(layer, microbatch) : nullptr;
    if (kept != nullptr) {
      torch_internals::set_cpu_rng_state(generator, *kept);
      return;
    }
    generator.set_current_seed(seed);
    if (!replay_) rng_states_->keep(layer, microbatch, torch_internals::cpu_rng_state(generator));
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
    if (THPVariable_Check(output.ptr())) {
      const at::Tensor result = THPVariable_Unpack(output.ptr());
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

void bind_layer_loop(py::module_& m) {
  py::class_<TimingMark, std::shared_ptr<TimingMark>>(
      m, "TimingMark", "A timing event on a CUDA device's compute stream (see LayerLoop).")
      .def("query", &TimingMark::query, "Whether the event completed.")
      .def("elapsed_time", &TimingMark::elapsed_time, py::arg("end"),
           "Milliseconds from this event to `end` (both completed).");
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
  m.def("layer_seed", &layer_seed, py::arg("call_seed"), py::arg("layer"), py::arg("microbatch"),
        py::arg("fresh"),
        "The seed of the generators for (call, layer, microbatch) (splitmix64 finaliser).");
}

}  // namespace roundpipe::bindings
