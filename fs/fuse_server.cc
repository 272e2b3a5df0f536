#define FUSE_USE_VERSION 312

#include "fs/fuse_server.h"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <new>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/mutex.h"
#include "core/thread_annotations.h"
#include "hub/engine/shared_tier.h"
#include "fs/metrics.h"
#include "fs/mount_point.h"
#include "fs/mount_tree.h"
#include "fs/passthrough.h"
#include "fs/patch_view.h"
#include "fs/status_errno.h"
#include "fs/whole_files.h"
#include "hub/store/http_client.h"
#include "hub/store/local_file.h"

namespace weightfs {
namespace {

// The largest read the kernel sends (it is also FUSE's default max_pages: 256 pages).
constexpr unsigned kMaxRead = 1u << 20;
// Kernel readahead for the mount (its backing-dev-info), raised from the default 128 KiB so a
// sequential reader's requests reach max_read. Root only; best effort.
constexpr int kReadaheadKb = 1024;

constexpr const char* kXattrPid = "user.weightfs.pid";
constexpr const char* kXattrStats = "user.weightfs.stats";
constexpr const char* kXattrStatus = "user.weightfs.status";
constexpr const char* kXattrCommit = "user.weightfs.commit";
constexpr const char* kXattrCommitAll = "user.weightfs.commit_all";
// Set by `weightfs unmount` before it unmounts: the local copies of files read whole are made now,
// while the kernel still holds their pages (WholeFiles::Hurry).
constexpr const char* kXattrFinishWholeFiles = "user.weightfs.finish_whole_files";
constexpr const char* kXattrKeepDrafts = "user.weightfs.keep_drafts";
constexpr const char* kXattrDiscard = "user.weightfs.discard";
// On a draft: commit it as one part of a version written by several nodes (docs/parts.md); the
// value is JSON {"parts": N, "part": ID, "wait": bool, "timeout_ms": T}.
constexpr const char* kXattrCommitPart = "user.weightfs.commit_part";
// On the root: the bucket's staged versions (JSON), and `weightfs discard` of one ("MODEL@VERSION").
constexpr const char* kXattrStaged = "user.weightfs.staged";
constexpr const char* kXattrDiscardStaged = "user.weightfs.discard_staged";
// On a version directory: its model's newest version, from a listing made now (rate-bounded).
constexpr const char* kXattrNewest = "user.weightfs.newest";

// The longest name of a directory entry (NAME_MAX, what statfs reports): a longer one is
// refused where it enters (ENAMETOOLONG), as local file systems do, not accepted and lost.
constexpr size_t kNameMax = 255;
bool TooLong(const char* name) { return std::strlen(name) > kNameMax; }

// libfuse's messages, into our log; the last error is kept for Mount()'s error message.
Mutex g_fuse_log_mu;
std::string g_fuse_last_error WFS_GUARDED_BY(g_fuse_log_mu);

void FuseLog(enum fuse_log_level level, const char* fmt, va_list ap) {
  char buf[1024];
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  std::string msg(buf);
  while (!msg.empty() && msg.back() == '\n') msg.pop_back();
  if (level <= FUSE_LOG_ERR) {
    spdlog::error("libfuse: {}", msg);
    MutexLock lock(g_fuse_log_mu);
    g_fuse_last_error = msg;
  } else if (level <= FUSE_LOG_NOTICE) {
    spdlog::info("libfuse: {}", msg);
  } else {
    spdlog::debug("libfuse: {}", msg);
  }
}

std::string TakeFuseError() {
  MutexLock lock(g_fuse_log_mu);
  std::string e = std::move(g_fuse_last_error);
  g_fuse_last_error.clear();
  return e.empty() ? "see the log" : e;
}

// An open file: what reads need, and its sequential-access state; or a draft's file.
struct OpenFile {
  VersionFile file;
  ReadStream stream;
  // A published file whose opens Passthrough counts (fs/passthrough.h): its inode, and the
  // backing id it was opened on (0: through the daemon).
  uint64_t counted_ino = 0;
  int backing_id = 0;
  std::unique_ptr<DraftHandle> draft;
  int patch_fd = -1;  // a patch view's file (fs/patch_view.h)
  ~OpenFile() {
    if (patch_fd >= 0) ::close(patch_fd);
  }
};

// An open directory: its entries as they were at opendir, so offsets stay stable.
struct OpenDir {
  std::vector<DirEntry> entries;
};

}  // namespace

struct FuseServer::Impl {
  ServerParts parts;
  MountOptions options;
  // Local copies of the files read whole, and the kernel serving them (null: no cache, or
  // --no-whole-files). It and the reader use each other: its threads are stopped first
  // (~Impl), then the reader goes (its readahead asks it which files stream), then it.
  std::unique_ptr<WholeFiles> whole;
  Namespace names;
  ChunkReader reader;
  std::unique_ptr<Drafts> drafts;  // null: read-only mount
  std::unique_ptr<PatchView> patches;  // null: no cache directory
  Passthrough passthrough;
  std::atomic<bool> serving{false};  // the session is up: the kernel can be notified
  // Inodes copied whole while open through the daemon: their kernel page cache is dropped once
  // the last such open is released.
  Mutex forget_pages_mu;
  std::unordered_set<uint64_t> forget_pages WFS_GUARDED_BY(forget_pages_mu);
  // FUSE_NOTIFY_RETRIEVE (WholeFiles::set_kernel_pages): the kernel answers each notification
  // with the pages it holds, in a request that OpRetrieveReply hands to the waiting caller by
  // its id (the cookie). A caller that gave up is no longer in the map: a late answer is dropped.
  struct Retrieval {
    uint8_t* out = nullptr;
    size_t size = 0;
    size_t got = 0;
    bool done = false;
  };
  Mutex retrieve_mu;
  CondVar retrieve_cv;
  std::unordered_map<uint64_t, Retrieval*> retrievals WFS_GUARDED_BY(retrieve_mu);
  uint64_t next_retrieval WFS_GUARDED_BY(retrieve_mu) = 1;
  // What the kernel's page cache holds of [offset, +size) of inode `ino` (a prefix), in requests
  // of at most kMaxRead (the kernel answers at most max_write, and max_pages pages).
  size_t KernelPages(uint64_t ino, uint64_t offset, uint8_t* out, size_t size) WFS_EXCLUDES(retrieve_mu);
  // Which of names, drafts and patches answers for a name or a node (set by the constructor).
  MountTree tree{&names, nullptr, nullptr, false};
  std::atomic<bool> publish_at_exit{true};
  fuse_session* session = nullptr;
  bool mounted = false;
  Mutex cache_warned_mu;
  std::map<std::string, int> cache_warned WFS_GUARDED_BY(cache_warned_mu);  // model -> the worst warning given (1, 2)

  // Drops the kernel's cached entry of draft `model`@`version` in its model's directory, and
  // with it every name under it: what the name means changed without the kernel seeing it (a
  // commit made it the published version, a discard removed it or shows the version it
  // shadowed, set-parent changed its files), and the kernel keeps drafts' names
  // (Drafts::State::kEntryTimeoutS). Before the reply of the request that changed it, so that
  // nothing the caller does next sees the old name. It takes the lock of the model's directory
  // only (the draft's own is the caller's); never called while the kernel holds that one (a
  // mkdir, rmdir or rename in it).
  void ForgetDraftName(const std::string& model, const std::string& version) {
    if (!session) return;
    uint64_t parent = FUSE_ROOT_ID;
    std::string_view rest = model;
    while (true) {
      const size_t slash = rest.find('/');
      if (slash == std::string_view::npos) break;
      Expected<NodeAttr> dir = tree.Lookup(parent, rest.substr(0, slash));
      if (!dir.ok()) return;  // not shown (so not cached either)
      parent = dir->ino;
      rest.remove_prefix(slash + 1);
    }
    const std::string name = std::string(rest) + "@" + version;
    (void)fuse_lowlevel_notify_inval_entry(session, parent, name.c_str(), name.size());
  }
  void ForgetDraftName(const std::optional<VersionRef>& draft) {
    if (draft) ForgetDraftName(draft->model, draft->version);
  }

  // Says once per model when the chunk cache cannot hold what reading the model's versions
  // needs: a version read whole (1), or two (2: a node following a run builds N+1 from N's
  // chunks in the cache). Without it a too-small cache costs whole-chunk fetches silently.
  void WarnIfCacheTooSmall(const Manifest& m) {
    if (!parts.cache) return;
    const uint64_t size = m.stats.logical_bytes, room = parts.cache->max_bytes();
    const int level = size > room ? 1 : 2 * size > room ? 2 : 0;
    if (level == 0) return;
    {
      MutexLock lock(cache_warned_mu);
      int& given = cache_warned[m.model];
      if (given != 0 && given <= level) return;
      given = level;
    }
    auto gib = [](uint64_t b) { return fmt::format("{:.1f} GiB", static_cast<double>(b) / (1ull << 30)); };
    // (Two versions and an eighth for the indexes and the packs a read keeps; whole GiB, as
    // --cache-size takes it.)
    const std::string need = std::to_string((2 * size + size / 8 + (1ull << 30) - 1) >> 30) + "GiB";
    if (level == 1) {
      spdlog::warn("{}@{} is {} and the chunk cache holds {} (--cache-size): a version read whole evicts its own "
                   "chunks, and reading the next version fetches whole chunks again instead of deltas; mount with "
                   "--cache-size {} to follow this model",
                   m.model, m.version, gib(size), gib(room),
                   need);
    } else {
      spdlog::warn("{}@{} is {} and the chunk cache holds {} (--cache-size): a node that reads one version after "
                   "another builds each from the one before, and both do not fit; mount with --cache-size {} to "
                   "follow this model",
                   m.model, m.version, gib(size), gib(room),
                   need);
    }
  }

  Impl(ServerParts p, MountOptions o)
      : parts(p), options(std::move(o)), names(p.bucket, NamesOptions(options)),
        reader(p.materializer, options.reader) {
    if (WithDrafts(options)) {
      DraftsOptions d = options.drafts;
      d.uid = options.names.uid;
      d.gid = options.names.gid;
      d.on_published = [this](std::shared_ptr<const Manifest> m) { names.AddPublished(std::move(m)); };
      d.on_gone = [this](const std::string& model, const std::string& version) { ForgetDraftName(model, version); };
      drafts = std::make_unique<Drafts>(p.bucket, p.cache, p.materializer, &reader, std::move(d));
    }
    if (!options.patch_dir.empty() && p.materializer) {
      PatchViewOptions po;
      po.dir = options.patch_dir;
      po.max_bytes = options.patch_max_bytes;
      po.uid = options.names.uid;
      po.gid = options.names.gid;
      po.file_mode = options.names.file_mode;
      po.dir_mode = options.names.dir_mode;
      po.timeout_s = options.names.immutable_timeout_s;
      patches = std::make_unique<PatchView>(p.bucket, p.materializer, p.cache, std::move(po));
    }
    tree = MountTree(&names, drafts.get(), patches.get(), p.bucket->derived() != nullptr);
    if (options.whole_files && p.cache && p.materializer) {
      whole = std::make_unique<WholeFiles>(p.materializer, &reader, p.cache);
      // A file written whole as it is read needs no chunk files besides.
      reader.set_skip_disk_cache([w = whole.get()](const ManifestFile& f) { return w->Streaming(f); });
      // The kernel's copy of the file's pages is of no use once it reads the local copy: freed,
      // unless a file open through the daemon still uses it.
      whole->set_kernel_pages([this](uint64_t ino, uint64_t offset, uint8_t* out, size_t size) {
        return KernelPages(ino, offset, out, size);
      });
      whole->set_on_copied([this](uint64_t ino) {
        if (!serving.load() || !passthrough.enabled()) return;
        if (passthrough.HasDaemonOpens(ino)) {
          MutexLock lock(forget_pages_mu);
          forget_pages.insert(ino);  // at its last release through the daemon
          return;
        }
        (void)fuse_lowlevel_notify_inval_inode(session, ino, 0, 0);
      });
    }
  }
  ~Impl() {
    if (whole) whole->Stop();
  }
  bool Owned(uint64_t ino) const { return tree.IsDraft(ino); }
  bool Patch(uint64_t ino) const { return tree.IsPatch(ino); }
  bool WithDrafts(const MountOptions& o) const { return !o.drafts.state_dir.empty() && !o.read_only; }
  // The directories above the versions take drafts (mkdir) when drafts are on: their mode
  // says so, for the kernel's permission checks.
  NamespaceOptions NamesOptions(const MountOptions& o) const {
    NamespaceOptions n = o.names;
    n.writable_dirs = WithDrafts(o);
    return n;
  }
};

namespace {

using Impl = FuseServer::Impl;

Impl& Server(fuse_req_t req) { return *static_cast<Impl*>(fuse_req_userdata(req)); }

}  // namespace

size_t FuseServer::Impl::KernelPages(uint64_t ino, uint64_t offset, uint8_t* out, size_t size) {
  size_t got = 0;
  while (got < size && serving.load()) {
    Retrieval r;
    r.out = out + got;
    r.size = std::min<size_t>(size - got, kMaxRead);
    uint64_t id = 0;
    {
      MutexLock lock(retrieve_mu);
      id = next_retrieval++;
      retrievals.emplace(id, &r);
    }
    const int rc = fuse_lowlevel_notify_retrieve(session, ino, r.size, static_cast<off_t>(offset + got),
                                                 reinterpret_cast<void*>(static_cast<uintptr_t>(id)));
    bool done = false;
    size_t n = 0;
    {
      MutexLock lock(retrieve_mu);
      // (Answered by a session thread at once; the bound is for a kernel that never answers.)
      if (rc == 0) retrieve_cv.WaitFor(retrieve_mu, std::chrono::seconds(2), [&]() WFS_REQUIRES(retrieve_mu) { return r.done; });
      done = r.done;
      n = r.got;
      retrievals.erase(id);
    }
    if (!done || n == 0) break;  // (a page the kernel does not hold: the next asks start there)
    got += n;  // (the kernel answers up to its max_pages, which may be less than asked)
  }
  return got;
}

namespace {

void OpRetrieveReply(fuse_req_t req, void* cookie, fuse_ino_t, off_t, fuse_bufvec* bufv) {
  Impl& s = Server(req);
  {
    MutexLock lock(s.retrieve_mu);
    if (auto it = s.retrievals.find(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(cookie))); it != s.retrievals.end()) {
      Impl::Retrieval& r = *it->second;
      fuse_bufvec dst{};  // (FUSE_BUFVEC_INIT is a C compound literal)
      dst.count = 1;
      dst.buf[0].size = std::min(fuse_buf_size(bufv), r.size);
      dst.buf[0].flags = static_cast<fuse_buf_flags>(0);
      dst.buf[0].mem = r.out;
      dst.buf[0].fd = -1;
      const ssize_t n = fuse_buf_copy(&dst, bufv, static_cast<fuse_buf_copy_flags>(0));
      r.got = n > 0 ? static_cast<size_t>(n) : 0;
      r.done = true;
      s.retrieve_cv.NotifyAll();
    }
  }
  fuse_reply_none(req);
}

// Runs a request body that returns OK once it has replied, or the Status to reply with: its
// errno is StatusToErrno's, in `context` (what the request is about; fs/status_errno.h). The
// body replies only as its last step, so an exception always arrives before any reply was
// sent; it is served as a failure to produce data (out of memory: ENOMEM, else EIO).
// Requests a person waits on interactively (`ls`, `stat`, a lookup): bounded in all by
// --metadata-timeout. Opens and reads have the per-request bound (--timeout) only.
bool IsMetadataOp(std::string_view op) {
  static constexpr std::string_view kOps[] = {"lookup", "getattr", "readdir", "readdirplus", "opendir",
                                              "getxattr", "listxattr", "statfs", "readlink", "access"};
  return std::find(std::begin(kOps), std::end(kOps), op) != std::end(kOps);
}

template <typename Body>
void Serve(fuse_req_t req, const char* op, ErrnoContext context, Body&& body) {
  std::optional<OperationDeadline> bound;
  if (const std::chrono::milliseconds t = Server(req).options.metadata_timeout; t.count() > 0 && IsMetadataOp(op)) {
    char what[64];
    std::snprintf(what, sizeof what, "--metadata-timeout %.3g s", static_cast<double>(t.count()) / 1000);
    bound.emplace(OperationDeadline::Clock::now() + t, what);
  }
  Status st;
  try {
    st = body();
  } catch (...) {
    st = StatusOfCurrentException(op);
    context = ErrnoContext::kData;
  }
  if (!st.ok()) fuse_reply_err(req, StatusToErrno(st, context, op));
}

// Every request that would change the tree or a file ends here: published versions are
// immutable; drafts (fs/drafts/) take the writes of draft directories.
Status WriteDenied(const char* op, fuse_ino_t ino) { return MountTree::ReadOnly(op, ino); }

Status NameTooLong(const char* name) {
  return Status::NameTooLong(std::string("a name of ") + std::to_string(std::strlen(name)) + " bytes (the most is " +
                             std::to_string(kNameMax) + ")");
}

fuse_entry_param EntryOf(const NodeAttr& a) {
  fuse_entry_param e{};
  e.ino = a.ino;
  e.generation = 1;
  e.attr = a.st;
  e.attr_timeout = a.AttrTimeout();
  e.entry_timeout = a.timeout_s;
  return e;
}

// ---- lifecycle --------------------------------------------------------------------------------

void OpInit(void* userdata, fuse_conn_info* conn) {
  (void)userdata;
  conn->max_read = kMaxRead;
  conn->max_write = kMaxRead;
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
  Serve(req, "lookup", ErrnoContext::kName, [&]() -> Status {
    if (TooLong(name)) return NameTooLong(name);
    WFS_ASSIGN_OR_RETURN(const NodeAttr a, Server(req).tree.Lookup(parent, name));
    fuse_entry_param e = EntryOf(a);
    fuse_reply_entry(req, &e);
    return Status::Ok();
  });
}

// Nodes live as long as the mount (stable inode numbers): lookup counts need no bookkeeping.
void OpForget(fuse_req_t req, fuse_ino_t, uint64_t) { fuse_reply_none(req); }
void OpForgetMulti(fuse_req_t req, size_t, fuse_forget_data*) { fuse_reply_none(req); }

void OpGetattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
  Serve(req, "getattr", ErrnoContext::kName, [&]() -> Status {
    WFS_ASSIGN_OR_RETURN(const NodeAttr a, Server(req).tree.GetAttr(ino));
    fuse_reply_attr(req, &a.st, a.AttrTimeout());
    return Status::Ok();
  });
}

void OpReadlink(fuse_req_t req, fuse_ino_t ino) {
  Serve(req, "readlink", ErrnoContext::kName, [&]() -> Status {
    Expected<std::string> target = Server(req).names.ReadLink(ino);
    if (!target.ok()) return target.status();
    fuse_reply_readlink(req, target->c_str());
    return Status::Ok();
  });
}

void OpAccess(fuse_req_t req, fuse_ino_t ino, int mask) {
  Serve(req, "access", ErrnoContext::kName, [&]() -> Status {
    Impl& s = Server(req);
    if ((mask & W_OK) && !(s.drafts && (Drafts::Owns(ino) || s.tree.DirPath(ino)))) {
      return WriteDenied("access(W_OK)", ino);
    }
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}

void OpStatfs(fuse_req_t req, fuse_ino_t) {
  Serve(req, "statfs", ErrnoContext::kName, [&]() -> Status {
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
    return Status::Ok();
  });
}

// ---- directories ------------------------------------------------------------------------------

void OpOpendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Serve(req, "opendir", ErrnoContext::kName, [&]() -> Status {
    Impl& s = Server(req);
    auto dir = std::make_unique<OpenDir>();
    WFS_ASSIGN_OR_RETURN(MountTree::Listing listing, s.tree.ReadDir(ino));
    dir->entries = std::move(listing.entries);
    const bool immutable = listing.immutable;
    fi->fh = reinterpret_cast<uint64_t>(dir.get());
    fi->cache_readdir = immutable;
    fi->keep_cache = immutable;
    if (fuse_reply_open(req, fi) == 0) dir.release();  // else the kernel never saw the handle
    return Status::Ok();
  });
}

void OpReaddir(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "readdir", ErrnoContext::kName, [&]() -> Status {
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
    return Status::Ok();
  });
}

void OpReaddirplus(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "readdirplus", ErrnoContext::kName, [&]() -> Status {
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
    const std::vector<NodeAttr> attrs = s.tree.GetAttrs(std::move(inos));
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
    return Status::Ok();
  });
}

void OpReleasedir(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  delete reinterpret_cast<OpenDir*>(fi->fh);
  fuse_reply_err(req, 0);
}

// ---- files ------------------------------------------------------------------------------------

void OpOpen(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
  Serve(req, "open", ErrnoContext::kChange, [&]() -> Status {
    Impl& s = Server(req);
    if (s.Owned(ino)) {
      auto file = std::make_unique<OpenFile>();
      WFS_TRY(s.drafts->Open(ino, fi->flags, &file->draft));
      fi->fh = reinterpret_cast<uint64_t>(file.get());
      fi->keep_cache = 0;  // a draft's file changes
      fi->direct_io = file->draft->direct;  // (Drafts::Open: a write-only save)
      if (fuse_reply_open(req, fi) == 0) {
        file.release();
      } else {
        s.drafts->Release(std::move(file->draft));
      }
      return Status::Ok();
    }
    if ((fi->flags & O_ACCMODE) != O_RDONLY || (fi->flags & O_TRUNC)) return WriteDenied("open for writing", ino);
    if (s.Patch(ino)) {
      auto file = std::make_unique<OpenFile>();
      WFS_TRY(s.patches->Open(ino, &file->patch_fd));
      fi->fh = reinterpret_cast<uint64_t>(file.get());
      fi->keep_cache = 1;
      fi->direct_io = 0;
      if (fuse_reply_open(req, fi) == 0) file.release();
      return Status::Ok();
    }
    Expected<VersionFile> f = s.names.Open(ino);
    if (!f.ok()) return f.status();
    s.WarnIfCacheTooSmall(*f->manifest);
    auto file = std::make_unique<OpenFile>();
    file->file = std::move(f).value();
    fi->fh = reinterpret_cast<uint64_t>(file.get());
    fi->keep_cache = 1;  // immutable: the page cache stays valid across opens
    fi->direct_io = 0;
    if (s.whole && s.passthrough.enabled() && s.whole->Wanted(file->file)) {
      // A file the mount holds whole is read by the kernel from the local copy (fs/passthrough.h);
      // every open of such a file is counted, so that an inode's opens share one mode.
      file->counted_ino = ino;
      file->backing_id = s.passthrough.Acquire(ino, [&] { return s.whole->Open(file->file); });
      if (file->backing_id > 0) fi->keep_cache = 0;  // (the kernel refuses it with passthrough)
    }
    int replied;
    {
      Passthrough::ReplyScope scope(file->backing_id);
      replied = fuse_reply_open(req, fi);
    }
    if (replied == 0) {
      file.release();
    } else if (file->counted_ino != 0) {
      s.passthrough.Release(file->counted_ino, file->backing_id);
    }
    return Status::Ok();
  });
}

void OpRead(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "read", ErrnoContext::kData, [&]() -> Status {
    OpenFile& f = *reinterpret_cast<OpenFile*>(fi->fh);
    if (f.draft) {
      std::vector<uint8_t> buf;
      WFS_TRY(Server(req).drafts->Read(*f.draft, static_cast<uint64_t>(off), size, &buf));
      fuse_reply_buf(req, reinterpret_cast<const char*>(buf.data()), buf.size());
      return Status::Ok();
    }
    if (f.patch_fd >= 0) {
      std::vector<uint8_t> buf(size);
      int err = 0;
      const uint64_t got = PreadUpTo(f.patch_fd, buf.data(), size, static_cast<uint64_t>(off), &err);
      if (err != 0) {
        return StatusOfErrno(err, "read of a patch file at " + std::to_string(off) + "+" + std::to_string(size));
      }
      fuse_reply_buf(req, reinterpret_cast<const char*>(buf.data()), got);
      return Status::Ok();
    }
    const Manifest& m = *f.file.manifest;
    Expected<ReadResult> r =
        Server(req).reader.Read(f.file.manifest, f.file.rows ? f.file.rows : std::shared_ptr<const ManifestFile>(f.file.manifest, f.file.file),
                                static_cast<uint64_t>(off), size, &f.stream);
    if (!r.ok()) {
      return r.status().WithContext("read " + m.model + "@" + m.version + "/" + f.file.file->path + " at " +
                                    std::to_string(off) + "+" + std::to_string(size));
    }
    if (Server(req).whole) Server(req).whole->NoteRead(ino, f.file, static_cast<uint64_t>(off), r->size, &*r);
    // The reply points into the chunk buffers, which `r` keeps alive until it is sent.
    if (r->iov.empty()) {
      fuse_reply_buf(req, nullptr, 0);
    } else {
      fuse_reply_iov(req, r->iov.data(), static_cast<int>(r->iov.size()));
    }
    return Status::Ok();
  });
}

void OpRelease(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
  std::unique_ptr<OpenFile> f(reinterpret_cast<OpenFile*>(fi->fh));
  Impl& s = Server(req);
  bool forget = false;
  if (f->counted_ino != 0) {
    s.passthrough.Release(f->counted_ino, f->backing_id);
    if (f->backing_id == 0 && !s.passthrough.HasDaemonOpens(f->counted_ino)) {
      MutexLock lock(s.forget_pages_mu);
      forget = s.forget_pages.erase(f->counted_ino) > 0;
    }
  }
  if (f->draft) {
    try {
      s.drafts->Release(std::move(f->draft));
    } catch (const std::exception& e) {
      spdlog::error("release: {}", e.what());
    }
  }
  fuse_reply_err(req, 0);
  // (After the reply: nothing of the kernel's waits on this request any more.)
  if (forget && s.serving.load()) (void)fuse_lowlevel_notify_inval_inode(s.session, f->counted_ino, 0, 0);
}

void OpFlush(fuse_req_t req, fuse_ino_t, fuse_file_info*) { fuse_reply_err(req, 0); }
void OpFsync(fuse_req_t req, fuse_ino_t, int, fuse_file_info* fi) {
  Serve(req, "fsync", ErrnoContext::kChange, [&]() -> Status {
    OpenFile& f = *reinterpret_cast<OpenFile*>(fi->fh);
    if (f.draft) WFS_TRY(Server(req).drafts->Fsync(*f.draft));
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}

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
                 {"builds_peak", r.builds_peak.load()},
                 {"builds_running", s.reader.builds_running()},
                 {"readahead_waiting", s.reader.readahead_waiting()},
                 {"cached_bytes", s.reader.cached_bytes()}};
  const MaterializerStats& m = s.parts.materializer->stats();
  j["materializer"] = {{"chunks", m.chunks.load()},
                       {"cache_hits", m.cache_hits.load()},
                       {"payloads_fetched", m.payloads_fetched.load()},
                       {"payload_bytes", m.payload_bytes.load()},
                       {"deltas_applied", m.deltas_applied.load()},
                       {"builds", m.builds.load()},
                       {"built_bytes", m.built_bytes.load()},
                       {"chain_steps", m.chain_steps.load()},
                       {"chain_depth_max", m.chain_depth_max.load()},
                       {"build_seconds", static_cast<double>(m.build_ns.load()) / 1e9},
                       {"decode_seconds", static_cast<double>(m.decode_ns.load()) / 1e9},
                       {"rewritten_heads", m.rewritten_heads.load()}};
  // Chunks asked of the caches: served from memory, else by the materializer (which counts its
  // disk-cache hits and its builds). Readers that joined a build in flight are neither.
  const uint64_t lookups = r.memory_hits.load() + m.chunks.load();
  const uint64_t hits = r.memory_hits.load() + m.cache_hits.load();
  j["rates"] = {{"chunk_lookups", lookups},
                {"cache_hit_ratio", lookups ? static_cast<double>(hits) / static_cast<double>(lookups) : 0.0},
                {"mean_chain_depth", m.builds.load() ? static_cast<double>(m.chain_steps.load()) /
                                                           static_cast<double>(m.builds.load())
                                                     : 0.0}};
  if (s.drafts) {
    const Drafts::Metrics d = s.drafts->metrics();
    j["drafts"] = {{"open", d.open_drafts},
                   {"pending_files", d.pending_files},
                   {"bytes_to_go", d.bytes_to_go},
                   {"queued_encodes", d.queued_encodes},
                   {"files_encoded", d.files_encoded},
                   {"bytes_encoded", d.bytes_encoded},
                   {"bytes_stored", d.bytes_stored},
                   {"versions_published", d.versions_published},
                   {"commit_failures", d.commit_failures}};
  }
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
  if (s.whole) {
    const WholeFilesStats& w = s.whole->stats();
    const PassthroughStats& p = s.passthrough.stats();
    j["whole_files"] = {{"streamed", w.streamed.load()},
                        {"stream_ends", w.stream_ends.load()},
                        {"queued", w.queued.load()},
                        {"copied", w.copied.load()},
                        {"copied_bytes", w.copied_bytes.load()},
                        {"failed", w.failed.load()},
                        {"dropped", w.dropped.load()},
                        {"copy_seconds", static_cast<double>(w.copy_ns.load()) / 1e9},
                        {"kernel_bytes", w.kernel_bytes.load()},
                        {"memory_bytes", w.memory_bytes.load()},
                        {"rebuilt", w.rebuilt.load()},
                        {"queue_depth", s.whole->queue_depth()}};
    j["passthrough"] = {{"enabled", s.passthrough.enabled()},
                        {"opens", p.opens.load()},
                        {"daemon_opens", p.daemon_opens.load()},
                        {"backing_files", p.backing_files.load()},
                        {"busy", p.busy.load()}};
  }
  if (s.parts.store) {
    const StoreCounters& c = s.parts.store->counters();
    j["bucket"] = {{"requests", c.requests.load()},
                   {"gets", c.gets.load()},
                   {"bytes_received", c.bytes_received.load()}};
  }
  if (s.parts.shared) {
    const SharedTierStats& t = s.parts.shared->stats();
    j["shared_cache"] = {{"hits", t.hits.load()},
                         {"misses", t.misses.load()},
                         {"fills", t.fills.load()},
                         {"waits", t.waits.load()},
                         {"wait_timeouts", t.wait_timeouts.load()},
                         {"corrupt", t.corrupt.load()},
                         {"errors", t.errors.load()},
                         {"bypassed", t.bypassed.load()},
                         {"evictions", t.evictions.load()},
                         {"prefetches", t.prefetches.load()},
                         {"bytes_received", t.bytes_received.load()},
                         {"bytes_filled", t.bytes_filled.load()}};
  }
  if (s.patches) {
    const PatchView::Stats p = s.patches->stats();
    j["patch_view"] = {{"generated", p.generated}, {"reused", p.reused}, {"failures", p.failures},
                       {"evicted", p.evicted}};
  }
  j["inodes"] = s.names.inode_count();
  j["memory_limit"] = s.options.reader.memory_limit;
  j["rss_bytes"] = CurrentRssBytes();
  j["peak_rss_bytes"] = PeakRssBytes();
  return j.dump();
}


// ---- extended attributes ----------------------------------------------------------------------

// The size-probe protocol: size 0 asks for the length; a buffer too small is OutOfRange (ERANGE).
Status ReplyXattrValue(fuse_req_t req, const std::string& value, size_t size) {
  if (size == 0) {
    fuse_reply_xattr(req, value.size());
  } else if (size < value.size()) {
    return Status::OutOfRange("an xattr value of " + std::to_string(value.size()) + " bytes, a buffer of " +
                              std::to_string(size));
  } else {
    fuse_reply_buf(req, value.data(), value.size());
  }
  return Status::Ok();
}

void OpGetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, size_t size) {
  Serve(req, "getxattr", ErrnoContext::kName, [&]() -> Status {
    Impl& s = Server(req);
    const std::string n(name);
    // Security labels and POSIX ACLs are not this file system's: "not supported", which tools
    // take as the answer for the whole file system where "no such attribute" (ENODATA) was an
    // answer for one file. `ls -l` asks for both on every file it lists: 20,000 requests for a
    // 10,000-file version, most of its time (docs/mount.md, "Listing").
    if (n.starts_with("security.") || n.starts_with("system.")) {
      return Status::Unsupported(n + ": no security labels or ACLs on a weightfs mount");
    }
    if (ino == Namespace::kRootIno && n == kXattrPid) {
      return ReplyXattrValue(req, std::to_string(::getpid()), size);
    }
    if (ino == Namespace::kRootIno && n == kXattrStats) {
      return ReplyXattrValue(req, StatsJsonOf(s), size);
    }
    if (ino == Namespace::kRootIno && n == kXattrStatus) {
      return ReplyXattrValue(req, s.drafts ? s.drafts->StatusJson() : R"({"enabled":false,"drafts":[]})", size);
    }
    if (ino == Namespace::kRootIno && n == kXattrStaged) {
      return ReplyXattrValue(req, s.drafts ? s.drafts->StagedJson() : "[]", size);
    }
    if (s.Owned(ino)) {
      std::string v;
      WFS_TRY(s.drafts->GetXattr(ino, n, &v));
      return ReplyXattrValue(req, v, size);
    }
    if (s.Patch(ino)) return Status::NoAttribute(n);
    if (n == kXattrNewest) {
      Expected<std::string> newest = s.names.NewestVersion(ino);
      if (!newest.ok()) {
        if (newest.status().kind() == ErrorKind::kInvalidArgument) return Status::NoAttribute(n);  // not a version
        return newest.status();
      }
      return ReplyXattrValue(req, *newest, size);
    }
    Expected<std::string> v = s.names.GetXattr(ino, n);
    if (!v.ok() && v.status().kind() == ErrorKind::kNotFound) return Status::NoAttribute(v.status().message());
    if (!v.ok()) return v.status();
    return ReplyXattrValue(req, *v, size);
  });
}

void OpListxattr(fuse_req_t req, fuse_ino_t ino, size_t size) {
  Serve(req, "listxattr", ErrnoContext::kName, [&]() -> Status {
    Impl& s = Server(req);
    if (s.Owned(ino)) {
      std::vector<std::string> names;
      WFS_TRY(s.drafts->ListXattr(ino, &names));
      std::string list;
      for (const std::string& n : names) list.append(n).push_back('\0');
      return ReplyXattrValue(req, list, size);
    }
    if (s.Patch(ino)) return ReplyXattrValue(req, "", size);
    Expected<std::vector<std::string>> names = s.names.ListXattr(ino);
    if (!names.ok()) return names.status();
    if (ino == Namespace::kRootIno) {
      names->push_back(kXattrPid);
      names->push_back(kXattrStats);
      names->push_back(kXattrStatus);
    }
    std::string list;
    for (const std::string& n : *names) list.append(n).push_back('\0');
    return ReplyXattrValue(req, list, size);
  });
}

// ---- changes: drafts, else refused --------------------------------------------------------------

Caller CallerOf(fuse_req_t req) {
  const fuse_ctx* ctx = fuse_req_ctx(req);
  return Caller{ctx->uid, ctx->gid};
}

void OpSetattr(fuse_req_t req, fuse_ino_t ino, struct stat* attr, int to_set, fuse_file_info* fi) {
  Serve(req, "setattr", ErrnoContext::kChange, [&]() -> Status {
    Impl& s = Server(req);
    if (!s.Owned(ino)) return WriteDenied("setattr", ino);
    AttrChange c;
    const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::system_clock::now().time_since_epoch()).count();
    auto ns = [](const timespec& t) { return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec; };
    if (to_set & FUSE_SET_ATTR_SIZE) c.size = static_cast<uint64_t>(attr->st_size);
    if (to_set & FUSE_SET_ATTR_MODE) c.mode = attr->st_mode;
    if (to_set & FUSE_SET_ATTR_UID) c.uid = attr->st_uid;
    if (to_set & FUSE_SET_ATTR_GID) c.gid = attr->st_gid;
    if (to_set & FUSE_SET_ATTR_ATIME_NOW) {
      c.atime_ns = now;
    } else if (to_set & FUSE_SET_ATTR_ATIME) {
      c.atime_ns = ns(attr->st_atim);
    }
    if (to_set & FUSE_SET_ATTR_MTIME_NOW) {
      c.mtime_ns = now;
    } else if (to_set & FUSE_SET_ATTR_MTIME) {
      c.mtime_ns = ns(attr->st_mtim);
    }
    NodeAttr a;
    DraftHandle* handle = fi ? reinterpret_cast<OpenFile*>(fi->fh)->draft.get() : nullptr;
    WFS_TRY(s.drafts->SetAttr(ino, c, handle, &a));
    fuse_reply_attr(req, &a.st, a.AttrTimeout());
    return Status::Ok();
  });
}
// A request no draft takes (mknod, symlink, link, removexattr, fallocate, copy_file_range):
// published versions refuse it as read-only; a draft's node by `refusal`.
void Refuse(fuse_req_t req, const char* op, fuse_ino_t ino, Status refusal) {
  Serve(req, op, ErrnoContext::kChange, [&] { return Server(req).Owned(ino) ? refusal : WriteDenied(op, ino); });
}

void OpMknod(fuse_req_t req, fuse_ino_t parent, const char*, mode_t, dev_t) {
  Refuse(req, "mknod", parent, Status::PermissionDenied("a draft holds regular files and directories only"));
}
void OpMkdir(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode) {
  Serve(req, "mkdir", ErrnoContext::kChange, [&]() -> Status {
    if (TooLong(name)) return NameTooLong(name);
    WFS_ASSIGN_OR_RETURN(const NodeAttr a, Server(req).tree.Mkdir(parent, name, mode, CallerOf(req)));
    fuse_entry_param e = EntryOf(a);
    fuse_reply_entry(req, &e);
    return Status::Ok();
  });
}
void OpUnlink(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Serve(req, "unlink", ErrnoContext::kChange, [&]() -> Status {
    WFS_TRY(Server(req).tree.Unlink(parent, name));
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}
void OpRmdir(fuse_req_t req, fuse_ino_t parent, const char* name) {
  Serve(req, "rmdir", ErrnoContext::kChange, [&]() -> Status {
    WFS_TRY(Server(req).tree.Rmdir(parent, name));
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}
void OpSymlink(fuse_req_t req, const char*, fuse_ino_t parent, const char*) {
  Refuse(req, "symlink", parent, Status::PermissionDenied("a draft holds no symbolic links"));
}
void OpRename(fuse_req_t req, fuse_ino_t parent, const char* name, fuse_ino_t new_parent,
              const char* new_name, unsigned flags) {
  Serve(req, "rename", ErrnoContext::kChange, [&]() -> Status {
    Impl& s = Server(req);
    if (!s.Owned(parent) && !s.Owned(new_parent)) return WriteDenied("rename", parent);
    if (TooLong(new_name)) return NameTooLong(new_name);
    WFS_TRY(s.tree.Rename(parent, name, new_parent, new_name, flags));
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}
void OpLink(fuse_req_t req, fuse_ino_t ino, fuse_ino_t, const char*) {
  Refuse(req, "link", ino, Status::PermissionDenied("a draft holds no hard links"));
}
void OpWrite(fuse_req_t req, fuse_ino_t ino, const char* buf, size_t size, off_t off, fuse_file_info* fi) {
  Serve(req, "write", ErrnoContext::kChange, [&]() -> Status {
    OpenFile& f = *reinterpret_cast<OpenFile*>(fi->fh);
    if (!f.draft) return WriteDenied("write", ino);
    WFS_TRY(Server(req).drafts->Write(*f.draft, static_cast<uint64_t>(off),
                                      std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(buf), size)));
    fuse_reply_write(req, size);
    return Status::Ok();
  });
}
void OpSetxattr(fuse_req_t req, fuse_ino_t ino, const char* name, const char* value, size_t size, int) {
  Serve(req, "setxattr", ErrnoContext::kChange, [&]() -> Status {
    Impl& s = Server(req);
    const std::string n(name);
    const std::string v(value, size);
    if (ino == Namespace::kRootIno && n == kXattrCommitAll) {
      // Any failure is EIO: `weightfs commit --all` reads the reasons in the status xattr.
      Status st = s.drafts ? s.drafts->CommitAll() : Status::Ok();
      if (!st.ok()) return Status::IOError(st.ToString());
      fuse_reply_err(req, 0);
      return Status::Ok();
    }
    if (ino == Namespace::kRootIno && n == kXattrFinishWholeFiles) {
      // (On a FUSE thread: the kernel's answers to the copies' requests need another one.)
      if (s.whole && s.options.max_threads > 1 && !s.whole->Hurry(std::chrono::seconds(60))) {
        spdlog::warn("whole files: the local copies were not all made within 60 s of the unmount's request");
      }
      fuse_reply_err(req, 0);
      return Status::Ok();
    }
    if (ino == Namespace::kRootIno && n == kXattrKeepDrafts) {
      s.publish_at_exit = false;
      spdlog::info("the drafts stay staged at unmount (weightfs unmount --keep-drafts)");
      fuse_reply_err(req, 0);
      return Status::Ok();
    }
    if (ino == Namespace::kRootIno && n == kXattrDiscardStaged) {
      if (!s.drafts) return Status::ReadOnly("drafts are off on this mount");
      WFS_TRY(s.drafts->DiscardStaged(v));
      fuse_reply_err(req, 0);
      return Status::Ok();
    }
    if (!s.Owned(ino)) return WriteDenied("setxattr", ino);
    if (n == kXattrCommitPart) {
      Drafts::PartCommit part;
      try {
        const nlohmann::json j = nlohmann::json::parse(v);
        part.parts = j.at("parts").get<int>();
        part.id = j.value("part", std::string());
        part.wait = j.value("wait", true);
        if (const int64_t ms = j.value("timeout_ms", int64_t{-1}); ms >= 0) {
          part.deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
        }
      } catch (const std::exception& e) {
        return Status::InvalidArgument(std::string("user.weightfs.commit_part: ") + e.what());
      }
      // `weightfs commit` killed while it waits: the kernel interrupts the request.
      // The mount going away (unmount, SIGTERM) ends the wait too: the part stays in the bucket.
      fuse_session* session = s.session;
      part.cancelled = [req, session] { return fuse_req_interrupted(req) != 0 || fuse_session_exited(session) != 0; };
      if (int err = StatusToErrno(s.drafts->CommitPart(ino, part), ErrnoContext::kCommit, "commit"); err != 0) {
        fuse_reply_err(req, err);
        return Status::Ok();
      }
    } else if (n == kXattrDiscard) {
      const std::optional<VersionRef> draft = s.drafts->DraftRef(ino);
      WFS_TRY(s.drafts->Discard(ino));
      s.ForgetDraftName(draft);
    } else if (n == kXattrCommit) {
      // (Its own context: a refusal to publish as things stand is EBUSY, not EINVAL.)
      if (int err = StatusToErrno(s.drafts->Commit(ino, v), ErrnoContext::kCommit, "commit"); err != 0) {
        fuse_reply_err(req, err);
        return Status::Ok();
      }
    } else {
      WFS_TRY(s.drafts->SetXattr(ino, n, v));
      // Set-parent changed which files the draft has.
      s.ForgetDraftName(s.drafts->DraftRef(ino));
    }
    fuse_reply_err(req, 0);
    return Status::Ok();
  });
}
void OpRemovexattr(fuse_req_t req, fuse_ino_t ino, const char*) {
  Refuse(req, "removexattr", ino, Status::Unsupported("a draft's attributes cannot be removed"));
}
void OpCreate(fuse_req_t req, fuse_ino_t parent, const char* name, mode_t mode, fuse_file_info* fi) {
  Serve(req, "create", ErrnoContext::kChange, [&]() -> Status {
    Impl& s = Server(req);
    if (!s.Owned(parent)) return WriteDenied("create", parent);
    auto file = std::make_unique<OpenFile>();
    NodeAttr a;
    if (TooLong(name)) return NameTooLong(name);
    WFS_TRY(s.drafts->Create(parent, name, mode, fi->flags, CallerOf(req), &a, &file->draft));
    fi->fh = reinterpret_cast<uint64_t>(file.get());
    fi->keep_cache = 0;
    fi->direct_io = file->draft->direct;  // (Drafts::Open: a write-only save)
    fuse_entry_param e = EntryOf(a);
    if (fuse_reply_create(req, &e, fi) == 0) {
      file.release();
    } else {
      s.drafts->Release(std::move(file->draft));
    }
    return Status::Ok();
  });
}
void OpFallocate(fuse_req_t req, fuse_ino_t ino, int, off_t, off_t, fuse_file_info*) {
  Refuse(req, "fallocate", ino, Status::Unsupported("fallocate"));
}
void OpCopyFileRange(fuse_req_t req, fuse_ino_t, off_t, fuse_file_info*, fuse_ino_t ino_out, off_t,
                     fuse_file_info*, size_t, int) {
  // EOPNOTSUPP (= ENOTSUP on Linux): the kernel falls back to read + write.
  Refuse(req, "copy_file_range", ino_out, Status::Unsupported("copy_file_range"));
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
  ops.retrieve_reply = OpRetrieveReply;
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
  // default_permissions: the kernel checks every access against the owners and modes we
  // report (a draft's files belong to whoever made them), so with --allow-other one user cannot
  // read, change or remove another's files.
  std::string opts = "max_read=" + std::to_string(kMaxRead) + ",default_permissions,subtype=weightfs,fsname=" +
                     OptionSafe(o.fsname);
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
  if (impl_->whole) {
    // After the mount, before the first request (INIT) is read.
    Status p = impl_->passthrough.Install(impl_->session, [](void* userdata) {
      return &static_cast<Impl*>(userdata)->passthrough;
    });
    if (!p.ok()) spdlog::warn("passthrough: {}; every read goes through the daemon", p.ToString());
  }
  if (impl_->drafts) {
    Status d = impl_->drafts->Load();
    if (!d.ok()) spdlog::warn("drafts: {}", d.ToString());
  }
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
  // The metrics file is written while the mount serves, and once more after the drafts are
  // published at the end (the destructor's write): the last numbers stay in it.
  std::unique_ptr<MetricsFile> metrics;
  if (!impl_->options.metrics_file.empty()) {
    metrics = std::make_unique<MetricsFile>(impl_->options.metrics_file, impl_->options.metrics_interval,
                                            [this](bool final) {
                                              return PrometheusText(StatsJsonOf(*impl_), impl_->options.mountpoint, !final);
                                            });
  }
  // The scrape endpoint answers while the mount serves (not while its drafts are published at
  // the end: Prometheus then sees the target down, as it is).
  std::unique_ptr<MetricsServer> endpoint;
  if (impl_->options.metrics_port >= 0) {
    Expected<std::unique_ptr<MetricsServer>> started =
        MetricsServer::Start(impl_->options.metrics_address, static_cast<uint16_t>(impl_->options.metrics_port), [this] {
          return PrometheusText(StatsJsonOf(*impl_), impl_->options.mountpoint);
        });
    if (!started.ok()) {
      spdlog::error("{}; the mount serves without it", started.status().message());
    } else {
      endpoint = std::move(started).value();
      spdlog::info("metrics for Prometheus at http://{}:{}/metrics", impl_->options.metrics_address, endpoint->port());
    }
  }
  fuse_loop_config* config = fuse_loop_cfg_create();
  fuse_loop_cfg_set_clone_fd(config, 0);
  fuse_loop_cfg_set_max_threads(config, static_cast<unsigned>(impl_->options.max_threads));
  fuse_loop_cfg_set_idle_threads(config, static_cast<unsigned>(impl_->options.max_threads));
  impl_->serving = true;
  int rc = fuse_session_loop_mt(impl_->session, config);
  impl_->serving = false;
  fuse_loop_cfg_destroy(config);
  endpoint.reset();
  fuse_session_unmount(impl_->session);
  impl_->mounted = false;
  if (rc < 0) return Status::IOError(std::string("the FUSE session failed: ") + std::strerror(-rc));
  if (rc > 0) spdlog::info("signal {}: unmounted {}", rc, impl_->options.mountpoint);
  if (impl_->drafts && impl_->drafts->enabled() && impl_->publish_at_exit) {
    Status d = impl_->drafts->CommitAll();
    if (!d.ok()) spdlog::error("drafts not published at unmount (kept staged for the next mount): {}", d.ToString());
  }
  // The files read whole just before the unmount are kept too (a local copy; seconds a GB).
  if (impl_->whole) impl_->whole->Finish(std::chrono::seconds(20));
  return Status::Ok();
}

std::string FuseServer::StatsJson() const { return StatsJsonOf(*impl_); }

}  // namespace weightfs
