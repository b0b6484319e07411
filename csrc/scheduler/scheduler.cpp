#include "scheduler/scheduler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "scheduler/simulator.h"

namespace roundpipe::scheduler {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr long kInfeasible = std::numeric_limits<long>::max();
constexpr double kTieTolerance = 1e-9;
constexpr std::size_t kMaxTiedBounds = 16;

// Prefix sums of `a` (+ `b` when given), so a stage's total is one subtraction. Every comparison
// in the planner uses these differences, so bounds and stage times agree to the last bit.
std::vector<double> prefix_sums(const std::vector<double>& a, const std::vector<double>* b) {
  std::vector<double> sums(a.size() + 1, 0.0);
  for (std::size_t i = 0; i < a.size(); ++i) sums[i + 1] = sums[i] + a[i] + (b ? (*b)[i] : 0.0);
  return sums;
}

// Moves from `from` towards `limit` and returns the farthest point p with fits(p), given that
// fits(from) holds and fits is monotone along the way. Galloping keeps it O(log distance).
template <class Fits>
int reach(int from, int limit, const Fits& fits) {
  const int direction = limit >= from ? 1 : -1;
  const int span = (limit - from) * direction;
  int good = 0;
  int bad = span + 1;
  for (int step = 1; good + step <= span; step *= 2) {
    if (!fits(from + direction * (good + step))) {
      bad = good + step;
      break;
    }
    good += step;
  }
  while (bad - good > 1) {
    const int mid = good + (bad - good) / 2;
    (fits(from + direction * mid) ? good : bad) = mid;
  }
  return from + direction * good;
}

// Per-layer sums of one kind of stage over one model's layers.
struct Sums {
  std::vector<double> time;
  std::vector<double> memory;
  std::vector<double> upload;  // parameter bytes, copied to the device once per stage

  double time_of(int begin, int end) const { return time[end] - time[begin]; }
  double memory_of(int begin, int end) const { return memory[end] - memory[begin]; }
  int layers() const { return static_cast<int>(time.size()) - 1; }

  // The one fit predicate: layers [begin, end) form a stage within the time bound and the cap.
  bool fits(int begin, int end, double bound, double cap) const {
    return time_of(begin, end) <= bound && memory_of(begin, end) <= cap;
  }
  // The farthest end in (begin, limit] of a fitting stage starting at `begin` (begin if none).
  int stage_end(int begin, int limit, double bound, double cap) const {
    return reach(begin, limit, [&](int j) { return fits(begin, j, bound, cap); });
  }
  // The lowest begin in [0, end) of a fitting stage ending at `end` (end if none).
  int stage_begin(int end, double bound, double cap) const {
    return reach(end, 0, [&](int i) { return fits(i, end, bound, cap); });
  }
};

// The greedy plan of layers [0, length): stages packed from the bottom, each as long as it fits;
// calls stage(begin, end) for each. Returns false when some layer fits in no stage.
template <class Stage>
bool pack_from_bottom(const Sums& sums, int length, double bound, double cap, const Stage& stage) {
  for (int begin = 0; begin < length;) {
    const int end = sums.stage_end(begin, length, bound, cap);
    if (end == begin) return false;
    stage(begin, end);
    begin = end;
  }
  return true;
}

// A run of one model's layers split into stages under the phase's bound.
struct Chain {
  int model = 0;
  bool backward = false;       // its stages run from the top layer down
  bool ends_at_fused = false;  // covers [0, k) where the fused stage starts at k
  Sums sums;
};

// The last model's fused stage [k, L) of a "fused" phase.
struct FusedStage {
  int model = 0;
  Sums sums;
};

struct Phase {
  std::vector<Chain> chains;  // in execution order
  std::optional<FusedStage> fused;
  std::size_t fused_position = 0;  // the fused stage runs before chains[fused_position]
  double cap = 0.0;
};

// What one greedy probe at bound T learns.
struct Probe {
  long count = 0;                  // fewest stages, kInfeasible when none fits
  double bottleneck = 0.0;         // largest stage time the greedy plan uses (<= T)
  double next_change = kInfinity;  // smallest bound > T at which the greedy plan changes
  int fused_begin = -1;            // k, the fused stage's first layer
};

// Smallest k with the fused stage [k, L) within the bound and the cap; L when even [L-1, L) is not.
int fused_begin(const FusedStage& fused, double bound, double cap) {
  return fused.sums.stage_begin(fused.sums.layers(), bound, cap);
}

int chain_length(const Chain& chain, int fused_start) {
  return chain.ends_at_fused ? fused_start : chain.sums.layers();
}

Probe probe(const Phase& phase, double bound) {
  Probe result;
  if (phase.fused) {
    const Sums& sums = phase.fused->sums;
    const int layers = sums.layers();
    const int k = fused_begin(*phase.fused, bound, phase.cap);
    if (k == layers) return {kInfeasible};
    result.fused_begin = k;
    result.count = 1;
    result.bottleneck = sums.time_of(k, layers);
    if (k > 0 && sums.memory_of(k - 1, layers) <= phase.cap) {
      result.next_change = sums.time_of(k - 1, layers);
    }
  }
  for (const Chain& chain : phase.chains) {
    const Sums& sums = chain.sums;
    const int length = chain_length(chain, result.fused_begin);
    const bool feasible = pack_from_bottom(sums, length, bound, phase.cap, [&](int begin, int end) {
      ++result.count;
      result.bottleneck = std::max(result.bottleneck, sums.time_of(begin, end));
      if (end < length && sums.memory_of(begin, end + 1) <= phase.cap) {
        result.next_change = std::min(result.next_change, sums.time_of(begin, end + 1));
      }
    });
    if (!feasible) return {kInfeasible};
  }
  return result;
}

// Stages of each chain (ascending ranges) for the greedy plan at `bound`, packed from the bottom
// or from the top of each chain; both use the fewest stages.
struct Partition {
  std::vector<std::vector<StageRange>> chains;
  int fused_begin = -1;
};

Partition partition(const Phase& phase, double bound, bool from_top) {
  Partition result;
  if (phase.fused) result.fused_begin = fused_begin(*phase.fused, bound, phase.cap);
  for (const Chain& chain : phase.chains) {
    const Sums& sums = chain.sums;
    const int length = chain_length(chain, result.fused_begin);
    std::vector<StageRange> stages;
    if (from_top) {
      for (int end = length; end > 0;) {
        const int begin = sums.stage_begin(end, bound, phase.cap);
        stages.push_back({begin, end});
        end = begin;
      }
      std::reverse(stages.begin(), stages.end());
    } else {
      pack_from_bottom(sums, length, bound, phase.cap,
                       [&](int begin, int end) { stages.push_back({begin, end}); });
    }
    result.chains.push_back(std::move(stages));
  }
  return result;
}

double predicted_seconds(const Phase& phase, const Partition& plan, const PlanOptions& options) {
  std::vector<StageWork> work;
  const auto add = [&](const Sums& sums, StageRange stage) {
    const double bytes = sums.upload[stage.end] - sums.upload[stage.begin];
    const double upload =
        options.upload_bytes_per_second > 0.0 ? bytes / options.upload_bytes_per_second : 0.0;
    work.push_back({sums.time_of(stage.begin, stage.end), upload});
  };
  for (std::size_t c = 0; c <= phase.chains.size(); ++c) {
    if (phase.fused && c == phase.fused_position) {
      add(phase.fused->sums, {plan.fused_begin, phase.fused->sums.layers()});
    }
    if (c == phase.chains.size()) break;
    const auto& stages = plan.chains[c];
    if (phase.chains[c].backward) {
      for (auto it = stages.rbegin(); it != stages.rend(); ++it) add(phase.chains[c].sums, *it);
    } else {
      for (const StageRange& stage : stages) add(phase.chains[c].sums, stage);
    }
  }
  return simulate_schedule(work, options.num_devices, options.num_microbatches);
}

[[noreturn]] void throw_layer_too_large(int model, int layer, const char* kind, double bytes,
                                        double cap) {
  throw std::invalid_argument("layer " + std::to_string(layer) + " of model " +
                              std::to_string(model) + " needs " + std::to_string(bytes) +
                              " bytes of device memory in a " + kind +
                              " stage, more than the stage memory cap of " + std::to_string(cap) +
                              " bytes (model_memory_limit / 2); raise model_memory_limit");
}

// The smallest largest-stage-time any valid plan reaches (T_lo in scheduler.h).
double lowest_bound(const Phase& phase) {
  double full_chains = 0.0;
  std::vector<double> fused_model_units;  // per layer, max over its truncated chains
  if (phase.fused) fused_model_units.assign(phase.fused->sums.layers(), 0.0);
  for (const Chain& chain : phase.chains) {
    for (int i = 0; i < chain.sums.layers(); ++i) {
      if (chain.sums.memory_of(i, i + 1) > phase.cap) {
        throw_layer_too_large(chain.model, i, chain.backward ? "backward" : "forward",
                              chain.sums.memory_of(i, i + 1), phase.cap);
      }
      const double unit = chain.sums.time_of(i, i + 1);
      if (chain.ends_at_fused) {
        fused_model_units[i] = std::max(fused_model_units[i], unit);
      } else {
        full_chains = std::max(full_chains, unit);
      }
    }
  }
  if (!phase.fused) return full_chains;
  const Sums& sums = phase.fused->sums;
  const int layers = sums.layers();
  if (sums.memory_of(layers - 1, layers) > phase.cap) {
    throw_layer_too_large(phase.fused->model, layers - 1, "fused",
                          sums.memory_of(layers - 1, layers), phase.cap);
  }
  double best = kInfinity;
  double recomputed = 0.0;  // max unit over layers [0, k)
  for (int k = 0; k < layers; ++k) {
    if (sums.memory_of(k, layers) <= phase.cap) {
      best = std::min(best, std::max(recomputed, sums.time_of(k, layers)));
    }
    recomputed = std::max(recomputed, fused_model_units[k]);
  }
  return std::max(full_chains, best);
}

double objective_of(const Probe& probe, int min_stages) {
  return static_cast<double>(std::max<long>(probe.count, min_stages)) * probe.bottleneck;
}

// Smallest breakpoint above `current` (whose count is n): the bound where N first drops below n.
// `below` is a probe with N < n, so the breakpoint lies in [current.next_change, below.bottleneck].
Probe next_breakpoint(const Phase& phase, const Probe& current, Probe below) {
  double low = current.next_change;
  while (low < below.bottleneck) {
    const Probe middle = probe(phase, low + (below.bottleneck - low) / 2);
    if (middle.count < current.count) {
      below = middle;
    } else {
      low = middle.next_change;
    }
  }
  return below;
}

struct PhaseSolution {
  PhaseSummary summary;
  Partition plan;
};

// Breakpoints found by bisection (scheduler.h, "walk"); returns them with the best objective.
struct Breakpoints {
  std::vector<Probe> probes;
  double best = kInfinity;

  void add(const Probe& probe, int min_stages) {
    probes.push_back(probe);
    best = std::min(best, objective_of(probe, min_stages));
  }
  // Later breakpoints have larger bounds; past this one none can tie or win.
  bool worth_going_past(double bound, long count, int min_stages) const {
    return count > min_stages && min_stages * bound <= best * (1 + kTieTolerance);
  }
};

Breakpoints walk_breakpoints(const Phase& phase, const Probe& first, const Probe& at_threshold,
                             int min_stages) {
  Breakpoints found;
  found.add(first, min_stages);
  Probe current = first;
  while (current.count > at_threshold.count &&
         found.worth_going_past(current.next_change, current.count, min_stages)) {
    current = next_breakpoint(phase, current, at_threshold);
    found.add(current, min_stages);
  }
  return found;
}

// The greedy plan of one chain at the current bound, with jump pointers over blocks of starts so
// that the stage count of any prefix costs O(L / kBlock + kBlock) and moving one stage end
// O(kBlock).
class ChainJumps {
 public:
  static constexpr int kBlock = 64;

  ChainJumps(const Sums& sums, double bound, double cap)
      : next_(sums.layers()), hops_(sums.layers()), exit_(sums.layers()) {
    for (int i = 0; i < sums.layers(); ++i) {
      next_[i] = sums.stage_end(i, sums.layers(), bound, cap);
    }
    for (int block = 0; block * kBlock < sums.layers(); ++block) {
      rebuild(std::min((block + 1) * kBlock, sums.layers()) - 1);
    }
  }

  int next(int start) const { return next_[start]; }

  void extend(int start) {
    ++next_[start];
    rebuild(start);
  }

  long stages_below(int length) const {
    long count = 0;
    for (int start = 0; start < length;) {
      if ((start / kBlock + 1) * kBlock <= length) {
        count += hops_[start];
        start = exit_[start];
      } else {
        ++count;
        start = next_[start];
      }
    }
    return count;
  }

 private:
  // Recomputes hops/exit of the starts in `start`'s block up to `start` (later ones do not
  // depend on it).
  void rebuild(int start) {
    const int layers = static_cast<int>(next_.size());
    const int block_begin = start / kBlock * kBlock;
    const int block_end = std::min(block_begin + kBlock, layers);
    for (int i = start; i >= block_begin; --i) {
      const int j = next_[i];
      hops_[i] = j >= block_end ? 1 : 1 + hops_[j];
      exit_[i] = j >= block_end ? j : exit_[j];
    }
  }

  std::vector<int> next_;  // greedy stage end from each start
  std::vector<int> hops_;  // stages from a start to the first start outside its block
  std::vector<int> exit_;  // that start
};

// Breakpoints found by sweeping the bound upward through every event at which a greedy stage
// grows by one layer (scheduler.h, "sweep"). Gives up (returns nullopt) after `budget` units of
// work, so that running it first never costs more than twice the walk.
std::optional<Breakpoints> sweep_breakpoints(const Phase& phase, const Probe& first, double upper,
                                             int min_stages, double budget) {
  struct Event {
    double bound;
    int chain;  // -1: the fused stage takes one more layer
    int start;
    bool operator>(const Event& other) const { return bound > other.bound; }
  };
  std::vector<ChainJumps> jumps;
  jumps.reserve(phase.chains.size());
  for (const Chain& chain : phase.chains)
    jumps.emplace_back(chain.sums, first.bottleneck, phase.cap);
  std::vector<Event> heap;
  const auto push = [&](int c, int start) {
    const Sums& sums = phase.chains[c].sums;
    const int end = jumps[c].next(start);
    if (end < sums.layers() && sums.memory_of(start, end + 1) <= phase.cap) {
      heap.push_back({sums.time_of(start, end + 1), c, start});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  int fused_start = first.fused_begin;
  const auto push_fused = [&] {
    const Sums& sums = phase.fused->sums;
    if (fused_start > 0 && sums.memory_of(fused_start - 1, sums.layers()) <= phase.cap) {
      heap.push_back({sums.time_of(fused_start - 1, sums.layers()), -1, 0});
      std::push_heap(heap.begin(), heap.end(), std::greater<>());
    }
  };
  for (int c = 0; c < static_cast<int>(phase.chains.size()); ++c) {
    for (int i = 0; i < phase.chains[c].sums.layers(); ++i) push(c, i);
  }
  if (phase.fused) push_fused();
  std::vector<long> counts(phase.chains.size());
  const auto recount = [&](std::size_t c) {
    counts[c] = jumps[c].stages_below(chain_length(phase.chains[c], fused_start));
  };
  for (std::size_t c = 0; c < counts.size(); ++c) recount(c);

  Breakpoints found;
  found.add(first, min_stages);
  long count = first.count;
  double work = 0.0;
  std::vector<char> touched(phase.chains.size(), 0);
  while (!heap.empty() && heap.front().bound <= upper &&
         found.worth_going_past(heap.front().bound, count, min_stages)) {
    const double bound = heap.front().bound;
    bool fused_moved = false;
    while (!heap.empty() && heap.front().bound == bound) {
      const Event event = heap.front();
      std::pop_heap(heap.begin(), heap.end(), std::greater<>());
      heap.pop_back();
      if (event.chain < 0) {
        --fused_start;
        fused_moved = true;
        push_fused();
      } else {
        jumps[event.chain].extend(event.start);
        touched[event.chain] = 1;
        push(event.chain, event.start);
      }
      work += ChainJumps::kBlock + 2 * std::log2(heap.size() + 2.0);
    }
    long next_count = phase.fused ? 1 : 0;
    for (std::size_t c = 0; c < counts.size(); ++c) {
      if (touched[c] || (fused_moved && phase.chains[c].ends_at_fused)) {
        recount(c);
        work += static_cast<double>(phase.chains[c].sums.layers()) / ChainJumps::kBlock +
                ChainJumps::kBlock;
      }
      touched[c] = 0;
      next_count += counts[c];
    }
    if (work > budget) return std::nullopt;
    if (next_count < count) {
      found.add({next_count, bound, kInfinity, fused_start}, min_stages);
      count = next_count;
    }
  }
  return found;
}

PhaseSolution solve_phase(const Phase& phase, const PlanOptions& options) {
  // Stage times are differences of prefix sums, which round: layers that add up to exactly the
  // slowest one, or to exactly upper_threshold times it, may come out a few ulps above. Both
  // bounds get a slack far below any timing's precision (and above the rounding of a sum of up
  // to millions of layers), so such a stage fits as its layers' sum says it does.
  constexpr double kRoundingSlack = 1e-9;
  const double lowest = lowest_bound(phase) * (1.0 + kRoundingSlack);
  const Probe first = probe(phase, lowest);
  const double upper = options.upper_threshold * lowest;
  const Probe at_threshold = probe(phase, upper);
  // The walk costs up to ~64 probes of O(stages) per breakpoint, the sweep O(kBlock) per event.
  const double walk_cost = static_cast<double>(first.count - at_threshold.count + 1) * 64.0 *
                           static_cast<double>(first.count + phase.chains.size());
  std::optional<Breakpoints> swept;
  if (options.search != BreakpointSearch::kWalk) {
    const double budget = options.search == BreakpointSearch::kSweep ? kInfinity : walk_cost;
    swept = sweep_breakpoints(phase, first, upper, options.min_stages, budget);
  }
  const Breakpoints found =
      swept ? std::move(*swept) : walk_breakpoints(phase, first, at_threshold, options.min_stages);
  const std::vector<Probe>& breakpoints = found.probes;
  const double best = found.best;

  PhaseSolution solution;
  std::size_t tied = 0;
  for (const Probe& candidate : breakpoints) {
    const double objective = objective_of(candidate, options.min_stages);
    if (objective > best * (1 + kTieTolerance) || tied == kMaxTiedBounds) continue;
    ++tied;
    for (const bool from_top : {false, true}) {
      Partition plan = partition(phase, candidate.bottleneck, from_top);
      const double predicted = predicted_seconds(phase, plan, options);
      ++solution.summary.tied_plans;
      if (solution.summary.tied_plans == 1 || predicted < solution.summary.predicted_seconds) {
        solution.summary = {static_cast<int>(candidate.count), candidate.bottleneck, objective,
                            predicted, solution.summary.tied_plans};
        solution.plan = std::move(plan);
      }
    }
  }
  return solution;
}

void check_estimates(const std::vector<double>& values, std::size_t layers, int model,
                     const char* name) {
  if (values.size() != layers) {
    throw std::invalid_argument(
        "model " + std::to_string(model) + ": " + name + " has " + std::to_string(values.size()) +
        " entries but forward_seconds has " + std::to_string(layers) + "; give one per layer");
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (!std::isfinite(values[i]) || values[i] < 0.0) {
      throw std::invalid_argument("model " + std::to_string(model) + ": " + name + "[" +
                                  std::to_string(i) + "] must be finite and non-negative, got " +
                                  std::to_string(values[i]));
    }
  }
}

void check_arguments(std::span<const LayerCosts> models, const PlanOptions& options) {
  if (models.empty()) throw std::invalid_argument("models must name at least one model");
  for (std::size_t m = 0; m < models.size(); ++m) {
    const LayerCosts& costs = models[m];
    const std::size_t layers = costs.forward_seconds.size();
    const int model = static_cast<int>(m);
    if (layers == 0) {
      throw std::invalid_argument("model " + std::to_string(m) +
                                  " has no layers; a plan needs at least one layer");
    }
    check_estimates(costs.forward_seconds, layers, model, "forward_seconds");
    check_estimates(costs.recompute_seconds, layers, model, "recompute_seconds");
    check_estimates(costs.backward_seconds, layers, model, "backward_seconds");
    check_estimates(costs.forward_bytes, layers, model, "forward_bytes");
    check_estimates(costs.backward_bytes, layers, model, "backward_bytes");
  }
  if (options.min_stages < 1) {
    throw std::invalid_argument("min_stages must be at least 1, got " +
                                std::to_string(options.min_stages));
  }
  if (!(options.upper_threshold >= 1.0) || !std::isfinite(options.upper_threshold)) {
    throw std::invalid_argument("upper_threshold must be a finite number >= 1, got " +
                                std::to_string(options.upper_threshold));
  }
  if (!(options.stage_memory_cap > 0.0)) {
    throw std::invalid_argument("stage_memory_cap must be positive (model_memory_limit / 2), got " +
                                std::to_string(options.stage_memory_cap));
  }
  if (!(options.upload_bytes_per_second >= 0.0)) {
    throw std::invalid_argument("upload_bytes_per_second must be >= 0 (0: not simulated), got " +
                                std::to_string(options.upload_bytes_per_second));
  }
  // num_devices and num_microbatches are checked by the simulator with the same wording.
  simulate_schedule({}, options.num_devices, options.num_microbatches);
}

Chain forward_chain(const LayerCosts& costs, int model) {
  return {model,
          false,
          false,
          {prefix_sums(costs.forward_seconds, nullptr), prefix_sums(costs.forward_bytes, nullptr),
           prefix_sums(costs.forward_bytes, nullptr)}};
}

Chain backward_chain(const LayerCosts& costs, int model) {
  return {model,
          true,
          false,
          {prefix_sums(costs.recompute_seconds, &costs.backward_seconds),
           prefix_sums(costs.backward_bytes, nullptr), prefix_sums(costs.forward_bytes, nullptr)}};
}

std::vector<Phase> build_phases(RunType run_type, std::span<const LayerCosts> models, double cap) {
  const int count = static_cast<int>(models.size());
  Phase forward;
  forward.cap = cap;
  for (int m = 0; m < count; ++m) forward.chains.push_back(forward_chain(models[m], m));
  if (run_type == RunType::kInfer) return {std::move(forward)};
  Phase backward;
  backward.cap = cap;
  for (int m = count - 1; m >= 0; --m) backward.chains.push_back(backward_chain(models[m], m));
  if (run_type == RunType::kTrain) return {std::move(forward), std::move(backward)};

  Phase fused = std::move(forward);
  fused.fused_position = fused.chains.size();
  fused.chains.back().ends_at_fused = true;
  backward.chains.front().ends_at_fused = true;
  const LayerCosts& last = models.back();
  fused.fused = FusedStage{
      count - 1,
      {prefix_sums(last.forward_seconds, &last.backward_seconds),
       prefix_sums(last.backward_bytes, nullptr), prefix_sums(last.forward_bytes, nullptr)}};
  for (Chain& chain : backward.chains) fused.chains.push_back(std::move(chain));
  return {std::move(fused)};
}

}  // namespace

RunType parse_run_type(std::string_view name) {
  if (name == "infer") return RunType::kInfer;
  if (name == "train") return RunType::kTrain;
  if (name == "fused") return RunType::kFused;
  throw std::invalid_argument("run_type must be 'infer', 'train' or 'fused', got '" +
                              std::string(name) + "'");
}

PlanResult plan_stages(RunType run_type, std::span<const LayerCosts> models,
                       const PlanOptions& options) {
  check_arguments(models, options);
  const std::vector<Phase> phases = build_phases(run_type, models, options.stage_memory_cap);
  PlanResult result;
  result.plans.resize(models.size());
  for (const Phase& phase : phases) {
    PhaseSolution solution = solve_phase(phase, options);
    result.objective += solution.summary.objective;
    result.predicted_seconds += solution.summary.predicted_seconds;
    result.phases.push_back(solution.summary);
    if (phase.fused) {
      const int layers = phase.fused->sums.layers();
      result.plans[phase.fused->model].backward.push_back({solution.plan.fused_begin, layers});
    }
    for (std::size_t c = 0; c < phase.chains.size(); ++c) {
      const Chain& chain = phase.chains[c];
      auto& stages = solution.plan.chains[c];
      ModelPlan& plan = result.plans[chain.model];
      if (chain.backward) {
        plan.backward.insert(plan.backward.end(), stages.rbegin(), stages.rend());
      } else {
        plan.forward = std::move(stages);
      }
    }
  }
  return result;
}

}  // namespace roundpipe::scheduler
