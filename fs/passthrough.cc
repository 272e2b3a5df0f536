#define FUSE_USE_VERSION 312

#include "fs/passthrough.h"

#include <fuse_lowlevel.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <spdlog/spdlog.h>

namespace weightfs {
namespace {

// The kernel's protocol (include/uapi/linux/fuse.h, 7.40), where libfuse 3.14's copy of it
// (7.38) lacks it. Only what passthrough needs, at the offsets both define.
constexpr uint32_t kOpInit = 26;                  // FUSE_INIT
constexpr uint32_t kInitExt = 1u << 30;           // FUSE_INIT_EXT: flags2 is meaningful
constexpr uint32_t kFlags2Passthrough = 1u << 5;  // FUSE_PASSTHROUGH (1ULL << 37) in flags2
constexpr uint32_t kOpenPassthrough = 1u << 7;    // FOPEN_PASSTHROUGH

struct InHeader {  // fuse_in_header
  uint32_t len, opcode;
  uint64_t unique, nodeid;
  uint32_t uid, gid, pid;
  uint16_t total_extlen, padding;
};
static_assert(sizeof(InHeader) == 40);
struct InitIn {  // the start of fuse_init_in
  uint32_t major, minor, max_readahead, flags, flags2;
};
struct OutHeader {  // fuse_out_header
  uint32_t len;
  int32_t error;
  uint64_t unique;
};
static_assert(sizeof(OutHeader) == 16);
struct InitOut {  // fuse_init_out, 7.40: max_stack_depth is the first of libfuse's unused[7]
  uint32_t major, minor, max_readahead, flags;
  uint16_t max_background, congestion_threshold;
  uint32_t max_write, time_gran;
  uint16_t max_pages, map_alignment;
  uint32_t flags2, max_stack_depth;
  uint32_t unused[6];
};
static_assert(sizeof(InitOut) == 64);
struct OpenOut {  // fuse_open_out: backing_id is libfuse 3.14's padding
  uint64_t fh;
  uint32_t open_flags;
  int32_t backing_id;
};
static_assert(sizeof(OpenOut) == 16);
struct BackingMap {  // fuse_backing_map
  int32_t fd;
  uint32_t flags;
  uint64_t padding;
};
#define WFS_FUSE_DEV_IOC_BACKING_OPEN _IOW(229, 1, BackingMap)
#define WFS_FUSE_DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

// The backing id the open replied to on this thread takes (ReplyScope), 0 for none.
thread_local int g_reply_backing = 0;

}  // namespace

Passthrough::ReplyScope::ReplyScope(int backing_id) { g_reply_backing = backing_id; }
Passthrough::ReplyScope::~ReplyScope() { g_reply_backing = 0; }

Passthrough::~Passthrough() {
  MutexLock lock(mu_);
  for (const auto& [ino, inode] : inodes_) {
    if (inode.backing_id > 0 && fd_ >= 0) {
      uint32_t id = static_cast<uint32_t>(inode.backing_id);
      (void)::ioctl(fd_, WFS_FUSE_DEV_IOC_BACKING_CLOSE, &id);
    }
  }
}

namespace {
std::atomic<Passthrough::OfUserdata> g_of_userdata{nullptr};
}  // namespace

Status Passthrough::Install(fuse_session* session, OfUserdata of_userdata) {
  g_of_userdata = of_userdata;
  fd_ = fuse_session_fd(session);
  fuse_custom_io io{};
  io.read = &Passthrough::Read;
  io.writev = &Passthrough::Writev;
  // (No splice hooks: libfuse then neither splices requests in nor replies out, as it did not
  // before; the mount asks for neither.)
  const int rc = fuse_session_custom_io(session, &io, fd_);
  if (rc != 0) return Status::IOError(std::string("cannot take over the FUSE session's I/O: ") + std::strerror(-rc));
  return Status::Ok();
}

ssize_t Passthrough::Read(int fd, void* buf, size_t len, void* userdata) {
  const ssize_t n = ::read(fd, buf, len);
  Passthrough* self = g_of_userdata.load()(userdata);
  if (self && n >= static_cast<ssize_t>(sizeof(InHeader) + sizeof(InitIn)) && !self->offered_.load()) {
    InHeader h;
    std::memcpy(&h, buf, sizeof h);
    if (h.opcode == kOpInit) {
      InitIn in;
      std::memcpy(&in, static_cast<const uint8_t*>(buf) + sizeof h, sizeof in);
      if ((in.flags & kInitExt) && (in.flags2 & kFlags2Passthrough)) {
        self->init_unique_ = h.unique;
        self->offered_ = true;
      } else {
        spdlog::info("passthrough: this kernel does not offer FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH); "
                     "every read goes through the daemon");
      }
    }
  }
  return n;
}

ssize_t Passthrough::Writev(int fd, struct iovec* iov, int count, void* userdata) {
  Passthrough* self = g_of_userdata.load()(userdata);
  if (self && count == 2 && iov[0].iov_len == sizeof(OutHeader)) {
    OutHeader h;
    std::memcpy(&h, iov[0].iov_base, sizeof h);
    if (g_reply_backing > 0 && h.error == 0 && iov[1].iov_len == sizeof(OpenOut)) {
      // An open (fuse_reply_open) in a ReplyScope: passed through.
      OpenOut* out = static_cast<OpenOut*>(iov[1].iov_base);
      out->open_flags |= kOpenPassthrough;
      out->backing_id = g_reply_backing;
    } else if (self->offered_.load() && !self->negotiated_.load() && h.unique == self->init_unique_.load() &&
               h.error == 0 && iov[1].iov_len >= sizeof(InitOut)) {
      InitOut* out = static_cast<InitOut*>(iov[1].iov_base);
      if (out->flags & kInitExt) {
        out->flags2 |= kFlags2Passthrough;
        out->max_stack_depth = 1;
        self->negotiated_ = true;
        spdlog::debug("passthrough: offered by the kernel and taken (stack depth 1)");
      }
    }
  }
  return ::writev(fd, iov, count);
}

int Passthrough::Acquire(uint64_t ino, const std::function<int()>& backing) {
  MutexLock lock(mu_);
  Inode& inode = inodes_[ino];
  if (inode.passthrough > 0) {
    ++inode.passthrough;
    stats_.opens++;
    return inode.backing_id;
  }
  if (inode.daemon > 0 || !enabled()) {
    if (inode.daemon > 0) stats_.busy++;
    ++inode.daemon;
    stats_.daemon_opens++;
    return 0;
  }
  // No open file: the mode is ours to choose. (Under the lock: a second open of the inode
  // meanwhile must see the choice. The work is an open(2) and an ioctl.)
  const int fd = backing();
  int id = -1;
  if (fd >= 0) {
    BackingMap map{fd, 0, 0};
    id = ::ioctl(fd_, WFS_FUSE_DEV_IOC_BACKING_OPEN, &map);
    const int err = errno;
    ::close(fd);
    if (id <= 0) {
      if (err == EPERM && !refused_.exchange(true)) {
        spdlog::info("passthrough: the kernel refused a backing file (it needs CAP_SYS_ADMIN: mount as root); files "
                     "read whole are served by the daemon");
      } else if (err != EPERM) {
        spdlog::warn("passthrough: the kernel refused a backing file for inode {}: {}", ino, std::strerror(err));
      }
    }
  }
  if (id <= 0) {
    ++inode.daemon;
    stats_.daemon_opens++;
    return 0;
  }
  stats_.backing_files++;
  stats_.opens++;
  inode.backing_id = id;
  inode.passthrough = 1;
  return id;
}

void Passthrough::Release(uint64_t ino, int backing_id) {
  int close_id = 0;
  {
    MutexLock lock(mu_);
    auto it = inodes_.find(ino);
    if (it == inodes_.end()) return;
    Inode& inode = it->second;
    if (backing_id > 0) {
      if (inode.passthrough > 0 && --inode.passthrough == 0) {
        close_id = inode.backing_id;
        inode.backing_id = 0;
      }
    } else if (inode.daemon > 0) {
      --inode.daemon;
    }
    if (inode.daemon == 0 && inode.passthrough == 0) inodes_.erase(it);
  }
  if (close_id > 0) CloseBacking(close_id);
}

bool Passthrough::HasDaemonOpens(uint64_t ino) const {
  MutexLock lock(mu_);
  auto it = inodes_.find(ino);
  return it != inodes_.end() && it->second.daemon > 0;
}

void Passthrough::CloseBacking(int backing_id) {
  // The kernel keeps the backing file while files opened on it live; the id goes.
  uint32_t id = static_cast<uint32_t>(backing_id);
  if (::ioctl(fd_, WFS_FUSE_DEV_IOC_BACKING_CLOSE, &id) != 0) {
    spdlog::debug("passthrough: closing backing id {}: {}", backing_id, std::strerror(errno));
  }
}

}  // namespace weightfs
