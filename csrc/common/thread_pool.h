// A small pool of native worker threads for host-side data-parallel passes (the optimizer
// kernels). Torch-free, so the kernels and their tests do not depend on ATen's thread pool.
//
// Workers are started lazily, on the first job that wants them, so importing roundpipe starts no
// thread. An idle worker polls for the next job for a short while before it sleeps, since jobs
// come in bursts. A job is a number of independent tasks; the calling thread takes part, the
// remaining tasks are shared out dynamically. One job runs at a time; a job submitted from inside a
// task runs inline on that thread instead of waiting for the pool (which would deadlock).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace roundpipe {

class ThreadPool {
 public:
  // At most `max_workers` helper threads will ever be started (the caller is the extra one).
  explicit ThreadPool(int max_workers);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs task(i) for every i in [0, num_tasks) on up to `num_threads` threads including the
  // caller, and returns when all are done. The first exception a task throws is rethrown here
  // after the others finished; tasks not yet started when it was thrown are skipped.
  void run(std::int64_t num_tasks, int num_threads, const std::function<void(std::int64_t)>& task);

  int max_workers() const { return max_workers_; }
  // Helper threads started so far.
  int started_workers();

  // The process-wide pool, sized to the machine's hardware threads. Created on first use.
  static ThreadPool& global();

 private:
  void start_workers(int count);
  void worker_loop(std::uint64_t seen_generation);
  void run_tasks(const std::function<void(std::int64_t)>& task, std::int64_t num_tasks);

  const int max_workers_;
  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
  // The current job, guarded by mutex_ except next_task_, which tasks claim concurrently.
  const std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t num_tasks_ = 0;
  std::uint64_t generation_ = 0;
  std::atomic<std::uint64_t> published_{0};  // generation_, readable without the lock
  int open_seats_ = 0;                       // helpers that may still join the current job
  int busy_helpers_ = 0;
  std::exception_ptr error_;
  std::atomic<std::int64_t> next_task_{0};
};

// Splits the concatenation of several buffers (numels[k] elements each) into chunks of about
// `chunk` elements and runs body(k, begin, end) for every piece of a chunk that falls in buffer
// k, on up to `num_threads` threads of `pool`. Chunks span buffer boundaries, so many small
// buffers share one task instead of paying one task (or one parallel region) each.
void parallel_for_chunks(ThreadPool& pool, int num_threads, std::span<const std::int64_t> numels,
                         std::int64_t chunk,
                         const std::function<void(std::size_t, std::int64_t, std::int64_t)>& body);

}  // namespace roundpipe
