// ReferenceIndex: the bytes of one reference index file of the chunk cache (<cache>/refs/, see
// hub/engine/chunk_cache.h): which byte ranges of one local file are which chunks.
//
// The bytes, integers little-endian:
//   "weightfs-chunk-refs 1\n"           magic and version (22 bytes)
//   u64 file_size                        the file's size when the index was written
//   i64 mtime_ns                         the file's mtime then (ns since the epoch)
//   u64 row_count
//   u32 path_length                      1..kMaxReferencePath
//   path                                 absolute, no NUL
//   row_count x {u64 hash.hi, u64 hash.lo, u64 offset, u64 length}   32 bytes a row
//   u64 XXH3-64 of every byte before it
// The checksum catches torn writes (index files are not fsynced, like chunk files); the sizes
// must add up to the file's length exactly; every row must lie inside file_size and be at most
// kMaxChunkBytes long. A row's bytes are still verified against its hash when read: the index
// says where to look, never what the bytes are.
//
// Functions only; thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/hash.h"
#include "core/status.h"

namespace weightfs {

// One row: bytes [offset, offset + length) of a file are the chunk `hash`.
struct ChunkRef {
  Hash128 hash;
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct ReferenceIndex {
  std::string path;
  uint64_t file_size = 0;
  int64_t mtime_ns = 0;
  std::vector<ChunkRef> rows;
};

inline constexpr size_t kMaxReferencePath = 4096;
// Bytes of an index file besides its path and rows.
inline constexpr uint64_t kReferenceIndexOverhead = 22 + 8 + 8 + 8 + 4 + 8;
inline constexpr uint64_t kReferenceRowBytes = 32;

// REQUIRES: index.path is 1..kMaxReferencePath bytes.
std::vector<uint8_t> SerializeReferenceIndex(const ReferenceIndex& index);
// Corruption (with what is wrong) for anything that is not exactly a valid index file.
Expected<ReferenceIndex> ParseReferenceIndex(std::span<const uint8_t> bytes);

}  // namespace weightfs
