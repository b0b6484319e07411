// A host worker thread that runs jobs from prioritised lanes (lower lane index first), started
// lazily on the first job so that creating a queue starts no thread. The destructor finishes the
// queued jobs and joins the worker.
#pragma once

#include <array>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace roundpipe::executor {

class WorkQueue {
 public:
  static constexpr int kLanes = 3;

  WorkQueue() = default;
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // `job` must not throw: jobs report their own errors (through their Event).
  void submit(int lane, std::function<void()> job);

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable ready_cv_;
  std::array<std::deque<std::function<void()>>, kLanes> lanes_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace roundpipe::executor
