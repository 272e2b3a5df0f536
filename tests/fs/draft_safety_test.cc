// Drafts against what third-party suites (fsx, pjdfstest) and hostile users do: a file
// truncated while the mount encodes it (the daemon must never die of SIGBUS), other users with
// --allow-other (default_permissions: the owner and mode of every draft node count), names
// longer than NAME_MAX, chmod/chown/utimes on a draft's directories and files (applied and kept
// across a remount), a file unlinked while open and made again under its name, and drafts
// abandoned with `weightfs discard` or `rm -r`.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/fs/draft_mount.h"

namespace weightfs {
namespace {

using namespace weightfs::test;

class DraftSafetyTest : public DraftMountTest {};

// Writes `bytes` to `path` (created or truncated) with plain write(2) calls.
int WriteWhole(const fs::path& path, const std::vector<uint8_t>& bytes, int flags = O_CREAT | O_TRUNC) {
  int fd = ::open(path.c_str(), O_WRONLY | flags, 0644);
  if (fd < 0) return errno;
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return err;
    }
    done += static_cast<size_t>(n);
  }
  return ::close(fd) == 0 ? 0 : errno;
}

// The loop that killed the daemon with SIGBUS at its second iteration (the close-time encode
// mapped the staging file while truncate cut it): write a file, close it (its encode starts),
// cut it at once, by truncate(2) or by opening it again with O_TRUNC. Every iteration the
// daemon is alive and the file reads back as what is left of it; at the end the draft commits
// and a fresh mount reads the result.
TEST_F(DraftSafetyTest, TruncatingAFileWhileItIsEncodedNeverKillsTheDaemon) {
  int iterations = 60;
  if (const char* n = std::getenv("WEIGHTFS_TRUNCATE_ITERATIONS")) iterations = std::atoi(n);
  Generate("4M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const std::vector<uint8_t> big = RandomBytes(32 << 20, 7);
  const fs::path file = draft / "big.bin";
  std::vector<uint8_t> expect;
  for (int i = 0; i < iterations; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    ASSERT_EQ(WriteWhole(file, big), 0);
    // Cut it while its encode reads it (the status says so; wait a bounded while for that).
    WaitFor([&] {
      const std::optional<std::string> st = GetXattr(m.mnt(), "user.weightfs.status");
      return st && st->find("\"encoding_now\":1") != std::string::npos;
    }, 3s);
    const size_t cut = (i % 3 == 2) ? 0 : (size_t{1} << 20) + static_cast<size_t>(i) * 4097;
    if (i % 3 == 2) {
      // open(O_TRUNC) and a short write, as a program rewriting the file does.
      expect.assign(big.begin(), big.begin() + 4096);
      ASSERT_EQ(WriteWhole(file, expect, O_TRUNC), 0);
    } else {
      ASSERT_EQ(Errno(::truncate(file.c_str(), static_cast<off_t>(cut))), 0) << std::strerror(errno);
      expect.assign(big.begin(), big.begin() + static_cast<std::ptrdiff_t>(cut));
    }
    ASSERT_FALSE(ProcessGone(m.pid())) << "the daemon died\n" << m.Describe();
    ASSERT_EQ(Slurp(file), expect);
  }
  Result c = m.Commit("m/x@v1");
  ASSERT_EQ(c.exit_code, 0) << c.out << m.Describe();
  EXPECT_EQ(m.LogText().find("shrank while it was encoded, not through the mount"), std::string::npos);
  ASSERT_EQ(m.Unmount().exit_code, 0);
  Mount& fresh = NewMount("fresh");
  ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
  EXPECT_EQ(Slurp(fresh.Dir("m/x@v1") / "big.bin"), expect);
}

// The loop that killed the daemon with SIGFPE (a divide by zero in the sparse encoder, whose
// passes read the staging file while the writer changed it): close a ~14 MB safetensors file
// in a draft (its encode starts against the parent's file), open it again and keep making
// small pwrites of tensor bytes for 0.3 s, pause 0-400 ms (mostly short), repeat. The daemon stays alive,
// the file reads back as written, and the committed version is what was written last.
// WEIGHTFS_REWRITE_ITERATIONS sets the rounds (CI: 20, ~9 s; the 1,000 run by hand). Without the fix it died within 40.
TEST_F(DraftSafetyTest, WritingAFileAgainWhileItIsEncodedNeverKillsTheDaemon) {
  int iterations = 20;
  if (const char* n = std::getenv("WEIGHTFS_REWRITE_ITERATIONS")) iterations = std::atoi(n);
  Generate("8M", 1, "--shard-size 100M");
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const fs::path source = Source(1) / "model.safetensors";
  ASSERT_TRUE(fs::exists(source)) << "expected one shard";
  std::vector<uint8_t> expect = Slurp(source);
  const std::vector<uint8_t> step = expect, parent = Slurp(Source(0) / "model.safetensors");
  ASSERT_EQ(parent.size(), step.size());
  const fs::path file = draft / "model.safetensors";
  std::mt19937_64 rng(11);
  for (int i = 0; i < iterations; ++i) {
    SCOPED_TRACE("iteration " + std::to_string(i));
    if (i == 0) {
      ASSERT_EQ(WriteWhole(file, expect), 0);  // closed: its encode starts
    }
    const int fd = ::open(file.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    const auto until = std::chrono::steady_clock::now() + 300ms;
    while (std::chrono::steady_clock::now() < until) {
      // Small writes past the header: elements go back to the parent's values or forward to
      // the step's (a change the encoder found may be gone when it reads its value).
      const size_t at = 4096 + (rng() % (expect.size() - 4096 - 4096)) / 2 * 2;
      uint8_t bytes[4096];
      const bool back = rng() & 1;
      for (size_t k = 0; k < sizeof bytes; ++k) bytes[k] = back ? parent[at + k] : step[at + k];
      ASSERT_EQ(::pwrite(fd, bytes, sizeof bytes, static_cast<off_t>(at)), static_cast<ssize_t>(sizeof bytes))
          << std::strerror(errno) << (ProcessGone(m.pid()) ? ": the daemon died\n" + m.Describe() : "");
      std::memcpy(expect.data() + at, bytes, sizeof bytes);
    }
    ASSERT_EQ(::close(fd), 0);  // the encode starts again
    // Mostly short pauses: the next writes then meet the encode of the last close.
    std::this_thread::sleep_for(std::chrono::milliseconds((rng() & 3) ? rng() % 40 : 20 + rng() % 380));
    ASSERT_FALSE(ProcessGone(m.pid())) << "the daemon died\n" << m.Describe();
  }
  EXPECT_EQ(Slurp(file), expect);
  Result c = m.Commit("m/x@v1");
  ASSERT_EQ(c.exit_code, 0) << c.out << m.Describe();
  ASSERT_EQ(m.Unmount().exit_code, 0);
  Mount& fresh = NewMount("fresh");
  ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
  EXPECT_EQ(Slurp(fresh.Dir("m/x@v1") / "model.safetensors"), expect);
}

// fsx in parallel: 8 workers in one draft, each on its own file, each doing what fsx does —
// writes at random offsets (past the end too: holes), truncates down and up, reads of random
// ranges checked against an in-memory copy, and closes and reopens (every close starts the
// file's encode, which then races the next writes) — then a commit, and every file read back
// by hash through a fresh mount. Five fsx processes in one draft used to kill the mount.
// WEIGHTFS_FSX_OPS sets each worker's operations (CI: 1,500; by hand 50,000).
TEST_F(DraftSafetyTest, EightParallelFsxWorkersInOneDraftMatchTheirModels) {
  int ops = 1500;
  if (const char* n = std::getenv("WEIGHTFS_FSX_OPS")) ops = std::max(1, std::atoi(n));
  constexpr int kWorkers = 8;
  constexpr size_t kMaxSize = 3 << 20;
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::vector<std::vector<uint8_t>> model(kWorkers);
  std::vector<std::string> failures(kWorkers);
  std::vector<std::array<uint64_t, 5>> counts(kWorkers);  // writes, truncates, reads, reopens, bytes checked
  auto worker = [&](int w) {
    std::mt19937_64 rng(seed + static_cast<unsigned>(w));
    std::vector<uint8_t>& ref = model[w];
    const fs::path path = draft / ("fsx" + std::to_string(w) + ".bin");
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT, 0644);
    if (fd < 0) {
      failures[w] = "open: " + std::string(std::strerror(errno));
      return;
    }
    std::vector<uint8_t> buf;
    for (int i = 0; i < ops && failures[w].empty(); ++i) {
      const uint64_t r = rng() % 100;
      if (r < 45) {  // write
        const size_t len = 1 + rng() % (64 << 10);
        const size_t at = rng() % (kMaxSize - len);
        buf.resize(len);
        for (uint8_t& b : buf) b = static_cast<uint8_t>(rng());
        if (::pwrite(fd, buf.data(), len, static_cast<off_t>(at)) != static_cast<ssize_t>(len)) {
          failures[w] = "op " + std::to_string(i) + ": pwrite: " + std::strerror(errno);
          break;
        }
        if (ref.size() < at + len) ref.resize(at + len, 0);
        std::memcpy(ref.data() + at, buf.data(), len);
        counts[w][0]++;
      } else if (r < 55) {  // truncate, down or up
        const size_t to = rng() % kMaxSize;
        if (::ftruncate(fd, static_cast<off_t>(to)) != 0) {
          failures[w] = "op " + std::to_string(i) + ": ftruncate: " + std::strerror(errno);
          break;
        }
        ref.resize(to, 0);
        counts[w][1]++;
      } else if (r < 92) {  // read and check
        const size_t at = ref.empty() ? 0 : rng() % ref.size();
        const size_t len = 1 + rng() % (128 << 10);
        buf.assign(len, 0xee);
        const ssize_t n = ::pread(fd, buf.data(), len, static_cast<off_t>(at));
        const size_t want = at < ref.size() ? std::min(len, ref.size() - at) : 0;
        if (n != static_cast<ssize_t>(want) || std::memcmp(buf.data(), ref.data() + at, want) != 0) {
          failures[w] = "op " + std::to_string(i) + ": read of " + std::to_string(len) + " at " + std::to_string(at) +
                        " got " + std::to_string(n) + " bytes, not the model's " + std::to_string(want);
          break;
        }
        counts[w][2]++;
        counts[w][4] += want;
      } else {  // close (its encode starts) and open again
        if (::close(fd) != 0) {
          failures[w] = "op " + std::to_string(i) + ": close: " + std::strerror(errno);
          fd = -1;
          break;
        }
        if (rng() % 4 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 30));
        fd = ::open(path.c_str(), O_RDWR);
        if (fd < 0) {
          failures[w] = "op " + std::to_string(i) + ": reopen: " + std::strerror(errno);
          break;
        }
        counts[w][3]++;
      }
    }
    if (fd >= 0) ::close(fd);
  };
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) threads.emplace_back(worker, w);
  for (std::thread& t : threads) t.join();
  std::array<uint64_t, 5> total{};
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(failures[w], "") << "worker " << w << (ProcessGone(m.pid()) ? ": the daemon died\n" + m.Describe() : "");
    for (size_t k = 0; k < total.size(); ++k) total[k] += counts[w][k];
  }
  std::printf("[ fsx      ] %d workers x %d ops: %llu writes, %llu truncates, %llu reads (%.1f MB checked), %llu reopens\n",
              kWorkers, ops, static_cast<unsigned long long>(total[0]), static_cast<unsigned long long>(total[1]),
              static_cast<unsigned long long>(total[2]), static_cast<double>(total[4]) / 1e6,
              static_cast<unsigned long long>(total[3]));
  ASSERT_FALSE(ProcessGone(m.pid())) << "the daemon died\n" << m.Describe();
  if (HasFailure()) return;
  Result c = m.Commit("m/x@v1");
  ASSERT_EQ(c.exit_code, 0) << c.out << m.Describe();
  ASSERT_EQ(m.Unmount().exit_code, 0);
  Mount& fresh = NewMount("fresh");
  ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
  for (int w = 0; w < kWorkers; ++w) {
    EXPECT_EQ(Slurp(fresh.Dir("m/x@v1") / ("fsx" + std::to_string(w) + ".bin")), model[w]) << "worker " << w;
  }
}

// What a process running as `uid` (and gid) gets for `op`: 0 or the errno, from a child that
// drops root first. -1 if the child could not run.
int AsUser(uid_t uid, gid_t gid, const std::function<int()>& op) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::close(pipefd[0]);
    int result = -1;
    if (::setgroups(0, nullptr) == 0 && ::setgid(gid) == 0 && ::setuid(uid) == 0) result = op();
    (void)!::write(pipefd[1], &result, sizeof result);
    ::_exit(0);
  }
  ::close(pipefd[1]);
  int result = -1;
  if (::read(pipefd[0], &result, sizeof result) != static_cast<ssize_t>(sizeof result)) result = -1;
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return result;
}

// --uid, --gid, --file-mode and --dir-mode set the owner and modes of published versions, and the
// kernel checks them: with --gid G --file-mode 0440 --dir-mode 0550 (and --allow-other), a user
// of group G reads a published file and another user gets EACCES. Write bits are refused.
TEST_F(DraftSafetyTest, OwnerGroupAndModesOfPublishedVersionsAreTheMountsAndTheKernelChecksThem) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (to act as other users)";
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& bad = NewMount("bad", "--file-mode 0644");
  const Result refused = bad.Start();
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("write bits"), std::string::npos) << refused.out;
  const gid_t readers = 65533;
  Mount& m = NewMount("a", "--allow-other --uid 4321 --gid 65533 --file-mode 0440 --dir-mode 0550");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  for (fs::path p = m.mnt().parent_path(); p != p.root_path() && p != "/tmp"; p = p.parent_path()) {
    ::chmod(p.c_str(), 0755);
  }
  const fs::path version = m.Dir("m/x@v0");
  fs::path file;
  for (const auto& e : fs::directory_iterator(version)) {
    if (e.path().extension() == ".safetensors") file = e.path();
  }
  ASSERT_FALSE(file.empty()) << "no safetensors file in " << version;
  struct stat st {};
  ASSERT_EQ(::stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_uid, 4321u);
  EXPECT_EQ(st.st_gid, readers);
  EXPECT_EQ(st.st_mode, S_IFREG | 0440);
  ASSERT_EQ(::stat(version.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode, S_IFDIR | 0550);
  ASSERT_EQ(::stat(m.Dir("m").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode, S_IFDIR | 0750);  // drafts are made here: the owner may write
  auto read_as = [&](uid_t uid, gid_t gid) {
    return AsUser(uid, gid, [&] {
      int fd = ::open(file.c_str(), O_RDONLY);
      if (fd < 0) return errno;
      char b;
      const int r = ::read(fd, &b, 1) == 1 ? 0 : errno;
      ::close(fd);
      return r;
    });
  };
  EXPECT_EQ(read_as(65534, readers), 0);
  EXPECT_EQ(read_as(65534, 65534), EACCES);
  EXPECT_EQ(read_as(4321, 65534), 0);
}

// With --allow-other every user reaches the mount; the kernel checks each access against the
// owner and mode the mount reports (default_permissions). A draft file made by root with mode
// 0600 is root's alone; one with 0644 anyone may read but not change; a published version anyone
// may read.
TEST_F(DraftSafetyTest, WithAllowOtherAnotherUserGetsEaccesOnAPrivateDraftFile) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (to act as a second user)";
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a", "--allow-other");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  // The second user must reach the mount point: the test's directories are made 0700.
  for (fs::path p = m.mnt().parent_path(); p != p.root_path() && p != "/tmp"; p = p.parent_path()) {
    ::chmod(p.c_str(), 0755);
  }
  const uid_t other = 65534;  // nobody
  const gid_t other_gid = 65534;
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const fs::path secret = draft / "secret.bin", shared = draft / "shared.bin";
  {
    int fd = ::open(secret.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(::write(fd, "top secret", 10), 10);
    ::close(fd);
  }
  ASSERT_EQ(WriteWhole(shared, {1, 2, 3}), 0);
  ASSERT_EQ(Errno(::chmod(shared.c_str(), 0644)), 0);
  struct stat st {};
  ASSERT_EQ(::stat(secret.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, 0u);

  auto open_as_other = [&](const fs::path& p, int flags) {
    return AsUser(other, other_gid, [&] {
      int fd = ::open(p.c_str(), flags);
      if (fd < 0) return errno;
      ::close(fd);
      return 0;
    });
  };
  EXPECT_EQ(open_as_other(secret, O_RDONLY), EACCES);
  EXPECT_EQ(open_as_other(secret, O_WRONLY), EACCES);
  EXPECT_EQ(open_as_other(shared, O_RDONLY), 0);
  EXPECT_EQ(open_as_other(shared, O_WRONLY), EACCES);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::chmod(secret.c_str(), 0666)); }), EPERM);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::truncate(secret.c_str(), 0)); }), EACCES);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::unlink(secret.c_str())); }), EACCES);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::rename(secret.c_str(), (draft / "mine").c_str())); }),
            EACCES);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::mkdir((draft / "d").c_str(), 0777)); }), EACCES);
  EXPECT_EQ(AsUser(other, other_gid, [&] { return Errno(::mkdir(m.Dir("m/x@v9").c_str(), 0777)); }), EACCES);
  // Nothing changed; the owner still reads it, and a published version is anyone's to read.
  EXPECT_EQ(SlurpText(secret), "top secret");
  EXPECT_EQ(open_as_other(m.Dir("m/x@v0") / "config.json", O_RDONLY), 0);
  // A file the other user may not read stays unreadable after a remount (the journal keeps
  // owners and modes).
  ASSERT_EQ(m.Unmount("--keep-drafts").exit_code, 0);
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  EXPECT_EQ(open_as_other(secret, O_RDONLY), EACCES);
  EXPECT_EQ(open_as_other(shared, O_RDONLY), 0);
}

TEST_F(DraftSafetyTest, NamesLongerThanNameMaxAreRefusedWhereTheyEnter) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const std::string longest(255, 'a'), too_long(256, 'b');
  EXPECT_EQ(WriteWhole(draft / longest, {1}), 0);
  EXPECT_EQ(Slurp(draft / longest), std::vector<uint8_t>{1});
  EXPECT_EQ(WriteWhole(draft / too_long, {1}), ENAMETOOLONG);
  EXPECT_EQ(Errno(::mkdir((draft / too_long).c_str(), 0755)), ENAMETOOLONG);
  EXPECT_EQ(Errno(::rename((draft / longest).c_str(), (draft / too_long).c_str())), ENAMETOOLONG);
  EXPECT_EQ(Errno(::mkdir(m.Dir("m/" + too_long).c_str(), 0755)), ENAMETOOLONG);
  struct stat st {};
  EXPECT_EQ(Errno(::stat((draft / too_long).c_str(), &st)), ENAMETOOLONG);
}

// chmod, chown and utimensat (atime and mtime) apply to a draft's directories and files, and a
// remount (the journal) keeps them.
TEST_F(DraftSafetyTest, ModesOwnersAndTimesOfDraftNodesApplyAndSurviveARemount) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0750)), 0) << std::strerror(errno);
  ASSERT_EQ(Errno(::mkdir((draft / "sub").c_str(), 0700)), 0);
  ASSERT_EQ(WriteWhole(draft / "sub" / "f.bin", {1, 2, 3}), 0);
  const timespec dir_times[2] = {{1000, 1}, {2000, 2}};
  const timespec file_times[2] = {{3000, 3}, {4000, 4}};
  auto check = [&](const char* when) {
    SCOPED_TRACE(when);
    struct stat st {};
    ASSERT_EQ(::stat(draft.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0711u);
    ASSERT_EQ(::stat((draft / "sub").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0751u);
    EXPECT_EQ(st.st_uid, 123u);
    EXPECT_EQ(st.st_gid, 456u);
    EXPECT_EQ(st.st_atim.tv_sec, 1000);
    EXPECT_EQ(st.st_atim.tv_nsec, 1);
    EXPECT_EQ(st.st_mtim.tv_sec, 2000);
    EXPECT_EQ(st.st_mtim.tv_nsec, 2);
    ASSERT_EQ(::stat((draft / "sub" / "f.bin").c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 07777, 0604u);
    EXPECT_EQ(st.st_atim.tv_sec, 3000);
    EXPECT_EQ(st.st_mtim.tv_sec, 4000);
    EXPECT_EQ(st.st_mtim.tv_nsec, 4);
  };
  ASSERT_EQ(Errno(::chmod(draft.c_str(), 0711)), 0);
  ASSERT_EQ(Errno(::chmod((draft / "sub").c_str(), 0751)), 0);
  ASSERT_EQ(Errno(::utimensat(AT_FDCWD, (draft / "sub").c_str(), dir_times, 0)), 0);
  ASSERT_EQ(Errno(::chmod((draft / "sub" / "f.bin").c_str(), 0604)), 0);
  ASSERT_EQ(Errno(::utimensat(AT_FDCWD, (draft / "sub" / "f.bin").c_str(), file_times, 0)), 0);
  ASSERT_EQ(Errno(::chown((draft / "sub").c_str(), 123, 456)), 0);
  check("applied");
  // A directory above the versions is the mount's: refused, not silently ignored.
  EXPECT_EQ(Errno(::chmod(m.Dir("m").c_str(), 0700)), EROFS);
  ASSERT_EQ(m.Unmount("--keep-drafts").exit_code, 0);
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  check("after a remount");
}

// A file unlinked while open keeps its bytes for the open descriptor; a new file under the
// same name is another file (another inode number), whatever the old descriptor does.
// A write-only save (cp, torch.save) writes around the kernel's page cache (direct_io). Readers
// of the same file never see a stale page for it: one opened while the writer writes reads
// what it wrote, also in the page it already read (the page at the end of the file, written
// on); one opened before the writer keeps the writer on the page cache, which stays coherent.
// (The kernel of the test machine (6.18) also drops cached pages a direct write covers; the
// mount's rule, every handle direct while a direct writer is open, does not depend on it.)
TEST_F(DraftSafetyTest, ReadersOfAFileBeingSavedReadWhatItsWriterWrote) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const std::vector<uint8_t> a = RandomBytes(6000, 1), b = RandomBytes(3000, 2), c = RandomBytes(2000, 3);
  auto read_all = [](int fd, size_t size) {
    std::vector<uint8_t> got(size + 100);
    const ssize_t n = ::pread(fd, got.data(), got.size(), 0);
    got.resize(n > 0 ? static_cast<size_t>(n) : 0);
    return got;
  };
  auto concat = [](std::vector<uint8_t> x, const std::vector<uint8_t>& y) {
    x.insert(x.end(), y.begin(), y.end());
    return x;
  };
  {
    SCOPED_TRACE("reader opened while the writer writes");
    const fs::path p = draft / "saved.bin";
    const int w = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(w, 0) << std::strerror(errno);
    ASSERT_EQ(::write(w, a.data(), a.size()), static_cast<ssize_t>(a.size()));
    const int r = ::open(p.c_str(), O_RDONLY);
    ASSERT_GE(r, 0) << std::strerror(errno);
    EXPECT_EQ(read_all(r, a.size()), a);
    ASSERT_EQ(::write(w, b.data(), b.size()), static_cast<ssize_t>(b.size()));  // on into the page read
    EXPECT_EQ(read_all(r, a.size() + b.size()), concat(a, b));
    ASSERT_EQ(::pwrite(w, c.data(), c.size(), 100), static_cast<ssize_t>(c.size()));  // over bytes read
    std::vector<uint8_t> expect = concat(a, b);
    std::copy(c.begin(), c.end(), expect.begin() + 100);
    EXPECT_EQ(read_all(r, expect.size()), expect);
    ::close(w);
    EXPECT_EQ(read_all(r, expect.size()), expect);
    ::close(r);
    EXPECT_EQ(Slurp(p), expect);
  }
  {
    SCOPED_TRACE("reader opened before the writer");
    const fs::path p = draft / "edited.bin";
    ASSERT_EQ(WriteWhole(p, a), 0);
    const int r = ::open(p.c_str(), O_RDONLY);
    ASSERT_GE(r, 0) << std::strerror(errno);
    EXPECT_EQ(read_all(r, a.size()), a);  // its pages cached
    const int w = ::open(p.c_str(), O_WRONLY);
    ASSERT_GE(w, 0) << std::strerror(errno);
    ASSERT_EQ(::pwrite(w, c.data(), c.size(), 1000), static_cast<ssize_t>(c.size()));
    std::vector<uint8_t> expect = a;
    std::copy(c.begin(), c.end(), expect.begin() + 1000);
    EXPECT_EQ(read_all(r, expect.size()), expect);
    ::close(w);
    ::close(r);
  }
  Result commit = m.Commit("m/x@v1");
  ASSERT_EQ(commit.exit_code, 0) << commit.out << m.Describe();
}

TEST_F(DraftSafetyTest, AFileUnlinkedWhileOpenAndMadeAgainIsAnotherFile) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path draft = m.Dir("m/x@v1");
  ASSERT_EQ(Errno(::mkdir(draft.c_str(), 0755)), 0) << std::strerror(errno);
  const fs::path p = draft / "f.bin";
  const std::vector<uint8_t> old_bytes = RandomBytes(100000, 1), new_bytes = RandomBytes(5000, 2);
  ASSERT_EQ(WriteWhole(p, old_bytes), 0);
  int fd = ::open(p.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  struct stat before {};
  ASSERT_EQ(::fstat(fd, &before), 0);
  ASSERT_EQ(Errno(::unlink(p.c_str())), 0);
  ASSERT_EQ(WriteWhole(p, new_bytes), 0);
  struct stat now {};
  ASSERT_EQ(::stat(p.c_str(), &now), 0);
  EXPECT_NE(now.st_ino, before.st_ino);
  EXPECT_EQ(now.st_size, 5000);
  std::vector<uint8_t> got(old_bytes.size());
  EXPECT_EQ(::pread(fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
  EXPECT_EQ(got, old_bytes);
  EXPECT_EQ(::pwrite(fd, "x", 1, 0), 1);  // to the unlinked file, not the new one
  struct stat orphan {};
  EXPECT_EQ(::fstat(fd, &orphan), 0);
  EXPECT_EQ(orphan.st_size, 100000);
  ::close(fd);
  EXPECT_EQ(Slurp(p), new_bytes);
  Result c = m.Commit("m/x@v1");
  ASSERT_EQ(c.exit_code, 0) << c.out << m.Describe();
  EXPECT_EQ(Slurp(p), new_bytes);
}

// A draft that inherits its parent's files can be abandoned: `weightfs discard`, or `rm -r`.
TEST_F(DraftSafetyTest, ADraftThatInheritsFilesCanBeDiscardedOrRemoved) {
  Generate("2M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& m = NewMount("a");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path d1 = m.Dir("m/x@v1"), d2 = m.Dir("m/x@v2");
  ASSERT_EQ(Errno(::mkdir(d1.c_str(), 0755)), 0);
  ASSERT_EQ(Errno(::mkdir(d2.c_str(), 0755)), 0);
  ASSERT_EQ(WriteWhole(d1 / "new.bin", RandomBytes(1 << 20, 3)), 0);
  ASSERT_FALSE(FilesUnder(d1).empty());
  Result discard = Cli("discard " + d1.string());
  EXPECT_EQ(discard.exit_code, 0) << discard.out << m.Describe();
  EXPECT_FALSE(fs::exists(d1));
  EXPECT_TRUE(m.DraftStatus("m/x@v1").is_null());
  Result again = Cli("discard " + m.Dir("m/x@v0").string());
  EXPECT_NE(again.exit_code, 0);
  EXPECT_NE(again.out.find("not a draft"), std::string::npos) << again.out;
  // rm -r: every inherited file unlinked, then the directory.
  Result rm = Shell("rm -r " + d2.string());
  EXPECT_EQ(rm.exit_code, 0) << rm.out;
  EXPECT_FALSE(fs::exists(d2));
  EXPECT_TRUE(m.DraftStatus("m/x@v2").is_null());
  // Nothing was published, the name is free again, and unmounting publishes nothing.
  ASSERT_EQ(Errno(::mkdir(d1.c_str(), 0755)), 0);
  ASSERT_EQ(Errno(::rmdir(d1.c_str())), ENOTEMPTY);  // it inherits v0's files
  EXPECT_EQ(Cli("discard " + d1.string()).exit_code, 0);
  ASSERT_EQ(m.Unmount().exit_code, 0);
  EXPECT_EQ(Versions().size(), 1u);
  // Its staging directories are gone from the cache directory.
  size_t draft_dirs = 0;
  for (const auto& e : fs::recursive_directory_iterator(m.cache())) {
    if (e.path().filename() == "journal.json") draft_dirs++;
  }
  EXPECT_EQ(draft_dirs, 0u);
}

}  // namespace
}  // namespace weightfs
