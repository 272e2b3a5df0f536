// TrlVersions (hub/trl/trl_bucket.h) over an in-memory store holding TRL delta-sync files built
// here: index decoding, the synthesized file of every step against a reference replay, chunk
// boundaries, overlaying anchors, step gaps, V1 key names, what listing reads, shared patch
// fetches under concurrency, and hostile files (each a Corruption naming file and tensor).
#include "hub/trl/trl_bucket.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "core/safetensors.h"
#include "hub/engine/bucket.h"
#include "hub/engine/materializer.h"
#include "hub/open_bucket.h"
#include "tests/testing/mem_store.h"
#include "tests/testing/safetensors_builder.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::RandomBytes;

// The bucket: an in-memory store that records the byte ranges it served.
using test::MemStore;

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> Safetensors(std::vector<Tensor> tensors, const std::map<std::string, std::string>& md) {
  test::SafetensorsBuilder b;
  for (Tensor& t : tensors) b.Add(t.name, t.dtype, t.shape, std::move(t.bytes));
  return b.Metadata(md).Build();
}

std::vector<uint8_t> U16s(const std::vector<uint64_t>& v) {
  std::vector<uint8_t> out;
  for (uint64_t x : v) {
    out.push_back(static_cast<uint8_t>(x));
    out.push_back(static_cast<uint8_t>(x >> 8));
  }
  return out;
}
std::vector<uint8_t> U32s(const std::vector<uint64_t>& v) {
  std::vector<uint8_t> out;
  for (uint64_t x : v) {
    for (int k = 0; k < 4; ++k) out.push_back(static_cast<uint8_t>(x >> (8 * k)));
  }
  return out;
}

std::map<std::string, std::string> Meta(uint64_t step, bool sparse, const std::string& encoding = "gap_delta") {
  std::map<std::string, std::string> md = {{"format", "sparse_weight_patch"}, {"version", "1"},
                                           {"sparse", sparse ? "True" : "False"},
                                           {"model_version", std::to_string(step)}};
  if (!encoding.empty()) md["encoding"] = encoding;
  return md;
}

std::string StepKey(bool anchor, uint64_t step) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s/step_%06llu.safetensors", anchor ? "anchors" : "deltas",
                static_cast<unsigned long long>(step));
  return buf;
}

// Gaps of sorted indices (TRL's gap_delta).
std::vector<uint64_t> Gaps(const std::vector<uint64_t>& idx) {
  std::vector<uint64_t> g;
  int64_t prev = -1;
  for (uint64_t i : idx) {
    g.push_back(static_cast<uint64_t>(static_cast<int64_t>(i) - prev - 1));
    prev = static_cast<int64_t>(i);
  }
  return g;
}

// Every byte of model.safetensors of MODEL@version, through the Materializer.
std::vector<uint8_t> ReadVersion(Bucket& bucket, const std::string& version, Status* status = nullptr) {
  Materializer mat(&bucket, nullptr);
  Expected<std::shared_ptr<const Manifest>> m = bucket.ReadManifest("run", version);
  if (!m.ok()) {
    if (status) *status = m.status();
    return {};
  }
  const ManifestFile& f = (*m)->files.at(0);
  std::vector<uint8_t> out;
  for (size_t i = 0; i < f.chunks.size(); ++i) {
    Expected<ByteBuffer> c = mat.Chunk(**m, f, i);
    if (!c.ok()) {
      if (status) *status = c.status();
      return {};
    }
    out.insert(out.end(), c->begin(), c->end());
  }
  if (status) *status = Status::Ok();
  return out;
}

// name -> (dtype, shape, bytes) of a safetensors file.
std::map<std::string, Tensor> Parse(const std::vector<uint8_t>& file) {
  std::map<std::string, Tensor> out;
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(file, file.size());
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  if (!h.ok()) return out;
  for (const TensorInfo& t : h->tensors) {
    out[t.name] = Tensor{t.name, t.dtype, t.shape,
                         std::vector<uint8_t>(file.begin() + static_cast<std::ptrdiff_t>(h->data_offset + t.begin),
                                              file.begin() + static_cast<std::ptrdiff_t>(h->data_offset + t.end))};
  }
  return out;
}

TEST(TrlIndicesTest, GapDeltaU16DecodesCumulativeGaps) {
  // indices 0, 3, 4, 70000 -> gaps 0, 2, 0, 69995 (needs U32); 0, 3, 4 -> U16.
  Expected<std::vector<uint64_t>> a = DecodeTrlIndices(U16s({0, 2, 0}), DType::kU16, "gap_delta", 5, "t");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(*a, (std::vector<uint64_t>{0, 3, 4}));
  Expected<std::vector<uint64_t>> b = DecodeTrlIndices(U32s({0, 2, 0, 69995}), DType::kU32, "gap_delta", 70001, "t");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(*b, (std::vector<uint64_t>{0, 3, 4, 70000}));
  Expected<std::vector<uint64_t>> first = DecodeTrlIndices(U16s({7}), DType::kU16, "gap_delta", 8, "t");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, (std::vector<uint64_t>{7}));
  Expected<std::vector<uint64_t>> empty = DecodeTrlIndices({}, DType::kU16, "gap_delta", 8, "t");
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

TEST(TrlIndicesTest, RawAndInferredEncodings) {
  Expected<std::vector<uint64_t>> raw = DecodeTrlIndices(U32s({1, 5, 9}), DType::kI32, "raw", 10, "t");
  ASSERT_TRUE(raw.ok()) << raw.status().ToString();
  EXPECT_EQ(*raw, (std::vector<uint64_t>{1, 5, 9}));
  // No encoding key (V1/V0): the dtype says.
  EXPECT_EQ(*DecodeTrlIndices(U32s({1, 5}), DType::kI32, "", 10, "t"), (std::vector<uint64_t>{1, 5}));
  EXPECT_EQ(*DecodeTrlIndices(U16s({1, 3}), DType::kU16, "", 10, "t"), (std::vector<uint64_t>{1, 5}));
}

TEST(TrlIndicesTest, HostileIndicesAreCorruptionNamingTheTensor) {
  auto expect_bad = [](Expected<std::vector<uint64_t>> r, const std::string& needle) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << r.status().ToString();
    EXPECT_NE(r.status().message().find("deltas/step_000002.safetensors tensor 'w'"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  const std::string what = "deltas/step_000002.safetensors tensor 'w'";
  expect_bad(DecodeTrlIndices(U32s({1, 5, 5}), DType::kI32, "raw", 10, what), "not strictly increasing");
  expect_bad(DecodeTrlIndices(U32s({3, 1}), DType::kI32, "raw", 10, what), "not strictly increasing");
  expect_bad(DecodeTrlIndices(U32s({0xFFFFFFFF}), DType::kI32, "raw", 10, what), "negative");
  expect_bad(DecodeTrlIndices(U32s({10}), DType::kI32, "raw", 10, what), "out of range");
  expect_bad(DecodeTrlIndices(U16s({5, 5}), DType::kU16, "gap_delta", 10, what), "out of range");
  expect_bad(DecodeTrlIndices(U16s({0xFFFF}), DType::kU16, "gap_delta", 10, what), "out of range");
  expect_bad(DecodeTrlIndices(U32s({0xFFFFFFFF, 0xFFFFFFFF}), DType::kU32, "gap_delta", 1ull << 32, what),
             "out of range");
  expect_bad(DecodeTrlIndices(U16s({0, 0}), DType::kU16, "raw", 10, what), "raw indices must be I32");
  expect_bad(DecodeTrlIndices(U32s({0}), DType::kI32, "gap_delta", 10, what), "must be U16 or U32");
  expect_bad(DecodeTrlIndices(U32s({0}), DType::kF32, "", 10, what), "expected I32, U16 or U32");
  expect_bad(DecodeTrlIndices(U16s({0, 0, 0}), DType::kU16, "gap_delta", 2, what), "3 indices for 2 elements");
  expect_bad(DecodeTrlIndices(U16s({0, 0}), DType::kU16, "zigzag", 10, what), "unknown index encoding");
}

// A run written the way TRL writes it, and the state a reference replay says each step has.
class TrlBucketTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_shared<MemStore>("mem://trl");
    store_->SetRecordReads(true);
    // Step 1: anchor with a [4, 3] and b [5] (BF16).
    state_["a"] = Tensor{"a", DType::kBF16, {4, 3}, RandomBytes(24, 1)};
    state_["b"] = Tensor{"b", DType::kBF16, {5}, RandomBytes(10, 2)};
    PutAnchor(1, {"a", "b"});
    // Step 2: gap_delta U16 patch of a (first and last elements), b untouched.
    PutDelta(2, {{"a", {0, 11}}}, "gap_delta", /*u32=*/false);
    // Step 3: no file (nothing changed). Step 4: U32 gaps patch of a and b.
    PutDelta(4, {{"a", {5, 6, 7}}, {"b", {4}}}, "gap_delta", /*u32=*/true);
    // Step 5: a periodic anchor that omits b (unchanged) and adds c [2, 2].
    Patch("a", {1, 2});
    state_["c"] = Tensor{"c", DType::kBF16, {2, 2}, RandomBytes(8, 3)};
    PutAnchor(5, {"a", "c"});
    // Step 6: raw I32 patch of b and c.
    PutDelta(6, {{"b", {0, 1, 2, 3, 4}}, {"c", {3}}}, "raw", false);
  }

  Expected<std::shared_ptr<TrlVersions>> Open(uint64_t chunk_bytes = 4) {
    TrlOptions o;
    o.chunk_bytes = chunk_bytes;  // several chunks per tensor: boundaries get exercised
    return OpenTrlVersions(store_, "run", o);
  }

  void PutAnchor(uint64_t step, const std::vector<std::string>& names) {
    std::vector<Tensor> ts;
    for (const std::string& n : names) ts.push_back(state_.at(n));
    EXPECT_TRUE(store_->Put(StepKey(true, step), Safetensors(ts, Meta(step, false)), PutMode::kOverwrite).ok());
    expected_[step] = state_;
  }
  // Applies new random values at `idx` of `name` to the reference state.
  std::vector<uint8_t> Patch(const std::string& name, const std::vector<uint64_t>& idx) {
    Tensor& t = state_.at(name);
    std::vector<uint8_t> vals = RandomBytes(idx.size() * 2, static_cast<uint32_t>(idx.size() * 31 + name[0] + seed_++));
    for (size_t k = 0; k < idx.size(); ++k) std::memcpy(&t.bytes[idx[k] * 2], &vals[k * 2], 2);
    return vals;
  }
  void PutDelta(uint64_t step, const std::vector<std::pair<std::string, std::vector<uint64_t>>>& patches,
                const std::string& encoding, bool u32, bool v1 = false) {
    std::vector<Tensor> ts;
    for (const auto& [name, idx] : patches) {
      std::vector<uint8_t> vals = Patch(name, idx);
      const uint64_t n = idx.size();
      if (v1) {
        ts.push_back(Tensor{name + ".indices", DType::kI32, {n}, U32s(idx)});
        ts.push_back(Tensor{name + ".values", DType::kBF16, {n}, vals});
      } else if (encoding == "raw") {
        ts.push_back(Tensor{name + ".idx", DType::kI32, {n}, U32s(idx)});
        ts.push_back(Tensor{name + ".val", DType::kBF16, {n}, vals});
      } else {
        ts.push_back(Tensor{name + ".idx", u32 ? DType::kU32 : DType::kU16, {n}, u32 ? U32s(Gaps(idx)) : U16s(Gaps(idx))});
        ts.push_back(Tensor{name + ".val", DType::kBF16, {n}, vals});
      }
    }
    EXPECT_TRUE(store_->Put(StepKey(false, step), Safetensors(ts, Meta(step, true, v1 ? "" : encoding)), PutMode::kOverwrite).ok());
    expected_[step] = state_;
  }

  void ExpectStep(Bucket& bucket, uint64_t step) {
    SCOPED_TRACE("step " + std::to_string(step));
    Status s;
    std::vector<uint8_t> file = ReadVersion(bucket, TrlVersionName(step), &s);
    ASSERT_TRUE(s.ok()) << s.ToString();
    std::map<std::string, Tensor> got = Parse(file);
    const std::map<std::string, Tensor>& want = expected_.at(step);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, t] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      EXPECT_EQ(got[name].dtype, t.dtype) << name;
      EXPECT_EQ(got[name].shape, t.shape) << name;
      EXPECT_EQ(got[name].bytes, t.bytes) << name;
    }
  }

  std::shared_ptr<MemStore> store_;
  std::map<std::string, Tensor> state_;
  std::map<uint64_t, std::map<std::string, Tensor>> expected_;
  uint32_t seed_ = 100;
};

TEST_F(TrlBucketTest, EveryStepEqualsTheReferenceReplay) {
  Expected<std::shared_ptr<TrlVersions>> trl = Open();
  ASSERT_TRUE(trl.ok()) << trl.status().ToString();
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  Expected<std::vector<VersionInfo>> versions = bucket->ListVersions();
  ASSERT_TRUE(versions.ok());
  std::vector<std::string> names;
  for (const VersionInfo& v : *versions) {
    EXPECT_EQ(v.model, "run");
    names.push_back(v.version);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"step-1", "step-2", "step-4", "step-5", "step-6"}));
  for (uint64_t step : {1, 2, 4, 5, 6}) ExpectStep(*bucket, step);
  // Manifests: derived, one file, parent = the previous step, sha256 unknown, created by step.
  Expected<std::shared_ptr<const Manifest>> m4 = bucket->ReadManifest("run", "step-4");
  ASSERT_TRUE(m4.ok());
  EXPECT_TRUE((*m4)->derived);
  EXPECT_EQ((*m4)->parent.value_or(""), "step-2");
  ASSERT_EQ((*m4)->files.size(), 1u);
  EXPECT_EQ((*m4)->files[0].path, "model.safetensors");
  EXPECT_EQ((*m4)->files[0].sha256, "");
  EXPECT_EQ((*m4)->stats.stored_bytes, store_->Object(StepKey(false, 4)).size());
  Expected<std::shared_ptr<const Manifest>> m5 = bucket->ReadManifest("run", "step-5");
  ASSERT_TRUE(m5.ok());
  EXPECT_LT((*m4)->created_ms, (*m5)->created_ms);
  // Chunk ids differ between steps, and are stable.
  EXPECT_NE((*m4)->files[0].chunks[1].hash, (*m5)->files[0].chunks[1].hash);
  EXPECT_EQ(bucket->ReadManifest("run", "step-4").value()->files[0].chunks[1].hash, (*m4)->files[0].chunks[1].hash);
  EXPECT_EQ(bucket->ReadManifest("run", "step-3").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(bucket->ReadManifest("other", "step-4").status().kind(), ErrorKind::kNotFound);
  // Read-only.
  EXPECT_EQ(bucket->PublishManifest(**m4).kind(), ErrorKind::kUnsupported);
}

TEST_F(TrlBucketTest, LargeChunksAndTheNewestAnchorsMetadata) {
  Expected<std::shared_ptr<TrlVersions>> trl = Open(kDefaultChunkBytes);
  ASSERT_TRUE(trl.ok());
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  for (uint64_t step : {1, 2, 4, 5, 6}) ExpectStep(*bucket, step);
  std::vector<uint8_t> f = ReadVersion(*bucket, "step-6");
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(f, f.size());
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->metadata.at("model_version"), "5");
  EXPECT_EQ(h->metadata.at("sparse"), "False");
}

TEST_F(TrlBucketTest, ListingReadsOnlyHeadersAndAChunkOnlyItsRanges) {
  Expected<std::shared_ptr<TrlVersions>> trl = Open();
  ASSERT_TRUE(trl.ok());
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  store_->TakeReads();
  for (uint64_t step : {1, 2, 4, 5, 6}) ASSERT_TRUE(bucket->ReadManifest("run", TrlVersionName(step)).ok());
  for (const MemStore::Read& r : store_->TakeReads()) {
    EXPECT_TRUE(r.key.starts_with("anchors/")) << r.key << " read while listing";
    std::vector<uint8_t>& obj = store_->Object(r.key);
    Expected<SafetensorsHeader> h = ParseSafetensorsHeader(obj, obj.size());
    ASSERT_TRUE(h.ok());
    EXPECT_LE(r.end, h->data_offset) << r.key << ": listing read tensor data";
  }
  // One chunk of b at step 6 (anchor 1, deltas 4 and 6 touch b): b's 4 bytes in anchor 1, the
  // headers of deltas 2, 4, 6 and the b patches of 4 and 6 (a's patches are not read).
  Expected<std::shared_ptr<const Manifest>> m = bucket->ReadManifest("run", "step-6");
  ASSERT_TRUE(m.ok());
  const ManifestFile& f = (*m)->files[0];
  std::optional<size_t> ci = f.FindChunk(ChunkKey{"b", 1});
  ASSERT_TRUE(ci.has_value());
  Materializer mat(bucket.get(), nullptr);
  ASSERT_TRUE(mat.Chunk(**m, f, *ci).ok());
  uint64_t anchor_bytes = 0;
  for (const MemStore::Read& r : store_->TakeReads()) {
    if (r.key.starts_with("anchors/")) {
      EXPECT_EQ(r.key, StepKey(true, 1));
      anchor_bytes += r.end - r.begin;
    }
  }
  EXPECT_EQ(anchor_bytes, 4u);
  EXPECT_EQ((*trl)->stats().patch_fetches.load(), 2u);  // b at 4 and 6; b has no patch at 2
}

TEST_F(TrlBucketTest, ConcurrentChunksShareOnePatchFetch) {
  // A bigger tensor with one delta patching it, many chunks read from many threads.
  state_["big"] = Tensor{"big", DType::kBF16, {4096}, RandomBytes(8192, 9)};
  PutAnchor(10, {"big"});
  std::vector<uint64_t> idx;
  for (uint64_t i = 0; i < 4096; i += 3) idx.push_back(i);
  PutDelta(11, {{"big", idx}}, "gap_delta", false);
  Expected<std::shared_ptr<TrlVersions>> trl = Open(256);
  ASSERT_TRUE(trl.ok());
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  Expected<std::shared_ptr<const Manifest>> m = bucket->ReadManifest("run", "step-11");
  ASSERT_TRUE(m.ok());
  const ManifestFile& f = (*m)->files[0];
  Materializer mat(bucket.get(), nullptr);
  std::vector<std::vector<uint8_t>> chunks(f.chunks.size());
  std::vector<std::thread> threads;
  std::atomic<size_t> next{0};
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (size_t i = next++; i < f.chunks.size(); i = next++) {
        Expected<ByteBuffer> c = mat.Chunk(**m, f, i);
        if (!c.ok()) {
          failures++;
          continue;
        }
        chunks[i].assign(c->begin(), c->end());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  std::vector<uint8_t> file;
  for (auto& c : chunks) file.insert(file.end(), c.begin(), c.end());
  EXPECT_EQ(Parse(file)["big"].bytes, expected_.at(11).at("big").bytes);
  // big: one patch (step 11); the others: their patches since the anchor each comes from (a:
  // anchor 5, none; b: anchor 1, steps 4 and 6; c: anchor 5, step 6) -- each fetched once
  // however many chunks and threads asked.
  EXPECT_EQ((*trl)->stats().patch_fetches.load(), 4u);
}

TEST_F(TrlBucketTest, V1KeyNamesRead) {
  PutDelta(7, {{"a", {0, 1, 2, 3}}, {"c", {0}}}, "", false, /*v1=*/true);
  Expected<std::shared_ptr<TrlVersions>> trl = Open();
  ASSERT_TRUE(trl.ok());
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  ExpectStep(*bucket, 7);
}

TEST_F(TrlBucketTest, NoLayoutIsNotFoundAndUrlsNameTheModel) {
  auto empty = std::make_shared<MemStore>();
  Expected<std::shared_ptr<TrlVersions>> trl = OpenTrlVersions(empty, "run");
  ASSERT_FALSE(trl.ok());
  EXPECT_EQ(trl.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(trl.status().message().find("anchors/step_NNNNNN.safetensors"), std::string::npos);
  Expected<std::unique_ptr<Bucket>> any = OpenBucketAnyLayout(empty, "/x/run");
  ASSERT_FALSE(any.ok());
  EXPECT_EQ(any.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(any.status().message().find("weightfs init"), std::string::npos) << any.status().message();
  EXPECT_NE(any.status().message().find("TRL"), std::string::npos) << any.status().message();
  Expected<std::unique_ptr<Bucket>> b = OpenBucketAnyLayout(store_, "/data/buckets/qwen grpo/");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  ASSERT_NE((*b)->derived(), nullptr);
  Expected<std::vector<VersionInfo>> v = (*b)->ListVersions();
  ASSERT_TRUE(v.ok());
  ASSERT_FALSE(v->empty());
  EXPECT_EQ(v->front().model, "qwen-grpo");
  EXPECT_EQ(TrlModelNameFromUrl("hf://buckets/org/name"), "name");
  EXPECT_EQ(TrlModelNameFromUrl("s3://bucket/runs/r1?x=1"), "r1");
  EXPECT_EQ(TrlModelNameFromUrl("file:///"), "trl");
  EXPECT_EQ(TrlModelNameFromUrl(".."), "trl");
  // A weightfs bucket opens as one.
  auto wfs = std::make_shared<MemStore>();
  ASSERT_TRUE(Bucket::Init(*wfs).ok());
  Expected<std::unique_ptr<Bucket>> w = OpenBucketAnyLayout(wfs, "/x/run");
  ASSERT_TRUE(w.ok());
  EXPECT_EQ((*w)->derived(), nullptr);
}

// A hostile delta at step 2 (replacing the good one): reading step 2 and 4 fails with `kind`
// and a message naming the file and `needle`; nothing crashes. When only a's entry is bad (not
// the header), step 5 still reads: a comes from anchor 5 there, and b never had a patch at 2.
class TrlHostileTest : public TrlBucketTest {
 protected:
  void ExpectBad(const std::vector<uint8_t>& delta2, ErrorKind kind, const std::string& needle,
                 bool header_level = true) {
    EXPECT_TRUE(store_->Put(StepKey(false, 2), delta2, PutMode::kOverwrite).ok());
    Expected<std::shared_ptr<TrlVersions>> trl = Open();
    ASSERT_TRUE(trl.ok());
    std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
    for (const char* version : {"step-2", "step-4"}) {
      Status s;
      ReadVersion(*bucket, version, &s);
      ASSERT_FALSE(s.ok()) << version;
      EXPECT_EQ(s.kind(), kind) << s.ToString();
      EXPECT_NE(s.message().find("deltas/step_000002.safetensors"), std::string::npos) << s.message();
      EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    }
    ExpectStep(*bucket, 1);  // before the bad delta
    if (!header_level) ExpectStep(*bucket, 5);
  }
  std::vector<uint8_t> Delta(std::vector<Tensor> ts, std::map<std::string, std::string> md) {
    return Safetensors(std::move(ts), md);
  }
};

TEST_F(TrlHostileTest, IndexOutOfRange) {
  ExpectBad(Delta({{"a.idx", DType::kU16, {2}, U16s({0, 12})}, {"a.val", DType::kBF16, {2}, RandomBytes(4, 5)}},
                  Meta(2, true)),
            ErrorKind::kCorruption, "tensor 'a': index 13 at position 1 is out of range for 12 elements", /*header_level=*/false);
}

TEST_F(TrlHostileTest, RawIndicesNotIncreasing) {
  ExpectBad(Delta({{"a.idx", DType::kI32, {2}, U32s({4, 4})}, {"a.val", DType::kBF16, {2}, RandomBytes(4, 5)}},
                  Meta(2, true, "raw")),
            ErrorKind::kCorruption, "tensor 'a': indices not strictly increasing", /*header_level=*/false);
}

TEST_F(TrlHostileTest, CountsDiffer) {
  ExpectBad(Delta({{"a.idx", DType::kU16, {2}, U16s({0, 1})}, {"a.val", DType::kBF16, {3}, RandomBytes(6, 5)}},
                  Meta(2, true)),
            ErrorKind::kCorruption, "parameter 'a' has 2 indices but 3 values");
}

TEST_F(TrlHostileTest, WrongValueDtype) {
  ExpectBad(Delta({{"a.idx", DType::kU16, {2}, U16s({0, 1})}, {"a.val", DType::kF16, {2}, RandomBytes(4, 5)}},
                  Meta(2, true)),
            ErrorKind::kCorruption, "tensor 'a': values are F16 but the tensor is BF16", /*header_level=*/false);
}

TEST_F(TrlHostileTest, MoreChangesThanElements) {
  std::vector<uint64_t> zeros(13, 0);
  ExpectBad(Delta({{"a.idx", DType::kU16, {13}, U16s(zeros)}, {"a.val", DType::kBF16, {13}, RandomBytes(26, 5)}},
                  Meta(2, true)),
            ErrorKind::kCorruption, "13 changes in a tensor of 12 elements", /*header_level=*/false);
}

TEST_F(TrlHostileTest, NotASparsePatch) {
  std::map<std::string, std::string> md = Meta(2, true);
  md["format"] = "pickle";
  ExpectBad(Delta({{"a.idx", DType::kU16, {1}, U16s({0})}, {"a.val", DType::kBF16, {1}, RandomBytes(2, 5)}}, md),
            ErrorKind::kCorruption, "format is 'pickle'");
  md.erase("format");
  ExpectBad(Delta({{"a.idx", DType::kU16, {1}, U16s({0})}, {"a.val", DType::kBF16, {1}, RandomBytes(2, 5)}}, md),
            ErrorKind::kCorruption, "format is missing");
}

TEST_F(TrlHostileTest, StepMismatchUnknownKeysAndNvcomp) {
  ExpectBad(Delta({{"a.idx", DType::kU16, {1}, U16s({0})}, {"a.val", DType::kBF16, {1}, RandomBytes(2, 5)}},
                  Meta(3, true)),
            ErrorKind::kCorruption, "model_version '3' does not match its step 2");
  ExpectBad(Delta({{"a.idx", DType::kU16, {1}, U16s({0})}, {"a.weird", DType::kBF16, {1}, RandomBytes(2, 5)}},
                  Meta(2, true)),
            ErrorKind::kCorruption, "tensor 'a.weird' is neither");
  ExpectBad(Delta({{"a.idx", DType::kU16, {1}, U16s({0})}}, Meta(2, true)), ErrorKind::kCorruption,
            "parameter 'a' has indices but no values");
  ExpectBad(Delta({{"a.idx", DType::kU8, {1}, {0}}, {"a.val", DType::kBF16, {1}, RandomBytes(2, 5)}},
                  Meta(2, true, "nvcomp_cascaded")),
            ErrorKind::kUnsupported, "nvcomp_cascaded");
}

TEST_F(TrlHostileTest, TruncatedAndGarbage) {
  std::vector<uint8_t> good = store_->Object(StepKey(false, 2));
  std::vector<uint8_t> truncated(good.begin(), good.end() - 3);
  ExpectBad(truncated, ErrorKind::kCorruption, "deltas/step_000002.safetensors");
  std::vector<uint8_t> garbage = RandomBytes(100, 77);
  ExpectBad(garbage, ErrorKind::kCorruption, "deltas/step_000002.safetensors");
  std::vector<uint8_t> tiny = {1, 2, 3};
  ExpectBad(tiny, ErrorKind::kCorruption, "too short");
}

TEST_F(TrlBucketTest, HostileAnchorFailsItsSteps) {
  EXPECT_TRUE(store_->Put(StepKey(true, 5), RandomBytes(64, 4), PutMode::kOverwrite).ok());
  Expected<std::shared_ptr<TrlVersions>> trl = Open();
  ASSERT_TRUE(trl.ok());  // opening lists, it does not read anchors
  std::unique_ptr<Bucket> bucket = Bucket::FromDerived(store_, *trl);
  Expected<std::shared_ptr<const Manifest>> m = bucket->ReadManifest("run", "step-6");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(m.status().message().find("anchors/step_000005.safetensors"), std::string::npos) << m.status().message();
  ExpectStep(*bucket, 4);
}

}  // namespace
}  // namespace weightfs
