#include "bindings/local_backward.h"

#include "bindings/bindings.h"

#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace roundpipe::bindings {
namespace {

namespace ag = torch::autograd;

std::atomic<std::int64_t> local_runs{0};
std::atomic<std::int64_t> engine_runs{0};

// The torch releases the passes on the calling thread were checked against (CI builds and tests
// them); any other sends every pass to torch's engine, whose internals this file restates.
constexpr bool kCheckedTorch =
    TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11 && TORCH_VERSION_MINOR <= 13;

// Whether passes may run on the calling thread at all: a checked torch with graph exec groups,
// and ROUNDPIPE_LOCAL_BACKWARD not "0" (read once, when the module loads).
bool local_enabled = false;

// The device every accelerator tensor of the graph lives on, and its current stream there:
// InputBuffer then never synchronises two streams, and the engine's per-node stream guard and its
// final synchronisation of leaf streams change nothing.
struct Placement {
  std::optional<c10::Device> device;  // unset: CPU only so far
  bool one_device_and_stream(const c10::Device& where, const c10::Stream& stream) {
    if (where.is_cpu()) return stream.device().is_cpu();
    if (!device) {
      const auto* guard = c10::impl::getDeviceGuardImpl(where.type());
      if (guard->getDevice() != where || guard->getStream(where) != stream) return false;
      device = where;
      return true;
    }
    return *device == where &&
           c10::impl::getDeviceGuardImpl(where.type())->getStream(where) == stream;
  }
};

// Whether `node` is a Python node (a custom autograd.Function's, compiled code's). libtorch_python
// does not export torch::autograd::PyNode's type information, so the type is told by its mangled
// name (the Itanium C++ ABI's, which every compiler torch supports on Linux and macOS uses).
bool is_python_node(const ag::Node& node) {
  const char* name = typeid(node).name();
  if (*name == '*') ++name;  // GCC marks names of types with internal linkage
  return std::strcmp(name, "N5torch8autograd6PyNodeE") == 0;
}

// Whether the engine would do nothing but what run_here does for `node`: no hooks (but
// ReachedFlag, which run_here calls as the engine would), a node of torch's C++ (a Python node
// runs user code that may ask for the graph task), no tensor subclass among its inputs, and every
// input on one device and its current stream (or the CPU).
bool runs_here(ag::Node& node, Placement& placement) {
  if (!node.pre_hooks().empty() || !node.tensor_pre_hooks().empty() ||
      !node.retains_grad_hooks().empty() || node.tensor_post_acc_grad_hooks() != nullptr) {
    return false;
  }
  for (const auto& hook : node.post_hooks()) {
    if (dynamic_cast<const ReachedFlag*>(hook.get()) == nullptr) return false;
  }
  if (is_python_node(node)) return false;
  bool cpu = false;
  bool accelerator = false;
  for (std::uint32_t i = 0; i < node.num_inputs(); ++i) {
    const ag::InputMetadata& metadata = node.input_metadata(i);
    if (metadata.is_tensor_subclass()) return false;
    const c10::Device device = metadata.device();
    (device.is_cpu() ? cpu : accelerator) = true;
    if (!placement.one_device_and_stream(device, metadata.stream())) return false;
  }
  // A node between the CPU and a device makes InputBuffer pick a stream of its own to sum on.
  return !(cpu && accelerator);
}

// What Engine::compute_dependencies counts: for every node reachable from the roots, the number of
// edges into it. False when a node cannot run here.
bool count_dependencies(const ag::edge_list& roots,
                        std::unordered_map<ag::Node*, int>& dependencies) {
  Placement placement;
  std::vector<ag::Node*> stack;
  const auto reach = [&](const ag::Edge& edge) {
    ag::Node* next = edge.function.get();
    if (next == nullptr) return;
    if (dependencies[next]++ == 0) stack.push_back(next);
  };
  for (const ag::Edge& root : roots) reach(root);
  while (!stack.empty()) {
    ag::Node* node = stack.back();
    stack.pop_back();
    if (!runs_here(*node, placement)) return false;
    for (const ag::Edge& edge : node->next_edges()) reach(edge);
  }
  return true;
}

// A node ready to run and the gradients for it. Kept in a heap by LaterFirst, as the engine's
// ready queue keeps its tasks (a std::priority_queue, which pushes and pops with std::push_heap
// and std::pop_heap): the same pushes then pop in the same order, the highest sequence number
// first.
struct Ready {
  NodeRef node;
  std::vector<at::Tensor> inputs;
};
struct LaterFirst {
  bool operator()(const Ready& a, const Ready& b) const {
    return a.node->sequence_nr() < b.node->sequence_nr();
  }
};

// InputBuffer::add's sum for a gradient meeting another on one device and stream: in place into
// a buffer no one else holds, as the engine does, else a new tensor (the same values either way).
void accumulate(at::Tensor& slot, at::Tensor&& grad) {
  if (!grad.defined()) return;
  if (!slot.defined()) {
    slot = std::move(grad);
    return;
  }
  const bool reusable = slot.use_count() == 1 && slot.layout() == c10::kStrided &&
                        grad.layout() == c10::kStrided && slot.is_non_overlapping_and_dense() &&
                        slot.storage().use_count() == 1 && !slot._is_zerotensor();
  if (reusable) {
    slot.add_(grad);
  } else if (slot.is_sparse() && !grad.is_sparse()) {
    slot = grad + slot;  // ATen adds a sparse tensor to a dense one, not the other way round
  } else {
    slot = slot + grad;
  }
}

// The backward of `roots` with gradients `grads` on this thread, as the engine runs it.
void run_here(const ag::edge_list& roots, std::vector<at::Tensor>& grads,
              std::unordered_map<ag::Node*, int>& dependencies) {
  const at::AutoGradMode no_grad(false);  // create_graph off, as the engine's graph task sets
  std::unordered_map<ag::Node*, std::vector<at::Tensor>> waiting;
  std::vector<Ready> ready;
  // What the engine does with a node's output: hand it to the next node, which is ready once
  // every edge into it delivered.
  const auto deliver = [&](const ag::Edge& edge, at::Tensor&& grad) {
    if (!edge.is_valid()) return;
    ag::Node* next = edge.function.get();
    auto buffer = waiting.find(next);
    if (buffer == waiting.end()) {
      buffer = waiting.emplace(next, std::vector<at::Tensor>(next->num_inputs())).first;
    }
    accumulate(buffer->second.at(edge.input_nr), std::move(grad));
    if (--dependencies.at(next) == 0) {
      ready.push_back(Ready{edge.function, std::move(buffer->second)});
      std::push_heap(ready.begin(), ready.end(), LaterFirst{});
      waiting.erase(buffer);
    }
  };
  for (std::size_t i = 0; i < roots.size(); ++i) deliver(roots[i], std::move(grads[i]));
  while (!ready.empty()) {
    std::pop_heap(ready.begin(), ready.end(), LaterFirst{});
    Ready task = std::move(ready.back());
    ready.pop_back();
    ag::Node& node = *task.node;
    node.will_release_variables();
    // With post hooks the engine keeps the inputs for them, which AccumulateGrad counts on when
    // it decides whether it may keep the incoming gradient rather than copy it.
    const bool post_hooks = !node.post_hooks().empty();
    std::vector<at::Tensor> inputs;
    if (post_hooks) inputs = task.inputs;
    std::vector<at::Tensor> outputs = node(std::move(task.inputs));
    ag::validate_outputs(node.next_edges(), outputs, [&](const std::string& message) {
      std::ostringstream error;
      error << "Function " << node.name() << " returned an " << message;
      return error.str();
    });
    node.release_variables();
    if (post_hooks) {
      for (const auto& hook : node.post_hooks()) outputs = (*hook)(outputs, inputs);
    }
    for (std::size_t i = 0; i < outputs.size(); ++i)
      deliver(node.next_edge(i), std::move(outputs[i]));
  }
}

// What BackwardScope calls, looked up when the module is imported and kept for the life of the
// process (never destroyed: the interpreter may be gone by then): torch._C's _get_graph_exec_group
// and _set_graph_exec_group and torch.utils.checkpoint.GraphExecGroup, None where this torch has
// none; and the name of compiled autograd's module, made once rather than per pass.
struct GroupCalls {
  py::object get, set, make;
  py::str compiled_autograd{"torch._dynamo.compiled_autograd"};
};
const GroupCalls* group_calls = nullptr;

const GroupCalls* find_group_calls() {
  auto* found = new GroupCalls{py::none(), py::none(), py::none()};
  const py::module_ c = py::module_::import("torch._C");
  if (py::hasattr(c, "_set_graph_exec_group") && py::hasattr(c, "_get_graph_exec_group")) {
    const py::module_ checkpoint = py::module_::import("torch.utils.checkpoint");
    if (py::hasattr(checkpoint, "GraphExecGroup")) {
      found->get = c.attr("_get_graph_exec_group");
      found->set = c.attr("_set_graph_exec_group");
      found->make = checkpoint.attr("GraphExecGroup");
    }
  }
  return found;
}

// Whether torch._dynamo's compiled autograd is on.
bool compiled_autograd_enabled() {
  PyObject* module = PyImport_GetModule(group_calls->compiled_autograd.ptr());
  if (module == nullptr) {
    if (PyErr_Occurred() != nullptr) throw py::error_already_set();
    return false;  // never imported: never enabled
  }
  const auto owner = py::reinterpret_steal<py::object>(module);
  return py::bool_(owner.attr("compiled_autograd_enabled")) ||
         py::bool_(owner.attr("in_compiled_autograd_region"));
}

}  // namespace

BackwardScope::BackwardScope() {
  const GroupCalls& calls = *group_calls;
  if (!local_enabled || compiled_autograd_enabled()) return;
  may_run_here_ = true;
  if (!calls.get().is_none()) return;  // the caller's group holds for the pass
  calls.set(calls.make());
  group_set_ = true;
}

BackwardScope::~BackwardScope() {
  if (!group_set_) return;
  const py::error_scope pending;  // a failed pass may unwind through here with its error set
  try {
    group_calls->set(py::none());
  } catch (const py::error_already_set&) {
    // Nothing to undo: the group is only a key of checkpoint's recompute caches.
  }
}

void run_backward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                  const BackwardScope& scope) {
  // Inside a pass of the engine that computes only some gradients (torch.autograd.grad,
  // backward(inputs=...)), torch's nodes ask that pass which of their outputs are needed, where a
  // nested engine call would answer for itself: all of them. Saved-tensor hooks around the call
  // packed what the nodes unpack: their unpack hooks are user code that may ask for the graph
  // task. Anomaly mode and the profiler's callbacks record what the engine does per node.
  const auto* outer = ag::get_current_graph_task_exec_info();
  bool here = scope.may_run_here() && (outer == nullptr || outer->empty()) &&
              roots.size() == grads.size() && !ag::AnomalyMode::is_enabled() &&
              !at::hasCallbacks() && !c10::impl::TorchDispatchModeTLS::any_modes_set() &&
              !at::SavedTensorDefaultHooks::get_hooks().has_value();
  ag::edge_list edges;
  std::vector<at::Tensor> root_grads;
  std::unordered_map<ag::Node*, int> dependencies;
  if (here) {
    edges.reserve(roots.size());
    for (std::size_t i = 0; i < roots.size() && here; ++i) {
      // A root without history (a leaf) or whose gradient is not of its kind: the engine's own
      // checks and messages.
      here = roots[i].defined() && grads[i].defined() && roots[i].grad_fn() != nullptr &&
             roots[i].is_complex() == grads[i].is_complex();
      if (here) edges.push_back(ag::impl::gradient_edge(roots[i]));
    }
  }
  if (here) {
    root_grads = grads;
    // As Engine::execute checks (and casts) the root gradients.
    ag::validate_outputs(edges, root_grads, [](const std::string& message) { return message; });
    here = count_dependencies(edges, dependencies);
  }
  if (!here) {
    engine_runs.fetch_add(1, std::memory_order_relaxed);
    ag::backward(roots, grads);
    return;
  }
  local_runs.fetch_add(1, std::memory_order_relaxed);
  run_here(edges, root_grads, dependencies);
}

void bind_local_backward(py::module_& m) {
  group_calls = find_group_calls();
  const char* switched = std::getenv("ROUNDPIPE_LOCAL_BACKWARD");
  const bool switched_off = switched != nullptr && std::strcmp(switched, "0") == 0;
  local_enabled = kCheckedTorch && !switched_off && !group_calls->set.is_none();
  m.def(
      "local_backward_enabled", [] { return local_enabled; },
      "Whether backward passes of recomputed segments may run on the calling thread: a torch "
      "release they were checked on (2.11 to 2.13) with graph exec groups, and "
      "ROUNDPIPE_LOCAL_BACKWARD not 0 when roundpipe was imported; else torch's engine runs all.");
  m.def(
      "backward_counts",
      [] {
        return std::make_pair(local_runs.load(std::memory_order_relaxed),
                              engine_runs.load(std::memory_order_relaxed));
      },
      "(passes run on the calling thread, passes run by torch's engine) since the process "
      "started: every backward of a recomputed segment and every _C.backward counts once.");
}

}  // namespace roundpipe::bindings
