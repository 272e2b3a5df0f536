// Files written once front to back and read once, kept out of the page cache: a draft's staging
// file, which a checkpoint's writer fills and the encoder reads back.
//
// Why: through the page cache, every byte of a staging file lands in a freshly allocated cache
// page, and touching memory for the first time is expensive on VMs whose hosts take free
// memory back (virtio-balloon free page reporting, as on the 2-core VM the benchmarks run on):
// writing 2 GB into a new file took 3.6-4.7 CPU-s there, and 46% of the daemon's CPU while a
// 2 GB checkpoint was saved by `cp` into a draft went to copying the writes into new cache
// pages (`copy_folio_from_iter_atomic`). The same 2 GB also pushed other cached data (the
// model the checkpoint was saved from, a reader's files) out of memory for nothing.
//
// The price: where the pages a save gets are ones freed a moment before (bench_step's saves
// run back to back), plain buffered writes are cheap, and these cost more: the writer waits
// for each window's writeback, the encoder reads the disk. docs/mount.md has both measures.
//
// Two ways out were measured (scripts, 2 GB in 1 MiB writes to a new file):
//   plain buffered writes                         3.6-4.7 s   3.6-4.8 CPU-s
//   O_DIRECT writes (waits for the disk per write) 1.3-1.6 s   0.1 CPU-s
//   StreamedWrites below (bounded page cache)      0.63-0.66 s 0.4 CPU-s
// StreamedWrites wins: the writer does not wait for the disk on each write, and the pages it
// drops are the ones its next writes get (memory the host still backs). O_DIRECT made each
// FUSE write of a `cp` into a draft wait for the disk (cp: 1 s -> 3.6-4.2 s).
//
// The reader (the encoder) then reads around the page cache (PreadDirect): the bytes are on
// disk, or nearly, and reading them buffered would fill the cache again. The kernel keeps the
// two kinds of access coherent: a direct read first writes back the cached dirty pages of its
// range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace weightfs {

// The alignment direct I/O is done at: a page, which covers every logical block size of a
// Linux block device (512 to 4096).
inline constexpr uint64_t kDirectAlign = 4096;

// Opens `path` with `flags` | O_DIRECT | O_CLOEXEC; -1 (errno set) when it cannot be opened,
// EINVAL when its file system does not do direct I/O (tmpfs before Linux 6.6, some FUSE file
// systems): the caller then reads through the page cache.
int OpenDirect(const std::string& path, int flags);

// Reads up to `size` bytes at `offset` through `direct_fd` (any offset and size: it reads the
// aligned blocks around them into an aligned buffer of the thread's), like PreadUpTo
// (local_file.h): returns how many it read, fewer at the end of the file or on an error (its
// errno in *error, else 0).
uint64_t PreadDirect(int direct_fd, uint8_t* out, uint64_t size, uint64_t offset, int* error = nullptr);

// Whether every page of `fd`'s bytes [offset, +length) is in the page cache (mincore of a map of
// them: no I/O, unlike a preadv2 RWF_NOWAIT, which starts the kernel's readahead of what it
// does not find). False when that cannot be told, and for a file the caller neither owns nor
// may write (the kernel then answers only for pages mapped in the caller; mincore(2)): such a
// reader reads around the cache. A reader that reads a range O_DIRECT unless this says it is
// cached gets the cached bytes from memory and leaves the cache as it was.
bool AllInPageCache(int fd, uint64_t offset, uint64_t length);

// Reads [offset, +size) of `fd` (opened for this read: its flags change) into `out`: from the
// page cache when AllInPageCache, else O_DIRECT (through the cache where the file system does
// not do direct I/O). Returns how many bytes it read, as PreadUpTo.
uint64_t PreadAroundCache(int fd, uint8_t* out, uint64_t size, uint64_t offset, int* error = nullptr);

// A file written front to back keeps at most two windows of it in the page cache: each time
// the writes pass a window's end, that window's writeback starts, and the window before it is
// waited for and dropped from the cache. Writes elsewhere (back, or far ahead) change nothing
// but where the next window starts. The file's bytes and their durability are unchanged: this
// only orders the I/O and frees the pages early. Not thread-safe (the file's lock guards it).
class StreamedWrites {
 public:
  static constexpr uint64_t kWindowBytes = 8 << 20;
  // After a write of [offset, end) to `fd`.
  void Wrote(int fd, uint64_t offset, uint64_t end);
  // Whether a window was written back and dropped: the file's bytes are mostly on disk, not in
  // the cache (read them direct).
  bool dropped() const { return dropped_; }
  // The file was replaced (truncated and written anew, moved): start over.
  void Reset() { *this = StreamedWrites(); }

 private:
  uint64_t next_ = 0;     // where the next write of the stream starts
  uint64_t started_ = 0;  // [window_start_, started_): writeback started, not yet dropped
  uint64_t window_start_ = 0;
  bool dropped_ = false;
};

}  // namespace weightfs
