#define FUSE_USE_VERSION 312

#include "fs/fuse_server.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "fs/mount_point.h"
#include "fs/status_errno.h"

namespace weightfs {
namespace {

// The largest read the kernel sends (it is also FUSE's default max_pages: 256 pages).
constexpr unsigned kMaxRead = 1u << 20;
// Kernel readahead for the mount (its backing-dev-info), raised from the default 128 KiB so a
// sequential reader's requests reach max_read. Root only; best effort.
constexpr int kReadaheadKb = 1024;

constexpr const char* kXattrPid = "user.weightfs.pid";
constexpr const char* kXattrStats = "user.weightfs.stats";

// libfuse's messages, into our log; the last error is kept for Mount()'s error message.
std::mutex g_fuse_log_mu;
std::string g_fuse_last_error;  // GUARDED_BY(g_fuse_log_mu)

void FuseLog(enum fuse_log_level level, const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  std::string msg(buf);
  while (!msg.empty() && msg.back() == '\n') msg.pop_back();
  if (level <= FUSE_LOG_ERR) {
    spdlog::error("libfuse: {}", msg);
    std::lock_guard<std::mutex> lock(g_fuse_log_mu);
    g_fuse_last_error = msg;
  } else if (level <= FUSE_LOG_NOTICE) {
    spdlog::info("libfuse: {}", msg);
  } else {
    spdlog::debug("libfuse: {}", msg);
  }
}

std::string TakeFuseError() {
  std::lock_guard<std::mutex> lock(g_fuse_log_mu);
  std::string e = std::move(g_fuse_last_error);
  g_fuse_last_error.clear();
  return e.empty() ? "see the log" : e;
}

// An open file: what reads need, and its sequential-access state.
struct OpenFile {
  VersionFile file;
  ReadStream stream;
};

// An open directory: its entries as they were at opendir, so offsets stay stable.
struct OpenDir {
  std::vector<DirEntry> entries;
};

}  // namespace

struct FuseServer::Impl {
  ServerParts parts;
  MountOptions options;
  Namespace names;
  ChunkReader reader;
  fuse_session* session = nullptr;
  bool mounted = false;

  Impl(ServerParts p, MountOptions o)
      : parts(p), options(std::move(o)), names(p.bucket, options.names),
        reader(p.materializer, options.reader) {}
};

namespace {

using Impl = FuseServer::Impl;

Impl& Server(fuse_req_t req) { return *static_cast<Impl*>(fuse_req_userdata(req)); }

// Runs a request body that returns 0 once it has replied, or an errno to reply with. The body
// replies only as its last step, so an exception always arrives before any reply was sent.
template <typename Body>
void Serve(fuse_req_t req, const char* op, Body&& body) {
  int err = 0;
  try {
    err = body();
  } catch (const std::bad_alloc&) {
    spdlog::error("{}: out of memory", op);
    err = ENOMEM;
  } catch (const std::exception& e) {
    spdlog::error("{}: {}", op, e.what());
    err = EIO;
  } catch (...) {
    spdlog::error("{}: unknown exception", op);
    err = EIO;
  }
  if (err != 0) fuse_reply_err(req, err);
}

// Every request that would change the tree or a file ends here: published versions are
// immutable. (Drafts, a later issue, route the writes of draft directories to staging here.)
int WriteDenied(const char* op, fuse_ino_t ino) {
  spdlog::debug("{} on inode {}: read-only file system", op, ino);
  return EROFS;
}

fuse_entry_param EntryOf(const NodeAttr& a) {
  fuse_entry_param e{};
  e.ino = a.ino;
  e.generation = 1;
  e.attr = a.st;
  e.attr_timeout = a.timeout_s;
  e.entry_timeout = a.timeout_s;
  return e;
}

// ---- lifecycle --------------------------------------------------------------------------------

void OpInit(void* userdata, fuse_conn_info* conn) {
  (void)userdata;
  conn->max_read = kMaxRead;
  conn->max_readahead = std::max(conn->max_readahead, kMaxRead);  // the kernel caps it
  auto want = [conn](unsigned cap) {
    if (conn->capable & cap) conn->want |= cap;
  };
  want(FUSE_CAP_ASYNC_READ);
  want(FUSE_CAP_READDIRPLUS);
  want(FUSE_CAP_READDIRPLUS_AUTO);
  want(FUSE_CAP_PARALLEL_DIROPS);
  // Files never change under a published name: never drop their page cache on getattr.
  conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
  conn->want &= ~FUSE_CAP_WRITEBACK_CACHE;
  spdlog::debug("fuse init: protocol {}.{}, capable {:#x}, want {:#x}, max_readahead {}",
                conn->proto_major, conn->proto_minor, conn->capable, conn->want,
                conn->max_readahead);
}

// ---- names and attributes ---------------------------------------------------------------------

void OpLookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Serve(req, "lookup", [&] {
    Expected<NodeAttr> a = Server(req).names.Lookup(parent, name);
    if (!a.ok()) return StatusToErrno(a.status(), ErrnoContext::kName, std::string("lookup ") + name);
    fuse_entry_param e = EntryOf(*a);
    fuse_reply_entry(req, &e);
    return 0;
  });
}

// Nodes live as long as the mount (stable inode numbers): lookup counts need no bookkeeping.
void OpForget(fuse_req_t req, fuse_ino_t, uint64_t) { fuse_reply_none(req); }
void OpForgetMulti(fuse_req_t req, size_t, fuse_forget_data*) { fuse_reply_none(req); }

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Serve(req, "getattr", [&] {
    Expected<NodeAttr> a = Server(req).names.GetAttr(ino);
    if (!a.ok()) return StatusToErrno(a.status(), ErrnoContext::kName, "getattr");
    fuse_reply_attr(req, &a->st, a->timeout_s);
    return 0;
  });
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  Serve(req, "readlink", [&] {
    Expected<std::string> target = Server(req).names.ReadLink(ino);
    if (!target.ok()) return StatusToErrno(target.status(), ErrnoContext::kName, "readlink");
    fuse_reply_readlink(req, target->c_str());
    return 0;
  });
}

void OpAccess(fuse_req_t req, fuse_ino_t ino, int mask) {
  Serve(req, "access", [&] {
    if (mask & W_OK) return WriteDenied("access(W_OK)", ino);
    fuse_reply_err(req, 0);
    return 0;
  });
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Serve(req, "statfs", [&] {
    Impl& s = Server(req);
    struct statvfs st {};
    // Space is the local cache's: what materializing more of the mount can use.
    if (!s.parts.cache || ::statvfs(s.parts.cache->dir().c_str(), &st) != 0) {
      st = {};
      st.f_bsize = st.f_frsize = 4096;
    }
    st.f_files = s.names.inode_count();
    st.f_ffree = 0;
    st.f_favail = 0;
    st.f_namemax = 255;
    fuse_reply_statfs(req, &st);
    return 0;
  });
}

// ---- directories ------------------------------------------------------------------------------

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Serve(req, "opendir", [&] {
    Impl& s = Server(req);
    Expected<std::vector<DirEntry>> entries = s.names.ReadDir(ino);
    if (!entries.ok()) return StatusToErrno(entries.status(), ErrnoContext::kName, "opendir");
    auto dir = std::make_unique<OpenDir>();
    dir->entries = std::move(entries).value();
    fi->fh = reinterpret_cast<uint64_t>(dir.get());
    // Inside a version the listing never changes: the kernel may keep it.
    const bool immutable = s.names.IsImmutable(ino);
    fi->cache_readdir = immutable;
    fi->keep_cache = immutable;
    if (fuse_reply_open(req, fi) == 0) dir.release();  // else the kernel never saw the handle
    return 0;
  });
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "readdir", [&] {
    const OpenDir& dir = *reinterpret_cast<OpenDir*>(fi->fh);
    std::vector<char> buf(size);
    size_t used = 0;
    for (size_t i = static_cast<size_t>(std::max<off_t>(off, 0)); i < dir.entries.size(); ++i) {
      struct stat st {};
      st.st_ino = dir.entries[i].ino;
      st.st_mode = dir.entries[i].type;
      size_t n = fuse_add_direntry(req, buf.data() + used, size - used, dir.entries[i].name.c_str(),
                                   &st, static_cast<off_t>(i + 1));
      if (n > size - used) break;
      used += n;
    }
    fuse_reply_buf(req, buf.data(), used);
    return 0;
  });
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "readdirplus", [&] {
    Impl& s = Server(req);
    const OpenDir& dir = *reinterpret_cast<OpenDir*>(fi->fh);
    // Which entries fit, then their attributes in one go (manifests are read in parallel).
    const size_t first = static_cast<size_t>(std::max<off_t>(off, 0));
    size_t end = first, need = 0;
    for (; end < dir.entries.size(); ++end) {
      size_t n = fuse_add_direntry_plus(req, nullptr, 0, dir.entries[end].name.c_str(), nullptr, 0);
      if (need + n > size) break;
      need += n;
    }
    std::vector<uint64_t> inos;
    for (size_t i = first; i < end; ++i) {
      if (dir.entries[i].name != "." && dir.entries[i].name != "..") inos.push_back(dir.entries[i].ino);
    }
    std::vector<NodeAttr> attrs = s.names.GetAttrs(inos);
    std::unordered_map<uint64_t, const NodeAttr*> by_ino;
    for (const NodeAttr& a : attrs) by_ino[a.ino] = &a;
    std::vector<char> buf(size);
    size_t used = 0;
    for (size_t i = first; i < end; ++i) {
      const DirEntry& d = dir.entries[i];
      fuse_entry_param e{};
      auto it = by_ino.find(d.ino);
      if (it != by_ino.end() && d.name != "." && d.name != "..") {
        e = EntryOf(*it->second);
      } else {
        // "." and "..", or a node whose attributes failed: a plain entry (ino 0 tells the
        // kernel not to cache anything for it).
        e.attr.st_ino = d.ino;
        e.attr.st_mode = d.type;
      }
      used += fuse_add_direntry_plus(req, buf.data() + used, size - used, d.name.c_str(), &e,
                                     static_cast<off_t>(i + 1));
    }
    fuse_reply_buf(req, buf.data(), used);
    return 0;
  });
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<OpenDir*>(fi->fh);
  fuse_reply_err(req, 0);
}

// ---- files ------------------------------------------------------------------------------------

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Serve(req, "open", [&] {
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) return WriteDenied("open for writing", ino);
    Expected<VersionFile> f = Server(req).names.Open(ino);
    if (!f.ok()) return StatusToErrno(f.status(), ErrnoContext::kName, "open");
    auto file = std::make_unique<OpenFile>();
    file->file = std::move(f).value();
    fi->fh = reinterpret_cast<uint64_t>(file.get());
    fi->keep_cache = 1;  // immutable: the page cache stays valid across opens
    fi->direct_io = 0;
    if (fuse_reply_open(req, fi) == 0) file.release();
    return 0;
  });
}

void OpRead(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "read", [&] {
    OpenFile& f = *reinterpret_cast<OpenFile*>(fi->fh);
    const Manifest& m = *f.file.manifest;
    Expected<ReadResult> r =
        Server(req).reader.Read(f.file.manifest, *f.file.file, static_cast<uint64_t>(off), size, &f.stream);
    if (!r.ok()) {
      return StatusToErrno(r.status(), ErrnoContext::kData,
                           "read " + m.model + "@" + m.version + "/" + f.file.file->path + " at " +
                               std::to_string(off) + "+" + std::to_string(size));
    }
    // The reply points into the chunk buffers, which `r` keeps alive until it is sent.
    if (r->iov.empty()) {
      fuse_reply_buf(req, nullptr, 0);
    } else {
      fuse_reply_iov(req, r->iov.data(), static_cast<int>(r->iov.size()));
    }
    return 0;
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<OpenFile*>(fi->fh);
  fuse_reply_err(req, 0);
}

void OpFlush(fuse_req_t req, fuse_ino_t, fuse_file_info*) { fuse_reply_err(req, 0); }
void OpFsync(fuse_req_t req, fuse_ino_t, int, fuse_file_info*) { fuse_reply_err(req, 0); }

int64_t PeakRssBytes() {
  struct rusage ru {};
  ::getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

int64_t CurrentRssBytes() {
  std::ifstream in("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  in >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}


std::string StatsJsonOf(const Impl& s) {
  nlohmann::json j;
  const ChunkReaderStats& r = s.reader.stats();
  j["reader"] = {{"reads", r.reads.load()},
                 {"read_bytes", r.read_bytes.load()},
                 {"memory_hits", r.memory_hits.load()},
                 {"materializations", r.materializations.load()},
                 {"shared_waits", r.shared_waits.load()},
                 {"failures", r.failures.load()},
                 {"readahead_queued", r.readahead_queued.load()},
                 {"readahead_dropped", r.readahead_dropped.load()},
                 {"evictions", r.evictions.load()},
                 {"cached_bytes", s.reader.cached_bytes()}};
  const MaterializerStats& m = s.parts.materializer->stats();
  j["materializer"] = {{"chunks", m.chunks.load()},
                       {"cache_hits", m.cache_hits.load()},
                       {"payloads_fetched", m.payloads_fetched.load()},
                       {"payload_bytes", m.payload_bytes.load()},
                       {"deltas_applied", m.deltas_applied.load()}};
  if (s.parts.cache) {
    const ChunkCacheStats& c = s.parts.cache->stats();
    j["disk_cache"] = {{"hits", c.hits.load()},
                       {"misses", c.misses.load()},
                       {"inserts", c.inserts.load()},
                       {"evictions", c.evictions.load()},
                       {"corrupt", c.corrupt.load()},
                       {"size_bytes", s.parts.cache->size_bytes()},
                       {"max_bytes", s.parts.cache->max_bytes()}};
  }
  if (s.parts.store) {
    const StoreCounters& c = s.parts.store->counters();
    j["bucket"] = {{"requests", c.requests.load()},
                   {"gets", c.gets.load()},
                   {"bytes_received", c.bytes_received.load()}};
  }
  j["inodes"] = s.names.inode_count();
  j["memory_limit"] = s.options.reader.memory_limit;
  j["rss_bytes"] = CurrentRssBytes();
  j["peak_rss_bytes"] = PeakRssBytes();
  return j.dump();
}


// ---- extended attributes ----------------------------------------------------------------------

// The size-probe protocol: size 0 asks for the length; a buffer too small is ERANGE.
int ReplyXattrValue(fuse_req_t req, const std::string& value, size_t size) {
  if (size == 0) {
    fuse_reply_xattr(req, value.size());
  } else if (size < value.size()) {
    return ERANGE;
  } else {
    fuse_reply_buf(req, value.data(), value.size());
  }
  return 0;
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  Serve(req, "getxattr", [&] {
    Impl& s = Server(req);
    const std::string n(name);
    if (ino == Namespace::kRootIno && n == kXattrPid) {
      return ReplyXattrValue(req, std::to_string(::getpid()), size);
    }
    if (ino == Namespace::kRootIno && n == kXattrStats) {
      return ReplyXattrValue(req, StatsJsonOf(s), size);
    }
    Expected<std::string> v = s.names.GetXattr(ino, n);
    if (!v.ok()) return StatusToErrno(v.status(), ErrnoContext::kXattr, "getxattr " + n);
    return ReplyXattrValue(req, *v, size);
  });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Serve(req, "listxattr", [&] {
    Expected<std::vector<std::string>> names = Server(req).names.ListXattr(ino);
    if (!names.ok()) return StatusToErrno(names.status(), ErrnoContext::kName, "listxattr");
    if (ino == Namespace::kRootIno) {
      names->push_back(kXattrPid);
      names->push_back(kXattrStats);
    }
    std::string list;
    for (const std::string& n : *names) list.append(n).push_back('\0');
    return ReplyXattrValue(req, list, size);
  });
}

// ---- changes: all refused ---------------------------------------------------------------------

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat*, int, fuse_file_info*) {
  fuse_reply_err(req, WriteDenied("setattr", ino));
}
void OpMknod(fuse_req_t req, fuse_ino_t parent, const char*, mode_t, dev_t) {
  fuse_reply_err(req, WriteDenied("mknod", parent));
}
void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char*, mode_t) {
  fuse_reply_err(req, WriteDenied("mkdir", parent));
}
void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char*) {
  fuse_reply_err(req, WriteDenied("unlink", parent));
}
void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char*) {
  fuse_reply_err(req, WriteDenied("rmdir", parent));
}
void OpSymlink(fuse_req_t req, const char*, fuse_ino_t parent, const char*) {
  fuse_reply_err(req, WriteDenied("symlink", parent));
}
void OpRename(fuse_req_t req, fuse_ino_t parent, const char*, fuse_ino_t, const char*, unsigned) {
  fuse_reply_err(req, WriteDenied("rename", parent));
}
void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t, const char*) {
  fuse_reply_err(req, WriteDenied("link", ino));
}
void OpWrite(fuse_req_t req, fuse_ino_t ino, const char*, size_t, off_t, fuse_file_info*) {
  fuse_reply_err(req, WriteDenied("write", ino));
}
void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char*, const char*, size_t, int) {
  fuse_reply_err(req, WriteDenied("setxattr", ino));
}
void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char*) {
  fuse_reply_err(req, WriteDenied("removexattr", ino));
}
void OpCreate(fuse_req_t req, fuse_ino_t parent, const char*, mode_t, fuse_file_info*) {
  fuse_reply_err(req, WriteDenied("create", parent));
}
void OpFallocate(fuse_req_t req, fuse_ino_t ino, int, off_t, off_t, fuse_file_info*) {
  fuse_reply_err(req, WriteDenied("fallocate", ino));
}
void OpCopyFileRange(fuse_req_t req, fuse_ino_t, off_t, fuse_file_info*, fuse_ino_t ino_out, off_t,
                     fuse_file_info*, size_t, int) {
  fuse_reply_err(req, WriteDenied("copy_file_range", ino_out));
}

fuse_lowlevel_ops MakeOps() {
  fuse_lowlevel_ops ops{};
  ops.init = OpInit;
  ops.lookup = OpLookup;
  ops.forget = OpForget;
  ops.forget_multi = OpForgetMulti;
  ops.getattr = OpGetattr;
  ops.readlink = OpReadlink;
  ops.access = OpAccess;
  ops.statfs = OpStatfs;
  ops.opendir = OpOpendir;
  ops.readdir = OpReaddir;
  ops.readdirplus = OpReaddirplus;
  ops.releasedir = OpReleasedir;
  ops.open = OpOpen;
  ops.read = OpRead;
  ops.release = OpRelease;
  ops.flush = OpFlush;
  ops.fsync = OpFsync;
  ops.getxattr = OpGetxattr;
  ops.listxattr = OpListxattr;
  ops.setattr = OpSetattr;
  ops.mknod = OpMknod;
  ops.mkdir = OpMkdir;
  ops.unlink = OpUnlink;
  ops.rmdir = OpRmdir;
  ops.symlink = OpSymlink;
  ops.rename = OpRename;
  ops.link = OpLink;
  ops.write = OpWrite;
  ops.setxattr = OpSetxattr;
  ops.removexattr = OpRemovexattr;
  ops.create = OpCreate;
  ops.fallocate = OpFallocate;
  ops.copy_file_range = OpCopyFileRange;
  return ops;
}

// Mount options are comma-separated: a comma inside the fsname would split it.
std::string OptionSafe(std::string s) {
  for (char& c : s) {
    if (c == ',' || c == '\\' || c == ' ') c = '_';
  }
  return s;
}

}  // namespace

// ---- FuseServer -------------------------------------------------------------------------------

FuseServer::FuseServer(ServerParts parts, MountOptions options)
    : impl_(std::make_unique<Impl>(parts, std::move(options))) {}

FuseServer::~FuseServer() {
  if (impl_->session) {
    if (impl_->mounted) fuse_session_unmount(impl_->session);
    fuse_remove_signal_handlers(impl_->session);
    fuse_session_destroy(impl_->session);
  }
}

Status FuseServer::Mount() {
  fuse_set_log_func(FuseLog);
  const MountOptions& o = impl_->options;
  std::string opts = "max_read=" + std::to_string(kMaxRead) + ",subtype=weightfs,fsname=" + OptionSafe(o.fsname);
  if (o.allow_other) opts += ",allow_other";
  if (o.read_only) opts += ",ro";
  for (const std::string& extra : o.fuse_options) opts += "," + extra;
  fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  fuse_opt_add_arg(&args, "weightfs");
  fuse_opt_add_arg(&args, "-o");
  fuse_opt_add_arg(&args, opts.c_str());
  static const fuse_lowlevel_ops kOps = MakeOps();
  impl_->session = fuse_session_new(&args, &kOps, sizeof kOps, impl_.get());
  fuse_opt_free_args(&args);
  if (!impl_->session) {
    return Status::InvalidArgument("cannot start a FUSE session with options '" + opts + "': " + TakeFuseError());
  }
  if (fuse_set_signal_handlers(impl_->session) != 0) {
    return Status::IOError("cannot install the signal handlers");
  }
  if (fuse_session_mount(impl_->session, o.mountpoint.c_str()) != 0) {
    return Status::IOError("cannot mount on " + o.mountpoint + ": " + TakeFuseError());
  }
  impl_->mounted = true;
  // Let sequential readers' requests reach max_read (the kernel's default readahead is 128 KiB).
  if (::geteuid() == 0) {
    if (std::optional<MountEntry> m = FindMount(o.mountpoint)) {
      std::ofstream ra("/sys/class/bdi/" + m->device + "/read_ahead_kb");
      ra << kReadaheadKb;
      ra.flush();
      if (!ra) spdlog::debug("cannot set the readahead of {} (/sys/class/bdi/{})", o.mountpoint, m->device);
    }
  }
  return Status::Ok();
}

Status FuseServer::Run() {
  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, static_cast<unsigned>(impl_->options.max_threads));
  fuse_loop_cfg_set_idle_threads(config, static_cast<unsigned>(impl_->options.max_threads));
  int rc = fuse_session_loop_mt(impl_->session, config);
  fuse_loop_cfg_destroy(config);
  fuse_session_unmount(impl_->session);
  impl_->mounted = false;
  if (rc < 0) return Status::IOError(std::string("the FUSE session failed: ") + std::strerror(-rc));
  if (rc > 0) spdlog::info("signal {}: unmounted {}", rc, impl_->options.mountpoint);
  return Status::Ok();
}

std::string FuseServer::StatsJson() const { return StatsJsonOf(*impl_); }

}  // namespace weightfs
