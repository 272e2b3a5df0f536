// The checks a chunk row of a manifest passes, whatever its serialization (format 1 JSON rows,
// core/manifest_reader.cc; format 2 binary tables, core/chunk_table.cc): internal to core/.
#pragma once

#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "core/chunk_codec.h"
#include "core/file_codec.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "core/status.h"

namespace weightfs::manifest_checks {

inline constexpr uint64_t kMaxFileSize = 1ull << 50;
inline constexpr uint32_t kMaxDepth = 100000;
inline constexpr uint64_t kMaxPayloadBytes = 2 * kMaxChunkBytes + 4096;
inline constexpr uint64_t kMaxTensorName = 4096;
// Entries of `versions` and of `sources`; `packs` may hold up to UINT32_MAX (a recipe's index
// is 32 bits).
inline constexpr uint64_t kMaxTableEntries = 1000000;
inline constexpr uint64_t kMaxPacks = UINT32_MAX;
inline constexpr size_t kRowColumns = 14;

// The sizes of the tables a chunk row indexes into. While they are not known yet, their caps:
// an index at or beyond a cap fails whatever the table turns out to hold.
struct Tables {
  uint64_t versions = kMaxTableEntries;
  uint64_t packs = kMaxPacks;
  uint64_t sources = kMaxTableEntries;
};

// A chunk row as read, before validation.
struct RawRow {
  size_t columns = 0;  // seen so far, however many
  Status error;        // the first column of the wrong type (or a bad hash)
  std::string tensor;
  Hash128 hash;
  uint64_t v[kRowColumns] = {};  // the integer columns, by position

  void Reset() {
    columns = 0;
    error = Status::Ok();
    tensor.clear();
  }
};

inline constexpr const char* kColumnNames[kRowColumns] = {
    "chunk tensor", "chunk index", "chunk offset", "chunk length", "chunk hash",
    "chunk encoding", "chunk pack", "chunk pack offset", "chunk pack length", "chunk origin",
    "chunk base", "chunk depth", "chunk chain bytes", "chunk keyframe bytes"};
enum Column : size_t {
  kTensor = 0, kIndex, kOffset, kLength, kHash, kEncoding, kPack, kPackOffset, kPackLength,
  kOrigin, kBase, kDepth, kChainBytes, kKeyframeBytes,
};

// The checks of a chunk's references into the manifest's tables, in the order CheckRow makes
// them. `external`: `pack` indexes sources.
inline Status CheckPack(bool external, uint64_t pack, const Tables& t) {
  const uint64_t n = external ? t.sources : t.packs;
  if (pack < n) return Status::Ok();
  return Status::Corruption(std::string("chunk names ") + (external ? "source " : "pack ") +
                            std::to_string(pack) + " of " + std::to_string(n));
}

inline Status CheckOrigin(uint64_t origin, const Tables& t) {
  return origin < t.versions ? Status::Ok() : Status::Corruption("chunk origin out of range");
}

inline Status CheckBase(uint64_t base, const Tables& t) {
  return base != 0 && base < t.versions
             ? Status::Ok()
             : Status::Corruption("delta chunk's base version out of range");
}

inline bool IsDelta(ChunkEncoding e) {
  return e == ChunkEncoding::kSparse || e == ChunkEncoding::kDense || e == ChunkEncoding::kPatch;
}

// Validates a row whose columns all have their types; fills *out (when given) if it passes.
// With the tables' caps for `t`, an index check fails only where it must fail for any table.
inline Status CheckRow(const RawRow& r, const Tables& t, ManifestChunk* out) {
  const uint64_t enc = r.v[kEncoding], pack = r.v[kPack], length = r.v[kLength];
  const uint64_t ref_offset = r.v[kPackOffset], ref_length = r.v[kPackLength];
  const uint64_t origin = r.v[kOrigin], base = r.v[kBase], depth = r.v[kDepth];
  const uint64_t chain_bytes = r.v[kChainBytes], keyframe_bytes = r.v[kKeyframeBytes];
  if (r.tensor.size() > kMaxTensorName) return Status::Corruption("tensor name longer than 4096 bytes");
  if (enc < 1 || enc > 6) return Status::Corruption("unknown chunk encoding " + std::to_string(enc));
  const auto encoding = static_cast<ChunkEncoding>(enc);
  if (length == 0 || length > kMaxChunkBytes) {
    return Status::Corruption("chunk length " + std::to_string(length) + " out of range");
  }
  const bool external = encoding == ChunkEncoding::kExternal;
  WFS_TRY(CheckPack(external, pack, t));
  if (external) {
    if (ref_length != length || ref_offset > kMaxFileSize) {
      return Status::Corruption("external chunk's source range out of bounds");
    }
  } else if (ref_length < kPayloadHeaderBytes || ref_length > kMaxPayloadBytes ||
             ref_offset > (1ull << 48)) {
    return Status::Corruption("chunk payload range out of bounds");
  }
  WFS_TRY(CheckOrigin(origin, t));
  if (depth > kMaxDepth) return Status::Corruption("chunk chain depth out of range");
  // No chain holds more than kMaxDepth payloads of kMaxPayloadBytes; larger counts would wrap
  // KeyframePolicy's sum (and the writer's) around u64.
  if (chain_bytes > kMaxDepth * kMaxPayloadBytes) return Status::Corruption("chunk chain bytes out of range");
  if (keyframe_bytes > kMaxPayloadBytes) return Status::Corruption("chunk keyframe bytes out of range");
  if (IsDelta(encoding)) {
    WFS_TRY(CheckBase(base, t));
    if (depth == 0) return Status::Corruption("delta chunk with depth 0");
  } else if (base != 0 || depth != 0) {
    return Status::Corruption("keyframe chunk with a base");
  }
  if (out != nullptr) {
    out->key.index = r.v[kIndex];
    out->offset = r.v[kOffset];
    out->length = length;
    out->hash = r.hash;
    out->encoding = encoding;
    out->ref = {static_cast<uint32_t>(pack), ref_offset, ref_length};
    out->origin = static_cast<uint32_t>(origin);
    out->base = static_cast<uint32_t>(base);
    out->depth = static_cast<uint32_t>(depth);
    out->chain_bytes = chain_bytes;
    out->keyframe_bytes = keyframe_bytes;
  }
  return Status::Ok();
}

// CheckRow's index checks for a chunk that passed the others.
inline Status CheckRefs(const ManifestChunk& c, const Tables& t) {
  WFS_TRY(CheckPack(c.is_external(), c.ref.pack, t));
  WFS_TRY(CheckOrigin(c.origin, t));
  if (c.is_delta()) WFS_TRY(CheckBase(c.base, t));
  return Status::Ok();
}

// The index of the first chunk whose key an earlier chunk has, or nullopt.
inline std::optional<size_t> FirstRepeatedKey(const std::vector<ManifestChunk>& chunks) {
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(chunks[a].key, a) < std::tie(chunks[b].key, b);
  });
  std::optional<size_t> first;
  for (size_t i = 1; i < order.size(); ++i) {
    if (chunks[order[i]].key == chunks[order[i - 1]].key && (!first || order[i] < *first)) {
      first = order[i];
    }
  }
  return first;
}

}  // namespace weightfs::manifest_checks
