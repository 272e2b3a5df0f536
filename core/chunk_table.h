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
// Blocks: the section of a file of more than kTableBlockRows rows is an index frame and then one
// such frame per block of kTableBlockRows rows (the last shorter), each a table of its rows as
// above (offsets implied from the block's first byte in the file), so that a reader of one
// chunk reads the index and one block, not the file's rows (docs/format2.md "Blocks"). The
// head gives the index frame's length (section [offset, length, index length]). Index frame:
//   "WCB1", varint rows per block, varint blocks,
//   blocks x varint frame length, blocks x varint file bytes the block's rows tile
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

// A file's whole section: one table frame when `chunks` are at most `block_rows`, else an index
// frame (index_length bytes) and the blocks' frames.
struct EncodedSection {
  std::vector<uint8_t> bytes;
  uint64_t index_length = 0;  // 0: one frame
};
EncodedSection EncodeChunkSection(std::span<const ManifestChunk> chunks, uint64_t block_rows = kTableBlockRows);

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

// Where the blocks of a blocked section are. Block k holds rows [k * block_rows, ...) and they
// tile the file's bytes [offsets[k], offsets[k + 1]); its frame is the section's bytes
// [starts[k], starts[k + 1]) (counted from the section's first byte: starts[0] is the index
// frame's length, starts.back() the section's).
struct TableBlockIndex {
  uint64_t block_rows = 0;
  std::vector<uint64_t> starts;
  std::vector<uint64_t> offsets;
  size_t blocks() const { return starts.empty() ? 0 : starts.size() - 1; }
  // The block whose rows hold byte `offset` of the file. REQUIRES: offset < the file's size.
  size_t BlockAt(uint64_t offset) const;
  size_t BlockOfRow(uint64_t row) const { return static_cast<size_t>(row / block_rows); }
  // Rows of block k.
  uint64_t RowsOf(size_t k, uint64_t file_rows) const {
    return std::min(block_rows, file_rows - static_cast<uint64_t>(k) * block_rows);
  }
  size_t Memory() const { return sizeof(*this) + (starts.size() + offsets.size()) * sizeof(uint64_t); }
};

// Decodes and checks the index frame of `file`'s blocked section (its length and row count
// from the head): the block count its rows need, frames that fill the section, spans that tile
// the file. Corruption naming what is wrong.
Expected<TableBlockIndex> DecodeTableIndex(std::span<const uint8_t> frame, const ManifestFile& file);

// A run of a file's rows: `rows` rows from row `first_row`, tiling the file's bytes from
// `offset`, `bytes` of them.
struct RowSpan {
  uint64_t first_row = 0;
  uint64_t rows = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Decodes the table frame of a block of `file`'s rows (`span`, from its block index) as
// DecodeChunkTable does a whole section; the rows' offsets are the file's.
Expected<std::vector<ManifestChunk>> DecodeChunkRows(std::span<const uint8_t> frame, const ManifestFile& file,
                                                     const RowSpan& span, const ChunkTableLimits& limits,
                                                     uint64_t max_bytes = 1ull << 30);

// Bytes a decoded row costs in memory (for caches that count bytes).
size_t ChunkRowsMemory(std::span<const ManifestChunk> chunks);

}  // namespace weightfs
