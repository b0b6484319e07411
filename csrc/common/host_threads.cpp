#include "common/host_threads.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>

namespace roundpipe {

namespace {
std::atomic<int> g_fixed_threads{0};

// `text` as a positive integer, or 0 when it is not one.
int positive_integer(std::string_view text) {
  int value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  return error == std::errc() && end == text.data() + text.size() && value > 0 ? value : 0;
}
}  // namespace

int affinity_threads() {
  int cpus = 0;
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (sched_getaffinity(0, sizeof(mask), &mask) == 0) cpus = CPU_COUNT(&mask);
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  const char* local_ranks = std::getenv("LOCAL_WORLD_SIZE");
  const int sharing = local_ranks != nullptr ? std::max(1, positive_integer(local_ranks)) : 1;
  return std::max(1, cpus / sharing);
}

int optimizer_threads() {
  if (const int fixed = g_fixed_threads.load(); fixed > 0) return fixed;
  if (const char* text = std::getenv("ROUNDPIPE_OPTIMIZER_THREADS"); text != nullptr && *text) {
    const int value = positive_integer(text);
    if (value == 0) {
      throw std::invalid_argument(std::string("ROUNDPIPE_OPTIMIZER_THREADS must be a positive "
                                              "integer, got '") +
                                  text + "'; unset it to use the CPUs this process may run on");
    }
    return value;
  }
  return affinity_threads();
}

void set_optimizer_threads(int threads) {
  if (threads < 0) {
    throw std::invalid_argument("threads must be positive, or 0 for the default; got " +
                                std::to_string(threads));
  }
  g_fixed_threads.store(threads);
}

}  // namespace roundpipe
