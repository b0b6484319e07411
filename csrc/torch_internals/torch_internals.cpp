#include "torch_internals/torch_internals.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/record_function.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace roundpipe::torch_internals {
namespace {

namespace ag = torch::autograd;

// Autograd holds its nodes in c10::intrusive_ptr from torch 2.13, in std::shared_ptr before.
using NodeRef = decltype(ag::Edge::function);

template <class T, class... Args>
NodeRef make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodeRef, std::shared_ptr<ag::Node>>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

// collect_grad's node: it keeps the gradient that reaches it and ends the pass there.
class InputGrad final : public ag::Node {
 public:
  explicit InputGrad(std::shared_ptr<at::Tensor> slot) : slot_(std::move(slot)) {}
  ag::variable_list apply(ag::variable_list&& grads) override {
    *slot_ = std::move(grads.at(0));
    return {};
  }
  std::string name() const override { return "roundpipe::InputGrad"; }

 private:
  std::shared_ptr<at::Tensor> slot_;
};

// flag_accumulation's post hook: sets a flag when its node runs and changes nothing.
struct ReachedFlag final : ag::FunctionPostHook {
  explicit ReachedFlag(std::uint8_t* flag) : flag_(flag) {}
  ag::variable_list operator()(const ag::variable_list& outputs,
                               const ag::variable_list&) override {
    *flag_ = 1;
    return outputs;
  }
  std::uint8_t* flag_;
};

}  // namespace

std::shared_ptr<at::Tensor> collect_grad(at::Tensor& tensor) {
  auto slot = std::make_shared<at::Tensor>();
  ag::create_gradient_edge(tensor, make_node<InputGrad>(slot));
  return slot;
}

std::shared_ptr<void> flag_accumulation(const at::Tensor& leaf, std::uint8_t* flag) {
  NodeRef accumulator = ag::impl::grad_accumulator(leaf);
  if (!accumulator) return nullptr;  // requires no grad: nothing can reach it
  accumulator->add_post_hook(std::make_unique<ReachedFlag>(flag));
  return std::make_shared<NodeRef>(std::move(accumulator));
}

at::Tensor tensor_on_storage(const at::Tensor& base, const at::Tensor& like, std::int64_t offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(base.storage()), base.key_set(),
                                                   like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), offset);
  return at::Tensor(std::move(impl));
}

at::Tensor below_autograd(c10::function_ref<at::Tensor()> make) {
  const at::AutoDispatchBelowADInplaceOrView below;
  return make();
}

void bump_version(const at::Tensor& tensor) { tensor.unsafeGetTensorImpl()->bump_version(); }

CpuRngState cpu_rng_state(const at::Generator& generator) {
  return at::check_generator<at::CPUGeneratorImpl>(generator)->engine();
}

void set_cpu_rng_state(const at::Generator& generator, const CpuRngState& state) {
  auto* cpu = at::check_generator<at::CPUGeneratorImpl>(generator);
  cpu->set_engine(state);
  cpu->set_next_float_normal_sample(std::nullopt);
  cpu->set_next_double_normal_sample(std::nullopt);
}

bool jit_tracing() { return torch::jit::tracer::isTracing(); }

// --- The local backward -----------------------------------------------------------------------

namespace {

std::atomic<std::int64_t> local_runs{0};
std::atomic<std::int64_t> engine_runs{0};

// The torch releases the passes on the calling thread were checked against; any other sends every
// pass to torch's engine, whose internals this file restates.
constexpr bool kCheckedTorch =
    TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11 && TORCH_VERSION_MINOR <= 13;

// Whether passes may run on the calling thread at all (init_local_backward decides, once).
bool local_enabled = false;

// The shared object that holds `address`, or null when none can be told.
const void* library_of(const void* address) {
  Dl_info info;
  if (dladdr(address, &info) == 0) return nullptr;
  return info.dli_fbase;
}

// The library whose C++ nodes are known to run here as under the engine: the one that defines
// AccumulateGrad and the generated backward nodes (libtorch_cpu), told from the type information
// of such nodes (every one of them has its virtual functions defined there, so its type
// information lives there). Null: none could be told, and no torch node is on the list.
const void* torch_nodes_library = nullptr;

// Finds torch_nodes_library from an AccumulateGrad, a generated node and a generated view node;
// null unless all three agree.
const void* find_torch_nodes_library() {
  try {
    // Whatever mode the import runs in, these build a graph.
    const c10::InferenceMode not_inference(false);
    const at::AutoGradMode grad(true);
    const at::Tensor leaf = at::zeros({2}).requires_grad_();
    const NodeRef accumulator = ag::impl::grad_accumulator(leaf);
    const at::Tensor product = leaf * 2;
    const at::Tensor view = leaf.view({1, 2});
    if (!accumulator || !product.grad_fn() || !view.grad_fn()) return nullptr;
    const void* library = library_of(&typeid(*accumulator));
    const bool agree = library != nullptr && library_of(&typeid(*product.grad_fn())) == library &&
                       library_of(&typeid(*view.grad_fn())) == library;
    return agree ? library : nullptr;
  } catch (const std::exception&) {
    return nullptr;  // a mode around the import refused the probe: no torch node on the list
  }
}

// Whether `node`'s kind is on the allow-list: torch's own C++ nodes and InputGrad. Python nodes
// (their type lives in libtorch_python), an extension's C++ nodes and any node whose library
// cannot be told are not. Looked up once per node type and thread.
bool known_kind(const ag::Node& node) {
  const std::type_info& type = typeid(node);
  if (type == typeid(InputGrad)) return true;
  thread_local std::unordered_map<const std::type_info*, bool> known;
  auto found = known.find(&type);
  if (found == known.end()) {
    const bool torch_node =
        torch_nodes_library != nullptr && library_of(&type) == torch_nodes_library;
    found = known.emplace(&type, torch_node).first;
  }
  return found->second;
}

// Whether `node`'s hooks are on the allow-list: none in any of Node's hook lists, but
// ReachedFlag among its post hooks (which run_locally calls as the engine would).
bool known_hooks(ag::Node& node) {
  if (!node.pre_hooks().empty() || !node.tensor_pre_hooks().empty() ||
      !node.retains_grad_hooks().empty() || node.tensor_post_acc_grad_hooks() != nullptr) {
    return false;
  }
  for (const auto& hook : node.post_hooks()) {
    if (dynamic_cast<const ReachedFlag*>(hook.get()) == nullptr) return false;
  }
  return true;
}

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

// Whether the engine would do nothing but what run_locally does for `node`: a known kind with known
// hooks, no tensor subclass among its inputs, and every input on one device and its current
// stream (or the CPU).
bool eligible_locally(ag::Node& node, Placement& placement) {
  if (!known_kind(node) || !known_hooks(node)) return false;
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
    if (!eligible_locally(*node, placement)) return false;
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
void run_locally(const ag::edge_list& roots, std::vector<at::Tensor>& grads,
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
// none or they cannot be looked up; and the name of compiled autograd's module, made once rather
// than per pass.
struct GroupCalls {
  py::object get, set, make;
  py::str compiled_autograd{"torch._dynamo.compiled_autograd"};
};
const GroupCalls* group_calls = nullptr;

const GroupCalls* find_group_calls() {
  auto* found = new GroupCalls{py::none(), py::none(), py::none()};
  try {
    const py::module_ c = py::module_::import("torch._C");
    const py::module_ checkpoint = py::module_::import("torch.utils.checkpoint");
    if (py::hasattr(c, "_set_graph_exec_group") && py::hasattr(c, "_get_graph_exec_group") &&
        py::hasattr(checkpoint, "GraphExecGroup")) {
      found->get = c.attr("_get_graph_exec_group");
      found->set = c.attr("_set_graph_exec_group");
      found->make = checkpoint.attr("GraphExecGroup");
    }
  } catch (const py::error_already_set&) {
    // Left None: every pass goes to the engine.
  }
  return found;
}

// Whether `owner.name` is true; true also when it cannot be read (a renamed global).
bool true_or_unreadable(const py::handle& owner, const char* name) {
  PyObject* value = PyObject_GetAttrString(owner.ptr(), name);
  if (value == nullptr) {
    PyErr_Clear();
    return true;
  }
  const int truth = PyObject_IsTrue(value);
  Py_DECREF(value);
  if (truth < 0) PyErr_Clear();
  return truth != 0;
}

// Whether torch._dynamo's compiled autograd may be on: its module imported and either of its
// globals true, or not readable.
bool compiled_autograd_maybe_on() {
  PyObject* module = PyImport_GetModule(group_calls->compiled_autograd.ptr());
  if (module == nullptr) {
    if (PyErr_Occurred() == nullptr) return false;  // never imported: never enabled
    PyErr_Clear();
    return true;
  }
  const auto owner = py::reinterpret_steal<py::object>(module);
  return true_or_unreadable(owner, "compiled_autograd_enabled") ||
         true_or_unreadable(owner, "in_compiled_autograd_region");
}

}  // namespace

void init_local_backward() {
  group_calls = find_group_calls();
  torch_nodes_library = find_torch_nodes_library();
  const char* switched = std::getenv("ROUNDPIPE_LOCAL_BACKWARD");
  const bool switched_off = switched != nullptr && std::strcmp(switched, "0") == 0;
  local_enabled = kCheckedTorch && !switched_off && !group_calls->set.is_none() &&
                  torch_nodes_library != nullptr;
}

bool local_backward_enabled() { return local_enabled; }

std::pair<std::int64_t, std::int64_t> backward_counts() {
  return {local_runs.load(std::memory_order_relaxed), engine_runs.load(std::memory_order_relaxed)};
}

BackwardScope::BackwardScope() {
  const GroupCalls& calls = *group_calls;
  if (!local_enabled || compiled_autograd_maybe_on()) return;
  try {
    if (!calls.get().is_none()) {  // the caller's group holds for the pass
      may_run_locally_ = true;
      return;
    }
    calls.set(calls.make());
  } catch (const py::error_already_set&) {
    return;  // a group that cannot be read or made: the engine runs the pass
  }
  group_set_ = true;
  may_run_locally_ = true;
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
  bool here = scope.may_run_locally() && (outer == nullptr || outer->empty()) &&
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
  run_locally(edges, root_grads, dependencies);
}

}  // namespace roundpipe::torch_internals
