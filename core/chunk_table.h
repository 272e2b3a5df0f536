// ChunkTable: the chunk rows of one file of a version in bucket format 2 (docs/format2.md), as
// one compressed, columnar section of the version's table object. A reader touching one chunk
// fetches (by range) and decodes only the section of that file, for each version in its chain.
//
// Section bytes: one zstd frame holding
//   "WCT1"                                        magic
//   varint rows, varint names                     row count; distinct tensor names
//   names x (varint length, bytes)                tensor names, in order of first use
//   columns, each `rows` values, one after another (a column at a time compresses well):
//     tensor       varint   index into the names
//     index        zigzag   chunk index - (previous index of the same tensor + 1)
//     length       varint   chunk bytes (offsets are implied: rows tile the file in order)
//     encoding     byte
//     pack         zigzag   - previous row's pack
//     pack offset  zigzag   - (previous row's pack offset + pack length) when in the same pack
//     pack length  varint
//     origin       zigzag   - previous row's
//     base         zigzag   - previous row's
//     depth        zigzag   - previous row's
//     chain bytes  zigzag   of (chain bytes - pack length for a delta), - previous row's
//     keyframe     zigzag   - pack length for a keyframe (depth 0), else - the previous
//                            delta's keyframe bytes
//     hash         16 bytes per row, hi then lo, little-endian (incompressible: last)
//
// Decoding trusts nothing: the frame's size is bounded by the row count the head gives (itself
// bounded), every row passes the checks format 1 rows pass (core/manifest_checks.h), rows must
// tile [0, file size) and keys must not repeat.
//
// Values; functions are thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/manifest.h"
#include "core/status.h"

namespace weightfs {

// The section of `chunks` (rows of one file, in order). A delta row's chain bytes (less its own
// payload) and keyframe bytes are hints and are stored rounded to 6 significant bits (to the
// nearest: a chain's error is a random walk, ~3% after 64 deltas, not a drift).
std::vector<uint8_t> EncodeChunkTable(std::span<const ManifestChunk> chunks);

// `c` as a table gives it back (the hints rounded as above).
ManifestChunk AsStoredInTable(const ManifestChunk& c);

// What a section's rows may index into: the sizes of the head's tables.
struct ChunkTableLimits {
  uint64_t versions = 0;
  uint64_t packs = 0;
  uint64_t sources = 0;
};

// Decodes the section of `file` (whose size and row count come from the head) and validates its
// rows. Corruption naming what is wrong; ResourceExhausted if it would not fit `max_bytes` of
// decoded memory.
Expected<std::vector<ManifestChunk>> DecodeChunkTable(std::span<const uint8_t> section,
                                                      const ManifestFile& file,
                                                      const ChunkTableLimits& limits,
                                                      uint64_t max_bytes = 1ull << 30);

// Bytes a decoded row costs in memory (for caches that count bytes).
size_t ChunkRowsMemory(std::span<const ManifestChunk> chunks);

}  // namespace weightfs
