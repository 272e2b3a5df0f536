#include "core/file_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "tests/testing/safetensors_builder.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::Bf16;

constexpr uint64_t kChunkBytes = 16 << 10;

using test::TensorSpec;

// A synthetic checkpoint: named tensors with plausible contents, kept by name so that versions
// can change, add or reorder tensors and be rebuilt into safetensors bytes.
struct Model {
  std::vector<TensorInfo> tensors;  // in file order
  std::map<std::string, std::vector<uint8_t>> data;
  std::map<std::string, std::string> metadata;

  void Add(std::string name, DType dtype, std::vector<uint64_t> shape, uint64_t seed) {
    TensorInfo t = TensorSpec(name, dtype, std::move(shape));
    uint64_t elems = 1;
    for (uint64_t d : t.shape) elems *= d;
    std::vector<uint8_t> bytes(elems * DTypeSize(dtype));
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (uint64_t i = 0; i < elems; ++i) {
      uint8_t* p = bytes.data() + i * DTypeSize(dtype);
      switch (dtype) {
        case DType::kBF16: {
          const uint16_t v = Bf16(normal(rng));
          std::memcpy(p, &v, 2);
          break;
        }
        case DType::kF32: {
          const float v = normal(rng);
          std::memcpy(p, &v, 4);
          break;
        }
        case DType::kI64: {
          const int64_t v = static_cast<int64_t>(rng() % 50000);
          std::memcpy(p, &v, 8);
          break;
        }
        default:
          for (size_t k = 0; k < DTypeSize(dtype); ++k) p[k] = static_cast<uint8_t>(rng() & 1);
      }
    }
    tensors.push_back(std::move(t));
    data[name] = std::move(bytes);
  }

  std::vector<uint8_t> Bytes() const {
    test::SafetensorsBuilder b;
    for (const TensorInfo& t : tensors) b.Add(t.name, t.dtype, t.shape, data.at(t.name));
    return b.Metadata(metadata).Build();
  }

  // Moves `fraction` of the bf16 elements of `name` by one ulp.
  void NudgeBf16(const std::string& name, double fraction, uint64_t seed) {
    std::vector<uint8_t>& d = data.at(name);
    std::mt19937_64 rng(seed);
    const size_t n = d.size() / 2;
    const auto changes = static_cast<size_t>(std::ceil(static_cast<double>(n) * fraction));
    for (size_t k = 0; k < changes; ++k) {
      const size_t i = rng() % n;
      uint16_t v;
      std::memcpy(&v, d.data() + 2 * i, 2);
      v = static_cast<uint16_t>((rng() & 1) ? v + 1 : v - 1);
      std::memcpy(d.data() + 2 * i, &v, 2);
    }
  }
};

Model BaseModel() {
  Model m;
  m.metadata = {{"format", "pt"}};
  m.Add("model.embed_tokens.weight", DType::kBF16, {512, 64}, 1);  // 64 KiB: 4 chunks
  m.Add("model.layers.0.mlp.weight", DType::kF32, {64, 100}, 2);   // 25 KiB: 2 chunks
  m.Add("model.layers.0.norm.weight", DType::kBF16, {64}, 3);
  m.Add("position_ids", DType::kI64, {1, 300}, 4);
  m.Add("mask", DType::kBool, {33}, 5);
  m.Add("empty", DType::kBF16, {0, 8}, 6);
  return m;
}

// Keeps every payload the encoder emits; thread-safe, as the sink contract requires.
class PayloadStore {
 public:
  PayloadSink Sink() {
    return [this](size_t i, std::span<const uint8_t> payload) {
      std::lock_guard<std::mutex> lock(mu_);
      ++calls_[i];
      payloads_[i].assign(payload.begin(), payload.end());
    };
  }
  PayloadSource Source() {
    return [this](size_t i) -> Expected<std::span<const uint8_t>> {
      auto it = payloads_.find(i);
      if (it == payloads_.end()) return Status::NotFound("no payload for chunk " + std::to_string(i));
      return std::span<const uint8_t>(it->second);
    };
  }
  std::map<size_t, std::vector<uint8_t>>& payloads() { return payloads_; }
  const std::map<size_t, std::vector<uint8_t>>& payloads() const { return payloads_; }
  const std::map<size_t, int>& calls() const { return calls_; }

 private:
  std::mutex mu_;
  std::map<size_t, int> calls_;
  std::map<size_t, std::vector<uint8_t>> payloads_;
};

struct Encoded {
  EncodedFile file;
  PayloadStore store;
};

void EncodeInto(ThreadPool& pool, std::span<const uint8_t> file, std::span<const uint8_t> parent,
                Encoded* out) {
  FileEncoder encoder(&pool, {}, kChunkBytes);
  out->file = encoder.Encode(file, parent, out->store.Sink());
}

// What the encoder promises about its result, whatever the input.
void ExpectConsistent(const Encoded& e, std::span<const uint8_t> file) {
  const ChunkPlan plan = PlanFile(file, file.size(), kChunkBytes);
  ASSERT_EQ(e.file.plan.chunks.size(), plan.chunks.size());
  ASSERT_EQ(e.file.chunks.size(), plan.chunks.size());
  uint64_t payload_bytes = 0;
  for (size_t i = 0; i < e.file.chunks.size(); ++i) {
    const EncodedChunk& c = e.file.chunks[i];
    SCOPED_TRACE(DescribeChunk(c.spec.key));
    EXPECT_EQ(c.spec.key, plan.chunks[i].key);
    EXPECT_EQ(c.spec.offset, plan.chunks[i].offset);
    EXPECT_EQ(c.hash, HashChunk(file.subspan(c.spec.offset, c.spec.length)));
    const auto calls = e.store.calls().find(i);
    if (c.encoding == ChunkEncoding::kSame) {
      EXPECT_EQ(c.payload_bytes, 0u);
      EXPECT_TRUE(c.parent.has_value());
      EXPECT_EQ(calls, e.store.calls().end()) << "sink called for a same-as-parent chunk";
    } else {
      ASSERT_NE(calls, e.store.calls().end()) << "no payload for a stored chunk";
      EXPECT_EQ(calls->second, 1) << "sink called more than once for one chunk";
      EXPECT_EQ(c.payload_bytes, e.store.payloads().at(i).size());
      payload_bytes += c.payload_bytes;
    }
    if (c.encoding == ChunkEncoding::kSparse || c.encoding == ChunkEncoding::kDense ||
        c.encoding == ChunkEncoding::kPatch) {
      EXPECT_TRUE(c.parent.has_value());
    }
  }
  EXPECT_EQ(e.file.payload_bytes(), payload_bytes);
}

void ExpectDecodes(ThreadPool& pool, Encoded& e, std::span<const uint8_t> parent,
                   const std::vector<uint8_t>& want) {
  FileDecoder decoder(&pool);
  std::vector<uint8_t> out(want.size(), 0xEE);
  Status s = decoder.Decode(e.file, e.store.Source(), parent, out);
  ASSERT_TRUE(s.ok()) << s.ToString();
  EXPECT_TRUE(out == want) << "decoded file differs";
}

class FileCodecTest : public ::testing::TestWithParam<size_t> {
 protected:
  ThreadPool pool_{GetParam()};
};

INSTANTIATE_TEST_SUITE_P(Threads, FileCodecTest, ::testing::Values(1, 4),
                         [](const auto& info) { return std::to_string(info.param) + "threads"; });

TEST_P(FileCodecTest, RoundTripWithoutParent) {
  const std::vector<uint8_t> file = BaseModel().Bytes();
  Encoded e;
  EncodeInto(pool_, file, {}, &e);
  ExpectConsistent(e, file);
  EXPECT_TRUE(e.file.plan.safetensors);
  for (const EncodedChunk& c : e.file.chunks) {
    EXPECT_TRUE(c.encoding == ChunkEncoding::kFull || c.encoding == ChunkEncoding::kRaw)
        << DescribeChunk(c.spec.key) << ": " << ChunkEncodingName(c.encoding);
    EXPECT_FALSE(c.parent.has_value());
  }
  EXPECT_EQ(e.store.calls().size(), e.file.chunks.size());
  EXPECT_LT(e.file.payload_bytes(), file.size());
  ExpectDecodes(pool_, e, {}, file);
}

TEST_P(FileCodecTest, RoundTripWithParent) {
  Model m = BaseModel();
  const std::vector<uint8_t> v1 = m.Bytes();
  m.NudgeBf16("model.embed_tokens.weight", 0.002, 7);
  const std::vector<uint8_t> v2 = m.Bytes();
  ASSERT_EQ(v1.size(), v2.size());

  Encoded e;
  EncodeInto(pool_, v2, v1, &e);
  ExpectConsistent(e, v2);
  for (const EncodedChunk& c : e.file.chunks) {
    SCOPED_TRACE(DescribeChunk(c.spec.key));
    ASSERT_TRUE(c.parent.has_value());
    EXPECT_EQ(c.parent->key, c.spec.key);
    EXPECT_EQ(c.parent->offset, c.spec.offset);
    if (c.spec.key.tensor == "model.embed_tokens.weight") {
      EXPECT_EQ(c.encoding, ChunkEncoding::kSparse);
    } else {
      EXPECT_EQ(c.encoding, ChunkEncoding::kSame);
    }
  }
  EXPECT_EQ(e.store.calls().size(), e.file.count(ChunkEncoding::kSparse));
  EXPECT_LT(e.file.payload_bytes(), 1000u);
  ExpectDecodes(pool_, e, v1, v2);
}

TEST_P(FileCodecTest, IdenticalFileStoresNothing) {
  const std::vector<uint8_t> file = BaseModel().Bytes();
  Encoded e;
  EncodeInto(pool_, file, file, &e);
  ExpectConsistent(e, file);
  EXPECT_EQ(e.file.count(ChunkEncoding::kSame), e.file.chunks.size());
  EXPECT_EQ(e.file.payload_bytes(), 0u);
  EXPECT_TRUE(e.store.calls().empty());
  ExpectDecodes(pool_, e, file, file);
}

// A tensor inserted at the front grows the header and shifts every data offset: chunks still
// pair with their parents by key, so unchanged tensors cost nothing and nudged ones stay sparse.
TEST_P(FileCodecTest, HeaderChangeStillPairsChunksByKey) {
  Model m = BaseModel();
  const std::vector<uint8_t> v1 = m.Bytes();
  Model m2 = m;
  m2.NudgeBf16("model.embed_tokens.weight", 0.001, 8);
  Model added;
  added.Add("lm_head.bias", DType::kBF16, {1000}, 9);
  m2.tensors.insert(m2.tensors.begin(), added.tensors[0]);
  m2.data["lm_head.bias"] = added.data["lm_head.bias"];
  m2.metadata["step"] = "300";
  const std::vector<uint8_t> v2 = m2.Bytes();

  Encoded e;
  EncodeInto(pool_, v2, v1, &e);
  ExpectConsistent(e, v2);
  size_t shifted = 0;
  for (const EncodedChunk& c : e.file.chunks) {
    SCOPED_TRACE(DescribeChunk(c.spec.key));
    if (c.spec.key.tensor == "lm_head.bias") {
      EXPECT_FALSE(c.parent.has_value());
      EXPECT_TRUE(c.encoding == ChunkEncoding::kFull || c.encoding == ChunkEncoding::kRaw);
      continue;
    }
    ASSERT_TRUE(c.parent.has_value());
    EXPECT_EQ(c.parent->key, c.spec.key);
    shifted += c.parent->offset != c.spec.offset;
    if (c.spec.role == ChunkRole::kHeader) {
      EXPECT_EQ(c.encoding, ChunkEncoding::kPatch);
    } else if (c.spec.key.tensor == "model.embed_tokens.weight") {
      EXPECT_EQ(c.encoding, ChunkEncoding::kSparse);
    } else {
      EXPECT_EQ(c.encoding, ChunkEncoding::kSame);
    }
  }
  EXPECT_EQ(shifted, e.file.chunks.size() - 2) << "all but the header and the new tensor moved";
  ExpectDecodes(pool_, e, v1, v2);
}

TEST_P(FileCodecTest, OpaqueFileRoundTrip) {
  std::mt19937_64 rng(10);
  std::vector<uint8_t> v1(100'000);
  for (size_t i = 0; i < v1.size(); ++i) {
    v1[i] = static_cast<uint8_t>("weightfs opaque bytes "[i % 22] ^ ((rng() % 16 == 0) ? rng() : 0));
  }
  std::vector<uint8_t> v2 = v1;
  for (int k = 0; k < 20; ++k) v2[rng() % v2.size()] ^= 0x40;
  v2.insert(v2.end(), v1.begin(), v1.begin() + 5000);  // grows: the last chunk changes length

  Encoded full;
  EncodeInto(pool_, v1, {}, &full);
  ExpectConsistent(full, v1);
  EXPECT_FALSE(full.file.plan.safetensors);
  for (const EncodedChunk& c : full.file.chunks) {
    EXPECT_EQ(c.spec.role, ChunkRole::kOpaque);
    EXPECT_EQ(c.spec.key.tensor, "");
  }
  ExpectDecodes(pool_, full, {}, v1);

  Encoded delta;
  EncodeInto(pool_, v2, v1, &delta);
  ExpectConsistent(delta, v2);
  EXPECT_LT(delta.file.payload_bytes(), full.file.payload_bytes() / 4);
  ExpectDecodes(pool_, delta, v1, v2);
}

TEST_P(FileCodecTest, EmptyFileRoundTrip) {
  Encoded e;
  EncodeInto(pool_, {}, {}, &e);
  EXPECT_TRUE(e.file.chunks.empty());
  ExpectDecodes(pool_, e, {}, {});
}

TEST_P(FileCodecTest, CorruptedPayloadFailsNamingTheChunk) {
  Model m = BaseModel();
  const std::vector<uint8_t> v1 = m.Bytes();
  m.NudgeBf16("model.embed_tokens.weight", 0.01, 11);
  const std::vector<uint8_t> v2 = m.Bytes();
  Encoded e;
  EncodeInto(pool_, v2, v1, &e);
  size_t victim = e.file.chunks.size();
  for (size_t i = 0; i < e.file.chunks.size(); ++i) {
    if (e.file.chunks[i].spec.key == ChunkKey{"model.embed_tokens.weight", 2}) victim = i;
  }
  ASSERT_LT(victim, e.file.chunks.size());
  ASSERT_NE(e.file.chunks[victim].encoding, ChunkEncoding::kSame);
  std::vector<uint8_t>& payload = e.store.payloads().at(victim);
  // The middle of the range-coded stream (its last bytes are flush padding a decoder may not need).
  payload[kPayloadHeaderBytes + (payload.size() - kPayloadHeaderBytes) / 2] ^= 0x10;

  FileDecoder decoder(&pool_);
  std::vector<uint8_t> out(v2.size());
  Status s = decoder.Decode(e.file, e.store.Source(), v1, out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.kind(), ErrorKind::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("tensor 'model.embed_tokens.weight' chunk 2"), std::string::npos)
      << s.ToString();
}

TEST_P(FileCodecTest, WrongParentFileFailsAsCorruption) {
  Model m = BaseModel();
  const std::vector<uint8_t> v1 = m.Bytes();
  m.NudgeBf16("model.embed_tokens.weight", 0.01, 12);
  const std::vector<uint8_t> v2 = m.Bytes();
  Encoded e;
  EncodeInto(pool_, v2, v1, &e);
  std::vector<uint8_t> other_parent = v1;
  other_parent[e.file.chunks[1].spec.offset + 10] ^= 1;  // first chunk of the embedding
  FileDecoder decoder(&pool_);
  std::vector<uint8_t> out(v2.size());
  Status s = decoder.Decode(e.file, e.store.Source(), other_parent, out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.kind(), ErrorKind::kCorruption) << s.ToString();
  EXPECT_NE(s.message().find("tensor 'model.embed_tokens.weight' chunk 0"), std::string::npos)
      << s.ToString();
}

TEST_P(FileCodecTest, MissingPayloadPropagates) {
  const std::vector<uint8_t> file = BaseModel().Bytes();
  Encoded e;
  EncodeInto(pool_, file, {}, &e);
  const size_t victim = e.file.chunks.size() - 1;
  PayloadSource inner = e.store.Source();
  PayloadSource failing = [&](size_t i) -> Expected<std::span<const uint8_t>> {
    if (i == victim) return Status::IOError("pack packs/abc unreadable");
    return inner(i);
  };
  FileDecoder decoder(&pool_);
  std::vector<uint8_t> out(file.size());
  Status s = decoder.Decode(e.file, failing, {}, out);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.kind(), ErrorKind::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("pack packs/abc unreadable"), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(DescribeChunk(e.file.chunks[victim].spec.key)), std::string::npos)
      << s.ToString();
}

TEST_P(FileCodecTest, WrongOutputSizeIsInvalidArgument) {
  const std::vector<uint8_t> file = BaseModel().Bytes();
  Encoded e;
  EncodeInto(pool_, file, {}, &e);
  FileDecoder decoder(&pool_);
  std::vector<uint8_t> out(file.size() + 1);
  Status s = decoder.Decode(e.file, e.store.Source(), {}, out);
  EXPECT_EQ(s.kind(), ErrorKind::kInvalidArgument) << s.ToString();
}

// Parallelism must not change the result: same encodings, hashes and payload bytes.
TEST(FileCodecDeterminismTest, OneAndFourThreadsProduceTheSamePayloads) {
  Model m = BaseModel();
  const std::vector<uint8_t> v1 = m.Bytes();
  m.NudgeBf16("model.embed_tokens.weight", 0.05, 13);
  const std::vector<uint8_t> v2 = m.Bytes();
  ThreadPool one(1), four(4);
  Encoded a, b;
  EncodeInto(one, v2, v1, &a);
  EncodeInto(four, v2, v1, &b);
  ASSERT_EQ(a.file.chunks.size(), b.file.chunks.size());
  for (size_t i = 0; i < a.file.chunks.size(); ++i) {
    EXPECT_EQ(a.file.chunks[i].encoding, b.file.chunks[i].encoding);
    EXPECT_EQ(a.file.chunks[i].hash, b.file.chunks[i].hash);
  }
  EXPECT_EQ(a.store.payloads(), b.store.payloads());
}

TEST(FileCodecDescribeTest, DescribeChunkNamesTheChunk) {
  EXPECT_EQ(DescribeChunk({kHeaderChunkName, 0}), "header chunk");
  EXPECT_EQ(DescribeChunk({"", 7}), "bytes chunk 7");
  EXPECT_EQ(DescribeChunk({"model.embed_tokens.weight", 3}),
            "tensor 'model.embed_tokens.weight' chunk 3");
}

}  // namespace
}  // namespace weightfs
