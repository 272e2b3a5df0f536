// MappedFile: a read-only memory map of a whole file (the tools read inputs this way so that
// a multi-GB checkpoint costs page cache, not heap). Movable, not copyable; the bytes stay
// valid while the object lives. Thread-safe for concurrent reads.
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
  // Touches every page so that timings that follow measure the code, not the disk.
  void Prefault() const;

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace weightfs
