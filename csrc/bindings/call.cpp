// roundpipe._C's pipeline-call part (csrc/call/): stages, saved inputs, the layer loop, backward
// stages and transfers.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "call/backward_stage.h"
#include "call/layer_loop.h"
#include "call/saved_inputs.h"
#include "call/stage.h"
#include "call/transfers.h"
#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::bindings {

void bind_call(py::module_& m) {
  m.def("empty_placed", &call::empty_placed, py::arg("tensor"), py::arg("device"),
        "An uninitialised tensor like `tensor` on `device` whose first element sits as far past "
        "an alignment boundary (64 bytes on the host, 512 on CUDA) as tensor's: copies a layer "
        "takes round as the original would.");
  m.def("plain_copy", &call::plain_copy, py::arg("tensor"),
        "tensor.detach().clone(), placed as `tensor` is (see empty_placed).");
  m.def("graph_cut", &call::graph_cut, py::arg("tensor"),
        "tensor.detach() requiring grad as tensor does, through one node of its own (no leaf): "
        "what a forward stage's layer passes on in grad mode without keeping its graph.");
  py::class_<call::RngStates, std::shared_ptr<call::RngStates>>(
      m, "RngStates",
      "The CPU generator states a call's forward layers were seeded with, kept for their "
      "recompute (at most 4096).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def_property_readonly("kept", &call::RngStates::kept, "How many states are kept.");
  py::class_<call::KeptInputs, std::shared_ptr<call::KeptInputs>>(
      m, "KeptInputs",
      "The lone-tensor layer inputs a call's forward stages keep for its recompute, per (layer, "
      "microbatch).")
      .def(py::init<std::int64_t, std::int64_t>(), py::arg("layers"), py::arg("microbatches"))
      .def(
          "find",
          [](const call::KeptInputs& kept, std::int64_t layer,
             std::int64_t microbatch) -> std::optional<at::Tensor> {
            const at::Tensor& input = kept.find(layer, microbatch);
            if (!input.defined()) return std::nullopt;
            return input;
          },
          py::arg("layer"), py::arg("microbatch"),
          "The input kept for (layer, microbatch), or None.")
      .def("covers", &call::KeptInputs::covers, py::arg("first"), py::arg("stop"),
           py::arg("microbatches"), py::arg("per_layer"),
           "Whether the inputs of layers [first, stop)'s segments (the first layer's, or with "
           "per_layer each layer's) are kept for each of `microbatches`.");
  py::class_<call::GradReach, std::shared_ptr<call::GradReach>>(
      m, "GradReach", "Flags which of `tensors` (leaves) an AccumulateGrad node ran for.")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("tensors"))
      .def("reached", &call::GradReach::reached,
           "Indices of the tensors that received a gradient since construction.");
  m.def(
      "upload_stage",
      [](int device_index, c10::Device device, const std::optional<at::Tensor>& arena,
         std::int64_t param_begin, std::int64_t param_end,
         const std::vector<std::pair<std::int64_t, std::int64_t>>& runs,
         const executor::EventPtr& fence, const std::vector<std::int64_t>& offsets,
         const std::vector<at::Tensor>& params, bool with_grads, std::int64_t grad_begin,
         std::int64_t grad_end, const std::vector<std::int64_t>& grad_offsets,
         const std::vector<std::int64_t>& trained,
         const std::optional<at::Tensor>& grad_arena) -> py::tuple {
        call::StageBuffers made = call::upload_stage(
            device_index, device, arena, param_begin, param_end, runs, fence, offsets, params,
            with_grads, grad_begin, grad_end, grad_offsets, trained, grad_arena);
        return py::make_tuple(made.buffer, made.uploaded, made.views, made.grads, made.reach);
      },
      py::arg("device_index"), py::arg("device"), py::arg("arena"), py::arg("param_begin"),
      py::arg("param_end"), py::arg("runs"), py::arg("fence"), py::arg("offsets"),
      py::arg("params"), py::arg("with_grads"), py::arg("grad_begin"), py::arg("grad_end"),
      py::arg("grad_offsets"), py::arg("trained"), py::arg("grad_arena") = py::none(),
      "A stage's buffers, filled from the parameter arena when given: (buffer, uploaded event "
      "or None, parameter views, gradient buffer or None, GradReach of the trained views or "
      "None); the gradient views become the trained views' .grad, and start from grad_arena's "
      "bytes when given (else zero).");
  m.def("rebind_parameters", &call::rebind_parameters, py::arg("owners"), py::arg("names"),
        py::arg("tensors"),
        "owner._parameters[name] = tensor per binding; returns what each held before (on an "
        "error the entries already replaced are put back).");
  m.def("changed_in_place", &call::changed_in_place, py::arg("tensors"),
        "Indices of the tensors whose version counter is no longer 0.");
  m.def("download_grads", &call::download_grads, py::arg("device_index"), py::arg("arena"),
        py::arg("grads"), py::arg("first_byte"), py::arg("runs"), py::arg("staging"),
        py::arg("replace") = false,
        "Accumulate a stage's gradient buffer into the gradient arena (with replace: copy it "
        "over), one (begin, end, dtype) byte run at a time on the device's copy engine; returns "
        "the events.");
  py::class_<call::TimingMark, std::shared_ptr<call::TimingMark>>(
      m, "TimingMark", "A timing event on a CUDA device's compute stream (see LayerLoop).")
      .def("query", &call::TimingMark::query, "Whether the event completed.")
      .def("elapsed_time", &call::TimingMark::elapsed_time, py::arg("end"),
           "Milliseconds from this event to `end` (both completed).");
  py::class_<call::LayerLoop>(
      m, "LayerLoop",
      "The layer calls of one stage: reseed, recompute context, NVTX range, "
      "module call and timing per layer, in one native loop.")
      .def(py::init<py::list, std::uint64_t, bool, std::vector<at::Generator>, py::object,
                    py::object, const std::string&, std::int64_t, std::shared_ptr<call::RngStates>,
                    bool, py::object>(),
           py::arg("modules"), py::arg("call_seed"), py::arg("fresh"), py::arg("generators"),
           py::arg("context"), py::arg("mark"), py::arg("timing"), py::arg("device_index"),
           py::arg("rng_states") = nullptr, py::arg("replay") = false, py::arg("cut") = py::none())
      .def("run", &call::LayerLoop::run, py::arg("first"), py::arg("stop"), py::arg("microbatch"),
           py::arg("value"), "Runs layers [first, stop) on value; returns the last output.")
      .def("run_keeping", &call::LayerLoop::run_keeping, py::arg("first"), py::arg("stop"),
           py::arg("first_microbatch"), py::arg("values"), py::arg("keep"), py::arg("kept"),
           py::arg("keeper"),
           "run over consecutive microbatches, keeping the inputs of the layers in keep for "
           "backward (lone tensors in `kept`, if given; the others by keeper(layer, microbatch, "
           "input)); returns the outputs.")
      .def("recompute_backward", &call::LayerLoop::recompute_backward, py::arg("first"),
           py::arg("stop"), py::arg("microbatch"), py::arg("inputs"), py::arg("saved"),
           py::arg("grad"), py::arg("per_layer"), py::arg("fallback"),
           "Recompute + backward of layers [first, stop) from their saved inputs (`saved`: what "
           "they were uploaded from, when a later recompute may start from it again, else []); "
           "returns the gradient of the first layer's input or None.")
      .def("recompute_backward_kept", &call::LayerLoop::recompute_backward_kept, py::arg("first"),
           py::arg("stop"), py::arg("microbatches"), py::arg("kept"), py::arg("retained"),
           py::arg("grads"), py::arg("per_layer"), py::arg("fallback"),
           "recompute_backward for each of `microbatches` from the inputs `kept` holds (copied "
           "first when `retained`); returns the input gradients.")
      .def_property_readonly("failure", &call::LayerLoop::failure,
                             "(phase, first, stop, microbatch) of the segment "
                             "recompute_backward last raised in.")
      .def("take_backward_host_times", &call::LayerLoop::take_backward_host_times,
           "(layers, seconds) of the backwards since the last call, each split evenly over its "
           "layers.")
      .def("take_backward_device_times", &call::LayerLoop::take_backward_device_times,
           "(first, stop, start, end) TimingMarks of each backward since the last call.")
      .def("take_host_times", &call::LayerLoop::take_host_times,
           "(layers, seconds) of the layer runs since the last call, in order.")
      .def("take_device_times", &call::LayerLoop::take_device_times,
           "(layer, start, end) TimingMarks of each layer run since the last call, in order.");
  m.def("layer_seed", &call::layer_seed, py::arg("call_seed"), py::arg("layer"),
        py::arg("microbatch"), py::arg("fresh"),
        "The seed of the generators for (call, layer, microbatch) (splitmix64 finaliser).");
  torch_internals::init_local_backward();
  m.def("backward", &call::backward, py::arg("outputs"), py::arg("grads"),
        "torch.autograd.backward(outputs, grads) without the GIL, on the calling thread where "
        "torch's engine would change nothing (see run_backward), else through the engine: one "
        "defined gradient per output; errors are raised as torch.autograd.backward raises them.");
  m.def(
      "local_backward_enabled", &torch_internals::local_backward_enabled,
      "Whether backward passes of recomputed segments may run on the calling thread: a torch "
      "release they were checked on (2.11 to 2.13) with graph exec groups, and "
      "ROUNDPIPE_LOCAL_BACKWARD not 0 when roundpipe was imported; else torch's engine runs all.");
  m.def("backward_counts", &torch_internals::backward_counts,
        "(passes run on the calling thread, passes run by torch's engine) since the process "
        "started: every backward of a recomputed segment and every _C.backward counts once.");
}

}  // namespace roundpipe::bindings
