#include "hub/store/local_store.h"
#include "hub/store/direct_file.h"
#include "hub/store/local_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>

namespace weightfs {
namespace {

namespace fs = std::filesystem;
constexpr const char* kTmpDir = ".weightfs-tmp";
constexpr uint64_t kAroundCacheBytes = 1 << 20;  // ReadRange: larger ranges are read O_DIRECT

// StatusOfErrno, with two more meanings a store gives its callers: an object that exists
// (create-if-absent lost) and a directory it may not touch.
Status ErrnoStatus(int err, const std::string& what) {
  switch (err) {
    case EEXIST: return Status::Conflict(what + ": " + std::strerror(err));
    case EACCES:
    case EPERM: return Status::Auth(what + ": " + std::strerror(err));
    default: return StatusOfErrno(err, what);
  }
}

Status FsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open " + path);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  return rc == 0 ? Status::Ok() : ErrnoStatus(err, "fsync " + path);
}

Status MakeDirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), "mkdir " + dir);
  return Status::Ok();
}

std::string UniqueName() {
  static std::atomic<uint64_t> counter{0};
  thread_local std::mt19937_64 rng(std::random_device{}());
  return std::to_string(::getpid()) + "-" + std::to_string(counter.fetch_add(1)) + "-" +
         std::to_string(rng());
}

}  // namespace

Expected<std::unique_ptr<LocalStore>> LocalStore::Open(const std::string& root) {
  std::error_code ec;
  fs::path p = fs::absolute(root, ec);
  // A local bucket is a directory that `weightfs init` made: say that, and what is there instead.
  if (ec || !fs::exists(p, ec)) {
    return Status::NotFound("bucket directory " + root + " does not exist; make it a bucket with `weightfs init " +
                            root + "`");
  }
  if (!fs::is_directory(p, ec)) {
    return Status::InvalidArgument(root + " is a file, not a bucket: a local bucket is a directory (`weightfs init DIR` "
                                   "makes one)");
  }
  std::string s = p.lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return std::unique_ptr<LocalStore>(new LocalStore(s));
}

std::string LocalStore::PathOf(std::string_view key) const { return root_ + "/" + std::string(key); }

std::string LocalStore::Describe() const { return "file://" + root_; }

template <typename Buffer>
Status LocalStore::ReadRange(std::string_view key, std::optional<ByteRange> range, Buffer* out) {
  WFS_TRY(ValidateKey(key));
  const std::string path = PathOf(key);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, Describe() + "/" + std::string(key));
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::NotFound(Describe() + "/" + std::string(key) + ": not a regular object");
  }
  const auto size = static_cast<uint64_t>(st.st_size);
  uint64_t offset = range ? range->offset : 0;
  if (offset > size) {
    ::close(fd);
    return Status::InvalidArgument("range offset " + std::to_string(offset) + " past the end of " +
                                   std::string(key) + " (" + std::to_string(size) + " bytes)");
  }
  uint64_t length = size - offset;
  if (range && range->length) length = std::min(length, *range->length);
  out->resize(length);
  int err = 0;
  // A large range (a pack's chunks) around the page cache unless it is all cached: its bytes
  // are decoded into the chunk cache, which serves every later read, so their pages in the
  // kernel's cache would only be a second copy of the compressed model taking fresh memory
  // (a cold read of a 2 GB model from a local bucket, row 5 of scripts/bench_step.sh by hand:
  // the daemon's system time 0.8-1.1 s against 1.9-3.4 s, the read 2.9-3.3 s against 2.9-4.1 s).
  // Small ones (manifests, indexes, a delta of a few pages) through it.
  const uint64_t got = length >= kAroundCacheBytes ? PreadAroundCache(fd, out->data(), length, offset, &err)
                                                   : PreadUpTo(fd, out->data(), length, offset, &err);
  ::close(fd);
  if (got != length) return ErrnoStatus(err != 0 ? err : EIO, "read " + path);
  return Status::Ok();
}

Expected<std::vector<uint8_t>> LocalStore::Get(std::string_view key, std::optional<ByteRange> range) {
  std::vector<uint8_t> out;
  WFS_TRY(ReadRange(key, range, &out));
  return out;
}

Status LocalStore::GetInto(std::string_view key, ByteRange range, ByteBuffer* out) {
  return ReadRange(key, range, out);
}

Status LocalStore::Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) {
  WFS_TRY(ValidateKey(key));
  const std::string path = PathOf(key);
  const std::string dir = fs::path(path).parent_path().string();
  const std::string tmp_dir = root_ + "/" + kTmpDir;
  WFS_TRY(MakeDirs(dir));
  WFS_TRY(MakeDirs(tmp_dir));
  const std::string tmp = tmp_dir + "/" + UniqueName();
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(errno, "create " + tmp);
  uint64_t done = 0;
  while (done < data.size()) {
    ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, "write " + tmp);
    }
    done += static_cast<uint64_t>(w);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, "fsync " + tmp);
  }
  ::close(fd);
  int rc;
  if (mode == PutMode::kCreateIfAbsent) {
    rc = ::link(tmp.c_str(), path.c_str());
    int err = errno;
    ::unlink(tmp.c_str());
    if (rc != 0) {
      if (err == EEXIST) {
        return Status::Conflict(Describe() + "/" + std::string(key) + " already exists");
      }
      return ErrnoStatus(err, "link " + path);
    }
  } else {
    rc = ::rename(tmp.c_str(), path.c_str());
    if (rc != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, "rename to " + path);
    }
  }
  return FsyncPath(dir, O_RDONLY | O_DIRECTORY);
}

Expected<ObjectInfo> LocalStore::Head(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  struct stat st;
  if (::stat(PathOf(key).c_str(), &st) != 0) {
    return ErrnoStatus(errno, Describe() + "/" + std::string(key));
  }
  if (!S_ISREG(st.st_mode)) return Status::NotFound(Describe() + "/" + std::string(key) + ": not an object");
  return ObjectInfo{std::string(key), static_cast<uint64_t>(st.st_size)};
}

Expected<ListPage> LocalStore::List(std::string_view prefix, std::string_view continuation,
                                    size_t max_keys) {
  // Walk only the directory that can hold the prefix, then filter. Keys come back sorted and
  // the continuation is the last key returned, so pages are stable under concurrent writes.
  const size_t slash = prefix.rfind('/');
  const std::string base = slash == std::string_view::npos ? "" : std::string(prefix.substr(0, slash));
  const std::string start = base.empty() ? root_ : root_ + "/" + base;
  std::vector<ObjectInfo> all;
  std::error_code ec, exists_ec;
  if (fs::is_directory(start, exists_ec)) {
    for (auto it = fs::recursive_directory_iterator(start, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const std::string rel = fs::relative(it->path(), root_, ec).string();
      if (ec) break;
      if (it->is_directory()) {
        if (rel == kTmpDir) it.disable_recursion_pending();
        continue;
      }
      if (!it->is_regular_file()) continue;
      if (rel.compare(0, prefix.size(), prefix) != 0) continue;
      if (!continuation.empty() && rel <= continuation) continue;
      struct stat st {};
      const bool stated = ::stat(it->path().c_str(), &st) == 0;
      all.push_back(ObjectInfo{rel, stated ? static_cast<uint64_t>(st.st_size) : static_cast<uint64_t>(it->file_size(ec)),
                               stated ? static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000 : 0});
    }
  }
  if (ec) return ErrnoStatus(ec.value(), "list " + start);
  std::sort(all.begin(), all.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  ListPage page;
  max_keys = std::max<size_t>(max_keys, 1);
  if (all.size() > max_keys) {
    all.resize(max_keys);
    page.continuation = all.back().key;
  }
  page.objects = std::move(all);
  return page;
}

Expected<std::vector<TemporaryObject>> LocalStore::ListTemporaries() {
  std::vector<TemporaryObject> out;
  const std::string dir = root_ + "/" + kTmpDir;
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (errno == ENOENT) return out;
    return ErrnoStatus(errno, "list " + dir);
  }
  while (dirent* e = ::readdir(d)) {
    if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
    const std::string key = std::string(kTmpDir) + "/" + e->d_name;
    struct stat st;
    if (!ValidateKey(key).ok() || ::stat((root_ + "/" + key).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    out.push_back({key, static_cast<uint64_t>(st.st_size),
                   static_cast<int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1000000});
  }
  ::closedir(d);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return out;
}

Status LocalStore::Delete(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  if (::unlink(PathOf(key).c_str()) != 0) return ErrnoStatus(errno, Describe() + "/" + std::string(key));
  return Status::Ok();
}

}  // namespace weightfs
