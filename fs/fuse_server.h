// FuseServer: serves the published versions of a bucket at a mount point through libfuse3's
// low-level API and its multi-threaded loop.
//
// The kernel protocol lives here and nowhere else: requests are answered from the Namespace
// (lookup, getattr, readdir[plus], readlink, xattrs), the ChunkReader (read), the drafts and the
// .patch view, which all return a Status: each request's body returns one, and it becomes the
// reply's errno through StatusToErrno (fs/status_errno.h) and nowhere else; no exception escapes
// a callback (std::bad_alloc -> ENOMEM, anything else -> EIO). Every request that would change
// something is refused as ReadOnly (EROFS) in one place (WriteDenied in the .cc) unless it is
// about a draft (fs/drafts/drafts.h): new version directories and everything in them, and
// `mkdir` in directories above the versions.
//
// Control through extended attributes (the `weightfs commit/status/unmount` commands use them):
// setting user.weightfs.commit on a draft directory publishes it (the value: another version
// name, or empty), user.weightfs.commit_all on the root publishes every draft, and the root's
// user.weightfs.status is a JSON report of the drafts. A failed commit leaves its message in
// the draft's user.weightfs.error.
//
// Every published version directory also answers a hidden, read-only `.patch` directory of
// sparse weight patches from its ancestors (fs/patch_view.h, docs/patch.md); its inodes are the
// PatchView's range, routed to it like the drafts' are.
//
// Kernel-side caching: files are opened with keep_cache (published files never change, so the
// page cache survives close/open, and re-reads and mmap run at memory speed); entries and
// attributes inside versions have long timeouts, directories above them the refresh interval.
// A published file the mount holds whole on local disk (fs/whole_files.h) is opened in
// passthrough mode instead (fs/passthrough.h): the kernel reads and maps the local copy itself,
// and no read of it reaches the daemon.
// Reads arrive in requests of up to 1 MiB (max_read), asynchronously (FUSE_CAP_ASYNC_READ).
//
// The root directory answers two extended attributes for tools: user.weightfs.pid (the daemon's
// process id; `weightfs unmount` waits for it to exit) and user.weightfs.stats (JSON counters:
// bytes fetched from the bucket vs materialized, cache hits and hit ratio, chain depths, build
// and decode time, queue depths, memory, peak RSS; fs/metrics.h turns them into Prometheus text).
//
// Lifecycle: Mount() then Run() on one thread; Run() returns when the file system is unmounted
// (umount, fusermount3 -u, weightfs unmount) or on SIGTERM/SIGINT/SIGHUP, after unmounting.
// The other methods are thread-safe.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "fs/chunk_reader.h"
#include "fs/drafts/drafts.h"
#include "fs/namespace.h"
#include "hub/store/store_wrapper.h"

namespace weightfs {

struct MountOptions {
  std::string mountpoint;                 // absolute path
  std::string fsname = "weightfs";        // the source column of the mount table
  std::vector<std::string> fuse_options;  // extra "-o" options (comma-separated lists allowed)
  bool allow_other = false;               // let other users read the mount
  bool read_only = false;                 // mount with MS_RDONLY
  size_t max_threads = 16;                // FUSE worker threads
  NamespaceOptions names;
  ChunkReaderOptions reader;
  // Drafts (the write path): on unless `drafts.state_dir` is empty or the mount is read-only.
  DraftsOptions drafts;
  // The read-only .patch view of every version (fs/patch_view.h): where its patch files are
  // kept (empty: no view) and their bound (LRU beyond it).
  std::string patch_dir;
  uint64_t patch_max_bytes = 4ull << 30;
  // Prometheus text of the stats (fs/metrics.h), rewritten every `metrics_interval` while
  // mounted; empty: none.
  std::string metrics_file;
  std::chrono::milliseconds metrics_interval{10000};
  // An HTTP endpoint for Prometheus (fs/metrics.h MetricsServer) on metrics_address:metrics_port;
  // -1: none.
  int metrics_port = -1;
  std::string metrics_address = "127.0.0.1";
  // What a metadata request (lookup, getattr, readdir, xattrs, statfs, readlink) gives the bucket
  // in all, retries included (OperationDeadline): `ls` of a bucket that is down or silent fails
  // with EIO in about this long, not the read timeout. 0: only the per-request bounds.
  std::chrono::milliseconds metadata_timeout{10000};
  // Keep a local copy of each published file read whole (in the chunk cache, in place of its
  // chunks) and let the kernel serve later opens of it from there (fs/whole_files.h,
  // fs/passthrough.h). Off: every read goes through the daemon (--no-whole-files).
  bool whole_files = true;
};

// What the server reads from and reports on. All must outlive the server; `cache` and `store`
// may be null.
class SharedTierStore;

struct ServerParts {
  Bucket* bucket = nullptr;
  Materializer* materializer = nullptr;
  ChunkCache* cache = nullptr;
  const CountingStore* store = nullptr;  // the bucket (the origin, with a shared tier)
  const SharedTierStore* shared = nullptr;  // --shared-cache, or null
};

class FuseServer {
 public:
  FuseServer(ServerParts parts, MountOptions options);
  ~FuseServer();
  FuseServer(const FuseServer&) = delete;
  FuseServer& operator=(const FuseServer&) = delete;

  // Creates the FUSE session, installs the signal handlers and mounts. An error names the
  // mount point and libfuse's reason.
  Status Mount();
  // REQUIRES: Mount() succeeded. Serves requests until unmounted or signalled, then unmounts
  // and publishes the drafts that are left (those that fail stay staged for the next mount).
  Status Run();

  // The counters user.weightfs.stats reports, as a JSON object.
  std::string StatsJson() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightfs
