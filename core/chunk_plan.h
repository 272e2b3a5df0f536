// ChunkPlan: how a file is cut into chunks, the unit of hashing, delta coding, caching and
// fetching.
//
// A safetensors file becomes one header chunk (the 8 + N prefix) followed by each tensor cut into
// element-aligned chunks of at most `chunk_bytes`. A chunk's identity across versions is
// (file path, tensor name, chunk index) — its ChunkKey here, the path being the caller's — so a
// header that grows and shifts every data offset does not break the pairing of a chunk with its
// parent. Any other file is cut into fixed-size chunks by offset, keyed by index.
//
// Plans are plain values; the functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"

namespace weightfs {

// Default chunk size: large enough that per-chunk overheads (model warm-up in the delta coder,
// pack index entries, range requests) are small; small enough that reading one tensor fetches
// little beyond it and one chunk per thread in memory stays cheap.
inline constexpr uint64_t kDefaultChunkBytes = 4ull << 20;
// Upper bound on any chunk a reader will accept (configured sizes are clamped to it).
inline constexpr uint64_t kMaxChunkBytes = 64ull << 20;

enum class ChunkRole : uint8_t { kHeader = 0, kTensor = 1, kOpaque = 2 };

// The name a header chunk uses in place of a tensor name.
inline constexpr const char* kHeaderChunkName = "__header__";

struct ChunkKey {
  std::string tensor;  // tensor name, kHeaderChunkName, or "" for an opaque file
  uint64_t index = 0;  // chunk index inside the tensor (or the file, for opaque files)
  bool operator==(const ChunkKey&) const = default;
  auto operator<=>(const ChunkKey&) const = default;
};

struct ChunkSpec {
  ChunkKey key;
  ChunkRole role = ChunkRole::kOpaque;
  DType dtype = DType::kOpaque;  // element type for tensor chunks, kOpaque otherwise
  uint64_t offset = 0;           // byte offset in the file
  uint64_t length = 0;           // bytes
};

struct ChunkPlan {
  uint64_t file_size = 0;
  bool safetensors = false;
  std::vector<ChunkSpec> chunks;  // in file order; they tile [0, file_size) exactly
};

// `header` is the parsed header when the file is valid safetensors, nullopt otherwise.
// `chunk_bytes` is clamped to [element size, kMaxChunkBytes]; tensor chunks hold whole elements.
ChunkPlan PlanChunks(const std::optional<SafetensorsHeader>& header, uint64_t file_size,
                     uint64_t chunk_bytes = kDefaultChunkBytes);

// Parses the safetensors header from a file's first bytes if it is one (nullopt otherwise) and
// plans it. `file` must hold the whole prefix (8 + N bytes) for a safetensors file to be seen as
// such; passing the whole file is simplest.
ChunkPlan PlanFile(std::span<const uint8_t> file_prefix, uint64_t file_size,
                   uint64_t chunk_bytes = kDefaultChunkBytes);

}  // namespace weightfs
