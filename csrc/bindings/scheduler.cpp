#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "scheduler/scheduler.h"
#include "scheduler/simulator.h"
#include "scheduler/timer.h"

namespace py = pybind11;

namespace roundpipe::bindings {

namespace {

using scheduler::StageRange;

// forward_seconds, recompute_seconds, backward_seconds, forward_bytes, backward_bytes
using ProfileTuple = std::tuple<std::vector<double>, std::vector<double>, std::vector<double>,
                                std::vector<double>, std::vector<double>>;
using RangeList = std::vector<std::pair<int, int>>;

RangeList to_pairs(const std::vector<StageRange>& stages) {
  RangeList pairs;
  pairs.reserve(stages.size());
  for (const StageRange& stage : stages) pairs.emplace_back(stage.begin, stage.end);
  return pairs;
}

py::dict plan_stages(const std::string& run_type, std::vector<ProfileTuple> profiles,
                     int min_stages, double upper_threshold, double stage_memory_cap,
                     int num_devices, int num_microbatches, double upload_bytes_per_second) {
  std::vector<scheduler::LayerCosts> models;
  models.reserve(profiles.size());
  for (auto& [forward, recompute, backward, forward_bytes, backward_bytes] : profiles) {
    models.push_back({std::move(forward), std::move(recompute), std::move(backward),
                      std::move(forward_bytes), std::move(backward_bytes)});
  }
  const scheduler::PlanOptions options{min_stages,  upper_threshold,  stage_memory_cap,
                                       num_devices, num_microbatches, upload_bytes_per_second};
  scheduler::PlanResult result;
  {
    py::gil_scoped_release release;
    result = scheduler::plan_stages(scheduler::parse_run_type(run_type), models, options);
  }
  py::list plans;
  for (const scheduler::ModelPlan& plan : result.plans) {
    plans.append(py::make_tuple(to_pairs(plan.forward), to_pairs(plan.backward)));
  }
  py::list phases;
  for (const scheduler::PhaseSummary& phase : result.phases) {
    py::dict summary;
    summary["num_stages"] = phase.num_stages;
    summary["largest_stage_seconds"] = phase.largest_stage_seconds;
    summary["objective"] = phase.objective;
    summary["predicted_seconds"] = phase.predicted_seconds;
    summary["tied_plans"] = phase.tied_plans;
    phases.append(summary);
  }
  py::dict out;
  out["plans"] = plans;
  out["phases"] = phases;
  out["objective"] = result.objective;
  out["predicted_seconds"] = result.predicted_seconds;
  return out;
}

std::pair<double, std::vector<std::tuple<int, int, int, double, double>>> simulate(
    const std::vector<double>& stage_seconds, int num_devices, int num_microbatches,
    const std::optional<std::vector<double>>& upload_seconds) {
  if (upload_seconds && upload_seconds->size() != stage_seconds.size()) {
    throw py::value_error("upload_seconds has " + std::to_string(upload_seconds->size()) +
                          " entries but stage_seconds has " + std::to_string(stage_seconds.size()) +
                          "; give one per stage");
  }
  std::vector<scheduler::StageWork> stages(stage_seconds.size());
  for (std::size_t s = 0; s < stages.size(); ++s) {
    stages[s] = {stage_seconds[s], upload_seconds ? (*upload_seconds)[s] : 0.0};
  }
  std::vector<scheduler::ScheduledRun> trace;
  double makespan = 0.0;
  {
    py::gil_scoped_release release;
    makespan = scheduler::simulate_schedule(stages, num_devices, num_microbatches, &trace);
  }
  std::vector<std::tuple<int, int, int, double, double>> runs;
  runs.reserve(trace.size());
  for (const auto& run : trace) {
    runs.emplace_back(run.stage, run.microbatch, run.device, run.start, run.end);
  }
  return {makespan, std::move(runs)};
}

}  // namespace

void bind_scheduler(py::module_& m) {
  using scheduler::LayerTimings;
  py::class_<LayerTimings>(m, "LayerTimings",
                           "Smoothed per-layer, per-action timings (see "
                           "csrc/scheduler/timer.h); actions 0 forward, 1 recompute, 2 "
                           "backward. Invalid arguments raise ValueError.")
      .def(py::init<int, double, double>(), py::arg("layers"), py::arg("smoothing"),
           py::arg("change_threshold"))
      .def(
          "fold",
          [](LayerTimings& self, int action, const std::vector<int>& layers,
             const std::vector<double>& seconds) { return self.fold(action, layers, seconds); },
          py::arg("action"), py::arg("layers"), py::arg("seconds"),
          "Folds seconds[i] of layers[i] in order; returns how many estimates moved enough to "
          "re-plan.")
      .def(
          "fold_reporting",
          [](LayerTimings& self, int action, const std::vector<int>& layers,
             const std::vector<double>& seconds) {
            std::vector<double> estimates;
            const int moved = self.fold(action, layers, seconds, &estimates);
            return std::make_pair(moved, estimates);
          },
          py::arg("action"), py::arg("layers"), py::arg("seconds"),
          "fold, also returning each record's new estimate.")
      .def("estimate", &LayerTimings::estimate, py::arg("action"), py::arg("layer"))
      .def("estimates", &LayerTimings::estimates, py::arg("action"))
      .def("records", &LayerTimings::records, py::arg("action"), py::arg("layer"));
  m.def("plan_stages", &plan_stages, py::arg("run_type"), py::arg("profiles"),
        py::arg("min_stages"), py::arg("upper_threshold"), py::arg("stage_memory_cap"),
        py::arg("num_devices"), py::arg("num_microbatches"),
        py::arg("upload_bytes_per_second") = 0.0,
        "Exact stage partitions for ModelExecutePlan.auto (see csrc/scheduler/scheduler.h).");
  m.def("simulate_schedule", &simulate, py::arg("stage_seconds"), py::arg("num_devices"),
        py::arg("num_microbatches"), py::arg("upload_seconds") = py::none(),
        "Predicted makespan and (stage, microbatch, device, start, end) runs of round-robin "
        "dispatch (see csrc/scheduler/simulator.h).");
}

}  // namespace roundpipe::bindings
