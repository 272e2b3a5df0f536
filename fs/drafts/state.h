// Drafts::State: everything a mount's drafts share, and the operations the parts of
// fs/drafts/ call on each other. Private to fs/drafts/.
//
// Locks, in the order they may be taken (never the other way):
//   encode_mu              one encode at a time (EncodeNow); taken with no other lock held
//   State::mu              the drafts, their trees, the inode table (the *Locked functions)
//   DraftFile::mu          one file's bytes, size, copy-up map, encode state
//   Draft::journal_mu      the order of journal writes (SaveJournal; never with mu held)
//   Draft::journal_out_mu  records queued for the journal (a leaf)
//   queue_mu               the background queue (a leaf)
// No bucket I/O, encoding or staging-file I/O of a whole file runs under State::mu.
//
// Files: inodes.cc (numbers and attributes), journal.cc (the journal, loading drafts),
// staging.cc (staging files, copy-up), encode.cc (the background encoder), commit.cc
// (publishing, removing), tree.cc (names), file_io.cc (open files), xattrs.cc, drafts.cc (the
// lifecycle and status).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/mutex.h"
#include "core/thread_pool.h"
#include "fs/drafts/draft.h"
#include "fs/drafts/drafts.h"

namespace weightfs {

// What SaveJournal writes besides the draft's changed paths.
struct JournalWrite {
  const DraftFile* file = nullptr;  // its path changed (a write, fsync, close: by handle)
  bool sync = false;                // fdatasync the journal too (fsync, commit)
  bool published = false;           // the draft was published: a last snapshot saying so
};

struct Drafts::State {
  Bucket* bucket;
  ChunkCache* cache;
  Materializer* materializer;
  ChunkReader* reader;
  DraftsOptions options;
  ThreadPool pool;
  int lock_fd = -1;
  std::string disabled_reason;  // non-empty: another mount owns the drafts
  std::atomic<bool> loaded{false};

  // Guards what follows and the drafts' trees (Draft::files, dirs, committing, error...: the
  // analysis cannot name it from Draft, so those are checked by review). Only DraftFile::mu and
  // Draft::journal_mu are taken under it.
  mutable Mutex mu WFS_ACQUIRED_AFTER(encode_mu);
  std::map<std::string, std::shared_ptr<Draft>> drafts WFS_GUARDED_BY(mu);  // by "model@version"
  std::set<std::string> new_dirs WFS_GUARDED_BY(mu);                         // made by mkdir, above versions
  std::map<std::string, std::vector<std::string>> published_dirs WFS_GUARDED_BY(mu);  // model -> retired state dirs
  std::set<std::string> published_names WFS_GUARDED_BY(mu);  // published by this mount, by "model@version"
  enum class Type : char { kNewDir = 'n', kDraftDir = 'd', kItem = 'i' };
  struct Ref {
    Type type;
    std::string a;  // kNewDir: its path; kDraftDir, kItem: the draft's name
    std::string b;  // kItem: the path inside the draft
    // An item removed (unlink, rmdir, renamed over): its number never names the path again;
    // a file still open answers getattr through `removed_file` (nlink 0), else ENOENT.
    bool removed = false;
    std::weak_ptr<DraftFile> removed_file;
  };
  std::map<std::string, uint64_t> inos WFS_GUARDED_BY(mu);
  std::unordered_map<uint64_t, Ref> refs WFS_GUARDED_BY(mu);
  uint64_t next_ino WFS_GUARDED_BY(mu) = kFirstIno;

  // Background work: encode (draft, path) or commit (draft, "").
  // Small files closed wait in `small` (by draft) until a pack's worth of them, a second
  // without another, or a commit; then they are encoded together (EncodeSmall). The worker's.
  struct SmallBatch {
    std::vector<std::string> paths;
    uint64_t bytes = 0;
    std::chrono::steady_clock::time_point last;
  };
  std::map<std::string, SmallBatch> small;  // by draft; only the worker thread uses it
  // Counts since mount (Drafts::metrics).
  std::atomic<uint64_t> files_encoded{0}, bytes_encoded{0}, bytes_stored{0}, versions_published{0},
      commit_failures{0};

  Mutex queue_mu;
  CondVar queue_cv;
  std::deque<std::pair<std::string, std::string>> queue WFS_GUARDED_BY(queue_mu);
  bool stopping WFS_GUARDED_BY(queue_mu) = false;
  std::thread worker;
  CondVar encoded_cv;  // DraftFile::encoding cleared (waited on with mu)
  Mutex encode_mu;     // one encode at a time (they share the pool)

  State(Bucket* b, ChunkCache* c, Materializer* m, ChunkReader* r, DraftsOptions o)
      : bucket(b), cache(c), materializer(m), reader(r), options(std::move(o)), pool(options.encode_threads) {}

  // ---- inodes (REQUIRES mu) ----
  static std::string Key(Type t, const std::string& a, const std::string& b) {
    return std::string(1, static_cast<char>(t)) + a + '\0' + b;
  }
  uint64_t InoLocked(Type t, const std::string& a, const std::string& b = {}) WFS_REQUIRES(mu);
  const Ref* RefLocked(uint64_t ino) const WFS_REQUIRES(mu) {
    auto it = refs.find(ino);
    return it == refs.end() || it->second.removed ? nullptr : &it->second;
  }
  // Item `path` of draft `name` is gone: a new node at the path gets a new number (the kernel
  // must not take it for the old one, which an open file may still hold).
  void RetireLocked(const std::string& name, const std::string& path, std::weak_ptr<DraftFile> file) WFS_REQUIRES(mu);
  // Moves the inodes of `from` (and everything under it) to `to` inside draft `name`.
  void RekeyLocked(const std::string& name, const std::string& from, const std::string& to) WFS_REQUIRES(mu);

  // Every node of draft `name` (removed, or published and replaced by a new draft of the same
  // name): their numbers never name anything again.
  void RetireDraftLocked(const std::string& name) WFS_REQUIRES(mu);

  std::shared_ptr<Draft> DraftLocked(const std::string& name) const WFS_REQUIRES(mu) {
    auto it = drafts.find(name);
    return it == drafts.end() ? nullptr : it->second;
  }
  // The Status for a node of draft `name`, which is gone: Stale (ESTALE) if it was published
  // (the kernel then walks the path again and finds the published version: a lookup that
  // raced the commit retries instead of failing), else NotFound.
  Status GoneLocked(const std::string& name) const WFS_REQUIRES(mu);

  // The model path of draft directories listed in `dir_path` ("leaf@version" there).
  static std::string ModelDir(const std::string& model) { return ParentPath(model); }
  static std::string Leaf(const std::string& model) {
    const size_t slash = model.rfind('/');
    return slash == std::string::npos ? model : model.substr(slash + 1);
  }
  // Resolves a directory node inside a draft: the draft and the path ("" = the draft's root).
  // PermissionDenied for a directory above the versions (files live in versions).
  Status DirOfLocked(uint64_t ino, std::shared_ptr<Draft>* d, std::string* path) const WFS_REQUIRES(mu);
  // New directories shown in `dir_path`: made by mkdir, or above a draft of a new model.
  std::set<std::string> NewDirsInLocked(const std::string& dir_path) const WFS_REQUIRES(mu);

  // ---- attributes (REQUIRES mu) ----
  // How long the kernel may keep the name of a draft and of its files (FileAttr says why it
  // may): the mount drops them when they change without the kernel seeing it.
  static constexpr double kEntryTimeoutS = 10;
  void DirAttr(uint64_t ino, const NodeMeta& meta, NodeAttr* out) const;
  void FileAttr(uint64_t ino, DraftFile& f, NodeAttr* out) const;
  Status AttrLocked(uint64_t ino, NodeAttr* out) WFS_REQUIRES(mu);

  // ---- journal (journal.cc) ----
  // The whole draft (a snapshot: journal.json), and one record of what changed since the last
  // (a line of journal.log: the paths in Draft::journal_paths).
  nlohmann::json JournalLocked(Draft& d, bool published = false) WFS_REQUIRES(mu);
  std::string RecordLocked(Draft& d, uint64_t seq) WFS_REQUIRES(mu);

  // Makes what changed in the draft (its journal_paths, `w.file`) part of its journal: a
  // record appended to journal.log, or a snapshot when the log has grown past the last
  // snapshot's size (compaction). The record is in the page cache when this returns (a daemon
  // killed after it loses nothing); it reaches the disk with the next sync (fsync, commit, or
  // a second after the last one). REQUIRES mu not held.
  Status SaveJournal(Draft& d, JournalWrite w = {}) WFS_EXCLUDES(mu);

  // ---- staging (REQUIRES mu and f.mu) ----
  Status StageLocked(Draft& d, DraftFile& f, bool backed) WFS_REQUIRES(mu, f.mu);

  // Sets a staged file's length to `size`. A file that an encode is reading must not shrink
  // in place (the encoder would find it cut short): it moves to a new staging file,
  // numbered `spare_id` (allocated by the caller under mu), holding the bytes that stay; the
  // encoder's descriptor keeps the old one until it closes it. The old file's path is returned in
  // *unlink_after: the caller removes it once the journal names the new one (a crash before
  // leaves the old, consistent state). REQUIRES f.mu.
  Status ResizeLocked(Draft& d, DraftFile& f, uint64_t size, uint64_t spare_id, std::string* unlink_after)
      WFS_REQUIRES(f.mu);

  void Enqueue(const std::string& draft, const std::string& path) WFS_EXCLUDES(queue_mu);

  // Loads the rows of f's parent file (once). REQUIRES no lock held (it may read the bucket).
  Status EnsureRows(Draft& d, DraftFile& f);
  // Copies up every parent chunk a backed file has not copied yet. REQUIRES no lock held.
  Status Fill(Draft& d, DraftFile& f);

  // Encodes the staged file at `path` unless it is encoded already. Waits for an encode of
  // the same file in progress. InvalidArgument while the file is open for writing or a write
  // to it failed (commit maps it to EBUSY).
  Status EnsureEncoded(const std::shared_ptr<Draft>& d, const std::string& path);

  // Encodes f (Fill first) unless it changes meanwhile (its generation): the part manifest is
  // written to the draft's parts/ and the journal names it. REQUIRES no lock held.
  Status EncodeNow(const std::shared_ptr<Draft>& d, const std::shared_ptr<DraftFile>& f, const std::string& path,
                   uint64_t generation);

  // Small files (one chunk at most: Small) are encoded together: one VersionEncoder, their
  // payloads in shared packs, one part file naming them all, one journal record. Files of
  // `paths` that are encoded already, being encoded, open for writing or gone are skipped
  // (EnsureEncoded deals with them). REQUIRES no lock held.
  Status EncodeSmall(const std::shared_ptr<Draft>& d, std::vector<std::string> paths);
  // Whether a staged file is small enough to be encoded with others. REQUIRES f.mu.
  bool Small(const DraftFile& f) const WFS_REQUIRES(f.mu) {
    return f.id != 0 && !f.backed && f.size <= options.push.chunk_bytes;
  }
  // Encodes every file of `paths` not encoded yet: the small ones together, the others one
  // by one (EnsureEncoded).
  Status EnsureAllEncoded(const std::shared_ptr<Draft>& d, const std::vector<std::string>& paths);

  // What a commit does with the files the draft inherits unchanged: `kept` are published as
  // the parent's; `dropped` are shards a written `*.safetensors.index.json` no longer names
  // (after a reshard, `cp new/* draft/` writes the new shards and index, and the parent's old
  // shards would otherwise stay in the version beside them), each with the index that left it
  // out. REQUIRES mu (takes the files' locks).
  struct InheritedPlan {
    std::vector<std::string> kept;
    std::map<std::string, std::string> dropped;  // path -> the index that does not name it
  };
  InheritedPlan PlanInheritedLocked(Draft& d) WFS_REQUIRES(mu);

  // Tensor elements and other bytes of an unchanged file, as push counts them: a safetensors
  // file's header chunk is parsed for its tensors (it is small and usually cached).
  Expected<std::pair<uint64_t, uint64_t>> ElementsOf(const Manifest& pm, const ManifestFile& pf);

  // Whether the published manifest of m's name has exactly m's parent and files (the same
  // recipes): then it is this draft's own, published by a commit that was cut short.
  bool IsOurs(const Manifest& m);

  // The draft whose directory is `draft_ino` (InvalidArgument: not a draft directory;
  // NotFound: published or removed since). REQUIRES mu not held.
  Expected<std::shared_ptr<Draft>> DraftOfDir(uint64_t draft_ino) WFS_EXCLUDES(mu);
  Status CommitDraft(const std::shared_ptr<Draft>& d, const std::string& as_in);
  Status CommitPartOf(const std::shared_ptr<Draft>& d, const PartCommit& part);
  // The first steps of a commit: waits briefly for writers' RELEASE, refuses open or failed
  // files, marks the draft committing; *paths gets the files to encode (EncodedFiles stages
  // renamed inherited files first). `part`: a part may write nothing (it may only remove files).
  // `wait_for_resumed`: wait (up to 10 min) for a commit in progress (a part resumed in the
  // background after a remount) instead of refusing at once.
  Status BeginCommit(const std::shared_ptr<Draft>& d, const std::string& as_in, bool part, bool wait_for_resumed,
                     std::vector<std::string>* paths);
  // Encodes `paths` (what is not encoded yet) and returns every staged file's encoded
  // manifest (a part may hold several files) by path, after checking that their packs are
  // still in the bucket (re-encoding the lost ones once).
  struct EncodedFile {
    std::shared_ptr<const Manifest> part;
    const ManifestFile* file = nullptr;  // in *part
  };
  Expected<std::map<std::string, EncodedFile>> EncodedFiles(const std::shared_ptr<Draft>& d,
                                                            const std::vector<std::string>& paths);
  // Published as `published`: the mount shows it, the draft becomes history.
  void FinishPublished(const std::shared_ptr<Draft>& d, std::shared_ptr<const Manifest> published);
  // Forgets draft `d` and deletes its staging directory. Busy while it is committed.
  Status RemoveDraft(const std::shared_ptr<Draft>& d);
  void WorkerMain();
  // One job of the queue: a commit, a file encoded now, or a small file added to its batch.
  void RunJob(const std::pair<std::string, std::string>& job);
  // Takes the draft's lease (packs are written under it) if it has none.
  Status EnsureLease(Draft& d);
  // A batch of small files goes when it holds this many files or a pack's worth of bytes, or
  // when no small file of its draft was closed for this long.
  static constexpr size_t kSmallBatchFiles = 16384;
  static constexpr size_t kSmallBatchSyncEach = 32;  // batches up to this size fdatasync each file
  static constexpr std::chrono::milliseconds kSmallIdle{1000};
  // The draft as its journal in `dir` says (snapshot and log); *max_seq: its last record.
  static Expected<nlohmann::json> ReplayJournal(const std::string& dir, uint64_t* max_seq);
  // Loads a draft from its replayed journal (`seq`: its last record) and compacts the journal.
  Status LoadDraft(const std::string& dir, const nlohmann::json& j, uint64_t seq);
};

}  // namespace weightfs
