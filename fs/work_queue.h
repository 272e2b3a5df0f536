// WorkQueue: a fixed set of background threads running jobs from a bounded FIFO — for work
// that is worth doing but never worth waiting for (readahead).
//
// TryPush never blocks: when `capacity` jobs are already waiting it refuses the job and returns
// false. The destructor drops the jobs that have not started and joins the threads (a running
// job finishes first, so jobs must themselves be bounded in time). A job that throws (an
// allocation failing) is logged and dropped; the thread goes on with the next. If the system
// refuses to start some threads, the queue runs with those it got (none: TryPush refuses).
// Thread-safe.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "core/thread_annotations.h"

namespace weightfs {

class WorkQueue {
 public:
  WorkQueue(size_t threads, size_t capacity);
  ~WorkQueue();
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;

  bool TryPush(std::function<void()> job) WFS_EXCLUDES(mu_);
  // Jobs waiting (not running).
  size_t pending() const WFS_EXCLUDES(mu_);

 private:
  void WorkerMain() WFS_EXCLUDES(mu_);

  const size_t capacity_;
  mutable Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> jobs_ WFS_GUARDED_BY(mu_);
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // set by the constructor only
};

}  // namespace weightfs
