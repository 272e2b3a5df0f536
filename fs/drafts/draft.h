// The draft model: a draft (a version being written), its files and directories, and who owns
// them. Plain data: Drafts::State (state.h) holds the drafts and says which lock guards what.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/manifest.h"
#include "core/mutex.h"
#include "core/status.h"
#include "hub/engine/lease.h"
#include "hub/store/direct_file.h"

namespace weightfs {

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::string ParentPath(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(path.substr(0, slash));
}

inline std::string Join(const std::string& dir, std::string_view name) {
  return dir.empty() ? std::string(name) : dir + "/" + std::string(name);
}

// A failure to produce the parent's bytes of a file (its rows, a chunk), while reading it or
// copying it up for a write, as the request's Status: the file exists, so a pack or table the
// bucket lost is an I/O error, not "no such file".
inline Status ParentBytes(const Status& st, const std::string& what) {
  if (st.ok()) return st;
  const Status io = st.kind() == ErrorKind::kNotFound ? Status::IOError(st.message()) : st;
  return io.WithContext(what);
}

// Who owns a node of a draft (its directories and files), its permission bits and times: what
// stat shows and what the kernel checks (the mount runs with default_permissions).
struct NodeMeta {
  mode_t mode = 0755;  // permission bits (07777)
  uid_t uid = 0;
  gid_t gid = 0;
  int64_t atime_ns = 0, mtime_ns = 0, ctime_ns = 0;

  static NodeMeta At(mode_t mode, uid_t uid, gid_t gid, int64_t time_ns) {
    return NodeMeta{static_cast<mode_t>(mode & 07777), uid, gid, time_ns, time_ns, time_ns};
  }
  nlohmann::json ToJson() const {
    return {{"mode", mode & 07777}, {"uid", uid}, {"gid", gid},
            {"atime_ns", atime_ns}, {"mtime_ns", mtime_ns}, {"ctime_ns", ctime_ns}};
  }
  // Fields a journal of an older weightfs lacks keep `defaults`'.
  static NodeMeta FromJson(const nlohmann::json& j, NodeMeta m) {
    m.mode = static_cast<mode_t>(j.value("mode", static_cast<unsigned>(m.mode)) & 07777);
    m.uid = j.value("uid", m.uid);
    m.gid = j.value("gid", m.gid);
    m.mtime_ns = j.value("mtime_ns", m.mtime_ns);
    m.atime_ns = j.value("atime_ns", m.mtime_ns);
    m.ctime_ns = j.value("ctime_ns", m.mtime_ns);
    return m;
  }
  void Touch(int64_t now_ns) { mtime_ns = ctime_ns = now_ns; }
  void Fill(struct stat* st) const {
    st->st_uid = uid;
    st->st_gid = gid;
    st->st_atim = {static_cast<time_t>(atime_ns / 1000000000), static_cast<long>(atime_ns % 1000000000)};
    st->st_mtim = {static_cast<time_t>(mtime_ns / 1000000000), static_cast<long>(mtime_ns % 1000000000)};
    st->st_ctim = {static_cast<time_t>(ctime_ns / 1000000000), static_cast<long>(ctime_ns % 1000000000)};
  }
};

// Where the bytes of one parent chunk of a backed file are (DraftFile::present). The values are
// the journal's characters ("present": one per chunk).
enum class ChunkState : char {
  kParent = '0',       // still the parent's: read from the parent, copied up before a partial write
  kCopiedUp = '1',     // copied into the staging file (then perhaps written to)
  kOverwritten = '2',  // written whole in the staging file, never copied
};

// A file of a draft. Inherited (id 0): its bytes are the parent's file `parent_path`. Staged:
// its bytes are the staging file, except — while `backed` — the parent chunks not `present`
// below `backing_limit`, which are still the parent's.
struct DraftFile {
  // Guards the fields marked so, and orders copy-up against writes. `id`, `parent_path`,
  // `parent_file` change only under State::mu as well; `rows` is set once (EnsureRows).
  mutable Mutex mu;
  NodeMeta meta WFS_GUARDED_BY(mu);
  // Where the file is in its draft now ("" once unlinked or renamed over). Guarded by
  // State::mu (the analysis cannot name it from here): a handle finds its file's path without
  // scanning the draft.
  std::string path;
  uint64_t id = 0;
  std::string staging WFS_GUARDED_BY(mu);
  // The staging file's descriptor: open while a handle has the file open (and briefly for the
  // encoder, a truncate or copy-up), else closed: a draft of 100,000 files must not hold
  // 100,000 descriptors (it ran out at ~20,000). EnsureFd before any use.
  int fd WFS_GUARDED_BY(mu) = -1;
  // A save's writes (direct handles) keep little of the staging file in the page cache; the
  // encoder reads it back direct once they dropped some (hub/store/direct_file.h says why).
  StreamedWrites streamed WFS_GUARDED_BY(mu);
  int handles WFS_GUARDED_BY(mu) = 0;  // open handles (DraftHandle) of the file
  uint64_t size WFS_GUARDED_BY(mu) = 0;
  std::string parent_path;                  // inherited or backed: the parent's file
  const ManifestFile* parent_file = nullptr;  // in the draft's parent manifest (its head)
  // The parent's file with its rows (format 2 keeps them in the parent's table: read when first
  // needed, State::EnsureRows). Set once, then never changes.
  std::shared_ptr<const ManifestFile> rows_holder;
  const ManifestFile* rows = nullptr;
  bool backed WFS_GUARDED_BY(mu) = false;
  std::vector<ChunkState> present WFS_GUARDED_BY(mu);  // per parent chunk, while backed
  uint64_t backing_limit WFS_GUARDED_BY(mu) = 0;
  int writers WFS_GUARDED_BY(mu) = 0;
  // Write-only handles opened with no other handle of the file open: they write around the
  // kernel's page cache (fuse direct_io), and while one is open every handle opened is direct
  // too, so that no cached page of the file goes stale under their writes.
  int direct_writers WFS_GUARDED_BY(mu) = 0;
  uint64_t generation WFS_GUARDED_BY(mu) = 0;  // bumped by every change of the bytes
  bool encoding WFS_GUARDED_BY(mu) = false;
  int readers WFS_GUARDED_BY(mu) = 0;  // encodes reading the staging file: it must not shrink in place
  // The part file (parts/) that holds the file's encoded manifest, "" = not encoded. A part
  // may hold many files (small files are encoded together, their payloads in shared packs):
  // the file is the part's file `encoded_path`. Draft::part_refs counts its users.
  std::string encoded WFS_GUARDED_BY(mu);
  std::string encoded_path WFS_GUARDED_BY(mu);  // the path it was encoded as
  uint64_t encoded_generation WFS_GUARDED_BY(mu) = 0;
  bool journal_dirty WFS_GUARDED_BY(mu) = false;  // times or `present` changed since its last journal record
  // A write failed (disk full...): the file is not what its writer meant; commit refuses it
  // until it is truncated to zero, rewritten with O_TRUNC or removed.
  std::string write_error WFS_GUARDED_BY(mu);
  // The encoded part's element tallies (PushResult's), for the version's changed fraction.
  std::array<uint64_t, 4> tally WFS_GUARDED_BY(mu){};  // tensor elements, tensor changed, other elements, other changed

  DraftFile() = default;
  explicit DraftFile(NodeMeta m) : meta(m) {}
  ~DraftFile() {
    if (fd >= 0) ::close(fd);
  }
  // Whether parent chunk `c` is still the parent's, to be copied up: the file is backed, the
  // chunk not copied or overwritten, and it starts below the backing limit. A copy-up fetches
  // the chunk without the lock and checks again with it before writing: in between a
  // truncate may have cut the file below the chunk (writing it would grow the staging file
  // back past its end with the parent's bytes, and the next encode would publish them), an
  // O_TRUNC open may have dropped the parent, or another copy-up (a write's, Fill) done it.
  // REQUIRES mu; `rows` loaded.
  bool StillBackedAt(size_t c) const WFS_REQUIRES(mu) {
    return backed && c < present.size() && present[c] == ChunkState::kParent && rows->chunks[c].offset < backing_limit;
  }
  // What must hold between the fields that say where the bytes are (a journal read back from
  // disk is checked with it): an inherited file has no staging state; a backed file has one
  // state per parent chunk and a backing limit within the parent's size; a file that is not
  // backed has no copy-up map. InvalidArgument naming the first that does not hold. REQUIRES mu.
  Status CheckInvariants() const WFS_REQUIRES(mu) {
    if (id == 0 && (backed || !present.empty())) return Status::InvalidArgument("an inherited file with a copy-up map");
    if (!backed && !present.empty()) return Status::InvalidArgument("a copy-up map without a parent");
    if (backed) {
      if (!parent_file) return Status::InvalidArgument("backed by no parent file");
      if (present.size() != parent_file->RowCount()) return Status::InvalidArgument("a copy-up map of the wrong length");
      if (backing_limit > parent_file->size) return Status::InvalidArgument("a backing limit past the parent's end");
      for (ChunkState c : present) {
        if (c != ChunkState::kParent && c != ChunkState::kCopiedUp && c != ChunkState::kOverwritten) {
          return Status::InvalidArgument("an unknown chunk state");
        }
      }
    }
    return Status::Ok();
  }
  // Opens the staging file if its descriptor is closed. REQUIRES mu.
  Status EnsureFd() WFS_REQUIRES(mu) {
    if (fd >= 0 || id == 0) return Status::Ok();
    fd = ::open(staging.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return StatusOfErrno(errno, "cannot open staging file " + staging);
    return Status::Ok();
  }
  // Closes the descriptor if no handle uses it. REQUIRES mu.
  void CloseIdleFd() WFS_REQUIRES(mu) {
    if (handles == 0 && fd >= 0) {
      ::close(fd);
      fd = -1;
    }
  }
  bool Encoded(const std::string& path) const WFS_REQUIRES(mu) {
    return id == 0 || (!encoded.empty() && encoded_generation == generation && encoded_path == path);
  }
};

struct Draft {
  std::string id, model, version;
  std::optional<std::string> parent;
  std::shared_ptr<const Manifest> parent_manifest;
  int64_t created_ms = 0;
  uint64_t next_id = 1;
  NodeMeta root;  // the draft's directory
  std::map<std::string, std::shared_ptr<DraftFile>> files;
  std::map<std::string, NodeMeta> dirs;
  bool commit_requested = false;
  std::string commit_as;
  // A part of a version written by several nodes (docs/parts.md): `parts` > 0 once
  // `commit --parts N` ran; `part_id` names this draft's part in the bucket for the version's
  // life (kept in the journal: a resumed part is never counted twice).
  int parts = 0;
  std::string part_id;
  std::string part_state;  // the last look at the staged version, for status
  size_t parts_in = 0;
  bool committing = false;
  std::string error;         // the last commit's or set-parent's failure (user.weightfs.error)
  std::string encode_error;  // the last background encode's failure
  std::unique_ptr<Lease> lease;
  std::string dir;
  // Users of each part file (DraftFile::encoded), under State::mu: a part holding many
  // files is deleted when the last of them is encoded again or removed.
  std::map<std::string, size_t> part_refs;

  // ---- the journal (journal.cc): a snapshot (journal.json) and records appended after it
  // (journal.log). Records are built under State::mu and queued in sequence order in
  // `journal_out`; whoever holds journal_mu writes what is queued, in that order.
  // Under State::mu: paths whose node changed since the last record (a file, a directory, a
  // path removed); the next record says what each is now. `journal_snapshot`: the next write
  // is a whole snapshot (a new parent, a failed append).
  std::set<std::string> journal_paths;
  bool journal_snapshot = false;
  uint64_t journal_seq = 0;
  struct JournalOut {
    std::optional<std::string> snapshot;  // written first, then the log starts again
    std::string records;                  // lines after it
    uint64_t last_seq = 0;
  };
  Mutex journal_out_mu;  // a leaf
  JournalOut journal_out WFS_GUARDED_BY(journal_out_mu);
  // Taken after State::mu is released, never under it.
  Mutex journal_mu;
  uint64_t journal_written WFS_GUARDED_BY(journal_mu) = 0;  // every record up to this one is in the page cache
  int journal_fd WFS_GUARDED_BY(journal_mu) = -1;           // journal.log, O_APPEND
  bool journal_unsynced WFS_GUARDED_BY(journal_mu) = false;
  int64_t journal_synced_ns WFS_GUARDED_BY(journal_mu) = 0;
  // Read under State::mu to decide when to compact.
  std::atomic<uint64_t> journal_log_bytes{0}, journal_snapshot_bytes{0};
  std::atomic<bool> journal_failed{false};  // an append failed: the next write is a snapshot

  Draft() = default;
  Draft(const Draft&) = delete;
  Draft& operator=(const Draft&) = delete;
  ~Draft() {
    if (journal_fd >= 0) ::close(journal_fd);
  }

  std::string name() const { return model + "@" + version; }
  // The draft lists exactly the parent's files, unchanged (a new draft, or a new parent);
  // they and their directories belong to `uid`/`gid` (the mount's owner).
  void InheritAll(std::shared_ptr<const Manifest> manifest, uid_t uid, gid_t gid) {
    parent_manifest = std::move(manifest);
    parent = parent_manifest->version;
    for (auto& [p, f] : files) f->path.clear();
    files.clear();
    dirs.clear();
    journal_snapshot = true;  // the whole tree changed
    const int64_t t = parent_manifest->created_ms * 1000000;
    for (const ManifestFile& pf : parent_manifest->files) {
      auto f = std::make_shared<DraftFile>(NodeMeta::At(0644, uid, gid, t));
      f->path = pf.path;
      f->parent_path = pf.path;
      f->parent_file = &pf;
      for (std::string p = ParentPath(pf.path); !p.empty(); p = ParentPath(p)) {
        dirs.emplace(p, NodeMeta::At(0755, uid, gid, t));
      }
      files.emplace(pf.path, std::move(f));
    }
  }
  // Whether the draft is still its parent: the parent's files, none written, renamed or
  // removed, none added. Unmount does not publish such a draft (a mkdir alone made a new
  // @latest of 0 changes). REQUIRES State::mu.
  bool Unchanged() const {
    if (!parent_manifest || files.size() != parent_manifest->files.size()) return false;
    for (const auto& [p, f] : files) {
      MutexLock flock(f->mu);
      if (f->id != 0 || !f->parent_file || f->parent_path != p) return false;
    }
    return true;
  }
  // Directories directly inside directory `path` ("" = the draft's own): a directory's link
  // count is 2 plus these (its "." and its subdirectories' "..").
  uint32_t SubdirCount(const std::string& path) const {
    const std::string prefix = path.empty() ? "" : path + "/";
    uint32_t n = 0;
    for (auto it = dirs.lower_bound(prefix); it != dirs.end() && it->first.starts_with(prefix); ++it) {
      if (it->first.find('/', prefix.size()) == std::string::npos) ++n;
    }
    return n;
  }
  // Whether a file or directory lies inside directory `path` (the maps are sorted: the first
  // key after "path/" tells).
  bool HasEntriesUnder(const std::string& path) const {
    const std::string prefix = path + "/";
    auto f = files.lower_bound(prefix);
    auto d = dirs.lower_bound(prefix);
    return (f != files.end() && f->first.starts_with(prefix)) || (d != dirs.end() && d->first.starts_with(prefix));
  }
  // The journal's next record says what `path` is now (a file, a directory, or gone). REQUIRES
  // State::mu.
  void Changed(const std::string& path) { journal_paths.insert(path); }
  // Directory `path`'s entries changed: its mtime and ctime are now.
  // The owner and times of directory `path` ("" = the draft's own); null if there is none.
  NodeMeta* DirMeta(const std::string& path) {
    if (path.empty()) return &root;
    auto it = dirs.find(path);
    return it == dirs.end() ? nullptr : &it->second;
  }
  // Directory `path`'s entries changed: its mtime and ctime are now.
  void TouchDir(const std::string& path) {
    if (NodeMeta* m = DirMeta(path)) m->Touch(NowNs());
    if (!path.empty()) Changed(path);  // (the root's meta is in every record)
  }
  // A part file gains or loses a user. Release returns true when it has none left (the
  // caller deletes it). REQUIRES State::mu.
  void RetainPart(const std::string& part) {
    if (!part.empty()) part_refs[part]++;
  }
  bool ReleasePart(const std::string& part) {
    if (part.empty()) return false;
    auto it = part_refs.find(part);
    if (it == part_refs.end()) return true;
    if (--it->second > 0) return false;
    part_refs.erase(it);
    return true;
  }
  std::string StagingPath(uint64_t id_) const { return dir + "/files/" + std::to_string(id_); }
  std::string PartPath(const std::string& part) const { return dir + "/parts/" + part; }
};

}  // namespace weightfs
