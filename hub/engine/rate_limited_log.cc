#include "hub/engine/rate_limited_log.h"

#include <cstdio>

#include <spdlog/spdlog.h>

namespace weightfs {
namespace {

std::string Seconds(RateLimitedLog::Clock::duration d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f", std::chrono::duration<double>(d).count());
  return buf;
}

}  // namespace

RateLimitedLog::RateLimitedLog(std::string what, spdlog::level::level_enum level,
                               Clock::duration interval, std::function<Clock::time_point()> now)
    : what_(std::move(what)), level_(level), interval_(interval), now_(std::move(now)) {}

RateLimitedLog::~RateLimitedLog() { Report(true); }

void RateLimitedLog::Log(std::string_view message) {
  total_.fetch_add(1, std::memory_order_relaxed);
  uint64_t suppressed = 0;
  Clock::duration since{};
  {
    MutexLock lock(mu_);
    const Clock::time_point now = now_();
    if (logged_ && now - last_line_ < interval_) {
      pending_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    suppressed = pending_.exchange(0, std::memory_order_relaxed);
    since = now - last_line_;
    logged_ = true;
    last_line_ = now;
  }
  if (suppressed == 0) {
    spdlog::log(level_, "{}", message);
  } else {
    spdlog::log(level_, "{} (+{} more {} in the last {} s)", message, suppressed, what_, Seconds(since));
  }
}

void RateLimitedLog::Report(bool force) {
  if (pending_.load(std::memory_order_relaxed) == 0) return;
  uint64_t suppressed = 0;
  Clock::duration since{};
  {
    MutexLock lock(mu_);
    const Clock::time_point now = now_();
    if (!force && now - last_line_ < interval_) return;
    suppressed = pending_.exchange(0, std::memory_order_relaxed);
    if (suppressed == 0) return;
    since = now - last_line_;
    last_line_ = now;  // this line opens a new interval
  }
  spdlog::log(level_, "{} more {} in the last {} s", suppressed, what_, Seconds(since));
}

}  // namespace weightfs
