#include "hub/chunk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <random>

#include <spdlog/spdlog.h>

#include "core/chunk_plan.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

Status Errno(int err, const std::string& what) {
  std::string m = what + ": " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) return Status::ResourceExhausted(m);
  if (err == ENOENT) return Status::NotFound(m);
  return Status::IOError(m);
}

struct Entry {
  int64_t mtime_ns;
  uint64_t size;
  std::string path;
};

// Every chunk file under `dir` (skipping .tmp and .lock).
std::vector<Entry> Scan(const std::string& dir) {
  std::vector<Entry> entries;
  DIR* top = ::opendir(dir.c_str());
  if (!top) return entries;
  while (dirent* d = ::readdir(top)) {
    if (d->d_name[0] == '.' || std::strlen(d->d_name) != 2) continue;
    std::string sub = dir + "/" + d->d_name;
    DIR* inner = ::opendir(sub.c_str());
    if (!inner) continue;
    while (dirent* e = ::readdir(inner)) {
      if (e->d_name[0] == '.') continue;
      std::string path = sub + "/" + e->d_name;
      struct stat st;
      if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      entries.push_back({static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec,
                         static_cast<uint64_t>(st.st_size), std::move(path)});
    }
    ::closedir(inner);
  }
  ::closedir(top);
  return entries;
}

}  // namespace

ChunkBytes::ChunkBytes(ByteBuffer buffer)
    : ChunkBytes(std::make_shared<const ByteBuffer>(std::move(buffer))) {}

ChunkBytes::ChunkBytes(std::shared_ptr<const ByteBuffer> buffer)
    : owner_(buffer), buffer_(std::move(buffer)), data_(buffer_->data()), size_(buffer_->size()) {}

Expected<std::unique_ptr<ChunkCache>> ChunkCache::Open(const std::string& dir, uint64_t max_bytes) {
  std::error_code ec;
  const std::string chunks = dir + "/chunks";
  fs::create_directories(chunks + "/.tmp", ec);
  if (ec) {
    return Status::IOError("cannot create cache directory " + chunks + ": " + ec.message() +
                           " (choose another with --cache-dir)");
  }
  std::unique_ptr<ChunkCache> cache(new ChunkCache(chunks, max_bytes));
  uint64_t total = 0;
  for (const Entry& e : Scan(chunks)) total += e.size;
  cache->total_ = total;
  // Leftovers of inserts killed midway.
  for (const auto& f : fs::directory_iterator(chunks + "/.tmp", ec)) {
    struct stat st;
    if (::stat(f.path().c_str(), &st) == 0 && st.st_mtime < ::time(nullptr) - 3600) {
      ::unlink(f.path().c_str());
    }
  }
  if (total > max_bytes) WFS_TRY(cache->EvictTo(max_bytes / 10 * 9));
  return cache;
}

std::string ChunkCache::PathOf(const Hash128& hash) const {
  std::string hex = hash.ToHex();
  return dir_ + "/" + hex.substr(0, 2) + "/" + hex;
}

bool ChunkCache::Contains(const Hash128& hash) const {
  const std::string path = PathOf(hash);
  return ::access(path.c_str(), F_OK) == 0 || ::access((path + ".ref").c_str(), F_OK) == 0;
}

namespace {

constexpr const char* kRefMagic = "weightfs-chunk-ref 1";

// Reads up to `size` bytes at `offset`; the number read (less at the end of the file or on an
// error).
uint64_t ReadFull(int fd, uint8_t* out, uint64_t size, uint64_t offset) {
  uint64_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + done));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      break;
    }
    done += static_cast<uint64_t>(n);
  }
  return done;
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

}  // namespace

bool ChunkCache::GetReference(const Hash128& hash, const Output& output) {
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
        ok = out.size() == length && ReadFull(fd.fd, out.data(), length, offset) == length &&
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

Status ChunkCache::PutReference(const Hash128& hash, const std::string& path, uint64_t offset,
                                uint64_t length) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return Errno(errno, "cache reference to " + path);
  if (path.size() > 3000 || path.find('\n') != std::string::npos) {
    return Status::InvalidArgument("path not suitable for a cache reference: " + path);
  }
  char head[160];
  std::snprintf(head, sizeof head, "%s\n%llu %llu %llu %lld\n", kRefMagic,
                static_cast<unsigned long long>(offset), static_cast<unsigned long long>(length),
                static_cast<unsigned long long>(st.st_size),
                static_cast<long long>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec);
  std::string body = std::string(head) + path;
  Status s = WriteEntry(PathOf(hash) + ".ref", {reinterpret_cast<const uint8_t*>(body.data()), body.size()}, 0);
  if (!s.ok()) {
    failed_inserts_.Log("chunk cache: " + s.ToString());
    return s;
  }
  failed_inserts_.Flush();
  stats_.inserts++;
  return s;
}

bool ChunkCache::Get(const Hash128& hash, ByteBuffer* out) {
  return GetInto(hash, [out](size_t size) {
    out->resize(size);
    return std::span<uint8_t>(out->data(), out->size());
  });
}

bool ChunkCache::GetInto(const Hash128& hash, const Output& output) {
  const std::string path = PathOf(hash);
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) {
    if (GetReference(hash, output)) {
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
    (void)::posix_fadvise(fd.fd, 0, static_cast<off_t>(size), POSIX_FADV_WILLNEED);
    // The copy is what gets hashed and what the caller serves: a change to the file after this
    // read cannot reach the caller, and one during it fails the hash or the length.
    const std::span<uint8_t> out = output(size);
    const uint64_t got = out.size() == size ? ReadFull(fd.fd, out.data(), size, 0) : 0;
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
  struct stat now;
  if (::stat(path.c_str(), &now) == 0 && static_cast<uint64_t>(now.st_dev) == dev &&
      static_cast<uint64_t>(now.st_ino) == ino && ::unlink(path.c_str()) == 0) {
    uint64_t total = total_.load();
    while (!total_.compare_exchange_weak(total, total - std::min(total, size))) {
    }
  }
  corrupt_entries_.Log("chunk cache entry " + path + " is corrupt (" + why + "); dropped it");
}

Status ChunkCache::WriteEntry(const std::string& path, std::span<const uint8_t> bytes,
                              size_t direct_capacity) {
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = dir_ + "/.tmp/" + path.substr(path.rfind('/') + 1) + "." +
                          std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  constexpr size_t kDirectAlign = 4096;
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
    return Errno(err, "cache insert " + tmp);
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
      return Errno(err, "cache insert " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (direct && padded != bytes.size() && ::ftruncate(fd, static_cast<off_t>(bytes.size())) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return Errno(err, "cache insert " + tmp);
  }
  // No fsync: a torn entry after a crash fails verification and is dropped, which is cheaper
  // than an fsync per chunk.
  ::close(fd);
  std::string sub = path.substr(0, path.rfind('/'));
  ::mkdir(sub.c_str(), 0755);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return Errno(err, "cache insert " + path);
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
  if (total_.load() + bytes.size() > max_bytes_) {
    Status s = EvictTo(max_bytes_ / 10 * 9 > bytes.size() ? max_bytes_ / 10 * 9 - bytes.size() : 0);
    if (!s.ok()) {
      failed_evictions_.Log("chunk cache: eviction failed: " + s.ToString());
    } else {
      failed_evictions_.Flush();
    }
  }
  Status s = WriteEntry(PathOf(hash), bytes, direct_capacity);
  if (s.kind() == ErrorKind::kResourceExhausted) {
    // The disk is fuller than our budget assumed: make room and try once more.
    uint64_t now = total_.load();
    (void)EvictTo(now / 2);
    s = WriteEntry(PathOf(hash), bytes, direct_capacity);
  }
  if (!s.ok()) {
    failed_inserts_.Log("chunk cache: " + s.ToString());
    return s;
  }
  failed_inserts_.Flush();  // a count left from a disk that was full
  total_ += bytes.size();
  stats_.inserts++;
  return Status::Ok();
}

Status ChunkCache::EvictTo(uint64_t target) {
  std::lock_guard<std::mutex> lock(evict_mu_);
  const std::string lock_path = dir_ + "/.lock";
  int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return Errno(errno, "cache lock " + lock_path);
  while (::flock(fd, LOCK_EX) != 0) {
    if (errno != EINTR) {
      int err = errno;
      ::close(fd);
      return Errno(err, "flock " + lock_path);
    }
  }
  std::vector<Entry> entries = Scan(dir_);
  uint64_t total = 0;
  for (const Entry& e : entries) total += e.size;
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.mtime_ns < b.mtime_ns; });
  size_t removed = 0;
  for (const Entry& e : entries) {
    if (total <= target) break;
    if (::unlink(e.path.c_str()) == 0 || errno == ENOENT) {
      total -= e.size;
      ++removed;
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
