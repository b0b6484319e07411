// Stage planner: the native core of ModelExecutePlan.auto (SPEC 2.4, seed 000).
//
// Input, per model: per-layer forward time f, recompute time r, backward time b, forward memory
// (parameters) and backward memory (parameters + gradients). A forward stage costs the sum of f
// over its layers; a backward stage the sum of r + b; the fused stage of a "fused" plan (the last
// layers, run forward + loss + backward without recompute) the sum of f + b. A stage's memory is
// the sum of its layers' forward (forward stage) or backward (backward and fused stage) memory.
//
// Phases. Stages that run as one round-robin wavefront form a phase:
//   "infer"  one phase: the forward stages of every model, in model order;
//   "train"  two independent phases (forward call, backward call): every model's forward stages,
//            then every model's backward stages in reverse model order;
//   "fused"  one phase: the forward stages of every model, the last model's fused stage, then the
//            backward stages of every model in reverse order (non-last models get "train" plans).
// All stages of a phase share one stage-time bound T.
//
// Objective, per phase (phases are independent, so minimising each minimises their sum):
//   minimise max(#stages, min_stages) * (largest stage time)
//   subject to  stage memory <= stage_memory_cap (= model_memory_limit / 2: the next stage is
//               prefetched) and largest stage time <= upper_threshold * T_lo,
// where T_lo is the smallest largest-stage-time any valid plan reaches (the slowest layer's stage
// time; for "fused" the best split between recomputed layers and the fused stage). T_lo itself is
// always allowed, so the threshold never makes a phase infeasible.
//
// Algorithm (exact). For a bound T let N(T) be the fewest stages with every stage time <= T and
// memory <= cap. Greedy packing from layer 0 reaches N(T) for a chain of layers; for a fused model
// the fused stage is made as long as T and the cap allow (the shorter the recomputed prefix, the
// fewer stages it needs). N is a non-increasing step function, and for a fixed stage count the
// objective grows with T, so the optimum sits at a breakpoint T_n = min{T : N(T) <= n}. The planner
// walks the breakpoints upward from T_lo to upper_threshold * T_lo:
//   * one greedy probe at T returns N(T), the largest stage time actually used (a breakpoint value
//     <= T with the same plan) and the smallest bound > T at which the greedy plan would change
//     (the cheapest one-layer extension of any stage), so N is constant on [bottleneck, change);
//   * the next breakpoint below the current count is found by bisection on T whose ends snap to
//     those two values, so both ends are always real segment sums and the search stops when they
//     meet (at most ~64 probes on doubles, typically ~log2 of the candidate count);
//   * the walk stops early once min_stages * (next possible T) exceeds the best objective, or the
//     count reaches min_stages (fewer stages cannot lower max(#stages, min_stages)).
// Ties. Bounds whose objective is within 1e-9 (relative) of the best are kept (at most 16, lowest T
// first); for each, the greedy plan packed from the bottom and the one packed from the top are
// simulated (simulator.h) and the plan with the smallest predicted iteration time wins.
//
// Complexity. One probe costs O(S log(L / S) + C) for S stages, L layers and C chains (galloping
// search over prefix sums). With B breakpoints walked (B <= N(T_lo) - N(upper_threshold * T_lo) +
// 1, small for the default threshold 1.1) and P probes per breakpoint (P <= ~64), planning costs
// O(L + B * P * S log(L / S)) plus O(16 * 2 * S * M) to simulate tied plans over M microbatches.
// Memory O(L).
#pragma once

#include <span>
#include <string_view>
#include <vector>

namespace roundpipe::planner {

enum class RunType { kInfer, kTrain, kFused };

// "infer", "train" or "fused"; anything else throws std::invalid_argument.
RunType parse_run_type(std::string_view name);

// Per-layer estimates of one model; all vectors have one entry per layer.
struct LayerCosts {
  std::vector<double> forward_seconds;
  std::vector<double> recompute_seconds;
  std::vector<double> backward_seconds;  // backward only, without the recompute
  std::vector<double> forward_bytes;     // device memory of a forward stage: parameters
  std::vector<double> backward_bytes;    // device memory of a backward stage: parameters + grads
};

// Layers [begin, end) of one stage.
struct StageRange {
  int begin = 0;
  int end = 0;
  friend bool operator==(const StageRange&, const StageRange&) = default;
};

// Forward stages ascend from layer 0; backward stages descend. In a "fused" plan backward[0] is
// the fused stage [k, L) and forward covers [0, k).
struct ModelPlan {
  std::vector<StageRange> forward;
  std::vector<StageRange> backward;
};

struct PlanOptions {
  int min_stages = 1;
  double upper_threshold = 1.1;
  double stage_memory_cap = 0.0;  // bytes; model_memory_limit / 2
  // For the simulated tie-break and the prediction.
  int num_devices = 1;
  int num_microbatches = 2;
  double upload_bytes_per_second = 0.0;  // 0: parameter uploads are not simulated
};

struct PhaseSummary {
  int num_stages = 0;
  double largest_stage_seconds = 0.0;
  double objective = 0.0;  // max(num_stages, min_stages) * largest_stage_seconds
  double predicted_seconds = 0.0;
  int tied_plans = 0;  // candidate plans the simulator chose among
};

struct PlanResult {
  std::vector<ModelPlan> plans;      // one per model, in input order
  std::vector<PhaseSummary> phases;  // "train": forward then backward; otherwise one
  double objective = 0.0;            // sum over phases
  double predicted_seconds = 0.0;    // sum over phases
};

// Plans every model jointly. Throws std::invalid_argument for an empty model list, a model without
// layers, inconsistent vector lengths, a negative or non-finite estimate, min_stages < 1,
// upper_threshold < 1, stage_memory_cap <= 0, num_devices < 1, num_microbatches < 1, a negative
// upload bandwidth, or a layer that alone exceeds stage_memory_cap (the message names it).
PlanResult plan_stages(RunType run_type, std::span<const LayerCosts> models,
                       const PlanOptions& options);

}  // namespace roundpipe::planner
