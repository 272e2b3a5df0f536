#include "hub/engine/chunk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>
#include <random>
#include <unordered_map>

#include <spdlog/spdlog.h>

#include "core/chunk_plan.h"
#include "hub/engine/file_bytes.h"
#include "hub/store/direct_file.h"
#include "hub/store/local_file.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

struct Entry {
  int64_t mtime_ns;
  uint64_t size;
  std::string path;
  std::string companion;  // a whole file, when `path` is its index file: evicted together
};

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

// Every regular file directly in `dir`, appended to `entries`.
void ScanFlat(const std::string& dir, std::vector<Entry>* entries) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::string path = dir + "/" + e->d_name;
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    entries->push_back({MtimeNs(st), static_cast<uint64_t>(st.st_size), std::move(path)});
  }
  ::closedir(d);
}

std::string NameOf(const std::string& path);
std::string WholeIndexName(const std::string& base);

// Every chunk file under `dir` (skipping .tmp and .lock), every index file in `refs_dir`, and
// every whole file in `files_dir` (with its index file as one entry, at the index file's mtime;
// one without an index file is an entry of its own): what the size bound counts and eviction
// chooses from.
std::vector<Entry> Scan(const std::string& dir, const std::string& refs_dir, const std::string& files_dir) {
  std::vector<Entry> entries;
  ScanFlat(refs_dir, &entries);
  std::vector<Entry> whole;
  ScanFlat(files_dir, &whole);
  if (!whole.empty()) {
    std::unordered_map<std::string, size_t> index_of;  // index file name -> entry
    for (size_t i = 0; i < entries.size(); ++i) {
      index_of.emplace(entries[i].path.substr(entries[i].path.rfind('/') + 1), i);
    }
    for (Entry& w : whole) {
      const std::string base = w.path.substr(w.path.rfind('/') + 1);
      if (auto it = index_of.find(WholeIndexName(base)); it != index_of.end() && entries[it->second].companion.empty()) {
        entries[it->second].size += w.size;
        entries[it->second].companion = std::move(w.path);
      } else {
        entries.push_back(std::move(w));
      }
    }
  }
  DIR* top = ::opendir(dir.c_str());
  if (!top) return entries;
  while (dirent* d = ::readdir(top)) {
    if (d->d_name[0] == '.' || std::strlen(d->d_name) != 2) continue;
    std::string sub = dir + "/" + d->d_name;
    ScanFlat(sub, &entries);
  }
  ::closedir(top);
  return entries;
}

}  // namespace

ChunkBytes::ChunkBytes(ByteBuffer buffer)
    : ChunkBytes(std::make_shared<const ByteBuffer>(std::move(buffer))) {}

ChunkBytes::ChunkBytes(std::shared_ptr<const ByteBuffer> buffer)
    : owner_(buffer), buffer_(std::move(buffer)), data_(buffer_->data()), size_(buffer_->size()) {}

Expected<std::unique_ptr<ChunkCache>> ChunkCache::Open(const std::string& dir, uint64_t max_bytes,
                                                       const ChunkCacheOptions& options) {
  std::error_code ec;
  const std::string chunks = dir + "/chunks";
  for (const std::string& sub : {chunks + "/.tmp", dir + "/refs", dir + "/files/.tmp"}) {
    fs::create_directories(sub, ec);
    if (ec) {
      return Status::IOError("cannot create cache directory " + sub + ": " + ec.message() +
                             " (choose another with --cache-dir)");
    }
  }
  std::unique_ptr<ChunkCache> cache(new ChunkCache(dir, max_bytes, options));
  uint64_t total = 0;
  for (const Entry& e : Scan(chunks, cache->refs_dir_, cache->files_dir_)) total += e.size;
  cache->total_ = total;
  // Leftovers of inserts and whole files killed midway.
  for (const std::string& tmp : {chunks + "/.tmp", cache->files_dir_ + "/.tmp"}) {
    for (const auto& f : fs::directory_iterator(tmp, ec)) {
      struct stat st;
      if (::stat(f.path().c_str(), &st) == 0 && st.st_mtime < ::time(nullptr) - 3600) {
        ::unlink(f.path().c_str());
      }
    }
  }
  if (total > max_bytes) WFS_TRY(cache->EvictTo(max_bytes / 10 * 9));
  return cache;
}

std::string ChunkCache::PathOf(const Hash128& hash) const {
  std::string hex = hash.ToHex();
  return dir_ + "/" + hex.substr(0, 2) + "/" + hex;
}

namespace {

constexpr const char* kRefMagic = "weightfs-chunk-ref 1";  // the legacy one-file-a-chunk form

// Chunks from this size on are written O_DIRECT even from an unaligned buffer (through a copy).
constexpr size_t kBounceMinBytes = 128 << 10;

// Reads `size` bytes from offset 0 of a file opened O_DIRECT into `out` (4 KiB-aligned, room for
// `size` rounded up to 4 KiB): whole blocks, the last one short at the end of the file. Returns
// the bytes read; fewer than `size` on an error or a short read before the end.
uint64_t ReadDirect(int fd, uint8_t* out, uint64_t size) {
  const uint64_t padded = (size + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  uint64_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, padded - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<uint64_t>(n);
    if (done % kDirectAlign != 0) break;  // the end of the file (or a short read: not resumable so)
  }
  return std::min(done, size);
}

// Closes the descriptor it holds.
struct Fd {
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  int fd;
};

bool IsIndexName(const std::string& name) {
  return name.size() == 32 &&
         std::all_of(name.begin(), name.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string NameOf(const std::string& path) {
  return HashChunk({reinterpret_cast<const uint8_t*>(path.data()), path.size()}).ToHex();
}

// A whole file's index file is named after the whole file's name alone (not its absolute
// path, as a local file's is), and read as being in this cache's files/: a cache directory
// that is moved or copied (cp -a, a bind mount elsewhere) keeps its whole files.
std::string WholeIndexName(const std::string& base) { return NameOf("weightfs whole file " + base); }

// <64 hex>-<decimal size>: a whole file's name.
bool IsWholeFileName(const std::string& base) {
  if (base.size() < 66 || base[64] != '-') return false;
  const auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return std::all_of(base.begin(), base.begin() + 64, hex) &&
         std::all_of(base.begin() + 65, base.end(), [](char c) { return c >= '0' && c <= '9'; });
}

void Subtract(std::atomic<uint64_t>* total, uint64_t size) {
  uint64_t t = total->load();
  while (!total->compare_exchange_weak(t, t - std::min(t, size))) {
  }
}

}  // namespace

// The in-memory reference index: chunk hash -> (index file, offset, length).
//
// Rows of a forgotten file (stale, replaced, evicted) are not erased at once — that would need
// a list of every file's hashes (16 more bytes a row) or a pass over the map per file — but
// left in `rows` pointing at an id no longer in `files`: a lookup that meets one erases it, and
// when they are half of `rows` one pass erases them all (amortized O(1) a row).
//
// Lock order: scan_mu, then mu. scan_mu is held while index files are read (one scan at a
// time; lookups never wait for a rescan, only for the first scan); mu only for map updates and
// the stat of an index file's name, never while a referenced file is read.
struct ChunkCache::RefIndex {
  // Memory charged a row: a node of `rows` (a next pointer and a 32-byte value: 40 bytes, 48
  // with malloc's header and rounding; libstdc++ keeps no hash code for a noexcept hasher) and
  // its share of the bucket array (8 to 12 bytes at libstdc++'s load factors), rounded up:
  // measured, 60 bytes a row for a million rows.
  static constexpr uint64_t kRowCost = 64;
  // A file's records in `files` and `by_name`, besides its path.
  static constexpr uint64_t kFileCost = 256;

  struct Loc {
    uint64_t offset;
    uint32_t length;  // <= kMaxChunkBytes
    uint32_t file;    // a key of `files`, or a forgotten one
  };
  struct File {
    std::string name;  // under refs/
    std::string path;  // the referenced file, and its size and mtime when indexed
    uint64_t size = 0;
    int64_t mtime_ns = 0;
    uint64_t dev = 0, ino = 0, bytes = 0;  // the index file as loaded or written
    uint64_t rows = 0;
    int64_t touched = 0;  // wall seconds the index file's mtime was last refreshed
  };
  struct HashOf {
    size_t operator()(const Hash128& h) const noexcept { return static_cast<size_t>(h.lo); }
  };

  Mutex scan_mu WFS_ACQUIRED_BEFORE(mu);
  std::atomic<bool> loaded{false};  // the first scan is done
  Mutex mu;
  std::unordered_map<Hash128, Loc, HashOf> rows WFS_GUARDED_BY(mu);
  std::unordered_map<uint32_t, File> files WFS_GUARDED_BY(mu);
  std::unordered_map<std::string, uint32_t> by_name WFS_GUARDED_BY(mu);
  // Index files not loaded for the budget (name -> ino), so that rescans do not read them
  // again; cleared when memory is freed.
  std::unordered_map<std::string, uint64_t> skipped WFS_GUARDED_BY(mu);
  uint32_t next_id WFS_GUARDED_BY(mu) = 1;
  uint64_t dead_rows WFS_GUARDED_BY(mu) = 0;   // rows of forgotten files (at most) still in `rows`
  uint64_t file_bytes WFS_GUARDED_BY(mu) = 0;  // memory charged for `files`
  int64_t dir_mtime WFS_GUARDED_BY(mu) = -1;   // refs/'s mtime as of the last scan; -1: rescan
  std::chrono::steady_clock::time_point last_check WFS_GUARDED_BY(mu);  // of refs/'s mtime
  bool budget_logged WFS_GUARDED_BY(mu) = false;

  uint64_t Used() const WFS_REQUIRES(mu) { return rows.size() * kRowCost + file_bytes; }

  // True if `n` more rows of a file fit in `budget`.
  bool Fits(uint64_t n, size_t path, uint64_t budget) WFS_REQUIRES(mu) {
    const uint64_t cost = n * kRowCost + kFileCost + path;
    if (Used() + cost > budget && dead_rows > 0) Sweep();
    return Used() + cost <= budget;
  }

  void Forget(uint32_t id) WFS_REQUIRES(mu) {
    auto it = files.find(id);
    if (it == files.end()) return;
    if (auto n = by_name.find(it->second.name); n != by_name.end() && n->second == id) by_name.erase(n);
    dead_rows += it->second.rows;
    file_bytes -= kFileCost + it->second.path.size();
    files.erase(it);
    if (dead_rows > rows.size() / 2) Sweep();
  }

  void Sweep() WFS_REQUIRES(mu) {
    std::erase_if(rows, [&](const auto& kv) WFS_REQUIRES(mu) { return !files.contains(kv.second.file); });
    dead_rows = 0;
  }

  // Adds a file's rows, replacing the file of the same name; false (and remembered in
  // `skipped`) when they do not fit in `budget`.
  bool Add(File f, std::span<const ChunkRef> file_rows, uint64_t budget) WFS_REQUIRES(mu) {
    if (auto n = by_name.find(f.name); n != by_name.end()) Forget(n->second);
    if (!Fits(file_rows.size(), f.path.size(), budget)) {
      skipped[f.name] = f.ino;
      return false;
    }
    skipped.erase(f.name);
    const uint32_t id = next_id++;
    for (const ChunkRef& r : file_rows) {
      rows.insert_or_assign(r.hash, Loc{r.offset, static_cast<uint32_t>(r.length), id});
    }
    f.rows = file_rows.size();
    file_bytes += kFileCost + f.path.size();
    by_name[f.name] = id;
    files.emplace(id, std::move(f));
    return true;
  }
};

// What a lookup found: where to read, and the file's identity when it was indexed.
struct ChunkCache::RefHit {
  uint32_t file = 0;
  std::string name, path;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t offset = 0, length = 0;
  int64_t touched = 0;
};

ChunkCache::ChunkCache(std::string dir, uint64_t max_bytes, const ChunkCacheOptions& options)
    : dir_(dir + "/chunks"),
      refs_dir_(dir + "/refs"),
      files_dir_(dir + "/files"),
      max_bytes_(max_bytes),
      options_(options),
      refs_(std::make_unique<RefIndex>()) {}

ChunkCache::~ChunkCache() {
  {
    MutexLock lock(staging_mu_);
    for (uint8_t* region : staging_free_) ::munmap(region, WholeFileWriter::kBuffers * WholeFileWriter::kStagingBytes);
  }
  {
    MutexLock lock(behind_mu_);
    behind_stop_ = true;  // (the writer writes out what is queued first)
  }
  behind_cv_.NotifyAll();
  if (writer_.joinable()) writer_.join();
  MutexLock lock(copies_mu_);
  for (auto& [p, capacity] : copies_free_) std::free(p);
}

void ChunkCache::set_write_behind(uint64_t bytes) {
  MutexLock lock(behind_mu_);
  behind_limit_ = bytes;
  if (bytes > 0 && !writer_.joinable()) writer_ = std::thread([this] { WriterMain(); });
}

void ChunkCache::PutBehind(const Hash128& hash, ChunkBytes bytes, size_t capacity) {
  {
    MutexLock lock(behind_mu_);
    if (writer_.joinable() && !behind_stop_ && behind_bytes_ + bytes.size() <= behind_limit_) {
      behind_bytes_ += bytes.size();
      behind_.push_back(Behind{hash, std::move(bytes), capacity});
      behind_cv_.NotifyAll();
      return;
    }
  }
  (void)PutAligned(hash, bytes.span(), capacity);
}

void ChunkCache::PutCopyBehind(const Hash128& hash, std::span<const uint8_t> bytes) {
  {
    MutexLock lock(behind_mu_);
    if (!writer_.joinable() || behind_limit_ == 0) {
      lock.Unlock();
      (void)Put(hash, bytes);
      return;
    }
  }
  if (bytes.size() > max_bytes_ || Contains(hash)) return;
  const size_t padded = (bytes.size() + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  uint8_t* buffer = nullptr;
  size_t capacity = 0;
  {
    MutexLock lock(copies_mu_);
    for (size_t i = 0; i < copies_free_.size(); ++i) {
      if (copies_free_[i].second >= padded) {
        std::tie(buffer, capacity) = copies_free_[i];
        copies_free_.erase(copies_free_.begin() + static_cast<ptrdiff_t>(i));
        break;
      }
    }
  }
  if (!buffer) {
    buffer = static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, padded));
    capacity = padded;
    if (!buffer) {
      (void)Put(hash, bytes);
      return;
    }
  }
  std::memcpy(buffer, bytes.data(), bytes.size());
  std::shared_ptr<const void> owner(buffer, [this, capacity](const void* p) {
    uint8_t* b = const_cast<uint8_t*>(static_cast<const uint8_t*>(p));
    MutexLock lock(copies_mu_);
    if (copies_free_.size() < kMaxFreeCopies) {
      copies_free_.emplace_back(b, capacity);
    } else {
      std::free(b);
    }
  });
  PutBehind(hash, ChunkBytes(std::move(owner), std::span<const uint8_t>(buffer, bytes.size())), capacity);
}

void ChunkCache::Flush() {
  MutexLock lock(behind_mu_);
  behind_cv_.Wait(behind_mu_, [&]() WFS_REQUIRES(behind_mu_) { return behind_.empty() && !behind_writing_; });
}

void ChunkCache::WriterMain() {
  MutexLock lock(behind_mu_);
  for (;;) {
    behind_cv_.Wait(behind_mu_, [&]() WFS_REQUIRES(behind_mu_) { return behind_stop_ || !behind_.empty(); });
    if (behind_.empty()) return;  // stopping, and everything is written
    Behind entry = std::move(behind_.front());
    behind_.pop_front();
    behind_writing_ = true;
    lock.Unlock();
    (void)PutAligned(entry.hash, entry.bytes.span(), entry.capacity);  // (errors are logged there)
    const uint64_t size = entry.bytes.size();
    entry = Behind{};  // the buffer goes back to its owner before the queue has room again
    lock.Lock();
    behind_writing_ = false;
    behind_bytes_ -= size;
    behind_cv_.NotifyAll();
  }
}

bool ChunkCache::Contains(const Hash128& hash) {
  const std::string path = PathOf(hash);
  if (::access(path.c_str(), F_OK) == 0) return true;
  RefHit hit;
  return FindIndexed(hash, false, &hit) || ::access((path + ".ref").c_str(), F_OK) == 0;
}

void ChunkCache::ScanRefs() {
  RefIndex& x = *refs_;
  const uint64_t budget = options_.reference_index_bytes;
  // refs/'s mtime before reading it: a file added after this is seen by the next rescan.
  int64_t dir_mtime = -1;
  if (struct stat dst; ::stat(refs_dir_.c_str(), &dst) == 0) dir_mtime = MtimeNs(dst);
  struct Found {
    std::string name;
    uint64_t dev, ino, size;
    int64_t mtime_ns;
  };
  std::vector<Found> found;
  if (DIR* d = ::opendir(refs_dir_.c_str())) {
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      // Other names are not ours to judge (a later version's files, say): left alone.
      if (!IsIndexName(name)) continue;
      const std::string path = refs_dir_ + "/" + name;
      struct stat st;
      if (::lstat(path.c_str(), &st) != 0) continue;
      if (!S_ISREG(st.st_mode)) {
        DropCorrupt(path, st.st_dev, st.st_ino, 0, "not a regular file");
        continue;
      }
      found.push_back({std::move(name), static_cast<uint64_t>(st.st_dev),
                       static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size), MtimeNs(st)});
    }
    ::closedir(d);
  }
  std::vector<Found> load;
  {
    MutexLock lock(x.mu);
    std::unordered_map<std::string, size_t> present;
    for (size_t i = 0; i < found.size(); ++i) present.emplace(found[i].name, i);
    // Index files gone (evicted, dropped by another process) are forgotten.
    std::vector<uint32_t> gone;
    for (const auto& [name, id] : x.by_name) {
      if (!present.contains(name)) gone.push_back(id);
    }
    for (uint32_t id : gone) x.Forget(id);
    for (Found& f : found) {
      if (auto n = x.by_name.find(f.name); n != x.by_name.end()) {
        const RefIndex::File& held = x.files.at(n->second);
        if (held.dev == f.dev && held.ino == f.ino) continue;
      }
      if (auto s = x.skipped.find(f.name); s != x.skipped.end() && s->second == f.ino) continue;
      load.push_back(std::move(f));
    }
  }
  // Newest first: when the budget runs out, what is left out is what was used longest ago.
  std::sort(load.begin(), load.end(), [](const Found& a, const Found& b) { return a.mtime_ns > b.mtime_ns; });
  bool over_budget = false;
  for (const Found& f : load) {
    const std::string path = refs_dir_ + "/" + f.name;
    // Rows the file can hold, from its size: a file that cannot fit is not even read, which also
    // bounds the buffer below by the budget.
    const uint64_t max_rows = f.size > kReferenceIndexOverhead
                                  ? (f.size - kReferenceIndexOverhead) / kReferenceRowBytes : 0;
    {
      MutexLock lock(x.mu);
      if (!x.Fits(max_rows, 0, budget)) {
        x.skipped[f.name] = f.ino;
        over_budget = true;
        continue;
      }
    }
    Fd fd(::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    struct stat st;
    if (fd.fd < 0 || ::fstat(fd.fd, &st) != 0 || static_cast<uint64_t>(st.st_ino) != f.ino ||
        static_cast<uint64_t>(st.st_dev) != f.dev || static_cast<uint64_t>(st.st_size) != f.size) {
      continue;  // replaced or removed since it was listed: the next scan sees what is there
    }
    std::vector<uint8_t> bytes(f.size);
    if (PreadUpTo(fd.fd, bytes.data(), f.size, 0) != f.size) {
      DropCorrupt(path, f.dev, f.ino, f.size, "shorter than its size, or unreadable");
      continue;
    }
    Expected<ReferenceIndex> index = ParseReferenceIndex(bytes);
    bytes = {};
    if (!index.ok()) {
      DropCorrupt(path, f.dev, f.ino, f.size, index.status().message());
      continue;
    }
    if (const std::string base = index->path.substr(index->path.rfind('/') + 1);
        IsWholeFileName(base) && f.name == WholeIndexName(base)) {
      index->path = files_dir_ + "/" + base;  // (wherever the cache directory was when it was written)
    } else if (NameOf(index->path) != f.name) {
      DropCorrupt(path, f.dev, f.ino, f.size, "its name is not the hash of the path it holds, " + index->path);
      continue;
    }
    RefIndex::File file{f.name, std::move(index->path), index->file_size, index->mtime_ns,
                        f.dev, f.ino, f.size, 0, f.mtime_ns / 1000000000};
    MutexLock lock(x.mu);
    // Still the file read? Else this process's PutReferences (or another process) replaced it
    // meanwhile, and what is held, or the next scan, is newer.
    struct stat now;
    if (::stat(path.c_str(), &now) != 0 || static_cast<uint64_t>(now.st_ino) != f.ino ||
        static_cast<uint64_t>(now.st_dev) != f.dev) {
      continue;
    }
    if (auto n = x.by_name.find(f.name); n != x.by_name.end()) {
      const RefIndex::File& held = x.files.at(n->second);
      if (held.dev == f.dev && held.ino == f.ino) continue;  // PutReferences registered it
    }
    if (!x.Add(std::move(file), index->rows, budget)) over_budget = true;
  }
  bool log_budget = false;
  size_t rows = 0;
  {
    MutexLock lock(x.mu);
    // A change within the filesystem's timestamp granularity of this scan would not move the
    // mtime: one so recent is not trusted (the next miss rescans).
    struct timespec wall;
    ::clock_gettime(CLOCK_REALTIME, &wall);
    const int64_t now_ns = static_cast<int64_t>(wall.tv_sec) * 1000000000 + wall.tv_nsec;
    x.dir_mtime = now_ns - dir_mtime < 2000000000 ? -1 : dir_mtime;
    if (over_budget && !x.budget_logged) log_budget = x.budget_logged = true;
    rows = x.rows.size();
    x.loaded = true;
  }
  if (log_budget) {
    spdlog::warn("chunk cache: the reference index of {} is at its memory bound ({} bytes, {} rows); "
                 "the references of further files are not loaded, their chunks come from the bucket",
                 refs_dir_, budget, rows);
  }
}

bool ChunkCache::FindIndexed(const Hash128& hash, bool rescan, RefHit* hit) {
  RefIndex& x = *refs_;
  if (!x.loaded.load()) {
    MutexLock scan(x.scan_mu);
    if (!x.loaded.load()) ScanRefs();
  }
  auto lookup = [&] {
    MutexLock lock(x.mu);
    auto it = x.rows.find(hash);
    if (it == x.rows.end()) return false;
    auto f = x.files.find(it->second.file);
    if (f == x.files.end()) {  // its file was forgotten
      x.rows.erase(it);
      if (x.dead_rows > 0) x.dead_rows--;
      return false;
    }
    *hit = {it->second.file, f->second.name, f->second.path, f->second.size,
            f->second.mtime_ns, it->second.offset, it->second.length, f->second.touched};
    return true;
  };
  if (lookup()) return true;
  if (!rescan) return false;
  {
    MutexLock lock(x.mu);
    const auto now = std::chrono::steady_clock::now();
    if (x.last_check != std::chrono::steady_clock::time_point{} &&
        now - x.last_check < options_.rescan_interval) {
      return false;
    }
    x.last_check = now;
  }
  struct stat st;
  if (::stat(refs_dir_.c_str(), &st) != 0) return false;
  {
    MutexLock lock(x.mu);
    if (x.dir_mtime == MtimeNs(st)) return false;
  }
  if (!x.scan_mu.TryLock()) return false;  // another thread is scanning: a miss, not a wait
  {
    MutexLock scan(x.scan_mu, std::adopt_lock);
    ScanRefs();
  }
  return lookup();
}

void ChunkCache::DropStaleRefs(uint32_t id, const std::string& why) {
  RefIndex& x = *refs_;
  RefIndex::File f;
  {
    MutexLock lock(x.mu);
    auto it = x.files.find(id);
    if (it == x.files.end()) return;  // another thread dropped it
    f = it->second;
    x.Forget(id);
    x.skipped.clear();  // memory freed: files left out for the budget may fit now
  }
  const std::string path = refs_dir_ + "/" + f.name;
  struct stat now;
  if (::stat(path.c_str(), &now) == 0 && static_cast<uint64_t>(now.st_dev) == f.dev &&
      static_cast<uint64_t>(now.st_ino) == f.ino && ::unlink(path.c_str()) == 0) {
    Subtract(&total_, f.bytes);
  }
  if (IsWholeFile(f.path)) {
    // Ours, and useless without its index: it goes too (a changed copy is never served).
    struct stat w;
    if (::lstat(f.path.c_str(), &w) == 0 && ::unlink(f.path.c_str()) == 0) Subtract(&total_, static_cast<uint64_t>(w.st_size));
    spdlog::warn("chunk cache: removed the whole file {} ({})", f.path, why);
    return;
  }
  spdlog::debug("chunk cache: dropped the references to {} ({})", f.path, why);
}

bool ChunkCache::GetIndexed(const Hash128& hash, const Output& output) {
  RefHit hit;
  if (!FindIndexed(hash, true, &hit)) return false;
  std::string stale;
  Fd fd(::open(hit.path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  struct stat st;
  if (fd.fd < 0) {
    stale = std::string("cannot be opened: ") + std::strerror(errno);
  } else if (::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    stale = "is not a regular file";
  } else if (static_cast<uint64_t>(st.st_size) != hit.size || MtimeNs(st) != hit.mtime_ns) {
    stale = "changed since it was indexed (size " + std::to_string(st.st_size) + ", mtime " +
            std::to_string(MtimeNs(st)) + "; indexed at size " + std::to_string(hit.size) +
            ", mtime " + std::to_string(hit.mtime_ns) + ")";
  } else {
    // As for chunk files: the caller's copy is what is hashed and served.
    const std::span<uint8_t> out = output(hit.length);
    const bool read = out.size() == hit.length &&
                      (IsWholeFile(hit.path) ? ReadWholeRange(fd.fd, out.data(), hit.length, hit.offset)
                                             : PreadUpTo(fd.fd, out.data(), hit.length, hit.offset) == hit.length);
    if (!read) {
      stale = "is shorter than indexed";
    } else if (HashChunk(out) != hash) {
      stale = "changed in place: bytes [" + std::to_string(hit.offset) + ", +" +
              std::to_string(hit.length) + ") do not match their chunk";
    }
  }
  if (!stale.empty()) {
    DropStaleRefs(hit.file, stale);
    return false;
  }
  // LRU: refresh the index file's mtime at most once a minute.
  if (const int64_t now = ::time(nullptr); hit.touched < now - 60) {
    ::utimensat(AT_FDCWD, (refs_dir_ + "/" + hit.name).c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
    MutexLock lock(refs_->mu);
    if (auto it = refs_->files.find(hit.file); it != refs_->files.end()) it->second.touched = now;
  }
  return true;
}

Status ChunkCache::PutReferences(const std::string& path, std::span<const ChunkRef> rows) {
  if (rows.empty()) return Status::Ok();
  if (path.empty() || path[0] != '/' || path.size() > kMaxReferencePath ||
      path.find('\0') != std::string::npos) {
    return Status::InvalidArgument("cache references need an absolute path of at most " +
                                   std::to_string(kMaxReferencePath) + " bytes, not " + path);
  }
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return StatusOfErrno(errno, "cache references to " + path);
  if (!S_ISREG(st.st_mode)) return Status::InvalidArgument("cache references to " + path + ": not a regular file");
  ReferenceIndex index{path, static_cast<uint64_t>(st.st_size), MtimeNs(st), {rows.begin(), rows.end()}};
  for (const ChunkRef& r : rows) {
    if (r.length == 0 || r.length > kMaxChunkBytes || r.offset > index.file_size ||
        r.length > index.file_size - r.offset) {
      return Status::InvalidArgument("cache references to " + path + ": [" + std::to_string(r.offset) +
                                     ", +" + std::to_string(r.length) + ") is not a chunk inside its " +
                                     std::to_string(index.file_size) + " bytes (did it change?)");
    }
  }
  const std::vector<uint8_t> bytes = SerializeReferenceIndex(index);
  if (bytes.size() > max_bytes_) return Status::Ok();  // like a chunk larger than the cache
  const std::string name = IndexNameOf(path);
  const std::string dest = refs_dir_ + "/" + name;
  struct stat old;
  const uint64_t replaced = ::lstat(dest.c_str(), &old) == 0 && S_ISREG(old.st_mode) ? old.st_size : 0;
  WFS_TRY(Insert(dest, bytes, 0, replaced));
  struct stat ist;
  if (::stat(dest.c_str(), &ist) != 0) return Status::Ok();  // evicted already
  RefIndex& x = *refs_;
  RefIndex::File file{name, path, index.file_size, index.mtime_ns, static_cast<uint64_t>(ist.st_dev),
                      static_cast<uint64_t>(ist.st_ino), bytes.size(), 0, ::time(nullptr)};
  bool log_budget = false;
  {
    MutexLock lock(x.mu);
    if (!x.Add(std::move(file), rows, options_.reference_index_bytes) && !x.budget_logged) {
      log_budget = x.budget_logged = true;
    }
  }
  if (log_budget) {
    spdlog::warn("chunk cache: the reference index of {} is at its memory bound ({} bytes); the "
                 "references of {} and further files are kept on disk but not loaded, their chunks "
                 "come from the bucket", refs_dir_, options_.reference_index_bytes, path);
  }
  return Status::Ok();
}


bool ChunkCache::GetLegacyReference(const Hash128& hash, const Output& output) {
  const std::string ref_path = PathOf(hash) + ".ref";
  char buf[4096];
  int rfd = ::open(ref_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (rfd < 0) return false;
  ssize_t n = ::read(rfd, buf, sizeof(buf) - 1);
  ::close(rfd);
  // "<magic>\n<offset> <length> <file size> <mtime ns>\n<path>"
  bool ok = false;
  if (n > 0) {
    buf[n] = '\0';
    const size_t magic = std::strlen(kRefMagic);
    unsigned long long offset = 0, length = 0, size = 0;
    long long mtime = 0;
    int consumed = 0;
    if (std::strncmp(buf, kRefMagic, magic) == 0 && buf[magic] == '\n' &&
        std::sscanf(buf + magic + 1, "%llu %llu %llu %lld\n%n", &offset, &length, &size, &mtime,
                    &consumed) == 4 &&
        consumed > 0 && length <= kMaxChunkBytes) {
      const char* path = buf + magic + 1 + consumed;
      Fd fd(::open(path, O_RDONLY | O_CLOEXEC));
      struct stat st;
      if (fd.fd >= 0 && ::fstat(fd.fd, &st) == 0 && static_cast<unsigned long long>(st.st_size) == size &&
          static_cast<long long>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec == mtime &&
          offset + length <= size) {
        const std::span<uint8_t> out = output(length);
        ok = out.size() == length && PreadUpTo(fd.fd, out.data(), length, offset) == length &&
             HashChunk(out) == hash;
      }
    }
  }
  if (!ok) {
    ::unlink(ref_path.c_str());  // the file moved on: the reference is stale
  } else if (struct stat rst; ::stat(ref_path.c_str(), &rst) == 0 && rst.st_mtime < ::time(nullptr) - 60) {
    ::utimensat(AT_FDCWD, ref_path.c_str(), nullptr, 0);
  }
  return ok;
}

bool ChunkCache::Get(const Hash128& hash, ByteBuffer* out) {
  return GetInto(hash, [out](size_t size) {
    out->resize(size);
    return std::span<uint8_t>(out->data(), out->size());
  });
}

bool ChunkCache::GetInto(const Hash128& hash, const Output& output, bool aligned) {
  const std::string path = PathOf(hash);
  // Entries are read as they are written, O_DIRECT where the caller's buffer allows: no copy
  // out of the page cache (13% of the daemon's CPU reading a cached version) and no second
  // copy of the chunk in the page cache beside the mount's own pages of the file.
  bool direct = aligned && direct_ok_.load(std::memory_order_relaxed);
  int opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
  if (opened < 0 && direct && errno == EINVAL) {
    direct = false;
    opened = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  }
  Fd fd(opened);
  if (fd.fd < 0) {
    if (GetIndexed(hash, output) || GetLegacyReference(hash, output)) {
      stats_.hits++;
      return true;
    }
    stats_.misses++;
    return false;
  }
  struct stat st;
  if (::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    stats_.misses++;
    return false;
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::string corrupt;
  if (size > kMaxChunkBytes) {
    corrupt = "larger (" + std::to_string(size) + " bytes) than any chunk";
  } else {
    // One asynchronous read of the whole file instead of reads in readahead-window steps.
    if (!direct) (void)::posix_fadvise(fd.fd, 0, static_cast<off_t>(size), POSIX_FADV_WILLNEED);
    // The copy is what gets hashed and what the caller serves: a change to the file after this
    // read cannot reach the caller, and one during it fails the hash or the length.
    const std::span<uint8_t> out = output(size);
    uint64_t got = 0;
    if (out.size() == size) {
      got = direct && reinterpret_cast<uintptr_t>(out.data()) % kDirectAlign == 0
                ? ReadDirect(fd.fd, out.data(), size)
                : PreadUpTo(fd.fd, out.data(), size, 0);
      if (got != size && direct) {
        // The file system would not read it so (or a short read): once more through the page
        // cache before calling it corrupt.
        Fd buffered(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
        got = buffered.fd >= 0 ? PreadUpTo(buffered.fd, out.data(), size, 0) : 0;
      }
    }
    if (got != size) {
      corrupt = "read " + std::to_string(got) + " of its " + std::to_string(size) +
                " bytes (truncated while read, or a read error)";
    } else if (HashChunk(out) != hash) {
      corrupt = "its bytes do not match its hash";
    }
  }
  if (!corrupt.empty()) {
    DropCorrupt(path, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), size, corrupt);
    stats_.misses++;
    return false;
  }
  // LRU: refresh the mtime, at most once a minute per entry (a hot chunk must not turn
  // every read into a metadata write).
  if (st.st_mtime < ::time(nullptr) - 60) ::futimens(fd.fd, nullptr);
  stats_.hits++;
  return true;
}

void ChunkCache::DropCorrupt(const std::string& path, uint64_t dev, uint64_t ino, uint64_t size,
                             const std::string& why) {
  stats_.corrupt++;
  struct stat now;  // lstat: a symlink planted in the cache is removed, not what it points at
  if (::lstat(path.c_str(), &now) == 0 && static_cast<uint64_t>(now.st_dev) == dev &&
      static_cast<uint64_t>(now.st_ino) == ino && ::unlink(path.c_str()) == 0) {
    Subtract(&total_, size);
  }
  corrupt_entries_.Log("chunk cache entry " + path + " is corrupt (" + why + "); dropped it");
}

Status ChunkCache::WriteEntry(const std::string& path, std::span<const uint8_t> bytes,
                              size_t direct_capacity) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = dir_ + "/.tmp/" + path.substr(path.rfind('/') + 1) + "." +
                          std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  const size_t padded = (bytes.size() + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  const bool direct = direct_capacity >= padded && !bytes.empty() &&
                      reinterpret_cast<uintptr_t>(bytes.data()) % kDirectAlign == 0 &&
                      direct_ok_.load(std::memory_order_relaxed);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0644);
  auto refused = [&](int err) {  // O_DIRECT not supported here: buffered from now on
    if (err != EINVAL) return false;
    if (direct_ok_.exchange(false)) {
      spdlog::info("chunk cache: {} does not take O_DIRECT writes; writing through the page cache", dir_);
    }
    return true;
  };
  if (fd < 0) {
    const int err = errno;
    if (direct && refused(err)) return WriteEntry(path, bytes, 0);
    return StatusOfErrno(err, "cache insert " + tmp);
  }
  // O_DIRECT writes whole 4 KiB blocks (the buffer's bytes past the end), then cuts the file.
  const size_t length = direct ? padded : bytes.size();
  size_t done = 0;
  while (done < length) {
    ssize_t n = ::write(fd, bytes.data() + done, length - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      if (direct && done == 0 && refused(err)) return WriteEntry(path, bytes, 0);
      return StatusOfErrno(err, "cache insert " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (direct && padded != bytes.size() && ::ftruncate(fd, static_cast<off_t>(bytes.size())) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return StatusOfErrno(err, "cache insert " + tmp);
  }
  // No fsync: a torn entry after a crash fails verification and is dropped, which is cheaper
  // than an fsync per chunk.
  ::close(fd);
  std::string sub = path.substr(0, path.rfind('/'));
  ::mkdir(sub.c_str(), 0755);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return StatusOfErrno(err, "cache insert " + path);
  }
  return Status::Ok();
}

Status ChunkCache::Put(const Hash128& hash, std::span<const uint8_t> bytes) {
  return PutImpl(hash, bytes, 0);
}

Status ChunkCache::PutAligned(const Hash128& hash, std::span<const uint8_t> bytes, size_t capacity) {
  return PutImpl(hash, bytes, capacity);
}

Status ChunkCache::PutImpl(const Hash128& hash, std::span<const uint8_t> bytes,
                           size_t direct_capacity) {
  if (bytes.size() > max_bytes_) return Status::Ok();
  if (Contains(hash)) return Status::Ok();
  if (direct_capacity == 0 && bytes.size() >= kBounceMinBytes && direct_ok_.load(std::memory_order_relaxed)) {
    // Unaligned bytes of a large chunk: copied into an aligned buffer of this thread and written
    // O_DIRECT, like PutAligned. The kernel's copy into fresh page-cache pages (and their
    // writeback) cost more than this copy: 40% of `weightfs patch`'s CPU, which caches every
    // chunk of the new version it builds.
    struct Bounce {
      uint8_t* data = nullptr;
      size_t capacity = 0;
      ~Bounce() { std::free(data); }
    };
    thread_local Bounce bounce;
    const size_t padded = (bytes.size() + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    if (bounce.capacity < padded) {
      void* p = std::aligned_alloc(kDirectAlign, padded);
      if (p != nullptr) {
        std::free(bounce.data);
        bounce.data = static_cast<uint8_t*>(p);
        bounce.capacity = padded;
      }
    }
    if (bounce.capacity >= padded) {
      std::memcpy(bounce.data, bytes.data(), bytes.size());
      return Insert(PathOf(hash), std::span<const uint8_t>(bounce.data, bytes.size()), bounce.capacity, 0);
    }
  }
  return Insert(PathOf(hash), bytes, direct_capacity, 0);
}

Status ChunkCache::Insert(const std::string& path, std::span<const uint8_t> bytes,
                          size_t direct_capacity, uint64_t replaced) {
  if (total_.load() + bytes.size() > max_bytes_) {
    Status s = EvictTo(max_bytes_ / 10 * 9 > bytes.size() ? max_bytes_ / 10 * 9 - bytes.size() : 0);
    if (!s.ok()) {
      failed_evictions_.Log("chunk cache: eviction failed: " + s.ToString());
    } else {
      failed_evictions_.Flush();
    }
  }
  Status s = WriteEntry(path, bytes, direct_capacity);
  if (s.kind() == ErrorKind::kResourceExhausted) {
    // The disk is fuller than our budget assumed: make room and try once more.
    uint64_t now = total_.load();
    (void)EvictTo(now / 2);
    s = WriteEntry(path, bytes, direct_capacity);
  }
  if (!s.ok()) {
    failed_inserts_.Log("chunk cache: " + s.ToString());
    return s;
  }
  failed_inserts_.Flush();  // a count left from a disk that was full
  total_ += bytes.size();
  Subtract(&total_, replaced);
  stats_.inserts++;
  return Status::Ok();
}

// Lock order: evict_mu_, the flock, refs_->mu.
Status ChunkCache::EvictTo(uint64_t target) {
  MutexLock lock(evict_mu_);
  const std::string lock_path = dir_ + "/.lock";
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return StatusOfErrno(errno, "cache lock " + lock_path);
  while (::flock(fd, LOCK_EX) != 0) {
    if (errno != EINTR) {
      int err = errno;
      ::close(fd);
      return StatusOfErrno(err, "flock " + lock_path);
    }
  }
  std::vector<Entry> entries = Scan(dir_, refs_dir_, files_dir_);
  uint64_t total = 0;
  for (const Entry& e : entries) total += e.size;
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.mtime_ns < b.mtime_ns; });
  size_t removed = 0;
  std::vector<std::string> index_files;  // evicted ones, forgotten by the in-memory index too
  for (const Entry& e : entries) {
    if (total <= target) break;
    if (::unlink(e.path.c_str()) == 0 || errno == ENOENT) {
      if (!e.companion.empty()) ::unlink(e.companion.c_str());  // a whole file goes with its index
      total -= e.size;
      ++removed;
      if (e.path.starts_with(refs_dir_ + "/")) index_files.push_back(e.path.substr(refs_dir_.size() + 1));
    }
  }
  if (!index_files.empty()) {
    MutexLock refs_lock(refs_->mu);
    for (const std::string& name : index_files) {
      if (auto it = refs_->by_name.find(name); it != refs_->by_name.end()) refs_->Forget(it->second);
    }
  }
  total_ = total;
  stats_.evictions += removed;
  ::flock(fd, LOCK_UN);
  ::close(fd);
  if (removed) spdlog::debug("chunk cache: evicted {} entries, {} bytes remain", removed, total);
  return Status::Ok();
}

}  // namespace weightfs

namespace weightfs {

// ---- whole files ------------------------------------------------------------------------------

namespace {

bool IsSha256Hex(const std::string& s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace

std::string ChunkCache::IndexNameOf(const std::string& path) const {
  return IsWholeFile(path) ? WholeIndexName(path.substr(files_dir_.size() + 1)) : NameOf(path);
}

std::string ChunkCache::WholeFilePath(const std::string& sha256, uint64_t size) const {
  return files_dir_ + "/" + sha256 + "-" + std::to_string(size);
}

bool ChunkCache::ReadWholeRange(int fd, uint8_t* out, uint64_t length, uint64_t offset) const {
  // Cached pages from the cache: the whole file is the one the kernel serves the next opens
  // from (passthrough), so a node that has just read N has N's pages there. Else from the disk:
  //  - through the page cache, the next chunks' pages asked for ahead (each read opens the file
  //    anew, so the kernel's readahead starts over each time): `weightfs patch` reads the same
  //    OLD at each step; read around the cache, OLD came from the disk every time (row 6 of
  //    scripts/bench_step.sh: 2.5 s against 1.7 s with OLD as chunk files);
  //  - around it (O_DIRECT, set on this read's own descriptor): the mount, whose readahead pool
  //    keeps several chunks in flight; through the cache, the base was a second copy of the
  //    model in memory beside the new version's pages (see the option).
  if (options_.whole_reads_around_page_cache) return PreadAroundCache(fd, out, length, offset) == length;
  if (PreadUpTo(fd, out, length, offset) != length) return false;
  (void)::posix_fadvise(fd, static_cast<off_t>(offset + length), static_cast<off_t>(2 * length), POSIX_FADV_WILLNEED);
  return true;
}

Expected<std::unique_ptr<WholeFileWriter>> ChunkCache::BeginWholeFile(const std::string& sha256, uint64_t size,
                                                                      WholeFileWriter::Mode mode) {
  if (!IsSha256Hex(sha256)) return Status::InvalidArgument("a whole file needs its SHA-256 in lowercase hex, not '" + sha256 + "'");
  if (size > max_bytes_ / 2) {
    return Status::ResourceExhausted("a whole copy of " + std::to_string(size) + " bytes would take more than half of the " +
                                     std::to_string(max_bytes_) + " bytes of the cache");
  }
  const std::string dest = WholeFilePath(sha256, size);
  if (HasWholeFile(sha256, size)) return Status::Conflict(dest + " is cached already");
  if (total_.load() + size > max_bytes_) {
    Status s = EvictTo(max_bytes_ / 10 * 9 > size ? max_bytes_ / 10 * 9 - size : 0);
    if (!s.ok()) failed_evictions_.Log("chunk cache: eviction failed: " + s.ToString());
  }
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = files_dir_ + "/.tmp/" + sha256 + "." + std::to_string(::getpid()) + "." +
                          std::to_string(counter.fetch_add(1));
  bool direct = mode == WholeFileWriter::Mode::kDirect && direct_ok_.load(std::memory_order_relaxed);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | (direct ? O_DIRECT : 0), 0444);
  if (fd < 0 && direct && errno == EINVAL) {
    direct = false;
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0444);
  }
  if (fd < 0) return StatusOfErrno(errno, "whole file " + tmp);
  const uint64_t padded = (size + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  if (padded > 0 && ::fallocate(fd, 0, 0, static_cast<off_t>(padded)) != 0 && (errno == ENOSPC || errno == EDQUOT)) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return StatusOfErrno(err, "whole file " + tmp + " (" + std::to_string(size) + " bytes)");
  }
  std::unique_ptr<WholeFileWriter> w(new WholeFileWriter(this, tmp, dest, size, fd, direct, mode));
  if (mode == WholeFileWriter::Mode::kDirect && !w->staging_) {
    return Status::ResourceExhausted("no memory for a whole file's staging buffers");
  }
  return w;
}

WholeFileWriter::WholeFileWriter(ChunkCache* cache, std::string tmp, std::string dest, uint64_t size, int fd, bool direct,
                                 Mode mode)
    : cache_(cache), tmp_(std::move(tmp)), dest_(std::move(dest)), size_(size), fd_(fd), mode_(mode), direct_(direct) {
  if (mode_ == Mode::kPageCache) return;  // no staging buffers, no thread: Append writes
  region_ = cache_->TakeStaging();
  if (!region_) return;
  region_bytes_ = kBuffers * kStagingBytes;
  staging_ = region_;
  writer_ = std::thread([this] { WriterMain(); });
}

uint8_t* ChunkCache::TakeStaging() {
  {
    MutexLock lock(staging_mu_);
    if (!staging_free_.empty()) {
      uint8_t* p = staging_free_.back();
      staging_free_.pop_back();
      return p;
    }
  }
  // 2 MiB-aligned anonymous memory with huge pages advised: O_DIRECT pins the pages of every
  // write, and the copies into it walk fewer TLB entries. Reused by the next whole file: fresh
  // pages are zeroed by the kernel (a tenth of a stream's CPU when each file mapped its own).
  constexpr size_t kHuge = 2 << 20;
  const size_t want = WholeFileWriter::kBuffers * WholeFileWriter::kStagingBytes;
  void* p = ::mmap(nullptr, want + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  uint8_t* raw = static_cast<uint8_t*>(p);
  uint8_t* aligned = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + kHuge - 1) / kHuge * kHuge);
  if (aligned > raw) ::munmap(raw, static_cast<size_t>(aligned - raw));
  ::munmap(aligned + want, static_cast<size_t>(raw + kHuge - aligned));
  (void)::madvise(aligned, want, MADV_HUGEPAGE);
  return aligned;
}

void ChunkCache::GiveStaging(uint8_t* region) {
  if (!region) return;
  {
    MutexLock lock(staging_mu_);
    if (staging_free_.empty()) {  // (one kept: one stream at a time is the common case)
      staging_free_.push_back(region);
      return;
    }
  }
  ::munmap(region, WholeFileWriter::kBuffers * WholeFileWriter::kStagingBytes);
}

WholeFileWriter::~WholeFileWriter() {
  if (writer_.joinable()) {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    writer_.join();
  }
  cache_->GiveStaging(region_);
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) ::unlink(tmp_.c_str());
}

void WholeFileWriter::WriterMain() {
  MutexLock lock(mu_);
  for (;;) {
    cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return stop_ || !writes_.empty(); });
    if (writes_.empty()) return;  // stopping, and everything handed over is written
    const Write w = writes_.front();
    bool direct = direct_;
    lock.Unlock();
    const uint8_t* data = region_ + w.buffer * kStagingBytes;
    Status st;
    size_t done = 0;
    while (done < w.length) {
      const ssize_t n = ::pwrite(fd_, data + done, w.length - done, static_cast<off_t>(w.offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EINVAL && direct && done == 0) {
        // The filesystem refuses O_DIRECT writes after all: through the page cache.
        const int flags = ::fcntl(fd_, F_GETFL);
        if (flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0) {
          direct = false;
          continue;
        }
      }
      if (n <= 0) {
        st = StatusOfErrno(n < 0 ? errno : EIO, "whole file " + tmp_);
        break;
      }
      done += static_cast<size_t>(n);
    }
    lock.Lock();
    direct_ = direct;
    if (!st.ok() && error_.ok()) error_ = st;
    writes_.pop_front();
    busy_[w.buffer] = false;
    cv_.NotifyAll();
  }
}

Status WholeFileWriter::Submit(size_t length) {
  MutexLock lock(mu_);
  if (!error_.ok()) return error_;
  if (length > 0) {
    writes_.push_back(Write{current_, flushed_, length});
    busy_[current_] = true;
    cv_.NotifyAll();
  }
  cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) {
    return !error_.ok() || std::any_of(std::begin(busy_), std::end(busy_), [](bool b) { return !b; });
  });
  if (!error_.ok()) return error_;
  for (size_t i = 0; i < kBuffers; ++i) {
    if (!busy_[i]) {
      current_ = i;
      break;
    }
  }
  staging_ = region_ + current_ * kStagingBytes;
  return Status::Ok();
}

Status WholeFileWriter::Drain() {
  MutexLock lock(mu_);
  cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return writes_.empty(); });
  return error_;
}

Status WholeFileWriter::Append(const ChunkRef& row, std::span<const uint8_t> bytes) {
  if (finished_ || fd_ < 0) return Status::InvalidArgument("whole file " + dest_ + " is finished");
  if (row.offset != written() || row.length != bytes.size() || row.length > size_ - std::min(size_, row.offset)) {
    return Status::InvalidArgument("whole file " + dest_ + ": a chunk at [" + std::to_string(row.offset) + ", +" +
                                   std::to_string(row.length) + ") after " + std::to_string(written()) + " of " +
                                   std::to_string(size_) + " bytes");
  }
  rows_.push_back(row);
  if (mode_ == Mode::kPageCache) return WriteThrough(bytes);
  while (!bytes.empty()) {
    const size_t n = std::min(bytes.size(), kStagingBytes - used_);
    std::memcpy(staging_ + used_, bytes.data(), n);
    used_ += n;
    bytes = bytes.subspan(n);
    if (used_ == kStagingBytes) {
      WFS_TRY(Submit(kStagingBytes));
      flushed_ += kStagingBytes;
      used_ = 0;
    }
  }
  return Status::Ok();
}

Status WholeFileWriter::WriteThrough(std::span<const uint8_t> bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::pwrite(fd_, bytes.data(), bytes.size(), static_cast<off_t>(flushed_));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      // What was written stays readable for Spill; nothing more is appended.
      Status st = StatusOfErrno(n < 0 ? errno : EIO, "whole file " + tmp_);
      rows_.pop_back();
      return st;
    }
    flushed_ += static_cast<uint64_t>(n);
    bytes = bytes.subspan(static_cast<size_t>(n));
  }
  return Status::Ok();
}

Status WholeFileWriter::Finish() {
  WFS_TRY(Complete());
  return Commit();
}

Status WholeFileWriter::Complete() {
  if (complete_ || finished_ || fd_ < 0) return Status::InvalidArgument("whole file " + dest_ + " is complete");
  if (written() != size_) {
    return Status::InvalidArgument("whole file " + dest_ + ": " + std::to_string(written()) + " of its " +
                                   std::to_string(size_) + " bytes appended");
  }
  if (mode_ == Mode::kDirect) {
    // O_DIRECT writes whole blocks: the last one padded, then the file cut to its size.
    const size_t tail = (used_ + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::memset(staging_ + used_, 0, tail - used_);
    WFS_TRY(Submit(tail));
    WFS_TRY(Drain());
    flushed_ += used_;
    used_ = 0;
  }
  if (::ftruncate(fd_, static_cast<off_t>(size_)) != 0) return StatusOfErrno(errno, "whole file " + tmp_);
  complete_ = true;
  return Status::Ok();
}

Status WholeFileWriter::Commit() {
  if (!complete_ || finished_ || fd_ < 0) return Status::InvalidArgument("whole file " + dest_ + " is not complete");
  // Synced before it has its name: after a crash a whole file is all there or not there (the
  // kernel serves it without a check of its bytes).
  if (::fdatasync(fd_) != 0) return StatusOfErrno(errno, "whole file " + tmp_);
  ::close(fd_);
  fd_ = -1;
  if (::rename(tmp_.c_str(), dest_.c_str()) != 0) return StatusOfErrno(errno, "whole file " + dest_);
  finished_ = true;
  return cache_->AddWholeFile(dest_, size_, rows_);
}

size_t WholeFileWriter::Spill() {
  if (finished_) return 0;
  (void)Drain();  // what was handed over is on disk (or failed: those chunks are not put)
  const int in = ::open(tmp_.c_str(), O_RDONLY | O_CLOEXEC);
  ByteBuffer bytes;
  size_t put = 0;
  for (const ChunkRef& r : rows_) {
    if (cache_->Contains(r.hash)) continue;
    bytes.resize(r.length);
    // [offset, flushed_) is in the file, the rest still in the staging buffer.
    const uint64_t on_disk = r.offset < flushed_ ? std::min<uint64_t>(r.length, flushed_ - r.offset) : 0;
    if (on_disk > 0 && (in < 0 || PreadUpTo(in, bytes.data(), on_disk, r.offset) != on_disk)) continue;
    if (on_disk < r.length) std::memcpy(bytes.data() + on_disk, staging_ + (r.offset + on_disk - flushed_), r.length - on_disk);
    if (HashChunk(bytes) != r.hash) continue;  // (never: what was appended was verified)
    if (cache_->Put(r.hash, bytes).ok()) ++put;
  }
  if (in >= 0) ::close(in);
  return put;
}

Status ChunkCache::AddWholeFile(const std::string& path, uint64_t size, std::span<const ChunkRef> rows) {
  total_ += size;
  Status indexed = PutReferences(path, rows);
  bool loaded = false;
  if (indexed.ok()) {
    struct stat st;
    MutexLock lock(refs_->mu);
    auto n = refs_->by_name.find(IndexNameOf(path));
    loaded = n != refs_->by_name.end() && ::stat(path.c_str(), &st) == 0 &&
             refs_->files.at(n->second).mtime_ns == MtimeNs(st);
  }
  if (!loaded) {
    // Not found through the index (its memory bound, or a failed write): no use as a copy.
    struct stat w;
    if (::lstat(path.c_str(), &w) == 0 && ::unlink(path.c_str()) == 0) Subtract(&total_, static_cast<uint64_t>(w.st_size));
    return indexed.ok() ? Status::ResourceExhausted("the reference index is full: " + path + " not kept") : indexed;
  }
  // Its chunks are found in it now: their own files go.
  size_t replaced = 0;
  for (const ChunkRef& r : rows) {
    const std::string chunk = PathOf(r.hash);
    struct stat st;
    if (::lstat(chunk.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::unlink(chunk.c_str()) == 0) {
      Subtract(&total_, static_cast<uint64_t>(st.st_size));
      ++replaced;
    }
  }
  spdlog::debug("chunk cache: whole file {} ({} chunks; it replaces {} chunk files)", path, rows.size(), replaced);
  return Status::Ok();
}

int ChunkCache::OpenWholeFile(const std::string& sha256, uint64_t size) {
  if (!IsSha256Hex(sha256)) return -1;
  const std::string path = WholeFilePath(sha256, size);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return -1;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return -1;
  }
  RefIndex& x = *refs_;
  if (!x.loaded.load()) {
    MutexLock scan(x.scan_mu);
    if (!x.loaded.load()) ScanRefs();
  }
  const std::string name = IndexNameOf(path);
  std::optional<uint32_t> id;
  std::string stale;
  int64_t touched = 0;
  {
    MutexLock lock(x.mu);
    if (auto n = x.by_name.find(name); n != x.by_name.end()) {
      const RefIndex::File& f = x.files.at(n->second);
      id = n->second;
      touched = f.touched;
      if (f.size != static_cast<uint64_t>(st.st_size) || f.size != size || f.mtime_ns != MtimeNs(st)) {
        stale = "changed since it was written (size " + std::to_string(st.st_size) + ", mtime " +
                std::to_string(MtimeNs(st)) + "; written at size " + std::to_string(f.size) + ", mtime " +
                std::to_string(f.mtime_ns) + ")";
      }
    }
  }
  if (!id || !stale.empty()) {
    ::close(fd);
    if (id) DropStaleRefs(*id, stale);  // (removes the whole file too)
    return -1;
  }
  if (const int64_t now = ::time(nullptr); touched < now - 60) {
    ::utimensat(AT_FDCWD, (refs_dir_ + "/" + name).c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
    MutexLock lock(x.mu);
    if (auto it = x.files.find(*id); it != x.files.end()) it->second.touched = now;
  }
  // (O_NONBLOCK was for the open only: a FIFO planted under the name must not hang it.)
  (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

bool ChunkCache::HasWholeFile(const std::string& sha256, uint64_t size) {
  const int fd = OpenWholeFile(sha256, size);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

}  // namespace weightfs
