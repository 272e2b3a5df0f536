#include "fs/mount_point.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

extern char** environ;

namespace weightfs {
namespace {

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size()) {
      int v = 0;
      bool octal = true;
      for (size_t k = 1; k <= 3; ++k) {
        if (s[i + k] < '0' || s[i + k] > '7') {
          octal = false;
          break;
        }
        v = v * 8 + (s[i + k] - '0');
      }
      if (octal) {
        out.push_back(static_cast<char>(v));
        i += 3;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

// Runs argv (argv[0] looked up in PATH), returns its exit status and its stderr+stdout.
int RunCommand(const std::vector<std::string>& args, std::string* output) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  int rc = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    *output = args[0] + ": " + std::strerror(rc);
    return -1;
  }
  char buf[512];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0 && output->size() < 4096) output->append(buf, static_cast<size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  while (!output->empty() && (output->back() == '\n' || output->back() == ' ')) output->pop_back();
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

std::string AbsolutePath(const std::string& path) {
  std::filesystem::path p(path);
  if (p.is_relative()) {
    std::error_code ec;
    p = std::filesystem::current_path(ec) / p;
  }
  std::string s = p.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::optional<MountEntry> FindMount(const std::string& path) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  std::optional<MountEntry> found;
  // Fields: id parent major:minor root mountpoint options [optional...] - fstype source super
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, mountpoint;
    if (!(fields >> id >> parent >> device >> root >> mountpoint)) continue;
    if (Unescape(mountpoint) != path) continue;
    std::string token;
    while (fields >> token && token != "-") {
    }
    MountEntry e;
    e.device = device;
    fields >> e.fstype >> e.source;
    e.source = Unescape(e.source);
    found = e;  // the last one is the top of a stack of mounts
  }
  return found;
}

MountProbe ProbeMountPoint(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOTCONN || err == ECONNABORTED) {
      return {MountPointState::kStale, path + " is a mount whose daemon is gone (" + std::strerror(err) + ")"};
    }
    if (err == ENOENT) {
      return {MountPointState::kMissing, "mount point " + path + " does not exist (mkdir -p " + path + ")"};
    }
    return {MountPointState::kError, "mount point " + path + ": " + std::strerror(err)};
  }
  if (!S_ISDIR(st.st_mode)) {
    return {MountPointState::kNotDirectory, "mount point " + path + " is not a directory"};
  }
  if (std::optional<MountEntry> m = FindMount(path)) {
    // The kernel may answer stat() from its attribute cache after the daemon died; statfs()
    // always asks the daemon.
    struct statfs sfs;
    if (m->fstype.starts_with("fuse") && ::statfs(path.c_str(), &sfs) != 0 &&
        (errno == ENOTCONN || errno == ECONNABORTED)) {
      return {MountPointState::kStale, path + " is a mount whose daemon is gone (" + std::strerror(errno) + ")"};
    }
    return {MountPointState::kBusy, "mount point " + path + " is busy: " + m->fstype + " (" + m->source +
                                        ") is mounted there; unmount it first (weightfs unmount " + path + ")"};
  }
  return {MountPointState::kReady, ""};
}

Status Unmount(const std::string& path, bool lazy) {
  if (::geteuid() == 0) {
    if (::umount2(path.c_str(), lazy ? MNT_DETACH : 0) == 0) return Status::Ok();
    int err = errno;
    if (err == EBUSY) {
      return Status::Conflict(path + " is busy: files on it are open or a process has its working "
                              "directory there (close them, or unmount lazily with --lazy)");
    }
    if (err == EINVAL) return Status::InvalidArgument(path + " is not a mount point");
    return StatusOfErrno(err, "unmounting " + path);
  }
  std::vector<std::string> args = {"fusermount3", "-u"};
  if (lazy) args.push_back("-z");
  args.push_back(path);
  std::string output;
  int rc = RunCommand(args, &output);
  if (rc == 0) return Status::Ok();
  if (output.find("busy") != std::string::npos) {
    return Status::Conflict(path + " is busy: files on it are open (close them, or unmount lazily "
                            "with --lazy)");
  }
  if (output.find("not mounted") != std::string::npos || output.find("not found in") != std::string::npos) {
    return Status::InvalidArgument(path + " is not a mount point");
  }
  return Status::IOError("unmounting " + path + ": " + (output.empty() ? "fusermount3 failed" : output));
}

Status CheckFuseDevice() {
  int fd = ::open("/dev/fuse", O_RDWR | O_CLOEXEC);
  if (fd >= 0) {
    ::close(fd);
    return Status::Ok();
  }
  int err = errno;
  if (err == ENOENT) {
    return Status::Unsupported(
        "no /dev/fuse: this machine cannot mount FUSE file systems (load the module with "
        "`modprobe fuse`; in a container, run it with --device /dev/fuse --cap-add SYS_ADMIN)");
  }
  return Status::IOError(std::string("cannot open /dev/fuse: ") + std::strerror(err) +
                         " (is the fuse3 package installed and are you allowed to use FUSE?)");
}

}  // namespace weightfs
