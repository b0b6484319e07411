// The layer calls of one stage of one pipelined call: the native side of
// roundpipe/call/layer_loop.py (LayerCalls). At short sequences a device finishes a layer in about
// a millisecond, so the host's Python work around each layer caps throughput; this loop does per
// layer x microbatch what Python would: reseed, point the recompute context, NVTX range, module
// call, timing, and for a backward stage the recompute + backward of its segments.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "call/module_call.h"
#include "call/saved_inputs.h"

namespace roundpipe::call {

namespace py = pybind11;

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
                         bool fresh);

// The layer calls of one stage of one pipelined call (roundpipe.call.layer_loop.LayerCalls): for
// each layer of a run, reseed the generators, point the recompute context at the layer, call the
// module (inside its NVTX range, when ranges are marked) and time it. What is the same for every
// layer x microbatch of the stage is given once, here. Called with the GIL. Hidden, as
// pybind11's own types are: it holds Python objects.
class __attribute__((visibility("hidden"))) LayerLoop {
 public:
  LayerLoop(py::list modules, std::uint64_t call_seed, bool fresh,
            std::vector<at::Generator> generators, py::object context, py::object mark,
            const std::string& timing, std::int64_t device_index,
            std::shared_ptr<RngStates> rng_states, bool replay, py::object cut);

  // Runs layers [first, stop) on `value` for `microbatch` and returns the last one's output; layer
  // 0 takes `value` as (args, kwargs). The context's `layer` names the layer that raised, if one
  // did.
  py::object run(std::int64_t first, std::int64_t stop, std::int64_t microbatch, py::object value);

  // run over microbatches first_microbatch, first_microbatch + 1, ... (values[i] the input of
  // the i-th), keeping the input of each layer in `keep` (ascending, within [first, stop)) for
  // the backward pass: with `kept` given a lone tensor is kept there (a private detached copy,
  // requiring grad as the input did), anything else by keeper(layer, microbatch, input). Returns
  // the outputs. The context's `layer` and `microbatch` name the layer that raised, if one did.
  py::list run_keeping(std::int64_t first, std::int64_t stop, std::int64_t first_microbatch,
                       const py::list& values, const std::vector<std::int64_t>& keep,
                       const std::shared_ptr<KeptInputs>& kept, const py::object& keeper);

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
                                const py::object& fallback);

  // recompute_backward for each of `microbatches` in turn (grads[i] the gradient of the last
  // output of the i-th), from the inputs `kept` holds (see KeptInputs::covers), which stay as
  // they are when `retained` (a later recompute may start from them again: each is copied
  // first). Returns the input gradients, in the same order.
  py::list recompute_backward_kept(std::int64_t first, std::int64_t stop,
                                   const std::vector<std::int64_t>& microbatches,
                                   const KeptInputs& kept, bool retained,
                                   const std::vector<std::optional<at::Tensor>>& grads,
                                   bool per_layer, const py::object& fallback);

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

  void check_layers(const char* method, std::int64_t first, std::int64_t stop) const;

  // Recompute starts from a kept input: never layer 0, which takes the call's (args, kwargs).
  void check_recompute(const char* method, std::int64_t first, std::int64_t stop) const;

  // The segments of recompute_backward for one microbatch, last first, with the context entered;
  // returns the gradient of layer first's input.
  std::optional<at::Tensor> recompute_segments(std::int64_t first, std::int64_t stop,
                                               std::int64_t microbatch,
                                               const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& saved,
                                               std::optional<at::Tensor> grad, bool per_layer,
                                               const py::object& fallback);

  void leave_after_failure();

  // Seeds `generator` with `seed` for (layer, microbatch). A CPU generator replaying a forward
  // takes the state that forward kept instead (what seeding makes: that engine, no cached normal
  // sample); recording one, it keeps the seeded state.
  void reseed(at::Generator& generator, std::uint64_t seed, std::int64_t layer,
              std::int64_t microbatch);

  // One segment of recompute_backward: layers [begin, end) recomputed in grad mode from
  // `stage_input` (copied first when `saved`, what it was uploaded from, is given and shares its
  // memory), then backpropagated from `grad`. Returns the gradient of the input, or nullopt when
  // none reached it.
  std::optional<at::Tensor> segment(std::int64_t begin, std::int64_t end, std::int64_t microbatch,
                                    const py::int_& mb, const at::Tensor& stage_input,
                                    const at::Tensor* saved, std::optional<at::Tensor> grad,
                                    const py::object& fallback);

  void set_running(bool running) { context_.attr(running_key_) = py::bool_(running); }

  void leave_context() const;

  // One layer: reseed the generators, point the context at the layer, call it.
  // (`pointed`: the context already points at the layer.)
  py::object step(std::int64_t layer, std::int64_t microbatch, const py::int_& mb,
                  const py::object& value, bool pointed = false);

  // Points the context at (layer, microbatch): what a failure from here on names.
  void point(std::int64_t layer, const py::int_& mb);

  py::object call(std::int64_t layer, const py::int_& mb, const py::object& value);

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

}  // namespace roundpipe::call
