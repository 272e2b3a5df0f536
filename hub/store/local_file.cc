#include "hub/store/local_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

namespace weightfs {

Status LastErrnoStatus(std::string_view what) { return StatusOfErrno(errno, what); }

Status WriteAtomically(const std::string& path, std::string_view bytes, AtomicWrite how) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, how.mode);
  if (fd < 0) return LastErrnoStatus("cannot write " + tmp);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n == 0 ? EIO : errno;
      ::close(fd);
      return StatusOfErrno(err, "writing " + tmp);
    }
    done += static_cast<size_t>(n);
  }
  if (how.durable && ::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return StatusOfErrno(err, "fsync " + tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return StatusOfErrno(err, "rename to " + path);
  }
  if (!how.durable) return Status::Ok();
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash);
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
  return Status::Ok();
}

Expected<std::string> ReadWholeFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotFound("cannot read " + path + ": " + std::strerror(errno));
  std::string out;
  char buf[1 << 16];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return StatusOfErrno(err, "reading " + path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

Status PwriteAll(int fd, const uint8_t* p, size_t n, uint64_t off, std::string_view what) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return LastErrnoStatus(std::string("writing ") + std::string(what));
    if (w == 0) return StatusOfErrno(EIO, std::string("writing ") + std::string(what));
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return Status::Ok();
}

uint64_t PreadUpTo(int fd, uint8_t* out, uint64_t size, uint64_t offset, int* error) {
  uint64_t done = 0;
  int err = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, out + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    done += static_cast<uint64_t>(n);
  }
  if (error != nullptr) *error = err;
  return done;
}

Status PreadAll(int fd, uint8_t* p, size_t n, uint64_t off, std::string_view what) {
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(off));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return LastErrnoStatus(std::string("reading ") + std::string(what));
    if (r == 0) {
      std::memset(p, 0, n);
      return Status::Ok();
    }
    p += r;
    n -= static_cast<size_t>(r);
    off += static_cast<uint64_t>(r);
  }
  return Status::Ok();
}

Status SyncFileSystemOf(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return LastErrnoStatus("cannot open " + path);
  const int rc = ::syncfs(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return StatusOfErrno(err, "syncfs " + path);
  return Status::Ok();
}

Status DataSync(int fd, std::string_view what) {
  if (::fdatasync(fd) != 0) return LastErrnoStatus(std::string("fsync ") + std::string(what));
  return Status::Ok();
}

void StartWriteback(int fd) { (void)::sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE); }

Status CopyPrefix(int from, int to, uint64_t size, std::string_view what) {
  loff_t in = 0, out = 0;
  while (static_cast<uint64_t>(in) < size) {
    ssize_t n = ::copy_file_range(from, &in, to, &out, size - static_cast<uint64_t>(in), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EXDEV || errno == ENOSYS || errno == EINVAL || errno == EOPNOTSUPP)) {
      std::vector<uint8_t> buf(1 << 20);
      while (static_cast<uint64_t>(in) < size) {
        const size_t want = std::min<uint64_t>(buf.size(), size - static_cast<uint64_t>(in));
        WFS_TRY(PreadAll(from, buf.data(), want, static_cast<uint64_t>(in), what));
        WFS_TRY(PwriteAll(to, buf.data(), want, static_cast<uint64_t>(in), what));
        in += static_cast<loff_t>(want);
      }
      break;
    }
    if (n < 0) return LastErrnoStatus(std::string("copying ") + std::string(what));
    if (n == 0) break;  // `from` is shorter than `size`: the rest reads as zeros
  }
  if (::ftruncate(to, static_cast<off_t>(size)) != 0) return LastErrnoStatus(std::string("resizing ") + std::string(what));
  return Status::Ok();
}

}  // namespace weightfs
