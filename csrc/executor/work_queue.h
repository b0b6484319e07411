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

  // `job` must not throw: jobs report their own errors (through their Event). A job must release
  // what it captured (tensors may own Python objects) before it signals completion: after the
  // signal the caller may move on, even into interpreter shutdown.
  void submit(int lane, std::function<void()> job);

  // Returns once every job submitted before the call has run (no-op if none ever was).
  void drain();

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable ready_cv_;
  std::array<std::deque<std::function<void()>>, kLanes> lanes_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace roundpipe::executor
