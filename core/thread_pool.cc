#include "core/thread_pool.h"

namespace weightfs {

struct ThreadPool::Loop {
  size_t n = 0;
  const std::function<void(size_t, size_t)>* fn = nullptr;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
  std::exception_ptr error;  // GUARDED_BY(mu): the first exception fn threw
};

ThreadPool::ThreadPool(size_t threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  for (size_t i = 1; i < threads; ++i) {
    try {
      workers_.emplace_back([this, i] { WorkerMain(i); });
    } catch (const std::exception&) {
      break;  // fewer workers: ParallelFor's caller always takes part
    }
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunLoop(Loop& loop, size_t slot) {
  size_t finished = 0;
  for (size_t i; (i = loop.next.fetch_add(1)) < loop.n;) {
    if (!loop.failed.load(std::memory_order_relaxed)) {
      try {
        (*loop.fn)(i, slot);
      } catch (...) {
        std::lock_guard<std::mutex> lock(loop.mu);
        if (!loop.error) loop.error = std::current_exception();
        loop.failed = true;
      }
    }
    ++finished;
  }
  if (finished && loop.done.fetch_add(finished) + finished == loop.n) {
    std::lock_guard<std::mutex> lock(loop.mu);
    loop.cv.notify_all();
  }
}

void ThreadPool::WorkerMain(size_t slot) {
  for (;;) {
    std::shared_ptr<Loop> loop;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      loop = queue_.front();
      // Leave the loop queued while indices remain so other idle workers join it too.
      if (loop->next.load() >= loop->n) {
        queue_.pop_front();
        continue;
      }
    }
    RunLoop(*loop, slot);
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty() && queue_.front() == loop) queue_.pop_front();
  }
}

void ThreadPool::ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  auto loop = std::make_shared<Loop>();
  loop->n = n;
  loop->fn = &fn;
  if (!workers_.empty() && n > 1) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(loop);
    }
    cv_.notify_all();
  }
  RunLoop(*loop, 0);
  std::unique_lock<std::mutex> lock(loop->mu);
  loop->cv.wait(lock, [&] { return loop->done.load() == n; });
  if (loop->error) std::rethrow_exception(loop->error);
}

}  // namespace weightfs
