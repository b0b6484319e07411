#include "executor/work_queue.h"

#include <pthread.h>
#include <unistd.h>

#include <memory>
#include <stdexcept>
#include <string>

namespace roundpipe::executor {
namespace {

std::atomic<pid_t> cached_pid{0};

void refresh_pid() { cached_pid.store(getpid(), std::memory_order_relaxed); }

}  // namespace

pid_t current_pid() {
  // Registered once; the handler runs in every forked child before fork() returns there.
  static const bool registered = [] {
    refresh_pid();
    return pthread_atfork(nullptr, nullptr, &refresh_pid) == 0;
  }();
  return registered ? cached_pid.load(std::memory_order_relaxed) : getpid();
}

WorkQueue::WorkQueue() : state_(new State(current_pid())) {}

WorkQueue::~WorkQueue() {
  State* state = state_.load();
  if (state->owner != current_pid()) return;  // the parent's: leaked (see the header)
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->stopping = true;
  }
  state->ready_cv.notify_all();
  if (state->worker.joinable()) state->worker.join();
  delete state;
}

WorkQueue::State& WorkQueue::state() {
  State* current = state_.load(std::memory_order_acquire);
  const pid_t self = current_pid();
  while (current->owner != self) {
    auto* fresh = new State(self);
    if (state_.compare_exchange_strong(current, fresh, std::memory_order_acq_rel)) {
      return *fresh;  // the parent's state is abandoned, never touched again
    }
    delete fresh;  // another thread of this child replaced it first; `current` is now that one
  }
  return *current;
}

void WorkQueue::submit(int lane, std::function<void()> job) {
  if (lane < 0 || lane >= kLanes) {
    throw std::invalid_argument("WorkQueue lane must be in [0, " + std::to_string(kLanes) +
                                "), got " + std::to_string(lane));
  }
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.lanes[lane].push_back(std::move(job));
    if (!s.worker.joinable()) s.worker = std::thread([&s] { run(s); });
  }
  s.ready_cv.notify_one();
}

void WorkQueue::drain(const std::function<void()>& check) {
  {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.worker.joinable()) return;
  }
  // Owned with the marker job: a wait that `check` abandons leaves the job to run later.
  struct Marker {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto marker = std::make_shared<Marker>();
  // The lowest-priority lane runs last: once this job runs, every earlier job has.
  submit(kLanes - 1, [marker] {
    std::lock_guard<std::mutex> lock(marker->mutex);
    marker->done = true;
    marker->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(marker->mutex);
  const auto done = [&marker] { return marker->done; };
  if (!check) {
    marker->cv.wait(lock, done);
    return;
  }
  while (!marker->cv.wait_for(lock, kDrainSlice, done)) {
    lock.unlock();
    check();
    lock.lock();
  }
}

bool WorkQueue::idle() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.running) return false;
  for (const auto& lane : s.lanes) {
    if (!lane.empty()) return false;
  }
  return true;
}

void WorkQueue::run(State& s) {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(s.mutex);
      s.running = false;
      s.ready_cv.wait(lock, [&s] {
        if (s.stopping) return true;
        for (const auto& lane : s.lanes) {
          if (!lane.empty()) return true;
        }
        return false;
      });
      for (auto& lane : s.lanes) {
        if (!lane.empty()) {
          job = std::move(lane.front());
          lane.pop_front();
          break;
        }
      }
      if (!job) return;  // stopping and drained
      s.running = true;
    }
    job();
  }
}

}  // namespace roundpipe::executor
