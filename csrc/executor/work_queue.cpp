#include "executor/work_queue.h"

#include <stdexcept>
#include <string>

namespace roundpipe::executor {

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  ready_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void WorkQueue::submit(int lane, std::function<void()> job) {
  if (lane < 0 || lane >= kLanes) {
    throw std::invalid_argument("WorkQueue lane must be in [0, " + std::to_string(kLanes) +
                                "), got " + std::to_string(lane));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lanes_[lane].push_back(std::move(job));
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
  }
  ready_cv_.notify_one();
}

void WorkQueue::drain() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!worker_.joinable()) return;
  }
  std::mutex done_mutex;
  std::condition_variable done_cv;
  bool done = false;
  // The lowest-priority lane runs last: once this job runs, every earlier job has.
  submit(kLanes - 1, [&] {
    std::lock_guard<std::mutex> lock(done_mutex);
    done = true;
    done_cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(done_mutex);
  done_cv.wait(lock, [&] { return done; });
}

void WorkQueue::run() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_cv_.wait(lock, [this] {
        if (stopping_) return true;
        for (const auto& lane : lanes_) {
          if (!lane.empty()) return true;
        }
        return false;
      });
      for (auto& lane : lanes_) {
        if (!lane.empty()) {
          job = std::move(lane.front());
          lane.pop_front();
          break;
        }
      }
      if (!job) return;  // stopping and drained
    }
    job();
  }
}

}  // namespace roundpipe::executor
