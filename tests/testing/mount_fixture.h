// Real mounts of the weightfs binary for the tests that drive it, header-only:
//
//   Shell / Cli / CliJson   a shell command, the weightfs binary (bounded by timeout(1): a hung
//                           command fails the test instead of leaving it and its mounts behind)
//   WaitFor                 polls a condition until it holds or a deadline passes
//   ProcessGone             a pid that no longer runs (gone, or a zombie nobody reaped yet)
//   GetXattr                an extended attribute's value, or nullopt with errno
//   MountedAt               whether a path is a mount point in this process's mount table
//   UnmountIfMounted        the teardown of a mount made otherwise (bounded unmount, else lazy)
//   Mount                   one `weightfs mount BUCKET MNT` with its own cache directory and
//                           log; Start() returns once the mount is live (the command returns
//                           once the daemon serves it) and reads the daemon's pid from the
//                           mount's user.weightfs.pid; torn down when it goes out of scope,
//                           even when the test failed: `weightfs unmount --keep-drafts` (bounded),
//                           else a lazy umount, then the daemon is waited for and killed if it
//                           lingers.
//
// The binary is WEIGHTFS_BINARY, which every suite that runs it gets as a compile definition.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/testing/command_runner.h"
#include "tests/testing/test_servers.h"

#ifndef WEIGHTFS_BINARY
#error "tests/testing/mount_fixture.h runs the weightfs binary: define WEIGHTFS_BINARY (tests/CMakeLists.txt)"
#endif

namespace weightfs::test {

// ---- running things --------------------------------------------------------------------------

// stdout and stderr of a shell command.
inline CommandResult Shell(const std::string& command) { return RunShell(command + " 2>&1"); }

// `weightfs ARGS` (stdout and stderr), killed after `seconds`; `env` prefixes the command (e.g.
// "env HF_TOKEN=x ").
inline CommandResult Cli(const std::string& args, int seconds = 120, const std::string& env = "") {
  return Shell(env + "timeout -k 5 " + std::to_string(seconds) + " " + std::string(WEIGHTFS_BINARY) + " " + args);
}

// stdout only, parsed as JSON (null if it is not JSON).
inline nlohmann::json CliJson(const std::string& args, const std::string& env = "") {
  CommandResult r = RunShell(env + "timeout -k 5 60 " + std::string(WEIGHTFS_BINARY) + " " + args + " 2>/dev/null");
  return nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
}

// Polls `done` every few ms until it holds (true) or `bound` passes (false).
inline bool WaitFor(const std::function<bool()>& done, std::chrono::milliseconds bound) {
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

inline bool ProcessGone(pid_t pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  const std::string stat = SlurpText("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
}

// The value of an extended attribute, or nullopt (errno in *err; 0 when it was read).
inline std::optional<std::string> GetXattr(const std::filesystem::path& p, const char* name, int* err = nullptr) {
  int dummy;
  if (!err) err = &dummy;
  *err = 0;
  for (int attempt = 0; attempt < 4; ++attempt) {
    const ssize_t size = ::getxattr(p.c_str(), name, nullptr, 0);
    if (size < 0) break;
    std::string v(static_cast<size_t>(size), '\0');
    const ssize_t n = ::getxattr(p.c_str(), name, v.data(), v.size());
    if (n < 0 && errno == ERANGE) continue;  // it grew in between
    if (n < 0) break;
    v.resize(static_cast<size_t>(n));
    return v;
  }
  *err = errno;
  return std::nullopt;
}

// Whether `path` (absolute, as mounted) is a mount point in /proc/self/mountinfo (whose paths
// escape space, tab, newline and backslash as \ooo).
inline bool MountedAt(const std::string& path) {
  std::istringstream table(SlurpText("/proc/self/mountinfo"));
  std::string line;
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, mount_point;
    if (!(fields >> id >> parent >> device >> root >> mount_point)) continue;
    std::string unescaped;
    for (size_t i = 0; i < mount_point.size(); ++i) {
      if (mount_point[i] == '\\' && i + 3 < mount_point.size()) {
        unescaped += static_cast<char>(std::strtol(mount_point.substr(i + 1, 3).c_str(), nullptr, 8));
        i += 3;
      } else {
        unescaped += mount_point[i];
      }
    }
    if (unescaped == path) return true;
  }
  return false;
}

// If `mnt` is a mount point: a bounded `weightfs unmount --keep-drafts` (drafts are not
// published), else a lazy umount. For tests that mount by other means than Mount.
inline void UnmountIfMounted(const std::string& mnt, const std::string& env = "") {
  if (!MountedAt(mnt)) return;
  Cli("unmount --keep-drafts " + mnt, 60, env);
  if (MountedAt(mnt)) Shell("umount -l " + mnt);
}

// ---- a mount ---------------------------------------------------------------------------------

struct MountOptions {
  std::string extra;        // more `weightfs mount` options
  int refresh_seconds = 1;  // --refresh N (0: the product's default)
  std::string env;          // prefix of every weightfs command of this mount ("env A=B ")
};

class Mount {
 public:
  using Options = MountOptions;

  // A mount of `bucket` at `mnt` (created) with cache directory `cache` and debug log `log`.
  Mount(std::string bucket, std::filesystem::path mnt, std::filesystem::path cache, std::filesystem::path log,
        Options options)
      : bucket_(std::move(bucket)), mnt_(std::move(mnt)), cache_(std::move(cache)), log_(std::move(log)),
        options_(std::move(options)) {
    std::filesystem::create_directories(mnt_);
  }
  Mount(std::string bucket, std::filesystem::path mnt, std::filesystem::path cache, std::filesystem::path log,
        std::string extra = "")
      : Mount(std::move(bucket), std::move(mnt), std::move(cache), std::move(log), WithExtra(std::move(extra))) {}
  // Everything under `dir`: dir/mnt, dir/cache, dir/log.txt.
  Mount(std::string bucket, const std::filesystem::path& dir, Options options = {})
      : Mount(std::move(bucket), dir / "mnt", dir / "cache", dir / "log.txt", std::move(options)) {}
  virtual ~Mount() { Teardown(); }
  Mount(const Mount&) = delete;
  Mount& operator=(const Mount&) = delete;

  // Mounts (again: a mount point left stale by a killed daemon is detached by the command) and
  // returns once `weightfs mount` has returned, with the mount live if it succeeded.
  const CommandResult& Start() {
    pid_ = 0;
    std::string args = "mount " + bucket_ + " " + mnt_.string() + " --cache-dir " + cache_.string() + " --log-file " +
                       log_.string() + " --log-level debug ";
    if (options_.refresh_seconds > 0) args += "--refresh " + std::to_string(options_.refresh_seconds) + " ";
    result_ = Cli(args + options_.extra, 120, options_.env);
    if (result_.exit_code == 0) {
      if (auto pid = GetXattr(mnt_, "user.weightfs.pid")) pid_ = std::atoi(pid->c_str());
    }
    return result_;
  }
  bool ok() const { return result_.exit_code == 0 && pid_ > 0; }
  const CommandResult& result() const { return result_; }
  // The mount command's output and the log's tail, for failure messages.
  std::string Describe() const { return result_.out + "\nlog:\n" + TailOfFile(log_.string(), 30); }

  // `weightfs unmount [flags] MNT`; once it succeeded, waits (bounded) for the daemon to exit.
  CommandResult Unmount(const std::string& flags = "") {
    CommandResult r = Cli("unmount " + flags + " " + mnt_.string(), 120, options_.env);
    if (r.exit_code == 0 && pid_ > 0) WaitFor([&] { return ProcessGone(pid_); }, std::chrono::seconds(20));
    return r;
  }

  // SIGKILL to the daemon; returns once it is gone.
  bool Kill() {
    if (pid_ <= 0 || ::kill(pid_, SIGKILL) != 0) return false;
    const bool gone = WaitFor([&] { return ProcessGone(pid_); }, std::chrono::seconds(10));
    pid_ = 0;
    return gone;
  }

  // Unmounts if still mounted (keeping drafts unpublished), lazily if the command fails or
  // hangs, then waits for the daemon and kills it if it lingers; removes the directory given
  // to RemoveAtTeardown. Called by the destructor; harmless twice.
  void Teardown() {
    UnmountIfMounted(mnt_.string(), options_.env);
    if (pid_ > 0) {
      if (!WaitFor([&] { return ProcessGone(pid_); }, std::chrono::seconds(20))) {
        ::kill(pid_, SIGKILL);
        WaitFor([&] { return ProcessGone(pid_); }, std::chrono::seconds(10));
      }
      pid_ = 0;
    }
    if (!remove_at_teardown_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(remove_at_teardown_, ec);
      remove_at_teardown_.clear();
    }
  }
  // A directory (holding the mount point) to remove once the mount is gone.
  void RemoveAtTeardown(std::filesystem::path dir) { remove_at_teardown_ = std::move(dir); }

  const std::string& bucket() const { return bucket_; }
  const std::filesystem::path& mnt() const { return mnt_; }
  const std::filesystem::path& cache() const { return cache_; }
  const std::filesystem::path& log() const { return log_; }
  pid_t pid() const { return pid_; }
  std::string LogText() const { return SlurpText(log_); }
  std::filesystem::path Dir(const std::string& model_at_version) const { return mnt_ / model_at_version; }

  // `weightfs status MNT --json`.
  nlohmann::json Status() const { return CliJson("status " + mnt_.string() + " --json", options_.env); }
  // The status entry of one draft (null if it is not listed).
  nlohmann::json DraftStatus(const std::string& name) const {
    nlohmann::json st = Status();
    if (st.is_object() && st["drafts"].is_array()) {
      for (const nlohmann::json& d : st["drafts"]) {
        if (d.value("name", "") == name) return d;
      }
    }
    return nlohmann::json();
  }
  // `weightfs commit MNT/DRAFT [flags]`.
  CommandResult Commit(const std::string& draft, const std::string& flags = "") {
    return Cli("commit " + (mnt_ / draft).string() + " " + flags, 120, options_.env);
  }
  // The mount's user.weightfs.stats (null if it cannot be read).
  nlohmann::json Stats() const {
    auto s = GetXattr(mnt_, "user.weightfs.stats");
    return s ? nlohmann::json::parse(*s, nullptr, false) : nlohmann::json();
  }
  // stats.bucket.bytes_received (0 if absent).
  uint64_t BytesReceived() const {
    nlohmann::json s = Stats();
    return s.is_object() && s.contains("bucket") ? s["bucket"].value("bytes_received", uint64_t{0}) : 0;
  }

 private:
  static Options WithExtra(std::string extra) {
    Options o;
    o.extra = std::move(extra);
    return o;
  }

  std::string bucket_;
  std::filesystem::path mnt_, cache_, log_;
  Options options_;
  CommandResult result_;
  pid_t pid_ = 0;
  std::filesystem::path remove_at_teardown_;
};

}  // namespace weightfs::test
