#include "hub/store/direct_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "hub/store/local_file.h"

namespace weightfs {
namespace {

// The largest read through the aligned buffer at once: a default chunk (4 MiB) at any offset in
// one read (its blocks, with the two it starts and ends in), a larger one in a few.
constexpr size_t kBounceBytes = (4 << 20) + 2 * kDirectAlign;

struct FreeAligned {
  void operator()(uint8_t* p) const { std::free(p); }
};

// This thread's aligned buffer for direct reads (allocated on first use, reused by every read:
// memory that stays warm).
uint8_t* Bounce() {
  thread_local std::unique_ptr<uint8_t, FreeAligned> buffer;
  if (!buffer) {
    buffer.reset(static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, kBounceBytes)));
    if (!buffer) throw std::bad_alloc();
  }
  return buffer.get();
}

}  // namespace

int OpenDirect(const std::string& path, int flags) { return ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC); }

uint64_t PreadDirect(int direct_fd, uint8_t* out, uint64_t size, uint64_t offset, int* error) {
  int err = 0;
  uint64_t done = 0;  // bytes of `out` filled
  uint8_t* bounce = Bounce();
  const uint64_t aligned_end = (offset + size + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  while (done < size) {
    const uint64_t want = offset + done;  // the next byte wanted
    const uint64_t pos = want / kDirectAlign * kDirectAlign;
    const uint64_t span = std::min<uint64_t>(kBounceBytes, aligned_end - pos);
    const ssize_t r = ::pread(direct_fd, bounce, static_cast<size_t>(span), static_cast<off_t>(pos));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) err = errno;
    if (r <= 0 || static_cast<uint64_t>(r) <= want - pos) break;  // an error, or the end of the file
    const uint64_t got = std::min<uint64_t>(static_cast<uint64_t>(r) - (want - pos), size - done);
    std::memcpy(out + done, bounce + (want - pos), got);
    done += got;
    if (static_cast<uint64_t>(r) % kDirectAlign != 0) break;  // ends inside a block: the end of the file
  }
  if (error != nullptr) *error = err;
  return done;
}

bool AllInPageCache(int fd, uint64_t offset, uint64_t length) {
  if (length == 0) return true;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const size_t span = static_cast<size_t>(offset + length - start);
  void* map = ::mmap(nullptr, span, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(start));
  if (map == MAP_FAILED) return false;
  std::vector<unsigned char> resident((span + page - 1) / page);
  const bool all = ::mincore(map, span, resident.data()) == 0 &&
                   std::all_of(resident.begin(), resident.end(), [](unsigned char c) { return (c & 1) != 0; });
  ::munmap(map, span);
  return all;
}

uint64_t PreadAroundCache(int fd, uint8_t* out, uint64_t size, uint64_t offset, int* error) {
  if (!AllInPageCache(fd, offset, size)) {
    const int flags = ::fcntl(fd, F_GETFL);
    if (flags >= 0 && ((flags & O_DIRECT) != 0 || ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0)) {
      int err = 0;
      const uint64_t got = PreadDirect(fd, out, size, offset, &err);
      if (got == size || err != EINVAL) {
        if (error != nullptr) *error = err;
        return got;
      }
      // A file system that takes the flag and then refuses the read (an alignment of its own):
      // the rest through the page cache.
      (void)::fcntl(fd, F_SETFL, flags & ~O_DIRECT);
      return got + PreadUpTo(fd, out + got, size - got, offset + got, error);
    }
  }
  return PreadUpTo(fd, out, size, offset, error);
}

void StreamedWrites::Wrote(int fd, uint64_t offset, uint64_t end) {
  if (offset != next_) {  // not the stream's next write: the windows start again from here
    window_start_ = started_ = offset / kWindowBytes * kWindowBytes;
  }
  next_ = end;
  while (end >= started_ + kWindowBytes) {
    // (Best effort: a failure here loses nothing; the writes' own errors and fdatasync's speak.)
    (void)::sync_file_range(fd, static_cast<off64_t>(started_), kWindowBytes, SYNC_FILE_RANGE_WRITE);
    started_ += kWindowBytes;
    if (started_ - window_start_ > 2 * kWindowBytes) {
      const uint64_t drop = window_start_;
      (void)::sync_file_range(fd, static_cast<off64_t>(drop), kWindowBytes,
                              SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
      (void)::posix_fadvise(fd, static_cast<off_t>(drop), kWindowBytes, POSIX_FADV_DONTNEED);
      window_start_ += kWindowBytes;
      dropped_ = true;
    }
  }
}

}  // namespace weightfs
