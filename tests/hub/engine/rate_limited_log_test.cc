// RateLimitedLog: one line per interval for a condition that repeats, each with the count of
// the lines left out, and nothing lost at the end.
#include "hub/engine/rate_limited_log.h"

#include <chrono>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/log_capture.h"

namespace weightfs {
namespace {

using std::chrono::seconds;
using Clock = RateLimitedLog::Clock;

// A clock the test moves.
struct FakeClock {
  Clock::time_point now = Clock::time_point() + std::chrono::hours(1);
  std::function<Clock::time_point()> fn() {
    return [this] { return now; };
  }
};

TEST(RateLimitedLogTest, FirstLineAtOnceThenOnePerIntervalWithTheCountLeftOut) {
  test::LogCapture capture;
  FakeClock clock;
  {
    RateLimitedLog log("failed things", spdlog::level::warn, seconds(60), clock.fn());
    log.Log("thing 1 failed");
    for (int i = 2; i <= 6; ++i) {
      clock.now += seconds(1);
      log.Log("thing " + std::to_string(i) + " failed");
    }
    EXPECT_EQ(capture.Lines(), std::vector<std::string>{"warning thing 1 failed"});
    EXPECT_EQ(log.pending(), 5u);
    clock.now += seconds(56);  // 61 s after the first line
    log.Log("thing 7 failed");
    clock.now += seconds(1);
    log.Log("thing 8 failed");
    EXPECT_EQ(capture.Lines(), (std::vector<std::string>{"warning thing 1 failed",
                                                         "warning thing 7 failed (+5 more failed things in the last 61 s)"}));
    // The condition ends: Flush reports the count, but not before the interval is over.
    log.Flush();
    EXPECT_EQ(capture.Lines().size(), 2u);
    clock.now += seconds(59);
    log.Flush();
    EXPECT_EQ(capture.Lines().back(), "warning 1 more failed things in the last 60 s");
    EXPECT_EQ(log.pending(), 0u);
    EXPECT_EQ(log.total(), 8u);
  }
  EXPECT_EQ(capture.Lines().size(), 3u);  // nothing pending at destruction
}

// Failures interleaved with successes that call Flush (a nearly full disk): still one line per
// interval, however they alternate.
TEST(RateLimitedLogTest, EventsAlternatingWithFlushesStayAtOneLinePerInterval) {
  test::LogCapture capture;
  FakeClock clock;
  RateLimitedLog log("failed inserts", spdlog::level::warn, seconds(60), clock.fn());
  for (int i = 0; i < 1000; ++i) {  // 1000 events over 100 s
    log.Log("insert failed");
    log.Flush();
    clock.now += std::chrono::milliseconds(100);
  }
  const std::vector<std::string> lines = capture.Lines();
  ASSERT_EQ(lines.size(), 2u) << lines.back();
  EXPECT_EQ(lines[0], "warning insert failed");
  EXPECT_EQ(lines[1], "warning insert failed (+599 more failed inserts in the last 60 s)");
}

TEST(RateLimitedLogTest, TheDestructorReportsWhatIsPending) {
  test::LogCapture capture;
  FakeClock clock;
  {
    RateLimitedLog log("corrupt entries", spdlog::level::warn, seconds(60), clock.fn());
    for (int i = 0; i < 10; ++i) log.Log("entry is corrupt");
    clock.now += seconds(3);
  }
  EXPECT_EQ(capture.Lines(), (std::vector<std::string>{"warning entry is corrupt",
                                                       "warning 9 more corrupt entries in the last 3 s"}));
}

}  // namespace
}  // namespace weightfs
