// weightfs::Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with the lock
// annotations of core/thread_annotations.h, so that clang's -Wthread-safety checks which lock
// guards what (libstdc++'s std::mutex and std::lock_guard carry no such attributes).
//
//   mutable Mutex mu_;
//   CondVar cv_;
//   bool stop_ WFS_GUARDED_BY(mu_) = false;
//
//   void Stop() WFS_EXCLUDES(mu_) {
//     MutexLock lock(mu_);
//     stop_ = true;
//     cv_.NotifyAll();
//   }
//   void Wait() WFS_EXCLUDES(mu_) {
//     MutexLock lock(mu_);
//     while (!stop_) cv_.Wait(mu_);
//   }
//
// Predicates passed to CondVar's waits run with the lock held, but the analysis checks a lambda
// as a function of its own: declare it `[&]() WFS_REQUIRES(mu_) { return stop_; }`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "core/thread_annotations.h"

namespace weightfs {

class CondVar;

// An exclusive lock. Also has lock()/unlock()/try_lock() so that std::lock_guard and
// std::unique_lock accept it (but prefer MutexLock: the analysis follows only that one).
class WFS_CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() WFS_ACQUIRE() { mu_.lock(); }
  void Unlock() WFS_RELEASE() { mu_.unlock(); }
  bool TryLock() WFS_TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis the lock is held where it cannot see it (a no-op at run time: a
  // std::mutex does not know its owner).
  void AssertHeld() const WFS_ASSERT_CAPABILITY(this) {}

  void lock() WFS_ACQUIRE() { Lock(); }
  void unlock() WFS_RELEASE() { Unlock(); }
  bool try_lock() WFS_TRY_ACQUIRE(true) { return TryLock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex from construction to destruction; Unlock()/Lock() drop and retake it in between
// (the destructor releases it only if held).
class WFS_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) WFS_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  // Adopts a lock the caller holds already (`if (mu.TryLock()) { MutexLock l(mu, std::adopt_lock); ...`).
  MutexLock(Mutex& mu, std::adopt_lock_t) WFS_REQUIRES(mu) : mu_(mu) {}
  ~MutexLock() WFS_RELEASE() {
    if (held_) mu_.Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void Unlock() WFS_RELEASE() {
    mu_.Unlock();
    held_ = false;
  }
  void Lock() WFS_ACQUIRE() {
    mu_.Lock();
    held_ = true;
  }

 private:
  Mutex& mu_;
  bool held_ = true;
};

// A condition variable to wait on with a Mutex held (it is released while waiting and held
// again on return, as with std::condition_variable).
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex& mu) WFS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held: the caller's
  }
  // Waits until pred() (called with mu held) is true.
  template <class Pred>
  void Wait(Mutex& mu, Pred pred) WFS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    cv_.wait(lock, std::move(pred));
    lock.release();
  }
  // Waits until pred() is true or `deadline` passes; returns pred().
  template <class Clock, class Duration, class Pred>
  bool WaitUntil(Mutex& mu, const std::chrono::time_point<Clock, Duration>& deadline, Pred pred)
      WFS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool ok = cv_.wait_until(lock, deadline, std::move(pred));
    lock.release();
    return ok;
  }
  // Waits until pred() is true or `timeout` passes; returns pred().
  template <class Rep, class Period, class Pred>
  bool WaitFor(Mutex& mu, const std::chrono::duration<Rep, Period>& timeout, Pred pred) WFS_REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu.mu_, std::adopt_lock);
    const bool ok = cv_.wait_for(lock, timeout, std::move(pred));
    lock.release();
    return ok;
  }

  void NotifyOne() noexcept { cv_.notify_one(); }
  void NotifyAll() noexcept { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace weightfs
