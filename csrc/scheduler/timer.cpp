#include "scheduler/timer.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace roundpipe::scheduler {

LayerTimings::LayerTimings(int layers, double smoothing, double change_threshold)
    : layers_(layers), beta_(smoothing), threshold_(change_threshold) {
  if (layers < 1)
    throw std::invalid_argument("layers must be positive, got " + std::to_string(layers));
  if (!(smoothing >= 0.0 && smoothing < 1.0)) {
    throw std::invalid_argument("smoothing must lie in [0, 1), got " + std::to_string(smoothing));
  }
  if (!(change_threshold >= 0.0) || !std::isfinite(change_threshold)) {
    throw std::invalid_argument("change_threshold must be finite and non-negative, got " +
                                std::to_string(change_threshold));
  }
  const auto size = static_cast<std::size_t>(kActions) * static_cast<std::size_t>(layers);
  average_.assign(size, 0.0);
  records_.assign(size, 0);
  planned_.assign(size, -1.0);
}

std::size_t LayerTimings::at(int action, int layer) const {
  if (action < 0 || action >= kActions) {
    throw std::invalid_argument("action must be 0 (forward), 1 (recompute) or 2 (backward), got " +
                                std::to_string(action));
  }
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument("layer " + std::to_string(layer) + " is not within [0, " +
                                std::to_string(layers_) + ")");
  }
  return static_cast<std::size_t>(action) * static_cast<std::size_t>(layers_) +
         static_cast<std::size_t>(layer);
}

int LayerTimings::fold(int action, std::span<const int> layers, std::span<const double> seconds,
                       std::vector<double>* estimates) {
  if (layers.size() != seconds.size()) {
    throw std::invalid_argument("got " + std::to_string(layers.size()) + " layers but " +
                                std::to_string(seconds.size()) + " times; pass one time per layer");
  }
  for (std::size_t i = 0; i < layers.size(); ++i) {
    at(action, layers[i]);
    if (!(seconds[i] >= 0.0) || !std::isfinite(seconds[i])) {
      throw std::invalid_argument("seconds must be finite and non-negative, got " +
                                  std::to_string(seconds[i]));
    }
  }
  int moved = 0;
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const std::size_t k = at(action, layers[i]);
    average_[k] = beta_ * average_[k] + (1.0 - beta_) * seconds[i];
    records_[k] += 1;
    const double estimate = average_[k] / (1.0 - std::pow(beta_, static_cast<double>(records_[k])));
    const double before = planned_[k];
    if (before < 0.0 || std::abs(estimate - before) > threshold_ * before) {
      planned_[k] = estimate;
      ++moved;
    }
    if (estimates != nullptr) estimates->push_back(estimate);
  }
  return moved;
}

std::optional<double> LayerTimings::estimate(int action, int layer) const {
  const std::size_t k = at(action, layer);
  if (records_[k] == 0) return std::nullopt;
  return average_[k] / (1.0 - std::pow(beta_, static_cast<double>(records_[k])));
}

std::vector<std::optional<double>> LayerTimings::estimates(int action) const {
  std::vector<std::optional<double>> all;
  all.reserve(static_cast<std::size_t>(layers_));
  for (int layer = 0; layer < layers_; ++layer) all.push_back(estimate(action, layer));
  return all;
}

long LayerTimings::records(int action, int layer) const { return records_[at(action, layer)]; }

}  // namespace roundpipe::scheduler
