#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <new>
#include <stdexcept>
#include <set>
#include <thread>
#include <vector>

namespace weightfs {
namespace {

// Runs a loop of n indices and checks each ran exactly once with a valid slot.
void ExpectEachIndexOnce(ThreadPool& pool, size_t n) {
  std::vector<std::atomic<int>> runs(n);
  std::atomic<bool> bad_slot{false};
  pool.ParallelFor(n, [&](size_t i, size_t slot) {
    if (slot >= pool.size()) bad_slot = true;
    runs[i].fetch_add(1);
  });
  EXPECT_FALSE(bad_slot);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(runs[i].load(), 1) << "index " << i;
}

TEST(ThreadPoolTest, SizeCountsTheCaller) {
  EXPECT_EQ(ThreadPool(1).size(), 1u);
  EXPECT_EQ(ThreadPool(4).size(), 4u);
  EXPECT_GE(ThreadPool(0).size(), 1u);
}

TEST(ThreadPoolTest, RunsEachIndexExactlyOnce) {
  for (size_t threads : {1, 2, 4, 8}) {
    ThreadPool pool(threads);
    for (size_t n : {0, 1, 2, 3, 7, 64, 1000, 10007}) {
      SCOPED_TRACE(std::to_string(threads) + " threads, n=" + std::to_string(n));
      ExpectEachIndexOnce(pool, n);
    }
  }
}

TEST(ThreadPoolTest, ZeroIndicesNeverCallsFn) {
  ThreadPool pool(4);
  bool called = false;
  pool.ParallelFor(0, [&](size_t, size_t) { called = true; });
  EXPECT_FALSE(called);
}

TEST(ThreadPoolTest, OneIndexRunsOnTheCaller) {
  ThreadPool pool(4);
  std::thread::id ran_on;
  size_t slot_seen = 99;
  pool.ParallelFor(1, [&](size_t i, size_t slot) {
    EXPECT_EQ(i, 0u);
    ran_on = std::this_thread::get_id();
    slot_seen = slot;
  });
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(slot_seen, 0u);
}

// A slot is for per-thread scratch: within one loop, no two calls may hold the same slot at once.
TEST(ThreadPoolTest, SlotsAreExclusiveWithinALoop) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> in_use(pool.size());
  std::atomic<bool> shared{false};
  pool.ParallelFor(2000, [&](size_t, size_t slot) {
    if (in_use[slot].fetch_add(1) != 0) shared = true;
    std::this_thread::yield();
    in_use[slot].fetch_sub(1);
  });
  EXPECT_FALSE(shared);
}

TEST(ThreadPoolTest, WorkersJoinTheLoop) {
  ThreadPool pool(4);
  std::mutex mu;
  std::set<std::thread::id> threads;
  auto seen = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return threads.size();
  };
  pool.ParallelFor(64, [&](size_t, size_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
    }
    // Hold each index until a second thread shows up (bounded: the test fails, never hangs).
    for (int spin = 0; spin < 100000 && seen() < 2; ++spin) std::this_thread::yield();
  });
  EXPECT_GT(threads.size(), 1u);
}

TEST(ThreadPoolTest, ConcurrentLoopsFromSeveralThreads) {
  ThreadPool pool(3);
  constexpr int kCallers = 6;
  constexpr int kLoopsPerCaller = 40;
  std::atomic<bool> failed{false};
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int loop = 0; loop < kLoopsPerCaller; ++loop) {
        const size_t n = static_cast<size_t>(1 + (c * 37 + loop * 11) % 300);
        std::vector<std::atomic<int>> runs(n);
        pool.ParallelFor(n, [&](size_t i, size_t slot) {
          if (slot >= pool.size()) failed = true;
          runs[i].fetch_add(1);
        });
        for (size_t i = 0; i < n; ++i) {
          if (runs[i].load() != 1) failed = true;
        }
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_FALSE(failed);
}

TEST(ThreadPoolTest, NestedLoopFromInsideALoop) {
  ThreadPool pool(2);
  std::vector<std::atomic<int>> runs(8 * 16);
  pool.ParallelFor(8, [&](size_t outer, size_t) {
    pool.ParallelFor(16, [&](size_t inner, size_t) { runs[outer * 16 + inner].fetch_add(1); });
  });
  for (size_t i = 0; i < runs.size(); ++i) EXPECT_EQ(runs[i].load(), 1) << i;
}

// A loop body that throws (an allocation failing while a chunk is encoded) must not end the
// process from a worker thread: the exception reaches ParallelFor's caller, the rest of that loop
// is skipped, and the pool serves the next loop.
TEST(ThreadPoolTest, ExceptionInALoopReachesTheCallerAndThePoolCarriesOn) {
  ThreadPool pool(4);
  for (size_t thrower : {size_t{0}, size_t{1}, size_t{500}, size_t{999}}) {
    SCOPED_TRACE(thrower);
    std::atomic<size_t> ran{0};
    try {
      pool.ParallelFor(1000, [&](size_t i, size_t) {
        if (i == thrower) throw std::bad_alloc();
        ran.fetch_add(1);
        std::this_thread::yield();
      });
      ADD_FAILURE() << "no exception";
    } catch (const std::bad_alloc&) {
    }
    EXPECT_LT(ran.load(), 1000u);
    ExpectEachIndexOnce(pool, 1000);
  }
  // Several throwing at once: one of them arrives.
  EXPECT_THROW(pool.ParallelFor(64, [](size_t, size_t) { throw std::runtime_error("each"); }),
               std::runtime_error);
  ExpectEachIndexOnce(pool, 64);
}

TEST(ThreadPoolTest, DestroysCleanlyWithoutWork) {
  for (int i = 0; i < 20; ++i) ThreadPool pool(4);
}

}  // namespace
}  // namespace weightfs
