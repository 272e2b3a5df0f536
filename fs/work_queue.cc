#include "fs/work_queue.h"

#include <spdlog/spdlog.h>

#include "core/status.h"

namespace weightfs {

WorkQueue::WorkQueue(size_t threads, size_t capacity) : capacity_(capacity) {
  for (size_t i = 0; i < threads; ++i) {
    try {
      threads_.emplace_back([this] { WorkerMain(); });
    } catch (const std::exception& e) {
      spdlog::warn("background work: {} of {} threads started ({})", i, threads, e.what());
      break;
    }
  }
}

WorkQueue::~WorkQueue() {
  {
    MutexLock lock(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_.NotifyAll();
  for (std::thread& t : threads_) t.join();
}

bool WorkQueue::TryPush(std::function<void()> job) {
  {
    MutexLock lock(mu_);
    if (stop_ || threads_.empty() || jobs_.size() >= capacity_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.NotifyOne();
  return true;
}

size_t WorkQueue::pending() const {
  MutexLock lock(mu_);
  return jobs_.size();
}

void WorkQueue::WorkerMain() {
  while (true) {
    std::function<void()> job;
    {
      MutexLock lock(mu_);
      cv_.Wait(mu_, [this]() WFS_REQUIRES(mu_) { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    try {
      job();
    } catch (...) {
      spdlog::error("{}", StatusOfCurrentException("background job").ToString());
    }
  }
}

}  // namespace weightfs
