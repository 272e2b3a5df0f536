// Format 2 versions (core/chunk_table.h, SerializeVersion): a head that locates each file's rows
// in a binary table, the rows round-tripping exactly, hostile sections refused, and what a row
// costs in a realistic RL version.
#include "core/chunk_table.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/manifest.h"
#include "core/manifest_checks.h"
#include "tests/testing/bytes.h"
#include <nlohmann/json.hpp>

namespace weightfs {
namespace {

using test::H;

ManifestChunk Row(std::string tensor, uint64_t index, uint64_t offset, uint64_t length, ChunkEncoding enc,
                  uint32_t pack, uint64_t pack_offset, uint64_t pack_length, uint32_t origin = 0,
                  uint32_t base = 0, uint32_t depth = 0, uint64_t chain = 0, uint64_t keyframe = 0) {
  ManifestChunk c;
  c.key = {std::move(tensor), index};
  c.offset = offset;
  c.length = length;
  c.hash = H(offset * 31 + length + index);
  c.encoding = enc;
  c.ref = {pack, pack_offset, pack_length};
  c.origin = origin;
  c.base = base;
  c.depth = depth;
  c.chain_bytes = chain;
  c.keyframe_bytes = keyframe;
  return c;
}

Manifest Small() {
  Manifest m;
  m.model = "acme/qwen";
  m.version = "step-2";
  m.parent = "step-1";
  m.created = "2026-12-02T13:00:00.123Z";
  m.created_ms = ParseUtc(m.created).value();
  m.chunk_bytes = 1000;
  m.versions = {"step-2", "step-1", "base"};
  m.packs = {H(100), H(101), H(102)};
  m.stats = {3105, 1000, 42, 5000};
  ManifestFile config;
  config.path = "config.json";
  config.size = 100;
  config.sha256 = std::string(64, 'a');
  config.chunks = {Row("", 0, 0, 100, ChunkEncoding::kFull, 0, 0, 80, 2, 0, 0, 0, 80)};
  ManifestFile model;
  model.path = "model.safetensors";
  model.size = 3000;
  model.sha256 = std::string(64, 'b');
  model.chunks = {
      Row(kHeaderChunkName, 0, 0, 200, ChunkEncoding::kPatch, 1, 0, 60, 0, 1, 1, 60, 150),
      Row("w", 0, 200, 1000, ChunkEncoding::kSparse, 1, 60, 70, 0, 1, 3, 300, 900),
      Row("w", 1, 1200, 1000, ChunkEncoding::kDense, 0, 80, 500, 1, 2, 1, 500, 900),
      Row("w", 2, 2200, 800, ChunkEncoding::kRaw, 2, 0, 840, 0, 0, 0, 0, 840),
  };
  ManifestFile empty;
  empty.path = "empty.bin";
  empty.size = 0;
  empty.sha256 = std::string(64, 'c');
  m.files = {config, empty, model};
  return m;
}

// `a` decoded from a table of `written`.
void ExpectSameRows(const std::vector<ManifestChunk>& a, const std::vector<ManifestChunk>& written) {
  ASSERT_EQ(a.size(), written.size());
  std::vector<ManifestChunk> b;
  for (const ManifestChunk& c : written) b.push_back(AsStoredInTable(c));
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    EXPECT_EQ(a[i].key, b[i].key);
    EXPECT_EQ(a[i].offset, b[i].offset);
    EXPECT_EQ(a[i].length, b[i].length);
    EXPECT_EQ(a[i].hash, b[i].hash);
    EXPECT_EQ(a[i].encoding, b[i].encoding);
    EXPECT_EQ(a[i].ref.pack, b[i].ref.pack);
    EXPECT_EQ(a[i].ref.offset, b[i].ref.offset);
    EXPECT_EQ(a[i].ref.length, b[i].ref.length);
    EXPECT_EQ(a[i].origin, b[i].origin);
    EXPECT_EQ(a[i].base, b[i].base);
    EXPECT_EQ(a[i].depth, b[i].depth);
    EXPECT_EQ(a[i].chain_bytes, b[i].chain_bytes);
    EXPECT_EQ(a[i].keyframe_bytes, b[i].keyframe_bytes);
  }
}

std::span<const uint8_t> SectionOf(const SerializedVersion& v, const ManifestFile& f) {
  return std::span<const uint8_t>(v.table).subspan(f.section.offset, f.section.length);
}

ChunkTableLimits LimitsOf(const Manifest& m) { return {m.versions.size(), m.packs.size(), m.sources.size()}; }

TEST(ChunkTableTest, AVersionRoundTripsThroughAHeadAndItsTable) {
  const Manifest m = Small();
  const SerializedVersion v = SerializeVersion(m);
  EXPECT_EQ(v.table_hash, HashChunk(v.table));
  Expected<Manifest> head = ParseManifest(v.head, m.model, m.version);
  ASSERT_TRUE(head.ok()) << head.status().ToString();
  EXPECT_EQ(head->format, kManifestFormat2);
  EXPECT_EQ(head->table, v.table_hash);
  EXPECT_EQ(head->table_size, v.table.size());
  EXPECT_EQ(head->versions, m.versions);
  EXPECT_EQ(head->packs, m.packs);
  EXPECT_EQ(head->created_ms, m.created_ms);
  EXPECT_EQ(head->stats.stored_bytes, m.stats.stored_bytes);
  ASSERT_EQ(head->files.size(), m.files.size());
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestFile& f = head->files[i];
    SCOPED_TRACE(f.path);
    EXPECT_EQ(f.path, m.files[i].path);
    EXPECT_EQ(f.size, m.files[i].size);
    EXPECT_EQ(f.sha256, m.files[i].sha256);
    EXPECT_FALSE(f.rows_loaded);
    EXPECT_TRUE(f.chunks.empty());
    EXPECT_EQ(f.section.rows, m.files[i].chunks.size());
    Expected<std::vector<ManifestChunk>> rows = DecodeChunkTable(SectionOf(v, f), f, LimitsOf(*head));
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    ExpectSameRows(*rows, m.files[i].chunks);
  }
}

TEST(ChunkTableTest, HostileSectionsAreCorruptionNeverACrash) {
  const Manifest m = Small();
  const SerializedVersion v = SerializeVersion(m);
  Manifest head = ParseManifest(v.head).value();
  const ManifestFile& f = head.files[2];
  const std::vector<uint8_t> good(SectionOf(v, f).begin(), SectionOf(v, f).end());
  auto decode = [&](const std::vector<uint8_t>& bytes, const ManifestFile& file, ChunkTableLimits limits) {
    return DecodeChunkTable(bytes, file, limits);
  };
  ASSERT_TRUE(decode(good, f, LimitsOf(head)).ok());
  // Truncated, or any byte flipped: never accepted as other rows.
  for (size_t cut = 0; cut < good.size(); ++cut) {
    std::vector<uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_EQ(decode(b, f, LimitsOf(head)).status().kind(), ErrorKind::kCorruption) << cut;
  }
  for (size_t i = 0; i < good.size(); ++i) {
    std::vector<uint8_t> b = good;
    b[i] ^= 0x5a;
    EXPECT_EQ(decode(b, f, LimitsOf(head)).status().kind(), ErrorKind::kCorruption) << "byte " << i;
  }
  // The head and the section must agree on the rows and the file's size.
  ManifestFile other = f;
  other.section.rows = 3;
  EXPECT_NE(decode(good, other, LimitsOf(head)).status().message().find("row count"), std::string::npos);
  other = f;
  other.size = 2999;
  EXPECT_EQ(decode(good, other, LimitsOf(head)).status().kind(), ErrorKind::kCorruption);
  // Rows must index into the head's tables.
  EXPECT_NE(decode(good, f, {head.versions.size(), 2, 0}).status().message().find("pack 2 of 2"), std::string::npos);
  EXPECT_NE(decode(good, f, {2, head.packs.size(), 0}).status().message().find("out of range"), std::string::npos);
  // A decoded size beyond the caller's budget is refused before anything is decoded.
  EXPECT_EQ(decode(good, f, LimitsOf(head)).ok(), true);
  EXPECT_EQ(DecodeChunkTable(good, f, LimitsOf(head), 100).status().kind(), ErrorKind::kResourceExhausted);
}

TEST(ChunkTableTest, AHeadWhoseSectionsLeaveTheTableIsCorruption) {
  const SerializedVersion v = SerializeVersion(Small());
  nlohmann::json j = nlohmann::json::parse(v.head.begin(), v.head.end());
  auto parse = [](const nlohmann::json& h) {
    const std::string t = h.dump();
    return ParseManifest(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.data()), t.size()));
  };
  ASSERT_TRUE(parse(j).ok());
  nlohmann::json bad = j;
  bad["files"][2]["section"][1] = j["table"]["size"].get<uint64_t>();
  EXPECT_NE(parse(bad).status().message().find("ends past the table"), std::string::npos);
  bad = j;
  bad["table"].erase("pack");
  EXPECT_EQ(parse(bad).status().kind(), ErrorKind::kCorruption);
  bad = j;
  bad["files"][0]["chunks"] = nlohmann::json::array();
  EXPECT_EQ(parse(bad).status().kind(), ErrorKind::kCorruption);
  bad = j;
  bad["files"][2]["rows"] = 3001;
  EXPECT_EQ(parse(bad).status().kind(), ErrorKind::kCorruption);
  bad = j;
  bad["format"] = 3;
  EXPECT_EQ(parse(bad).status().kind(), ErrorKind::kUnsupported);
}

// A file of more rows than a block holds: its section is an index and blocks, each decoded on
// its own (a reader of one chunk reads the index and one block); a file of fewer keeps the one
// table older readers read, and its head the two-element section.
TEST(ChunkTableTest, ASectionInBlocksRoundTripsBlockByBlock) {
  const Manifest m = Small();
  const SerializedVersion v = SerializeVersion(m, /*block_rows=*/3);
  const Manifest head = ParseManifest(v.head, m.model, m.version).value();
  const ManifestFile& config = head.files[0];
  EXPECT_EQ(config.section.index_length, 0u);  // one row: one table
  EXPECT_TRUE(DecodeChunkTable(SectionOf(v, config), config, LimitsOf(head)).ok());
  const nlohmann::json j = nlohmann::json::parse(v.head.begin(), v.head.end());
  EXPECT_EQ(j["files"][0]["section"].size(), 2u);
  EXPECT_EQ(j["files"][2]["section"].size(), 3u);

  const ManifestFile& f = head.files[2];  // 4 rows: blocks of 3 and 1
  ASSERT_GT(f.section.index_length, 0u);
  const std::span<const uint8_t> section = SectionOf(v, f);
  Expected<TableBlockIndex> index = DecodeTableIndex(section.first(f.section.index_length), f);
  ASSERT_TRUE(index.ok()) << index.status().ToString();
  ASSERT_EQ(index->blocks(), 2u);
  EXPECT_EQ(index->block_rows, 3u);
  EXPECT_EQ(index->offsets, (std::vector<uint64_t>{0, 2200, 3000}));
  EXPECT_EQ(index->BlockAt(0), 0u);
  EXPECT_EQ(index->BlockAt(2199), 0u);
  EXPECT_EQ(index->BlockAt(2200), 1u);
  EXPECT_EQ(index->BlockAt(2999), 1u);
  std::vector<ManifestChunk> all;
  for (size_t k = 0; k < index->blocks(); ++k) {
    const RowSpan span{k * 3, index->RowsOf(k, f.section.rows), index->offsets[k], index->offsets[k + 1] - index->offsets[k]};
    Expected<std::vector<ManifestChunk>> rows =
        DecodeChunkRows(section.subspan(index->starts[k], index->starts[k + 1] - index->starts[k]), f, span, LimitsOf(head));
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    EXPECT_EQ(rows->front().offset, index->offsets[k]);
    all.insert(all.end(), rows->begin(), rows->end());
  }
  ExpectSameRows(all, m.files[2].chunks);
  // The whole section is not one table: a reader that does not know blocks fails, never
  // misreads it.
  EXPECT_EQ(DecodeChunkTable(section, f, LimitsOf(head)).status().kind(), ErrorKind::kCorruption);
}

TEST(ChunkTableTest, HostileBlockIndexesAreCorruptionNeverACrash) {
  const Manifest m = Small();
  const SerializedVersion v = SerializeVersion(m, /*block_rows=*/2);
  const Manifest head = ParseManifest(v.head, m.model, m.version).value();
  const ManifestFile& f = head.files[2];
  const std::span<const uint8_t> section = SectionOf(v, f);
  const std::vector<uint8_t> good(section.begin(), section.begin() + static_cast<std::ptrdiff_t>(f.section.index_length));
  ASSERT_TRUE(DecodeTableIndex(good, f).ok());
  for (size_t cut = 0; cut < good.size(); ++cut) {
    const std::vector<uint8_t> b(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_EQ(DecodeTableIndex(b, f).status().kind(), ErrorKind::kCorruption) << cut;
  }
  for (size_t i = 0; i < good.size(); ++i) {
    std::vector<uint8_t> b = good;
    b[i] ^= 0x5a;
    EXPECT_EQ(DecodeTableIndex(b, f).status().kind(), ErrorKind::kCorruption) << "byte " << i;
  }
  // The head must agree with the index: rows (hence blocks), the file's size, the section's.
  ManifestFile other = f;
  other.section.rows = 2;
  EXPECT_NE(DecodeTableIndex(good, other).status().message().find("block count"), std::string::npos);
  other = f;
  other.size = 2999;
  EXPECT_EQ(DecodeTableIndex(good, other).status().kind(), ErrorKind::kCorruption);
  other = f;
  other.section.length += 1;
  EXPECT_NE(DecodeTableIndex(good, other).status().message().find("do not fill"), std::string::npos);
  // A block decoded as another block's span: its rows do not tile it.
  Expected<TableBlockIndex> index = DecodeTableIndex(good, f);
  const std::span<const uint8_t> block0 = section.subspan(index->starts[0], index->starts[1] - index->starts[0]);
  EXPECT_EQ(DecodeChunkRows(block0, f, RowSpan{2, 2, 1200, 1800}, LimitsOf(head)).status().kind(), ErrorKind::kCorruption);
  // The head's third element must leave room for blocks.
  nlohmann::json j = nlohmann::json::parse(v.head.begin(), v.head.end());
  auto parse = [](const nlohmann::json& h) {
    const std::string t = h.dump();
    return ParseManifest(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(t.data()), t.size()));
  };
  j["files"][2]["section"][2] = j["files"][2]["section"][1];
  EXPECT_NE(parse(j).status().message().find("block index"), std::string::npos);
  j["files"][2]["section"][2] = 0;
  EXPECT_EQ(parse(j).status().kind(), ErrorKind::kCorruption);
  j["files"][2]["section"] = nlohmann::json::array({0, 10, 5, 1});
  EXPECT_EQ(parse(j).status().kind(), ErrorKind::kCorruption);
}

// What a row costs in the table of an RL step: every chunk of every tensor a SPARSE delta
// against the parent's, payloads of a few tens of KB packed 32 MiB at a time, chains of
// different depths (keyframes were chosen per chunk), uniformly random lengths: about the
// entropy of its columns (~23 bytes, the hash alone 16). docs/format2.md has what real
// versions cost.
TEST(ChunkTableTest, ARowOfAnRlStepCostsAboutItsEntropy) {
  std::mt19937_64 rng(11);
  ManifestFile f;
  f.path = "model-00001-of-00064.safetensors";
  const size_t rows = 20000;
  uint64_t offset = 0, pack = 0, pack_offset = 0;
  for (size_t k = 0; k < rows; ++k) {
    const std::string tensor = "model.layers." + std::to_string(k / 300) + ".mlp.experts." +
                               std::to_string((k / 12) % 25) + ".down_proj.weight";
    const uint64_t length = kDefaultChunkBytes;
    const uint64_t payload = 20000 + rng() % 30000;
    if (pack_offset + payload > (32u << 20)) {
      ++pack;
      pack_offset = 0;
    }
    const uint32_t depth = 1 + static_cast<uint32_t>((k * 7 + rng() % 3) % 40);
    const uint64_t keyframe = 2'600'000 + rng() % 300'000;
    ManifestChunk c = Row(tensor, k % 12, offset, length, ChunkEncoding::kSparse, static_cast<uint32_t>(pack),
                          pack_offset, payload, 0, 1, depth, depth * 35000 + rng() % 20000, keyframe);
    c.hash = Hash128{rng(), rng()};
    f.chunks.push_back(c);
    offset += length;
    pack_offset += payload;
  }
  f.size = offset;
  const std::vector<uint8_t> section = EncodeChunkTable(f.chunks);
  const double per_row = static_cast<double>(section.size()) / rows;
  std::printf("[          ] %zu rows: %zu bytes, %.1f bytes a row (format 1 JSON + zstd: ~43)\n", rows,
              section.size(), per_row);
  EXPECT_LE(per_row, 21.0);
  f.section.rows = rows;
  Expected<std::vector<ManifestChunk>> back = DecodeChunkTable(section, f, {2, pack + 1, 0});
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameRows(*back, f.chunks);
  // The hints are within 1/64 of what was written.
  for (size_t i = 0; i < rows; ++i) {
    EXPECT_NEAR(static_cast<double>((*back)[i].keyframe_bytes), static_cast<double>(f.chunks[i].keyframe_bytes),
                f.chunks[i].keyframe_bytes / 64.0);
    EXPECT_NEAR(static_cast<double>((*back)[i].chain_bytes), static_cast<double>(f.chunks[i].chain_bytes),
                f.chunks[i].chain_bytes / 64.0);
  }
}

TEST(ChunkTableTest, RoundedHintsAreStableAcrossRewrites) {
  // A row inherited unchanged by the next version, or rewritten by upgrade, keeps its values.
  for (uint64_t v : {0ull, 1ull, 63ull, 64ull, 65ull, 1000ull, 123457ull, 2'718'281ull, 99'999'999'999ull}) {
    ManifestChunk c = Row("w", 0, 0, 4096, ChunkEncoding::kSparse, 0, 0, 700, 0, 1, 3, v + 700, v);
    const ManifestChunk once = AsStoredInTable(c), twice = AsStoredInTable(once);
    EXPECT_EQ(once.chain_bytes, twice.chain_bytes) << v;
    EXPECT_EQ(once.keyframe_bytes, twice.keyframe_bytes) << v;
    EXPECT_LE(once.keyframe_bytes, manifest_checks::kMaxPayloadBytes) << v;
  }
}

}  // namespace
}  // namespace weightfs
