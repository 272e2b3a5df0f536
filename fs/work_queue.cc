#include "fs/work_queue.h"

namespace weightfs {

WorkQueue::WorkQueue(size_t threads, size_t capacity) : capacity_(capacity) {
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { WorkerMain(); });
}

WorkQueue::~WorkQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    jobs_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

bool WorkQueue::TryPush(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ || threads_.empty() || jobs_.size() >= capacity_) return false;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
  return true;
}

size_t WorkQueue::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

void WorkQueue::WorkerMain() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

}  // namespace weightfs
