#include <atomic>
#include <stdexcept>
#include <vector>

#include "common/thread_pool.h"
#include "harness.h"

using namespace roundpipe;

TEST_CASE("thread_pool_runs_every_task_once") {
  ThreadPool pool(3);
  for (int round = 0; round < 20; ++round) {
    std::vector<std::atomic<int>> hits(1000);
    pool.run(1000, 4, [&](std::int64_t i) { hits[static_cast<std::size_t>(i)].fetch_add(1); });
    for (const auto& hit : hits) CHECK_EQ(hit.load(), 1);
  }
}

TEST_CASE("thread_pool_starts_workers_lazily_and_within_the_limit") {
  ThreadPool pool(3);
  CHECK_EQ(pool.started_workers(), 0);
  pool.run(1, 4, [](std::int64_t) {});  // one task: the caller alone
  CHECK_EQ(pool.started_workers(), 0);
  pool.run(100, 2, [](std::int64_t) {});
  CHECK_EQ(pool.started_workers(), 1);
  pool.run(100, 64, [](std::int64_t) {});
  CHECK_EQ(pool.started_workers(), 3);
}

TEST_CASE("thread_pool_uses_several_threads") {
  ThreadPool pool(1);
  std::atomic<int> inside{0};
  std::atomic<int> most{0};
  pool.run(2, 2, [&](std::int64_t) {
    const int now = inside.fetch_add(1) + 1;
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
    // Each task waits for the other, so the job only ends if both run at the same time.
    while (inside.load() < 2) std::this_thread::yield();
  });
  CHECK_EQ(most.load(), 2);
}

TEST_CASE("thread_pool_rethrows_a_worker_exception_and_stays_usable") {
  ThreadPool pool(3);
  CHECK_THROWS(pool.run(64, 4,
                        [](std::int64_t i) {
                          if (i == 37) throw std::runtime_error("task 37 failed");
                        }),
               std::runtime_error, "task 37 failed");
  std::atomic<int> count{0};
  pool.run(64, 4, [&](std::int64_t) { count.fetch_add(1); });
  CHECK_EQ(count.load(), 64);
}

TEST_CASE("thread_pool_nested_jobs_run_inline") {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  pool.run(8, 3, [&](std::int64_t) { pool.run(8, 3, [&](std::int64_t) { count.fetch_add(1); }); });
  CHECK_EQ(count.load(), 64);
}

TEST_CASE("thread_pool_destructor_joins_idle_and_never_used_workers") {
  for (int round = 0; round < 50; ++round) {
    ThreadPool unused(2);
    ThreadPool used(2);
    used.run(10, 3, [](std::int64_t) {});
  }
}

TEST_CASE("parallel_for_chunks_covers_every_element_once") {
  ThreadPool pool(3);
  const std::vector<std::int64_t> numels{0, 5, 0, 1, 100, 0, 37, 64, 1000, 0};
  for (std::int64_t chunk : {1, 7, 64, 100000}) {
    std::vector<std::vector<std::atomic<int>>> hits;
    for (std::int64_t n : numels) hits.emplace_back(static_cast<std::size_t>(n));
    std::atomic<bool> oversized{false};
    parallel_for_chunks(pool, 4, numels, chunk,
                        [&](std::size_t k, std::int64_t begin, std::int64_t end) {
                          if (begin >= end || end - begin > chunk || end > numels[k]) {
                            oversized.store(true);
                          }
                          for (std::int64_t i = begin; i < end; ++i) {
                            hits[k][static_cast<std::size_t>(i)].fetch_add(1);
                          }
                        });
    CHECK(!oversized.load());
    for (const auto& buffer : hits) {
      for (const auto& hit : buffer) CHECK_EQ(hit.load(), 1);
    }
  }
  parallel_for_chunks(
      pool, 4, std::vector<std::int64_t>{}, 16,
      [](std::size_t, std::int64_t, std::int64_t) { throw std::logic_error("no"); });
}
