// WeightPatcher (hub/engine/weight_patcher.h) on a local directory bucket: versions pushed with small
// chunks, patches from the parent and from further back applied here the way an engine applies
// them (flat[idx] = val, whole tensors replaced, removed ones dropped), and the result compared
// with NEW's tensors byte for byte. Also: which path each chunk took, what was fetched, and the
// errors a caller gets for versions that are missing or not an ancestor.
#include "hub/engine/weight_patcher.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/hash.h"
#include "core/safetensors.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "hub/engine/version_writer.h"
#include "hub/store/local_store.h"
#include "hub/store/store_wrapper.h"
#include "tests/testing/safetensors_builder.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

struct Tensor {
  DType dtype = DType::kBF16;
  std::vector<uint64_t> shape;
  std::vector<uint8_t> bytes;
  uint64_t elements() const { return bytes.size() / DTypeSize(dtype); }
};

// A safetensors file's tensors (by name) and metadata; written in name order.
struct Weights {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;

  std::vector<uint8_t> Bytes() const {
    test::SafetensorsBuilder b;
    for (const auto& [name, t] : tensors) b.Add(name, t.dtype, t.shape, t.bytes);
    return b.Metadata(metadata).Build();
  }
};

// Parses a safetensors file into Weights (test input: trusted enough, checked by the parser).
Weights Parse(const std::vector<uint8_t>& file) {
  Weights w;
  Expected<uint64_t> prefix = SafetensorsPrefixLength(file);
  EXPECT_TRUE(prefix.ok()) << prefix.status().ToString();
  if (!prefix.ok()) return w;
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(file, file.size());
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  if (!h.ok()) return w;
  w.metadata = h->metadata;
  for (const TensorInfo& t : h->tensors) {
    Tensor x;
    x.dtype = t.dtype;
    x.shape = t.shape;
    x.bytes.assign(file.begin() + static_cast<ptrdiff_t>(h->data_offset + t.begin),
                   file.begin() + static_cast<ptrdiff_t>(h->data_offset + t.end));
    w.tensors[t.name] = std::move(x);
  }
  return w;
}

std::vector<std::string> JsonNames(const std::string& text) {
  return nlohmann::json::parse(text).get<std::vector<std::string>>();
}

// What an inference engine does with a patch: OLD's tensors, removed ones dropped, dense ones
// replaced, sparse ones patched in place (flat[idx] = val). Fails the test on a malformed patch.
std::map<std::string, Tensor> Apply(const Weights& old, const Weights& patch) {
  std::map<std::string, Tensor> out = old.tensors;
  EXPECT_EQ(patch.metadata.at("sparse_weight_patch"), "1");
  for (const std::string& name : JsonNames(patch.metadata.at("removed"))) {
    EXPECT_EQ(out.erase(name), 1u) << name;
  }
  const std::vector<std::string> dense = JsonNames(patch.metadata.at("dense"));
  for (const std::string& name : dense) {
    EXPECT_TRUE(patch.tensors.count(name)) << name;
    out[name] = patch.tensors.at(name);
  }
  for (const auto& [key, idx] : patch.tensors) {
    if (!key.ends_with(".idx")) continue;
    const std::string name = key.substr(0, key.size() - 4);
    EXPECT_TRUE(out.count(name)) << name;
    EXPECT_TRUE(patch.tensors.count(name + ".val")) << name;
    Tensor& t = out[name];
    const Tensor& val = patch.tensors.at(name + ".val");
    EXPECT_EQ(val.dtype, t.dtype) << name;
    EXPECT_EQ(idx.dtype, PatchIndexDType(t.elements())) << name;
    EXPECT_EQ(idx.elements(), val.elements()) << name;
    const size_t w = DTypeSize(t.dtype), iw = DTypeSize(idx.dtype);
    uint64_t prev = 0;
    for (uint64_t k = 0; k < idx.elements(); ++k) {
      uint64_t i = 0;
      std::memcpy(&i, idx.bytes.data() + k * iw, iw);  // little-endian, non-negative
      if (k > 0) {
        EXPECT_GT(i, prev) << name << ": indices must ascend";
      }
      prev = i;
      EXPECT_LT(i, t.elements()) << name;
      if (i >= t.elements()) break;
      EXPECT_NE(std::memcmp(t.bytes.data() + i * w, val.bytes.data() + k * w, w), 0)
          << name << "[" << i << "] is listed but does not change";
      std::memcpy(t.bytes.data() + i * w, val.bytes.data() + k * w, w);
    }
  }
  for (const auto& [key, t] : patch.tensors) {
    const bool pair = key.ends_with(".idx") || key.ends_with(".val");
    EXPECT_TRUE(pair || std::find(dense.begin(), dense.end(), key) != dense.end()) << key;
  }
  return out;
}

// NEW's tensors equal the applied patch, bit for bit (compared by hash, then in full).
void ExpectSameTensors(const std::map<std::string, Tensor>& got, const Weights& want) {
  std::set<std::string> got_names, want_names;
  for (const auto& [n, t] : got) got_names.insert(n);
  for (const auto& [n, t] : want.tensors) want_names.insert(n);
  EXPECT_EQ(got_names, want_names);
  for (const auto& [name, t] : want.tensors) {
    auto it = got.find(name);
    if (it == got.end()) continue;
    EXPECT_EQ(it->second.dtype, t.dtype) << name;
    EXPECT_EQ(it->second.shape, t.shape) << name;
    EXPECT_EQ(HashChunk(it->second.bytes).ToHex(), HashChunk(t.bytes).ToHex()) << name;
  }
}

uint16_t Bf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

Tensor Random(DType dtype, std::vector<uint64_t> shape, uint64_t seed) {
  Tensor t;
  t.dtype = dtype;
  t.shape = shape;
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  t.bytes.resize(n * DTypeSize(dtype));
  for (uint64_t i = 0; i < n; ++i) {
    const float f = normal(rng);
    if (dtype == DType::kBF16) {
      const uint16_t b = Bf16Bits(f);
      std::memcpy(t.bytes.data() + 2 * i, &b, 2);
    } else {
      std::memcpy(t.bytes.data() + 4 * i, &f, 4);
    }
  }
  return t;
}

// A training-like step: about `fraction` of the elements move by one unit in the last place
// (the bit pattern of a positive or negative float, either way). `skip` is left alone.
void Step(Tensor& t, double fraction, uint64_t seed, uint64_t skip = UINT64_MAX) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  const size_t w = DTypeSize(t.dtype);
  for (uint64_t i = 0; i < t.elements(); ++i) {
    if (i == skip || u(rng) >= fraction) continue;
    uint32_t v = 0;
    std::memcpy(&v, t.bytes.data() + i * w, w);
    v = (rng() & 1) ? v + 1 : v - 1;
    std::memcpy(t.bytes.data() + i * w, &v, w);
  }
}

// Adds one unit to an element's bit pattern (delta = -1 subtracts).
void Nudge(Tensor& t, uint64_t i, int delta) {
  const size_t w = DTypeSize(t.dtype);
  uint32_t v = 0;
  std::memcpy(&v, t.bytes.data() + i * w, w);
  v = static_cast<uint32_t>(static_cast<int64_t>(v) + delta);
  std::memcpy(t.bytes.data() + i * w, &v, w);
}

constexpr const char* kFile = "model.safetensors";
constexpr uint64_t kRevertElement = 77;  // embed: changed in v1, changed back in v2

class PatchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-patch-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "bucket");
    auto local = LocalStore::Open((root_ / "bucket").string());
    ASSERT_TRUE(local.ok());
    store_ = std::make_shared<CountingStore>(std::shared_ptr<Store>(std::move(local).value()));
    ASSERT_TRUE(Bucket::Init(*store_).ok());
    auto b = Bucket::Open(store_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    bucket_ = std::move(b).value();
    options_.chunk_bytes = 16 << 10;  // several chunks per tensor
    options_.pack_bytes = 256 << 10;
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<ChunkCache> Cache(const std::string& name) {
    auto c = ChunkCache::Open((root_ / name).string(), 1ull << 30);
    EXPECT_TRUE(c.ok());
    return std::move(c).value();
  }

  // v0: bf16 and f32 tensors; v1: a ~1% step (and embed[77] +1); v2: a step, a tensor changed
  // densely, three quarters of another, embed[77] back; v3: a step, a tensor added, one
  // removed, one reshaped, one whose dtype changed; v4: only the header's metadata differs.
  std::vector<Weights> MakeVersions() {
    std::vector<Weights> v(5);
    Weights& w = v[0];
    w.metadata = {{"format", "pt"}};
    w.tensors["embed"] = Random(DType::kBF16, {256, 128}, 1);   // 4 chunks
    w.tensors["layers.0.q"] = Random(DType::kBF16, {128, 96}, 2);
    w.tensors["layers.0.norm"] = Random(DType::kF32, {128}, 3);
    w.tensors["layers.0.mlp"] = Random(DType::kF32, {64, 128}, 4);  // 2 chunks
    w.tensors["frozen"] = Random(DType::kBF16, {64, 64}, 5);
    w.tensors["dense_changer"] = Random(DType::kBF16, {96, 128}, 6);  // 2 chunks
    w.tensors["half_dense"] = Random(DType::kBF16, {256, 128}, 11);  // 4 chunks
    w.tensors["gone"] = Random(DType::kBF16, {300}, 7);
    w.tensors["reshaped"] = Random(DType::kF32, {16, 8}, 8);
    w.tensors["retyped"] = Random(DType::kF32, {64}, 9);
    v[1] = v[0];
    for (auto& [name, t] : v[1].tensors) {
      if (name != "frozen") Step(t, 0.01, 100 + t.bytes.size(), kRevertElement);
    }
    Nudge(v[1].tensors["embed"], kRevertElement, +1);
    v[2] = v[1];
    for (auto& [name, t] : v[2].tensors) {
      if (name != "frozen") Step(t, 0.01, 200 + t.bytes.size(), kRevertElement);
    }
    Nudge(v[2].tensors["embed"], kRevertElement, -1);
    v[2].tensors["dense_changer"] = Random(DType::kBF16, {96, 128}, 60);
    // The first quarter sparse, the rest new: sparse stops paying at its third chunk.
    const Tensor fresh = Random(DType::kBF16, {256, 128}, 61);
    std::copy(fresh.bytes.begin() + (16 << 10), fresh.bytes.end(), v[2].tensors["half_dense"].bytes.begin() + (16 << 10));
    v[3] = v[2];
    for (auto& [name, t] : v[3].tensors) {
      if (name != "frozen") Step(t, 0.01, 300 + t.bytes.size(), kRevertElement);
    }
    v[3].tensors["new_head"] = Random(DType::kBF16, {32, 128}, 10);
    v[3].tensors.erase("gone");
    v[3].tensors["reshaped"].shape = {8, 16};
    Tensor& retyped = v[3].tensors["retyped"];
    retyped.dtype = DType::kI32;  // same bytes, another dtype
    v[4] = v[3];
    v[4].metadata["step"] = "4";
    return v;
  }

  std::string WriteVersion(int k, const Weights& w) {
    const std::string dir = (root_ / ("v" + std::to_string(k))).string();
    fs::create_directories(dir);
    const std::vector<uint8_t> bytes = w.Bytes();
    std::ofstream(dir + "/" + kFile, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return dir;
  }

  // Pushes versions[0..] as v0, v1, ... each the parent of the next.
  void PushAll(const std::vector<Weights>& versions, ChunkCache* cache) {
    std::shared_ptr<const Manifest> parent;
    for (size_t k = 0; k < versions.size(); ++k) {
      auto files = FilesUnder(WriteVersion(static_cast<int>(k), versions[k]));
      ASSERT_TRUE(files.ok());
      auto r = PushVersion(*bucket_, cache, pool_, {"acme/m", "v" + std::to_string(k)}, parent, *files, options_);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      parent = r->manifest;
    }
  }

  // The patch of kFile from `from` to `to`, its stats, parsed.
  Weights MakePatch(Materializer& m, const std::string& from, const std::string& to, PatchStats* stats,
                    PatchOptions options = {}) {
    options.spill_dir = root_.string();
    auto patcher = WeightPatcher::Open(&m, &pool_, "acme/m", from, to, options);
    EXPECT_TRUE(patcher.ok()) << patcher.status().ToString();
    if (!patcher.ok()) return {};
    std::vector<uint8_t> out;
    Status s = (*patcher)->Write(kFile, [&](std::span<const uint8_t> b) {
      out.insert(out.end(), b.begin(), b.end());
      return Status::Ok();
    }, stats);
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(stats->patch_bytes, out.size());
    return Parse(out);
  }

  fs::path root_;
  std::shared_ptr<CountingStore> store_;
  std::unique_ptr<Bucket> bucket_;
  ThreadPool pool_{4};
  PushOptions options_;
};

TEST_F(PatchTest, PatchesFromTheParentAndFurtherBackApplyBitExactly) {
  const std::vector<Weights> v = MakeVersions();
  PushAll(v, nullptr);
  Materializer m(bucket_.get(), nullptr);
  for (auto [from, to] : {std::pair{0, 1}, {1, 2}, {0, 2}, {2, 3}, {1, 3}, {0, 3}, {3, 4}, {0, 4}, {2, 2}}) {
    SCOPED_TRACE("v" + std::to_string(from) + " -> v" + std::to_string(to));
    PatchStats stats;
    const Weights patch = MakePatch(m, "v" + std::to_string(from), "v" + std::to_string(to), &stats);
    ExpectSameTensors(Apply(v[from], patch), v[to]);
    EXPECT_EQ(patch.metadata.at("from"), "v" + std::to_string(from));
    EXPECT_EQ(patch.metadata.at("to"), "v" + std::to_string(to));
    EXPECT_EQ(patch.metadata.at("model"), "acme/m");
    EXPECT_EQ(patch.metadata.at("file"), kFile);
    EXPECT_EQ(patch.metadata.at("format"), "sparse_weight_patch");
    EXPECT_EQ(patch.metadata.at("encoding"), "raw");
    EXPECT_EQ(patch.metadata.at("changed_elements"), std::to_string(stats.elements_changed));
    EXPECT_EQ(stats.tensors, v[to].tensors.size());
    EXPECT_EQ(stats.tensors_sparse + stats.tensors_dense + stats.tensors_unchanged, stats.tensors);
    // The frozen tensor never appears; a step moves the others sparsely.
    EXPECT_FALSE(patch.tensors.count("frozen.idx") || patch.tensors.count("frozen"));
    if (from < to && to <= 3) {
      EXPECT_TRUE(patch.tensors.count("embed.idx"));
      EXPECT_EQ(patch.tensors.at("embed.val").dtype, DType::kBF16);
      EXPECT_EQ(patch.tensors.at("layers.0.mlp.val").dtype, DType::kF32);
      EXPECT_EQ(patch.tensors.at("embed.idx").dtype, DType::kI32);
      EXPECT_GT(stats.chunks_from_deltas, 0u);
      EXPECT_GT(stats.chunks_same, 0u);  // frozen's
    }
    const std::vector<std::string> dense = JsonNames(patch.metadata.at("dense"));
    const std::vector<std::string> removed = JsonNames(patch.metadata.at("removed"));
    const bool crosses_v2 = from < 2 && to >= 2, crosses_v3 = from < 3 && to >= 3;
    EXPECT_EQ(std::count(dense.begin(), dense.end(), "dense_changer"), crosses_v2 ? 1 : 0);
    EXPECT_EQ(std::count(dense.begin(), dense.end(), "half_dense"), crosses_v2 ? 1 : 0);
    EXPECT_EQ(std::count(dense.begin(), dense.end(), "new_head"), crosses_v3 ? 1 : 0);
    EXPECT_EQ(std::count(dense.begin(), dense.end(), "reshaped"), crosses_v3 ? 1 : 0);
    EXPECT_EQ(std::count(dense.begin(), dense.end(), "retyped"), crosses_v3 ? 1 : 0);
    EXPECT_EQ(removed, crosses_v3 ? std::vector<std::string>{"gone"} : std::vector<std::string>{});
    EXPECT_EQ(stats.tensors_removed, removed.size());
    if (from == 0 && to == 2) {
      // Changed in v1 and back in v2: not in the patch, though both deltas list it.
      const Tensor& idx = patch.tensors.at("embed.idx");
      for (uint64_t k = 0; k < idx.elements(); ++k) {
        int32_t i;
        std::memcpy(&i, idx.bytes.data() + 4 * k, 4);
        EXPECT_NE(i, static_cast<int32_t>(kRevertElement));
      }
    }
    if (from == to || (from == 3 && to == 4)) {
      // Nothing (v3 -> v4: only the header changed).
      EXPECT_TRUE(patch.tensors.empty());
      EXPECT_EQ(stats.tensors_unchanged, stats.tensors);
      EXPECT_EQ(stats.chunks_from_deltas + stats.chunks_compared, 0u);
    }
    if (from != to) {
      EXPECT_GT(stats.stored_delta_bytes, 0u);
    }
  }
}

// Following training: a node patches v1 -> v2 (cold: OLD's chunks come from the bucket and go
// into the cache, and so do NEW's, built from them and the deltas), then v2 -> v3. The second
// patch finds v2's chunks in the cache: the bucket serves v3's stored payloads and metadata only.
TEST_F(PatchTest, FollowingTrainingFetchesOnlyTheNewDeltas) {
  const std::vector<Weights> v = MakeVersions();
  PushAll(std::vector<Weights>(v.begin(), v.begin() + 4), nullptr);
  std::unique_ptr<ChunkCache> cache = Cache("cache");
  Materializer m(bucket_.get(), cache.get());
  PatchStats stats;
  const Weights first = MakePatch(m, "v1", "v2", &stats, PatchOptions{.cache = cache.get()});
  ExpectSameTensors(Apply(v[1], first), v[2]);
  EXPECT_GT(stats.chunks_from_deltas, 0u);
  EXPECT_LE(stats.delta_payload_bytes, stats.stored_delta_bytes);

  const uint64_t received = store_->counters().bytes_received.load();
  const uint64_t chunks = m.stats().chunks.load(), hits = m.stats().cache_hits.load();
  const Weights next = MakePatch(m, "v2", "v3", &stats, PatchOptions{.cache = cache.get()});
  ExpectSameTensors(Apply(v[2], next), v[3]);
  const uint64_t fetched = store_->counters().bytes_received.load() - received;
  const uint64_t misses = (m.stats().chunks.load() - chunks) - (m.stats().cache_hits.load() - hits);
  EXPECT_GT(stats.chunks_from_deltas, 0u);
  EXPECT_EQ(stats.chunks_compared, 0u);
  // Materialized from the bucket: v3's header and the chunks of its new or reshaped tensors,
  // all v3's own payloads; every chunk of v2 came from the cache.
  EXPECT_LE(misses, 1 + stats.chunks_whole);
  EXPECT_GT(stats.delta_payload_bytes, stats.stored_delta_bytes / 4);
  EXPECT_GE(fetched, stats.delta_payload_bytes);
  EXPECT_LE(fetched, stats.stored_delta_bytes + (16 << 10)) << "beyond v3's payloads, only metadata";
}

// Keyframes between OLD and NEW (a depth limit of 1 makes every changed chunk of v2 FULL): the
// chunks are materialized in both versions and compared; the patch is as exact.
TEST_F(PatchTest, KeyframesInTheChainAreCompared) {
  const std::vector<Weights> v = MakeVersions();
  options_.keyframes.max_depth = 1;
  PushAll(std::vector<Weights>(v.begin(), v.begin() + 4), nullptr);
  Materializer m(bucket_.get(), nullptr);
  for (auto [from, to] : {std::pair{1, 2}, {0, 3}, {1, 3}}) {
    SCOPED_TRACE("v" + std::to_string(from) + " -> v" + std::to_string(to));
    PatchStats stats;
    const Weights patch = MakePatch(m, "v" + std::to_string(from), "v" + std::to_string(to), &stats);
    ExpectSameTensors(Apply(v[from], patch), v[to]);
    EXPECT_GT(stats.chunks_compared, 0u);
  }
  PatchStats stats;
  MakePatch(m, "v1", "v2", &stats);
  EXPECT_EQ(stats.chunks_from_deltas, 0u);  // every changed chunk of v2 is a keyframe
}

// NEW chunked differently from OLD (another chunk size): OLD's elements are read by range.
TEST_F(PatchTest, OtherChunkingIsComparedByRange) {
  const std::vector<Weights> v = MakeVersions();
  PushAll(std::vector<Weights>(v.begin(), v.begin() + 2), nullptr);
  auto files = FilesUnder(WriteVersion(2, v[2]));
  ASSERT_TRUE(files.ok());
  auto v1 = bucket_->ReadFullManifest("acme/m", "v1");
  ASSERT_TRUE(v1.ok());
  PushOptions other = options_;
  other.chunk_bytes = 24 << 10;
  ASSERT_TRUE(PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v2"}, *v1, *files, other).ok());
  Materializer m(bucket_.get(), nullptr);
  for (const char* from : {"v0", "v1"}) {
    PatchStats stats;
    const Weights patch = MakePatch(m, from, "v2", &stats);
    ExpectSameTensors(Apply(from == std::string("v0") ? v[0] : v[1], patch), v[2]);
    EXPECT_GT(stats.chunks_compared, 0u);
  }
}

TEST_F(PatchTest, ErrorsNameTheProblem) {
  const std::vector<Weights> v = MakeVersions();
  PushAll(std::vector<Weights>(v.begin(), v.begin() + 3), nullptr);
  // A branch: v0 -> side.
  auto files = FilesUnder(WriteVersion(9, v[1]));
  ASSERT_TRUE(files.ok());
  auto v0 = bucket_->ReadFullManifest("acme/m", "v0");
  ASSERT_TRUE(v0.ok());
  ASSERT_TRUE(PushVersion(*bucket_, nullptr, pool_, {"acme/m", "side"}, *v0, *files, options_).ok());
  // A file that is not safetensors.
  fs::create_directories(root_ / "odd");
  std::ofstream(root_ / "odd" / "notes.bin") << "not tensors";
  auto odd_files = FilesUnder((root_ / "odd").string());
  ASSERT_TRUE(odd_files.ok());
  auto v2 = bucket_->ReadFullManifest("acme/m", "v2");
  ASSERT_TRUE(v2.ok());
  ASSERT_TRUE(PushVersion(*bucket_, nullptr, pool_, {"acme/m", "odd"}, *v2, *odd_files, options_).ok());

  Materializer m(bucket_.get(), nullptr);
  auto open = [&](const std::string& from, const std::string& to) {
    return WeightPatcher::Open(&m, &pool_, "acme/m", from, to);
  };
  auto not_ancestor = open("side", "v2");
  ASSERT_FALSE(not_ancestor.ok());
  EXPECT_EQ(not_ancestor.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(not_ancestor.status().message().find("acme/m@side is not an ancestor of acme/m@v2"), std::string::npos)
      << not_ancestor.status().ToString();
  EXPECT_NE(not_ancestor.status().message().find("v0 -> v1 -> v2"), std::string::npos)
      << not_ancestor.status().ToString();
  auto backwards = open("v2", "v0");
  ASSERT_FALSE(backwards.ok());
  EXPECT_EQ(backwards.status().kind(), ErrorKind::kInvalidArgument);
  auto missing_new = open("v0", "v7");
  ASSERT_FALSE(missing_new.ok());
  EXPECT_EQ(missing_new.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(missing_new.status().message().find("v7"), std::string::npos) << missing_new.status().ToString();
  auto missing_old = open("v7", "v2");
  ASSERT_FALSE(missing_old.ok());
  EXPECT_EQ(missing_old.status().kind(), ErrorKind::kNotFound);
  auto other_model = WeightPatcher::Open(&m, &pool_, "acme/other", "v0", "v1");
  ASSERT_FALSE(other_model.ok());
  EXPECT_EQ(other_model.status().kind(), ErrorKind::kNotFound);

  auto ok = open("v0", "odd");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ((*ok)->WeightFiles(), std::vector<std::string>{});
  PatchStats stats;
  auto sink = [](std::span<const uint8_t>) { return Status::Ok(); };
  Status s = (*ok)->Write("notes.bin", sink, &stats);
  EXPECT_EQ(s.kind(), ErrorKind::kInvalidArgument) << s.ToString();
  s = (*ok)->Write(kFile, sink, &stats);
  EXPECT_EQ(s.kind(), ErrorKind::kNotFound) << s.ToString();
  // A version missing in the middle of the ancestry: NotFound naming it.
  ASSERT_TRUE(store_->Delete(Bucket::ManifestKey("acme/m", "v1")).ok());
  bucket_->Forget("acme/m", "v1");
  auto gap = open("v0", "v2");
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(gap.status().message().find("v1"), std::string::npos) << gap.status().ToString();
}

// A model with tensors "w" and "w.idx" cannot have both written when "w" is sparse: an error,
// not an ambiguous file.
TEST_F(PatchTest, NameCollisionIsInvalidArgument) {
  std::vector<Weights> v(2);
  v[0].tensors["w"] = Random(DType::kBF16, {4096}, 1);
  v[0].tensors["w.idx"] = Random(DType::kBF16, {4096}, 2);
  v[1] = v[0];
  Step(v[1].tensors["w"], 0.01, 3);
  v[1].tensors["w.idx"] = Random(DType::kBF16, {8, 512}, 4);  // reshaped: dense
  PushAll(v, nullptr);
  Materializer m(bucket_.get(), nullptr);
  auto patcher = WeightPatcher::Open(&m, &pool_, "acme/m", "v0", "v1");
  ASSERT_TRUE(patcher.ok());
  PatchStats stats;
  Status s = (*patcher)->Write(kFile, [](std::span<const uint8_t>) { return Status::Ok(); }, &stats);
  EXPECT_EQ(s.kind(), ErrorKind::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("w.idx"), std::string::npos) << s.ToString();
}

TEST(PatchIndexDTypeTest, Int64AboveTwoToTheThirtyOneElements) {
  EXPECT_EQ(PatchIndexDType(1), DType::kI32);
  EXPECT_EQ(PatchIndexDType(uint64_t{1} << 31), DType::kI32);
  EXPECT_EQ(PatchIndexDType((uint64_t{1} << 31) + 1), DType::kI64);
}

}  // namespace
}  // namespace weightfs
