// MappedFile: a read-only memory map of a whole file (the tools read inputs this way so that
// a multi-GB checkpoint costs page cache, not heap; the mount's drafts encode staging files
// this way). Movable, not copyable; the bytes stay valid while the object lives. Thread-safe
// for concurrent reads.
//
// Guarded against files that shrink under the map: touching a page past a file's new end
// raises SIGBUS, which would kill the process (a user truncating a checkpoint while `push`
// reads it; anything truncating a staging file while the mount encodes it). Every MappedFile
// registers its range with a process-wide SIGBUS handler; a fault inside a registered range
// replaces the rest of the map, from the faulting page on, with zero pages, counts the fault
// and lets the reader go on. The reader then reads zeros, not the file: a user of the bytes
// must check faulted() after it is done with them and throw its results away if it is set.
// A SIGBUS anywhere else goes to the handler that was installed before (or kills the process,
// as it would have).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "core/status.h"

namespace weightfs {

class MappedFile {
 public:
  static Expected<MappedFile> Open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  ~MappedFile();

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  uint64_t size() const { return size_; }
  // True if the file shrank under the map and a read touched a page past its new end: some of
  // bytes() read as zeros since. Check it after the last use of the bytes.
  bool faulted() const;
  // Touches every page so that timings that follow measure the code, not the disk.
  void Prefault() const;

  // Guarded maps that faulted since the process started (for tests and the log).
  static uint64_t total_faults();

 private:
  void Release();

  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int slot_ = -1;  // the registry slot guarding the map (-1: none, see mapped_file.cc)
};

}  // namespace weightfs
