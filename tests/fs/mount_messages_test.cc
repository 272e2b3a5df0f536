// What `weightfs mount` and the draft commands say about mistakes that used to pass silently or
// with a bare errno, through real mounts: mounting over a non-empty directory (its files are
// hidden), a second mount on a cache directory whose drafts another mount owns (drafts are off),
// and a draft's parent that cannot be set (the reason comes back, not EBUSY/EINVAL alone); the
// log as JSON lines.
#include <sys/stat.h>
#include <sys/xattr.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/fs/draft_mount.h"

namespace weightfs {
namespace {

using namespace weightfs::test;

class MountMessagesTest : public DraftMountTest {};

TEST_F(MountMessagesTest, MountingOverANonEmptyDirectoryWarnsNamingWhatItHides) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  std::ofstream(m.mnt() / "notes.txt") << "mine";
  const Result& r = m.Start();
  ASSERT_EQ(r.exit_code, 0) << m.Describe();
  EXPECT_NE(r.out.find("warning: mount point " + m.mnt().string() + " is not empty (1 entry: notes.txt)"),
            std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(m.mnt() / "notes.txt"));  // hidden, as the warning says
  ASSERT_EQ(m.Unmount().exit_code, 0);
  EXPECT_EQ(SlurpText(m.mnt() / "notes.txt"), "mine");
  // An empty mount point: no warning.
  fs::remove(m.mnt() / "notes.txt");
  const Result& again = m.Start();
  ASSERT_EQ(again.exit_code, 0) << m.Describe();
  EXPECT_EQ(again.out.find("warning"), std::string::npos) << again.out;
}

TEST_F(MountMessagesTest, ASecondMountOnTheSameCacheDirectorySaysDraftsAreOff) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& first = NewMount("a");
  ASSERT_EQ(first.Start().exit_code, 0) << first.Describe();
  Mount& second = NewMount("b", "", "", first.cache());
  const Result& r = second.Start();
  ASSERT_EQ(r.exit_code, 0) << second.Describe();
  EXPECT_NE(r.out.find("warning: drafts are off on " + second.mnt().string()), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("another mount of this bucket with the same cache directory owns its drafts"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("--cache-dir"), std::string::npos) << r.out;
  EXPECT_EQ(Errno(::mkdir(second.Dir("m/x@v1").c_str(), 0755)), EROFS);
  // The first mount said nothing of the kind and takes drafts.
  EXPECT_EQ(Errno(::mkdir(first.Dir("m/x@v1").c_str(), 0755)), 0) << std::strerror(errno);
}

TEST_F(MountMessagesTest, SetParentRefusalsSayWhy) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  ASSERT_EQ(Cli("push " + bucket_ + " m/x@v1 " + Source(1).string() + " --no-cache").exit_code, 0);
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path d = m.Dir("m/x@v2");
  ASSERT_EQ(Errno(::mkdir(d.c_str(), 0755)), 0);
  // A version that does not exist: EINVAL to setfattr, the reason in user.weightfs.error and
  // from `weightfs set-parent`.
  EXPECT_EQ(Errno(::setxattr(d.c_str(), "user.weightfs.parent", "v9", 2, 0)), EINVAL);
  EXPECT_NE(GetXattr(d, "user.weightfs.error").value_or("").find("m/x@v9 cannot be the parent"), std::string::npos);
  Result missing = Cli("set-parent " + d.string() + " v9");
  EXPECT_EQ(missing.exit_code, 1) << missing.out;
  EXPECT_NE(missing.out.find("cannot set the parent of m/x@v2 to v9: set-parent: m/x@v9 cannot be the parent"),
            std::string::npos)
      << missing.out;
  EXPECT_NE(missing.out.find("`weightfs log BUCKET m/x` lists its versions"), std::string::npos) << missing.out;
  // Success clears the error.
  Result ok = Cli("set-parent " + d.string() + " v0");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  EXPECT_EQ(GetXattr(d, "user.weightfs.parent").value_or(""), "v0");
  EXPECT_FALSE(GetXattr(d, "user.weightfs.error").has_value());
  // A draft with changes: EBUSY, and which change.
  std::ofstream(d / "config.json") << "{}";
  EXPECT_EQ(Errno(::setxattr(d.c_str(), "user.weightfs.parent", "v1", 2, 0)), EBUSY);
  Result busy = Cli("set-parent " + d.string() + " v1");
  EXPECT_EQ(busy.exit_code, 1) << busy.out;
  EXPECT_NE(busy.out.find("set-parent: config.json was written, renamed or removed already"), std::string::npos)
      << busy.out;
  EXPECT_EQ(GetXattr(d, "user.weightfs.parent").value_or(""), "v0");
}

// A chunk cache too small to follow a model (a version read whole, or two: N+1 is built from
// N's chunks in the cache) is said once per model, with the --cache-size that fits.
// --log-format json: every line of the log is one JSON object with time, level, pid and msg,
// also for messages holding quotes, backslashes and bytes that are not UTF-8.
TEST_F(MountMessagesTest, AJsonLogIsOneObjectALineWhateverTheMessagesHold) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a", "--log-format json");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  for (const std::string name : {"m/x@q\"uote", "m/x@back\\slash", "m/x@bad\xff\xfe"}) {
    EXPECT_EQ(Errno(::mkdir(m.Dir(name).c_str(), 0755)), EINVAL) << name;
  }
  ASSERT_EQ(m.Unmount().exit_code, 0);
  const std::string log = m.LogText();
  size_t lines = 0, refusals = 0;
  for (size_t at = 0; at < log.size();) {
    const size_t end = log.find('\n', at);
    const std::string line = log.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end == std::string::npos ? log.size() : end + 1;
    if (line.empty()) continue;
    ++lines;
    nlohmann::json j;
    ASSERT_NO_THROW(j = nlohmann::json::parse(line)) << line;
    ASSERT_TRUE(j.is_object()) << line;
    for (const char* key : {"time", "level", "msg"}) EXPECT_TRUE(j.contains(key) && j[key].is_string()) << key << ": " << line;
    EXPECT_EQ(j.value("pid", 0), m.pid()) << line;
    const std::string msg = j.value("msg", "");
    if (msg.find("not a valid version name") != std::string::npos) {
      refusals += j.value("level", "") == "warning";  // (the test mounts log at debug: a debug line too)
      EXPECT_TRUE(msg.find("q\"uote") != std::string::npos || msg.find("back\\slash") != std::string::npos ||
                  msg.find("bad\ufffd\ufffd") != std::string::npos) << msg;
    }
  }
  EXPECT_GE(lines, 3u) << log;
  EXPECT_EQ(refusals, 3u) << log;
}

TEST_F(MountMessagesTest, ACacheTooSmallToFollowAModelIsSaidOnceWithTheSizeThatFits) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  ASSERT_EQ(Cli("push " + bucket_ + " m/x@v1 " + Source(1).string() + " --no-cache").exit_code, 0);
  const uint64_t size = fs::file_size(Source(1) / "model.safetensors");
  auto warnings = [](const std::string& log) {
    size_t n = 0;
    for (size_t at = log.find("to follow this model"); at != std::string::npos;
         at = log.find("to follow this model", at + 1)) {
      ++n;
    }
    return n;
  };
  // Room for one version, not two.
  Mount& m = NewMount("a", "--cache-size " + std::to_string(size * 3 / 2));
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  EXPECT_EQ(Slurp(m.Dir("m/x@v1") / "model.safetensors"), Slurp(Source(1) / "model.safetensors"));
  EXPECT_EQ(Slurp(m.Dir("m/x@v0") / "model.safetensors"), Slurp(Source(0) / "model.safetensors"));
  std::string log = m.LogText();
  EXPECT_EQ(warnings(log), 1u) << log;
  EXPECT_NE(log.find("both do not fit; mount with --cache-size 1GiB"), std::string::npos) << log;
  // Room for less than one version: said again, worse.
  Mount& tiny = NewMount("b", "--cache-size " + std::to_string(size / 2));
  ASSERT_EQ(tiny.Start().exit_code, 0) << tiny.Describe();
  EXPECT_EQ(Slurp(tiny.Dir("m/x@v1") / "model.safetensors"), Slurp(Source(1) / "model.safetensors"));
  log = tiny.LogText();
  EXPECT_NE(log.find("a version read whole evicts its own chunks"), std::string::npos) << log;
  // The default cache: nothing said.
  Mount& roomy = NewMount("c");
  ASSERT_EQ(roomy.Start().exit_code, 0) << roomy.Describe();
  EXPECT_EQ(Slurp(roomy.Dir("m/x@v1") / "model.safetensors"), Slurp(Source(1) / "model.safetensors"));
  EXPECT_EQ(warnings(roomy.LogText()), 0u);
}

// Issue 29, item 8: a mount of one model (or organisation) of a bucket. It lists only
// models/PREFIX/, shows and probes only the models under it (paths stay the bucket's), and
// makes drafts only there; what is outside is absent, and a mkdir there is refused saying why.
TEST_F(MountMessagesTest, APrefixMountShowsAndWritesOnlyTheModelsUnderIt) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  for (const char* other : {"m/y@v0", "n/z@v0", "m/x2@v0"}) {
    Result p = Cli("push " + bucket_ + " " + other + " " + Source(0).string() + " --no-cache");
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  Mount& one = NewMount("one", "--prefix m/x");
  ASSERT_EQ(one.Start().exit_code, 0) << one.Describe();
  auto names = [](const fs::path& dir) {
    std::set<std::string> out;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) out.insert(e.path().filename().string());
    return out;
  };
  EXPECT_EQ(names(one.mnt()), std::set<std::string>{"m"});
  EXPECT_EQ(names(one.mnt() / "m"), (std::set<std::string>{"x@v0", "x@latest"}));
  struct stat st {};
  EXPECT_NE(::stat((one.mnt() / "m/y@v0").c_str(), &st), 0);  // not probed either
  EXPECT_EQ(errno, ENOENT);
  EXPECT_NE(::stat((one.mnt() / "m/x2@v0").c_str(), &st), 0);  // "m/x" is not a string prefix
  EXPECT_NE(::stat((one.mnt() / "n/z@v0").c_str(), &st), 0);
  for (const std::string& f : FilesUnder(Source(0))) {
    EXPECT_EQ(Sha256sum(one.mnt() / "m/x@v0" / f), Sha256Of(Source(0) / f)) << f;
  }
  EXPECT_EQ(::mkdir((one.mnt() / "m/x@v1").c_str(), 0755), 0) << std::strerror(errno);
  EXPECT_NE(::mkdir((one.mnt() / "m/y@v1").c_str(), 0755), 0);
  EXPECT_EQ(errno, EROFS);
  EXPECT_NE(::mkdir((one.mnt() / "q").c_str(), 0755), 0);
  EXPECT_EQ(errno, EROFS);
  EXPECT_NE(one.LogText().find("this mount shows only the models under m/x (--prefix)"), std::string::npos)
      << one.Describe();
  // An organisation: its models, not the others'.
  Mount& org = NewMount("org", "--prefix m --read-only");
  ASSERT_EQ(org.Start().exit_code, 0) << org.Describe();
  EXPECT_EQ(names(org.mnt()), std::set<std::string>{"m"});
  EXPECT_EQ(names(org.mnt() / "m"), (std::set<std::string>{"x@v0", "x@latest", "y@v0", "y@latest", "x2@v0", "x2@latest"}));
  Result bad = Cli("mount " + bucket_ + " " + (root_ / "bad").string() + " --prefix 'm/../x'");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("--prefix m/../x: give an organisation or a model"), std::string::npos) << bad.out;
}

}  // namespace
}  // namespace weightfs
