#include "scheduler/simulator.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace roundpipe::scheduler {

namespace {

void check_time(double seconds, const char* what, std::size_t stage) {
  if (!std::isfinite(seconds) || seconds < 0.0) {
    throw std::invalid_argument(std::string(what) + " of stage " + std::to_string(stage) +
                                " must be a finite non-negative number of seconds, got " +
                                std::to_string(seconds));
  }
}

}  // namespace

double simulate_schedule(std::span<const StageWork> stages, int num_devices, int num_microbatches,
                         std::vector<ScheduledRun>* trace) {
  // Bounded above too: the schedule's memory and time grow with both.
  constexpr int kMaxDevices = 1 << 16;
  constexpr int kMaxMicrobatches = 1 << 20;
  if (num_devices < 1 || num_devices > kMaxDevices) {
    throw std::invalid_argument("num_devices must be from 1 to " + std::to_string(kMaxDevices) +
                                ", got " + std::to_string(num_devices));
  }
  if (num_microbatches < 1 || num_microbatches > kMaxMicrobatches) {
    throw std::invalid_argument("num_microbatches must be from 1 to " +
                                std::to_string(kMaxMicrobatches) + ", got " +
                                std::to_string(num_microbatches));
  }
  for (std::size_t s = 0; s < stages.size(); ++s) {
    check_time(stages[s].seconds_per_microbatch, "seconds_per_microbatch", s);
    check_time(stages[s].upload_seconds, "upload_seconds", s);
  }
  if (trace != nullptr) {
    trace->clear();
    trace->reserve(stages.size() * static_cast<std::size_t>(num_microbatches));
  }
  const auto devices = static_cast<std::size_t>(num_devices);
  // finished[s]: when stage s computed its last microbatch (frees its parameters on the device).
  std::vector<double> finished(stages.size(), 0.0);
  std::vector<double> copy_engine_free(devices, 0.0);
  std::vector<double> device_free(devices, 0.0);
  // previous[m]: when stage s-1 finished microbatch m; all zero before the first stage.
  std::vector<double> previous(static_cast<std::size_t>(num_microbatches), 0.0);
  double makespan = 0.0;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const std::size_t device = s % devices;
    const double slot_free = s >= 2 * devices ? finished[s - 2 * devices] : 0.0;
    const double upload_start = std::max(copy_engine_free[device], slot_free);
    const double uploaded = upload_start + stages[s].upload_seconds;
    copy_engine_free[device] = uploaded;
    double ready = std::max(uploaded, device_free[device]);
    for (int m = 0; m < num_microbatches; ++m) {
      const double start = std::max(ready, previous[static_cast<std::size_t>(m)]);
      const double end = start + stages[s].seconds_per_microbatch;
      previous[static_cast<std::size_t>(m)] = end;
      ready = end;
      if (trace != nullptr) {
        trace->push_back({static_cast<int>(s), m, static_cast<int>(device), start, end});
      }
    }
    finished[s] = ready;
    device_free[device] = ready;
    makespan = std::max(makespan, ready);
  }
  return makespan;
}

}  // namespace roundpipe::scheduler
