// libFuzzer target for core/chunk_table: a file's section in blocks (an index frame, then a
// table frame per block), built from rows the input describes and then damaged where the input
// says (a byte flipped, the section cut short, the head's counts changed). Decoding must never
// crash or throw; the index and every block either decode to exactly what was written or fail
// with Corruption; whatever decodes keeps the promises a reader relies on (blocks that fill the
// section, spans that tile the file, rows that tile their span).
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   ./chunk_table_fuzz -max_total_time=60
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/chunk_table.h"
#include "core/manifest.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

using weightfs::ChunkEncoding;
using weightfs::ErrorKind;
using weightfs::fuzz::Check;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  weightfs::fuzz::Reader in(data, size);
  // Rows: a few tensors of a few chunks, lengths and payload references from the input.
  const size_t rows = 2 + in.U8() % 40;
  const uint64_t block_rows = 1 + in.U8() % std::min<size_t>(8, rows - 1);  // (fewer than the rows: blocks)
  std::vector<weightfs::ManifestChunk> chunks(rows);
  uint64_t offset = 0;
  for (size_t i = 0; i < rows; ++i) {
    weightfs::ManifestChunk& c = chunks[i];
    c.key = {"t" + std::to_string(i / 3), i % 3};
    c.offset = offset;
    c.length = 1 + in.U16() % 5000;
    offset += c.length;
    c.hash = weightfs::Hash128{in.U16() * 0x9e3779b97f4a7c15ull, i};
    c.encoding = (in.U8() & 1) ? ChunkEncoding::kSparse : ChunkEncoding::kFull;
    c.depth = c.encoding == ChunkEncoding::kSparse ? 1 + in.U8() % 4 : 0;
    c.base = c.depth ? 1 : 0;
    c.ref = {in.U8() % 2u, in.U16(), 40 + in.U16() % 4000u};  // (at least a payload header)
    c.chain_bytes = c.ref.length * (c.depth + 1);
    c.keyframe_bytes = c.depth ? 3000 : c.ref.length;
  }
  weightfs::EncodedSection enc = weightfs::EncodeChunkSection(chunks, block_rows);
  weightfs::ManifestFile file;
  file.path = "f";
  file.size = offset;
  file.section = {0, enc.bytes.size(), rows, enc.index_length};
  Check(enc.index_length > 0);
  // The damage.
  bool damaged = false;
  switch (in.U8() % 5) {
    case 0:
      break;
    case 1: {  // a byte flipped
      const size_t at = in.U16() % enc.bytes.size();
      const uint8_t mask = static_cast<uint8_t>(in.U8() | 1);
      enc.bytes[at] ^= mask;
      damaged = true;
      break;
    }
    case 2: {  // cut short (the head still says the old length)
      enc.bytes.resize(in.U16() % enc.bytes.size());
      damaged = true;
      break;
    }
    case 3:  // the head's row count or file size changed
      if (in.U8() & 1) {
        file.section.rows = in.U8();
      } else {
        file.size = in.U16();
      }
      damaged = file.section.rows != rows || file.size != offset;
      break;
    default:  // the head's index length changed
      file.section.index_length = in.U8();
      damaged = file.section.index_length != enc.index_length;
      break;
  }
  const std::span<const uint8_t> section(enc.bytes);
  const weightfs::ChunkTableLimits limits{2, 2, 0};
  if (file.section.index_length == 0 || file.section.index_length > section.size()) return 0;  // (the head's parser refuses these)
  weightfs::Expected<weightfs::TableBlockIndex> index =
      weightfs::DecodeTableIndex(section.first(file.section.index_length), file);
  if (!index.ok()) {
    Check(index.status().kind() == ErrorKind::kCorruption);
    Check(damaged);
    return 0;
  }
  // What a decoded index promises.
  Check(index->block_rows >= 1);
  Check(index->blocks() == (file.section.rows + index->block_rows - 1) / index->block_rows);
  Check(index->starts.front() == file.section.index_length && index->starts.back() == file.section.length);
  Check(index->offsets.front() == 0 && index->offsets.back() == file.size);
  for (size_t k = 0; k < index->blocks(); ++k) {
    Check(index->starts[k] < index->starts[k + 1] && index->offsets[k] < index->offsets[k + 1]);
  }
  size_t next_row = 0;
  bool all_ok = true;
  for (size_t k = 0; k < index->blocks(); ++k) {
    if (index->starts[k + 1] > section.size()) {  // (a cut section: the store says Corruption)
      all_ok = false;
      continue;
    }
    const weightfs::RowSpan span{k * index->block_rows, index->RowsOf(k, file.section.rows), index->offsets[k],
                                 index->offsets[k + 1] - index->offsets[k]};
    weightfs::Expected<std::vector<weightfs::ManifestChunk>> got = weightfs::DecodeChunkRows(
        section.subspan(index->starts[k], index->starts[k + 1] - index->starts[k]), file, span, limits);
    if (!got.ok()) {
      if (!damaged) std::fprintf(stderr, "an undamaged block was refused: %s\n", got.status().ToString().c_str());
      Check(got.status().kind() == ErrorKind::kCorruption || got.status().kind() == ErrorKind::kResourceExhausted);
      all_ok = false;
      continue;
    }
    Check(got->size() == span.rows);
    uint64_t pos = span.offset;
    for (const weightfs::ManifestChunk& c : *got) {
      Check(c.offset == pos && c.length > 0);
      pos += c.length;
    }
    Check(pos == span.offset + span.bytes);
    if (!damaged) {
      for (const weightfs::ManifestChunk& c : *got) {
        const weightfs::ManifestChunk want = weightfs::AsStoredInTable(chunks[next_row++]);
        Check(c.key == want.key && c.offset == want.offset && c.length == want.length && c.hash == want.hash &&
              c.encoding == want.encoding && c.ref.pack == want.ref.pack && c.ref.offset == want.ref.offset &&
              c.ref.length == want.ref.length && c.depth == want.depth && c.base == want.base);
      }
    }
  }
  if (!damaged) Check(all_ok && next_row == rows);
  return 0;
}
