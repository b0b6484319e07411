// LayerTimings (csrc/scheduler/timer.h) against the moving average written out by hand.
#include <cmath>
#include <stdexcept>
#include <vector>

#include "harness.h"
#include "scheduler/timer.h"

using roundpipe::scheduler::LayerTimings;

namespace {

// sum(beta^(t-1-i) * (1-beta) * x_i) / (1 - beta^t): the estimate after records x_0..x_{t-1}.
double reference(const std::vector<double>& records, double beta) {
  const auto t = static_cast<double>(records.size());
  double weighted = 0.0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    weighted += std::pow(beta, t - 1 - static_cast<double>(i)) * (1 - beta) * records[i];
  }
  return weighted / (1 - std::pow(beta, t));
}

}  // namespace

TEST_CASE("layer_timings_estimate_is_the_bias_corrected_average") {
  LayerTimings timings(3, 0.9, 0.05);
  CHECK(!timings.estimate(0, 1).has_value());
  const std::vector<double> records{1.0, 3.0, 2.0, 2.5, 0.5};
  std::vector<double> estimates;
  timings.fold(2, std::vector<int>(records.size(), 1), records, &estimates);
  CHECK(std::abs(*timings.estimate(2, 1) - reference(records, 0.9)) < 1e-12);
  CHECK_EQ(estimates.front(), 1.0);  // the first record is taken as is
  CHECK(std::abs(estimates.back() - reference(records, 0.9)) < 1e-12);
  CHECK_EQ(timings.records(2, 1), 5L);
  CHECK(!timings.estimate(0, 1).has_value() && !timings.estimate(2, 0).has_value());
}

TEST_CASE("layer_timings_report_only_moves_that_matter") {
  LayerTimings timings(2, 0.9, 0.05);
  CHECK_EQ(timings.fold(0, std::vector<int>{0, 1}, std::vector<double>{1.0, 1.0}), 2);  // first
  CHECK_EQ(timings.fold(0, std::vector<int>{0}, std::vector<double>{1.02}), 0);         // within 5%
  CHECK_EQ(timings.fold(0, std::vector<int>{0}, std::vector<double>{5.0}), 1);
}

TEST_CASE("layer_timings_check_everything_before_folding") {
  LayerTimings timings(2, 0.9, 0.05);
  CHECK_THROWS(timings.fold(0, std::vector<int>{0, 2}, std::vector<double>{1.0, 1.0}),
               std::invalid_argument, "not within [0, 2)");
  CHECK_THROWS(timings.fold(0, std::vector<int>{0, 1}, std::vector<double>{1.0, NAN}),
               std::invalid_argument, "finite and non-negative");
  CHECK_THROWS(timings.fold(0, std::vector<int>{0}, std::vector<double>{-1.0}),
               std::invalid_argument, "finite and non-negative");
  CHECK_THROWS(timings.fold(3, std::vector<int>{0}, std::vector<double>{1.0}),
               std::invalid_argument, "action");
  CHECK_THROWS(timings.fold(0, std::vector<int>{0}, std::vector<double>{}), std::invalid_argument,
               "one time per layer");
  CHECK(!timings.estimate(0, 0).has_value());  // nothing folded by the refused calls
  CHECK_THROWS(LayerTimings(0, 0.9, 0.05), std::invalid_argument, "positive");
  CHECK_THROWS(LayerTimings(1, 1.0, 0.05), std::invalid_argument, "smoothing");
}
