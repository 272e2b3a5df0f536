#include "core/thread_pool.h"

namespace weightfs {

struct ThreadPool::Loop {
  size_t n = 0;
  const std::function<void(size_t, size_t)>* fn = nullptr;
  std::atomic<size_t> next{0};
  std::atomic<size_t> done{0};
  std::atomic<bool> failed{false};
  Mutex mu;
  CondVar cv;
  std::exception_ptr error WFS_GUARDED_BY(mu);  // the first exception fn threw
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
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunLoop(Loop& loop, size_t slot) {
  size_t finished = 0;
  for (size_t i; (i = loop.next.fetch_add(1)) < loop.n;) {
    if (!loop.failed.load(std::memory_order_relaxed)) {
      try {
        (*loop.fn)(i, slot);
      } catch (...) {
        MutexLock lock(loop.mu);
        if (!loop.error) loop.error = std::current_exception();
        loop.failed = true;
      }
    }
    ++finished;
  }
  if (finished && loop.done.fetch_add(finished) + finished == loop.n) {
    MutexLock lock(loop.mu);
    loop.cv.NotifyAll();
  }
}

void ThreadPool::WorkerMain(size_t slot) {
  for (;;) {
    std::shared_ptr<Loop> loop;
    {
      MutexLock lock(mu_);
      cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (stop_) return;
      loop = queue_.front();
      // Leave the loop queued while indices remain so other idle workers join it too.
      if (loop->next.load() >= loop->n) {
        queue_.pop_front();
        continue;
      }
    }
    RunLoop(*loop, slot);
    MutexLock lock(mu_);
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
      MutexLock lock(mu_);
      queue_.push_back(loop);
    }
    cv_.NotifyAll();
  }
  RunLoop(*loop, 0);
  MutexLock lock(loop->mu);
  loop->cv.Wait(loop->mu, [&] { return loop->done.load() == n; });
  if (loop->error) std::rethrow_exception(loop->error);
}

}  // namespace weightfs
