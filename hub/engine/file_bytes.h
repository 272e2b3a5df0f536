// FileBytes: the bytes of a file being encoded, as the encoder reads them: a span in memory, or
// a descriptor read with pread.
//
// Why not a map: populating a map's page tables is the expensive part of reading a file that is
// in the page cache. On the 2-core VM the benchmarks run on, copying a 479 MB shard out of a
// map took 0.24 s and pread of the same bytes into a reused buffer 0.034 s (7x; MAP_POPULATE:
// 0.22 s); the copy out of the map was 18% of `weightfs push`'s CPU. The encoder copies every
// chunk into a private buffer before it hashes and encodes it anyway (a file that changes under
// it must not yield a hash of one state and a payload of another), so pread costs nothing more.
//
// A file that shrinks under a reader is an IOError of Read ("ended at ... bytes"), never a
// signal. Thread-safe for concurrent reads. Movable, not copyable. A view of memory or of a
// caller's descriptor holds neither (the caller keeps them alive while it is used); Open's
// descriptor is its own and closed with it.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/status.h"
#include "hub/store/direct_file.h"
#include "hub/store/local_file.h"  // PreadUpTo (callers of FileBytes use it too)

namespace weightfs {

class FileBytes {
 public:
  // Bytes in memory.
  explicit FileBytes(std::span<const uint8_t> memory) : memory_(memory), size_(memory.size()) {}
  // `size` bytes of the file open as `fd` (read from offset 0), `name` for errors.
  FileBytes(int fd, uint64_t size, std::string name) : fd_(fd), size_(size), name_(std::move(name)) {}
  // How Open reads the file: through the page cache, or around it (O_DIRECT,
  // hub/store/direct_file.h) for a file written so and read once, where the file system can.
  enum class Access { kCached, kDirect };
  // The file at `path` as it is now (its size at open), read through a descriptor of its own.
  static Expected<FileBytes> Open(const std::string& path, Access access = Access::kCached);
  FileBytes(FileBytes&& other) noexcept;
  FileBytes& operator=(FileBytes&& other) noexcept;
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;
  ~FileBytes();

  uint64_t size() const { return size_; }
  // Reads dst.size() bytes at `offset` (inside size()). IOError if the file ends before them.
  Status Read(uint64_t offset, std::span<uint8_t> dst) const;
  // Whether the file is shorter now than size(): it was truncated by someone (a read that
  // failed tells why by this).
  bool Shrank() const;
  // The bytes, when they are in memory (empty for a descriptor).
  std::span<const uint8_t> memory() const { return memory_; }
  bool in_memory() const { return fd_ < 0; }
  int descriptor() const { return fd_; }  // -1 in memory

 private:
  std::span<const uint8_t> memory_;
  int fd_ = -1;
  int direct_fd_ = -1;  // Access::kDirect: what Read reads through (fd_ stays for the rest)
  uint64_t size_ = 0;
  std::string name_;
  bool owns_fd_ = false;
};

}  // namespace weightfs
