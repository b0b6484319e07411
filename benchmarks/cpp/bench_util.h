// Shared by the C++ microbenchmarks: a wall clock, a fixed-width table on stdout, and one
// machine-readable line per benchmark (`BENCH_JSON {...}`) that scripts can grep for.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe::bench {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// One row: a name and named numeric columns (the same columns, in the same order, in every row).
struct Row {
  std::string name;
  std::vector<std::pair<std::string, double>> values;
};

class Report {
 public:
  explicit Report(std::string bench) : bench_(std::move(bench)) {}

  void add(Row row) { rows_.push_back(std::move(row)); }

  // The table, then `BENCH_JSON {"bench": ..., "rows": [{"name": ..., column: value, ...}]}`.
  void print() const {
    if (rows_.empty()) return;
    std::printf("%-34s", "case");
    for (const auto& [column, value] : rows_.front().values) std::printf(" %14s", column.c_str());
    std::printf("\n");
    for (const Row& row : rows_) {
      std::printf("%-34s", row.name.c_str());
      for (const auto& [column, value] : row.values) std::printf(" %14.3f", value);
      std::printf("\n");
    }
    std::string json = "{\"bench\": \"" + bench_ + "\", \"rows\": [";
    for (std::size_t i = 0; i < rows_.size(); ++i) {
      json += (i ? ", " : "") + std::string("{\"name\": \"") + rows_[i].name + "\"";
      for (const auto& [column, value] : rows_[i].values) {
        char number[64];
        std::snprintf(number, sizeof(number), "%.6g", value);
        json += ", \"" + column + "\": " + number;
      }
      json += "}";
    }
    json += "]}";
    std::printf("BENCH_JSON %s\n", json.c_str());
    std::fflush(stdout);
  }

 private:
  std::string bench_;
  std::vector<Row> rows_;
};

// Median of `samples` (taken by value: sorted here).
inline double median(std::vector<double> samples) {
  if (samples.empty()) return 0.0;
  std::sort(samples.begin(), samples.end());
  const std::size_t mid = samples.size() / 2;
  return samples.size() % 2 ? samples[mid] : 0.5 * (samples[mid - 1] + samples[mid]);
}

}  // namespace roundpipe::bench
