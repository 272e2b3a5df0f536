#include "core/manifest.h"
#include "tests/testing/bytes.h"

#include <gtest/gtest.h>
#include <zstd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace weightfs {
namespace {

using test::AsBytes;
using test::H;
using test::RleFrame;
using test::kSanitized;

using json = nlohmann::json;

// Columns of a chunk row (see the format in core/manifest.h).
enum Col : size_t {
  kTensor = 0,
  kIndex,
  kOffset,
  kLength,
  kHash,
  kEncoding,
  kPack,
  kPackOffset,
  kPackLength,
  kOrigin,
  kBase,
  kDepth,
  kChainBytes,
  kKeyframeBytes,
};

// The reader's caps, restated here so a test fails if they move silently.
constexpr uint64_t kMaxPayload = 2 * kMaxChunkBytes + 4096;
constexpr uint32_t kMaxDepth = 100000;

ManifestChunk Chunk(std::string tensor, uint64_t index, uint64_t offset, uint64_t length,
                    ChunkEncoding enc, uint32_t pack, uint64_t pack_offset, uint64_t pack_length,
                    uint32_t origin = 0, uint32_t base = 0, uint32_t depth = 0,
                    uint64_t chain_bytes = 0, uint64_t keyframe_bytes = 0) {
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
  c.chain_bytes = chain_bytes;
  c.keyframe_bytes = keyframe_bytes;
  return c;
}

// A manifest that uses every encoding, inherited recipes (origin != 0), deltas against two
// different ancestors, and a path with every extra character a file path may hold.
// files[1] ("model.safetensors") is the one the rejection tests below poke at: header chunk
// (PATCH), tensor "w" chunks 0 (SPARSE), 1 (DENSE, inherited), 2 (RAW).
Manifest SmallManifest() {
  Manifest m;
  m.model = "acme/qwen";
  m.version = "step-2";
  m.parent = "step-1";
  m.created = "2026-12-02T13:00:00.123Z";
  m.created_ms = 1796216400123;
  m.chunk_bytes = 1000;
  m.versions = {"step-2", "step-1", "base"};
  m.packs = {H(100), H(101), H(102)};
  m.stats = {3105, 1000, 42, 5000};
  ManifestFile config;
  config.path = "config.json";
  config.size = 100;
  config.sha256 = std::string(64, 'a');
  config.chunks = {Chunk("", 0, 0, 100, ChunkEncoding::kFull, 0, 0, 80, 2, 0, 0, 0, 80)};
  ManifestFile model;
  model.path = "model.safetensors";
  model.size = 3000;
  model.sha256 = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
  model.chunks = {
      Chunk(kHeaderChunkName, 0, 0, 200, ChunkEncoding::kPatch, 1, 0, 60, 0, 1, 1, 60, 150),
      Chunk("w", 0, 200, 1000, ChunkEncoding::kSparse, 1, 60, 70, 0, 1, 3, 300, 900),
      Chunk("w", 1, 1200, 1000, ChunkEncoding::kDense, 0, 80, 500, 1, 2, 1, 500, 900),
      Chunk("w", 2, 2200, 800, ChunkEncoding::kRaw, 2, 0, 840, 0, 0, 0, 0, 840),
  };
  ManifestFile odd;
  odd.path = "sub/dir/a@b=c+d_e-f.bin";
  odd.size = 5;
  odd.sha256 = std::string(64, '0');
  odd.chunks = {Chunk("", 0, 0, 5, ChunkEncoding::kFull, 2, 840, 45)};
  m.files = {config, model, odd};
  return m;
}

bool SameChunk(const ManifestChunk& a, const ManifestChunk& b) {
  return a.key == b.key && a.offset == b.offset && a.length == b.length && a.hash == b.hash &&
         a.encoding == b.encoding && a.ref.pack == b.ref.pack && a.ref.offset == b.ref.offset &&
         a.ref.length == b.ref.length && a.origin == b.origin && a.base == b.base &&
         a.depth == b.depth && a.chain_bytes == b.chain_bytes &&
         a.keyframe_bytes == b.keyframe_bytes;
}

void ExpectSameManifest(const Manifest& a, const Manifest& b) {
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.version, b.version);
  EXPECT_EQ(a.parent, b.parent);
  EXPECT_EQ(a.created, b.created);
  EXPECT_EQ(a.created_ms, b.created_ms);
  EXPECT_EQ(a.chunk_bytes, b.chunk_bytes);
  EXPECT_EQ(a.versions, b.versions);
  EXPECT_EQ(a.packs, b.packs);
  EXPECT_EQ(a.stats.logical_bytes, b.stats.logical_bytes);
  EXPECT_EQ(a.stats.stored_bytes, b.stats.stored_bytes);
  EXPECT_EQ(a.stats.changed_elements, b.stats.changed_elements);
  EXPECT_EQ(a.stats.elements, b.stats.elements);
  ASSERT_EQ(a.files.size(), b.files.size());
  for (size_t i = 0; i < a.files.size(); ++i) {
    const ManifestFile& fa = a.files[i];
    const ManifestFile& fb = b.files[i];
    SCOPED_TRACE("file " + fa.path);
    EXPECT_EQ(fa.path, fb.path);
    EXPECT_EQ(fa.size, fb.size);
    EXPECT_EQ(fa.sha256, fb.sha256);
    ASSERT_EQ(fa.chunks.size(), fb.chunks.size());
    size_t mismatches = 0;
    for (size_t k = 0; k < fa.chunks.size() && mismatches < 5; ++k) {
      if (!SameChunk(fa.chunks[k], fb.chunks[k])) {
        ++mismatches;
        ADD_FAILURE() << "chunk " << k << " differs";
      }
    }
  }
}

json BaseJson() {
  const std::vector<uint8_t> bytes = SerializeManifest(SmallManifest());
  return json::parse(bytes.begin(), bytes.end());
}

Expected<Manifest> ParseJson(const json& j, std::string_view model = {},
                             std::string_view version = {}) {
  const std::string text = j.dump();
  return ParseManifest(AsBytes(text), model, version);
}

json& Row(json& j, size_t chunk, size_t file = 1) { return j["files"][file]["chunks"][chunk]; }

// Applies `mutate` to the small manifest's JSON and expects ParseManifest to refuse it with
// `kind` and a message that contains `needle`.
void ExpectRejected(const std::function<void(json&)>& mutate, std::string_view needle,
                    ErrorKind kind = ErrorKind::kCorruption) {
  json j = BaseJson();
  mutate(j);
  Expected<Manifest> m = ParseJson(j);
  ASSERT_FALSE(m.ok()) << "accepted: " << j.dump().substr(0, 400);
  EXPECT_EQ(m.status().kind(), kind) << m.status().ToString();
  EXPECT_NE(m.status().message().find(needle), std::string::npos)
      << "message '" << m.status().message() << "' does not mention '" << needle << "'";
}

void ExpectAccepted(const std::function<void(json&)>& mutate) {
  json j = BaseJson();
  mutate(j);
  Expected<Manifest> m = ParseJson(j);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
}

// A one-chunk FULL file of 10 bytes in pack 0.
json OneChunkFile(const std::string& path) {
  return {{"path", path},
          {"size", 10},
          {"sha256", std::string(64, 'b')},
          {"chunks", json::array({json::array({"", 0, 0, 10, H(7).ToHex(), 1, 0, 0, 40, 0, 0, 0,
                                               0, 40})})}};
}

// A zstd frame by hand (RFC 8878): single segment, 8-byte content size `claimed`, one last
// block of `type` (0 raw, 1 RLE, 3 reserved) holding `body`.
std::vector<uint8_t> HandMadeFrame(uint64_t claimed, std::string_view body, int type = 0,
                                   uint32_t block_size = UINT32_MAX) {
  std::vector<uint8_t> f = {0x28, 0xB5, 0x2F, 0xFD, 0xE0};
  for (int i = 0; i < 8; ++i) f.push_back(static_cast<uint8_t>(claimed >> (8 * i)));
  const uint32_t size = block_size == UINT32_MAX ? static_cast<uint32_t>(body.size()) : block_size;
  const uint32_t header = (size << 3) | (static_cast<uint32_t>(type) << 1) | 1u;
  for (int i = 0; i < 3; ++i) f.push_back(static_cast<uint8_t>(header >> (8 * i)));
  f.insert(f.end(), body.begin(), body.end());
  return f;
}

std::vector<uint8_t> Zstd(std::span<const uint8_t> bytes) {
  std::vector<uint8_t> out(ZSTD_compressBound(bytes.size()));
  const size_t n = ZSTD_compress(out.data(), out.size(), bytes.data(), bytes.size(), 3);
  EXPECT_FALSE(ZSTD_isError(n));
  out.resize(ZSTD_isError(n) ? 0 : n);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Round trips and the wire format.

TEST(ManifestTest, SmallManifestRoundTripsAsPlainJson) {
  const Manifest m = SmallManifest();
  const std::vector<uint8_t> bytes = SerializeManifest(m);
  ASSERT_FALSE(bytes.empty());
  EXPECT_EQ(bytes[0], '{') << "a small manifest is stored as plain JSON";
  Expected<Manifest> back = ParseManifest(bytes, "acme/qwen", "step-2");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameManifest(m, *back);
  // And once more: serialization is deterministic.
  EXPECT_EQ(SerializeManifest(*back), bytes);
}

TEST(ManifestTest, BaseVersionWithoutParentRoundTrips) {
  Manifest m = SmallManifest();
  m.parent.reset();
  Expected<Manifest> back = ParseManifest(SerializeManifest(m));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->parent.has_value());
  ExpectSameManifest(m, *back);

  m.files.clear();  // a version of nothing is still a version
  back = ParseManifest(SerializeManifest(m));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->files.empty());
}

TEST(ManifestTest, LargeManifestRoundTripsThroughZstd) {
  // 200k chunk rows in 8 files: ~30 MB of JSON, so the compressed path is taken.
  constexpr size_t kFiles = 8;
  constexpr size_t kChunksPerFile = kSanitized ? 4'000 : 25'000;
  Manifest m;
  m.model = "org/team/big-model";
  m.version = "v3";
  m.parent = "v2";
  m.created = "2027-01-31T23:59:59.999Z";
  m.created_ms = ParseUtc(m.created).value();
  m.chunk_bytes = kDefaultChunkBytes;
  m.versions = {"v3", "v2", "v1"};
  for (uint64_t p = 0; p < 50; ++p) m.packs.push_back(H(1000 + p));
  std::mt19937_64 rng(7);
  for (size_t f = 0; f < kFiles; ++f) {
    ManifestFile file;
    file.path = "model-0000" + std::to_string(f + 1) + "-of-0000" + std::to_string(kFiles) + ".safetensors";
    file.sha256 = std::string(64, "0123456789abcdef"[f]);
    uint64_t offset = 0;
    for (size_t k = 0; k < kChunksPerFile; ++k) {
      const uint64_t length = k == 0 ? 12345 : kDefaultChunkBytes - (rng() % 3) * 2;
      const std::string tensor = k == 0 ? kHeaderChunkName : "layers." + std::to_string(k / 16) + ".mlp.weight";
      const uint64_t index = k == 0 ? 0 : k % 16;
      const uint32_t kind = static_cast<uint32_t>(rng() % 3);
      ManifestChunk c;
      if (kind == 0) {
        c = Chunk(tensor, index, offset, length, ChunkEncoding::kFull,
                  static_cast<uint32_t>(rng() % 50), rng() % (1ull << 40), 40 + rng() % length,
                  static_cast<uint32_t>(rng() % 3), 0, 0, 0, 40 + rng() % length);
      } else {
        const uint32_t depth = 1 + static_cast<uint32_t>(rng() % 64);
        c = Chunk(tensor, index, offset, length, kind == 1 ? ChunkEncoding::kSparse : ChunkEncoding::kDense,
                  static_cast<uint32_t>(rng() % 50), rng() % (1ull << 40), 40 + rng() % 100000,
                  static_cast<uint32_t>(rng() % 3), 1 + static_cast<uint32_t>(rng() % 2), depth,
                  depth * 1000, 3'000'000);
      }
      c.hash = Hash128{rng(), rng()};
      file.chunks.push_back(c);
      offset += length;
    }
    file.size = offset;
    m.stats.logical_bytes += offset;
    m.files.push_back(std::move(file));
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<uint8_t> bytes = SerializeManifest(m);
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_GE(bytes.size(), 4u);
  EXPECT_EQ(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 4),
            (std::vector<uint8_t>{0x28, 0xB5, 0x2F, 0xFD}))
      << "a large manifest is stored zstd-compressed";
  Expected<Manifest> back = ParseManifest(bytes, m.model, m.version);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameManifest(m, *back);
  auto ms = [](auto d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); };
  // Informational only (no timing asserts): what 200k rows cost.
  std::printf("[          ] %zu chunk rows: %zu bytes compressed, serialize %lld ms, parse %lld ms\n",
              kFiles * kChunksPerFile, bytes.size(), static_cast<long long>(ms(t1 - t0)), static_cast<long long>(ms(t2 - t1)));
}

TEST(ManifestTest, ReadsZstdCompressedSmallManifestsToo) {
  const std::vector<uint8_t> plain = SerializeManifest(SmallManifest());
  Expected<Manifest> back = ParseManifest(Zstd(plain));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameManifest(SmallManifest(), *back);
  // A hand-made frame holding the JSON in a raw block is a manifest as well.
  const std::string text(plain.begin(), plain.end());
  back = ParseManifest(HandMadeFrame(text.size(), text));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ExpectSameManifest(SmallManifest(), *back);
}

// The documented format, written by hand: pins the wire format against accidental changes.
TEST(ManifestTest, ParsesTheDocumentedFormat) {
  const std::string text = R"({
    "format": 1, "model": "acme/qwen", "version": "step-2", "parent": "step-1",
    "created": "2026-12-02T13:00:00.000Z", "chunk_bytes": 4194304,
    "versions": ["step-2", "step-1"],
    "packs": ["000102030405060708090a0b0c0d0e0f"],
    "stats": {"logical_bytes": 7, "stored_bytes": 41, "changed_elements": 2, "elements": 7},
    "files": [{"path": "model.safetensors", "size": 7,
               "sha256": "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100",
               "chunks": [["__header__", 0, 0, 3, "00000000000000010000000000000002", 1, 0, 0, 41,
                           1, 0, 0, 0, 41],
                          ["w", 0, 3, 4, "0000000000000003000000000000000f", 2, 0, 41, 45,
                           0, 1, 1, 45, 100]]}]})";
  Expected<Manifest> m = ParseManifest(AsBytes(text), "acme/qwen", "step-2");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->model, "acme/qwen");
  EXPECT_EQ(m->version, "step-2");
  EXPECT_EQ(m->parent, std::optional<std::string>("step-1"));
  EXPECT_EQ(m->created_ms, 1796216400000);
  EXPECT_EQ(m->chunk_bytes, 4194304u);
  EXPECT_EQ(m->versions, (std::vector<std::string>{"step-2", "step-1"}));
  ASSERT_EQ(m->packs.size(), 1u);
  EXPECT_EQ(m->packs[0], (Hash128{0x0001020304050607ull, 0x08090a0b0c0d0e0full}));
  EXPECT_EQ(m->stats.logical_bytes, 7u);
  EXPECT_EQ(m->stats.stored_bytes, 41u);
  EXPECT_EQ(m->stats.changed_elements, 2u);
  EXPECT_EQ(m->stats.elements, 7u);
  ASSERT_EQ(m->files.size(), 1u);
  const ManifestFile& f = m->files[0];
  EXPECT_EQ(f.path, "model.safetensors");
  EXPECT_EQ(f.size, 7u);
  ASSERT_EQ(f.chunks.size(), 2u);
  const ManifestChunk& h = f.chunks[0];
  EXPECT_EQ(h.key, (ChunkKey{kHeaderChunkName, 0}));
  EXPECT_EQ(h.hash, (Hash128{1, 2}));
  EXPECT_EQ(h.encoding, ChunkEncoding::kFull);
  EXPECT_EQ(h.origin, 1u);
  EXPECT_EQ(h.keyframe_bytes, 41u);
  const ManifestChunk& w = f.chunks[1];
  EXPECT_EQ(w.key, (ChunkKey{"w", 0}));
  EXPECT_EQ(w.offset, 3u);
  EXPECT_EQ(w.length, 4u);
  EXPECT_EQ(w.hash, (Hash128{3, 15}));
  EXPECT_EQ(w.encoding, ChunkEncoding::kSparse);
  EXPECT_TRUE(w.is_delta());
  EXPECT_EQ(w.ref.pack, 0u);
  EXPECT_EQ(w.ref.offset, 41u);
  EXPECT_EQ(w.ref.length, 45u);
  EXPECT_EQ(w.origin, 0u);
  EXPECT_EQ(w.base, 1u);
  EXPECT_EQ(w.depth, 1u);
  EXPECT_EQ(w.chain_bytes, 45u);
  EXPECT_EQ(w.keyframe_bytes, 100u);
}

TEST(ManifestTest, ParentAndStatsAreOptional) {
  json j = BaseJson();
  j.erase("parent");
  j.erase("stats");
  Expected<Manifest> m = ParseJson(j);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_FALSE(m->parent.has_value());
  EXPECT_EQ(m->stats.logical_bytes, 0u);
  EXPECT_EQ(m->stats.elements, 0u);
  j["parent"] = nullptr;
  m = ParseJson(j);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_FALSE(m->parent.has_value());
}

TEST(ManifestTest, LookupHelpers) {
  Manifest m = SmallManifest();
  ASSERT_NE(m.FindFile("model.safetensors"), nullptr);
  EXPECT_EQ(m.FindFile("model.safetensors")->size, 3000u);
  EXPECT_EQ(m.FindFile("model"), nullptr);
  EXPECT_EQ(m.FindFile("zzz"), nullptr);
  EXPECT_EQ(m.FindFile(""), nullptr);
  const ManifestFile& f = m.files[1];
  EXPECT_EQ(f.ChunkAt(0), 0u);
  EXPECT_EQ(f.ChunkAt(199), 0u);
  EXPECT_EQ(f.ChunkAt(200), 1u);
  EXPECT_EQ(f.ChunkAt(2199), 2u);
  EXPECT_EQ(f.ChunkAt(2200), 3u);
  EXPECT_EQ(f.ChunkAt(2999), 3u);
  EXPECT_EQ(f.FindChunk({"w", 1}), std::optional<size_t>(2));
  EXPECT_EQ(f.FindChunk({"w", 3}), std::nullopt);
  EXPECT_EQ(m.VersionIndex("step-1"), 1u);
  EXPECT_EQ(m.VersionIndex("older"), 3u);
  EXPECT_EQ(m.versions.size(), 4u);
  EXPECT_EQ(m.PackIndex(H(101)), 1u);
  EXPECT_EQ(m.PackIndex(H(555)), 3u);
  EXPECT_EQ(m.packs.size(), 4u);
}

// ---------------------------------------------------------------------------------------------
// What ParseManifest refuses.

TEST(ManifestTest, RejectsBytesThatAreNotAJsonObject) {
  for (std::string_view text : {"", " ", "{", "hello", "{\"format\": 1,}", "[1, 2]", "1", "null",
                                "\"format\"", "true", "{\"format\": 1} trailing"}) {
    SCOPED_TRACE(std::string(text));
    Expected<Manifest> m = ParseManifest(AsBytes(text));
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
    EXPECT_NE(m.status().message().find("not a JSON object"), std::string::npos) << m.status().ToString();
  }
  // Invalid UTF-8 inside a string, and a NUL before the end.
  const std::string bad_utf8 = "{\"format\": 1, \"model\": \"\xff\xfe\"}";
  EXPECT_EQ(ParseManifest(AsBytes(bad_utf8)).status().kind(), ErrorKind::kCorruption);
  json j = BaseJson();
  std::string with_nul = j.dump();
  with_nul.insert(with_nul.size() / 2, 1, '\0');
  EXPECT_EQ(ParseManifest(AsBytes(with_nul)).status().kind(), ErrorKind::kCorruption);
}

// nlohmann parses iteratively and (since 3.10) destroys iteratively: deep nesting anywhere must
// be an ordinary error, not a stack overflow.
TEST(ManifestTest, DeeplyNestedJsonIsAnErrorNotAStackOverflow) {
  constexpr size_t kDepth = 200'000;
  const std::string nested = std::string(kDepth, '[') + std::string(kDepth, ']');
  Expected<Manifest> m = ParseManifest(AsBytes(nested));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("not a JSON object"), std::string::npos);
  m = ParseManifest(AsBytes("{\"format\":1,\"model\":" + nested + "}"));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption) << m.status().ToString();
  // Deep junk under a key the reader ignores: accepted, and freed without recursion.
  std::string text = BaseJson().dump();
  const std::string key = "\"stats\":{";
  ASSERT_NE(text.find(key), std::string::npos);
  text.insert(text.find(key) + key.size(), "\"deep\":" + nested + ",");
  m = ParseManifest(AsBytes(text));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
}

TEST(ManifestTest, RejectsOtherFormatsAsUnsupported) {
  ExpectRejected([](json& j) { j["format"] = 3; }, "format 3", ErrorKind::kUnsupported);
  // Format 2 is a head whose rows are in a table object (chunk_table_test.cc): rows inline are
  // damage there.
  ExpectRejected([](json& j) { j["format"] = 2; }, "table");
  ExpectRejected([](json& j) { j["format"] = 0; }, "format 0", ErrorKind::kUnsupported);
  ExpectRejected([](json& j) { j["format"] = -1; }, "format -1", ErrorKind::kUnsupported);
  ExpectRejected([](json& j) { j["format"] = UINT64_MAX; }, "upgrade weightfs", ErrorKind::kUnsupported);
  // A format that is not an integer at all is damage, not a newer writer.
  ExpectRejected([](json& j) { j["format"] = "1"; }, "no format");
  ExpectRejected([](json& j) { j["format"] = 1.0; }, "no format");
  ExpectRejected([](json& j) { j["format"] = nullptr; }, "no format");
  ExpectRejected([](json& j) { j.erase("format"); }, "no format");
}

TEST(ManifestTest, RejectsMissingFields) {
  for (const char* field : {"model", "version", "created", "chunk_bytes", "versions", "packs", "files"}) {
    SCOPED_TRACE(field);
    ExpectRejected([&](json& j) { j.erase(field); }, std::string("no '") + field + "'");
  }
  ExpectRejected([](json& j) { j["files"][0].erase("path"); }, "without a path");
  for (const char* field : {"size", "sha256", "chunks"}) {
    SCOPED_TRACE(field);
    ExpectRejected([&](json& j) { j["files"][1].erase(field); }, "missing size, sha256 or chunks");
  }
}

// Hostile names in each of the three places a manifest names something on disk or in a key.
const std::vector<std::string>& EscapingNames() {
  static const std::vector<std::string> names = {
      "", ".", "..", "../x", "x/..", "a/../b", "/abs", "a//b", "a/", "a/./b", "./a",
      std::string("a\0b", 3), "a b", "a\\b", "a:b", "a*b", "a\nb", "\xc3\xa9", "~a", "a?b", "%2e%2e",
  };
  return names;
}

TEST(ManifestTest, RejectsModelNamesThatEscape) {
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("model '" + bad + "'");
    ExpectRejected([&](json& j) { j["model"] = bad; }, "model name");
  }
  ExpectRejected([](json& j) { j["model"] = std::string(257, 'm'); }, "longer than 256");
  ExpectRejected([](json& j) { j["model"] = "a@b"; }, "character outside");
  ExpectAccepted([](json& j) { j["model"] = std::string(256, 'm'); });
  ExpectAccepted([](json& j) { j["model"] = "Org.1/sub_2/name-3"; });
}

TEST(ManifestTest, RejectsVersionNamesThatEscape) {
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("version '" + bad + "'");
    ExpectRejected([&](json& j) {
      j["version"] = bad;
      j["versions"][0] = bad;
    }, "version name");
  }
  ExpectRejected([](json& j) { j["version"] = j["versions"][0] = "a/b"; }, "version name");
  ExpectRejected([](json& j) { j["version"] = j["versions"][0] = std::string(129, 'v'); },
                 "longer than 128");
  ExpectAccepted([](json& j) { j["version"] = j["versions"][0] = std::string(128, 'v'); });
}

TEST(ManifestTest, RejectsFilePathsThatEscape) {
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("path '" + bad + "'");
    ExpectRejected([&](json& j) { j["files"][0]["path"] = bad; }, "file path");
  }
  ExpectRejected([](json& j) { j["files"][2]["path"] = "sub/" + std::string(1021, 'p'); },
                 "longer than 1024");
  ExpectAccepted([](json& j) {
    j["files"][2]["path"] = "sub/" + std::string(255, 'p') + "/" + std::string(255, 'p') + "/" +
                            std::string(255, 'p') + "/" + std::string(251, 'p');
  });
  ExpectRejected([](json& j) { j["files"][2]["path"] = "sub/" + std::string(256, 'p'); }, "longer than 255 bytes");
}

TEST(ManifestTest, RejectsAManifestStoredUnderAnotherName) {
  const json j = BaseJson();
  EXPECT_TRUE(ParseJson(j, "acme/qwen", "step-2").ok());
  EXPECT_TRUE(ParseJson(j, "acme/qwen", "").ok());
  EXPECT_TRUE(ParseJson(j, "", "step-2").ok());
  Expected<Manifest> m = ParseJson(j, "acme/other", "step-2");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(m.status().message().find("names model 'acme/qwen' but is stored under 'acme/other'"),
            std::string::npos) << m.status().ToString();
  m = ParseJson(j, "acme/qwen", "step-3");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(m.status().message().find("names version 'step-2' but is stored under 'step-3'"),
            std::string::npos) << m.status().ToString();
  m = ParseJson(j, "acme/QWEN", "step-2");  // names are case-sensitive
  EXPECT_FALSE(m.ok());
}

TEST(ManifestTest, RejectsABadParent) {
  ExpectRejected([](json& j) { j["parent"] = "step-2"; }, "its own parent");
  ExpectRejected([](json& j) { j["parent"] = "../step-1"; }, "version name");
  ExpectRejected([](json& j) { j["parent"] = ""; }, "version name");
  ExpectRejected([](json& j) { j["parent"] = 1; }, "parent is not a string");
}

TEST(ManifestTest, RejectsABadVersionsTable) {
  ExpectRejected([](json& j) { j["versions"][0] = "step-1"; j["versions"][1] = "step-2"; },
                 "versions[0] is not the version itself");
  ExpectRejected([](json& j) { j["versions"][2] = "step-1"; }, "duplicate entry in versions");
  ExpectRejected([](json& j) { j["versions"].push_back("step-2"); }, "duplicate entry in versions");
  ExpectRejected([](json& j) { j["versions"] = json::array(); }, "versions is not a non-empty array");
  ExpectRejected([](json& j) { j["versions"][1] = "a/b"; }, "version name");
  ExpectRejected([](json& j) { j["versions"][1] = ".."; }, "version name");
}

TEST(ManifestTest, RejectsBadPackNames) {
  for (const char* bad : {"", "0123456789abcdef0123456789abcde", "0123456789abcdef0123456789abcdef0",
                          "0123456789ABCDEF0123456789abcdef", "0123456789abcdeg0123456789abcdef",
                          "../../../../etc/passwd/000000000"}) {
    SCOPED_TRACE(bad);
    ExpectRejected([&](json& j) { j["packs"][1] = bad; }, "pack name is not 32 hex digits");
  }
}

TEST(ManifestTest, RejectsBadCreatedAndChunkBytes) {
  ExpectRejected([](json& j) { j["created"] = "yesterday"; }, "'yesterday' is not an RFC 3339 UTC time");
  ExpectRejected([](json& j) { j["created"] = "2026-12-02T13:00:00"; }, "RFC 3339");
  {  // A huge value is not echoed in full.
    json j = BaseJson();
    j["created"] = std::string(1 << 20, '7');
    Expected<Manifest> m = ParseJson(j);
    ASSERT_FALSE(m.ok());
    EXPECT_LT(m.status().message().size(), 300u) << m.status().message().substr(0, 300);
  }
  ExpectRejected([](json& j) { j["chunk_bytes"] = 0; }, "chunk_bytes out of range");
  ExpectRejected([](json& j) { j["chunk_bytes"] = kMaxChunkBytes + 1; }, "chunk_bytes out of range");
  ExpectAccepted([](json& j) { j["chunk_bytes"] = kMaxChunkBytes; });
}

TEST(ManifestTest, RejectsBadFileEntries) {
  ExpectRejected([](json& j) { j["files"][1]["sha256"] = std::string(63, 'a'); }, "sha256 is not 64 lowercase hex");
  ExpectRejected([](json& j) { j["files"][1]["sha256"] = std::string(64, 'A'); }, "sha256 is not 64 lowercase hex");
  ExpectRejected([](json& j) { j["files"][1]["sha256"] = std::string(64, 'g'); }, "sha256 is not 64 lowercase hex");
  ExpectRejected([](json& j) { j["files"][0]["size"] = (1ull << 50) + 1; }, "file size out of range");
  ExpectRejected([](json& j) {
    j["files"][2]["size"] = 1;
    j["files"][2]["chunks"] = json::array({Row(j, 0, 2), Row(j, 0, 2)});
  }, "more chunks than bytes");
  ExpectRejected([](json& j) { Row(j, 1)[kTensor] = std::string(4097, 't'); }, "tensor name longer than 4096");
  ExpectAccepted([](json& j) { Row(j, 1)[kTensor] = Row(j, 2)[kTensor] = Row(j, 3)[kTensor] = std::string(4096, 't'); });
  // A tensor name is not a path: any string is fine, a NUL included (it only keys chunks).
  ExpectAccepted([](json& j) { Row(j, 1)[kTensor] = Row(j, 2)[kTensor] = Row(j, 3)[kTensor] = std::string("../\0x", 5); });
  ExpectRejected([](json& j) { Row(j, 1)[kHash] = "0123"; }, "32 hex digits");
  ExpectRejected([](json& j) { Row(j, 1)[kHash] = std::string(32, 'F'); }, "non-hex digit");
  // An empty file has no chunks.
  ExpectAccepted([](json& j) {
    j["files"][2]["size"] = 0;
    j["files"][2]["chunks"] = json::array();
  });
  // Error messages say where: the manifest, the file, the chunk.
  ExpectRejected([](json& j) { Row(j, 2)[kLength] = 0; },
                 "manifest acme/qwen@step-2: file 'model.safetensors': chunk 2: chunk length 0 out of range");
}

TEST(ManifestTest, RejectsChunksThatDoNotTileTheFile) {
  ExpectRejected([](json& j) { Row(j, 2)[kOffset] = 1201; }, "chunk 2 does not start where the previous one ends");  // gap
  ExpectRejected([](json& j) { Row(j, 2)[kOffset] = 1199; }, "chunk 2 does not start where the previous one ends");  // overlap
  ExpectRejected([](json& j) { Row(j, 0)[kOffset] = 1; }, "chunk 0 does not start");
  ExpectRejected([](json& j) { Row(j, 3)[kLength] = 801; }, "chunks extend past the file size");
  ExpectRejected([](json& j) { j["files"][1]["size"] = 2999; }, "chunks extend past the file size");
  ExpectRejected([](json& j) { j["files"][1]["size"] = 3001; }, "chunks do not cover the file");
  ExpectRejected([](json& j) { j["files"][1]["chunks"].erase(3); }, "chunks do not cover the file");
  ExpectRejected([](json& j) { j["files"][1]["chunks"] = json::array(); }, "chunks do not cover the file");
  ExpectRejected([](json& j) {  // out of order: each still has a valid offset/length of its own
    std::swap(Row(j, 1), Row(j, 2));
  }, "does not start where the previous one ends");
  // Offsets that wrap around u64 cannot pass for a tiling.
  ExpectRejected([](json& j) {
    j["files"][1]["size"] = 1ull << 50;
    Row(j, 3)[kOffset] = UINT64_MAX - 100;
  }, "does not start");
}

TEST(ManifestTest, RejectsChunkLengthsOutOfRange) {
  ExpectRejected([](json& j) { Row(j, 0)[kLength] = 0; }, "chunk length 0 out of range");
  ExpectRejected([](json& j) {
    j["files"][0]["size"] = kMaxChunkBytes + 1;
    Row(j, 0, 0)[kLength] = kMaxChunkBytes + 1;
  }, "out of range");
  ExpectAccepted([](json& j) {
    j["files"][0]["size"] = kMaxChunkBytes;
    Row(j, 0, 0)[kLength] = kMaxChunkBytes;
  });
}

TEST(ManifestTest, RejectsPayloadRangesOutOfBounds) {
  ExpectRejected([](json& j) { Row(j, 1)[kPackLength] = kPayloadHeaderBytes - 1; }, "payload range out of bounds");
  ExpectRejected([](json& j) { Row(j, 1)[kPackLength] = kMaxPayload + 1; }, "payload range out of bounds");
  ExpectRejected([](json& j) { Row(j, 1)[kPackOffset] = (1ull << 48) + 1; }, "payload range out of bounds");
  ExpectAccepted([](json& j) {
    Row(j, 1)[kPackLength] = kMaxPayload;
    Row(j, 1)[kPackOffset] = 1ull << 48;
  });
}

TEST(ManifestTest, RejectsIndicesOutOfRange) {
  ExpectRejected([](json& j) { Row(j, 1)[kPack] = 3; }, "chunk names pack 3 of 3");
  ExpectRejected([](json& j) { Row(j, 1)[kPack] = UINT64_MAX; }, "of 3");
  ExpectRejected([](json& j) { j["packs"] = json::array(); }, "chunk names pack 0 of 0");
  ExpectRejected([](json& j) { Row(j, 1)[kOrigin] = 3; }, "chunk origin out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kOrigin] = (1ull << 32); }, "chunk origin out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kBase] = 3; }, "base version out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kBase] = (1ull << 32) + 1; }, "base version out of range");
  ExpectAccepted([](json& j) { Row(j, 1)[kPack] = 2; Row(j, 1)[kOrigin] = 2; Row(j, 1)[kBase] = 2; });
}

TEST(ManifestTest, RejectsInconsistentChainFields) {
  ExpectRejected([](json& j) { Row(j, 1)[kBase] = 0; }, "base version out of range");  // a delta against itself
  ExpectRejected([](json& j) { Row(j, 1)[kDepth] = 0; }, "delta chunk with depth 0");
  ExpectRejected([](json& j) { Row(j, 3)[kBase] = 1; }, "keyframe chunk with a base");
  ExpectRejected([](json& j) { Row(j, 3)[kDepth] = 1; }, "keyframe chunk with a base");
  ExpectRejected([](json& j) { Row(j, 1)[kDepth] = kMaxDepth + 1; }, "depth out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kDepth] = (1ull << 32) + 1; }, "depth out of range");
  ExpectAccepted([](json& j) { Row(j, 1)[kDepth] = kMaxDepth; });
}

// chain_bytes and keyframe_bytes feed KeyframePolicy's sum; values no writer can produce
// (a chain longer than kMaxDepth payloads of the largest size) must not wrap it around.
TEST(ManifestTest, RejectsChainByteCountsNoChainCanHave) {
  ExpectRejected([](json& j) { Row(j, 1)[kChainBytes] = UINT64_MAX; }, "chain bytes out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kKeyframeBytes] = UINT64_MAX; }, "keyframe bytes out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kKeyframeBytes] = kMaxPayload + 1; }, "keyframe bytes out of range");
  ExpectRejected([](json& j) { Row(j, 1)[kChainBytes] = uint64_t{kMaxDepth} * kMaxPayload + 1; },
                 "chain bytes out of range");
  ExpectAccepted([](json& j) {
    Row(j, 1)[kChainBytes] = uint64_t{kMaxDepth} * kMaxPayload;
    Row(j, 1)[kKeyframeBytes] = kMaxPayload;
  });
}

TEST(ManifestTest, RejectsUnknownEncodings) {
  for (uint64_t enc : {uint64_t{0}, uint64_t{7}, uint64_t{255}, uint64_t{256 + 1}, UINT64_MAX}) {
    SCOPED_TRACE(enc);
    ExpectRejected([&](json& j) { Row(j, 3)[kEncoding] = enc; }, "unknown chunk encoding");
  }
  // Every real encoding is accepted where its other fields fit.
  ExpectAccepted([](json& j) { Row(j, 3)[kEncoding] = 1; });
  ExpectAccepted([](json& j) { Row(j, 2)[kEncoding] = 4; });
}

// kExternal (6): ref.pack indexes `sources`, and the range is exactly the chunk.
TEST(ManifestTest, ExternalChunksNeedASourceAndTheirOwnLength) {
  const std::string src = "hf://acme/base@0123456789abcdef0123456789abcdef01234567/model.safetensors";
  auto external = [&](json& j, size_t row) {
    j["sources"] = json::array({src});
    json& r = Row(j, row);
    r[kEncoding] = 6;
    r[kPack] = 0;
    r[kPackLength] = r[kLength];
    r[kBase] = 0;
    r[kDepth] = 0;
  };
  ExpectAccepted([&](json& j) { external(j, 3); });
  ExpectRejected([&](json& j) { external(j, 3); j.erase("sources"); }, "chunk names source 0 of 0");
  ExpectRejected([&](json& j) { external(j, 3); Row(j, 3)[kPackLength] = 1; }, "source range out of bounds");
  ExpectRejected([&](json& j) { external(j, 3); j["sources"] = json::array({"hf://x@main/a"}); }, "source");
  ExpectRejected([&](json& j) { external(j, 3); j["sources"] = json::array({src, src}); }, "duplicate entry in sources");
  ExpectRejected([&](json& j) { external(j, 3); j["sources"] = "x"; }, "sources is not an array");
}

TEST(ManifestTest, RejectsDuplicateChunkKeys) {
  ExpectRejected([](json& j) { Row(j, 2)[kIndex] = 0; }, "duplicate chunk key tensor 'w' chunk 0");
  ExpectRejected([](json& j) { Row(j, 1)[kTensor] = kHeaderChunkName; }, "duplicate chunk key header");
  // The same key in two files is fine: keys are per file.
  ExpectAccepted([](json& j) { Row(j, 0, 0)[kTensor] = "w"; });
}

TEST(ManifestTest, RejectsUnsortedOrRepeatedFiles) {
  ExpectRejected([](json& j) { std::swap(j["files"][0], j["files"][1]); }, "files are not sorted by path or repeat one");
  ExpectRejected([](json& j) { j["files"][2] = j["files"][1]; }, "files are not sorted by path or repeat one");
  ExpectRejected([](json& j) { j["files"] = json::array({OneChunkFile("b"), OneChunkFile("B")}); }, "not sorted");
  ExpectAccepted([](json& j) { j["files"] = json::array({OneChunkFile("B"), OneChunkFile("b")}); });
}

TEST(ManifestTest, RejectsAPathThatIsBothAFileAndADirectory) {
  const std::vector<std::vector<std::string>> conflicts = {
      {"a", "a/b"},
      {"a", "a-x", "a.y", "a/b"},       // '-' and '.' sort between "a" and "a/"
      {"a", "a/b/c/d"},
      {"x/a", "x/a/b", "y"},
      {"0", "a", "a.bin", "a/b", "b"},
  };
  for (const auto& paths : conflicts) {
    SCOPED_TRACE(paths[0] + ", " + paths[1]);
    ExpectRejected([&](json& j) {
      j["files"] = json::array();
      for (const std::string& p : paths) j["files"].push_back(OneChunkFile(p));
    }, "is both a file and a directory");
  }
  const std::vector<std::vector<std::string>> fine = {
      {"a", "ab", "a-x"}, {"a", "a-x", "ab"}, {"a/b", "a/c"}, {"a", "b/a"}, {"a.b", "a/c"},
  };
  for (const auto& paths : fine) {
    SCOPED_TRACE(paths[0] + ", " + paths[1]);
    json j = BaseJson();
    j["files"] = json::array();
    std::vector<std::string> sorted = paths;
    std::sort(sorted.begin(), sorted.end());
    for (const std::string& p : sorted) j["files"].push_back(OneChunkFile(p));
    Expected<Manifest> m = ParseJson(j);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
  }
}

// Every field, given a value of the wrong JSON type (or a number that is negative, fractional
// or beyond u64), is refused with a Corruption naming it.
TEST(ManifestTest, RejectsWrongJsonTypesInEveryField) {
  const json not_strings[] = {1, -1, 1.5, nullptr, true, json::array(), json::object()};
  const json not_counts[] = {"1", -1, 1.5, 1.0, 1e300, nullptr, true, json::array({1}), json::object(),
                             json::parse("18446744073709551616")};
  for (const char* field : {"model", "version", "created"}) {
    for (const json& v : not_strings) {
      SCOPED_TRACE(std::string(field) + " = " + v.dump());
      ExpectRejected([&](json& j) { j[field] = v; }, std::string(field) + " is not a string");
    }
  }
  for (const json& v : not_strings) {
    if (v.is_null()) continue;  // a null parent means "no parent"
    SCOPED_TRACE("parent = " + v.dump());
    ExpectRejected([&](json& j) { j["parent"] = v; }, "parent is not a string");
  }
  for (const json& v : not_counts) {
    SCOPED_TRACE("chunk_bytes = " + v.dump());
    ExpectRejected([&](json& j) { j["chunk_bytes"] = v; }, "chunk_bytes is not a non-negative integer");
  }
  for (const json& v : {json("step-2"), json(2), json::object(), json(nullptr)}) {
    SCOPED_TRACE("versions = " + v.dump());
    ExpectRejected([&](json& j) { j["versions"] = v; }, "versions is not a non-empty array");
  }
  for (const json& v : not_strings) {
    SCOPED_TRACE("versions[1] = " + v.dump());
    ExpectRejected([&](json& j) { j["versions"][1] = v; }, "versions entry is not a string");
  }
  for (const json& v : {json("x"), json(1), json::object(), json(nullptr)}) {
    SCOPED_TRACE("packs = " + v.dump());
    ExpectRejected([&](json& j) { j["packs"] = v; }, "packs is not an array");
  }
  for (const json& v : not_strings) {
    SCOPED_TRACE("packs[0] = " + v.dump());
    ExpectRejected([&](json& j) { j["packs"][0] = v; }, "pack name is not 32 hex digits");
  }
  for (const json& v : {json("x"), json(1), json::object(), json(nullptr)}) {
    SCOPED_TRACE("files = " + v.dump());
    ExpectRejected([&](json& j) { j["files"] = v; }, "files is not an array");
  }
  for (const json& v : {json("x"), json(1), json::array(), json(nullptr)}) {
    SCOPED_TRACE("files[0] = " + v.dump());
    ExpectRejected([&](json& j) { j["files"][0] = v; }, "file entry is not an object");
  }
  for (const json& v : not_strings) {
    SCOPED_TRACE("path = " + v.dump());
    ExpectRejected([&](json& j) { j["files"][1]["path"] = v; }, "file path is not a string");
  }
  for (const json& v : not_counts) {
    SCOPED_TRACE("size = " + v.dump());
    ExpectRejected([&](json& j) { j["files"][1]["size"] = v; }, "size is not a non-negative integer");
  }
  for (const json& v : not_strings) {
    SCOPED_TRACE("sha256 = " + v.dump());
    ExpectRejected([&](json& j) { j["files"][1]["sha256"] = v; }, "sha256 is not 64 lowercase hex");
  }
  for (const json& v : {json("x"), json(1), json::object(), json(nullptr)}) {
    SCOPED_TRACE("chunks = " + v.dump());
    ExpectRejected([&](json& j) { j["files"][1]["chunks"] = v; }, "missing size, sha256 or chunks");
  }
  for (const json& v : {json("x"), json(1), json::object(), json(nullptr), json::array({1, 2})}) {
    SCOPED_TRACE("row = " + v.dump());
    ExpectRejected([&](json& j) { Row(j, 1) = v; }, "chunk row is not an array of 14");
  }
  ExpectRejected([](json& j) { Row(j, 1).push_back(0); }, "chunk row is not an array of 14");
  ExpectRejected([](json& j) { Row(j, 1).erase(13); }, "chunk row is not an array of 14");

  const char* names[] = {"chunk tensor", "chunk index", "chunk offset", "chunk length", "chunk hash",
                         "chunk encoding", "chunk pack", "chunk pack offset", "chunk pack length",
                         "chunk origin", "chunk base", "chunk depth", "chunk chain bytes",
                         "chunk keyframe bytes"};
  for (size_t col = 0; col < 14; ++col) {
    const bool is_string = col == kTensor || col == kHash;
    for (const json& v : is_string ? std::span<const json>(not_strings) : std::span<const json>(not_counts)) {
      SCOPED_TRACE("column " + std::to_string(col) + " = " + v.dump());
      ExpectRejected([&](json& j) { Row(j, 1)[col] = v; },
                     std::string(names[col]) + (is_string ? " is not a string" : " is not a non-negative integer"));
    }
  }
}

TEST(ManifestTest, RejectsCorruptZstdFrames) {
  // A big manifest, compressed by SerializeManifest itself.
  Manifest m = SmallManifest();
  for (int i = 0; i < 5000; ++i) m.versions.push_back("older-version-" + std::to_string(i));
  const std::vector<uint8_t> good = SerializeManifest(m);
  ASSERT_EQ(good[0], 0x28) << "expected the compressed path";
  ASSERT_TRUE(ParseManifest(good).ok());

  auto expect_corrupt = [](std::vector<uint8_t> bytes, std::string_view needle) {
    Expected<Manifest> r = ParseManifest(bytes);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().ToString();
  };
  expect_corrupt({0x28, 0xB5, 0x2F, 0xFD}, "not a valid zstd frame");
  expect_corrupt({0x28, 0xB5, 0x2F, 0xFD, 0xFF, 0xFF}, "not a valid zstd frame");
  expect_corrupt(std::vector<uint8_t>(good.begin(), good.begin() + good.size() / 2), "does not decode");
  expect_corrupt(std::vector<uint8_t>(good.begin(), good.end() - 1), "does not decode");
  std::vector<uint8_t> two = good;
  two.insert(two.end(), good.begin(), good.end());  // a second frame beyond the declared size
  expect_corrupt(two, "does not decode");
  // Damage inside the compressed blocks: whatever it decodes to must not pass (either zstd
  // notices or the JSON/validation does), and nothing may crash.
  for (size_t at = 20; at < good.size(); at += good.size() / 24 + 1) {
    std::vector<uint8_t> bad = good;
    bad[at] ^= 0x5a;
    Expected<Manifest> r = ParseManifest(bad);
    if (!r.ok()) {
      EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << r.status().ToString();
    }
  }
  // Hand-made frames: declared size smaller or larger than the content, a reserved block type.
  expect_corrupt(HandMadeFrame(1, "{}"), "does not decode");
  expect_corrupt(HandMadeFrame(100, "{}"), "does not decode");
  expect_corrupt(HandMadeFrame(2, "{}", /*type=*/3), "does not decode");
  expect_corrupt(HandMadeFrame(2, "{}", /*type=*/0, /*block_size=*/5), "does not decode");
  // Valid zstd around something that is not a manifest.
  expect_corrupt(HandMadeFrame(5, "hello"), "not a JSON object");
  expect_corrupt(Zstd(AsBytes("[1,2,3]")), "not a JSON object");
}

TEST(ManifestTest, RejectsZstdBombs) {
  // Frames that claim more than 1 GiB are refused before anything is allocated.
  for (uint64_t claimed : {(1ull << 30) + 1, 1ull << 40, 1ull << 62}) {
    SCOPED_TRACE(claimed);
    Expected<Manifest> r = ParseManifest(HandMadeFrame(claimed, "{}"));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().kind(), ErrorKind::kResourceExhausted) << r.status().ToString();
    EXPECT_NE(r.status().message().find("larger than 1 GiB"), std::string::npos);
  }
  // One that claims just the cap but holds 2 bytes is corrupt (and must not cost a gigabyte).
  Expected<Manifest> r = ParseManifest(HandMadeFrame(1ull << 30, "{}"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << r.status().ToString();
  // A frame without a declared size is refused (writers always declare it).
  std::vector<uint8_t> unknown = {0x28, 0xB5, 0x2F, 0xFD, 0x00, 0x50};  // FCS absent, window 1 MiB
  const uint32_t header = (2u << 3) | 1u;
  for (int i = 0; i < 3; ++i) unknown.push_back(static_cast<uint8_t>(header >> (8 * i)));
  unknown.push_back('{');
  unknown.push_back('}');
  r = ParseManifest(unknown);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << r.status().ToString();
}

TEST(ManifestTest, RleFrameHelperMakesValidFrames) {
  const std::string text = BaseJson().dump();
  const size_t brace = text.find('{');
  // The small manifest with 1 MiB of spaces after its opening brace: a manifest still.
  const std::vector<uint8_t> frame = RleFrame(text.substr(0, brace + 1), ' ', 1 << 20, text.substr(brace + 1));
  EXPECT_LT(frame.size(), 8u << 10);
  Expected<Manifest> m = ParseManifest(frame, "acme/qwen", "step-2");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ExpectSameManifest(SmallManifest(), *m);
}

// The issue this pins: a 20 KB frame inflating to 200 MB of JSON. Its declared size is over the
// caller's limit, so it is refused before a byte is inflated, naming the manifest and the sizes.
TEST(ManifestTest, ZstdBombOverTheCallersLimitIsRefused) {
  constexpr std::string_view kPrefix = R"({"format": 1, "model": ")";
  constexpr uint64_t kJson = kPrefix.size() + (200ull << 20) + 2;
  const std::vector<uint8_t> bomb = RleFrame(kPrefix, 'a', 200ull << 20, R"("})");
  ASSERT_LT(bomb.size(), 20u << 10);
  Expected<Manifest> m = ParseManifest(bomb, "acme/qwen", "step-2", 64ull << 20);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kResourceExhausted) << m.status().ToString();
  for (const std::string& needle : {std::string("manifest acme/qwen@step-2"), std::to_string(bomb.size()) + " bytes",
                                    std::to_string(kJson) + " bytes", std::string("larger than 64 MiB")}) {
    EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status().message() << " lacks " << needle;
  }
}

// A frame whose header claims little but whose blocks hold much more: zstd compares the declared
// size with the output only at the end of a (multi-segment) frame, so the reader counts the
// bytes inflated against its limit as they come and stops there, 2 MiB into 200 MiB.
TEST(ManifestTest, ZstdFrameThatLiesAboutItsSizeStopsAtTheLimit) {
  const std::vector<uint8_t> liar =
      RleFrame(R"({"format": 1, "model": ")", 'a', 200ull << 20, R"("})", /*claimed=*/1 << 20);
  Expected<Manifest> m = ParseManifest(liar, "acme/qwen", "step-2", 2ull << 20);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kResourceExhausted) << m.status().ToString();
  EXPECT_NE(m.status().message().find("manifest acme/qwen@step-2: inflates to more than 2 MiB of JSON (from " +
                                      std::to_string(liar.size()) + " bytes of zstd)"),
            std::string::npos) << m.status().ToString();
}

TEST(ManifestTest, JsonLimitIsSetByTheCaller) {
  const std::string text = BaseJson().dump();
  EXPECT_TRUE(ParseManifest(AsBytes(text), {}, {}, text.size()).ok());
  Expected<Manifest> m = ParseManifest(AsBytes(text), "acme/qwen", "step-2", text.size() - 1);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kResourceExhausted) << m.status().ToString();
  EXPECT_NE(m.status().message().find("manifest acme/qwen@step-2: " + std::to_string(text.size()) +
                                      " bytes of JSON, larger than " + std::to_string(text.size() - 1) + " bytes"),
            std::string::npos) << m.status().ToString();
  // The same for the inflated size of a compressed manifest.
  const std::vector<uint8_t> z = Zstd(AsBytes(text));
  EXPECT_TRUE(ParseManifest(z, {}, {}, text.size()).ok());
  EXPECT_EQ(ParseManifest(z, {}, {}, text.size() - 1).status().kind(), ErrorKind::kResourceExhausted);
}

// The decoder's window is what a frame header can make it allocate: capped at 8 MiB (weightfs
// writes 2 MiB windows at most). (A frame that fits the decoder's 128 KiB output block needs no
// window at all.)
TEST(ManifestTest, ZstdFrameAskingForAHugeWindowIsRefused) {
  const std::string text = BaseJson().dump();
  const size_t brace = text.find('{') + 1;
  auto frame = [&](int window_log) {
    return RleFrame(text.substr(0, brace), ' ', 1 << 20, text.substr(brace), std::nullopt, window_log);
  };
  Expected<Manifest> m = ParseManifest(frame(23));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  m = ParseManifest(frame(24), "acme/qwen", "step-2");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kResourceExhausted) << m.status().ToString();
  EXPECT_NE(m.status().message().find("window larger than 8 MiB"), std::string::npos) << m.status().ToString();
}

// SerializeManifest writes keys sorted ("files" before "packs" and "versions"); any writer's
// order must give the same manifest, and a damaged one the same error.
TEST(ManifestTest, KeysInAnyOrderGiveTheSameManifestAndTheSameErrors) {
  using ordered = nlohmann::ordered_json;
  auto reorder = [](const json& j, bool reverse) {
    std::vector<std::string> keys;
    for (auto it = j.begin(); it != j.end(); ++it) keys.push_back(it.key());
    if (reverse) std::reverse(keys.begin(), keys.end());
    ordered o = ordered::object();
    for (const std::string& k : keys) {
      if (k != "files") {
        o[k] = j[k];
        continue;
      }
      ordered files = ordered::array();
      for (const json& f : j[k]) {  // and "chunks" last in each file entry
        ordered e = ordered::object();
        for (const char* field : {"path", "size", "sha256", "chunks"}) e[field] = f[field];
        files.push_back(e);
      }
      o[k] = files;
    }
    return o.dump();
  };
  auto parse = [](const std::string& text) { return ParseManifest(AsBytes(text)); };
  const json base = BaseJson();
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "tables before files" : "files before tables");
    Expected<Manifest> m = parse(reorder(base, reverse));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ExpectSameManifest(SmallManifest(), *m);
  }
  const std::vector<std::pair<std::function<void(json&)>, std::string>> damage = {
      // An index into a table the reader reaches only after the row (or before it).
      {[](json& j) { Row(j, 1)[kPack] = 3; }, "file 'model.safetensors': chunk 1: chunk names pack 3 of 3"},
      {[](json& j) { Row(j, 2)[kOrigin] = 3; }, "chunk 2: chunk origin out of range"},
      // An index error comes before a later check of the same row, and before later rows.
      {[](json& j) { Row(j, 1)[kPack] = 3; Row(j, 1)[kDepth] = kMaxDepth + 1; }, "chunk 1: chunk names pack 3 of 3"},
      {[](json& j) { Row(j, 1)[kBase] = 5; Row(j, 3)[kLength] = 0; }, "chunk 1: delta chunk's base version out of range"},
      {[](json& j) { Row(j, 1)[kBase] = 5; Row(j, 2)[kOffset] = 7; }, "chunk 1: delta chunk's base version out of range"},
      {[](json& j) { Row(j, 2)[kOffset] = 7; Row(j, 2)[kPack] = 9; }, "chunk 2: chunk names pack 9 of 3"},
      // The manifest's own fields come before its files.
      {[](json& j) { Row(j, 1)[kLength] = 0; j["model"] = "../x"; }, "model name '../x'"},
      {[](json& j) { Row(j, 1)[kPack] = 3; j["chunk_bytes"] = 0; }, "chunk_bytes out of range"},
      // A file's own fields come before its rows (its size is read after its chunks here).
      {[](json& j) { Row(j, 1)[kLength] = 0; j["files"][1]["size"] = -1; }, "size is not a non-negative integer"},
      {[](json& j) { Row(j, 3)[kLength] = 801; Row(j, 3)[kIndex] = 1; }, "chunks extend past the file size"},
  };
  for (const auto& [mutate, needle] : damage) {
    SCOPED_TRACE(needle);
    json j = base;
    mutate(j);
    for (bool reverse : {false, true}) {
      Expected<Manifest> m = parse(reorder(j, reverse));
      ASSERT_FALSE(m.ok());
      EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
      EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status().message();
    }
  }
}

// A DOM keeps the last of repeated keys and another reader might keep the first: a manifest
// that repeats a key the reader interprets is refused. Repeated keys it ignores are harmless.
TEST(ManifestTest, RejectsRepeatedKeys) {
  const std::string text = BaseJson().dump();
  auto with = [&](const std::string& after, const std::string& insert) {
    std::string t = text;
    const size_t at = t.find(after);
    EXPECT_NE(at, std::string::npos) << after;
    return t.insert(at + after.size(), insert);
  };
  Expected<Manifest> m = ParseManifest(AsBytes(with("{", R"("files":[],)")));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(m.status().message().find("manifest repeats key 'files'"), std::string::npos) << m.status().ToString();
  m = ParseManifest(AsBytes(with("{", R"("model":"acme/other",)")));
  EXPECT_NE(m.status().message().find("manifest repeats key 'model'"), std::string::npos) << m.status().ToString();
  m = ParseManifest(AsBytes(with(R"({"chunks":)", R"([],"chunks":)")));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("file entry repeats key 'chunks'"), std::string::npos) << m.status().ToString();
  m = ParseManifest(AsBytes(with("{", R"("x":1,"x":[2],)")));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
}

// ---------------------------------------------------------------------------------------------
// Names.

TEST(ManifestNameTest, ModelNames) {
  for (const char* ok : {"a", "acme/qwen", "org/sub/name", "A-Z_0.9", "..a", "a..", ".hidden", "a/.b"}) {
    EXPECT_TRUE(ValidateModelName(ok).ok()) << ok << ": " << ValidateModelName(ok).ToString();
  }
  EXPECT_TRUE(ValidateModelName(std::string(256, 'm')).ok());
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("'" + bad + "'");
    Status s = ValidateModelName(bad);
    EXPECT_EQ(s.kind(), ErrorKind::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find("model name"), std::string::npos) << s.ToString();
  }
  EXPECT_NE(ValidateModelName("").message().find("is empty"), std::string::npos);
  EXPECT_NE(ValidateModelName("a//b").message().find("empty, '.' or '..' component"), std::string::npos);
  EXPECT_NE(ValidateModelName("a b").message().find("character outside [A-Za-z0-9._-]"), std::string::npos);
  EXPECT_NE(ValidateModelName(std::string(257, 'm')).message().find("longer than 256 bytes"), std::string::npos);
  EXPECT_FALSE(ValidateModelName("a@b").ok());
  EXPECT_FALSE(ValidateModelName("a=b").ok());
}

TEST(ManifestNameTest, VersionNames) {
  for (const char* ok : {"v", "step-1", "base", "2026.12.02_run-3", "..v"}) {
    EXPECT_TRUE(ValidateVersionName(ok).ok()) << ok;
  }
  EXPECT_TRUE(ValidateVersionName(std::string(128, 'v')).ok());
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("'" + bad + "'");
    EXPECT_EQ(ValidateVersionName(bad).kind(), ErrorKind::kInvalidArgument);
  }
  for (const char* bad : {"a/b", "a@b", "latest/..", "v+1"}) {
    EXPECT_EQ(ValidateVersionName(bad).kind(), ErrorKind::kInvalidArgument) << bad;
  }
  EXPECT_NE(ValidateVersionName(std::string(129, 'v')).message().find("longer than 128 bytes"), std::string::npos);
}

TEST(ManifestNameTest, FilePaths) {
  for (const char* ok : {"model.safetensors", "a@b=c+d", "dir/sub/file-00001-of-00002.bin", "x", ".gitattributes"}) {
    EXPECT_TRUE(ValidateFilePath(ok).ok()) << ok;
  }
  // 1024 bytes in all, but no component over NAME_MAX (255): a longer one could not be pulled
  // to a local file system or looked up on the mount.
  const std::string c255(255, 'p');
  EXPECT_TRUE(ValidateFilePath(c255 + "/" + c255 + "/" + c255 + "/" + std::string(1024 - 3 * 256 - 1, 'p')).ok());
  EXPECT_NE(ValidateFilePath(std::string(256, 'p')).message().find("longer than 255 bytes"), std::string::npos);
  for (const std::string& bad : EscapingNames()) {
    SCOPED_TRACE("'" + bad + "'");
    Status s = ValidateFilePath(bad);
    EXPECT_EQ(s.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(s.message().find("file path"), std::string::npos) << s.ToString();
  }
  EXPECT_NE(ValidateFilePath("a b").message().find("[A-Za-z0-9._-@=+]"), std::string::npos);
  EXPECT_NE(ValidateFilePath(std::string(1025, 'p')).message().find("longer than 1024 bytes"), std::string::npos);
}

TEST(ManifestNameTest, ParseVersionRef) {
  Expected<VersionRef> r = ParseVersionRef("acme/qwen@step-1", true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "acme/qwen");
  EXPECT_EQ(r->version, "step-1");

  r = ParseVersionRef("org/sub/name@v", true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "org/sub/name");
  EXPECT_EQ(r->version, "v");

  r = ParseVersionRef("noversion", true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(r.status().message().find("'noversion' names no version; write MODEL@VERSION"), std::string::npos);

  r = ParseVersionRef("noversion", false);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->model, "noversion");
  EXPECT_EQ(r->version, "");

  // Split at the last '@': the model "a@b" is then invalid.
  r = ParseVersionRef("a@b@c", true);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(r.status().message().find("model name 'a@b'"), std::string::npos) << r.status().ToString();

  for (const char* bad : {"", "@", "@v", "m@", "../m@v", "m@../v", "m@v/w", "/m@v", "m@v ", "m@\xc3\xa9"}) {
    for (bool required : {true, false}) {
      SCOPED_TRACE(std::string(bad) + (required ? " required" : " optional"));
      r = ParseVersionRef(bad, required);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().kind(), ErrorKind::kInvalidArgument);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Times.

TEST(UtcTimeTest, FormatsRfc3339WithMilliseconds) {
  EXPECT_EQ(FormatUtc(0), "1970-01-01T00:00:00.000Z");
  EXPECT_EQ(FormatUtc(1796216400123), "2026-12-02T13:00:00.123Z");
  EXPECT_EQ(FormatUtc(1709251199999), "2024-02-29T23:59:59.999Z");
  EXPECT_EQ(FormatUtc(946684800001), "2000-01-01T00:00:00.001Z");
  EXPECT_EQ(FormatUtc(253402300799999), "9999-12-31T23:59:59.999Z");
  // Before 1970 the milliseconds still count forward within the second.
  EXPECT_EQ(FormatUtc(-1), "1969-12-31T23:59:59.999Z");
  EXPECT_EQ(FormatUtc(-500), "1969-12-31T23:59:59.500Z");
  EXPECT_EQ(FormatUtc(-1000), "1969-12-31T23:59:59.000Z");
  EXPECT_EQ(FormatUtc(-1001), "1969-12-31T23:59:58.999Z");
}

TEST(UtcTimeTest, RoundTrips) {
  for (int64_t ms : {int64_t{0}, int64_t{1}, int64_t{999}, int64_t{1000}, int64_t{1796216400123},
                     int64_t{1709251199999}, int64_t{951782400000} /* 2000-02-29 */,
                     int64_t{253402300799999}, int64_t{-1}, int64_t{-1001}, int64_t{-86400000}}) {
    SCOPED_TRACE(ms);
    const std::string text = FormatUtc(ms);
    Expected<int64_t> back = ParseUtc(text);
    ASSERT_TRUE(back.ok()) << text << ": " << back.status().ToString();
    EXPECT_EQ(*back, ms) << text;
  }
}

TEST(UtcTimeTest, ParsesWithoutOrWithAnyFraction) {
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00Z").value(), 1796216400000);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00.5Z").value(), 1796216400500);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00.12Z").value(), 1796216400120);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00.123Z").value(), 1796216400123);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00.1239999999999999999999Z").value(), 1796216400123);
  EXPECT_EQ(ParseUtc("1970-01-01T00:00:00Z").value(), 0);
  EXPECT_EQ(ParseUtc("2024-02-29T00:00:00Z").value(), 1709164800000);
  EXPECT_EQ(ParseUtc("2000-02-29T00:00:00Z").value(), 951782400000);
  // A leap second is what RFC 3339 allows; it counts as the next minute's first second.
  EXPECT_EQ(ParseUtc("2016-12-31T23:59:60Z").value(), ParseUtc("2017-01-01T00:00:00Z").value());
}

TEST(UtcTimeTest, RejectsGarbage) {
  for (std::string_view bad :
       {"", "Z", "garbage", "yesterday", "2026-12-02", "2026-12-02T13:00:00", "2026-12-02T13:00:00.Z",
        "2026-12-02T13:00:00.123", "2026-12-02T13:00:00+00:00", "2026-12-02T13:00:00.123+01:00",
        "2026-12-02T13:00:00.123Z ", "2026-12-02T13:00:00ZZ", "2026-12-02 13:00:00Z",
        "2026-12-02t13:00:00Z", "2026-12-02T13:00:00z", "2026-12-02T13:00:00.-1Z",
        "2026-12-02T13:00:00.1a3Z", "+2026-12-02T13:00:00Z", "-2026-12-02T13:00:00Z",
        // Out of range fields.
        "2026-13-02T13:00:00Z", "2026-00-02T13:00:00Z", "2026-12-00T13:00:00Z", "2026-12-32T13:00:00Z",
        "2026-02-29T00:00:00Z", "2026-02-31T00:00:00Z", "1900-02-29T00:00:00Z", "2026-04-31T00:00:00Z",
        "2026-12-02T24:00:00Z", "2026-12-02T13:60:00Z", "2026-12-02T13:00:61Z",
        // Not the fixed-width form: spaces, one-digit fields, short or long years.
        " 2026-12-02T13:00:00Z", "2026-12-02T 13:00:00Z", "2026-1-2T3:4:5Z", "26-12-02T13:00:00Z",
        "02026-12-02T13:00:00Z", "2026-12-02T13:00:0Z", "2026-12-02T13:00:00.\0Z"}) {
    SCOPED_TRACE(std::string(bad));
    Expected<int64_t> r = ParseUtc(bad);
    ASSERT_FALSE(r.ok()) << "accepted as " << *r;
    EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption);
    EXPECT_NE(r.status().message().find("is not an RFC 3339 UTC time"), std::string::npos);
  }
  // A NUL inside the string must not end it early.
  const std::string with_nul("2026-12-02T13:00:00Z\0junk", 25);
  EXPECT_FALSE(ParseUtc(with_nul).ok());
}

TEST(UtcTimeTest, AnyOffsetTakesOffsetsAndNoZoneAndStillRejectsGarbage) {
  const int64_t t = 1796216400000;  // 2026-12-02T13:00:00Z
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00Z", UtcForm::kAnyOffset).value(), t);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00", UtcForm::kAnyOffset).value(), t);
  EXPECT_EQ(ParseUtc("2026-12-02T14:30:00+01:30", UtcForm::kAnyOffset).value(), t);
  EXPECT_EQ(ParseUtc("2026-12-02T08:00:00.250-05:00", UtcForm::kAnyOffset).value(), t + 250);
  EXPECT_EQ(ParseUtc("2026-12-02T13:00:00+00:00", UtcForm::kAnyOffset).value(), t);
  for (std::string_view bad : {"2026-12-02T13:00:00+1:00", "2026-12-02T13:00:00+01:60", "2026-12-02T13:00:00+24:00",
                               "2026-12-02T13:00:00+0100", "2026-12-02T13:00:00 PST", "2026-12-02T13:00:0",
                               "2026-12-02T13:00:00.", "2026-02-30T13:00:00", "2026-12-02T13:00:00+01:00Z"}) {
    SCOPED_TRACE(std::string(bad));
    EXPECT_FALSE(ParseUtc(bad, UtcForm::kAnyOffset).ok());
  }
}

// ---------------------------------------------------------------------------------------------
// Keyframe policy.

ManifestChunk Parent(uint32_t depth, uint64_t chain_bytes, uint64_t keyframe_bytes) {
  ManifestChunk c;
  c.depth = depth;
  c.chain_bytes = chain_bytes;
  c.keyframe_bytes = keyframe_bytes;
  return c;
}

TEST(KeyframePolicyTest, DepthLimit) {
  KeyframePolicy p;
  p.max_depth = 4;
  p.max_chain_ratio = 1e9;  // only depth matters here
  EXPECT_FALSE(p.NeedsKeyframe(Parent(0, 0, 1000), 10));  // first delta after a keyframe
  EXPECT_FALSE(p.NeedsKeyframe(Parent(3, 30, 1000), 10));  // becomes depth 4 == max
  EXPECT_TRUE(p.NeedsKeyframe(Parent(4, 40, 1000), 10));   // would be depth 5
  EXPECT_TRUE(p.NeedsKeyframe(Parent(100, 40, 1000), 10));
  p.max_depth = 0;  // deltas disabled
  EXPECT_TRUE(p.NeedsKeyframe(Parent(0, 0, 1000), 1));
  KeyframePolicy defaults;
  EXPECT_EQ(defaults.max_depth, 64u);
  EXPECT_FALSE(defaults.NeedsKeyframe(Parent(63, 0, 1000), 1));
  EXPECT_TRUE(defaults.NeedsKeyframe(Parent(64, 0, 1000), 1));
}

TEST(KeyframePolicyTest, ChainRatio) {
  KeyframePolicy p;  // ratio 1.0: a chain may hold as many bytes as its keyframe, not more
  EXPECT_FALSE(p.NeedsKeyframe(Parent(1, 400, 1000), 600));
  EXPECT_TRUE(p.NeedsKeyframe(Parent(1, 400, 1000), 601));
  EXPECT_FALSE(p.NeedsKeyframe(Parent(0, 0, 1000), 1000));
  EXPECT_TRUE(p.NeedsKeyframe(Parent(0, 0, 1000), 1001));
  p.max_chain_ratio = 0.5;
  EXPECT_FALSE(p.NeedsKeyframe(Parent(0, 0, 1000), 500));
  EXPECT_TRUE(p.NeedsKeyframe(Parent(0, 0, 1000), 501));
  p.max_chain_ratio = 2.5;
  EXPECT_FALSE(p.NeedsKeyframe(Parent(7, 2000, 1000), 500));
  EXPECT_TRUE(p.NeedsKeyframe(Parent(7, 2000, 1000), 501));
  p.max_chain_ratio = 0;  // every change is a keyframe
  EXPECT_TRUE(p.NeedsKeyframe(Parent(0, 0, 1000), 1));
  // A keyframe of unknown size (0) admits no delta.
  EXPECT_TRUE(KeyframePolicy{}.NeedsKeyframe(Parent(0, 0, 0), 1));
  // The largest chain the manifest reader accepts does not wrap the sum around.
  p.max_chain_ratio = 1.0;
  EXPECT_TRUE(p.NeedsKeyframe(Parent(1, uint64_t{kMaxDepth} * kMaxPayload, kMaxPayload), kMaxPayload));
}

}  // namespace
}  // namespace weightfs
