// Where the mount daemon logs (tools/logging.h), as a user finds it: a file under the cache
// directory by default, the journal when systemd's stream is stderr, syslog only where it runs;
// and what a failed request leaves there: a line naming the request and the bucket key, and no
// credentials (nor in the mount table or the command's output).
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using test::Cli;
using test::CommandResult;
using test::SlurpText;
using test::TempDir;

// A generated model (data/v000, v001) pushed as acme/m@v0 and @v1 into `bucket` (a URL).
::testing::AssertionResult MakeBucket(const TempDir& work, const std::string& bucket) {
  for (const std::string& cmd : {"gen " + work.Join("data") + " --params 1M --versions 1 --seed 4", "init " + bucket,
                                 "push " + bucket + " acme/m@v0 " + work.Join("data/v000") + " --no-cache",
                                 "push " + bucket + " acme/m@v1 " + work.Join("data/v001") + " --no-cache"}) {
    CommandResult r = Cli(cmd);
    if (r.exit_code != 0) return ::testing::AssertionFailure() << "weightfs " << cmd << ":\n" << r.out;
  }
  return ::testing::AssertionSuccess();
}

// Unmounts `mnt` at the end of a test, if it is mounted.
struct UnmountAtExit {
  std::string mnt;
  ~UnmountAtExit() {
    test::UnmountIfMounted(mnt);
  }
};

TEST(MountLogTest, DaemonLogsToAFileUnderTheCacheDirectoryByDefault) {
  TempDir work("log");
  ASSERT_TRUE(MakeBucket(work, work.Join("bucket")));
  const std::string mnt = work.Join("mnt"), cache = work.Join("cache");
  fs::create_directories(mnt);
  UnmountAtExit unmount{mnt};
  CommandResult m = Cli("mount " + work.Join("bucket") + " " + mnt + " --cache-dir " + cache);
  ASSERT_EQ(m.exit_code, 0) << m.out;
  // The mount point's path, '/' as '-': /tmp/wfs-log-XXXXXX/mnt -> tmp-wfs-log-XXXXXX-mnt.log
  std::string name = mnt.substr(1);
  for (char& c : name) c = c == '/' ? '-' : c;
  const std::string log = cache + "/logs/" + name + ".log";
  EXPECT_NE(m.out.find("log: " + log), std::string::npos) << m.out;
  EXPECT_NE(SlurpText(log).find("[info] mounted file://" + work.Join("bucket") + " at " + mnt), std::string::npos)
      << SlurpText(log);
  ASSERT_EQ(Cli("unmount " + mnt).exit_code, 0);
  EXPECT_NE(SlurpText(log).find("[info] unmounted " + mnt), std::string::npos) << SlurpText(log);
}

TEST(MountLogTest, SyslogOnlyWhereASyslogDaemonListens) {
  TempDir work("log");
  ASSERT_TRUE(MakeBucket(work, work.Join("bucket")));
  const std::string mnt = work.Join("mnt");
  fs::create_directories(mnt);
  UnmountAtExit unmount{mnt};
  CommandResult m = Cli("mount " + work.Join("bucket") + " " + mnt + " --cache-dir " + work.Join("cache") +
                        " --log-file syslog");
  struct stat st;
  if (::stat("/dev/log", &st) == 0 && S_ISSOCK(st.st_mode)) {
    EXPECT_EQ(m.exit_code, 0) << m.out;
  } else {
    EXPECT_EQ(m.exit_code, 1) << m.out;
    EXPECT_NE(m.out.find("no syslog daemon listens here (/dev/log does not exist)"), std::string::npos) << m.out;
    EXPECT_FALSE(test::MountedAt(mnt));
  }
}

TEST(MountLogTest, DaemonLogsToTheJournalWhenStderrIsSystemdsStream) {
  TempDir work("log");
  ASSERT_TRUE(MakeBucket(work, work.Join("bucket")));
  const std::string mnt = work.Join("mnt"), journal = work.Join("journal");
  fs::create_directories(mnt);
  std::ofstream(journal).flush();
  UnmountAtExit unmount{mnt};
  // What systemd does for a unit's processes: stderr is a stream JOURNAL_STREAM names.
  CommandResult m = test::RunShell("JOURNAL_STREAM=$(stat -c %d:%i " + journal + ") " + WEIGHTFS_BINARY + " mount " +
                                   work.Join("bucket") + " " + mnt + " --cache-dir " + work.Join("cache") + " 2>>" +
                                   journal);
  ASSERT_EQ(m.exit_code, 0) << m.out << SlurpText(journal);
  EXPECT_NE(m.out.find("log: the journal"), std::string::npos) << m.out;
  // The daemon kept the journal as its stderr, with priority prefixes for journald.
  EXPECT_NE(SlurpText(journal).find("<6>mounted file://" + work.Join("bucket") + " at " + mnt), std::string::npos)
      << SlurpText(journal);
  EXPECT_FALSE(fs::exists(work.Join("cache/logs")));
}

TEST(MountLogTest, EachFailedReadLogsALineWithTheBucketKeyAndNeverTheCredentials) {
  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  TempDir work("log");
  const std::string secret = "s3cr3t-Pa55word";
  const std::string bucket = "http://weights:" + secret + "@127.0.0.1:" + std::to_string(nginx.port()) + "/b";
  ASSERT_TRUE(MakeBucket(work, bucket));
  const std::string mnt = work.Join("mnt"), log = work.Join("mount.log");
  fs::create_directories(mnt);
  UnmountAtExit unmount{mnt};
  CommandResult m = Cli("mount " + bucket + " " + mnt + " --cache-dir " + work.Join("cache") + " --log-file " + log +
                        " --log-level debug");
  ASSERT_EQ(m.exit_code, 0) << m.out;

  // The packs are gone from the server: reading a file fails (EIO) and says why in the log.
  std::error_code ec;
  fs::remove_all(nginx.root() + "/b/packs", ec);
  ASSERT_FALSE(ec) << ec.message();
  CommandResult cat = test::RunShell("cat " + mnt + "/acme/m@v1/model.safetensors 2>&1 >/dev/null");
  EXPECT_NE(cat.exit_code, 0);
  EXPECT_NE(cat.out.find("Input/output error"), std::string::npos) << cat.out;

  const std::string text = SlurpText(log);
  std::istringstream lines(text);
  int errors = 0;
  for (std::string line; std::getline(lines, line);) {
    if (line.find("[error]") == std::string::npos) continue;
    ++errors;
    EXPECT_NE(line.find("read acme/m@v1/model.safetensors at "), std::string::npos) << line;
    EXPECT_NE(line.find("/b/packs/"), std::string::npos) << "the line names the bucket key: " << line;
  }
  EXPECT_GE(errors, 1) << text;
  CommandResult status = Cli("status " + mnt);
  for (const auto& [what, where] : {std::pair{"the log", text}, {"the mount table", SlurpText("/proc/self/mounts")},
                                    {"mount's output", m.out}, {"status", status.out}}) {
    EXPECT_EQ(where.find(secret), std::string::npos) << "the password is in " << what << ":\n" << where;
  }
  EXPECT_NE(SlurpText("/proc/self/mounts").find("weightfs:http://127.0.0.1:" + std::to_string(nginx.port()) + "/b " +
                                                mnt),
            std::string::npos);
}

}  // namespace
}  // namespace weightfs
