#include "core/chunk_plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "tests/testing/safetensors_builder.h"

namespace weightfs {
namespace {

using test::TensorSpec;


// A safetensors file from the test kit's builder (its data section a byte pattern; the plan
// only looks at sizes), and its parsed header.
struct File {
  std::vector<uint8_t> bytes;
  SafetensorsHeader header;
};

File MakeFile(const std::vector<TensorInfo>& tensors, const std::map<std::string, std::string>& metadata = {}) {
  File f;
  f.bytes = test::SafetensorsBuilder().Add(tensors).Metadata(metadata).Build();
  auto parsed = ParseSafetensorsHeader(f.bytes, f.bytes.size());
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  if (parsed.ok()) f.header = *parsed;
  return f;
}

// The invariants every plan promises: chunks in file order tile [0, file_size) exactly; keys are
// unique; tensor chunks hold whole elements of at most max(chunk_bytes, element) bytes.
void ExpectWellFormed(const ChunkPlan& plan, uint64_t chunk_bytes) {
  uint64_t cursor = 0;
  std::map<ChunkKey, int> keys;
  for (const ChunkSpec& c : plan.chunks) {
    SCOPED_TRACE(c.key.tensor + "#" + std::to_string(c.key.index));
    EXPECT_EQ(c.offset, cursor) << "gap or overlap";
    EXPECT_GT(c.length, 0u) << "empty chunk";
    cursor = c.offset + c.length;
    EXPECT_EQ(++keys[c.key], 1) << "duplicate key";
    if (c.role == ChunkRole::kTensor) {
      const uint64_t elem = DTypeSize(c.dtype);
      EXPECT_EQ(c.length % elem, 0u);
      EXPECT_LE(c.length, std::max<uint64_t>(elem, std::min(chunk_bytes, kMaxChunkBytes)));
    } else {
      EXPECT_EQ(c.dtype, DType::kOpaque);
    }
  }
  EXPECT_EQ(cursor, plan.file_size);
}

TEST(ChunkPlanTest, HeaderChunkThenElementAlignedTensorChunks) {
  File f = MakeFile({TensorSpec("a", DType::kBF16, {1000}), TensorSpec("b", DType::kF32, {3, 333}),
                     TensorSpec("c", DType::kI64, {7}), TensorSpec("d", DType::kU8, {5})});
  const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size(), 1000);
  ASSERT_TRUE(plan.safetensors);
  EXPECT_EQ(plan.file_size, f.bytes.size());
  ExpectWellFormed(plan, 1000);

  struct Want {
    const char* tensor;
    uint64_t index;
    ChunkRole role;
    DType dtype;
    uint64_t length;
  };
  const std::vector<Want> want = {
      {kHeaderChunkName, 0, ChunkRole::kHeader, DType::kOpaque, f.header.data_offset},
      {"a", 0, ChunkRole::kTensor, DType::kBF16, 1000},
      {"a", 1, ChunkRole::kTensor, DType::kBF16, 1000},
      {"b", 0, ChunkRole::kTensor, DType::kF32, 1000},
      {"b", 1, ChunkRole::kTensor, DType::kF32, 1000},
      {"b", 2, ChunkRole::kTensor, DType::kF32, 1000},
      {"b", 3, ChunkRole::kTensor, DType::kF32, 996},
      {"c", 0, ChunkRole::kTensor, DType::kI64, 56},
      {"d", 0, ChunkRole::kTensor, DType::kU8, 5},
  };
  ASSERT_EQ(plan.chunks.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("chunk " + std::to_string(i));
    EXPECT_EQ(plan.chunks[i].key, (ChunkKey{want[i].tensor, want[i].index}));
    EXPECT_EQ(plan.chunks[i].role, want[i].role);
    EXPECT_EQ(plan.chunks[i].dtype, want[i].dtype);
    EXPECT_EQ(plan.chunks[i].length, want[i].length);
  }
  EXPECT_EQ(plan.chunks[0].offset, 0u);
  EXPECT_EQ(plan.chunks[1].offset, f.header.data_offset);
}

TEST(ChunkPlanTest, ChunkSizeRoundsDownToWholeElements) {
  File f = MakeFile({TensorSpec("w", DType::kF64, {100})});  // 800 bytes
  const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size(), 100);  // 12.5 elements
  ExpectWellFormed(plan, 100);
  ASSERT_EQ(plan.chunks.size(), 1 + 9u);  // 8 chunks of 96 bytes, one of 32
  for (size_t i = 1; i < 9; ++i) EXPECT_EQ(plan.chunks[i].length, 96u);
  EXPECT_EQ(plan.chunks[9].length, 32u);
}

TEST(ChunkPlanTest, ChunksTileRandomFilesExactly) {
  std::mt19937_64 rng(3);
  const DType dtypes[] = {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3,
                          DType::kI64, DType::kI32, DType::kI16, DType::kU8,   DType::kBool};
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<TensorInfo> tensors;
    const int count = static_cast<int>(rng() % 8);
    for (int t = 0; t < count; ++t) {
      std::vector<uint64_t> shape;
      const int rank = static_cast<int>(rng() % 3);
      for (int d = 0; d < rank; ++d) shape.push_back(rng() % 40);
      tensors.push_back(TensorSpec("t" + std::to_string(t), dtypes[rng() % std::size(dtypes)], shape));
    }
    File f = MakeFile(tensors);
    const uint64_t chunk_bytes = 1 + rng() % 300;
    SCOPED_TRACE("trial " + std::to_string(trial) + " chunk_bytes " + std::to_string(chunk_bytes));
    const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size(), chunk_bytes);
    ASSERT_TRUE(plan.safetensors);
    ExpectWellFormed(plan, chunk_bytes);
    // Each tensor's chunks are indexed 0, 1, ... and cover exactly its byte range.
    for (const TensorInfo& t : f.header.tensors) {
      uint64_t next_index = 0, covered = 0;
      for (const ChunkSpec& c : plan.chunks) {
        if (c.key.tensor != t.name) continue;
        EXPECT_EQ(c.key.index, next_index++);
        EXPECT_EQ(c.offset, f.header.data_offset + t.begin + covered);
        EXPECT_EQ(c.dtype, t.dtype);
        covered += c.length;
      }
      EXPECT_EQ(covered, t.size()) << t.name;
    }
  }
}

TEST(ChunkPlanTest, ZeroSizeTensorsProduceNoChunk) {
  File f = MakeFile({TensorSpec("empty0", DType::kBF16, {0}), TensorSpec("x", DType::kF32, {4}),
                     TensorSpec("empty1", DType::kF32, {3, 0, 5}), TensorSpec("scalar", DType::kI32, {})});
  const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size(), 1024);
  ExpectWellFormed(plan, 1024);
  ASSERT_EQ(plan.chunks.size(), 3u);
  EXPECT_EQ(plan.chunks[0].role, ChunkRole::kHeader);
  EXPECT_EQ(plan.chunks[1].key.tensor, "x");
  EXPECT_EQ(plan.chunks[2].key.tensor, "scalar");  // shape [] is one element
  EXPECT_EQ(plan.chunks[2].length, 4u);
  for (const ChunkSpec& c : plan.chunks) EXPECT_NE(c.key.tensor.rfind("empty", 0), 0u);
}

TEST(ChunkPlanTest, HeaderOnlyFileIsOneChunk) {
  File f = MakeFile({});
  const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size());
  ASSERT_TRUE(plan.safetensors);
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].length, f.bytes.size());
}

TEST(ChunkPlanTest, OpaqueFilesGetFixedSizeChunks) {
  std::vector<uint8_t> bytes(10, 'x');
  const ChunkPlan plan = PlanFile(bytes, bytes.size(), 4);
  EXPECT_FALSE(plan.safetensors);
  ExpectWellFormed(plan, 4);
  ASSERT_EQ(plan.chunks.size(), 3u);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(plan.chunks[i].key, (ChunkKey{"", i}));
    EXPECT_EQ(plan.chunks[i].role, ChunkRole::kOpaque);
    EXPECT_EQ(plan.chunks[i].dtype, DType::kOpaque);
    EXPECT_EQ(plan.chunks[i].offset, 4 * i);
  }
  EXPECT_EQ(plan.chunks[2].length, 2u);

  EXPECT_EQ(PlanChunks(std::nullopt, 12, 4).chunks.size(), 3u);  // exact multiple: no tail
  EXPECT_TRUE(PlanChunks(std::nullopt, 0, 4).chunks.empty());
  EXPECT_EQ(PlanChunks(std::nullopt, 0, 4).file_size, 0u);
}

TEST(ChunkPlanTest, ChunkBytesIsClamped) {
  // Below one element: one element per chunk (and one byte for opaque files), never zero.
  EXPECT_EQ(PlanChunks(std::nullopt, 5, 0).chunks.size(), 5u);
  File f = MakeFile({TensorSpec("w", DType::kF64, {3})});
  for (uint64_t tiny : {0, 1, 7}) {
    const ChunkPlan plan = PlanFile(f.bytes, f.bytes.size(), tiny);
    ExpectWellFormed(plan, tiny);
    ASSERT_EQ(plan.chunks.size(), 4u) << tiny;
    for (size_t i = 1; i < 4; ++i) EXPECT_EQ(plan.chunks[i].length, 8u);
  }

  // Above the maximum: kMaxChunkBytes (plans need sizes only, so nothing is allocated).
  const uint64_t big = 2 * kMaxChunkBytes + 1;
  const ChunkPlan opaque = PlanChunks(std::nullopt, big, ~0ull);
  ASSERT_EQ(opaque.chunks.size(), 3u);
  EXPECT_EQ(opaque.chunks[0].length, kMaxChunkBytes);
  EXPECT_EQ(opaque.chunks[2].length, 1u);

  test::SafetensorsBuilder file;
  file.Add("huge", DType::kBF16, {kMaxChunkBytes + 8});
  const std::vector<uint8_t> prefix = file.Header();
  auto header = ParseSafetensorsHeader(prefix, prefix.size() + file.Tensors()[0].end);
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  const ChunkPlan plan = PlanChunks(*header, header->file_size, 1ull << 40);
  ExpectWellFormed(plan, kMaxChunkBytes);
  ASSERT_EQ(plan.chunks.size(), 1 + 3u);
  EXPECT_EQ(plan.chunks[1].length, kMaxChunkBytes);
  EXPECT_EQ(plan.chunks[2].length, kMaxChunkBytes);
  EXPECT_EQ(plan.chunks[3].length, 16u);
}

TEST(ChunkPlanTest, DefaultChunkSizeIsFourMiB) {
  test::SafetensorsBuilder file;
  file.Add("w", DType::kBF16, {5u << 20});  // 10 MiB
  const std::vector<uint8_t> prefix = file.Header();
  auto header = ParseSafetensorsHeader(prefix, prefix.size() + file.Tensors()[0].end);
  ASSERT_TRUE(header.ok());
  const ChunkPlan plan = PlanChunks(*header, header->file_size);
  ASSERT_EQ(plan.chunks.size(), 1 + 3u);
  EXPECT_EQ(plan.chunks[1].length, kDefaultChunkBytes);
  EXPECT_EQ(plan.chunks[3].length, (10u << 20) - 2 * kDefaultChunkBytes);
}

TEST(ChunkPlanTest, NonSafetensorsFilesAreOpaque) {
  File good = MakeFile({TensorSpec("w", DType::kF32, {16})});

  std::vector<std::vector<uint8_t>> files;
  files.push_back({});                                   // empty
  files.push_back({1, 2, 3});                            // shorter than the length field
  files.push_back(std::vector<uint8_t>(100, 0));         // header length 0
  std::vector<uint8_t> text(200, 'a');                   // a huge little-endian length
  files.push_back(text);
  std::vector<uint8_t> truncated = good.bytes;           // data section cut short
  truncated.pop_back();
  files.push_back(truncated);
  std::vector<uint8_t> extended = good.bytes;            // data beyond the last tensor
  extended.push_back(0);
  files.push_back(extended);
  std::vector<uint8_t> bad_json = good.bytes;            // JSON broken
  bad_json[9] = '[';
  files.push_back(bad_json);

  for (size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE("file " + std::to_string(i));
    const ChunkPlan plan = PlanFile(files[i], files[i].size(), 64);
    EXPECT_FALSE(plan.safetensors);
    ExpectWellFormed(plan, 64);
    for (const ChunkSpec& c : plan.chunks) EXPECT_EQ(c.role, ChunkRole::kOpaque);
  }

  // A valid file seen through a prefix shorter than its header cannot be planned as safetensors.
  const ChunkPlan short_prefix =
      PlanFile(std::span<const uint8_t>(good.bytes).first(good.header.data_offset - 1),
               good.bytes.size(), 64);
  EXPECT_FALSE(short_prefix.safetensors);
  EXPECT_EQ(short_prefix.file_size, good.bytes.size());
  // ...and through exactly its header, it can.
  EXPECT_TRUE(PlanFile(std::span<const uint8_t>(good.bytes).first(good.header.data_offset),
                       good.bytes.size(), 64)
                  .safetensors);
}

// The chunk key is what pairs a chunk with its parent: a header that grows (metadata added, a
// tensor appended) shifts every data offset but must not change any existing key.
TEST(ChunkPlanTest, KeysStableWhenHeaderGrows) {
  const std::vector<TensorInfo> base = {TensorSpec("embed", DType::kBF16, {300, 7}),
                                        TensorSpec("norm", DType::kF32, {33}),
                                        TensorSpec("ids", DType::kI64, {10})};
  File v1 = MakeFile(base);
  std::vector<TensorInfo> grown = base;
  grown.push_back(TensorSpec("new.extra_tensor_with_a_long_name", DType::kF16, {64}));
  File v2 = MakeFile(grown, {{"format", "pt"}, {"note", std::string(500, 'n')}});
  ASSERT_GT(v2.header.data_offset, v1.header.data_offset);
  const uint64_t shift = v2.header.data_offset - v1.header.data_offset;

  const ChunkPlan p1 = PlanFile(v1.bytes, v1.bytes.size(), 256);
  const ChunkPlan p2 = PlanFile(v2.bytes, v2.bytes.size(), 256);
  ExpectWellFormed(p1, 256);
  ExpectWellFormed(p2, 256);
  ASSERT_GT(p2.chunks.size(), p1.chunks.size());
  for (size_t i = 0; i < p1.chunks.size(); ++i) {
    const ChunkSpec& a = p1.chunks[i];
    const ChunkSpec& b = p2.chunks[i];
    SCOPED_TRACE(a.key.tensor + "#" + std::to_string(a.key.index));
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.role, b.role);
    EXPECT_EQ(a.dtype, b.dtype);
    if (a.role == ChunkRole::kHeader) {
      EXPECT_EQ(b.length, a.length + shift);
    } else {
      EXPECT_EQ(b.offset, a.offset + shift);
      EXPECT_EQ(b.length, a.length);
    }
  }
  for (size_t i = p1.chunks.size(); i < p2.chunks.size(); ++i) {
    EXPECT_EQ(p2.chunks[i].key.tensor, "new.extra_tensor_with_a_long_name");
  }
}

}  // namespace
}  // namespace weightfs
