#include "core/chunk_table.h"

#include <zstd.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>

#include "core/manifest_checks.h"

namespace weightfs {
namespace {

using namespace manifest_checks;

constexpr char kTableMagic[4] = {'W', 'C', 'T', '1'};
constexpr char kIndexMagic[4] = {'W', 'C', 'B', '1'};
// zstd level of a section: tables are written once per version and read by every reader. 15
// (measured on generated RL steps with 16 KiB chunks: 20.2 bytes a row, as 19; 12: 20.8).
constexpr int kLevel = 15;
// The most bytes a row can take in a section (14 varints of at most 10 bytes and a hash),
// without its tensor name: bounds what a frame may inflate to.
constexpr uint64_t kMaxRowBytes = 13 * 10 + 16 + 1;

void PutVarint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v) | 0x80);
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

uint64_t Zigzag(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
int64_t Unzigzag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }
// The difference a - b as a zigzag varint (wrapping: any two u64 round-trip).
uint64_t Diff(uint64_t a, uint64_t b) { return Zigzag(static_cast<int64_t>(a - b)); }
uint64_t Undiff(uint64_t d, uint64_t b) { return b + static_cast<uint64_t>(Unzigzag(d)); }

class Reader {
 public:
  explicit Reader(std::span<const uint8_t> in) : in_(in) {}
  bool Varint(uint64_t* v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= in_.size()) return false;
      const uint8_t b = in_[pos_++];
      x |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *v = x;
        return true;
      }
    }
    return false;
  }
  bool Bytes(size_t n, const uint8_t** p) {
    if (in_.size() - pos_ < n) return false;
    *p = in_.data() + pos_;
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  std::span<const uint8_t> in_;
  size_t pos_ = 0;
};

Status Bad(const ManifestFile& file, const std::string& what) {
  return Status::Corruption("chunk table of " + file.path + ": " + what);
}

}  // namespace

uint64_t RoundHint(uint64_t v, uint64_t max) {
  constexpr int kBits = 6;
  if (v < (1u << kBits)) return v;
  const int shift = std::bit_width(v) - kBits;
  const uint64_t rounded = ((v + (1ull << (shift - 1))) >> shift) << shift;
  // Above the limit: the largest value on the grid under it (so that rounding again keeps it).
  return rounded <= max ? rounded : RoundHint(max >> shift << shift, max);
}

// A row's chain and keyframe bytes as the table stores them (see AsStoredInTable).
uint64_t StoredChainBytes(const ManifestChunk& c) {
  if (c.depth == 0) return c.chain_bytes;
  const uint64_t own = std::min(c.chain_bytes, c.ref.length);
  return RoundHint(c.chain_bytes - own, kMaxDepth * kMaxPayloadBytes - own) + own;
}
uint64_t StoredKeyframeBytes(const ManifestChunk& c) {
  return c.depth == 0 ? c.keyframe_bytes : RoundHint(c.keyframe_bytes, kMaxPayloadBytes);
}

ManifestChunk AsStoredInTable(const ManifestChunk& c) {
  ManifestChunk out = c;
  out.chain_bytes = StoredChainBytes(c);
  out.keyframe_bytes = StoredKeyframeBytes(c);
  return out;
}

namespace {
std::vector<uint8_t> Compress(const std::vector<uint8_t>& raw);
}  // namespace

std::vector<uint8_t> EncodeChunkTable(std::span<const ManifestChunk> chunks) {
  // Chain and keyframe bytes are hints (the keyframe policy, cost estimates): stored to 6
  // significant bits, they cost ~1 byte a row instead of ~5 (docs/format2.md).
  std::vector<uint8_t> raw(kTableMagic, kTableMagic + 4);
  PutVarint(raw, chunks.size());
  std::unordered_map<std::string_view, uint64_t> name_index;
  std::vector<std::string_view> names;
  for (const ManifestChunk& c : chunks) {
    if (name_index.emplace(c.key.tensor, names.size()).second) names.push_back(c.key.tensor);
  }
  PutVarint(raw, names.size());
  for (std::string_view n : names) {
    PutVarint(raw, n.size());
    raw.insert(raw.end(), n.begin(), n.end());
  }
  // Column by column.
  for (const ManifestChunk& c : chunks) PutVarint(raw, name_index[c.key.tensor]);
  {
    std::unordered_map<uint64_t, uint64_t> next_index;  // by name index
    for (const ManifestChunk& c : chunks) {
      uint64_t& next = next_index[name_index[c.key.tensor]];
      PutVarint(raw, Diff(c.key.index, next));
      next = c.key.index + 1;
    }
  }
  for (const ManifestChunk& c : chunks) PutVarint(raw, c.length);
  for (const ManifestChunk& c : chunks) raw.push_back(static_cast<uint8_t>(c.encoding));
  {
    uint64_t prev = 0;
    for (const ManifestChunk& c : chunks) {
      PutVarint(raw, Diff(c.ref.pack, prev));
      prev = c.ref.pack;
    }
  }
  {
    uint64_t pack = ~0ull, expect = 0;
    for (const ManifestChunk& c : chunks) {
      PutVarint(raw, Diff(c.ref.offset, c.ref.pack == pack ? expect : 0));
      pack = c.ref.pack;
      expect = c.ref.offset + c.ref.length;
    }
  }
  for (const ManifestChunk& c : chunks) PutVarint(raw, c.ref.length);
  auto column = [&](auto get) {
    uint64_t prev = 0;
    for (const ManifestChunk& c : chunks) {
      const uint64_t v = get(c);
      PutVarint(raw, Diff(v, prev));
      prev = v;
    }
  };
  column([](const ManifestChunk& c) -> uint64_t { return c.origin; });
  column([](const ManifestChunk& c) -> uint64_t { return c.base; });
  column([](const ManifestChunk& c) -> uint64_t { return c.depth; });
  // The chain's bytes less this payload's are the base's chain (0 for a first delta); a
  // keyframe's own bytes are its keyframe bytes: both usually small or zero after the
  // transform (Predicted in the decoder restores them).
  column([](const ManifestChunk& c) -> uint64_t { return StoredChainBytes(c) - (c.depth ? c.ref.length : 0); });
  {
    uint64_t prev = 0;
    for (const ManifestChunk& c : chunks) {
      const uint64_t keyframe = StoredKeyframeBytes(c);
      PutVarint(raw, Diff(keyframe, c.depth == 0 ? c.ref.length : prev));
      if (c.depth != 0) prev = keyframe;
    }
  }
  for (const ManifestChunk& c : chunks) {
    for (int i = 0; i < 8; ++i) raw.push_back(static_cast<uint8_t>(c.hash.hi >> (8 * i)));
    for (int i = 0; i < 8; ++i) raw.push_back(static_cast<uint8_t>(c.hash.lo >> (8 * i)));
  }
  return Compress(raw);
}

namespace {

// A frame of a section: with zstd's checksum of the content, since a section is read by range
// and the table's own hash (in the head) cannot vouch for it: a damaged section is Corruption,
// not other rows.
std::vector<uint8_t> Compress(const std::vector<uint8_t>& raw) {
  std::vector<uint8_t> out(ZSTD_compressBound(raw.size()));
  std::unique_ptr<ZSTD_CCtx, size_t (*)(ZSTD_CCtx*)> cctx(ZSTD_createCCtx(), ZSTD_freeCCtx);
  if (!cctx) throw std::bad_alloc();
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_compressionLevel, kLevel);
  ZSTD_CCtx_setParameter(cctx.get(), ZSTD_c_checksumFlag, 1);
  const size_t n = ZSTD_compress2(cctx.get(), out.data(), out.size(), raw.data(), raw.size());
  if (ZSTD_isError(n)) throw std::bad_alloc();  // (only an allocation can fail here)
  out.resize(n);
  return out;
}

// The frame's content, at most `bound` bytes.
Expected<std::vector<uint8_t>> Inflate(std::span<const uint8_t> frame, uint64_t bound, const ManifestFile& file,
                                       const std::string& what) {
  const unsigned long long claimed = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (claimed == ZSTD_CONTENTSIZE_ERROR || claimed == ZSTD_CONTENTSIZE_UNKNOWN) {
    return Bad(file, what + " is not a zstd frame with its size");
  }
  if (claimed > bound) return Bad(file, what + " claims " + std::to_string(claimed) + " bytes");
  std::vector<uint8_t> raw(claimed);
  const size_t n = ZSTD_decompress(raw.data(), raw.size(), frame.data(), frame.size());
  if (ZSTD_isError(n) || n != claimed) return Bad(file, what + ": the zstd frame does not decode");
  return raw;
}

}  // namespace

EncodedSection EncodeChunkSection(std::span<const ManifestChunk> chunks, uint64_t block_rows) {
  EncodedSection out;
  if (chunks.size() <= block_rows) {
    out.bytes = EncodeChunkTable(chunks);
    return out;
  }
  std::vector<uint8_t> frames;
  std::vector<uint8_t> index(kIndexMagic, kIndexMagic + 4);
  PutVarint(index, block_rows);
  const size_t blocks = (chunks.size() + block_rows - 1) / block_rows;
  PutVarint(index, blocks);
  std::vector<uint64_t> spans;
  for (size_t k = 0; k < blocks; ++k) {
    const std::span<const ManifestChunk> rows = chunks.subspan(k * block_rows, std::min<size_t>(block_rows, chunks.size() - k * block_rows));
    const std::vector<uint8_t> frame = EncodeChunkTable(rows);
    PutVarint(index, frame.size());
    frames.insert(frames.end(), frame.begin(), frame.end());
    spans.push_back(rows.back().offset + rows.back().length - rows.front().offset);
  }
  for (uint64_t span : spans) PutVarint(index, span);
  out.bytes = Compress(index);
  out.index_length = out.bytes.size();
  out.bytes.insert(out.bytes.end(), frames.begin(), frames.end());
  return out;
}

size_t TableBlockIndex::BlockAt(uint64_t offset) const {
  auto it = std::upper_bound(offsets.begin(), offsets.end(), offset);
  return static_cast<size_t>(it - offsets.begin()) - 1;
}

Expected<TableBlockIndex> DecodeTableIndex(std::span<const uint8_t> frame, const ManifestFile& file) {
  const uint64_t rows = file.section.rows;
  if (rows == 0 || rows > file.size) {
    return Bad(file, std::to_string(rows) + " rows for " + std::to_string(file.size) + " bytes");
  }
  WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, Inflate(frame, 64 + 2 * 10 * rows, file, "the block index"));
  Reader r(raw);
  const uint8_t* magic;
  if (!r.Bytes(4, &magic) || std::memcmp(magic, kIndexMagic, 4) != 0) return Bad(file, "no WCB1 magic");
  TableBlockIndex index;
  uint64_t blocks = 0;
  if (!r.Varint(&index.block_rows) || index.block_rows == 0 || index.block_rows > rows) {
    return Bad(file, "bad rows per block");
  }
  if (!r.Varint(&blocks) || blocks != (rows + index.block_rows - 1) / index.block_rows) {
    return Bad(file, "the block count does not fit the row count");
  }
  index.starts.assign(1, file.section.index_length);
  index.offsets.assign(1, 0);
  for (uint64_t k = 0; k < blocks; ++k) {
    uint64_t length;
    if (!r.Varint(&length) || length == 0 || length > file.section.length - index.starts.back()) {
      return Bad(file, "block " + std::to_string(k) + "'s frame ends past the section");
    }
    index.starts.push_back(index.starts.back() + length);
  }
  if (index.starts.back() != file.section.length) return Bad(file, "the blocks do not fill the section");
  for (uint64_t k = 0; k < blocks; ++k) {
    uint64_t bytes;
    if (!r.Varint(&bytes) || bytes == 0 || bytes > file.size - index.offsets.back()) {
      return Bad(file, "block " + std::to_string(k) + "'s rows end past the file's end");
    }
    index.offsets.push_back(index.offsets.back() + bytes);
  }
  if (index.offsets.back() != file.size) return Bad(file, "the blocks' rows do not cover the file");
  if (!r.done()) return Bad(file, "bytes after the block index");
  return index;
}

Expected<std::vector<ManifestChunk>> DecodeChunkTable(std::span<const uint8_t> section, const ManifestFile& file,
                                                      const ChunkTableLimits& limits, uint64_t max_bytes) {
  return DecodeChunkRows(section, file, RowSpan{0, file.section.rows, 0, file.size}, limits, max_bytes);
}

Expected<std::vector<ManifestChunk>> DecodeChunkRows(std::span<const uint8_t> section, const ManifestFile& file,
                                                     const RowSpan& span, const ChunkTableLimits& limits,
                                                     uint64_t max_bytes) {
  const uint64_t rows = span.rows;
  if ((span.bytes > 0) != (rows > 0) || rows > span.bytes) {
    return Bad(file, std::to_string(rows) + " rows for " + std::to_string(span.bytes) + " bytes");
  }
  // What a frame may inflate to: the columns' worst case plus tensor names of up to 512 bytes
  // per row on average (real names are tens of bytes, and a row per tensor at least).
  const uint64_t bound = std::min<uint64_t>(max_bytes, 64 + rows * (kMaxRowBytes + 10 + 512));
  const uint64_t decoded_memory = rows * (sizeof(ManifestChunk) + 64);
  if (decoded_memory > max_bytes) {
    return Status::ResourceExhausted("chunk table of " + file.path + ": " + std::to_string(rows) +
                                     " rows would take more than the " + std::to_string(max_bytes) +
                                     " bytes allowed for it");
  }
  WFS_ASSIGN_OR_RETURN(std::vector<uint8_t> raw,
                       Inflate(section, bound, file, "the section of " + std::to_string(rows) + " rows"));

  Reader r(raw);
  const uint8_t* magic;
  if (!r.Bytes(4, &magic) || std::memcmp(magic, kTableMagic, 4) != 0) return Bad(file, "no WCT1 magic");
  uint64_t count = 0, name_count = 0;
  if (!r.Varint(&count) || count != rows) return Bad(file, "row count differs from the head's");
  if (!r.Varint(&name_count) || name_count > rows) return Bad(file, "bad tensor name count");
  std::vector<std::string> names(name_count);
  for (std::string& name : names) {
    uint64_t len;
    const uint8_t* p;
    if (!r.Varint(&len) || len > kMaxTensorName || !r.Bytes(len, &p)) return Bad(file, "bad tensor name");
    name.assign(reinterpret_cast<const char*>(p), len);
  }
  std::vector<RawRow> raws(rows);
  auto read_column = [&](Column col, auto&& decode) -> Status {
    for (uint64_t i = 0; i < rows; ++i) {
      uint64_t v;
      if (!r.Varint(&v)) return Bad(file, std::string("truncated ") + kColumnNames[col] + " column");
      raws[i].v[col] = decode(i, v);
    }
    return Status::Ok();
  };
  {
    for (uint64_t i = 0; i < rows; ++i) {
      uint64_t v;
      if (!r.Varint(&v) || v >= name_count) return Bad(file, "bad tensor index");
      raws[i].v[kTensor] = v;
    }
    std::vector<uint64_t> next(name_count, 0);
    WFS_TRY(read_column(kIndex, [&](uint64_t i, uint64_t v) {
      uint64_t& nx = next[raws[i].v[kTensor]];
      const uint64_t index = Undiff(v, nx);
      nx = index + 1;
      return index;
    }));
  }
  WFS_TRY(read_column(kLength, [](uint64_t, uint64_t v) { return v; }));
  for (uint64_t i = 0; i < rows; ++i) {
    const uint8_t* p;
    if (!r.Bytes(1, &p)) return Bad(file, "truncated chunk encoding column");
    raws[i].v[kEncoding] = *p;
  }
  {
    uint64_t prev = 0;
    WFS_TRY(read_column(kPack, [&](uint64_t, uint64_t v) { return prev = Undiff(v, prev); }));
  }
  {
    WFS_TRY(read_column(kPackOffset, [](uint64_t, uint64_t v) { return v; }));  // resolved below
  }
  WFS_TRY(read_column(kPackLength, [](uint64_t, uint64_t v) { return v; }));
  {
    uint64_t pack = ~0ull, expect = 0;
    for (uint64_t i = 0; i < rows; ++i) {
      RawRow& row = raws[i];
      row.v[kPackOffset] = Undiff(row.v[kPackOffset], row.v[kPack] == pack ? expect : 0);
      pack = row.v[kPack];
      expect = row.v[kPackOffset] + row.v[kPackLength];
    }
  }
  for (Column col : {kOrigin, kBase, kDepth, kChainBytes}) {
    uint64_t prev = 0;
    WFS_TRY(read_column(col, [&](uint64_t, uint64_t v) { return prev = Undiff(v, prev); }));
  }
  {
    uint64_t prev = 0;
    WFS_TRY(read_column(kKeyframeBytes, [&](uint64_t i, uint64_t v) {
      RawRow& row = raws[i];
      row.v[kChainBytes] += row.v[kDepth] ? row.v[kPackLength] : 0;  // (see the encoder)
      const uint64_t keyframe = Undiff(v, row.v[kDepth] == 0 ? row.v[kPackLength] : prev);
      if (row.v[kDepth] != 0) prev = keyframe;
      return keyframe;
    }));
  }
  for (uint64_t i = 0; i < rows; ++i) {
    const uint8_t* p;
    if (!r.Bytes(16, &p)) return Bad(file, "truncated chunk hash column");
    uint64_t hi = 0, lo = 0;
    for (int k = 0; k < 8; ++k) hi |= static_cast<uint64_t>(p[k]) << (8 * k);
    for (int k = 0; k < 8; ++k) lo |= static_cast<uint64_t>(p[8 + k]) << (8 * k);
    raws[i].hash = Hash128{hi, lo};
  }
  if (!r.done()) return Bad(file, "bytes after the last column");

  const Tables tables{limits.versions, limits.packs, limits.sources};
  std::vector<ManifestChunk> chunks(rows);
  const uint64_t end = span.offset + span.bytes;
  uint64_t pos = span.offset;
  for (uint64_t i = 0; i < rows; ++i) {
    RawRow& row = raws[i];
    row.v[kOffset] = pos;
    row.columns = kRowColumns;
    if (Status s = CheckRow(row, tables, &chunks[i]); !s.ok()) {
      return Bad(file, "row " + std::to_string(span.first_row + i) + ": " + s.message());
    }
    chunks[i].key.tensor = names[row.v[kTensor]];
    pos += chunks[i].length;
    if (pos > end) return Bad(file, "row " + std::to_string(span.first_row + i) + " ends past its block's end");
  }
  if (pos != end) {
    return Bad(file, "rows cover " + std::to_string(pos - span.offset) + " of " + std::to_string(span.bytes) + " bytes");
  }
  if (std::optional<size_t> dup = FirstRepeatedKey(chunks)) {
    return Bad(file, "row " + std::to_string(span.first_row + *dup) + " repeats the key of an earlier row");
  }
  return chunks;
}

size_t ChunkRowsMemory(std::span<const ManifestChunk> chunks) {
  size_t n = chunks.size() * sizeof(ManifestChunk);
  for (const ManifestChunk& c : chunks) {
    if (c.key.tensor.size() > 15) n += c.key.tensor.size() + 1;
  }
  return n;
}

}  // namespace weightfs
