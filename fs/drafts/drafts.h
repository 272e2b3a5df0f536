// Drafts: the write path of a mount. A draft is a version being written: `mkdir
// MNT/acme/qwen@v4` creates one whose parent is acme/qwen's latest version (none: a base), and
// it lists the parent's files until they are replaced or removed. Files written into it go to
// staging files on local disk; when a file is closed it is encoded against the parent's file of
// the same path (VersionEncoder: inherit, delta or keyframe per chunk) and its packs are
// uploaded in the background, so that publishing after the last close only assembles and
// writes the manifest (create-if-absent).
//
// Local state, per bucket, under `state_dir` (in the cache directory):
//   lock                    flock: one mount of a bucket per cache directory owns its drafts
//   <draft id>/journal.json the draft: names, parent, files (inherited or staged), encoded parts
//   <draft id>/journal.log  the changes since journal.json, a record a line (journal.cc)
//   <draft id>/files/<n>    staging files
//   <draft id>/parts/<n>    staged files encoded: a manifest whose packs are uploaded (one file,
//                           or many small files encoded together)
// A change of the draft's tree is appended to the journal before it is acknowledged (synced
// on fsync, commit, and a second later); journal.json is rewritten atomically when the log
// outgrows it. Staging data is as durable as the user makes it (fsync). A crash of the daemon
// therefore loses at most unsynced writes, one of the machine the last second of them; the next
// mount reloads the drafts, re-encodes what was not encoded, and finishes commits that were
// requested. A published draft's staging files stay (its journal says "published") as the
// chunk cache's source for the next draft of the model's deltas, until a newer version of that
// model is published from this cache directory.
//
// Lazy copy-up: opening an inherited file for writing without O_TRUNC makes a sparse staging
// file of the parent's size and materializes into it only the parent chunks a write touches
// partially; reads of the chunks not yet copied come from the parent. The rest is filled in
// when the file is encoded (its SHA-256 needs every byte).
//
// Inode numbers are >= kFirstIno (the Namespace's are small); each node keeps its number for
// the life of the mount. Operations return a Status (NotFound, Conflict, NotEmpty, IsDirectory,
// Busy, CrossDevice, ...): the FUSE adapter turns it into the reply's errno with StatusToErrno
// (fs/status_errno.h); commit's message is what the `weightfs commit` command prints. Thread-safe; bucket I/O, encoding
// and staging I/O never run under the metadata lock.
#pragma once

#include <sys/stat.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "hub/engine/version_writer.h"
#include "fs/chunk_reader.h"
#include "fs/namespace.h"

namespace weightfs {

struct DraftsOptions {
  std::string state_dir;  // per bucket, inside the cache directory
  PushOptions push;       // chunking, packs, keyframe policy, codec options
  size_t encode_threads = 0;  // 0: one per core
  uid_t uid = 0;
  gid_t gid = 0;
  // --prefix: drafts only of models under it (hub/engine/bucket.h ModelUnder); directories only on
  // the way to it or under it. "": any.
  std::string prefix;
  // Called with a draft's published manifest before the draft goes (the Namespace shows the
  // version from then on, so the name never answers ENOENT in between).
  std::function<void(std::shared_ptr<const Manifest>)> on_published;
  // Called once a published draft is gone (its name names the version now), on the thread that
  // published it: the mount drops what the kernel cached of the name.
  std::function<void(const std::string& model, const std::string& version)> on_gone;
};

struct Draft;
struct DraftFile;

// Who makes a node (the FUSE request's caller): it belongs to them.
struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
};

// What a setattr changes; each field optional. The kernel has checked that the caller may
// (the mount runs with default_permissions).
struct AttrChange {
  std::optional<uint64_t> size;
  std::optional<mode_t> mode;
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  std::optional<int64_t> atime_ns, mtime_ns;
};

// An open file of a draft.
struct DraftHandle {
  std::shared_ptr<DraftFile> file;
  std::shared_ptr<Draft> draft;
  std::string path;  // at open (for messages)
  bool write = false;
  // Served around the kernel's page cache (FUSE direct_io; see DraftFile::direct_writers).
  bool direct = false;
  bool direct_writer = false;  // counted in the file's direct_writers
  ReadStream stream;
};

class Drafts {
 public:
  static constexpr uint64_t kFirstIno = 1ull << 48;

  Drafts(Bucket* bucket, ChunkCache* cache, Materializer* materializer, ChunkReader* reader,
         DraftsOptions options);
  ~Drafts();  // stops the background encoder (drafts stay on disk)
  Drafts(const Drafts&) = delete;
  Drafts& operator=(const Drafts&) = delete;

  // Takes the state directory's lock and loads the drafts an earlier mount left; queues the
  // encoding of staged files not yet encoded and resumes commits that were requested. If
  // another mount holds the lock, drafts are disabled here (mkdir gets ReadOnly: EROFS) and the reason
  // is returned for the log.
  Status Load();
  bool enabled() const;

  static bool Owns(uint64_t ino) { return ino >= kFirstIno; }

  // ---- directories above the versions ("" = the root, "acme", ...) -----------------------
  // Drafts and new (not yet published) model directories shown in `dir_path`.
  Status LookupIn(const std::string& dir_path, std::string_view name, NodeAttr* out);
  std::vector<DirEntry> EntriesIn(const std::string& dir_path);
  // "leaf@version": a new draft (owned by `who`, with `mode`); any other name: a new
  // directory for models to come.
  Status MkdirIn(const std::string& dir_path, std::string_view name, mode_t mode, const Caller& who,
              NodeAttr* out);
  // Removes an empty draft (all files deleted) or an empty new directory.
  Status RmdirIn(const std::string& dir_path, std::string_view name);

  // ---- nodes this class owns -------------------------------------------------------------
  Status GetAttr(uint64_t ino, NodeAttr* out);
  Status Lookup(uint64_t parent, std::string_view name, NodeAttr* out);
  Status ReadDir(uint64_t ino, std::vector<DirEntry>* out);
  // The model and version of a draft directory, or nullopt.
  std::optional<VersionRef> DraftRef(uint64_t ino) const;
  // The path of a new model directory (for DirPath-like routing), else nullopt.
  std::optional<std::string> DirPath(uint64_t ino) const;
  Status Mkdir(uint64_t parent, std::string_view name, mode_t mode, const Caller& who, NodeAttr* out);
  Status Rmdir(uint64_t parent, std::string_view name);
  Status Unlink(uint64_t parent, std::string_view name);
  Status Rename(uint64_t parent, std::string_view name, uint64_t new_parent, std::string_view new_name,
             unsigned flags);
  Status Create(uint64_t parent, std::string_view name, mode_t mode, int flags, const Caller& who,
             NodeAttr* out, std::unique_ptr<DraftHandle>* handle);
  Status Open(uint64_t ino, int flags, std::unique_ptr<DraftHandle>* handle);
  // Files: size, owner, mode, times. A draft's directories: owner, mode, times. The
  // directories above the versions: EPERM (they are the mount's).
  // `handle`: the open file setattr came with (ftruncate, fchmod), which may have been renamed
  // or unlinked since; null: by inode.
  Status SetAttr(uint64_t ino, const AttrChange& change, DraftHandle* handle, NodeAttr* out);
  Status Read(DraftHandle& h, uint64_t offset, size_t size, std::vector<uint8_t>* out);
  Status Write(DraftHandle& h, uint64_t offset, std::span<const uint8_t> data);
  Status Fsync(DraftHandle& h);
  // Closing the last writer queues the file's encoding.
  void Release(std::unique_ptr<DraftHandle> h);

  // user.weightfs.parent (settable on an unchanged draft), .state, .error on draft dirs.
  Status GetXattr(uint64_t ino, std::string_view name, std::string* out);
  Status SetXattr(uint64_t ino, std::string_view name, std::string_view value);
  Status ListXattr(uint64_t ino, std::vector<std::string>* out);

  // ---- publishing --------------------------------------------------------------------------
  // Waits until every file of the draft is encoded and uploaded, then publishes the manifest
  // as `as` (empty: the draft's own name). On failure the draft and its data stay.
  Status Commit(uint64_t draft_ino, const std::string& as);
  // Publishes this draft as one part of a version written by `parts` nodes (docs/parts.md):
  // encodes and uploads what it wrote, puts its part record, then (with `wait`) waits until
  // every part is in and the version is published (by whichever node completes the set), the
  // deadline passes (Timeout: the part stays safe in the bucket, commit again to go on
  // waiting) or `cancelled()`. Conflict: the parts cannot make one version, or it was
  // discarded. The draft goes once the version is published.
  struct PartCommit {
    int parts = 0;
    std::string id;  // empty: the draft's own (made up at its first part commit)
    bool wait = true;
    std::optional<std::chrono::steady_clock::time_point> deadline;
    std::function<bool()> cancelled;
    bool resumed = false;  // the background resume or unmount, not a user's command
  };
  Status CommitPart(uint64_t draft_ino, const PartCommit& part);
  // Abandons a staged version ("MODEL@VERSION") in the bucket from any node: its part records
  // go (waiting nodes stop), its packs are left to gc.
  Status DiscardStaged(std::string_view name);
  // Staged versions of the bucket (parts in and expected, which parts), JSON, for `status`.
  std::string StagedJson();
  // Commits every draft (unmount); the first error, after trying all. A part draft puts its
  // part (again) and does not wait.
  Status CommitAll();
  // Abandons a draft: forgets it and deletes its staging files (`weightfs discard`). EBUSY
  // while it is committed or a file of it is open for writing.
  Status Discard(uint64_t draft_ino);
  // Drafts, pending encodes, bytes to go, errors (JSON object) for `weightfs status`.
  std::string StatusJson();
  // Files whose encoding is queued, not started (a queue depth for the metrics).
  size_t queued_encodes();
  // What the mount's drafts are doing now and have done since it was mounted, for the metrics.
  struct Metrics {
    uint64_t open_drafts = 0;         // drafts not yet published
    uint64_t pending_files = 0;       // written files not yet encoded
    uint64_t bytes_to_go = 0;         // ... and their bytes
    uint64_t queued_encodes = 0;      // encodes waiting to start
    uint64_t files_encoded = 0;       // since mount: files encoded into packs
    uint64_t bytes_encoded = 0;       // ... their bytes
    uint64_t bytes_stored = 0;        // ... what the packs took (uploaded to the bucket)
    uint64_t versions_published = 0;  // drafts published
    uint64_t commit_failures = 0;     // commits that failed (the draft is kept)
  };
  Metrics metrics();

  struct State;

 private:
  std::unique_ptr<State> state_;
};

}  // namespace weightfs
