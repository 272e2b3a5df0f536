// weightfs wait: block until a version is published (by this node or any other) and visible in
// a mount: what an inference node runs between RL steps.
//
// It asks the mount, never the bucket: a lookup of MODEL@VERSION that the mount's listing does
// not have makes the daemon check the bucket for that version (fs/namespace.h, Probe), and a
// version directory's user.weightfs.newest attribute re-lists its model's versions. The daemon
// bounds both by its --probe-rate for the whole mount, however many waiters poll.
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "fs/mount_point.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace weightfs::cli {
namespace {

constexpr const char* kWaitHelp = R"(usage: weightfs wait MOUNTPOINT/MODEL@VERSION [--timeout S] [--interval S]
       weightfs wait MOUNTPOINT/MODEL@latest --newer-than VERSION [--timeout S] [--interval S]

Waits until a version is published - on this node or any other writing to the bucket - and
visible in the mount, then prints its path. The first form waits for MODEL@VERSION itself; the
second for any version of MODEL newer (by creation time) than VERSION, and prints the newest.

Each check asks the mount: a lookup of MODEL@VERSION that is not listed yet makes the mount
check the bucket for it (one small request), and --newer-than re-lists MODEL's versions (one
listing). The mount answers at most its --probe-rate checks a second (default 20) for all
waiters together; a version appears within about --interval plus one request after it is
published.

exit status: 0 published (the path is printed), 1 an error, 2 a usage error, 124 timed out.

options:
  --timeout S      give up after S seconds                                 [forever]
  --interval S     seconds between checks                                      [0.1]
  --newer-than V   wait for a version newer than V (with MODEL@latest)
  --create-ok      wait for the first version of a model the mount does not have
                   yet (without it, a model that is not there is an error at once:
                   most often a typo, which would wait forever)
  -h, --help       show this help
)";

constexpr int kTimedOut = 124;

int Usage(const std::string& message) {
  std::fprintf(stderr, "weightfs: wait: %s (see --help)\n", message.c_str());
  return 2;
}

// The models of the mount directory `dir` (names before '@' of its entries), or nullopt if
// `dir` cannot be read (it is not there: no model of that organisation).
std::optional<std::vector<std::string>> ModelsIn(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> models;
  for (auto it = std::filesystem::directory_iterator(dir, ec); !ec && it != std::filesystem::directory_iterator();
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const size_t at = name.find('@');
    if (at != std::string::npos && at > 0) models.push_back(name.substr(0, at));
  }
  if (ec) return std::nullopt;
  std::sort(models.begin(), models.end());
  models.erase(std::unique(models.begin(), models.end()), models.end());
  return models;
}

// Creation time of a version directory (its mtime), in ns.
std::optional<int64_t> CreatedNs(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

int WaitMain(int argc, char** argv) {
  ArgParser args({"--timeout", "--interval", "--newer-than"}, {"--help", "-h", "--create-ok"});
  if (auto rc = ParseArgs(args, argc, argv, kWaitHelp, 1)) return *rc;
  std::string path = AbsolutePath(args.positionals()[0]);
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  double timeout = -1, interval = 0.1;
  if (auto v = args.Get("--timeout")) {
    Expected<double> d = ParseDouble(*v);
    if (!d.ok() || *d < 0) return Usage("--timeout expects seconds");
    timeout = *d;
  }
  if (auto v = args.Get("--interval")) {
    Expected<double> d = ParseDouble(*v);
    if (!d.ok() || *d < 0.001 || *d > 3600) return Usage("--interval expects 0.001..3600 seconds");
    interval = *d;
  }
  const size_t slash = path.rfind('/');
  const std::string dir = path.substr(0, slash), name = path.substr(slash + 1);
  const size_t at = name.find('@');
  if (at == std::string::npos || at == 0 || at + 1 == name.size()) {
    return Usage(path + " is not MOUNTPOINT/MODEL@VERSION");
  }
  const std::optional<std::string> newer_than = args.Get("--newer-than");
  if (newer_than && name.substr(at + 1) != "latest") return Usage("--newer-than takes MOUNTPOINT/MODEL@latest");
  // Only a weightfs mount answers lookups of unlisted versions: anything else would be waited
  // on forever.
  // (From the nearest directory that exists: an organisation the mount lacks is a typo to
  // report, not "not a mount".)
  std::string existing = dir;
  while (::access(existing.c_str(), F_OK) != 0 && existing.rfind('/') != std::string::npos && existing.size() > 1) {
    existing = existing.substr(0, std::max<size_t>(1, existing.rfind('/')));
  }
  const std::string root = MountRootOf(existing);
  char pid[32];
  if (::getxattr(root.c_str(), "user.weightfs.pid", pid, sizeof pid) <= 0) {
    return Fail(dir + " is not in a weightfs mount (weightfs mount BUCKET MOUNTPOINT)");
  }
  const std::string leaf = name.substr(0, at);
  const auto start = std::chrono::steady_clock::now();
  bool warned = false;
  bool model_checked = args.Has("--create-ok");
  for (;;) {
    std::optional<std::string> found;
    int err = 0;
    if (!newer_than) {
      struct stat st {};
      if (::stat(path.c_str(), &st) == 0) {
        found = path;
      } else {
        err = errno;
      }
    } else {
      // Asked of MODEL@V (user.* attributes exist on directories, not on the @latest link).
      char buf[512];
      const std::string old_dir = dir + "/" + leaf + "@" + *newer_than;
      const ssize_t n = ::getxattr(old_dir.c_str(), "user.weightfs.newest", buf, sizeof buf - 1);
      if (n > 0) {
        const std::string newest(buf, static_cast<size_t>(n));
        if (newest != *newer_than) {
          const std::optional<int64_t> t_new = CreatedNs(dir + "/" + leaf + "@" + newest);
          const std::optional<int64_t> t_old = CreatedNs(old_dir);
          if (!t_old) return Fail(leaf + "@" + *newer_than + " is not a version in " + dir);
          if (t_new && std::make_pair(*t_new, newest) > std::make_pair(*t_old, *newer_than)) {
            found = dir + "/" + leaf + "@" + newest;
          }
        }
      } else if (n < 0) {
        err = errno;
        if (err == ENOENT) return Fail(leaf + "@" + *newer_than + " is not a version in " + dir);
      }
    }
    if (found) {
      std::printf("%s\n", found->c_str());
      return 0;
    }
    if (!model_checked && (err == 0 || err == ENOENT)) {
      // Once: is the model there at all? (The lookup above asked the bucket for the version
      // itself; a model the mount has no version of is most often a typo.)
      model_checked = true;
      const std::optional<std::vector<std::string>> models = ModelsIn(dir);
      if (!models || !std::binary_search(models->begin(), models->end(), leaf)) {
        struct stat st {};
        if (!newer_than && ::stat(path.c_str(), &st) == 0) {  // published meanwhile
          std::printf("%s\n", path.c_str());
          return 0;
        }
        const std::string prefix = dir.size() > root.size() ? dir.substr(root.size() + 1) + "/" : "";
        const std::string model = prefix + leaf;
        std::vector<std::string> alike;
        if (models) {
          std::vector<std::string> full;
          for (const std::string& m : *models) full.push_back(prefix + m);
          alike = LookAlike(model, full);
        }
        return Fail("no model " + model + " in the mount " + root +
                    (alike.empty() ? "" : " (did you mean " + OrList(alike) + "?)") +
                    "; to wait for the first version of a new model, give --create-ok");
      }
    }
    if (err != 0 && err != ENOENT) {
      // A bucket that fails (EIO, a timeout) may come back: say so once and keep waiting.
      if (err != EIO && err != ETIMEDOUT && err != EAGAIN) return Fail(path + ": " + std::strerror(err));
      if (!warned) {
        std::fprintf(stderr, "weightfs: wait: %s: %s (the bucket fails; still waiting, see the mount's log)\n",
                     path.c_str(), std::strerror(err));
        warned = true;
      }
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout >= 0 && waited >= timeout) {
      std::fprintf(stderr, "weightfs: wait: %s %s not published after %.1f s\n", path.c_str(),
                   newer_than ? ("newer than " + *newer_than).c_str() : "", waited);
      return kTimedOut;
    }
    double nap = interval;
    if (timeout >= 0) nap = std::min(nap, timeout - waited);
    std::this_thread::sleep_for(std::chrono::duration<double>(std::max(nap, 0.0)));
  }
}

}  // namespace weightfs::cli
