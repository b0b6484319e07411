// The stage planner against brute force over every partition of small models, plus hand cases.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "harness.h"
#include "scheduler/scheduler.h"

using roundpipe::scheduler::BreakpointSearch;
using roundpipe::scheduler::LayerCosts;
using roundpipe::scheduler::ModelPlan;
using roundpipe::scheduler::parse_run_type;
using roundpipe::scheduler::plan_stages;
using roundpipe::scheduler::PlanOptions;
using roundpipe::scheduler::PlanResult;
using roundpipe::scheduler::RunType;
using roundpipe::scheduler::StageRange;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int kNoPlan = std::numeric_limits<int>::max() / 4;

// Stage counts add up, and "no plan" absorbs everything.
int add(int a, int b) { return a >= kNoPlan || b >= kNoPlan ? kNoPlan : a + b; }

double sum(const std::vector<double>& values, int begin, int end) {
  double total = 0.0;
  for (int i = begin; i < end; ++i) total += values[i];
  return total;
}

std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> result(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) result[i] = a[i] + b[i];
  return result;
}

// Fewest stages over every partition of [0, length) (all 2^(length-1) of them) with each stage's
// time <= bound and memory <= cap.
int brute_min_stages(const std::vector<double>& time, const std::vector<double>& memory, int length,
                     double bound, double cap) {
  if (length == 0) return 0;
  int best = kNoPlan;
  for (unsigned cuts = 0; cuts < (1u << (length - 1)); ++cuts) {
    int stages = 0;
    bool fits = true;
    for (int begin = 0, end = 1; end <= length; ++end) {
      if (end == length || (cuts >> (end - 1) & 1u)) {
        fits = fits && sum(time, begin, end) <= bound && sum(memory, begin, end) <= cap;
        ++stages;
        begin = end;
      }
    }
    if (fits) best = std::min(best, stages);
  }
  return best;
}

// Every segment time of `time`: the only values a plan's largest stage time can take.
void add_segment_sums(const std::vector<double>& time, std::vector<double>& out) {
  for (std::size_t b = 0; b < time.size(); ++b) {
    for (std::size_t e = b + 1; e <= time.size(); ++e) out.push_back(sum(time, b, e));
  }
}

// Brute-force objective of one phase: `stages(bound)` gives the fewest stages under a bound.
template <class StagesUnder>
double brute_phase_objective(std::vector<double> candidates, const StagesUnder& stages_under,
                             const PlanOptions& options) {
  std::sort(candidates.begin(), candidates.end());
  double lowest = kInf;
  for (double bound : candidates) {
    if (stages_under(bound) < kNoPlan) {
      lowest = bound;
      break;
    }
  }
  double best = kInf;
  for (double bound : candidates) {
    if (bound > options.upper_threshold * lowest) break;
    const int stages = stages_under(bound);
    if (stages >= kNoPlan) continue;
    best = std::min(best, std::max(stages, options.min_stages) * bound);
  }
  return best;
}

double brute_objective(RunType run_type, const std::vector<LayerCosts>& models,
                       const PlanOptions& options) {
  const double cap = options.stage_memory_cap;
  std::vector<std::vector<double>> backward_time;
  for (const auto& m : models)
    backward_time.push_back(plus(m.recompute_seconds, m.backward_seconds));
  const auto length = [](const LayerCosts& m) {
    return static_cast<int>(m.forward_seconds.size());
  };
  const auto forward_stages = [&](double bound) {
    int total = 0;
    for (const auto& m : models)
      total =
          add(total, brute_min_stages(m.forward_seconds, m.forward_bytes, length(m), bound, cap));
    return total;
  };
  const auto backward_stages = [&](double bound) {
    int total = 0;
    for (std::size_t i = 0; i < models.size(); ++i)
      total = add(total, brute_min_stages(backward_time[i], models[i].backward_bytes,
                                          length(models[i]), bound, cap));
    return total;
  };
  std::vector<double> forward_candidates;
  std::vector<double> backward_candidates;
  for (std::size_t i = 0; i < models.size(); ++i) {
    add_segment_sums(models[i].forward_seconds, forward_candidates);
    add_segment_sums(backward_time[i], backward_candidates);
  }
  if (run_type == RunType::kInfer) {
    return brute_phase_objective(forward_candidates, forward_stages, options);
  }
  if (run_type == RunType::kTrain) {
    return brute_phase_objective(forward_candidates, forward_stages, options) +
           brute_phase_objective(backward_candidates, backward_stages, options);
  }
  const LayerCosts& last = models.back();
  const int layers = length(last);
  const std::vector<double> fused_time = plus(last.forward_seconds, last.backward_seconds);
  std::vector<double> candidates = forward_candidates;
  candidates.insert(candidates.end(), backward_candidates.begin(), backward_candidates.end());
  add_segment_sums(fused_time, candidates);
  const auto fused_stages = [&](double bound) {
    int others = 0;
    for (std::size_t i = 0; i + 1 < models.size(); ++i) {
      others = add(others, brute_min_stages(models[i].forward_seconds, models[i].forward_bytes,
                                            length(models[i]), bound, cap));
      others = add(others, brute_min_stages(backward_time[i], models[i].backward_bytes,
                                            length(models[i]), bound, cap));
    }
    int best = kNoPlan;
    for (int k = 0; k < layers; ++k) {
      if (sum(fused_time, k, layers) > bound || sum(last.backward_bytes, k, layers) > cap) continue;
      best = std::min(
          best, add(1 + brute_min_stages(last.forward_seconds, last.forward_bytes, k, bound, cap),
                    brute_min_stages(backward_time.back(), last.backward_bytes, k, bound, cap)));
    }
    return add(others, best);
  };
  return brute_phase_objective(candidates, fused_stages, options);
}

// Checks the plan's shape, the memory cap and the threshold, and returns the
// objective recomputed from the plan itself.
double checked_objective(RunType run_type, const std::vector<LayerCosts>& models,
                         const PlanOptions& options, const PlanResult& result) {
  CHECK_EQ(result.plans.size(), models.size());
  const double cap = options.stage_memory_cap;
  double forward_largest = 0, backward_largest = 0;
  int forward_count = 0, backward_count = 0;
  for (std::size_t i = 0; i < models.size(); ++i) {
    const LayerCosts& m = models[i];
    const ModelPlan& plan = result.plans[i];
    const int layers = static_cast<int>(m.forward_seconds.size());
    const bool fused = run_type == RunType::kFused && i + 1 == models.size();
    int next = 0;
    for (const StageRange& stage : plan.forward) {
      CHECK_EQ(stage.begin, next);
      CHECK(stage.end > stage.begin);
      CHECK(sum(m.forward_bytes, stage.begin, stage.end) <= cap);
      forward_largest = std::max(forward_largest, sum(m.forward_seconds, stage.begin, stage.end));
      ++forward_count;
      next = stage.end;
    }
    const int k = next;
    if (!fused) CHECK_EQ(k, layers);
    if (run_type == RunType::kInfer) {
      CHECK(plan.backward.empty());
      continue;
    }
    int top = layers;
    for (std::size_t s = 0; s < plan.backward.size(); ++s) {
      const StageRange stage = plan.backward[s];
      CHECK_EQ(stage.end, top);
      CHECK(stage.end > stage.begin);
      CHECK(sum(m.backward_bytes, stage.begin, stage.end) <= cap);
      const bool fused_stage = fused && s == 0;
      if (fused_stage) CHECK_EQ(stage.begin, k);
      const double time =
          fused_stage ? sum(plus(m.forward_seconds, m.backward_seconds), stage.begin, stage.end)
                      : sum(plus(m.recompute_seconds, m.backward_seconds), stage.begin, stage.end);
      backward_largest = std::max(backward_largest, time);
      ++backward_count;
      top = stage.begin;
    }
    CHECK_EQ(top, 0);
  }
  const auto phase = [&](int count, double largest) {
    return std::max(count, options.min_stages) * largest;
  };
  if (run_type == RunType::kTrain) {
    return phase(forward_count, forward_largest) + phase(backward_count, backward_largest);
  }
  return phase(forward_count + backward_count, std::max(forward_largest, backward_largest));
}

bool close(double a, double b) { return std::abs(a - b) <= 1e-9 * std::max(std::abs(b), 1.0); }

LayerCosts random_model(std::mt19937& rng, int layers, bool integral) {
  std::uniform_real_distribution<double> real(0.05, 3.0);
  std::uniform_int_distribution<int> whole(1, 12);
  const auto draw = [&] { return integral ? static_cast<double>(whole(rng)) : real(rng); };
  LayerCosts m;
  for (int i = 0; i < layers; ++i) {
    m.forward_seconds.push_back(draw());
    m.recompute_seconds.push_back(draw());
    m.backward_seconds.push_back(draw());
    m.forward_bytes.push_back(static_cast<double>(whole(rng)));
    m.backward_bytes.push_back(m.forward_bytes.back() * 2);
  }
  return m;
}

PlanOptions random_options(std::mt19937& rng, const std::vector<LayerCosts>& models) {
  const double thresholds[] = {1.0, 1.1, 1.3, 2.0, 3.0, 1e6};
  PlanOptions options;
  options.min_stages = std::uniform_int_distribution<int>(1, 8)(rng);
  options.upper_threshold = thresholds[std::uniform_int_distribution<int>(0, 5)(rng)];
  double largest = 0, total = 0;
  for (const auto& m : models) {
    for (double bytes : m.backward_bytes) largest = std::max(largest, bytes);
    total += sum(m.backward_bytes, 0, static_cast<int>(m.backward_bytes.size()));
  }
  options.stage_memory_cap = std::uniform_real_distribution<double>(largest, total)(rng);
  options.num_devices = std::uniform_int_distribution<int>(1, 4)(rng);
  options.num_microbatches = options.num_devices + 1;
  return options;
}

void check_against_brute_force(RunType run_type, int num_models, bool integral, int trials) {
  std::mt19937 rng(1234 + static_cast<int>(run_type) * 7 + num_models * 31 + integral);
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<LayerCosts> models;
    const int max_layers = num_models == 1 ? 10 : 5;
    for (int m = 0; m < num_models; ++m) {
      models.push_back(
          random_model(rng, std::uniform_int_distribution<int>(1, max_layers)(rng), integral));
    }
    PlanOptions options = random_options(rng, models);
    const double expected = brute_objective(run_type, models, options);
    for (const BreakpointSearch search :
         {BreakpointSearch::kAuto, BreakpointSearch::kWalk, BreakpointSearch::kSweep}) {
      options.search = search;
      const PlanResult result = plan_stages(run_type, models, options);
      if (!close(result.objective, expected)) {
        throw roundpipe::testing::Failure(
            "trial " + std::to_string(trial) + ", search " +
            std::to_string(static_cast<int>(search)) + ": planner objective " +
            std::to_string(result.objective) + " != brute force " + std::to_string(expected));
      }
      CHECK(close(checked_objective(run_type, models, options, result), result.objective));
    }
  }
}

LayerCosts uniform_model(int layers, double seconds, double bytes) {
  LayerCosts m;
  m.forward_seconds.assign(layers, seconds);
  m.recompute_seconds.assign(layers, seconds);
  m.backward_seconds.assign(layers, 2 * seconds);
  m.forward_bytes.assign(layers, bytes);
  m.backward_bytes.assign(layers, 2 * bytes);
  return m;
}

}  // namespace

TEST_CASE("planner_infer_matches_brute_force") {
  check_against_brute_force(RunType::kInfer, 1, true, 150);
  check_against_brute_force(RunType::kInfer, 1, false, 100);
}

TEST_CASE("planner_train_matches_brute_force") {
  check_against_brute_force(RunType::kTrain, 1, true, 150);
  check_against_brute_force(RunType::kTrain, 1, false, 100);
}

TEST_CASE("planner_fused_matches_brute_force") {
  check_against_brute_force(RunType::kFused, 1, true, 120);
  check_against_brute_force(RunType::kFused, 1, false, 80);
}

TEST_CASE("planner_joint_models_match_brute_force") {
  for (RunType type : {RunType::kInfer, RunType::kTrain, RunType::kFused}) {
    check_against_brute_force(type, 2, true, 60);
    check_against_brute_force(type, 3, false, 20);
  }
}

TEST_CASE("planner_walk_and_sweep_agree_on_large_uneven_models") {
  // Too large for brute force: the two exact searches must find the same optimum.
  std::mt19937 rng(99);
  for (int trial = 0; trial < 12; ++trial) {
    const RunType type = static_cast<RunType>(trial % 3);
    const std::vector<LayerCosts> models{random_model(rng, 300, trial % 2 == 0)};
    PlanOptions options = random_options(rng, models);
    options.search = BreakpointSearch::kWalk;
    const double walked = plan_stages(type, models, options).objective;
    options.search = BreakpointSearch::kSweep;
    const double swept = plan_stages(type, models, options).objective;
    CHECK(close(walked, swept));
  }
}

TEST_CASE("planner_uniform_layers_get_one_layer_per_stage_under_default_threshold") {
  const std::vector<LayerCosts> models{uniform_model(6, 1.0, 1.0)};
  PlanOptions options;
  options.min_stages = 2;
  options.stage_memory_cap = 100;
  const PlanResult result = plan_stages(RunType::kInfer, models, options);
  CHECK_EQ(result.plans[0].forward.size(), 6u);
  CHECK_EQ(result.objective, 6.0);
  const PlanResult fused = plan_stages(RunType::kFused, models, options);
  // Every backward-side layer costs 3 (recompute 1 + backward 2; fused forward 1 + backward 2),
  // so the fused stage is one layer and each forward stage packs up to three layers.
  CHECK_EQ(fused.plans[0].backward.size(), 6u);
  CHECK((fused.plans[0].backward[0] == StageRange{5, 6}));
  CHECK_EQ(fused.plans[0].forward.size(), 2u);
  CHECK_EQ(fused.objective, 8 * 3.0);
}

TEST_CASE("planner_respects_memory_cap") {
  // Layer times 1, 1, 2, 2: [0, 2) as one stage gives 3 stages of at most 2 (objective 6) instead
  // of 4 (objective 8), but only when two layers (6 bytes each) fit under the cap.
  LayerCosts model = uniform_model(4, 1.0, 6.0);
  model.forward_seconds = {1, 1, 2, 2};
  const std::vector<LayerCosts> models{model};
  PlanOptions options;
  options.stage_memory_cap = 11;
  const PlanResult split = plan_stages(RunType::kInfer, models, options);
  CHECK_EQ(split.plans[0].forward.size(), 4u);
  CHECK_EQ(split.objective, 8.0);
  options.stage_memory_cap = 12;
  const PlanResult merged = plan_stages(RunType::kInfer, models, options);
  CHECK((merged.plans[0].forward == std::vector<StageRange>{{0, 2}, {2, 3}, {3, 4}}));
  CHECK_EQ(merged.objective, 6.0);
}

TEST_CASE("planner_min_stages_prefers_smaller_stages") {
  // With min_stages 4 and the threshold out of the way, 8 uniform layers in 4 stages of 2 or 8
  // stages of 1 tie at 8; 2 stages of 4 cost 4 * 4 = 16 and lose.
  const std::vector<LayerCosts> models{uniform_model(8, 1.0, 1.0)};
  PlanOptions options;
  options.min_stages = 4;
  options.upper_threshold = 100;
  options.stage_memory_cap = 100;
  options.num_devices = 4;
  options.num_microbatches = 5;
  const PlanResult result = plan_stages(RunType::kInfer, models, options);
  CHECK_EQ(result.objective, 8.0);
  CHECK(result.plans[0].forward.size() >= 4u);
  CHECK(result.phases[0].tied_plans >= 2);
}

TEST_CASE("planner_rejects_bad_arguments") {
  const std::vector<LayerCosts> models{uniform_model(3, 1.0, 1.0)};
  PlanOptions options;
  options.stage_memory_cap = 10;
  PlanOptions bad = options;
  bad.min_stages = 0;
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument, "min_stages");
  bad = options;
  bad.upper_threshold = 0.9;
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument,
               "upper_threshold must be a finite number >= 1");
  bad = options;
  bad.stage_memory_cap = 0;
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument,
               "stage_memory_cap must be positive");
  bad = options;
  bad.num_devices = 0;
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument, "num_devices");
  bad.num_devices = 1 << 30;  // a schedule over as many devices would not fit in memory
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument,
               "num_devices must be from 1 to 65536");
  bad = options;
  bad.num_microbatches = 1 << 30;
  CHECK_THROWS(plan_stages(RunType::kTrain, models, bad), std::invalid_argument,
               "num_microbatches must be from 1 to 1048576");
  CHECK_THROWS(plan_stages(RunType::kTrain, std::vector<LayerCosts>{}, options),
               std::invalid_argument, "at least one model");
  CHECK_THROWS(plan_stages(RunType::kTrain, std::vector<LayerCosts>{LayerCosts{}}, options),
               std::invalid_argument, "model 0 has no layers");
  std::vector<LayerCosts> ragged = models;
  ragged[0].backward_bytes.pop_back();
  CHECK_THROWS(plan_stages(RunType::kTrain, ragged, options), std::invalid_argument,
               "backward_bytes has 2 entries");
  std::vector<LayerCosts> negative = models;
  negative[0].recompute_seconds[1] = -1;
  CHECK_THROWS(plan_stages(RunType::kTrain, negative, options), std::invalid_argument,
               "recompute_seconds[1]");
  std::vector<LayerCosts> huge = models;
  huge[0].backward_bytes[2] = 50;
  CHECK_THROWS(plan_stages(RunType::kTrain, huge, options), std::invalid_argument,
               "layer 2 of model 0");
  CHECK_THROWS(parse_run_type("inference"), std::invalid_argument, "'infer', 'train' or 'fused'");
  CHECK(parse_run_type("fused") == RunType::kFused);
}
