// Manifest: the description of one published version — its files, their chunks, and for every
// chunk the recipe that materializes it from the bucket's packs.
//
// A recipe is one payload (FULL/RAW, or a delta) in a pack. A delta's base is the chunk with the
// same file path and ChunkKey in an older version named by `base` (an index into `versions`);
// that version's manifest holds the base's own recipe, and so on back to a keyframe. A chunk
// that did not change inherits its parent's recipe unchanged (origin != 0), so a version costs
// only its changed chunks, and a chain never needs more manifests than its depth.
//
// Format 1 (JSON, stored zstd-compressed when large; readers accept both):
//   {"format": 1, "model": "acme/qwen", "version": "step-2", "parent": "step-1" | null,
//    "created": "2026-12-02T13:00:00.000Z", "chunk_bytes": 4194304,
//    "versions": ["step-2", "step-1", ...],   // [0] is this version; recipes index into it
//    "packs": ["<32 hex>", ...],              // every pack a recipe here points into
//    "stats": {"logical_bytes": N, "stored_bytes": N, "changed_elements": N, "elements": N},
//    "files": [{"path": "model.safetensors", "size": N, "sha256": "<64 hex>",
//               "chunks": [[tensor, index, offset, length, hash, encoding, pack, pack_offset,
//                           pack_length, origin, base, depth, chain_bytes, keyframe_bytes], ...]}]}
// Chunk rows are arrays: at 10^5..10^6 chunks per version the manifest must stay small and fast.
//
// Validation (ParseManifest) trusts nothing: names (no escapes, see ValidateModelName /
// ValidateVersionName / ValidateFilePath), chunks tiling each file exactly, indices in range,
// lengths capped, depth decreasing along a chain (a cycle cannot pass that check).
//
// Values, no I/O; functions are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/chunk_codec.h"
#include "core/chunk_plan.h"
#include "core/hash.h"
#include "core/status.h"

namespace weightfs {

inline constexpr int kManifestFormat = 1;
// Bucket format 2 (docs/format2.md): a version is a small head (this JSON, each file's rows in a
// section of a binary table object instead of inline) and the table.
inline constexpr int kManifestFormat2 = 2;

struct PayloadRef {
  uint32_t pack = 0;     // index into Manifest::packs
  uint64_t offset = 0;   // byte offset of the payload in the pack
  uint64_t length = 0;   // payload bytes
};

struct ManifestChunk {
  ChunkKey key;
  uint64_t offset = 0;  // in the file
  uint64_t length = 0;
  Hash128 hash;         // of the materialized bytes
  ChunkEncoding encoding = ChunkEncoding::kFull;  // of the payload; never kSame here
  // kExternal: ref.pack indexes Manifest::sources, ref.offset/length is the byte range there
  // (length == the chunk's length). Otherwise a payload in a pack.
  PayloadRef ref;
  uint32_t origin = 0;  // version (index into versions) that wrote the payload; 0 = this one
  uint32_t base = 0;    // for deltas: version holding the base chunk (same path and key)
  uint32_t depth = 0;   // deltas since the keyframe (0 for FULL/RAW)
  uint64_t chain_bytes = 0;     // payload bytes of those deltas, this one included
  uint64_t keyframe_bytes = 0;  // payload bytes of the keyframe the chain starts at
  bool is_external() const { return encoding == ChunkEncoding::kExternal; }
  bool is_delta() const {
    return encoding == ChunkEncoding::kSparse || encoding == ChunkEncoding::kDense ||
           encoding == ChunkEncoding::kPatch;
  }
};

// Rows per block of a section in blocks (core/chunk_table.h). 512 rows of 4 MiB chunks tile 2 GiB
// of a file; a block is ~10 KB on the wire (~20 bytes a row), ~60 KB decoded.
constexpr uint64_t kTableBlockRows = 512;

// Where a file's rows are in a format 2 version's table object (core/chunk_table.h).
struct TableSection {
  uint64_t offset = 0;  // in the table object
  uint64_t length = 0;  // bytes of the section
  uint64_t rows = 0;    // chunk rows it holds
  // Bytes of its block index (core/chunk_table.h: a file of more than kTableBlockRows rows);
  // 0: the section is one table of every row.
  uint64_t index_length = 0;
  // One table of more rows than a block holds: written before table blocks (format2.md
  // "Blocks"); every read of one chunk decodes all of it. `weightfs upgrade` rewrites it.
  bool ShouldBeBlocks() const { return index_length == 0 && rows > kTableBlockRows; }
};

struct ManifestFile {
  std::string path;  // relative, '/'-separated
  uint64_t size = 0;
  std::string sha256;
  // Tile [0, size) in order. Empty in a format 2 head until the file's section is read
  // (rows_loaded false): hub's Bucket::File resolves it. Or a block of them (a window: hub's
  // Bucket::RowsAt): chunks[0] is the file's row first_row, and the rows tile part of the file.
  std::vector<ManifestChunk> chunks;
  bool rows_loaded = true;
  uint64_t first_row = 0;
  TableSection section;  // format 2
  // Index of the chunk with this key, or nullopt.
  std::optional<size_t> FindChunk(const ChunkKey& key) const;
  // The chunk with this key, trying index `hint` first (versions of a file usually share their
  // layout, so a chain walk finds its parent's row at once), then a scan; null if none.
  const ManifestChunk* FindChunkNear(const ChunkKey& key, size_t hint) const;
  // Index (in chunks) of the chunk containing byte `offset`. REQUIRES: Holds(offset).
  size_t ChunkAt(uint64_t offset) const;
  // Whether the rows held (all, or a block's) hold byte `offset` of the file.
  bool Holds(uint64_t offset) const {
    return rows_loaded && !chunks.empty() && offset >= chunks.front().offset &&
           offset - chunks.front().offset < chunks.back().offset + chunks.back().length - chunks.front().offset;
  }
  // Rows of the whole file (a head's or a block's count them all).
  uint64_t RowCount() const { return AllRows() ? chunks.size() : section.rows; }
  // Whether these are all of the file's rows (not a block of them).
  bool AllRows() const { return rows_loaded && first_row == 0 && (section.index_length == 0 || section.rows == chunks.size()); }
};

struct ManifestStats {
  uint64_t logical_bytes = 0;     // sum of file sizes
  uint64_t stored_bytes = 0;      // payload bytes this version wrote (origin == 0)
  uint64_t changed_elements = 0;  // elements (bytes for opaque data) that differ from the parent
  uint64_t elements = 0;
  double changed_fraction() const {
    return elements ? static_cast<double>(changed_elements) / static_cast<double>(elements) : 0;
  }
};

struct Manifest {
  int format = kManifestFormat;  // 1: rows inline; 2: a head whose files' rows are in `table`
  Hash128 table;                 // format 2: the table object (packs/<hex>)
  uint64_t table_size = 0;
  std::string model;
  std::string version;
  std::optional<std::string> parent;
  std::string created;     // RFC 3339 UTC with milliseconds
  int64_t created_ms = 0;  // Unix milliseconds, derived from `created` on parse
  uint64_t chunk_bytes = kDefaultChunkBytes;
  std::vector<std::string> versions;  // [0] == version
  std::vector<Hash128> packs;
  // Files outside the bucket that kExternal recipes read ("hf://ORG/REPO@COMMIT/PATH", see
  // hub/engine/external_source.h); for those recipes ref.pack indexes this table. Serialized only
  // when non-empty.
  std::vector<std::string> sources;
  ManifestStats stats;
  std::vector<ManifestFile> files;  // sorted by path
  // Not serialized. Set on manifests a DerivedVersions made (hub/engine/derived_versions.h): chunk
  // hashes are identifiers, not content hashes, and sha256 may be empty (unknown).
  bool derived = false;
  // Not serialized. The table of the parent head this version's inherited rows (origin != 0)
  // were copied from; Bucket::PublishManifest checks the parent's head is still that one and,
  // when gc rewrote it meanwhile (same bytes, new rows), takes them from its new head first
  // (RebindInheritedRows). Hash128{} (no head's table): always. Unset: no check (a manifest
  // built by other means, e.g. a benchmark's).
  std::optional<Hash128> inherited_from;

  const ManifestFile* FindFile(std::string_view path) const;
  // Index of `name` in versions, adding it if absent.
  uint32_t VersionIndex(const std::string& name);
  uint32_t PackIndex(const Hash128& pack);
  uint32_t SourceIndex(const std::string& source);
};

// Replaces every row of `m` inherited from its parent (origin != 0) by the row of the same file
// and bytes (hash and length) in `parent`, a newer head of the parent (gc rewrote it: the same
// files and bytes, other recipes), mapped into m's versions, packs and sources; `rows(path)` is
// the parent's file of that path with its rows loaded (null: none). m's own rows stay (their
// deltas' base is the parent's chunk of the same key, whose bytes a rewrite keeps). Packs no row
// uses any more are dropped. Corruption if an inherited chunk's bytes are not in the parent.
Status RebindInheritedRows(Manifest* m, const Manifest& parent,
                           const std::function<const ManifestFile*(const std::string&)>& rows);

// Serialized manifest bytes (compressed with zstd when the JSON exceeds 64 KiB).
std::vector<uint8_t> SerializeManifest(const Manifest& manifest);
// Format 2: the head (small JSON: everything but the rows, which it locates) and the table (each
// file's rows, a section per file: core/chunk_table.h), named by its hash. REQUIRES: every
// file's rows loaded.
struct SerializedVersion {
  std::vector<uint8_t> head;
  std::vector<uint8_t> table;
  Hash128 table_hash;  // HashChunk(table): its key in the bucket
};
// `block_rows`: a file of more rows has its section in blocks of that many (core/chunk_table.h;
// tests and the scale bench set others).
SerializedVersion SerializeVersion(const Manifest& manifest, uint64_t block_rows = kTableBlockRows);

// The most JSON ParseManifest reads unless its caller says otherwise (inflated, for a manifest
// stored compressed). A real 500k-chunk manifest is ~74 MB of JSON.
inline constexpr uint64_t kDefaultMaxManifestJsonBytes = 1ull << 30;

// Parses and validates. `expected_model`/`expected_version` (when non-empty) must match what
// the manifest says about itself (a manifest copied under another key is rejected), and name
// it in errors. More than `max_json_bytes` of JSON (plain, or inflated from zstd) is
// ResourceExhausted, found before it is all read. Peak memory is about what the returned
// Manifest holds (at most twice that while a vector grows): ~1.3x its JSON for real manifests,
// up to ~2.2x for rows of the smallest values; plus at most ~9 MiB of zstd decoder for a
// compressed one, whatever its header claims. (One exception, bounded by max_json_bytes: JSON
// that runs on for long stretches with nothing but brackets, commas and true/false/null, which
// nlohmann's lexer keeps in full for its error messages; whitespace is collapsed before it.)
// An allocation failure is ResourceExhausted too.
Expected<Manifest> ParseManifest(std::span<const uint8_t> bytes,
                                 std::string_view expected_model = {},
                                 std::string_view expected_version = {},
                                 uint64_t max_json_bytes = kDefaultMaxManifestJsonBytes);

// Names. A model is '/'-separated components of [A-Za-z0-9._-] (not "." or ".."), at most 256
// bytes; a version is one such component, at most 128 bytes; a file path is like a model name
// plus '@', '=' and '+' allowed, at most 1024 bytes, no component longer than 255 (NAME_MAX). Each returns InvalidArgument naming the rule.
Status ValidateModelName(std::string_view model);
Status ValidateVersionName(std::string_view version);
Status ValidateFilePath(std::string_view path);
// A manifest source string: "hf://" + a repo id (NAME or ORG/NAME, model-name rules) + "@" + a
// 40-hex commit + "/" + a file path. InvalidArgument naming the rule, or OK.
Status ValidateSourceName(std::string_view source);

// "model@version" split at the last '@'; validated.
struct VersionRef {
  std::string model;
  std::string version;  // may be empty when allowed by the caller ("model" alone)
};
Expected<VersionRef> ParseVersionRef(std::string_view text, bool version_required);

// When a chunk must become a keyframe instead of one more delta.
struct KeyframePolicy {
  // A delta chain may hold at most this multiple of its keyframe's bytes. It bounds what a
  // cold read fetches for a chunk: keyframe + chain <= (1 + ratio) x keyframe.
  double max_chain_ratio = 1.0;
  // ... and at most this many deltas (bounds the decode work of a cold read).
  uint32_t max_depth = 64;

  bool NeedsKeyframe(const ManifestChunk& parent, uint64_t delta_bytes) const {
    return parent.depth + 1 > max_depth ||
           static_cast<double>(parent.chain_bytes + delta_bytes) >
               max_chain_ratio * static_cast<double>(parent.keyframe_bytes);
  }
};

// RFC 3339 UTC ("2026-12-02T13:00:00.123Z") of Unix milliseconds, and back (the fraction is
// optional on input). kStrict (manifests) takes only the "Z" form; kAnyOffset (times other
// tools send, such as AWS credential expiries) also takes "+hh:mm" / "-hh:mm" and no zone at
// all (read as UTC).
std::string FormatUtc(int64_t unix_ms);
enum class UtcForm { kStrict, kAnyOffset };
Expected<int64_t> ParseUtc(std::string_view text, UtcForm form = UtcForm::kStrict);

}  // namespace weightfs
