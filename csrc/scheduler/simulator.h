// Schedule simulator: predicts the iteration time of RoundPipe's round-robin dispatch.
//
// Model of the runtime:
//   * stage s runs on device s mod D; a device runs its stages in order, one at a time, each stage
//     processing microbatches 0..M-1 in order;
//   * stage s of microbatch m starts after stage s-1 of microbatch m (activation / gradient
//     dependency) and after the device finished what it ran before;
//   * a device holds at most two stages' parameters (the one computing and the prefetched next),
//     so the upload of stage s starts once stage s-2D has finished and the device's previous
//     upload is done; it overlaps the compute of stage s-D. A stage starts computing only once its
//     upload is complete.
// Transfers of activations and gradient downloads are not modelled (they overlap compute and are
// small next to parameter uploads). Cost: O(S * M) time, O(M + S) memory.
#pragma once

#include <span>
#include <vector>

namespace roundpipe::scheduler {

struct StageWork {
  double seconds_per_microbatch = 0.0;  // compute time of one microbatch through the stage
  double upload_seconds = 0.0;          // time to copy the stage's parameters to its device
};

struct ScheduledRun {
  int stage = 0;
  int microbatch = 0;
  int device = 0;
  double start = 0.0;
  double end = 0.0;
};

// Returns the makespan (seconds from the first upload to the last compute). When `trace` is not
// null it receives every (stage, microbatch) run in stage-major order. Throws
// std::invalid_argument for num_devices < 1, num_microbatches < 1 or a negative / non-finite time.
double simulate_schedule(std::span<const StageWork> stages, int num_devices, int num_microbatches,
                         std::vector<ScheduledRun>* trace = nullptr);

}  // namespace roundpipe::scheduler
