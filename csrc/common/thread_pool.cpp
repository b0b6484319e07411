#include "common/thread_pool.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <memory>

namespace roundpipe {

namespace {
// Set while a thread executes tasks, so that a nested job runs inline instead of deadlocking on
// the pool it is already part of.
thread_local bool t_inside_job = false;

// How long an idle worker polls for the next job before it sleeps. Jobs come in bursts (an
// inf/NaN check, then the update, group after group, step after step) and waking a sleeping
// thread can take tens of microseconds on a virtual machine, a sizeable part of a small job.
constexpr auto kSpinBeforeSleep = std::chrono::microseconds(200);

struct InsideJob {
  bool previous = t_inside_job;
  InsideJob() { t_inside_job = true; }
  ~InsideJob() { t_inside_job = previous; }
};
}  // namespace

ThreadPool::ThreadPool(int max_workers) : max_workers_(std::max(0, max_workers)) {}

ThreadPool::~ThreadPool() {
  // Waiting for the submit lock lets a job still in flight on another thread finish first.
  std::lock_guard<std::mutex> submit(submit_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

int ThreadPool::started_workers() {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(workers_.size());
}

void ThreadPool::start_workers(int count) {
  while (static_cast<int>(workers_.size()) < count) {
    // A new worker may join the job about to be published (its generation is one ahead).
    workers_.emplace_back([this, seen = generation_] { worker_loop(seen); });
  }
}

void ThreadPool::worker_loop(std::uint64_t seen_generation) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    const auto job_waiting = [&] {
      return stopping_ || (generation_ != seen_generation && open_seats_ > 0);
    };
    if (!job_waiting()) {
      lock.unlock();
      const auto deadline = std::chrono::steady_clock::now() + kSpinBeforeSleep;
      while (published_.load(std::memory_order_acquire) == seen_generation &&
             std::chrono::steady_clock::now() < deadline) {
        std::this_thread::yield();
      }
      lock.lock();
    }
    wake_.wait(lock, job_waiting);
    if (stopping_) return;
    seen_generation = generation_;
    --open_seats_;
    ++busy_helpers_;
    const auto* task = task_;
    const std::int64_t num_tasks = num_tasks_;
    lock.unlock();
    run_tasks(*task, num_tasks);
    lock.lock();
    if (--busy_helpers_ == 0) done_.notify_all();
  }
}

void ThreadPool::run_tasks(const std::function<void(std::int64_t)>& task, std::int64_t num_tasks) {
  InsideJob inside;
  while (true) {
    const std::int64_t index = next_task_.fetch_add(1);
    if (index >= num_tasks) return;
    try {
      task(index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
      next_task_.store(num_tasks);
    }
  }
}

void ThreadPool::run(std::int64_t num_tasks, int num_threads,
                     const std::function<void(std::int64_t)>& task) {
  const std::int64_t helpers =
      std::min<std::int64_t>({num_threads - 1, max_workers_, num_tasks - 1});
  if (helpers <= 0 || t_inside_job) {
    for (std::int64_t index = 0; index < num_tasks; ++index) task(index);
    return;
  }
  std::lock_guard<std::mutex> submit(submit_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    start_workers(static_cast<int>(helpers));
    task_ = &task;
    num_tasks_ = num_tasks;
    next_task_.store(0);
    open_seats_ = static_cast<int>(helpers);
    ++generation_;
    published_.store(generation_, std::memory_order_release);
  }
  wake_.notify_all();
  run_tasks(task, num_tasks);
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    open_seats_ = 0;  // a helper that has not joined yet must not see a finished job
    done_.wait(lock, [&] { return busy_helpers_ == 0; });
    task_ = nullptr;
    std::swap(error, error_);
  }
  if (error) std::rethrow_exception(error);
}

ThreadPool& ThreadPool::global() {
  static std::mutex mutex;
  static std::unique_ptr<ThreadPool> pool;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (pool && owner != getpid()) {
    // A forked child inherits the pool object but not its threads: joining them would never
    // return, so the parent's pool is abandoned rather than destroyed.
    static_cast<void>(pool.release());
  }
  if (!pool) {
    const int hardware = static_cast<int>(std::thread::hardware_concurrency());
    pool = std::make_unique<ThreadPool>(std::max(1, hardware) - 1);
    owner = getpid();
  }
  return *pool;
}

void parallel_for_chunks(ThreadPool& pool, int num_threads, std::span<const std::int64_t> numels,
                         std::int64_t chunk,
                         const std::function<void(std::size_t, std::int64_t, std::int64_t)>& body) {
  std::vector<std::int64_t> offsets(numels.size() + 1, 0);
  for (std::size_t k = 0; k < numels.size(); ++k) offsets[k + 1] = offsets[k] + numels[k];
  const std::int64_t total = offsets.back();
  if (total == 0) return;
  chunk = std::max<std::int64_t>(chunk, 1);
  const std::int64_t num_chunks = (total + chunk - 1) / chunk;
  pool.run(num_chunks, num_threads, [&](std::int64_t index) {
    std::int64_t begin = index * chunk;
    const std::int64_t end = std::min(begin + chunk, total);
    // The last buffer starting at or before `begin`; empty buffers before it are skipped.
    auto k = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) -
                                      offsets.begin() - 1);
    while (begin < end) {
      const std::int64_t piece_end = std::min(end, offsets[k + 1]);
      if (piece_end > begin) body(k, begin - offsets[k], piece_end - offsets[k]);
      begin = std::max(begin, piece_end);
      ++k;
    }
  });
}

}  // namespace roundpipe
