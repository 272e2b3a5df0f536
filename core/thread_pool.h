// ThreadPool: a fixed set of worker threads for data-parallel loops (encode/decode a file's
// chunks across cores). ParallelFor is safe to call from several threads at once; each call
// blocks until its own loop is done. Workers pick indices dynamically, so chunks of uneven cost
// balance out. An exception thrown by the loop body (an allocation failing) ends that loop and
// is rethrown to ParallelFor's caller; the workers live on.
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/mutex.h"

namespace weightfs {

class ThreadPool {
 public:
  // threads == 0 means std::thread::hardware_concurrency(). If the system refuses to start
  // some of them, the pool runs with those it got (the caller's thread at least).
  explicit ThreadPool(size_t threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  size_t size() const { return workers_.size() + 1; }  // the caller takes part too

  // Calls fn(index, slot) for every index in [0, n) with slot in [0, size()) identifying the
  // thread (for per-thread scratch state); returns when all calls have returned. If a call
  // throws, the indices not started yet are skipped and the first exception is rethrown here
  // once the calls in progress have returned.
  void ParallelFor(size_t n, const std::function<void(size_t index, size_t slot)>& fn);

 private:
  struct Loop;
  void WorkerMain(size_t slot) WFS_EXCLUDES(mu_);
  static void RunLoop(Loop& loop, size_t slot);

  Mutex mu_;
  CondVar cv_;
  std::deque<std::shared_ptr<Loop>> queue_ WFS_GUARDED_BY(mu_);
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace weightfs
