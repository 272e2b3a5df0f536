// The bucket commands as users run them: the real binary, real processes, a local bucket.
// Killing pushes at random moments, racing processes, corrupted packs, gc afterwards.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/command_runner.h"

namespace {

namespace fs = std::filesystem;

using Result = weightfs::test::CommandResult;

using weightfs::test::RunCli;

// Starts the binary with `args` (split on spaces), output to `log`; returns its pid.
// The .safetensors files of `dir`, sorted: the shards a test pushes as parts.
std::vector<std::string> SafetensorsIn(const std::string& dir) {
  std::vector<std::string> shards;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") shards.push_back(e.path().string());
  }
  std::sort(shards.begin(), shards.end());
  return shards;
}

pid_t Spawn(const std::vector<std::string>& args, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "w");
    if (f) {
      dup2(fileno(f), 1);
      dup2(fileno(f), 2);
    }
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(WEIGHTFS_BINARY));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(WEIGHTFS_BINARY, argv.data());
    _exit(127);
  }
  return pid;
}

int Wait(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

size_t CountFiles(const fs::path& dir) {
  size_t n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) n += e.is_regular_file();
  return n;
}

class BucketCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    data_ = fs::temp_directory_path() / ("wfs-cli-data-" + std::to_string(getpid()));
    fs::remove_all(data_);
    // ~25 MB per version in 3 shards: big enough that a push takes a few hundred ms.
    Result g = RunCli("gen " + data_.string() + " --params 12M --versions 2 --lr 1e-6 --shard-size 10M --seed 3");
    ASSERT_EQ(g.exit_code, 0) << g.out;
  }
  static void TearDownTestSuite() { fs::remove_all(data_); }

  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-cli-" + std::to_string(getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    bucket_ = (root_ / "bucket").string();
    ASSERT_EQ(RunCli("init " + bucket_).exit_code, 0);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string Version(int k) const {
    char buf[16];
    std::snprintf(buf, sizeof buf, "v%03d", k);
    return (data_ / buf).string();
  }
  std::string Cache(const std::string& name) const { return " --cache-dir " + (root_ / name).string(); }

  static fs::path data_;
  fs::path root_;
  std::string bucket_;
};
fs::path BucketCli::data_;

// A URL with a slash missing is refused with the URL it meant, not made into a local directory
// named "s3:" ("initialized weightfs bucket file:///.../s3:/bucket").
TEST_F(BucketCli, AUrlWithASlashMissingIsRefusedNotMadeADirectory) {
  const fs::path cwd = fs::current_path();
  fs::current_path(root_);
  Result r = RunCli("init s3:/bucket");
  Result h = RunCli("init https:example.com/b");
  Result ok = RunCli("init ./s3:/bucket");
  fs::current_path(cwd);
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("did you mean s3://bucket?"), std::string::npos) << r.out;
  EXPECT_NE(h.exit_code, 0) << h.out;
  EXPECT_NE(h.out.find("https://example.com/b"), std::string::npos) << h.out;
  EXPECT_EQ(ok.exit_code, 0) << ok.out;  // said explicitly: a directory of that name
  EXPECT_TRUE(fs::exists(root_ / "s3:" / "bucket"));
}

TEST_F(BucketCli, PushPullVerifyLogCatRoundTrip) {
  Result p0 = RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + Cache("c"));
  ASSERT_EQ(p0.exit_code, 0) << p0.out;
  EXPECT_NE(p0.out.find("(base)"), std::string::npos) << p0.out;
  Result p1 = RunCli("push " + bucket_ + " acme/m@v1 " + Version(1) + Cache("c") + " --stats");
  ASSERT_EQ(p1.exit_code, 0) << p1.out;
  EXPECT_NE(p1.out.find("parent v0"), std::string::npos) << p1.out;
  EXPECT_NE(p1.out.find("stats:"), std::string::npos) << p1.out;
  Result pull = RunCli("pull " + bucket_ + " acme/m@v1 " + (root_ / "out").string() + Cache("c2"));
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  for (const auto& e : fs::directory_iterator(Version(1))) {
    EXPECT_EQ(Slurp(e.path().string()), Slurp((root_ / "out" / e.path().filename()).string()))
        << e.path();
  }
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
  Result log = RunCli("log " + bucket_ + " --json");
  ASSERT_EQ(log.exit_code, 0) << log.out;
  EXPECT_NE(log.out.find("\"version\":\"v1\""), std::string::npos) << log.out;
  Result cat = RunCli("cat " + bucket_ + " acme/m@v1/config.json" + Cache("c3"));
  EXPECT_EQ(cat.exit_code, 0);
  EXPECT_EQ(cat.out, Slurp(Version(1) + "/config.json"));
  // Errors: one clear line, non-zero exit.
  Result missing = RunCli("pull " + bucket_ + " acme/m@nope " + (root_ / "x").string());
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.out.find("does not exist"), std::string::npos) << missing.out;
  Result not_bucket = RunCli("log " + (root_ / "out").string());
  EXPECT_EQ(not_bucket.exit_code, 1);
  EXPECT_NE(not_bucket.out.find("weightfs init"), std::string::npos) << not_bucket.out;
  EXPECT_EQ(RunCli("push --help").exit_code, 0);
}

TEST_F(BucketCli, TwoProcessesPushingOneVersionHaveExactlyOneWinner) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  std::vector<pid_t> pids;
  for (int i = 0; i < 2; ++i) {
    pids.push_back(Spawn({"push", bucket_, "acme/m@v1", Version(1), "--no-cache"},
                         (root_ / ("log" + std::to_string(i))).string()));
  }
  int winners = 0;
  for (int i = 0; i < 2; ++i) {
    int rc = Wait(pids[i]);
    std::string log = Slurp((root_ / ("log" + std::to_string(i))).string());
    if (rc == 0) {
      ++winners;
    } else {
      EXPECT_EQ(rc, 1) << log;
      EXPECT_TRUE(log.find("already") != std::string::npos) << log;
    }
  }
  EXPECT_EQ(winners, 1);
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
}

TEST_F(BucketCli, KilledPushesNeverPublishHalfAVersionAndGcCleansUp) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  std::mt19937 rng(42);
  const fs::path manifest = root_ / "bucket/models/acme/m/versions/v1.json";
  int published_early = 0;
  for (int i = 0; i < 8; ++i) {
    pid_t pid = Spawn({"push", bucket_, "acme/m@v1", Version(1), "--no-cache", "--pack-size", "1M"},
                      (root_ / "log").string());
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 400)(rng)));
    kill(pid, SIGKILL);
    Wait(pid);
    if (fs::exists(manifest)) {
      // The push got all the way: the version must be complete.
      ++published_early;
      ASSERT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
      break;
    }
    // Never a partial version: the name is free and the log does not list it.
    EXPECT_EQ(RunCli("log " + bucket_ + " acme/m --json").out.find("\"v1\""), std::string::npos);
  }
  if (!published_early) {
    Result again = RunCli("push " + bucket_ + " acme/m@v1 " + Version(1) + " --no-cache");
    ASSERT_EQ(again.exit_code, 0) << again.out;
  }
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
  Result gc = RunCli("gc " + bucket_);
  ASSERT_EQ(gc.exit_code, 0) << gc.out;
  // After gc every pack is referenced: a second gc removes nothing.
  Result gc2 = RunCli("gc " + bucket_ + " --dry-run");
  EXPECT_NE(gc2.out.find("would remove 0 unreferenced packs"), std::string::npos) << gc2.out;
  EXPECT_EQ(CountFiles(root_ / "bucket/leases"), 0u);
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v0").exit_code, 0);
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
}

// Issue 29, item 4: Ctrl-C during a push, then the same command. The interrupted push says
// what it kept and how to resume; the second says it resumed and sends only what the first had
// not: bytes sent + bytes resumed = bytes stored (plus the manifest), counted by --stats at
// the store. At most the packs in flight at the interrupt are left unreferenced; the version
// reads back bit-exact. (A delta's resume, which also checks the parent chunk, is
// BucketEngineTest.AnInterruptedPushResumesFromItsRecord: a delta pushes too fast to Ctrl-C.)
TEST_F(BucketCli, AnInterruptedPushResumesWithoutSendingAgainWhatItKept) {
  auto sent_bytes = [](const std::string& out) -> uint64_t {
    const size_t at = out.find("sent ");
    return at == std::string::npos ? 0 : std::stoull(out.substr(at + 5));
  };
  auto number_after = [](const std::string& out, const std::string& what) -> uint64_t {
    const size_t at = out.find(what);
    return at == std::string::npos ? 0 : std::stoull(out.substr(at + what.size()));
  };
  const fs::path packs = root_ / "bucket/packs";
  for (int k = 0; k < 1; ++k) {
    SCOPED_TRACE("v" + std::to_string(k));
    const std::string v = "acme/m@v" + std::to_string(k);
    const std::string pack_size = "1M";
    const size_t before = CountFiles(packs);
    pid_t pid = Spawn({"push", bucket_, v, Version(k), "--cache-dir", (root_ / "cache").string(), "--pack-size", pack_size,
                       "--threads", "1"},
                      (root_ / "log").string());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (CountFiles(packs) < before + 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    kill(pid, SIGINT);
    const int rc = Wait(pid);
    const std::string said = Slurp((root_ / "log").string());
    if (rc == 0) {
      ADD_FAILURE() << "the push finished before it could be interrupted: " << said;
      continue;
    }
    EXPECT_EQ(rc, 130) << said;
    EXPECT_NE(said.find("push interrupted; nothing was published"), std::string::npos) << said;
    EXPECT_NE(said.find("run the same command again to resume"), std::string::npos) << said;
    EXPECT_EQ(RunCli("log " + bucket_ + " acme/m --json").out.find("\"v" + std::to_string(k) + "\""), std::string::npos);

    Result again = RunCli("push " + bucket_ + " " + v + " " + Version(k) + Cache("cache") + " --pack-size " + pack_size +
                          " --threads 1 --stats");
    ASSERT_EQ(again.exit_code, 0) << again.out;
    EXPECT_NE(again.out.find("resuming an interrupted push of " + v), std::string::npos) << again.out;
    const uint64_t resumed_chunks = number_after(again.out, "resumed: ");
    EXPECT_GT(resumed_chunks, 0u) << again.out;
    // What the version stores, from its manifest, against what this run sent and reused.
    Result log = RunCli("log " + bucket_ + " acme/m --json");
    const nlohmann::json j = nlohmann::json::parse(log.out, nullptr, false);
    ASSERT_TRUE(j.is_object() || j.is_array()) << log.out;
    uint64_t stored = 0;
    for (const auto& e : (j.is_object() ? j["versions"] : j)) {
      if (e.value("version", "") == "v" + std::to_string(k)) stored = e.value("stored_bytes", uint64_t{0});
    }
    ASSERT_GT(stored, 0u) << log.out;
    const std::string resumed_text = again.out.substr(again.out.find("resumed: "));
    const uint64_t sent = sent_bytes(again.out);
    EXPECT_LT(sent, stored) << again.out;  // not everything again
    // sent = the packs not resumed + metadata (manifest, table, lease): nothing resumed is sent.
    const uint64_t resumed_stored = stored - std::min(stored, sent);
    EXPECT_GT(resumed_stored, 0u) << again.out;
    EXPECT_FALSE(fs::exists(root_ / "cache/pushes") && CountFiles(root_ / "cache/pushes") > 0)
        << "the record is removed once the version is published";
    Result v_ok = RunCli("verify " + bucket_ + " " + v);
    EXPECT_EQ(v_ok.exit_code, 0) << v_ok.out;
    Result pulled = RunCli("pull " + bucket_ + " " + v + " " + (root_ / ("out" + std::to_string(k))).string() + " --no-cache");
    ASSERT_EQ(pulled.exit_code, 0) << pulled.out;
    for (const auto& f : fs::directory_iterator(Version(k))) {
      EXPECT_EQ(Slurp(f.path().string()), Slurp((root_ / ("out" + std::to_string(k)) / f.path().filename()).string()))
          << f.path();
    }
    Result gc = RunCli("gc " + bucket_ + " --dry-run");
    EXPECT_LE(number_after(gc.out, "would remove "), 4u) << gc.out;  // at most the packs in flight
  }
}

// `push --parts` interrupted while it waits for the other parts: its part is in the bucket and
// counts (the message says so, not "nothing was published"), and the last part publishes.
TEST_F(BucketCli, APartInterruptedWhileWaitingStaysInAndCounts) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  const std::vector<std::string> shards = SafetensorsIn(Version(1));
  ASSERT_GE(shards.size(), 2u);
  const std::string log_path = (root_ / "waiting").string();
  pid_t pid = Spawn({"push", bucket_, "acme/m@v1", shards[0], "--no-cache", "--parts", "2", "--part", "p0"}, log_path);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (Slurp(log_path).find("1 of 2 parts in") == std::string::npos && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGINT);
  EXPECT_EQ(Wait(pid), 130);
  const std::string said = Slurp(log_path);
  EXPECT_NE(said.find("this part is in the bucket and counts"), std::string::npos) << said;
  EXPECT_EQ(said.find("nothing was published"), std::string::npos) << said;
  Result last = RunCli("push " + bucket_ + " acme/m@v1 " + shards[1] + " --no-cache --parts 2 --part p1 --timeout 60");
  ASSERT_EQ(last.exit_code, 0) << last.out;
  EXPECT_NE(last.out.find("published acme/m@v1 from 2 parts"), std::string::npos) << last.out;
  Result pull = RunCli("pull " + bucket_ + " acme/m@v1 " + (root_ / "out").string() + " --no-cache");
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  for (size_t i = 0; i < 2; ++i) {
    const fs::path name = fs::path(shards[i]).filename();
    EXPECT_EQ(Slurp(shards[i]), Slurp((root_ / "out" / name).string())) << name;
  }
}

// `push --parts`: three processes, each pushing one shard of v1, publish v1 once with all
// three; the small files no part pushes are inherited from v0. A part alone times out (124)
// and is listed as staged; a killed part pushed again is not counted twice.
TEST_F(BucketCli, PartsFromThreeProcessesPublishOneVersion) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  const std::vector<std::string> shards = SafetensorsIn(Version(1));
  ASSERT_GE(shards.size(), 3u);
  const std::string n = std::to_string(shards.size());
  // Part 0 alone: it waits out its timeout, and the version is staged, not published.
  Result alone = RunCli("push " + bucket_ + " acme/m@v1 " + shards[0] + " --no-cache --parts " + n +
                        " --part p0 --timeout 0.5");
  EXPECT_EQ(alone.exit_code, 124) << alone.out;
  EXPECT_NE(alone.out.find("1 of " + n + " parts are in"), std::string::npos) << alone.out;
  Result log = RunCli("log " + bucket_ + " acme/m");
  EXPECT_NE(log.out.find("staged acme/m@v1"), std::string::npos) << log.out;
  EXPECT_NE(log.out.find("part p0"), std::string::npos) << log.out;
  Result json = RunCli("log " + bucket_ + " acme/m --json");
  ASSERT_EQ(json.exit_code, 0) << json.out;
  for (const auto& v : nlohmann::json::parse(json.out)) {
    EXPECT_FALSE(v.value("version", "") == "v1" && !v.value("staged", false)) << "published with one part: " << json.out;
  }
  // A one-writer push of the name is refused while it is staged.
  Result plain = RunCli("push " + bucket_ + " acme/m@v1 " + Version(1) + " --no-cache");
  EXPECT_EQ(plain.exit_code, 1) << plain.out;
  EXPECT_NE(plain.out.find("--parts"), std::string::npos) << plain.out;
  // Part 1 killed at a random moment, then pushed again: it counts once.
  std::mt19937 rng(7);
  pid_t killed = Spawn({"push", bucket_, "acme/m@v1", shards[1], "--no-cache", "--parts", n, "--part", "p1", "--no-wait"},
                       (root_ / "killed").string());
  std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 300)(rng)));
  kill(killed, SIGKILL);
  Wait(killed);
  // Every part at once (part 0 again, waiting now), each its own process.
  std::vector<pid_t> pids;
  for (size_t i = 0; i < shards.size(); ++i) {
    pids.push_back(Spawn({"push", bucket_, "acme/m@v1", shards[i], "--no-cache", "--parts", n, "--part",
                          "p" + std::to_string(i), "--timeout", "60"},
                         (root_ / ("part" + std::to_string(i))).string()));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    EXPECT_EQ(Wait(pids[i]), 0) << Slurp((root_ / ("part" + std::to_string(i))).string());
  }
  Result pull = RunCli("pull " + bucket_ + " acme/m@v1 " + (root_ / "out").string() + " --no-cache");
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  for (const auto& e : fs::directory_iterator(Version(1))) {
    const bool shard = e.path().extension() == ".safetensors";
    const std::string expected = shard ? e.path().string() : Version(0) + "/" + e.path().filename().string();
    EXPECT_EQ(Slurp(expected), Slurp((root_ / "out" / e.path().filename()).string())) << e.path();
  }
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
  Result after = RunCli("log " + bucket_ + " acme/m");
  EXPECT_EQ(after.out.find("staged"), std::string::npos) << after.out;
  EXPECT_NE(after.out.find("acme/m@v1 "), std::string::npos) << after.out;  // published: a row
  // A part submitted again leaves its first submission's packs (payload order in a pack
  // follows the encode threads): gc takes them, and the version stays whole.
  Result gc = RunCli("gc " + bucket_);
  ASSERT_EQ(gc.exit_code, 0) << gc.out;
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
  Result gc2 = RunCli("gc " + bucket_ + " --dry-run");
  EXPECT_NE(gc2.out.find("would remove 0 unreferenced packs"), std::string::npos) << gc2.out;
}

// One corrupt manifest must not hide the rest of the bucket: `log` lists every other version
// (of every model), reports the corrupt one (an UNREADABLE row and an error line; an "error"
// field with --json) and exits 1, as --help documents.
TEST_F(BucketCli, LogListsEveryVersionAndReportsACorruptManifest) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v1 " + Version(1) + " --no-cache").exit_code, 0);
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v2 " + Version(2) + " --no-cache").exit_code, 0);
  ASSERT_EQ(RunCli("push " + bucket_ + " other/n@base " + Version(0) + " --no-cache").exit_code, 0);
  std::ofstream(root_ / "bucket/models/acme/m/versions/v1.json", std::ios::trunc) << "{\"format\": 1, \"model\": ";

  Result log = RunCli("log " + bucket_);
  EXPECT_EQ(log.exit_code, 1) << log.out;
  for (const char* listed : {"acme/m@v0 ", "acme/m@v2 ", "other/n@base "}) {
    EXPECT_NE(log.out.find(listed), std::string::npos) << listed << " missing from\n" << log.out;
  }
  EXPECT_NE(log.out.find("cannot read acme/m@v1: Corruption"), std::string::npos) << log.out;
  const size_t row = log.out.find("acme/m@v1 ");
  ASSERT_NE(row, std::string::npos) << log.out;
  EXPECT_NE(log.out.find("UNREADABLE", row), std::string::npos) << log.out;
  // The unreadable version comes after its model's other versions.
  EXPECT_GT(log.out.rfind("acme/m@v1 "), log.out.find("acme/m@v2 ")) << log.out;

  // --json: stdout is one valid document with an "error" field for the unreadable version.
  Result json = weightfs::test::RunShell(std::string(WEIGHTFS_BINARY) + " log " + bucket_ + " --json 2>/dev/null");
  EXPECT_EQ(json.exit_code, 1);
  const nlohmann::json j = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_TRUE(j.is_array()) << json.out;
  ASSERT_EQ(j.size(), 4u) << json.out;
  size_t errors = 0;
  for (const auto& e : j) {
    if (e.contains("error")) {
      ++errors;
      EXPECT_EQ(e["model"], "acme/m");
      EXPECT_EQ(e["version"], "v1");
      EXPECT_NE(e["error"].get<std::string>().find("Corruption"), std::string::npos) << e.dump();
    } else {
      EXPECT_TRUE(e.contains("stored_bytes")) << e.dump();
    }
  }
  EXPECT_EQ(errors, 1u);

  // A model whose versions all read: exit 0. The --help says what the exit status means.
  Result other = RunCli("log " + bucket_ + " other/n");
  EXPECT_EQ(other.exit_code, 0) << other.out;
  EXPECT_NE(other.out.find("other/n@base"), std::string::npos) << other.out;
  Result help = RunCli("log --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("Exit status"), std::string::npos) << help.out;
}

// Pushes killed mid-upload leave temporary objects in .weightfs-tmp/; `gc` removes the old ones
// (unchanged for an hour), keeps young ones, counts both, and --dry-run removes nothing.
TEST_F(BucketCli, GcRemovesOldTemporaryUploadsAndCountsThem) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  const fs::path tmp = root_ / "bucket/.weightfs-tmp";
  fs::create_directories(tmp);
  for (const char* name : {"9001-0-1", "9001-1-2", "9002-0-3"}) {
    std::ofstream(tmp / name, std::ios::binary) << std::string(1 << 20, 'x');
  }
  const time_t old = ::time(nullptr) - 2 * 3600;
  const timespec times[2] = {{old, 0}, {old, 0}};
  for (const char* name : {"9001-0-1", "9001-1-2"}) {
    ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / name).c_str(), times, 0), 0);
  }
  Result dry = RunCli("gc " + bucket_ + " --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.out;
  EXPECT_NE(dry.out.find("would remove 2 temporary uploads left by interrupted writes"), std::string::npos) << dry.out;
  EXPECT_NE(dry.out.find("kept 1 temporary upload"), std::string::npos) << dry.out;
  EXPECT_EQ(CountFiles(tmp), 3u);
  Result gc = RunCli("gc " + bucket_);
  ASSERT_EQ(gc.exit_code, 0) << gc.out;
  EXPECT_NE(gc.out.find("removed 2 temporary uploads left by interrupted writes (2.0 MiB)"), std::string::npos)
      << gc.out;
  EXPECT_EQ(CountFiles(tmp), 1u);
  EXPECT_TRUE(fs::exists(tmp / "9002-0-3"));
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v0").exit_code, 0);
}

TEST_F(BucketCli, FlippedByteInAPackFailsPullAndVerifyNamingTheChunk) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  for (const auto& e : fs::directory_iterator(root_ / "bucket/packs")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(1000);
    char c;
    f.get(c);
    f.seekp(1000);
    f.put(static_cast<char>(c ^ 1));
    break;
  }
  Result v = RunCli("verify " + bucket_ + " acme/m@v0");
  EXPECT_EQ(v.exit_code, 1);
  EXPECT_NE(v.out.find("chunk"), std::string::npos) << v.out;
  EXPECT_NE(v.out.find(".safetensors"), std::string::npos) << v.out;
  const fs::path dest = root_ / "out";
  Result p = RunCli("pull " + bucket_ + " acme/m@v0 " + dest.string() + " --no-cache");
  EXPECT_EQ(p.exit_code, 1) << p.out;
  // Whatever was written before the failure is correct; the failing file is absent.
  for (const auto& e : fs::directory_iterator(dest)) {
    EXPECT_EQ(e.path().string().find(".weightfs-partial"), std::string::npos);
    EXPECT_EQ(Slurp(e.path().string()), Slurp(Version(0) + "/" + e.path().filename().string()));
  }
}

// A checkpoint that claims to be safetensors and is not (truncated, or a header that lies) is
// refused by push with the file and the reason, and nothing is published; --allow-invalid
// stores it as opaque bytes, bit-exact.
TEST_F(BucketCli, ACorruptSafetensorsFileIsRefusedUnlessAllowed) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + Cache("c")).exit_code, 0);
  const fs::path dir = root_ / "ckpt";
  fs::create_directories(dir);
  std::string shard;
  for (const auto& e : fs::directory_iterator(Version(1))) {
    fs::copy_file(e.path(), dir / e.path().filename());
    if (e.path().extension() == ".safetensors" && shard.empty()) shard = e.path().filename().string();
  }
  ASSERT_FALSE(shard.empty());
  // Truncated, as a save killed half way leaves it.
  fs::resize_file(dir / shard, fs::file_size(dir / shard) / 2);
  Result cut = RunCli("push " + bucket_ + " acme/m@v1 " + dir.string() + Cache("c"));
  EXPECT_EQ(cut.exit_code, 1) << cut.out;
  EXPECT_NE(cut.out.find(shard + " is not a valid safetensors file (by its name): "), std::string::npos) << cut.out;
  EXPECT_NE(cut.out.find("--allow-invalid"), std::string::npos) << cut.out;
  Result log = RunCli("log " + bucket_ + " acme/m --json");
  EXPECT_EQ(log.out.find("\"version\":\"v1\""), std::string::npos) << log.out;
  // A header that lies: a tensor's end offset moved past the file (same length, so the JSON
  // stays the same size).
  fs::copy_file(fs::path(Version(1)) / shard, dir / shard, fs::copy_options::overwrite_existing);
  {
    std::fstream f(dir / shard, std::ios::in | std::ios::out | std::ios::binary);
    std::string head(4096, '\0');
    f.read(head.data(), static_cast<std::streamsize>(head.size()));
    const size_t at = head.find("\"data_offsets\":[0,");
    ASSERT_NE(at, std::string::npos) << head.substr(0, 200);
    f.seekp(static_cast<std::streamoff>(at + 18));
    f.write("9", 1);  // the first tensor's end now begins with 9: past the others or the file
  }
  Result lies = RunCli("push " + bucket_ + " acme/m@v1 " + dir.string() + Cache("c"));
  EXPECT_EQ(lies.exit_code, 1) << lies.out;
  EXPECT_NE(lies.out.find(shard + " is not a valid safetensors file"), std::string::npos) << lies.out;
  // Allowed: stored as bytes, and read back as they were.
  Result allowed = RunCli("push " + bucket_ + " acme/m@v1 " + dir.string() + Cache("c") + " --allow-invalid");
  ASSERT_EQ(allowed.exit_code, 0) << allowed.out;
  EXPECT_NE(allowed.out.find("stored as opaque bytes (--allow-invalid)"), std::string::npos) << allowed.out;
  Result pull = RunCli("pull " + bucket_ + " acme/m@v1 " + (root_ / "out").string() + Cache("c2"));
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  EXPECT_EQ(Slurp((root_ / "out" / shard).string()), Slurp((dir / shard).string()));
}

// Typos that did damage quietly: `log` of a model that is not there exits 1 naming the ones
// meant; `push` of a new model (its organisation forgotten) says it stores a full base and
// names the model that looks alike.
TEST_F(BucketCli, AModelNameThatIsNotThereIsSaidWithTheOnesMeant) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/rl@v0 " + Version(0) + Cache("c")).exit_code, 0);
  Result typo = RunCli("log " + bucket_ + " acme/rll");
  EXPECT_EQ(typo.exit_code, 1) << typo.out;
  EXPECT_NE(typo.out.find("no model acme/rll in " + bucket_ + "; did you mean acme/rl?"), std::string::npos) << typo.out;
  Result json = RunCli("log " + bucket_ + " zeta/other --json");
  EXPECT_EQ(json.exit_code, 1) << json.out;
  EXPECT_NE(json.out.find("(its models: acme/rl)"), std::string::npos) << json.out;
  Result ok = RunCli("log " + bucket_ + " acme/rl");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  Result fresh = RunCli("push " + bucket_ + " rl@v1 " + Version(1) + Cache("c"));
  ASSERT_EQ(fresh.exit_code, 0) << fresh.out;
  EXPECT_NE(fresh.out.find("new model rl (no versions yet): storing a full base (did you mean acme/rl? Push to that "
                           "name to store deltas against it)"),
            std::string::npos)
      << fresh.out;
  Result next = RunCli("push " + bucket_ + " acme/rl@v1 " + Version(1) + Cache("c"));
  ASSERT_EQ(next.exit_code, 0) << next.out;
  EXPECT_EQ(next.out.find("new model"), std::string::npos) << next.out;
}

// gc --keep-last rebases the kept version onto new keyframes: the bucket can grow. gc says
// what it wrote and what it removed, and the difference matches the bucket's size on disk.
TEST_F(BucketCli, GcSaysWhatItsRebaseWroteAndTheBucketsSizeFollows) {
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v0 " + Version(0) + Cache("c")).exit_code, 0);
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@v1 " + Version(1) + Cache("c")).exit_code, 0);
  auto du = [&] {
    uint64_t n = 0;
    for (const auto& e : fs::recursive_directory_iterator(bucket_)) n += e.is_regular_file() ? e.file_size() : 0;
    return static_cast<double>(n);
  };
  // "1.5 MiB" -> bytes.
  auto bytes_after = [](const std::string& text, const std::string& word) {
    const size_t at = text.find(word);
    if (at == std::string::npos) return -1.0;
    double v = 0;
    char unit[8] = {};
    if (std::sscanf(text.c_str() + at + word.size(), " %lf %7s", &v, unit) != 2) return -1.0;
    const std::string u(unit);
    return v * (u == "KiB" ? 1024.0 : u == "MiB" ? 1048576.0 : u == "GiB" ? 1073741824.0 : 1.0);
  };
  Result dry = RunCli("gc " + bucket_ + " --keep-last 1 --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.out;
  EXPECT_NE(dry.out.find("would write about"), std::string::npos) << dry.out;
  const double before = du();
  Result gc = RunCli("gc " + bucket_ + " --keep-last 1");
  ASSERT_EQ(gc.exit_code, 0) << gc.out;
  const double after = du();
  const double written = bytes_after(gc.out, "wrote"), growth = bytes_after(gc.out, "grew by");
  ASSERT_GT(written, 0) << gc.out;
  ASSERT_GT(growth, 0) << gc.out;  // a base retired for keyframes of a whole version: it grows
  // Heads and tables rewritten too: within 10% and 256 KiB.
  EXPECT_NEAR(after - before, growth, 0.1 * growth + 262144) << gc.out << "\nbucket " << before << " -> " << after;
  // The dry run's estimate is of the same size.
  const double estimate = bytes_after(dry.out, "would write about");
  EXPECT_NEAR(estimate, written, 0.25 * written) << dry.out << gc.out;
  EXPECT_EQ(RunCli("verify " + bucket_ + " acme/m@v1").exit_code, 0);
  // `log` after it: v1's STORED counts its new keyframes, and its retired parent is gone.
  Result log = RunCli("log " + bucket_ + " acme/m --json");
  ASSERT_EQ(log.exit_code, 0) << log.out;
  const nlohmann::json versions = nlohmann::json::parse(log.out, nullptr, false);
  ASSERT_TRUE(versions.is_array() && versions.size() == 1) << log.out;
  EXPECT_GE(versions[0]["stored_bytes"].get<double>(), 0.9 * written) << log.out;
  EXPECT_EQ(versions[0]["parent_gone"], true) << log.out;
  Result text = RunCli("log " + bucket_ + " acme/m");
  EXPECT_NE(text.out.find("v0 (gone)"), std::string::npos) << text.out;
}

// Checkpoints saved under a new name each step are stored whole (deltas pair files by path):
// push says so and names the parent's file that holds the same tensors.
TEST_F(BucketCli, AFileRenamedBetweenVersionsIsSaidToBeStoredWhole) {
  std::string shard;
  for (const auto& e : fs::directory_iterator(Version(0))) {
    if (e.path().extension() == ".safetensors") shard = e.path().filename().string();
  }
  ASSERT_FALSE(shard.empty());
  for (int k = 0; k < 2; ++k) {
    const fs::path dir = root_ / ("step" + std::to_string(k));
    fs::create_directories(dir);
    fs::copy_file(fs::path(Version(k)) / shard, dir / ("step-000" + std::to_string(k) + ".safetensors"));
  }
  ASSERT_EQ(RunCli("push " + bucket_ + " acme/m@s0 " + (root_ / "step0").string() + Cache("c")).exit_code, 0);
  Result renamed = RunCli("push " + bucket_ + " acme/m@s1 " + (root_ / "step1").string() + Cache("c"));
  ASSERT_EQ(renamed.exit_code, 0) << renamed.out;
  EXPECT_NE(renamed.out.find("step-0001.safetensors has no file of that path in acme/m@s0 and is stored whole"),
            std::string::npos)
      << renamed.out;
  EXPECT_NE(renamed.out.find("step-0000.safetensors there holds the same tensors"), std::string::npos) << renamed.out;
  EXPECT_NE(renamed.out.find("FILE --as step-0000.safetensors"), std::string::npos) << renamed.out;
  // Pushed as what the warning says: a delta of the same name, a fraction of the bytes.
  Result as = RunCli("push " + bucket_ + " acme/m@s3 " + (root_ / "step1" / "step-0001.safetensors").string() +
                     " --as step-0000.safetensors --parent s0" + Cache("c"));
  ASSERT_EQ(as.exit_code, 0) << as.out;
  EXPECT_EQ(as.out.find("stored whole"), std::string::npos) << as.out;
  Result log = RunCli("log " + bucket_ + " acme/m --json");
  const nlohmann::json versions = nlohmann::json::parse(log.out, nullptr, false);
  uint64_t whole = 0, delta = 0;
  for (const auto& v : versions) {
    if (v.value("version", "") == "s1") whole = v.value("stored_bytes", uint64_t{0});
    if (v.value("version", "") == "s3") delta = v.value("stored_bytes", uint64_t{0});
  }
  EXPECT_GT(delta, 0u) << log.out;
  EXPECT_LT(delta * 5, whole) << log.out;
  Result pull = RunCli("pull " + bucket_ + " acme/m@s3 " + (root_ / "s3").string() + " --no-cache");
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  EXPECT_EQ(Slurp((root_ / "s3" / "step-0000.safetensors").string()),
            Slurp((root_ / "step1" / "step-0001.safetensors").string()));
  Result two = RunCli("push " + bucket_ + " acme/m@s4 " + (root_ / "step1").string() + " --as x.safetensors");
  EXPECT_EQ(two.exit_code, 2) << two.out;
  // The same name as in its parent: no warning.
  fs::rename(root_ / "step1" / "step-0001.safetensors", root_ / "step1" / "step-0000.safetensors");
  Result same = RunCli("push " + bucket_ + " acme/m@s2 " + (root_ / "step1").string() + Cache("c") + " --parent s0");
  ASSERT_EQ(same.exit_code, 0) << same.out;
  EXPECT_EQ(same.out.find("stored whole"), std::string::npos) << same.out;
}

}  // namespace
