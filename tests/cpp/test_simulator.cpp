// The schedule simulator against schedules worked out by hand and the flow-shop closed form.
#include <stdexcept>
#include <vector>

#include "harness.h"
#include "scheduler/simulator.h"

using roundpipe::scheduler::ScheduledRun;
using roundpipe::scheduler::simulate_schedule;
using roundpipe::scheduler::StageWork;

TEST_CASE("simulator_two_devices_three_stages_by_hand") {
  // Device 0 runs stages 0 and 2, device 1 stage 1. Stage 2 waits for stage 1 of each
  // microbatch: m0 runs [3,4], m1 waits for stage 1 to finish it at 5, runs [5,6].
  const std::vector<StageWork> stages{{1, 0}, {2, 0}, {1, 0}};
  std::vector<ScheduledRun> trace;
  CHECK_EQ(simulate_schedule(stages, 2, 2, &trace), 6.0);
  const std::vector<std::vector<double>> expected{
      // stage, microbatch, device, start, end
      {0, 0, 0, 0, 1}, {0, 1, 0, 1, 2}, {1, 0, 1, 1, 3},
      {1, 1, 1, 3, 5}, {2, 0, 0, 3, 4}, {2, 1, 0, 5, 6},
  };
  CHECK_EQ(trace.size(), expected.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    CHECK_EQ(trace[i].stage, static_cast<int>(expected[i][0]));
    CHECK_EQ(trace[i].microbatch, static_cast<int>(expected[i][1]));
    CHECK_EQ(trace[i].device, static_cast<int>(expected[i][2]));
    CHECK_EQ(trace[i].start, expected[i][3]);
    CHECK_EQ(trace[i].end, expected[i][4]);
  }
}

TEST_CASE("simulator_upload_overlaps_compute_with_one_prefetch_slot") {
  // One device, one microbatch. Stage 0 uploads [0,1] and computes [1,4]; stage 1's upload
  // overlaps that compute ([1,2]); stage 2 must wait for stage 0 to free its slot (at 4), uploads
  // [4,5] while stage 1 computes [4,7], then computes [7,10].
  const std::vector<StageWork> compute_bound{{3, 1}, {3, 1}, {3, 1}};
  CHECK_EQ(simulate_schedule(compute_bound, 1, 1), 10.0);
  // Upload-bound: uploads [0,2], [2,4], [4,6] back to back; compute [2,3], [4,5], [6,7].
  const std::vector<StageWork> upload_bound{{1, 2}, {1, 2}, {1, 2}};
  CHECK_EQ(simulate_schedule(upload_bound, 1, 1), 7.0);
}

TEST_CASE("simulator_three_devices_uniform_pipeline") {
  // Stage s of microbatch m starts at s + m: the classic fill/drain diagonal.
  const std::vector<StageWork> stages(3, StageWork{1, 0});
  std::vector<ScheduledRun> trace;
  CHECK_EQ(simulate_schedule(stages, 3, 4, &trace), 6.0);
  for (const ScheduledRun& run : trace) CHECK_EQ(run.start, run.stage + run.microbatch);
}

TEST_CASE("simulator_matches_flow_shop_closed_form_without_device_sharing") {
  // With a device per stage and identical microbatches the makespan of a flow shop is
  // sum(t) + (M - 1) * max(t).
  const std::vector<StageWork> stages{{0.5, 0}, {2.0, 0}, {1.25, 0}, {0.75, 0}};
  for (int microbatches = 1; microbatches <= 6; ++microbatches) {
    CHECK_EQ(simulate_schedule(stages, 4, microbatches), 4.5 + (microbatches - 1) * 2.0);
    CHECK_EQ(simulate_schedule(stages, 7, microbatches), 4.5 + (microbatches - 1) * 2.0);
  }
}

TEST_CASE("simulator_one_device_runs_everything_in_sequence") {
  const std::vector<StageWork> stages{{0.5, 0}, {2.0, 0}, {1.25, 0}};
  CHECK_EQ(simulate_schedule(stages, 1, 3), 3 * 3.75);
  CHECK_EQ(simulate_schedule({}, 2, 3), 0.0);
}

TEST_CASE("simulator_rejects_bad_arguments") {
  const std::vector<StageWork> stages{{1, 0}};
  CHECK_THROWS(simulate_schedule(stages, 0, 1), std::invalid_argument, "num_devices");
  CHECK_THROWS(simulate_schedule(stages, 1, 0), std::invalid_argument, "num_microbatches");
  const std::vector<StageWork> negative{{1, 0}, {-1, 0}};
  CHECK_THROWS(simulate_schedule(negative, 1, 1), std::invalid_argument,
               "seconds_per_microbatch of stage 1");
  const std::vector<StageWork> bad_upload{{1, -2}};
  CHECK_THROWS(simulate_schedule(bad_upload, 1, 1), std::invalid_argument, "upload_seconds");
}
