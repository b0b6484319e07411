// The one native door to torch's private API: the native twin of roundpipe/torch_internals.py.
//
// The rule: no file of csrc/ outside csrc/torch_internals/ includes a private torch header or
// names a private torch type or function; the others call the wrappers below (and those of
// modules.h). Private here means:
//   - any header under torch/csrc/ except torch/csrc/utils/pybind.h, torch/csrc/Exceptions.h and
//     torch/csrc/autograd/python_variable.h (THPVariable_Wrap / THPVariable_Unpack), which
//     torch's extension docs use: autograd nodes, edges, hooks, the engine and its graph tasks,
//     anomaly mode, the JIT tracer;
//   - the c10::impl, at::impl, torch::autograd::impl and any detail namespace (device guard
//     implementations, dispatch-key and TorchDispatchMode thread-local state), and the headers
//     under an impl/ folder;
//   - the *Impl.h internals of ATen and c10 (CPUGeneratorImpl, TensorImpl), dispatch-key guards
//     (ATen/core/LegacyTypeDispatch.h), saved-tensor hook and RecordFunction state;
//   - torch's private Python API reached from C++ (torch._C._set_graph_exec_group, the globals
//     of torch._dynamo.compiled_autograd, nn.Module's underscored attributes: modules.h), which
//     is why no string outside this folder names an underscored attribute
//     (tests/test_native_door.py).
// Public, usable anywhere: torch/extension.h's ATen (ATen/ATen.h, ATen/ops/*, at::Tensor,
// at::Generator, at::accelerator), c10's Device, Stream, Event and utilities, c10/cuda's
// streams and caching allocator, and the three torch/csrc headers named above.
//
// Why the local backward lives here, not behind wrappers: it restates torch's engine node by
// node (ready order, validate_outputs, InputBuffer's sums, hook lists), so every line of it is
// private API, and a wrapper per Node member would be the same code spread over two files.
//
// Each wrapper says which torch releases it was checked on: read against each release's headers
// and compiled against them (CI builds and tests 2.11 with CUDA and 2.13 on the CPU). A torch
// outside 2.11 to 2.13 may still build, but the local backward then sends every pass to torch's
// engine.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace roundpipe::torch_internals {

// --- Autograd graphs --------------------------------------------------------------------------

// Gives `tensor` (a fresh tensor without history, floating point or complex) a history of one
// node that ends the backward pass there and keeps the gradient that reaches it in the returned
// slot (undefined until one does). The tensor is then not a leaf, as a layer's input is in plain
// PyTorch: a layer may change it in place, and the pass runs one node for it where a leaf behind
// a clone would run two. Checked on torch 2.11, 2.12, 2.13 (Node, create_gradient_edge).
std::shared_ptr<at::Tensor> collect_grad(at::Tensor& tensor);

// Sets *flag to 1 whenever `leaf`'s AccumulateGrad node runs, the node made here if it was not
// yet; returns what keeps that node alive (every graph built while it lives then uses the same
// one), or null when `leaf` requires no grad. The flag is the one hook the local backward runs
// itself. Checked on torch 2.11, 2.12, 2.13 (impl::grad_accumulator, FunctionPostHook).
std::shared_ptr<void> flag_accumulation(const at::Tensor& leaf, std::uint8_t* flag);

// --- Tensors ----------------------------------------------------------------------------------

// A tensor of its own (no autograd view, no dispatch) on `base`'s storage, with `like`'s dtype,
// sizes and strides, starting `offset` elements of that dtype into the storage. Checked on torch
// 2.11, 2.12, 2.13 (TensorImpl's constructor and set_sizes_and_strides).
at::Tensor tensor_on_storage(const at::Tensor& base, const at::Tensor& like, std::int64_t offset);

// What make() returns, with autograd's dispatch keys skipped while it runs: the tensors it makes
// are unknown to autograd (no view of another, no history). Checked on torch 2.11, 2.12, 2.13
// (AutoDispatchBelowADInplaceOrView).
at::Tensor below_autograd(c10::function_ref<at::Tensor()> make);

// Moves `tensor`'s version counter on, as an in-place op does (a kernel that wrote it behind the
// dispatcher's back). Checked on torch 2.11, 2.12, 2.13 (TensorImpl::bump_version).
void bump_version(const at::Tensor& tensor);

// --- Generators -------------------------------------------------------------------------------

// The Mersenne Twister state of a CPU generator.
using CpuRngState = at::mt19937;

// `generator`'s state (a CPU generator; the caller holds generator.mutex()). Checked on torch
// 2.11, 2.12, 2.13 (CPUGeneratorImpl::engine).
CpuRngState cpu_rng_state(const at::Generator& generator);

// Puts `state` in `generator` (a CPU generator; the caller holds generator.mutex()) with no
// cached normal sample: what seeding it to that state makes. Checked on torch 2.11, 2.12, 2.13
// (CPUGeneratorImpl::set_engine, set_next_*_normal_sample).
void set_cpu_rng_state(const at::Generator& generator, const CpuRngState& state);

// --- The JIT ----------------------------------------------------------------------------------

// Whether torch.jit.trace is tracing on this thread. Checked on torch 2.11, 2.12, 2.13
// (jit::tracer::isTracing).
bool jit_tracing();

// --- The local backward -----------------------------------------------------------------------
//
// A backward pass run on the calling thread, node by node, where torch's engine would run the
// same nodes in the same order but pay for a graph task around them (each engine call builds one,
// captures the thread-local state, switches it in and out around every node and runs final
// callbacks: for a small layer as much as its backward kernels). run_backward runs the graphs it
// knows to be safe exactly as the engine would: the same ready order (the highest sequence number
// first), the same checks of every node's gradients, the same sums where gradients meet, graph
// freed as it goes. What it knows to be safe is an allow-list; everything else goes to torch's
// engine:
//   - node kinds: torch's own C++ nodes (those defined in the library that defines
//     AccumulateGrad and the generated backward nodes) and collect_grad's; a Python node (custom
//     Functions, compiled code), an extension's C++ node or any node whose library cannot be
//     told is not on the list;
//   - hooks: none, but flag_accumulation's flag among a node's post hooks. Every hook list Node
//     has in 2.11 to 2.13 is read; a hook list a later torch adds is covered by the version gate;
//   - inputs: no tensor subclass, one device and its current stream (or the CPU only);
//   - the moment: no anomaly mode, profiler callback, TorchDispatchMode, saved-tensor hooks,
//     compiled autograd (or a state of it that cannot be read), nor an engine pass around it
//     that computes only some gradients;
//   - the torch: 2.11 to 2.13 with graph exec groups, ROUNDPIPE_LOCAL_BACKWARD not "0".

// Reads ROUNDPIPE_LOCAL_BACKWARD and looks up what BackwardScope calls; once, with the GIL held,
// before any other call below.
void init_local_backward();

// Whether passes may run on the calling thread at all (see above).
bool local_backward_enabled();

// (passes run on the calling thread, passes run by torch's engine) since the process started.
std::pair<std::int64_t, std::int64_t> backward_counts();

// What a backward pass needs from the Python side, made with the GIL held before the pass and
// dropped with it held after. torch.utils.checkpoint (use_reentrant=False) tells one backward pass
// from another by the engine's graph task, of which passes on the calling thread have none; inside
// a graph exec group (torch.utils.checkpoint.GraphExecGroup) it goes by the group instead. The
// scope makes a fresh group current for the pass unless one is (as each engine pass has a graph
// task of its own), so that a layer checkpointing part of itself recomputes it once per pass, as
// under the engine. Checked on torch 2.11, 2.12, 2.13 (_get_graph_exec_group,
// _set_graph_exec_group, compiled_autograd's globals).
class BackwardScope {
 public:
  BackwardScope();
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

  // Whether the pass may run on the calling thread (the graph decides the rest).
  bool may_run_locally() const { return may_run_locally_; }

 private:
  bool may_run_locally_ = false;
  bool group_set_ = false;
};

// torch::autograd::backward(roots, grads) with retain_graph and create_graph off, on the calling
// thread where `scope` and the graph allow (see above), else through torch's engine (its
// PythonEngine, so Python hooks and custom Functions behave as under torch.autograd.backward).
// Call without the GIL. Checked on torch 2.11, 2.12, 2.13 (Engine::execute, compute_dependencies,
// InputBuffer::add, validate_outputs, graph task exec info).
void run_backward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                  const BackwardScope& scope);

}  // namespace roundpipe::torch_internals
