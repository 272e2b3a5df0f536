// Passthrough: files the kernel reads straight from a local file, not through the daemon (FUSE
// passthrough, Linux 6.9 and later).
//
// Why: a published file that the mount holds whole on local disk (hub/engine/chunk_cache.h,
// whole files) gains nothing from a round trip through the daemon, and loses a lot on the
// kernel's side: FUSE's page cache holds small folios, so a loader that maps a safetensors
// file and copies its tensors takes a TLB miss (a page walk, dear in a VM) per 4 KiB, where a
// local file's pages are mapped 2 MiB at a time (docs/mount.md, "Warm mmap"). With passthrough
// the kernel opens the FUSE file on the local one: reads, maps and the page cache are the
// local file's own, so a re-read or a map of a file read once runs as on the local disk.
//
// How, with Debian 12's libfuse 3.14, which predates passthrough (3.16 has it): libfuse lets a
// session do its own I/O on /dev/fuse (fuse_session_custom_io), and the protocol pieces are
// small. Install() takes over the session's reads and writes:
//   - the kernel's INIT says whether it offers passthrough (flags2 bit FUSE_PASSTHROUGH); the
//     INIT reply then takes it, with a stack depth of 1 (the backing files are on an ordinary
//     file system, not another stacked one);
//   - Acquire() registers a backing file with the kernel (ioctl FUSE_DEV_IOC_BACKING_OPEN,
//     which needs CAP_SYS_ADMIN: root mounts only) and returns its id;
//   - an open replied to inside a ReplyScope carries FOPEN_PASSTHROUGH and that id (the reply's
//     fuse_open_out has the field where libfuse 3.14 writes a zero padding);
//   - Release() closes the id (FUSE_DEV_IOC_BACKING_CLOSE) when the inode's last passthrough
//     open is released.
// Nothing else in the messages changes; without the kernel's offer, or without CAP_SYS_ADMIN,
// every open is an ordinary one and Acquire() says so.
//
// The kernel's rule, which Acquire() keeps: all open files of an inode use one mode. While an
// inode has a file open through the page cache (an ordinary open, or a map of one), an open in
// passthrough mode fails with EIO, and while it has one open in passthrough mode, so does an
// ordinary open, or one with another backing file. So every open of a file that could be
// passed through goes through Acquire and Release, which count the inode's opens of each mode
// (counted at the reply, uncounted at the release: the kernel drops its own count before it
// sends the release, so ours is never below the kernel's) and choose the mode the inode is
// in; a new mode only once the inode has no open file.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>

#include "core/mutex.h"
#include "core/status.h"
#include "core/thread_annotations.h"

struct fuse_session;

namespace weightfs {

struct PassthroughStats {
  std::atomic<uint64_t> opens{0};           // opens served by the kernel from a backing file
  std::atomic<uint64_t> daemon_opens{0};    // opens of files that could have been: through the daemon
  std::atomic<uint64_t> backing_files{0};   // backing ids registered (FUSE_DEV_IOC_BACKING_OPEN)
  std::atomic<uint64_t> busy{0};            // opens through the daemon because the inode had such an open
};

class Passthrough {
 public:
  Passthrough() = default;
  ~Passthrough();
  Passthrough(const Passthrough&) = delete;
  Passthrough& operator=(const Passthrough&) = delete;

  // Takes over the I/O of `session` (mounted, not yet serving): from now on INIT offers
  // passthrough when the kernel does. libfuse hands its I/O callbacks the session's userdata
  // (the server's), which `of_userdata` turns into this object. REQUIRES: called once per
  // session, with the same `of_userdata` for every session of the process; `this` outlives
  // the session.
  using OfUserdata = Passthrough* (*)(void* userdata);
  Status Install(fuse_session* session, OfUserdata of_userdata);

  // Whether opens can be passed through: the kernel took the offer at INIT, and registering a
  // backing file has not failed for want of privilege.
  bool enabled() const { return negotiated_.load() && !refused_.load(); }

  // For an open of `ino`, about to be replied to: the backing id to reply with (> 0), or 0 to
  // open it through the daemon (the open is counted as one). `backing` is called when the
  // inode has no open file and is to be passed through: it returns a read-only descriptor of
  // the local copy (which Acquire closes), or -1 if there is none. Every Acquire is matched by
  // one Release(ino, id) with what it returned, also when the reply fails.
  int Acquire(uint64_t ino, const std::function<int()>& backing) WFS_EXCLUDES(mu_);
  void Release(uint64_t ino, int backing_id) WFS_EXCLUDES(mu_);
  // Whether `ino` has an open file through the page cache (its kernel page cache is in use).
  bool HasDaemonOpens(uint64_t ino) const WFS_EXCLUDES(mu_);

  // An open replied to (fuse_reply_open) on this thread while one lives is passed through on
  // `backing_id`.
  class ReplyScope {
   public:
    explicit ReplyScope(int backing_id);
    ~ReplyScope();
    ReplyScope(const ReplyScope&) = delete;
    ReplyScope& operator=(const ReplyScope&) = delete;
  };

  const PassthroughStats& stats() const { return stats_; }

 private:
  struct Inode {
    uint32_t daemon = 0;       // open files through the page cache
    uint32_t passthrough = 0;  // open files on backing_id
    int backing_id = 0;
  };
  static ssize_t Read(int fd, void* buf, size_t len, void* self);
  static ssize_t Writev(int fd, struct iovec* iov, int count, void* self);
  void CloseBacking(int backing_id);

  int fd_ = -1;  // the session's /dev/fuse descriptor
  std::atomic<bool> offered_{false};     // the kernel's INIT offered passthrough
  std::atomic<bool> negotiated_{false};  // and the reply took it
  std::atomic<bool> refused_{false};     // registering a backing file failed for want of privilege
  std::atomic<uint64_t> init_unique_{0};
  mutable Mutex mu_;
  std::unordered_map<uint64_t, Inode> inodes_ WFS_GUARDED_BY(mu_);  // inodes with open files
  PassthroughStats stats_;
};

}  // namespace weightfs
