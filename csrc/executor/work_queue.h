// A host worker thread that runs jobs from prioritised lanes (lower lane index first), started
// lazily on the first job so that creating a queue starts no thread. The destructor finishes the
// queued jobs and joins the worker.
//
// Fork: a forked child inherits the queue but not its thread. The first use in the child abandons
// the parent's state (its jobs, locks and thread handle are leaked, never run, locked or joined)
// and starts afresh, so a child can use the queue and exit promptly.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace roundpipe::executor {

// This process's id, cached: getpid() is a system call, and the fork checks here and in Event ask
// for it on every job and event. A forked child's first call already returns the child's id.
pid_t current_pid();

class WorkQueue {
 public:
  static constexpr int kLanes = 3;

  WorkQueue();
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  // `job` must not throw: jobs report their own errors (through their Event). A job must release
  // what it captured (tensors may own Python objects) before it signals completion: after the
  // signal the caller may move on, even into interpreter shutdown.
  void submit(int lane, std::function<void()> job);

  // Returns once every job submitted before the call has run (no-op if none ever was). With
  // `check`, waits in slices and calls it between them; it may throw to abandon the wait (the
  // jobs still run, the wait's own marker job included).
  void drain(const std::function<void()>& check = {});

  // True when no job is queued or running: work the caller does itself now is ordered after
  // every job submitted before, as the next job would be.
  bool idle();

 private:
  struct State {
    explicit State(pid_t owner_pid) : owner(owner_pid) {}
    const pid_t owner;
    std::mutex mutex;
    std::condition_variable ready_cv;
    std::array<std::deque<std::function<void()>>, kLanes> lanes;
    bool stopping = false;
    bool running = false;  // the worker is running a job
    std::thread worker;
  };

  static constexpr std::chrono::milliseconds kDrainSlice{50};

  // This process's state (a fresh one in a forked child).
  State& state();
  static void run(State& state);

  std::atomic<State*> state_;
};

}  // namespace roundpipe::executor
