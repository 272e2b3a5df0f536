#include "hub/engine/reference_index.h"

#include <cstring>
#include <string_view>

#include "core/chunk_plan.h"

namespace weightfs {
namespace {

constexpr std::string_view kRefsMagic = "weightfs-chunk-refs 1\n";
static_assert(kRefsMagic.size() == 22);

void Put64(std::vector<uint8_t>* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<uint8_t>(v >> (8 * i)));
}

uint64_t Get64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

std::vector<uint8_t> SerializeReferenceIndex(const ReferenceIndex& index) {
  std::vector<uint8_t> out;
  out.reserve(kReferenceIndexOverhead + index.path.size() + index.rows.size() * kReferenceRowBytes);
  out.insert(out.end(), kRefsMagic.begin(), kRefsMagic.end());
  Put64(&out, index.file_size);
  Put64(&out, static_cast<uint64_t>(index.mtime_ns));
  Put64(&out, index.rows.size());
  const uint32_t path_length = static_cast<uint32_t>(index.path.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(path_length >> (8 * i)));
  out.insert(out.end(), index.path.begin(), index.path.end());
  for (const ChunkRef& r : index.rows) {
    Put64(&out, r.hash.hi);
    Put64(&out, r.hash.lo);
    Put64(&out, r.offset);
    Put64(&out, r.length);
  }
  Put64(&out, Hash64(out));
  return out;
}

Expected<ReferenceIndex> ParseReferenceIndex(std::span<const uint8_t> bytes) {
  if (bytes.size() < kReferenceIndexOverhead ||
      std::memcmp(bytes.data(), kRefsMagic.data(), kRefsMagic.size()) != 0) {
    return Status::Corruption("not a reference index (no \"weightfs-chunk-refs 1\" magic line)");
  }
  const uint8_t* p = bytes.data() + kRefsMagic.size();
  ReferenceIndex index;
  index.file_size = Get64(p);
  index.mtime_ns = static_cast<int64_t>(Get64(p + 8));
  const uint64_t rows = Get64(p + 16);
  const uint32_t path_length = static_cast<uint32_t>(p[24] | (p[25] << 8) | (p[26] << 16)) |
                               (static_cast<uint32_t>(p[27]) << 24);
  if (path_length == 0 || path_length > kMaxReferencePath) {
    return Status::Corruption("reference index: path length " + std::to_string(path_length) +
                              " outside 1.." + std::to_string(kMaxReferencePath));
  }
  // Overflow-safe: compare the row count with what the bytes can hold, never multiply it first.
  const uint64_t room = bytes.size() - kReferenceIndexOverhead;
  if (path_length > room || (room - path_length) % kReferenceRowBytes != 0 ||
      rows != (room - path_length) / kReferenceRowBytes) {
    return Status::Corruption("reference index: " + std::to_string(bytes.size()) +
                              " bytes do not hold a path of " + std::to_string(path_length) +
                              " bytes and " + std::to_string(rows) + " rows");
  }
  const size_t body = bytes.size() - 8;
  if (Hash64(bytes.first(body)) != Get64(bytes.data() + body)) {
    return Status::Corruption("reference index: checksum mismatch (torn or altered)");
  }
  const char* path = reinterpret_cast<const char*>(p + 28);
  index.path.assign(path, path_length);
  if (index.path[0] != '/' || index.path.find('\0') != std::string::npos) {
    return Status::Corruption("reference index: path is not absolute or holds a NUL");
  }
  index.rows.resize(rows);
  const uint8_t* r = p + 28 + path_length;
  for (uint64_t i = 0; i < rows; ++i, r += kReferenceRowBytes) {
    ChunkRef& row = index.rows[i];
    row.hash.hi = Get64(r);
    row.hash.lo = Get64(r + 8);
    row.offset = Get64(r + 16);
    row.length = Get64(r + 24);
    if (row.length == 0 || row.length > kMaxChunkBytes || row.offset > index.file_size ||
        row.length > index.file_size - row.offset) {
      return Status::Corruption("reference index of " + index.path + ": row " + std::to_string(i) +
                                " [" + std::to_string(row.offset) + ", +" + std::to_string(row.length) +
                                ") is not a chunk inside the file's " +
                                std::to_string(index.file_size) + " bytes");
    }
  }
  return index;
}

}  // namespace weightfs
