// Stage planner: the native core of ModelExecutePlan.auto.
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
// objective grows with T, so the optimum sits at a breakpoint T_n = min{T : N(T) <= n}, which is
// a segment sum. The planner enumerates the breakpoints from T_lo up to upper_threshold * T_lo in
// one of two exact ways:
//   * walk: one greedy probe at T returns N(T), the largest stage time actually used (a segment
//     sum <= T with the same plan) and the smallest bound > T at which the greedy plan changes
//     (the cheapest one-layer extension of any stage), so N is constant between the two. The next
//     breakpoint is found by bisection on T whose ends snap to those values; both ends are always
//     segment sums and the search stops when they meet (at most ~64 probes on doubles).
//   * sweep: every bound at which one greedy stage grows by one layer is an event; events are
//     taken in increasing order from a heap, each moving one stage end, and per-chain jump
//     pointers over blocks of 64 starts keep the stage count current in O(64 + L / 64) per event.
//     Cost grows with the number of segment sums inside the threshold band, not with the
//     number of breakpoints, so it wins when stages hold few layers and breakpoints are many.
// The sweep runs first with the walk's worst-case cost as budget and hands over to the walk when
// it runs out, so a phase costs at most about twice the cheaper of the two. Both stop once
// min_stages * (next possible T) exceeds the best objective, or the count reaches min_stages
// (fewer stages cannot lower max(#stages, min_stages)).
// Ties. Bounds whose objective is within 1e-9 (relative) of the best are kept (at most 16, lowest T
// first); for each, the greedy plan packed from the bottom and the one packed from the top are
// simulated (simulator.h) and the plan with the smallest predicted iteration time wins.
//
// Complexity. L layers, C chains, S = N(T_lo) stages, B breakpoints in the band
// (B <= N(T_lo) - N(upper_threshold * T_lo) + 1), E events in the band (one-layer stage
// extensions with time <= upper_threshold * T_lo), M microbatches. Setup O(L log L); walk
// O(B * 64 * S log(L / S)); sweep O(E (64 + log L) + L log L); planning costs
// O(L log L + min(walk, sweep)) plus O(16 * 2 * S * M) to simulate tied plans. Memory O(L).
#pragma once

#include <span>
#include <string_view>
#include <vector>

namespace roundpipe::scheduler {

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

// How breakpoints are found (see "Algorithm"): kAuto runs the sweep with the walk's worst case as
// budget and falls back to the walk; the fixed choices exist so tests and benchmarks can compare.
enum class BreakpointSearch { kAuto, kWalk, kSweep };

struct PlanOptions {
  int min_stages = 1;
  double upper_threshold = 1.1;
  double stage_memory_cap = 0.0;  // bytes; model_memory_limit / 2
  // For the simulated tie-break and the prediction.
  int num_devices = 1;
  int num_microbatches = 2;
  double upload_bytes_per_second = 0.0;  // 0: parameter uploads are not simulated
  BreakpointSearch search = BreakpointSearch::kAuto;
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

}  // namespace roundpipe::scheduler
