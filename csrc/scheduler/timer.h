// Smoothed per-layer timings: what ModelExecutePlan.auto plans with (roundpipe.timer.ModelTimer
// keeps one per model and feeds it every layer x microbatch the runtime timed).
//
// Each (action, layer) estimate is an exponential moving average with bias correction (as in
// Adam): after records x_1..x_t it is sum(beta^(t-i) * (1-beta) * x_i) / (1 - beta^t), so the
// first record is taken as is and old records fade with `smoothing` = beta. A fold reports how
// many estimates moved by more than `change_threshold` (relative) from the value they had when
// they last moved that much, or got their first record: the runtime re-plans only then.
#pragma once

#include <optional>
#include <span>
#include <vector>

namespace roundpipe::scheduler {

class LayerTimings {
 public:
  static constexpr int kActions = 3;  // forward, recompute, backward

  LayerTimings(int layers, double smoothing, double change_threshold);

  // Folds seconds[i] of layers[i] doing `action`, in order. Every argument is checked before
  // anything is folded (std::invalid_argument). Returns the number of estimates that moved enough
  // to re-plan; with `estimates`, appends each record's new estimate.
  int fold(int action, std::span<const int> layers, std::span<const double> seconds,
           std::vector<double>* estimates = nullptr);

  // The estimate of `layer` doing `action`, or nothing before its first record.
  std::optional<double> estimate(int action, int layer) const;
  // Every layer's estimate of `action`.
  std::vector<std::optional<double>> estimates(int action) const;
  // How many records `layer` has for `action`.
  long records(int action, int layer) const;

  int layers() const { return layers_; }

 private:
  std::size_t at(int action, int layer) const;

  int layers_;
  double beta_;
  double threshold_;
  std::vector<double> average_;  // [action * layers + layer]
  std::vector<long> records_;    // same layout
  std::vector<double> planned_;  // estimate at the last move that mattered; < 0: none yet
};

}  // namespace roundpipe::scheduler
