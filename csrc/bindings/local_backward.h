// A backward pass run on the calling thread, node by node, where torch's engine would run the same
// nodes in the same order but pay for a graph task around them.
//
// The pipeline calls the engine once per recomputed segment: per stage and microbatch, or with
// recompute_grain "layer" per layer and microbatch. Each engine call builds a graph task (which
// captures the thread-local state), switches that state in and out around every node, and runs
// final callbacks; for a small layer that costs as much as its backward kernels. The segments the
// pipeline backpropagates are most often plain graphs of torch's own nodes, on one thread and one
// stream, for which none of that changes a result. run_backward runs those itself, exactly as
// the engine would: the same ready order (the node with the highest sequence number first), the
// same checks of every node's gradients (torch::autograd::validate_outputs), the same sums where
// gradients meet, graph freed as it goes. Any graph it cannot vouch for goes to torch's engine:
// hooks on a node or a tensor (but ReachedFlag), Python nodes (custom Functions, compiled code),
// tensor subclasses, more than one device or a stream other than the current one, anomaly mode, an
// active profiler, compiled autograd, an engine pass around it that computes only some gradients.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function_hook.h>

#include <cstdint>
#include <vector>

namespace roundpipe::bindings {

// Autograd holds its nodes in c10::intrusive_ptr in recent torch (2.13 here), in std::shared_ptr
// in earlier releases.
using NodeRef = decltype(torch::autograd::Edge::function);

// A post hook that sets a flag when its node runs and changes nothing (a stage's GradReach puts one
// on each parameter copy's AccumulateGrad): the one kind of hook run_backward runs itself.
struct ReachedFlag final : torch::autograd::FunctionPostHook {
  explicit ReachedFlag(std::uint8_t* flag) : flag_(flag) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    *flag_ = 1;
    return outputs;
  }
  std::uint8_t* flag_;
};

// What a backward pass needs from the Python side, made with the GIL held before the pass and
// dropped with it held after. torch.utils.checkpoint (use_reentrant=False) tells one backward pass
// from another by the engine's graph task, of which passes on the calling thread have none; inside
// a graph exec group (torch.utils.checkpoint.GraphExecGroup) it goes by the group instead. The
// scope makes a fresh group current for the pass unless one is (as each engine pass has a graph
// task of its own), so that a layer checkpointing part of itself recomputes it once per pass, as
// under the engine. A torch without graph exec groups, or with compiled autograd on (the engine
// then hands the graph to it), gets every pass run by the engine.
class BackwardScope {
 public:
  BackwardScope();
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

  // Whether the pass may run on the calling thread (the graph decides the rest).
  bool may_run_here() const { return may_run_here_; }

 private:
  bool may_run_here_ = false;
  bool group_set_ = false;
};

// torch::autograd::backward(roots, grads) with retain_graph and create_graph off, on the calling
// thread where `scope` and the graph allow (see above), else through torch's engine. Call without
// the GIL.
void run_backward(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& grads,
                  const BackwardScope& scope);

}  // namespace roundpipe::bindings
