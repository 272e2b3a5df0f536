#include "fs/drafts.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/safetensors.h"
#include "core/thread_pool.h"
#include "engine/lease.h"
#include "engine/mapped_file.h"
#include "fs/status_errno.h"

namespace weightfs {

namespace {

constexpr const char* kXattrParent = "user.weightfs.parent";
constexpr const char* kXattrState = "user.weightfs.state";
constexpr const char* kXattrError = "user.weightfs.error";

int StatusToErrnoLogged(const Status& status, const std::string& operation) {
  return StatusToErrno(status, ErrnoContext::kData, operation);
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string ParentPath(std::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == std::string_view::npos ? std::string() : std::string(path.substr(0, slash));
}

std::string Join(const std::string& dir, std::string_view name) {
  return dir.empty() ? std::string(name) : dir + "/" + std::string(name);
}

std::string Errno(std::string_view what, int err) {
  return std::string(what) + ": " + std::strerror(err);
}

// Writes `bytes` to `path` so that a crash leaves the old or the new content.
Status WriteAtomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::IOError(Errno("cannot write " + tmp, errno));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return err == ENOSPC ? Status::ResourceExhausted(Errno("writing " + tmp, err))
                           : Status::IOError(Errno("writing " + tmp, err));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IOError(Errno("fsync " + tmp, err));
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return Status::IOError(Errno("rename to " + path, errno));
  const std::string dir = ParentPath(path);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

Expected<std::string> ReadWholeFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotFound(Errno("cannot read " + path, errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Status::IOError(Errno("reading " + path, err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

int PwriteAll(int fd, const uint8_t* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return 0;
}

// Reads up to n bytes; short only at the end of the file (the rest is left zero).
int PreadAll(int fd, uint8_t* p, size_t n, uint64_t off) {
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) {
      std::memset(p, 0, n);
      return 0;
    }
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return 0;
}

// Rows a file of a manifest has, loaded or not (a format 2 head knows the count).
size_t RowCount(const ManifestFile& f) { return f.rows_loaded ? f.chunks.size() : f.section.rows; }

}  // namespace

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

// A file of a draft. Inherited (id 0): its bytes are the parent's file `parent_path`. Staged:
// its bytes are the staging file, except — while `backed` — the parent chunks not `present`
// below `backing_limit`, which are still the parent's.
struct DraftFile {
  std::mutex mu;  // guards everything below, and orders copy-up against writes
  NodeMeta meta;
  uint64_t id = 0;
  std::string staging;
  int fd = -1;
  uint64_t size = 0;
  std::string parent_path;                  // inherited or backed: the parent's file
  const ManifestFile* parent_file = nullptr;  // in the draft's parent manifest (its head)
  // The parent's file with its rows (format 2 keeps them in the parent's table: read when first
  // needed, State::EnsureRows). Set once, then never changes.
  std::shared_ptr<const ManifestFile> rows_holder;
  const ManifestFile* rows = nullptr;
  bool backed = false;
  std::vector<char> present;
  uint64_t backing_limit = 0;
  int writers = 0;
  uint64_t generation = 0;  // bumped by every change of the bytes
  bool encoding = false;
  int mapped = 0;  // encodes holding a map of the staging file: it must not shrink in place
  std::string encoded;       // part file name; "" = not encoded
  std::string encoded_path;  // the path it was encoded as
  uint64_t encoded_generation = 0;
  bool journal_dirty = false;  // `present` changed since the journal was written
  // A write failed (disk full...): the file is not what its writer meant; commit refuses it
  // until it is truncated to zero, rewritten with O_TRUNC or removed.
  std::string write_error;
  // The encoded part's element tallies (PushResult's), for the version's changed fraction.
  std::array<uint64_t, 4> tally{};  // tensor elements, tensor changed, other elements, other changed

  ~DraftFile() {
    if (fd >= 0) ::close(fd);
  }
  bool Encoded(const std::string& path) const {
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
  bool committing = false;
  std::string error;         // the last commit's or set-parent's failure (user.weightfs.error)
  std::string encode_error;  // the last background encode's failure
  std::unique_ptr<Lease> lease;
  std::string dir;
  // Journal writes: built under State::mu, written in sequence order under journal_mu.
  std::mutex journal_mu;
  uint64_t journal_seq = 0, journal_written = 0;

  std::string name() const { return model + "@" + version; }
  // The draft lists exactly the parent's files, unchanged (a new draft, or a new parent);
  // they and their directories belong to `uid`/`gid` (the mount's owner).
  void InheritAll(std::shared_ptr<const Manifest> manifest, uid_t uid, gid_t gid) {
    parent_manifest = std::move(manifest);
    parent = parent_manifest->version;
    files.clear();
    dirs.clear();
    const int64_t t = parent_manifest->created_ms * 1000000;
    for (const ManifestFile& pf : parent_manifest->files) {
      auto f = std::make_shared<DraftFile>();
      f->meta = NodeMeta::At(0644, uid, gid, t);
      f->parent_path = pf.path;
      f->parent_file = &pf;
      for (std::string p = ParentPath(pf.path); !p.empty(); p = ParentPath(p)) {
        dirs.emplace(p, NodeMeta::At(0755, uid, gid, t));
      }
      files.emplace(pf.path, std::move(f));
    }
  }
  // Whether a file or directory lies inside directory `path`.
  bool HasEntriesUnder(const std::string& path) const {
    const std::string prefix = path + "/";
    auto under = [&](const auto& e) { return e.first.starts_with(prefix); };
    return std::any_of(files.begin(), files.end(), under) || std::any_of(dirs.begin(), dirs.end(), under);
  }
  // The owner and times of directory `path` ("" = the draft's own); null if there is none.
  NodeMeta* DirMeta(const std::string& path) {
    if (path.empty()) return &root;
    auto it = dirs.find(path);
    return it == dirs.end() ? nullptr : &it->second;
  }
  // Directory `path`'s entries changed: its mtime and ctime are now.
  void TouchDir(const std::string& path) {
    if (NodeMeta* m = DirMeta(path)) m->Touch(NowNs());
  }
  std::string StagingPath(uint64_t id_) const { return dir + "/files/" + std::to_string(id_); }
  std::string PartPath(const std::string& part) const { return dir + "/parts/" + part; }
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

  mutable std::mutex mu;  // guards what follows; a leaf except for DraftFile::mu taken under it
  std::map<std::string, std::shared_ptr<Draft>> drafts;  // by "model@version"
  std::set<std::string> new_dirs;                         // made by mkdir, above versions
  std::map<std::string, std::vector<std::string>> published_dirs;  // model -> retired state dirs
  std::set<std::string> published_names;  // drafts published by this mount, by "model@version"
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
  std::map<std::string, uint64_t> inos;
  std::unordered_map<uint64_t, Ref> refs;
  uint64_t next_ino = kFirstIno;

  // Background work: encode (draft, path) or commit (draft, "").
  std::mutex queue_mu;
  std::condition_variable queue_cv;
  std::deque<std::pair<std::string, std::string>> queue;
  bool stopping = false;
  std::thread worker;
  std::condition_variable encoded_cv;  // DraftFile::encoding cleared (with mu)
  std::mutex encode_mu;                // one encode at a time (they share the pool)

  State(Bucket* b, ChunkCache* c, Materializer* m, ChunkReader* r, DraftsOptions o)
      : bucket(b), cache(c), materializer(m), reader(r), options(std::move(o)), pool(options.encode_threads) {}

  // ---- inodes (REQUIRES mu) ----
  static std::string Key(Type t, const std::string& a, const std::string& b) {
    return std::string(1, static_cast<char>(t)) + a + '\0' + b;
  }
  uint64_t InoLocked(Type t, const std::string& a, const std::string& b = {}) {
    auto [it, inserted] = inos.emplace(Key(t, a, b), next_ino);
    if (inserted) refs[next_ino++] = Ref{t, a, b};
    return it->second;
  }
  const Ref* RefLocked(uint64_t ino) const {
    auto it = refs.find(ino);
    return it == refs.end() || it->second.removed ? nullptr : &it->second;
  }
  // Item `path` of draft `name` is gone: a new node at the path gets a new number (the kernel
  // must not take it for the old one, which an open file may still hold).
  void RetireLocked(const std::string& name, const std::string& path, std::weak_ptr<DraftFile> file) {
    auto it = inos.find(Key(Type::kItem, name, path));
    if (it == inos.end()) return;
    Ref& r = refs[it->second];
    r.removed = true;
    r.removed_file = std::move(file);
    inos.erase(it);
  }
  // Moves the inodes of `from` (and everything under it) to `to` inside draft `name`.
  void RekeyLocked(const std::string& name, const std::string& from, const std::string& to) {
    std::vector<std::pair<std::string, uint64_t>> moved;
    const std::string k = Key(Type::kItem, name, from);
    if (auto it = inos.find(k); it != inos.end()) {
      moved.emplace_back(to, it->second);
      inos.erase(it);
    }
    // (Keys like "from-x" sort between "from" and "from/...": the children are a range of
    // their own.)
    const std::string prefix = k + "/";
    for (auto it = inos.lower_bound(prefix); it != inos.end() && it->first.starts_with(prefix);) {
      moved.emplace_back(to + it->first.substr(k.size()), it->second);
      it = inos.erase(it);
    }
    for (auto& [path, ino] : moved) {
      inos.erase(Key(Type::kItem, name, path));
      inos[Key(Type::kItem, name, path)] = ino;
      refs[ino] = Ref{Type::kItem, name, path};
    }
  }

  // Every node of draft `name` (removed, or published and replaced by a new draft of the same
  // name): their numbers never name anything again.
  void RetireDraftLocked(const std::string& name) {
    for (Type t : {Type::kDraftDir, Type::kItem}) {
      const std::string prefix = Key(t, name, "");
      for (auto it = inos.lower_bound(prefix); it != inos.end() && it->first.starts_with(prefix);) {
        if (t == Type::kItem || it->first == prefix) {
          refs[it->second].removed = true;
          it = inos.erase(it);
        } else {
          ++it;
        }
      }
    }
  }

  std::shared_ptr<Draft> DraftLocked(const std::string& name) const {
    auto it = drafts.find(name);
    return it == drafts.end() ? nullptr : it->second;
  }
  // The errno for a node of draft `name`, which is gone: ESTALE if it was published (the
  // kernel then walks the path again and finds the published version: a lookup that raced
  // the commit retries instead of failing), else ENOENT.
  int GoneLocked(const std::string& name) const { return published_names.count(name) ? ESTALE : ENOENT; }

  // The model path of draft directories listed in `dir_path` ("leaf@version" there).
  static std::string ModelDir(const std::string& model) { return ParentPath(model); }
  static std::string Leaf(const std::string& model) {
    const size_t slash = model.rfind('/');
    return slash == std::string::npos ? model : model.substr(slash + 1);
  }
  // New directories shown in `dir_path`: made by mkdir, or above a draft of a new model.
  std::set<std::string> NewDirsInLocked(const std::string& dir_path) const {
    std::set<std::string> out;
    auto add_ancestors = [&](const std::string& path) {
      // `path` or its ancestor directly in dir_path, if any.
      std::string p = path;
      while (!p.empty()) {
        std::string parent = ParentPath(p);
        if (parent == dir_path) {
          out.insert(p);
          break;
        }
        p = parent;
      }
    };
    for (const std::string& d : new_dirs) add_ancestors(d);
    for (const auto& [name, d] : drafts) add_ancestors(ParentPath(d->model));
    return out;
  }

  // ---- attributes (REQUIRES mu) ----
  void DirAttr(uint64_t ino, const NodeMeta& meta, NodeAttr* out) const {
    out->ino = ino;
    out->st = {};
    out->st.st_ino = ino;
    out->st.st_mode = S_IFDIR | (meta.mode & 07777);
    out->st.st_nlink = 2;
    out->st.st_size = 4096;
    out->st.st_blksize = 1 << 20;
    meta.Fill(&out->st);
    out->timeout_s = 0;
  }
  void FileAttr(uint64_t ino, DraftFile& f, NodeAttr* out) const {
    std::lock_guard<std::mutex> lock(f.mu);
    DirAttr(ino, f.meta, out);
    out->st.st_mode = S_IFREG | (f.meta.mode & 07777);
    out->st.st_nlink = 1;
    out->st.st_size = static_cast<off_t>(f.id == 0 && f.parent_file ? f.parent_file->size : f.size);
    out->st.st_blocks = (out->st.st_size + 511) / 512;
  }
  int AttrLocked(uint64_t ino, NodeAttr* out) {
    if (auto it = refs.find(ino); it != refs.end() && it->second.removed) {
      std::shared_ptr<DraftFile> f = it->second.removed_file.lock();
      if (!f) return ENOENT;
      FileAttr(ino, *f, out);
      out->st.st_nlink = 0;
      return 0;
    }
    const Ref* r = RefLocked(ino);
    if (!r) return ENOENT;
    switch (r->type) {
      case Type::kNewDir: {
        if (!new_dirs.count(r->a) && NewDirsInLocked(ParentPath(r->a)).count(r->a) == 0) return ENOENT;
        DirAttr(ino, NodeMeta::At(0755, options.uid, options.gid, 0), out);
        return 0;
      }
      case Type::kDraftDir: {
        std::shared_ptr<Draft> d = DraftLocked(r->a);
        if (!d) return GoneLocked(r->a);
        DirAttr(ino, d->root, out);
        return 0;
      }
      case Type::kItem: {
        std::shared_ptr<Draft> d = DraftLocked(r->a);
        if (!d) return GoneLocked(r->a);
        if (auto it = d->files.find(r->b); it != d->files.end()) {
          FileAttr(ino, *it->second, out);
          return 0;
        }
        if (auto it = d->dirs.find(r->b); it != d->dirs.end()) {
          DirAttr(ino, it->second, out);
          return 0;
        }
        return ENOENT;
      }
    }
    return ENOENT;
  }

  // ---- journal ----
  nlohmann::json JournalLocked(Draft& d, bool published = false) {
    nlohmann::json j;
    j["format"] = 1;
    j["model"] = d.model;
    j["version"] = d.version;
    j["parent"] = d.parent ? nlohmann::json(*d.parent) : nlohmann::json(nullptr);
    j["created_ms"] = d.created_ms;
    j["next_id"] = d.next_id;
    j["commit"] = d.commit_requested;
    j["commit_as"] = d.commit_as;
    j["published"] = published;
    j["root"] = d.root.ToJson();
    j["dirs"] = nlohmann::json::array();
    for (const auto& [path, meta] : d.dirs) {
      nlohmann::json e = meta.ToJson();
      e["path"] = path;
      j["dirs"].push_back(std::move(e));
    }
    j["files"] = nlohmann::json::array();
    for (auto& [path, f] : d.files) {
      std::lock_guard<std::mutex> lock(f->mu);
      nlohmann::json e;
      e = f->meta.ToJson();
      e["path"] = path;
      e["id"] = f->id;
      e["parent_path"] = f->parent_path;
      e["backed"] = f->backed;
      if (f->backed) {
        e["present"] = std::string(f->present.begin(), f->present.end());
        e["backing_limit"] = f->backing_limit;
      }
      const bool valid = f->id != 0 && f->Encoded(path);
      e["encoded"] = valid ? f->encoded : "";
      e["encoded_path"] = valid ? f->encoded_path : "";
      e["write_error"] = f->write_error;
      e["tally"] = f->tally;
      f->journal_dirty = false;
      j["files"].push_back(std::move(e));
    }
    return j;
  }

  // Writes the draft's journal as it is now. REQUIRES mu not held.
  Status SaveJournal(Draft& d, bool published = false) {
    std::string text;
    uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(mu);
      text = JournalLocked(d, published).dump();
      seq = ++d.journal_seq;
    }
    std::lock_guard<std::mutex> lock(d.journal_mu);
    if (seq <= d.journal_written) return Status::Ok();  // a newer state was written already
    Status s = WriteAtomically(d.dir + "/journal.json", text);
    if (s.ok()) d.journal_written = seq;
    if (!s.ok()) spdlog::error("draft {}: cannot write its journal: {}", d.name(), s.ToString());
    return s;
  }

  int SaveJournalErrno(Draft& d) {
    Status st = SaveJournal(d);
    return st.ok() ? 0 : st.kind() == ErrorKind::kResourceExhausted ? ENOSPC : EIO;
  }

  // ---- staging (REQUIRES mu and f.mu) ----
  int StageLocked(Draft& d, DraftFile& f, bool backed) {
    f.id = d.next_id++;
    f.staging = d.StagingPath(f.id);
    f.fd = ::open(f.staging.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (f.fd < 0) {
      const int err = errno;
      spdlog::error("draft {}: cannot create staging file {}: {}", d.name(), f.staging, std::strerror(err));
      f.id = 0;
      return err;
    }
    f.size = 0;
    f.backed = false;
    if (backed && f.parent_file) {
      if (::ftruncate(f.fd, static_cast<off_t>(f.parent_file->size)) != 0) return errno;
      f.size = f.parent_file->size;
      f.backed = true;
      f.present.assign(RowCount(*f.parent_file), '0');
      f.backing_limit = f.parent_file->size;
    }
    return 0;
  }

  // Sets a staged file's length to `size`. A file that an encode has mapped must not shrink
  // in place (the encoder would fault on the pages cut off): it moves to a new staging file,
  // numbered `spare_id` (allocated by the caller under mu), holding the bytes that stay; the
  // map keeps the old one's pages until it goes. The old file's path is returned in
  // *unlink_after: the caller removes it once the journal names the new one (a crash before
  // leaves the old, consistent state). Returns 0 or an errno. REQUIRES f.mu.
  int ResizeLocked(Draft& d, DraftFile& f, uint64_t size, uint64_t spare_id, std::string* unlink_after) {
    if (f.mapped == 0 || size >= f.size) {
      if (::ftruncate(f.fd, static_cast<off_t>(size)) != 0) return errno;
      f.size = size;
      return 0;
    }
    const std::string path = d.StagingPath(spare_id);
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return errno;
    auto fail = [&](int err) {
      ::close(fd);
      ::unlink(path.c_str());
      return err;
    };
    loff_t in = 0, out = 0;
    while (static_cast<uint64_t>(in) < size) {
      ssize_t n = ::copy_file_range(f.fd, &in, fd, &out, size - static_cast<uint64_t>(in), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
        std::vector<uint8_t> buf(1 << 20);
        while (static_cast<uint64_t>(in) < size) {
          const size_t want = std::min<uint64_t>(buf.size(), size - static_cast<uint64_t>(in));
          if (int err = PreadAll(f.fd, buf.data(), want, static_cast<uint64_t>(in)); err != 0) return fail(err);
          if (int err = PwriteAll(fd, buf.data(), want, static_cast<uint64_t>(in)); err != 0) return fail(err);
          in += static_cast<loff_t>(want);
        }
        break;
      }
      if (n < 0) return fail(errno);
      if (n == 0) break;  // the old file is shorter than f.size said: the rest reads as zeros
    }
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) return fail(errno);
    spdlog::debug("draft {}: staging file {} shrinks while it is encoded; moved to {}", d.name(), f.staging, path);
    unlink_after->assign(f.staging);
    ::close(f.fd);
    f.fd = fd;
    f.staging = path;
    f.id = spare_id;
    f.size = size;
    return 0;
  }

  void Enqueue(const std::string& draft, const std::string& path) {
    {
      std::lock_guard<std::mutex> lock(queue_mu);
      queue.emplace_back(draft, path);
    }
    queue_cv.notify_one();
  }

  // Fills the parent chunks a backed file has not copied yet. REQUIRES no lock held.
  // Loads the rows of f's parent file (once). REQUIRES no lock held (it may read the bucket).
  Status EnsureRows(Draft& d, DraftFile& f) {
    const ManifestFile* head;
    {
      std::lock_guard<std::mutex> lock(f.mu);
      if (f.rows || !f.parent_file) return Status::Ok();
      head = f.parent_file;
    }
    Expected<std::shared_ptr<const ManifestFile>> rows = bucket->File(d.parent_manifest, *head);
    if (!rows.ok()) return rows.status().WithContext("reading the rows of " + head->path + " in the parent");
    std::lock_guard<std::mutex> lock(f.mu);
    if (!f.rows) {
      f.rows_holder = std::move(rows).value();
      f.rows = f.rows_holder.get();
    }
    return Status::Ok();
  }
  int EnsureRowsErrno(Draft& d, DraftFile& f, const std::string& what) {
    Status st = EnsureRows(d, f);
    return st.ok() ? 0 : StatusToErrnoLogged(st, what);
  }

  Status Fill(Draft& d, DraftFile& f) {
    WFS_TRY(EnsureRows(d, f));
    std::vector<size_t> missing;
    const ManifestFile* pf;
    {
      std::lock_guard<std::mutex> lock(f.mu);
      if (!f.backed) return Status::Ok();
      pf = f.rows;
      for (size_t c = 0; c < f.present.size(); ++c) {
        if (f.present[c] == '0' && pf->chunks[c].offset < f.backing_limit) missing.push_back(c);
      }
    }
    for (size_t c : missing) {
      Expected<ByteBuffer> bytes = materializer->Chunk(*d.parent_manifest, *pf, c);
      if (!bytes.ok()) return bytes.status().WithContext("copying " + f.parent_path + " from the parent");
      std::lock_guard<std::mutex> lock(f.mu);
      // While the chunk was fetched the file may have been truncated below it (backing_limit)
      // or rewritten with O_TRUNC (not backed at all): writing it then would grow the staging
      // file back past its end with the parent's bytes, and the next encode would publish them.
      const uint64_t off = pf->chunks[c].offset;
      if (!f.backed || c >= f.present.size() || f.present[c] != '0' || off >= f.backing_limit) continue;
      const uint64_t len = std::min<uint64_t>(bytes->size(), f.backing_limit - off);
      if (int err = PwriteAll(f.fd, bytes->data(), len, off); err != 0) {
        return err == ENOSPC ? Status::ResourceExhausted(Errno("staging " + f.staging, err))
                             : Status::IOError(Errno("staging " + f.staging, err));
      }
      f.present[c] = '1';
    }
    {
      std::lock_guard<std::mutex> lock(f.mu);
      if (::fdatasync(f.fd) != 0) return Status::IOError(Errno("fsync " + f.staging, errno));
      f.backed = false;
      f.present.clear();
    }
    return SaveJournal(d);
  }

  // Encodes the staged file at `path` unless it is encoded already. Waits for an encode of
  // the same file in progress. Busy (InvalidArgument) while the file is open for writing.
  Status EnsureEncoded(const std::shared_ptr<Draft>& d, const std::string& path) {
    std::shared_ptr<DraftFile> f;
    uint64_t generation;
    {
      std::unique_lock<std::mutex> lock(mu);
      for (;;) {
        auto it = d->files.find(path);
        if (it == d->files.end()) return Status::Ok();  // removed meanwhile
        f = it->second;
        std::unique_lock<std::mutex> flock(f->mu);
        if (f->Encoded(path)) return Status::Ok();
        if (!f->write_error.empty()) {
          return Status::InvalidArgument("a write to " + d->name() + "/" + path + " failed (" + f->write_error +
                                         "); write the file again or remove it, then commit");
        }
        if (f->writers > 0) {
          return Status::InvalidArgument(d->name() + "/" + path + " is still open for writing");
        }
        if (!f->encoding) {
          f->encoding = true;
          generation = f->generation;
          break;
        }
        flock.unlock();
        encoded_cv.wait(lock);
      }
    }
    Status s = EncodeNow(d, f, path, generation);
    {
      std::lock_guard<std::mutex> lock(mu);
      std::lock_guard<std::mutex> flock(f->mu);
      f->encoding = false;
    }
    encoded_cv.notify_all();
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      d->encode_error = s.ToString();
    }
    return s;
  }

  Status EncodeNow(const std::shared_ptr<Draft>& d, const std::shared_ptr<DraftFile>& f,
                   const std::string& path, uint64_t generation) {
    std::lock_guard<std::mutex> serial(encode_mu);
    const auto start = std::chrono::steady_clock::now();
    WFS_TRY(Fill(*d, *f));
    {
      std::unique_lock<std::mutex> lock(mu);
      if (!d->lease) {
        lock.unlock();
        Expected<std::unique_ptr<Lease>> lease = Lease::Acquire(&bucket->store(), d->name() + " (draft)");
        if (!lease.ok()) return lease.status().WithContext("taking a lease for the draft's packs");
        lock.lock();
        if (!d->lease) d->lease = std::move(lease).value();
      }
    }
    // The staging file is mapped under the file's lock and counted in `mapped` until the map
    // goes: while it is, the file never shrinks in place (ResizeLocked moves it instead), so
    // the encoder cannot fault on pages cut off under it. Writes may still change it: the
    // result is then stale (generation) and thrown away.
    std::string staging;
    uint64_t id;
    MappedFile mapped;
    {
      std::lock_guard<std::mutex> lock(f->mu);
      if (f->generation != generation) return Status::Ok();  // changed: encoded on its next close
      if (::fdatasync(f->fd) != 0) return Status::IOError(Errno("fsync " + f->staging, errno));
      staging = f->staging;
      id = f->id;
      Expected<MappedFile> m = MappedFile::Open(staging);
      if (!m.ok()) return m.status();
      mapped = std::move(m).value();
      f->mapped++;
    }
    struct Unmap {
      DraftFile& f;
      MappedFile& mapped;
      ~Unmap() {
        mapped = MappedFile();
        std::lock_guard<std::mutex> lock(f.mu);
        f.mapped--;
      }
    };
    // Whether the bytes the encoder saw are not the file's any more (a write since, or a
    // truncation from outside weightfs that the map's guard caught).
    auto stale = [&] {
      std::lock_guard<std::mutex> lock(f->mu);
      return f->generation != generation;
    };
    Expected<Manifest> encoded = Status::IOError("not encoded");
    PushResult result;
    const uint64_t size = mapped.size();
    bool faulted = false;
    {
      Unmap unmap{*f, mapped};
      VersionEncoder encoder(*bucket, cache, pool, VersionRef{d->model, d->version}, d->parent_manifest,
                             options.push, size);
      Status added = encoder.AddFile(path, mapped.bytes(), staging);
      encoded = added.ok() ? encoder.Finish(&result) : Expected<Manifest>(added);
      faulted = mapped.faulted();
    }
    if (stale()) return Status::Ok();  // encoded again on its next close
    if (faulted) {
      return Status::IOError("staging file " + staging + " of " + d->name() + "/" + path +
                             " shrank while it was encoded, not through the mount; write the file again");
    }
    if (!encoded.ok()) return encoded.status();
    Manifest part = std::move(encoded).value();
    const std::string part_name = std::to_string(id) + "-" + std::to_string(NowNs());
    const std::vector<uint8_t> bytes = SerializeManifest(part);
    WFS_TRY(WriteAtomically(d->PartPath(part_name),
                            std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())));
    bool current = false;
    std::string old_part;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = d->files.find(path);
      if (it != d->files.end() && it->second == f) {
        std::lock_guard<std::mutex> flock(f->mu);
        if (f->generation == generation) {
          old_part = f->encoded;
          f->tally = {result.tensor_elements, result.tensor_changed, result.other_elements, result.other_changed};
          f->encoded = part_name;
          f->encoded_path = path;
          f->encoded_generation = generation;
          current = true;
        }
      }
    }
    if (!current) {
      ::unlink(d->PartPath(part_name).c_str());
      return Status::Ok();
    }
    if (!old_part.empty()) ::unlink(d->PartPath(old_part).c_str());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    spdlog::info("draft {}: encoded {} ({} bytes -> {} stored, {} full / {} delta / {} same chunks) in {:.2f} s",
                 d->name(), path, size, part.stats.stored_bytes, result.full_chunks,
                 result.delta_chunks, result.same_chunks, secs);
    return SaveJournal(*d);
  }

  // Tensor elements and other bytes of an unchanged file, as push counts them: a safetensors
  // file's header chunk is parsed for its tensors (it is small and usually cached).
  Expected<std::pair<uint64_t, uint64_t>> ElementsOf(const Manifest& pm, const ManifestFile& pf) {
    if (pf.chunks.empty() || pf.chunks[0].key.tensor != kHeaderChunkName) return std::pair<uint64_t, uint64_t>{0, pf.size};
    WFS_ASSIGN_OR_RETURN(ByteBuffer header, materializer->Chunk(pm, pf, 0));
    WFS_ASSIGN_OR_RETURN(SafetensorsHeader h, ParseSafetensorsHeader(header, pf.size));
    uint64_t elements = 0;
    for (const TensorInfo& t : h.tensors) elements += t.size() / std::max<size_t>(1, DTypeSize(t.dtype));
    return std::pair<uint64_t, uint64_t>{elements, pf.chunks[0].length};
  }

  // Whether the published manifest of m's name has exactly m's parent and files (the same
  // recipes): then it is this draft's own, published by a commit that was cut short.
  bool IsOurs(const Manifest& m) {
    Expected<std::shared_ptr<const Manifest>> there = bucket->ReadFullManifest(m.model, m.version);
    if (!there.ok() || (*there)->parent != m.parent || (*there)->files.size() != m.files.size()) return false;
    for (size_t i = 0; i < m.files.size(); ++i) {
      const ManifestFile& a = m.files[i];
      const ManifestFile& b = (*there)->files[i];
      if (a.path != b.path || a.size != b.size || a.sha256 != b.sha256 || a.chunks.size() != b.chunks.size()) return false;
      for (size_t c = 0; c < a.chunks.size(); ++c) {
        const ManifestChunk& x = a.chunks[c];
        const ManifestChunk& y = b.chunks[c];
        if (x.hash != y.hash || x.ref.length != y.ref.length || x.is_external() != y.is_external()) return false;
        const bool same_place = x.is_external() ? m.sources[x.ref.pack] == (*there)->sources[y.ref.pack]
                                                : m.packs[x.ref.pack] == (*there)->packs[y.ref.pack];
        if (!same_place) return false;
      }
    }
    return true;
  }

  Status CommitDraft(const std::shared_ptr<Draft>& d, const std::string& as_in);
  // Forgets draft `d` and deletes its staging directory. 0, or EBUSY while it is committed.
  int RemoveDraft(const std::shared_ptr<Draft>& d);
  void WorkerMain();
  Status LoadDraft(const std::string& dir, const nlohmann::json& j);
};

// ---- background work ------------------------------------------------------------------------

void Drafts::State::WorkerMain() {
  for (;;) {
    std::pair<std::string, std::string> job;
    {
      std::unique_lock<std::mutex> lock(queue_mu);
      queue_cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (stopping) return;
      job = std::move(queue.front());
      queue.pop_front();
    }
    try {  // an exception (an allocation failing) fails this job, not the daemon
    std::shared_ptr<Draft> d;
    {
      std::lock_guard<std::mutex> lock(mu);
      d = DraftLocked(job.first);
    }
    if (!d) continue;
    if (job.second.empty()) {
      Status s = CommitDraft(d, d->commit_as);
      if (!s.ok()) {
        spdlog::error("resuming the commit of draft {}: {}", job.first, s.ToString());
        std::lock_guard<std::mutex> lock(mu);
        d->error = s.ToString();
      }
      continue;
    }
    Status s = EnsureEncoded(d, job.second);
    if (!s.ok() && s.kind() != ErrorKind::kInvalidArgument) {
      // The bucket (or the disk) failed: the draft's other queued files would most likely fail
      // the same way, one timeout after another. Commit encodes them when it runs.
      size_t dropped = 0;
      {
        std::lock_guard<std::mutex> lock(queue_mu);
        const size_t before = queue.size();
        std::erase_if(queue, [&](const auto& j) { return j.first == job.first && !j.second.empty(); });
        dropped = before - queue.size();
      }
      spdlog::error("draft {}: encoding {} failed (the data stays staged; commit retries{}): {}", job.first,
                    job.second, dropped ? ", as it will the " + std::to_string(dropped) + " files queued after it" : "",
                    s.ToString());
    }
    } catch (...) {
      const Status st = StatusOfCurrentException(job.second.empty() ? "committing" : "encoding");
      spdlog::error("draft {} {}: {}: {} (the data stays staged; commit retries)", job.first, job.second,
                    ErrorKindName(st.kind()), st.message());
    }
  }
}

Status Drafts::State::CommitDraft(const std::shared_ptr<Draft>& d, const std::string& as_in) {
  const auto start = std::chrono::steady_clock::now();
  std::string as = as_in.empty() ? d->version : as_in;
  WFS_TRY(ValidateVersionName(as));
  if (as == "latest") return Status::InvalidArgument("'latest' is reserved for the newest version's link");
  std::vector<std::string> paths;
  {
    std::unique_lock<std::mutex> lock(mu);
    if (d->committing) return Status::InvalidArgument("draft " + d->name() + " is being committed already");
    // The kernel sends RELEASE after close() has returned: a commit that follows a close at
    // once may still see the writer. Give those a moment.
    auto writing = [&] {
      for (auto& [path, f] : d->files) {
        std::lock_guard<std::mutex> flock(f->mu);
        if (f->writers > 0) return true;
      }
      return false;
    };
    encoded_cv.wait_for(lock, std::chrono::seconds(2), [&] { return !writing(); });
    for (auto& [path, f] : d->files) {
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->writers > 0) {
        return Status::InvalidArgument(d->name() + "/" + path +
                                       " is still open for writing; close it, then commit");
      }
      if (!f->write_error.empty()) {
        return Status::InvalidArgument("a write to " + d->name() + "/" + path + " failed (" + f->write_error +
                                       "); write the file again or remove it, then commit");
      }
      if (f->id != 0 || f->parent_path != path) paths.push_back(path);
    }
    if (d->files.empty()) return Status::InvalidArgument("draft " + d->name() + " has no files");
    d->committing = true;
    d->commit_requested = true;
    d->commit_as = as_in;
  }
  struct Done {
    State* s;
    Draft* d;
    ~Done() {
      std::lock_guard<std::mutex> lock(s->mu);
      d->committing = false;
    }
  } done{this, d.get()};
  WFS_TRY(SaveJournal(*d));

  // A renamed inherited file is materialized under its new path (its recipes name the old one).
  for (const std::string& path : paths) {
    std::shared_ptr<DraftFile> f;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = d->files.find(path);
      if (it == d->files.end()) continue;
      f = it->second;
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->id == 0) {
        if (int err = StageLocked(*d, *f, /*backed=*/true); err != 0) {
          return Status::IOError(Errno("staging " + path, err));
        }
        f->generation++;
      }
    }
  }
  std::shared_ptr<const Manifest> published_manifest;
  for (int attempt = 0;; ++attempt) {
    for (const std::string& path : paths) WFS_TRY(EnsureEncoded(d, path));
    // The parts, and a check that their packs are still in the bucket (a draft left alone
    // longer than its lease may have lost them to gc).
    std::map<std::string, Manifest> parts;
    Manifest m;
    {
      std::vector<std::pair<std::string, std::string>> part_files;
      {
        std::lock_guard<std::mutex> lock(mu);
        for (auto& [path, f] : d->files) {
          std::lock_guard<std::mutex> flock(f->mu);
          if (f->id == 0) continue;
          if (!f->Encoded(path)) return Status::InvalidArgument(d->name() + "/" + path + " changed during the commit; commit again");
          part_files.emplace_back(path, f->encoded);
        }
      }
      for (auto& [path, part] : part_files) {
        Expected<std::string> text = ReadWholeFile(d->PartPath(part));
        if (!text.ok()) return text.status();
        Expected<Manifest> pm = ParseManifest(std::span<const uint8_t>(
            reinterpret_cast<const uint8_t*>(text->data()), text->size()));
        if (!pm.ok()) return pm.status().WithContext("the encoded part of " + path);
        parts.emplace(path, std::move(pm).value());
      }
    }
    std::vector<std::string> lost;
    for (auto& [path, pm] : parts) {
      std::set<uint32_t> own;
      for (const ManifestChunk& c : pm.files[0].chunks) {
        if (c.origin == 0 && !c.is_external()) own.insert(c.ref.pack);
      }
      for (uint32_t p : own) {
        Expected<ObjectInfo> h = bucket->store().Head(Bucket::PackKey(pm.packs[p]));
        if (h.ok()) continue;
        if (h.status().kind() != ErrorKind::kNotFound) return h.status().WithContext("checking the draft's packs");
        lost.push_back(path);
        break;
      }
    }
    if (!lost.empty()) {
      if (attempt > 0) return Status::IOError("packs of " + lost[0] + " vanished from the bucket twice");
      std::lock_guard<std::mutex> lock(mu);
      for (const std::string& path : lost) {
        spdlog::warn("draft {}: the packs of {} are gone from the bucket (gc?); encoding it again", d->name(), path);
        if (auto it = d->files.find(path); it != d->files.end()) {
          std::lock_guard<std::mutex> flock(it->second->mu);
          it->second->encoded.clear();
        }
      }
      continue;
    }

    m.model = d->model;
    m.version = as;
    m.versions = {as};
    m.parent = d->parent;
    m.chunk_bytes = options.push.chunk_bytes;
    std::array<uint64_t, 4> tally{};  // as DraftFile::tally, summed over the version
    std::vector<const ManifestFile*> inherited;
    // The rows of the files the version inherits (read from the parent's table first).
    {
      std::vector<std::shared_ptr<DraftFile>> unchanged;
      {
        std::lock_guard<std::mutex> lock(mu);
        for (auto& [path, f] : d->files) {
          std::lock_guard<std::mutex> flock(f->mu);
          if (f->id == 0) unchanged.push_back(f);
        }
      }
      for (const std::shared_ptr<DraftFile>& f : unchanged) WFS_TRY(EnsureRows(*d, *f));
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [path, f] : d->files) {
        std::lock_guard<std::mutex> flock(f->mu);
        if (f->id == 0) {
          if (!f->rows) return Status::InvalidArgument(d->name() + "/" + path + " changed during the commit; commit again");
          AppendFileFrom(*d->parent_manifest, *f->rows, &m, /*src_is_dst=*/false);
          m.stats.logical_bytes += f->rows->size;
          inherited.push_back(f->rows);
          continue;
        }
        for (size_t i = 0; i < 4; ++i) tally[i] += f->tally[i];
        auto part = parts.find(path);
        if (part == parts.end()) {
          return Status::InvalidArgument(d->name() + "/" + path + " changed during the commit; commit again");
        }
        const Manifest& pm = part->second;
        AppendFileFrom(pm, pm.files[0], &m, /*src_is_dst=*/true);
        m.stats.logical_bytes += pm.stats.logical_bytes;
        m.stats.stored_bytes += pm.stats.stored_bytes;
      }
    }
    // Inherited files count as unchanged, with the elements push would count for them.
    for (const ManifestFile* pf : inherited) {
      Expected<std::pair<uint64_t, uint64_t>> e = ElementsOf(*d->parent_manifest, *pf);
      if (!e.ok()) return e.status().WithContext("counting the elements of " + pf->path);
      tally[0] += e->first;
      tally[2] += e->second;
    }
    const bool tensors = tally[0] > 0;
    m.stats.elements = tensors ? tally[0] : tally[2];
    m.stats.changed_elements = tensors ? tally[1] : tally[3];
    m.chunk_bytes = parts.empty() ? (d->parent_manifest ? d->parent_manifest->chunk_bytes : m.chunk_bytes)
                                  : parts.begin()->second.chunk_bytes;
    m.created = FormatUtc(NowMs());
    Status published = bucket->PublishManifest(m);
    if (published.kind() == ErrorKind::kConflict && IsOurs(m)) {
      spdlog::info("draft {}: {}@{} is already published with exactly its files (a commit interrupted "
                   "after publishing); finishing it", d->name(), d->model, as);
      published = Status::Ok();
    }
    if (published.kind() == ErrorKind::kConflict) {
      return Status::Conflict("version " + d->model + "@" + as + " already exists in " + bucket->Describe() +
                              " (another writer published it); the draft is kept: commit it under another "
                              "name with `weightfs commit --as NEWNAME`");
    }
    WFS_TRY(published);
    Expected<std::shared_ptr<const Manifest>> back = bucket->ReadManifest(d->model, as);
    if (!back.ok()) return back.status().WithContext("reading back the published manifest");
    published_manifest = *back;
    break;
  }
  // The mount shows the version before the draft that held its name goes.
  if (options.on_published) options.on_published(published_manifest);

  // Published: the draft becomes history; its staging files stay as the cache's source for
  // the next draft of this model, until a newer one is published from here.
  std::vector<std::string> retire;
  {
    std::lock_guard<std::mutex> lock(mu);
    drafts.erase(d->name());
    published_names.insert(d->name());
    auto& older = published_dirs[d->model];
    retire = std::move(older);
    older = {d->dir};
    d->error.clear();
    d->encode_error.clear();
  }
  (void)SaveJournal(*d, /*published=*/true);
  d->lease.reset();
  for (const std::string& dir : retire) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("published draft {} as {}@{} in {:.2f} s", d->name(), d->model, as, secs);
  return Status::Ok();
}

// ---- loading ----------------------------------------------------------------------------------

Status Drafts::State::LoadDraft(const std::string& dir, const nlohmann::json& j) {
  auto d = std::make_shared<Draft>();
  d->dir = dir;
  d->id = std::filesystem::path(dir).filename().string();
  d->model = j.at("model").get<std::string>();
  d->version = j.at("version").get<std::string>();
  WFS_TRY(ValidateModelName(d->model));
  WFS_TRY(ValidateVersionName(d->version));
  if (j.at("published").get<bool>()) {
    std::lock_guard<std::mutex> lock(mu);
    published_dirs[d->model].push_back(dir);
    return Status::Ok();
  }
  if (!j.at("parent").is_null()) d->parent = j.at("parent").get<std::string>();
  d->created_ms = j.at("created_ms").get<int64_t>();
  d->next_id = j.at("next_id").get<uint64_t>();
  d->commit_requested = j.at("commit").get<bool>();
  d->commit_as = j.at("commit_as").get<std::string>();
  if (d->parent) {
    Expected<std::shared_ptr<const Manifest>> pm = bucket->ReadManifest(d->model, *d->parent);
    if (!pm.ok()) return pm.status().WithContext("reading the parent of draft " + d->name());
    d->parent_manifest = *pm;
  }
  // (A journal of an older weightfs lists directories by name and has no owners or times.)
  const NodeMeta defaults = NodeMeta::At(0755, options.uid, options.gid, d->created_ms * 1000000);
  d->root = j.contains("root") ? NodeMeta::FromJson(j.at("root"), defaults) : defaults;
  for (const auto& dj : j.at("dirs")) {
    if (dj.is_string()) {
      d->dirs.emplace(dj.get<std::string>(), defaults);
    } else {
      const std::string path = dj.at("path").get<std::string>();
      WFS_TRY(ValidateFilePath(path));
      d->dirs.emplace(path, NodeMeta::FromJson(dj, defaults));
    }
  }
  for (const auto& e : j.at("files")) {
    auto f = std::make_shared<DraftFile>();
    const std::string path = e.at("path").get<std::string>();
    WFS_TRY(ValidateFilePath(path));
    f->meta = NodeMeta::FromJson(e, NodeMeta::At(0644, options.uid, options.gid, 0));
    f->id = e.at("id").get<uint64_t>();
    f->parent_path = e.at("parent_path").get<std::string>();
    if (!f->parent_path.empty()) {
      if (!d->parent_manifest || !(f->parent_file = d->parent_manifest->FindFile(f->parent_path))) {
        return Status::Corruption("draft " + d->name() + ": " + path + " names a parent file that does not exist");
      }
    }
    if (f->id == 0 && !f->parent_file) return Status::Corruption("draft " + d->name() + ": " + path + " has no data");
    if (f->id != 0) {
      f->staging = d->StagingPath(f->id);
      f->fd = ::open(f->staging.c_str(), O_RDWR | O_CLOEXEC);
      if (f->fd < 0) {
        spdlog::error("draft {}: the staging file of {} is gone ({}); the file is dropped", d->name(), path,
                      std::strerror(errno));
        continue;
      }
      struct stat st {};
      ::fstat(f->fd, &st);
      f->size = static_cast<uint64_t>(st.st_size);
      f->backed = e.at("backed").get<bool>();
      if (f->backed) {
        const std::string present = e.at("present").get<std::string>();
        if (!f->parent_file || present.size() != RowCount(*f->parent_file)) {
          return Status::Corruption("draft " + d->name() + ": " + path + " has a bad copy-up map");
        }
        f->present.assign(present.begin(), present.end());
        f->backing_limit = e.at("backing_limit").get<uint64_t>();
      }
      f->write_error = e.value("write_error", std::string());
      if (e.contains("tally")) f->tally = e.at("tally").get<std::array<uint64_t, 4>>();
      f->encoded = e.at("encoded").get<std::string>();
      f->encoded_path = e.at("encoded_path").get<std::string>();
      if (!f->encoded.empty() && ::access(d->PartPath(f->encoded).c_str(), R_OK) != 0) f->encoded.clear();
    }
    d->files.emplace(path, std::move(f));
  }
  std::vector<std::string> pending;
  for (auto& [path, f] : d->files) {
    if (!f->Encoded(path)) pending.push_back(path);
  }
  const std::string name = d->name();
  const bool commit = d->commit_requested;
  {
    std::lock_guard<std::mutex> lock(mu);
    drafts[name] = d;
  }
  spdlog::info("draft {} resumed ({} files, {} to encode{})", name, d->files.size(), pending.size(),
               commit ? ", commit requested" : "");
  for (const std::string& p : pending) {
    if (d->files.at(p)->id != 0) Enqueue(name, p);
  }
  if (commit) Enqueue(name, "");
  return Status::Ok();
}

// ---- Drafts -----------------------------------------------------------------------------------

Drafts::Drafts(Bucket* bucket, ChunkCache* cache, Materializer* materializer, ChunkReader* reader,
               DraftsOptions options)
    : state_(std::make_unique<State>(bucket, cache, materializer, reader, std::move(options))) {}

Drafts::~Drafts() {
  {
    std::lock_guard<std::mutex> lock(state_->queue_mu);
    state_->stopping = true;
  }
  state_->queue_cv.notify_all();
  if (state_->worker.joinable()) state_->worker.join();
  if (state_->lock_fd >= 0) ::close(state_->lock_fd);
}

bool Drafts::enabled() const { return state_->loaded && state_->disabled_reason.empty(); }

Status Drafts::Load() {
  State& s = *state_;
  std::error_code ec;
  std::filesystem::create_directories(s.options.state_dir, ec);
  if (ec) {
    s.disabled_reason = "cannot create " + s.options.state_dir + ": " + ec.message();
    return Status::IOError(s.disabled_reason);
  }
  const std::string lock_path = s.options.state_dir + "/lock";
  s.lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (s.lock_fd < 0 || ::flock(s.lock_fd, LOCK_EX | LOCK_NB) != 0) {
    s.disabled_reason = "another mount of this bucket with the same cache directory owns its drafts (" +
                        s.options.state_dir + "); mount with another --cache-dir to write here";
    s.loaded = true;
    return Status::Conflict(s.disabled_reason);
  }
  s.worker = std::thread([&s] { s.WorkerMain(); });
  Status first;
  for (const auto& entry : std::filesystem::directory_iterator(s.options.state_dir, ec)) {
    if (!entry.is_directory()) continue;
    const std::string dir = entry.path().string();
    Expected<std::string> text = ReadWholeFile(dir + "/journal.json");
    if (!text.ok()) continue;  // a draft whose creation did not finish
    Status st;
    try {
      st = s.LoadDraft(dir, nlohmann::json::parse(*text));
    } catch (const std::exception& e) {
      st = Status::Corruption(std::string("bad journal: ") + e.what());
    }
    if (!st.ok()) {
      spdlog::error("draft in {} not loaded (kept on disk; the next mount tries again): {}", dir, st.ToString());
      if (first.ok()) first = st;
    }
  }
  s.loaded = true;
  return first;
}

int Drafts::LookupIn(const std::string& dir_path, std::string_view name, NodeAttr* out) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  const std::string n(name);
  if (const size_t at = n.rfind('@'); at != std::string::npos) {
    const std::string draft = Join(dir_path, n);
    if (!s.DraftLocked(draft)) return ENOENT;
    return s.AttrLocked(s.InoLocked(State::Type::kDraftDir, draft), out);
  }
  const std::string path = Join(dir_path, n);
  if (!s.NewDirsInLocked(dir_path).count(path)) return ENOENT;
  return s.AttrLocked(s.InoLocked(State::Type::kNewDir, path), out);
}

std::vector<DirEntry> Drafts::EntriesIn(const std::string& dir_path) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  std::vector<DirEntry> out;
  for (const std::string& p : s.NewDirsInLocked(dir_path)) {
    out.push_back({p.substr(p.rfind('/') == std::string::npos ? 0 : p.rfind('/') + 1),
                   s.InoLocked(State::Type::kNewDir, p), S_IFDIR});
  }
  for (const auto& [name, d] : s.drafts) {
    if (State::ModelDir(d->model) != dir_path) continue;
    out.push_back({State::Leaf(d->model) + "@" + d->version, s.InoLocked(State::Type::kDraftDir, name), S_IFDIR});
  }
  return out;
}

int Drafts::MkdirIn(const std::string& dir_path, std::string_view name, mode_t mode, const Caller& who,
                    NodeAttr* out) {
  State& s = *state_;
  if (!enabled()) {
    spdlog::warn("mkdir {}: {}", Join(dir_path, name), s.disabled_reason.empty() ? "drafts are off" : s.disabled_reason);
    return EROFS;
  }
  const std::string n(name);
  const size_t at = n.rfind('@');
  if (at == std::string::npos) {
    const std::string path = Join(dir_path, n);
    if (!ValidateModelName(path).ok()) return EINVAL;
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.NewDirsInLocked(dir_path).count(path)) return EEXIST;
    s.new_dirs.insert(path);
    return s.AttrLocked(s.InoLocked(State::Type::kNewDir, path), out);
  }
  const std::string model = Join(dir_path, n.substr(0, at));
  const std::string version = n.substr(at + 1);
  if (Status v = ValidateModelName(model); !v.ok()) {
    spdlog::warn("mkdir {}: {}", n, v.message());
    return EINVAL;
  }
  if (Status v = ValidateVersionName(version); !v.ok() || version == "latest") {
    spdlog::warn("mkdir {}: not a valid version name", n);
    return EINVAL;
  }
  const std::string draft_name = model + "@" + version;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.DraftLocked(draft_name)) return EEXIST;
  }
  if (s.bucket->store().Head(Bucket::ManifestKey(model, version)).ok()) return EEXIST;
  auto d = std::make_shared<Draft>();
  d->model = model;
  d->version = version;
  d->created_ms = NowMs();
  d->root = NodeMeta::At(mode, who.uid, who.gid, d->created_ms * 1000000);
  Expected<std::shared_ptr<const Manifest>> latest = s.bucket->Latest(model);
  if (latest.ok()) {
    d->InheritAll(*latest, who.uid, who.gid);
  } else if (latest.status().kind() != ErrorKind::kNotFound) {
    spdlog::error("mkdir {}: cannot find the parent: {}", draft_name, latest.status().ToString());
    return EIO;
  }
  char id[64];
  std::snprintf(id, sizeof id, "%lld-%d-%llx", static_cast<long long>(d->created_ms), static_cast<int>(::getpid()),
                static_cast<unsigned long long>(NowNs() & 0xffffff));
  d->id = id;
  d->dir = s.options.state_dir + "/" + d->id;
  std::error_code ec;
  std::filesystem::create_directories(d->dir + "/files", ec);
  if (!ec) std::filesystem::create_directories(d->dir + "/parts", ec);
  if (ec) {
    spdlog::error("mkdir {}: cannot create its staging directory {}: {}", draft_name, d->dir, ec.message());
    return ec.value() == ENOSPC ? ENOSPC : EIO;
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.DraftLocked(draft_name)) {
      std::filesystem::remove_all(d->dir, ec);
      return EEXIST;
    }
    s.RetireDraftLocked(draft_name);  // an earlier draft of this name (published as another)
    s.drafts[draft_name] = d;
  }
  if (Status js = s.SaveJournal(*d); !js.ok()) {
    std::lock_guard<std::mutex> lock(s.mu);
    s.drafts.erase(draft_name);
    std::filesystem::remove_all(d->dir, ec);
    return js.kind() == ErrorKind::kResourceExhausted ? ENOSPC : EIO;
  }
  spdlog::info("draft {} created (parent {})", draft_name, d->parent.value_or("none: a base"));
  std::lock_guard<std::mutex> lock(s.mu);
  return s.AttrLocked(s.InoLocked(State::Type::kDraftDir, draft_name), out);
}

int Drafts::RmdirIn(const std::string& dir_path, std::string_view name) {
  State& s = *state_;
  const std::string n(name);
  std::shared_ptr<Draft> d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (n.find('@') == std::string::npos) {
      const std::string path = Join(dir_path, n);
      if (!s.NewDirsInLocked(dir_path).count(path)) return ENOENT;
      for (const auto& [k, dr] : s.drafts) {
        if (dr->model.starts_with(path + "/")) return ENOTEMPTY;
      }
      for (const std::string& nd : s.new_dirs) {
        if (nd.starts_with(path + "/")) return ENOTEMPTY;
      }
      s.new_dirs.erase(path);
      return 0;
    }
    d = s.DraftLocked(Join(dir_path, n));
    if (!d) return ENOENT;
    if (!d->files.empty() || !d->dirs.empty()) return ENOTEMPTY;
  }
  return s.RemoveDraft(d);
}

int Drafts::State::RemoveDraft(const std::shared_ptr<Draft>& d) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (d->committing) return EBUSY;
    if (DraftLocked(d->name()) != d) return ENOENT;
    drafts.erase(d->name());
    RetireDraftLocked(d->name());
  }
  // Queued encodes of it find no draft and do nothing; one running holds its own references.
  std::error_code ec;
  std::filesystem::remove_all(d->dir, ec);
  if (ec) spdlog::warn("draft {}: cannot remove its staging directory {}: {}", d->name(), d->dir, ec.message());
  spdlog::info("draft {} removed (nothing of it was published)", d->name());
  return 0;
}

int Drafts::Discard(uint64_t draft_ino) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const State::Ref* r = s.RefLocked(draft_ino);
    if (!r || r->type != State::Type::kDraftDir) return ENOTSUP;
    d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    for (auto& [path, f] : d->files) {
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->writers > 0) {
        spdlog::warn("discard {}: {} is open for writing; close it first", d->name(), path);
        return EBUSY;
      }
    }
  }
  return s.RemoveDraft(d);
}

std::optional<std::string> Drafts::DirPath(uint64_t ino) const {
  std::lock_guard<std::mutex> lock(state_->mu);
  const State::Ref* r = state_->RefLocked(ino);
  if (!r || r->type != State::Type::kNewDir) return std::nullopt;
  return r->a;
}

int Drafts::GetAttr(uint64_t ino, NodeAttr* out) {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->AttrLocked(ino, out);
}

namespace {
// Resolves a directory node inside a draft: the draft and the path ("" = the draft's root).
int DirOf(Drafts::State& s, uint64_t ino, std::shared_ptr<Draft>* d, std::string* path) {
  const auto* r = s.RefLocked(ino);
  if (!r) return ENOENT;
  if (r->type == Drafts::State::Type::kNewDir) return EPERM;
  *d = s.DraftLocked(r->a);
  if (!*d) return s.GoneLocked(r->a);
  if (r->type == Drafts::State::Type::kDraftDir) {
    path->clear();
    return 0;
  }
  if ((*d)->files.count(r->b)) return ENOTDIR;
  if (!(*d)->dirs.count(r->b)) return ENOENT;
  *path = r->b;
  return 0;
}
}  // namespace

int Drafts::Lookup(uint64_t parent, std::string_view name, NodeAttr* out) {
  State& s = *state_;
  std::optional<std::string> new_dir = DirPath(parent);
  if (new_dir) return LookupIn(*new_dir, name, out);
  std::lock_guard<std::mutex> lock(s.mu);
  std::shared_ptr<Draft> d;
  std::string dir;
  if (int err = DirOf(s, parent, &d, &dir); err != 0) return err;
  const std::string path = Join(dir, name);
  if (!d->files.count(path) && !d->dirs.count(path)) return ENOENT;
  return s.AttrLocked(s.InoLocked(State::Type::kItem, d->name(), path), out);
}

int Drafts::ReadDir(uint64_t ino, std::vector<DirEntry>* out) {
  State& s = *state_;
  out->clear();
  if (std::optional<std::string> nd = DirPath(ino)) {
    out->push_back({".", ino, S_IFDIR});
    out->push_back({"..", ino, S_IFDIR});  // the kernel resolves ".." itself
    for (DirEntry& e : EntriesIn(*nd)) out->push_back(std::move(e));
    return 0;
  }
  std::lock_guard<std::mutex> lock(s.mu);
  std::shared_ptr<Draft> d;
  std::string dir;
  if (int err = DirOf(s, ino, &d, &dir); err != 0) return err;
  out->push_back({".", ino, S_IFDIR});
  out->push_back({"..", ino, S_IFDIR});
  std::map<std::string, mode_t> names;
  for (const auto& [p, meta] : d->dirs) {
    if (ParentPath(p) == dir) names[p] = S_IFDIR;
  }
  for (const auto& [p, f] : d->files) {
    if (ParentPath(p) == dir) names[p] = S_IFREG;
  }
  for (const auto& [p, type] : names) {
    out->push_back({p.substr(dir.empty() ? 0 : dir.size() + 1), s.InoLocked(State::Type::kItem, d->name(), p), type});
  }
  return 0;
}

int Drafts::Mkdir(uint64_t parent, std::string_view name, mode_t mode, const Caller& who, NodeAttr* out) {
  State& s = *state_;
  if (std::optional<std::string> nd = DirPath(parent)) return MkdirIn(*nd, name, mode, who, out);
  std::shared_ptr<Draft> d;
  std::string path;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::string dir;
    if (int err = DirOf(s, parent, &d, &dir); err != 0) return err;
    path = Join(dir, name);
    if (!ValidateFilePath(path).ok()) return EINVAL;
    if (d->files.count(path) || d->dirs.count(path)) return EEXIST;
    d->dirs.emplace(path, NodeMeta::At(mode, who.uid, who.gid, NowNs()));
    d->TouchDir(dir);
  }
  if (int e = s.SaveJournalErrno(*d); e != 0) return e;
  std::lock_guard<std::mutex> lock(s.mu);
  return s.AttrLocked(s.InoLocked(State::Type::kItem, d->name(), path), out);
}

int Drafts::Rmdir(uint64_t parent, std::string_view name) {
  State& s = *state_;
  if (std::optional<std::string> nd = DirPath(parent)) return RmdirIn(*nd, name);
  std::shared_ptr<Draft> d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::string dir;
    if (int err = DirOf(s, parent, &d, &dir); err != 0) return err;
    const std::string path = Join(dir, name);
    if (d->files.count(path)) return ENOTDIR;
    if (!d->dirs.count(path)) return ENOENT;
    if (d->HasEntriesUnder(path)) return ENOTEMPTY;
    d->dirs.erase(path);
    d->TouchDir(dir);
    s.RetireLocked(d->name(), path, {});
  }
  return s.SaveJournalErrno(*d);
}

int Drafts::Unlink(uint64_t parent, std::string_view name) {
  State& s = *state_;
  if (DirPath(parent)) return EPERM;
  std::shared_ptr<Draft> d;
  std::shared_ptr<DraftFile> f;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::string dir;
    if (int err = DirOf(s, parent, &d, &dir); err != 0) return err;
    const std::string path = Join(dir, name);
    if (d->dirs.count(path)) return EISDIR;
    auto it = d->files.find(path);
    if (it == d->files.end()) return ENOENT;
    f = it->second;
    d->files.erase(it);
    d->TouchDir(dir);
    s.RetireLocked(d->name(), path, f);
  }
  // The staging file goes first: on a full disk removing files is how space comes back, and
  // the journal write below needs some. (A journal still naming the file after a crash is
  // harmless: a file whose staging file is gone is dropped when the draft is loaded.)
  {
    std::lock_guard<std::mutex> flock(f->mu);
    if (f->id != 0) {
      ::unlink(f->staging.c_str());  // open handles keep reading through their descriptor
      if (!f->encoded.empty()) ::unlink(d->PartPath(f->encoded).c_str());
      if (f.use_count() == 1 && f->fd >= 0) {  // nobody has it open: release the space now
        ::close(f->fd);
        f->fd = -1;
      }
    }
  }
  (void)s.SaveJournal(*d);  // logs its failure; the unlink itself is done
  return 0;
}

int Drafts::Rename(uint64_t parent, std::string_view name, uint64_t new_parent, std::string_view new_name,
                   unsigned flags) {
  State& s = *state_;
  if (flags & ~1u) return EINVAL;  // RENAME_EXCHANGE, RENAME_WHITEOUT: not supported
  const bool noreplace = flags & 1u;
  if (DirPath(parent) || DirPath(new_parent)) return EXDEV;
  std::shared_ptr<Draft> d, d2;
  std::shared_ptr<DraftFile> replaced;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::string dir, dir2;
    if (int err = DirOf(s, parent, &d, &dir); err != 0) return err == EPERM ? EXDEV : err;
    if (int err = DirOf(s, new_parent, &d2, &dir2); err != 0) return err == EPERM ? EXDEV : err;
    if (d != d2) return EXDEV;
    const std::string from = Join(dir, name), to = Join(dir2, new_name);
    if (!ValidateFilePath(to).ok()) return EINVAL;
    if (from == to) return 0;
    const bool is_file = d->files.count(from) > 0;
    if (!is_file && !d->dirs.count(from)) return ENOENT;
    if (to.starts_with(from + "/")) return EINVAL;
    const bool to_file = d->files.count(to) > 0, to_dir = d->dirs.count(to) > 0;
    if ((to_file || to_dir) && noreplace) return EEXIST;
    if (is_file) {
      if (to_dir) return EISDIR;
      if (to_file) {
        replaced = d->files[to];
        d->files.erase(to);
        s.RetireLocked(d->name(), to, replaced);
      }
      auto f = d->files[from];
      d->files.erase(from);
      d->files[to] = f;
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->id != 0 && f->writers == 0 && !f->Encoded(to) && !f->encoding) s.Enqueue(d->name(), to);
    } else {
      if (to_file) return ENOTDIR;
      if (to_dir && d->HasEntriesUnder(to)) return ENOTEMPTY;
      if (to_dir) {
        d->dirs.erase(to);
        s.RetireLocked(d->name(), to, {});
      }
      std::map<std::string, std::shared_ptr<DraftFile>> files;
      for (auto& [p, f] : d->files) {
        files[p.starts_with(from + "/") ? to + p.substr(from.size()) : p] = f;
      }
      std::map<std::string, NodeMeta> dirs;
      for (const auto& [p, meta] : d->dirs) {
        dirs.emplace(p == from ? to : p.starts_with(from + "/") ? to + p.substr(from.size()) : p, meta);
      }
      d->files = std::move(files);
      d->dirs = std::move(dirs);
      for (auto& [p, f] : d->files) {
        if (!p.starts_with(to + "/")) continue;
        std::lock_guard<std::mutex> flock(f->mu);
        if (f->id != 0 && f->writers == 0 && !f->Encoded(p) && !f->encoding) s.Enqueue(d->name(), p);
      }
    }
    s.RekeyLocked(d->name(), from, to);
    d->TouchDir(dir);
    d->TouchDir(dir2);
    const int64_t now = NowNs();
    if (is_file) {
      std::lock_guard<std::mutex> flock(d->files[to]->mu);
      d->files[to]->meta.ctime_ns = now;
    } else if (NodeMeta* m = d->DirMeta(to)) {
      m->ctime_ns = now;
    }
  }
  if (replaced) {
    std::lock_guard<std::mutex> flock(replaced->mu);
    if (replaced->id != 0) {
      ::unlink(replaced->staging.c_str());
      if (!replaced->encoded.empty()) ::unlink(d->PartPath(replaced->encoded).c_str());
    }
  }
  return s.SaveJournalErrno(*d);
}

namespace {
bool Writes(int flags) { return (flags & O_ACCMODE) != O_RDONLY || (flags & O_TRUNC); }
}  // namespace

int Drafts::Create(uint64_t parent, std::string_view name, mode_t mode, int flags, const Caller& who,
                   NodeAttr* out, std::unique_ptr<DraftHandle>* handle) {
  State& s = *state_;
  if (DirPath(parent)) return EPERM;  // files live in versions
  std::shared_ptr<Draft> d;
  uint64_t ino;
  bool created = false;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    std::string dir;
    if (int err = DirOf(s, parent, &d, &dir); err != 0) return err;
    const std::string path = Join(dir, name);
    if (Status v = ValidateFilePath(path); !v.ok()) {
      spdlog::warn("create {}/{}: {}", d->name(), path, v.message());
      return EINVAL;
    }
    if (d->dirs.count(path)) return EISDIR;
    if (d->committing) return EBUSY;
    ino = s.InoLocked(State::Type::kItem, d->name(), path);
    if (!d->files.count(path)) {
      auto f = std::make_shared<DraftFile>();
      f->meta = NodeMeta::At(mode, who.uid, who.gid, NowNs());
      std::lock_guard<std::mutex> flock(f->mu);
      if (int err = s.StageLocked(*d, *f, false); err != 0) return err;
      d->files[path] = f;
      d->TouchDir(dir);
      created = true;
    } else if (flags & O_EXCL) {
      return EEXIST;
    }
  }
  // The new file is in the journal before the kernel learns of it: a crash cannot lose it.
  if (int e = created ? s.SaveJournalErrno(*d) : 0; e != 0) return e;
  if (int err = Open(ino, flags | O_CREAT, handle); err != 0) return err;
  return GetAttr(ino, out);
}

int Drafts::Open(uint64_t ino, int flags, std::unique_ptr<DraftHandle>* handle) {
  State& s = *state_;
  auto h = std::make_unique<DraftHandle>();
  bool journal = false;
  std::string unlink_after;  // a staging file replaced by a new one (see ResizeLocked)
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (!r || r->type != State::Type::kItem) return EISDIR;
    std::shared_ptr<Draft> d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    auto it = d->files.find(r->b);
    if (it == d->files.end()) return d->dirs.count(r->b) ? EISDIR : ENOENT;
    h->draft = d;
    h->file = it->second;
    h->path = r->b;
    DraftFile& f = *h->file;
    std::lock_guard<std::mutex> flock(f.mu);
    if (Writes(flags)) {
      if (d->committing) return EBUSY;
      if (f.id == 0) {
        if (int err = s.StageLocked(*d, f, !(flags & O_TRUNC)); err != 0) return err;
        journal = true;
      } else if (flags & O_TRUNC) {
        if (int err = s.ResizeLocked(*d, f, 0, d->next_id, &unlink_after); err != 0) return err;
        if (!unlink_after.empty()) {
          d->next_id++;
          journal = true;
        }
        f.backed = false;
        f.present.clear();
        if (!f.write_error.empty()) journal = true;
        f.write_error.clear();
      }
      if (!f.encoded.empty()) journal = true;  // the encoded part is stale from now on
      f.writers++;
      f.generation++;
      if (flags & O_TRUNC) f.meta.Touch(NowNs());
      h->write = true;
    }
  }
  if (journal && !s.SaveJournal(*h->draft).ok()) {
    std::lock_guard<std::mutex> flock(h->file->mu);
    h->file->writers--;
    return EIO;
  }
  if (!unlink_after.empty()) ::unlink(unlink_after.c_str());
  *handle = std::move(h);
  return 0;
}

int Drafts::SetAttr(uint64_t ino, const AttrChange& change, DraftHandle* handle, NodeAttr* out) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  std::shared_ptr<DraftFile> f;
  std::string path;
  uint64_t spare_id = 0;
  std::string unlink_after;  // a staging file replaced by a new one (see ResizeLocked)
  const std::optional<uint64_t>& size = change.size;
  const int64_t now = NowNs();
  // Owner, mode and times (the kernel checked the caller may change them: default_permissions).
  auto apply = [&](NodeMeta& m) {
    if (change.mode) m.mode = *change.mode & 07777;
    if (change.uid) m.uid = *change.uid;
    if (change.gid) m.gid = *change.gid;
    if (change.atime_ns) m.atime_ns = *change.atime_ns;
    if (change.mtime_ns) m.mtime_ns = *change.mtime_ns;
    m.ctime_ns = now;
  };
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (handle) {
      // ftruncate, fchmod...: the open file, even if it was renamed or unlinked since.
      d = handle->draft;
      f = handle->file;
      if (s.DraftLocked(d->name()) != d) return s.GoneLocked(d->name());
      for (const auto& [p, file] : d->files) {
        if (file == f) path = p;
      }
    } else {
      if (!r) return ENOENT;
      // The directories above the versions are the mount's, not a draft's: nothing to keep
      // their owner or times in.
      if (r->type == State::Type::kNewDir) return size ? EISDIR : EPERM;
      d = s.DraftLocked(r->a);
      if (!d) return s.GoneLocked(r->a);
    }
    if (!f && (r->type == State::Type::kDraftDir || d->dirs.count(r->b))) {
      if (size) return EISDIR;
      apply(*d->DirMeta(r->type == State::Type::kDraftDir ? std::string() : r->b));
    } else {
      if (!f) {
        auto it = d->files.find(r->b);
        if (it == d->files.end()) return ENOENT;
        f = it->second;
        path = r->b;
      }
      std::lock_guard<std::mutex> flock(f->mu);
      if (size && f->id == 0) {
        if (d->committing) return EBUSY;
        if (int err = s.StageLocked(*d, *f, true); err != 0) return err;
      }
      if (size) spare_id = d->next_id++;  // in case the file must move (ResizeLocked)
      apply(f->meta);
    }
  }
  if (size) {
    bool backed;
    {
      std::lock_guard<std::mutex> flock(f->mu);
      backed = f->backed && *size < f->backing_limit;
    }
    if (backed) {
      if (int err = s.EnsureRowsErrno(*d, *f, "truncate " + d->name() + "/" + path); err != 0) return err;
    }
    // The chunk the new end cuts through keeps its head: copy it up first.
    std::optional<size_t> cut;
    {
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->backed && *size < f->backing_limit) {
        const size_t c = f->rows->ChunkAt(*size);
        if (f->present[c] == '0' && f->rows->chunks[c].offset < *size) cut = c;
      }
    }
    if (cut) {
      Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(d->parent_manifest, *f->rows, *cut);
      if (!bytes.ok()) return StatusToErrnoLogged(bytes.status(), "truncate " + d->name() + "/" + path);
      std::lock_guard<std::mutex> flock(f->mu);
      const ManifestChunk& c = f->rows->chunks[*cut];
      // (As in Fill: the file may have stopped being backed there while the chunk was fetched.)
      if (f->backed && *cut < f->present.size() && f->present[*cut] == '0' && c.offset < f->backing_limit) {
        if (int err = PwriteAll(f->fd, (*bytes)->data(), std::min<uint64_t>({c.length, *size - c.offset, f->backing_limit - c.offset}), c.offset); err != 0) return err;
        f->present[*cut] = '1';
      }
    }
    std::lock_guard<std::mutex> flock(f->mu);
    if (int err = s.ResizeLocked(*d, *f, *size, spare_id, &unlink_after); err != 0) return err;
    if (*size == 0) f->write_error.clear();
    if (f->backed) f->backing_limit = std::min(f->backing_limit, *size);
    f->generation++;
    if (!change.mtime_ns) f->meta.mtime_ns = now;
    if (f->writers == 0 && !path.empty()) s.Enqueue(d->name(), path);
  }
  if (int e = s.SaveJournalErrno(*d); e != 0) return e;
  if (!unlink_after.empty()) ::unlink(unlink_after.c_str());
  if (f && path.empty()) {  // an open file that is unlinked: its attributes from the handle
    std::lock_guard<std::mutex> lock(s.mu);
    s.FileAttr(ino, *f, out);
    out->st.st_nlink = 0;
    return 0;
  }
  return GetAttr(ino, out);
}

int Drafts::Read(DraftHandle& h, uint64_t offset, size_t size, std::vector<uint8_t>* out) {
  State& s = *state_;
  DraftFile& f = *h.file;
  bool needs_rows;
  {
    std::lock_guard<std::mutex> lock(f.mu);
    needs_rows = f.id == 0 || f.backed;  // reads (some of) the parent's bytes
  }
  if (needs_rows) {
    if (int err = s.EnsureRowsErrno(*h.draft, f, "read " + h.draft->name() + "/" + h.path); err != 0) return err;
  }
  uint64_t id, fsize, limit = 0;
  bool backed;
  std::vector<char> present;
  {
    std::lock_guard<std::mutex> lock(f.mu);
    id = f.id;
    fsize = f.id == 0 ? f.parent_file->size : f.size;
    backed = f.backed;
    if (backed) {
      present = f.present;
      limit = f.backing_limit;
    }
  }
  // Under the file's lock: a truncate may move the file to a new staging file (ResizeLocked)
  // and close the descriptor.
  auto pread_staged = [&f](uint8_t* p, size_t n, uint64_t off) {
    std::lock_guard<std::mutex> lock(f.mu);
    return PreadAll(f.fd, p, n, off);
  };
  out->clear();
  if (offset >= fsize) return 0;
  const uint64_t end = std::min<uint64_t>(fsize, offset + size);
  if (id == 0) {
    Expected<ReadResult> r = s.reader->Read(h.draft->parent_manifest, *f.rows, offset, end - offset, &h.stream);
    if (!r.ok()) return StatusToErrnoLogged(r.status(), "read " + h.draft->name() + "/" + h.path);
    out->reserve(r->size);
    for (const iovec& v : r->iov) {
      out->insert(out->end(), static_cast<const uint8_t*>(v.iov_base), static_cast<const uint8_t*>(v.iov_base) + v.iov_len);
    }
    return 0;
  }
  out->resize(end - offset);
  uint64_t pos = offset;
  while (pos < end) {
    if (backed && pos < limit) {
      const size_t c = f.rows->ChunkAt(pos);
      const ManifestChunk& ch = f.rows->chunks[c];
      const uint64_t cend = std::min({ch.offset + ch.length, limit, end});
      if (present[c] == '0') {
        Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(h.draft->parent_manifest, *f.rows, c);
        if (!bytes.ok()) return StatusToErrnoLogged(bytes.status(), "read " + h.draft->name() + "/" + h.path);
        std::memcpy(out->data() + (pos - offset), (*bytes)->data() + (pos - ch.offset), cend - pos);
      } else if (int err = pread_staged(out->data() + (pos - offset), cend - pos, pos); err != 0) {
        return err;
      }
      pos = cend;
      continue;
    }
    if (int err = pread_staged(out->data() + (pos - offset), end - pos, pos); err != 0) return err;
    pos = end;
  }
  return 0;
}

int Drafts::Write(DraftHandle& h, uint64_t offset, std::span<const uint8_t> data) {
  State& s = *state_;
  DraftFile& f = *h.file;
  if (!h.write) return EBADF;
  bool backed;
  {
    std::lock_guard<std::mutex> lock(f.mu);
    backed = f.backed;
  }
  // Only a file still backed by its parent needs the parent's rows (a write to a file opened
  // with O_TRUNC must not depend on the bucket).
  if (backed) {
    if (int err = s.EnsureRowsErrno(*h.draft, f, "copy-up of " + h.draft->name() + "/" + h.path); err != 0) return err;
  }
  const uint64_t end = offset + data.size();
  // Copy-up: parent chunks this write covers only in part are materialized first (and made
  // durable: the journal will say they are in the staging file).
  bool copied = false;
  for (;;) {
    std::optional<size_t> need;
    {
      std::lock_guard<std::mutex> lock(f.mu);
      if (f.backed && offset < f.backing_limit) {
        for (size_t c = f.rows->ChunkAt(offset); c < f.present.size(); ++c) {
          const ManifestChunk& ch = f.rows->chunks[c];
          if (ch.offset >= end || ch.offset >= f.backing_limit) break;
          if (f.present[c] != '0') continue;
          const uint64_t cend = std::min(ch.offset + ch.length, f.backing_limit);
          if (offset <= ch.offset && end >= cend) continue;  // wholly overwritten: nothing to copy
          need = c;
          break;
        }
      }
    }
    if (!need) break;
    Expected<std::shared_ptr<const ByteBuffer>> bytes = s.reader->Chunk(h.draft->parent_manifest, *f.rows, *need);
    if (!bytes.ok()) return StatusToErrnoLogged(bytes.status(), "copy-up of " + h.draft->name() + "/" + h.path);
    std::lock_guard<std::mutex> lock(f.mu);
    // Unless, while it was fetched, an encode's Fill copied it (the file is no longer backed),
    // an O_TRUNC open dropped the parent or a truncate cut the file below it (as in Fill).
    if (f.backed && *need < f.present.size() && f.present[*need] == '0' &&
        f.rows->chunks[*need].offset < f.backing_limit) {
      const ManifestChunk& ch = f.rows->chunks[*need];
      const uint64_t len = std::min<uint64_t>(ch.length, f.backing_limit - ch.offset);
      if (int err = PwriteAll(f.fd, (*bytes)->data(), len, ch.offset); err != 0) return err;
      f.present[*need] = '1';
      copied = true;
    }
  }
  bool marked = copied;  // the copy-up map changed: journaled before the write is acknowledged
  {
    std::lock_guard<std::mutex> lock(f.mu);
    if (int err = PwriteAll(f.fd, data.data(), data.size(), offset); err != 0) {
      spdlog::error("write {}/{} at {}: {} (staging file {}); the draft cannot be committed until the "
                    "file is written again or removed", h.draft->name(), h.path, offset, std::strerror(err), f.staging);
      f.write_error = std::strerror(err);
      f.journal_dirty = true;
      return err;
    }
    // Parent chunks this write covered whole are the staging file's from now on (marked only
    // once the bytes are there: a reader or a crash before sees the parent's).
    if (f.backed && offset < f.backing_limit) {
      for (size_t c = f.rows->ChunkAt(offset); c < f.present.size(); ++c) {
        const ManifestChunk& ch = f.rows->chunks[c];
        if (ch.offset >= end || ch.offset >= f.backing_limit) break;
        if (f.present[c] == '0' && offset <= ch.offset && end >= std::min(ch.offset + ch.length, f.backing_limit)) {
          f.present[c] = '2';
          marked = true;
        }
      }
    }
    f.size = std::max(f.size, end);
    f.generation++;
    f.meta.Touch(NowNs());
    f.journal_dirty = true;  // (the times; written at the next fsync or close)
    if (copied && ::fdatasync(f.fd) != 0) return errno;
  }
  // A journal that said "the parent's" for a chunk the staging file now holds would, after a
  // crash of the daemon, show the parent's bytes where this write put its own.
  if (marked) {
    if (Status js = s.SaveJournal(*h.draft); !js.ok()) {
      std::lock_guard<std::mutex> lock(f.mu);
      f.write_error = "cannot record the write in the draft's journal: " + js.message();
      return js.kind() == ErrorKind::kResourceExhausted ? ENOSPC : EIO;
    }
  }
  return 0;
}

int Drafts::Fsync(DraftHandle& h) {
  bool dirty;
  {
    std::lock_guard<std::mutex> lock(h.file->mu);
    if (h.file->id == 0) return 0;
    if (::fdatasync(h.file->fd) != 0) return errno;
    dirty = h.file->journal_dirty;
  }
  if (dirty && !state_->SaveJournal(*h.draft).ok()) return EIO;
  return 0;
}

void Drafts::Release(std::unique_ptr<DraftHandle> h) {
  if (!h->write) return;
  bool last, dirty;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    std::lock_guard<std::mutex> flock(h->file->mu);
    last = --h->file->writers == 0;
    dirty = h->file->journal_dirty;
  }
  state_->encoded_cv.notify_all();
  if (dirty) (void)state_->SaveJournal(*h->draft);
  if (!last) return;
  // Encode under the file's path as it is now (it may have been renamed while open).
  std::string path;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (const auto& [p, f] : h->draft->files) {
      if (f == h->file) path = p;
    }
  }
  if (!path.empty()) state_->Enqueue(h->draft->name(), path);
}

int Drafts::GetXattr(uint64_t ino, std::string_view name, std::string* out) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  const State::Ref* r = s.RefLocked(ino);
  if (!r) return ENOENT;
  if (r->type != State::Type::kDraftDir) return ENODATA;
  std::shared_ptr<Draft> d = s.DraftLocked(r->a);
  if (!d) return s.GoneLocked(r->a);
  if (name == kXattrParent) {
    if (!d->parent) return ENODATA;
    *out = *d->parent;
  } else if (name == kXattrState) {
    *out = d->committing ? "committing" : "draft";
  } else if (name == kXattrError) {
    if (d->error.empty()) return ENODATA;
    *out = d->error;
  } else {
    return ENODATA;
  }
  return 0;
}

int Drafts::ListXattr(uint64_t ino, std::vector<std::string>* out) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  const State::Ref* r = s.RefLocked(ino);
  if (!r) return ENOENT;
  out->clear();
  if (r->type != State::Type::kDraftDir) return 0;
  std::shared_ptr<Draft> d = s.DraftLocked(r->a);
  if (!d) return s.GoneLocked(r->a);
  if (d->parent) out->push_back(kXattrParent);
  out->push_back(kXattrState);
  if (!d->error.empty()) out->push_back(kXattrError);
  return 0;
}

int Drafts::SetXattr(uint64_t ino, std::string_view name, std::string_view value) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (!r) return ENOENT;
    if (r->type != State::Type::kDraftDir || name != kXattrParent) return ENOTSUP;
    d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    // Only an unchanged draft can change its parent: every file still the parent's.
    for (const auto& [p, f] : d->files) {
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->id != 0 || f->parent_path != p) {
        // The reason goes to the draft's user.weightfs.error, where `weightfs set-parent` reads
        // it: EBUSY alone does not say which of the refusals this is.
        d->error = "set-parent: " + p + " was written, renamed or removed already; a draft's parent can be set "
                   "only before anything changes in it (discard it and mkdir it again)";
        spdlog::warn("setxattr {} on {}: {}", name, d->name(), d->error);
        return EBUSY;
      }
    }
  }
  std::string v(value);
  while (!v.empty() && (v.back() == '\n' || v.back() == '\0')) v.pop_back();
  if (const size_t at = v.rfind('@'); at != std::string::npos) v = v.substr(at + 1);
  Expected<std::shared_ptr<const Manifest>> pm = s.bucket->ReadManifest(d->model, v);
  if (!pm.ok()) {
    const bool bad_name = pm.status().kind() == ErrorKind::kNotFound || pm.status().kind() == ErrorKind::kInvalidArgument;
    std::lock_guard<std::mutex> lock(s.mu);
    d->error = "set-parent: " + d->model + "@" + v + " cannot be the parent: " + pm.status().ToString() +
               (bad_name ? " (`weightfs log BUCKET " + d->model + "` lists its versions)" : "");
    spdlog::warn("setxattr {} on {}: {}", name, d->name(), d->error);
    return bad_name ? EINVAL : EIO;
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    d->InheritAll(*pm, d->root.uid, d->root.gid);
    d->error.clear();
  }
  spdlog::info("draft {}: parent is now {}", d->name(), v);
  return s.SaveJournalErrno(*d);
}

Status Drafts::Commit(uint64_t draft_ino, const std::string& as) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    const State::Ref* r = s.RefLocked(draft_ino);
    if (!r || r->type != State::Type::kDraftDir) return Status::InvalidArgument("not a draft directory");
    d = s.DraftLocked(r->a);
  }
  if (!d) return Status::NotFound("the draft is gone (published or removed)");
  Status st = s.CommitDraft(d, as);
  if (!st.ok()) {
    std::lock_guard<std::mutex> lock(s.mu);
    d->error = st.ToString();
    spdlog::error("commit of draft {}: {}", d->name(), st.ToString());
  }
  return st;
}

Status Drafts::CommitAll() {
  State& s = *state_;
  std::vector<std::shared_ptr<Draft>> all;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto& [name, d] : s.drafts) all.push_back(d);
  }
  Status first;
  for (auto& d : all) {
    bool empty;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      empty = d->files.empty();
    }
    if (empty) {
      spdlog::info("draft {} has no files: not published", d->name());
      continue;
    }
    Status st = s.CommitDraft(d, d->commit_as);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(s.mu);
      d->error = st.ToString();
      spdlog::error("publishing draft {}: {} (its data stays staged; the next mount resumes it)", d->name(), st.ToString());
      if (first.ok()) first = st.WithContext("publishing " + d->name());
    }
  }
  return first;
}

size_t Drafts::queued_encodes() {
  std::lock_guard<std::mutex> qlock(state_->queue_mu);
  return state_->queue.size();
}

std::string Drafts::StatusJson() {
  State& s = *state_;
  nlohmann::json j;
  j["enabled"] = enabled();
  if (!s.disabled_reason.empty()) j["disabled_reason"] = s.disabled_reason;
  j["drafts"] = nlohmann::json::array();
  std::lock_guard<std::mutex> lock(s.mu);
  for (auto& [name, d] : s.drafts) {
    nlohmann::json dj;
    dj["name"] = name;
    dj["parent"] = d->parent ? nlohmann::json(*d->parent) : nlohmann::json(nullptr);
    uint64_t staged = 0, encoded = 0, bytes_to_go = 0, staged_bytes = 0, writers = 0, encoding = 0;
    for (auto& [p, f] : d->files) {
      std::lock_guard<std::mutex> flock(f->mu);
      if (f->id == 0) continue;
      staged++;
      encoding += f->mapped > 0;
      staged_bytes += f->size;
      writers += static_cast<uint64_t>(f->writers);
      if (f->Encoded(p)) {
        encoded++;
      } else {
        bytes_to_go += f->size;
      }
    }
    dj["files"] = d->files.size();
    dj["staged_files"] = staged;
    dj["staged_bytes"] = staged_bytes;
    dj["encoded_files"] = encoded;
    dj["pending_files"] = staged - encoded;
    dj["bytes_to_go"] = bytes_to_go;
    dj["open_for_writing"] = writers;
    dj["encoding_now"] = encoding;  // files whose encode is reading them right now
    dj["state"] = d->committing ? "committing" : d->commit_requested ? "commit requested" : "draft";
    std::string error = !d->error.empty() ? d->error : d->encode_error;
    for (auto& [p, f] : d->files) {
      std::lock_guard<std::mutex> flock(f->mu);
      if (!f->write_error.empty() && error.empty()) error = "a write to " + p + " failed: " + f->write_error;
    }
    dj["error"] = error;
    j["drafts"].push_back(std::move(dj));
  }
  {
    std::lock_guard<std::mutex> qlock(s.queue_mu);
    j["queued_encodes"] = s.queue.size();
  }
  if (s.cache) j["cache"] = {{"size_bytes", s.cache->size_bytes()}, {"max_bytes", s.cache->max_bytes()}};
  j["state_dir"] = s.options.state_dir;
  return j.dump();
}

}  // namespace weightfs
