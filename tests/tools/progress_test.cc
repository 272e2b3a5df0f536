// cli::Progress (tools/cli.h): bytes done of the total, rate and ETA; in place on a TTY, plain
// lines every `interval` seconds elsewhere. A fake clock drives it; its output goes to a
// temporary file. Then the real binary: push and pull into a pipe print plain progress lines.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/command_runner.h"
#include "tools/cli.h"

namespace weightfs::cli {
namespace {

namespace fs = std::filesystem;
constexpr uint64_t kMiB = 1 << 20;

// A Progress whose clock the test sets and whose output it reads.
class FakeTerminal {
 public:
  explicit FakeTerminal(bool tty, double interval = 5) : file_(std::tmpfile()) {
    output_.out = file_;
    output_.tty = tty;
    output_.now = [this] { return now_; };
    output_.interval = interval;
  }
  ~FakeTerminal() { std::fclose(file_); }
  const Progress::Output& output() const { return output_; }
  void At(double seconds) { now_ = seconds; }
  // Everything printed since the last call.
  std::string Take() {
    std::fflush(file_);
    std::string all;
    std::rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, file_)) > 0) all.append(buf, n);
    std::string fresh = all.substr(taken_);
    taken_ = all.size();
    return fresh;
  }

 private:
  FILE* file_;
  Progress::Output output_;
  double now_ = 0;
  size_t taken_ = 0;
};

TEST(Progress, WithoutATtyPrintsAPlainLineEveryIntervalWithRateAndEta) {
  FakeTerminal t(/*tty=*/false, /*interval=*/5);
  Progress p("push acme/m@v1", 100 * kMiB, t.output());
  for (int s = 1; s < 5; ++s) {
    t.At(s);
    p.Update(static_cast<uint64_t>(s) * 10 * kMiB);
  }
  EXPECT_EQ(t.Take(), "");  // nothing before the first interval
  t.At(5);
  p.Update(50 * kMiB);
  EXPECT_EQ(t.Take(), "push acme/m@v1: 50.0 MiB of 100.0 MiB (50%), 10.0 MiB/s, ETA 5 s\n");
  t.At(9);
  p.Update(90 * kMiB);
  EXPECT_EQ(t.Take(), "");
  t.At(10);
  p.Update(95 * kMiB);
  EXPECT_EQ(t.Take(), "push acme/m@v1: 95.0 MiB of 100.0 MiB (95%), 9.5 MiB/s, ETA 1 s\n");
  t.At(16);
  p.Update(100 * kMiB);
  EXPECT_EQ(t.Take(), "push acme/m@v1: 100.0 MiB of 100.0 MiB (100%), 6.2 MiB/s\n");
  p.Finish();
  EXPECT_EQ(t.Take(), "push acme/m@v1: 100.0 MiB in 16 s (6.2 MiB/s)\n");
  p.Finish();
  EXPECT_EQ(t.Take(), "");
}

TEST(Progress, WithoutATtyAShortOperationPrintsNothing) {
  FakeTerminal t(/*tty=*/false);
  Progress p("pull acme/m@v1", 10 * kMiB, t.output());
  t.At(1);
  p.Update(10 * kMiB);
  p.Finish();
  EXPECT_EQ(t.Take(), "");
}

TEST(Progress, OnATtyOneLineIsRewrittenInPlaceAndEnded) {
  FakeTerminal t(/*tty=*/true);
  Progress p("pull acme/m@v1", 4096ull * kMiB, t.output());
  t.At(0.3);
  p.Update(1 * kMiB);  // a rate over the first moments would say "ETA 20 min": none yet
  EXPECT_EQ(t.Take(), "\rpull acme/m@v1: 1.0 MiB of 4.0 GiB (0%)\033[K");
  t.At(2);
  p.Update(1024 * kMiB);
  EXPECT_EQ(t.Take(), "\rpull acme/m@v1: 1.0 GiB of 4.0 GiB (25%), 512.0 MiB/s, ETA 6 s\033[K");
  t.At(2.05);
  p.Update(1100 * kMiB);
  EXPECT_EQ(t.Take(), "");  // at most ten times a second
  t.At(300);
  p.Update(2048 * kMiB);
  EXPECT_EQ(t.Take(), "\rpull acme/m@v1: 2.0 GiB of 4.0 GiB (50%), 6.8 MiB/s, ETA 5 min 0 s\033[K");
  p.Finish();
  EXPECT_EQ(t.Take(), "\rpull acme/m@v1: 2.0 GiB in 5 min 0 s (6.8 MiB/s)\033[K\n");
}

TEST(Progress, CountsItemsWhenGivenANounAndFormatsLongDurations) {
  EXPECT_EQ(FormatDuration(3725), "1 h 02 min");
  EXPECT_EQ(FormatDuration(61), "1 min 1 s");
  FakeTerminal t(/*tty=*/false, /*interval=*/0);
  Progress p("upgrade", 1000, t.output(), "versions");
  t.At(10);
  p.Update(100);
  EXPECT_EQ(t.Take(), "upgrade: 100 versions of 1000 versions (10%), 10 versions/s, ETA 1 min 30 s\n");
}

// The binary: push and pull whose stderr is a pipe print plain progress lines (here every
// update: WEIGHTFS_PROGRESS_INTERVAL=0), never a carriage return.
TEST(ProgressCli, PushAndPullIntoAPipePrintPlainProgressLines) {
  const fs::path root = fs::temp_directory_path() / ("wfs-progress-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const std::string bin = std::string("WEIGHTFS_PROGRESS_INTERVAL=0 ") + WEIGHTFS_BINARY;
  auto run = [&](const std::string& args) { return weightfs::test::RunShell(bin + " " + args + " 2>&1 >/dev/null"); };
  ASSERT_EQ(run("gen " + (root / "gen").string() + " --params 2M --versions 1 --shard-size 2M").exit_code, 0);
  ASSERT_EQ(run("init " + (root / "b").string()).exit_code, 0);
  auto push = run("push " + (root / "b").string() + " acme/m@v0 " + (root / "gen/v000").string() + " --no-cache");
  ASSERT_EQ(push.exit_code, 0) << push.out;
  EXPECT_NE(push.out.find("push acme/m@v0: "), std::string::npos) << push.out;
  EXPECT_NE(push.out.find(" of "), std::string::npos) << push.out;
  EXPECT_NE(push.out.find("/s"), std::string::npos) << push.out;
  EXPECT_NE(push.out.find(" in "), std::string::npos) << push.out;  // the summary line
  EXPECT_EQ(push.out.find('\r'), std::string::npos) << push.out;
  auto pull = run("pull " + (root / "b").string() + " acme/m@v0 " + (root / "out").string() + " --no-cache");
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  EXPECT_NE(pull.out.find("pull acme/m@v0: "), std::string::npos) << pull.out;
  EXPECT_EQ(pull.out.find('\r'), std::string::npos) << pull.out;
  fs::remove_all(root);
}

}  // namespace
}  // namespace weightfs::cli
