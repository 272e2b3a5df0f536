#include "fs/work_queue.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <new>
#include <stdexcept>

namespace weightfs {
namespace {

// Readahead jobs run on WorkQueue's threads: one that throws (an allocation failing while a chunk
// is materialized) must not end the process, and the thread must go on with the next job.
TEST(WorkQueueTest, AJobThatThrowsIsDroppedAndTheNextOneRuns) {
  WorkQueue queue(1, 8);
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  ASSERT_TRUE(queue.TryPush([] { throw std::bad_alloc(); }));
  ASSERT_TRUE(queue.TryPush([] { throw std::runtime_error("broken job"); }));
  ASSERT_TRUE(queue.TryPush([] { throw 7; }));
  ASSERT_TRUE(queue.TryPush([&] {
    std::lock_guard<std::mutex> lock(mu);
    ++done;
    cv.notify_all();
  }));
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(30), [&] { return done == 1; }));
}

}  // namespace
}  // namespace weightfs
