// RateLimitedLog: the log line of a condition that can repeat for every chunk (a full cache disk
// fails every insert, a damaged cache directory every read) — at most one line per interval,
// and a count of the lines left out.
//
//   RateLimitedLog failed_inserts("failed chunk cache inserts", spdlog::level::warn);
//   failed_inserts.Log("chunk cache: " + status.ToString());
//
// The first event is logged at once. Events within `interval` of the last logged line are only
// counted; the first one after it is logged with "(+N more <what> in the last T s)". A count
// still pending when the events stop is logged by Flush() ("N more <what> in the last T s")
// once the interval has passed — callers call it where the condition is seen to have ended (a
// later insert succeeds); it costs an atomic load when nothing is pending — and by the
// destructor, so no count is lost at shutdown. Either way at most one line per interval, however
// the events and the Flush calls interleave.
//
// Thread-safe. The lock is never held while logging.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <spdlog/common.h>

#include "core/mutex.h"

namespace weightfs {

class RateLimitedLog {
 public:
  using Clock = std::chrono::steady_clock;

  // `what`: a plural noun phrase for the counted events ("failed chunk cache inserts"). `now`
  // is the clock (tests pass a fake one).
  explicit RateLimitedLog(std::string what, spdlog::level::level_enum level = spdlog::level::warn,
                          Clock::duration interval = std::chrono::seconds(60),
                          std::function<Clock::time_point()> now = Clock::now);
  ~RateLimitedLog();
  RateLimitedLog(const RateLimitedLog&) = delete;
  RateLimitedLog& operator=(const RateLimitedLog&) = delete;

  // Logs `message`, or counts it when a line was logged less than `interval` ago.
  void Log(std::string_view message) WFS_EXCLUDES(mu_);
  // Logs the number of events counted since the last line, if any and if the last line is at
  // least `interval` old.
  void Flush() { Report(false); }

  // Events counted and not yet reported.
  uint64_t pending() const { return pending_.load(std::memory_order_relaxed); }
  // Events seen in all.
  uint64_t total() const { return total_.load(std::memory_order_relaxed); }

 private:
  void Report(bool force) WFS_EXCLUDES(mu_);

  const std::string what_;
  const spdlog::level::level_enum level_;
  const Clock::duration interval_;
  const std::function<Clock::time_point()> now_;
  Mutex mu_;
  bool logged_ WFS_GUARDED_BY(mu_) = false;  // a line was logged at last_line_
  Clock::time_point last_line_ WFS_GUARDED_BY(mu_);
  std::atomic<uint64_t> pending_{0};  // written under mu_; read without it by Flush's fast path
  std::atomic<uint64_t> total_{0};
};

}  // namespace weightfs
