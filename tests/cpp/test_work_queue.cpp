#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "executor/work_queue.h"
#include "harness.h"

using roundpipe::executor::WorkQueue;

TEST_CASE("work_queue_runs_lanes_in_priority_order") {
  WorkQueue queue;
  std::mutex mutex;
  std::vector<int> order;
  std::atomic<bool> release{false};
  // The first job holds the worker so that the next ones queue up behind it.
  queue.submit(0, [&] {
    while (!release.load()) std::this_thread::yield();
  });
  for (int lane : {2, 1, 0, 2, 0}) {
    queue.submit(lane, [&, lane] {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(lane);
    });
  }
  release.store(true);
  queue.drain();
  CHECK(order == (std::vector<int>{0, 0, 1, 2, 2}));
}

TEST_CASE("work_queue_rejects_a_bad_lane") {
  WorkQueue queue;
  CHECK_THROWS(queue.submit(WorkQueue::kLanes, [] {}), std::invalid_argument, "lane");
}

TEST_CASE("work_queue_forked_child_starts_afresh") {
#ifdef __SANITIZE_THREAD__
  // ThreadSanitizer cannot start threads in the child of a multi-threaded fork; the other builds
  // (plain and ASan/UBSan) run this case.
  return;
#endif
  WorkQueue queue;
  std::atomic<bool> release{false};
  std::atomic<bool> started{false};
  // The parent's worker is busy (and its job still queued behind) when the process forks.
  queue.submit(0, [&] {
    started.store(true);
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  queue.submit(1, [] {});
  while (!started.load()) std::this_thread::yield();
  const pid_t child = fork();
  if (child == 0) {
    // Neither the parent's thread nor its queued job exists here; a new job must still run, and
    // drain must return instead of waiting for them.
    std::atomic<int> ran{0};
    queue.submit(0, [&] { ran.fetch_add(1); });
    queue.drain();
    _exit(ran.load() == 1 ? 0 : 3);
  }
  CHECK(child > 0);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  pid_t done = 0;
  while ((done = waitpid(child, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (done == 0) {  // hung: do not leave it behind
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  release.store(true);
  queue.drain();
  CHECK_EQ(done, child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST_CASE("work_queue_drain_with_a_check_can_be_abandoned") {
  WorkQueue queue;
  std::atomic<bool> release{false};
  queue.submit(0, [&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  // The worker is stuck: the check is called between slices of the wait and ends it by throwing.
  int checks = 0;
  const auto give_up_third_time = [&] {
    if (++checks == 3) throw std::runtime_error("given up");
  };
  CHECK_THROWS(queue.drain(give_up_third_time), std::runtime_error, "given up");
  CHECK_EQ(checks, 3);
  // The abandoned wait's marker job still runs (into state it shares, not the dead frame).
  std::atomic<int> ran{0};
  queue.submit(2, [&] { ran.fetch_add(1); });
  release.store(true);
  queue.drain([] {});
  CHECK_EQ(ran.load(), 1);
}
