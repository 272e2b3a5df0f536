// Mount-point helpers for `weightfs mount` / `weightfs unmount`: what is (or was) mounted at a
// directory, recovering the mount a killed daemon left behind, unmounting.
//
// A FUSE daemon that dies without unmounting leaves its mount point answering every request
// with ENOTCONN ("Transport endpoint is not connected") or ECONNABORTED; ProbeMountPoint reports
// that as kStale
// and Unmount(lazy) clears it. Unmounting uses umount2(2) as root and `fusermount3 -u` for
// other users (the setuid helper that FUSE mounts of ordinary users go through).
//
// Functions are thread-safe; they run system calls and, for non-root users, fusermount3.
#pragma once

#include <optional>
#include <string>

#include "core/status.h"

namespace weightfs {

enum class MountPointState {
  kReady,         // an existing directory, nothing mounted on it
  kMissing,       // does not exist
  kNotDirectory,  // exists, not a directory
  kBusy,          // something is mounted there
  kStale,         // a FUSE mount whose daemon is gone (ENOTCONN)
  kError,         // another error (message says which)
};

struct MountProbe {
  MountPointState state = MountPointState::kError;
  std::string message;  // for anything but kReady: one line naming the path and the fix
};

// `path` should be absolute (see AbsolutePath).
MountProbe ProbeMountPoint(const std::string& path);

// The mount table's entry for a mount exactly at `path` (/proc/self/mountinfo).
struct MountEntry {
  std::string device;  // "major:minor" (names the mount's backing-dev-info in /sys/class/bdi)
  std::string fstype;  // "fuse.weightfs" for our mounts
  std::string source;  // fsname
};
std::optional<MountEntry> FindMount(const std::string& path);

// Unmounts `path`; `lazy` detaches it even while files are open (MNT_DETACH, fusermount3 -z).
// A mount with open files and !lazy fails with Conflict saying so.
Status Unmount(const std::string& path, bool lazy);

// OK if /dev/fuse can be opened for reading and writing (libfuse opens it before it falls back
// to fusermount3, so a user who cannot open it cannot mount); else a message with the fix.
Status CheckFuseDevice();

// `path` made absolute against the working directory and lexically normalized, without
// touching it (a stale mount point cannot be resolved with realpath).
std::string AbsolutePath(const std::string& path);

}  // namespace weightfs
