#include "hub/engine/file_bytes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace weightfs {

Expected<FileBytes> FileBytes::Open(const std::string& path, Access access) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return StatusOfErrno(errno, "opening " + path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return StatusOfErrno(err, "stat of " + path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::InvalidArgument(path + " is not a regular file");
  }
  FileBytes f(fd, static_cast<uint64_t>(st.st_size), path);
  f.owns_fd_ = true;
  // (A file system without direct I/O is read through the page cache.)
  if (access == Access::kDirect) f.direct_fd_ = std::max(-1, OpenDirect(path, O_RDONLY));
  return f;
}

FileBytes::FileBytes(FileBytes&& other) noexcept
    : memory_(other.memory_), fd_(other.fd_), direct_fd_(other.direct_fd_), size_(other.size_),
      name_(std::move(other.name_)), owns_fd_(other.owns_fd_) {
  other.fd_ = -1;
  other.direct_fd_ = -1;
  other.owns_fd_ = false;
}

FileBytes& FileBytes::operator=(FileBytes&& other) noexcept {
  if (this != &other) {
    if (owns_fd_) ::close(fd_);
    if (direct_fd_ >= 0) ::close(direct_fd_);
    memory_ = other.memory_;
    fd_ = other.fd_;
    direct_fd_ = other.direct_fd_;
    other.direct_fd_ = -1;
    size_ = other.size_;
    name_ = std::move(other.name_);
    owns_fd_ = other.owns_fd_;
    other.fd_ = -1;
    other.owns_fd_ = false;
  }
  return *this;
}

FileBytes::~FileBytes() {
  if (owns_fd_) ::close(fd_);
  if (direct_fd_ >= 0) ::close(direct_fd_);
}

bool FileBytes::Shrank() const {
  struct stat st {};
  return !in_memory() && ::fstat(fd_, &st) == 0 && static_cast<uint64_t>(st.st_size) < size_;
}

Status FileBytes::Read(uint64_t offset, std::span<uint8_t> dst) const {
  if (offset > size_ || dst.size() > size_ - offset) {
    return Status::InvalidArgument("read of " + std::to_string(dst.size()) + " bytes at " + std::to_string(offset) +
                                   " past the end of " + (name_.empty() ? "a buffer" : name_) + " (" +
                                   std::to_string(size_) + " bytes)");
  }
  if (in_memory()) {
    if (!dst.empty()) std::memcpy(dst.data(), memory_.data() + offset, dst.size());
    return Status::Ok();
  }
  int error = 0;
  const uint64_t got = direct_fd_ >= 0 ? PreadDirect(direct_fd_, dst.data(), dst.size(), offset, &error)
                                        : PreadUpTo(fd_, dst.data(), dst.size(), offset, &error);
  if (got == dst.size()) return Status::Ok();
  if (error != 0) return StatusOfErrno(error, "reading " + name_);
  return Status::IOError(name_ + " ended at " + std::to_string(offset + got) + " bytes while it was read (" +
                         std::to_string(size_) + " expected): it shrank");
}

}  // namespace weightfs
