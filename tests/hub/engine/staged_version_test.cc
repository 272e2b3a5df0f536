// A version written by several writers (hub/engine/staged_version.h) on a local directory bucket:
// parts publish one version with every part's files, once; files no part writes are inherited;
// conflicts, a different parent, a resubmitted part, a timeout and a discard publish nothing;
// gc keeps a staged part's packs until its grace ends; the final publish's requests do not
// grow with chunks.
#include "hub/engine/staged_version.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "hub/engine/gc.h"
#include "hub/engine/lease.h"
#include "hub/engine/materializer.h"
#include "hub/engine/version_reader.h"
#include "hub/store/local_store.h"
#include "hub/store/store_wrapper.h"
#include "tests/testing/safetensors_builder.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::vector<uint8_t> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

class StagedVersionTest : public ::testing::Test {
 protected:
  static constexpr int kShards = 8;

  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-staged-" + std::to_string(::getpid()) + "-" +
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
    options_.chunk_bytes = 64 << 10;
    options_.pack_bytes = 256 << 10;
    std::mt19937_64 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    values_.resize(kShards);
    for (auto& v : values_) {
      v.resize(60000);
      for (auto& x : v) {
        float f = normal(rng);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        x = static_cast<uint16_t>(bits >> 16);
      }
    }
  }
  void TearDown() override { fs::remove_all(root_); }

  static std::string Shard(int i) { return "model-0000" + std::to_string(i) + "-of-00008.safetensors"; }

  // A training step of shard i: ~2% of its elements move by one unit in the last place.
  void Step(int i, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (auto& x : values_[i]) {
      if (rng() % 50 == 0) x = static_cast<uint16_t>(x + 1);
    }
  }

  // Writes shard i as it is now under dir, and returns it as a PushFile.
  PushFile WriteShard(const fs::path& dir, int i) {
    fs::create_directories(dir);
    const uint8_t* p = reinterpret_cast<const uint8_t*>(values_[i].data());
    std::vector<uint8_t> bytes = test::SafetensorsBuilder()
                                     .Add("layer." + std::to_string(i) + ".w", DType::kBF16, {values_[i].size()},
                                          std::vector<uint8_t>(p, p + values_[i].size() * 2))
                                     .Build();
    const fs::path path = dir / Shard(i);
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                                static_cast<std::streamsize>(bytes.size()));
    return {Shard(i), path.string()};
  }

  std::shared_ptr<const Manifest> PushBase() {
    std::vector<PushFile> files;
    for (int i = 0; i < kShards; ++i) files.push_back(WriteShard(root_ / "v0", i));
    auto r = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v0"}, nullptr, files, options_);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? r->manifest : nullptr;
  }

  Expected<StagedState> Part(const std::string& id, int parts, const std::vector<int>& shards,
                             std::shared_ptr<const Manifest> parent, bool wait = false,
                             std::chrono::milliseconds timeout = 30s) {
    std::vector<PushFile> files;
    for (int i : shards) files.push_back(WriteShard(root_ / ("part-" + id), i));
    PushPartOptions part;
    part.parts = parts;
    part.id = id;
    part.wait = wait;
    part.deadline = std::chrono::steady_clock::now() + timeout;
    return PushPart(*bucket_, nullptr, pool_, {"acme/m", "v1"}, std::move(parent), files, options_, part, nullptr);
  }

  // v1 read back through a cold materializer equals the files under `expected` (by path).
  void ExpectVersionHolds(const std::string& version, const std::map<std::string, fs::path>& expected) {
    auto m = bucket_->ReadFullManifest("acme/m", version);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ASSERT_EQ((*m)->files.size(), expected.size());
    Materializer mat(bucket_.get(), nullptr);
    const fs::path dest = root_ / ("out-" + version);
    ASSERT_TRUE(PullVersion(mat, pool_, **m, dest.string()).ok());
    for (const auto& [path, local] : expected) EXPECT_EQ(ReadFile(dest / path), ReadFile(local)) << path;
  }

  // The record of a part that writes and removes nothing (it only takes part).
  static PartRecord EmptyPart(const std::string& id, int parts) {
    PartRecord r;
    r.meta.id = id;
    r.meta.parts = parts;
    r.meta.parent = "v0";
    r.meta.created_ms = NowMs();
    r.manifest.model = "acme/m";
    r.manifest.version = "v1";
    r.manifest.versions = {"v1"};
    r.manifest.parent = "v0";
    return r;
  }

  bool StagingEmpty() {
    auto objects = ListAll(*store_, "staging/");
    return objects.ok() && objects->empty();
  }

  fs::path root_;
  std::shared_ptr<CountingStore> store_;
  std::unique_ptr<Bucket> bucket_;
  ThreadPool pool_{2};
  PushOptions options_;
  std::vector<std::vector<uint16_t>> values_;
};

TEST_F(StagedVersionTest, FourPartsPublishOneVersionWithEveryPartsFiles) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  for (int i = 0; i < kShards; ++i) Step(i, 100 + static_cast<uint64_t>(i));
  // Four writers at once, each with two shards, each waiting for the others.
  std::vector<Expected<StagedState>> results(4, Status::IOError("not run"));
  std::vector<std::thread> writers;
  for (int k = 0; k < 4; ++k) {
    writers.emplace_back([&, k] { results[k] = Part("rank" + std::to_string(k), 4, {2 * k, 2 * k + 1}, v0, true); });
  }
  for (auto& t : writers) t.join();
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(results[k].ok()) << k << ": " << results[k].status().ToString();
    EXPECT_EQ(results[k]->kind, StagedState::kPublished) << k << ": " << results[k]->message;
  }
  std::map<std::string, fs::path> expected;
  for (int i = 0; i < kShards; ++i) expected[Shard(i)] = root_ / ("part-rank" + std::to_string(i / 2)) / Shard(i);
  ExpectVersionHolds("v1", expected);
  auto head = bucket_->ReadManifest("acme/m", "v1");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ((*head)->parent, "v0");
  // Deltas, not copies: each shard changed ~2% of its elements.
  EXPECT_LT((*head)->stats.stored_bytes * 4, v0->stats.stored_bytes);
  EXPECT_NEAR((*head)->stats.changed_fraction(), 0.02, 0.01);
  EXPECT_TRUE(StagingEmpty());
}

TEST_F(StagedVersionTest, FilesNoPartWritesAreInheritedFromTheParent) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(1, 1);
  Step(6, 6);
  auto a = Part("a", 2, {1}, v0);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->kind, StagedState::kWaiting);
  EXPECT_FALSE(bucket_->store().Head(Bucket::ManifestKey("acme/m", "v1")).ok()) << "published with one of two parts";
  auto b = Part("b", 2, {6}, v0);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(b->kind, StagedState::kPublished) << b->message;
  std::map<std::string, fs::path> expected;
  for (int i = 0; i < kShards; ++i) expected[Shard(i)] = root_ / "v0" / Shard(i);
  expected[Shard(1)] = root_ / "part-a" / Shard(1);
  expected[Shard(6)] = root_ / "part-b" / Shard(6);
  ExpectVersionHolds("v1", expected);
  // The inherited shards store nothing: v1 costs the two deltas.
  auto head = bucket_->ReadFullManifest("acme/m", "v1");
  ASSERT_TRUE(head.ok());
  for (const ManifestFile& f : (*head)->files) {
    for (const ManifestChunk& c : f.chunks) {
      if (f.path != Shard(1) && f.path != Shard(6)) {
        EXPECT_NE(c.origin, 0u) << f.path;
      }
    }
  }
}

TEST_F(StagedVersionTest, TwoPartsWritingOnePathPublishNothingUntilOneLetsGo) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(3, 3);
  auto a = Part("a", 2, {3}, v0);
  ASSERT_TRUE(a.ok());
  auto b = Part("b", 2, {3, 4}, v0);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().kind(), ErrorKind::kConflict);
  EXPECT_NE(b.status().message().find(Shard(3)), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("part a"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("part b"), std::string::npos) << b.status().message();
  EXPECT_FALSE(bucket_->store().Head(Bucket::ManifestKey("acme/m", "v1")).ok());
  // The other writer reads the reason instead of waiting on.
  StagedVersion other(*bucket_, "acme/m", "v1");
  auto parts = other.ReadParts();
  ASSERT_TRUE(parts.ok());
  ASSERT_EQ(parts->size(), 2u);
  auto st = other.Step((*parts)[0]);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->kind, StagedState::kConflict);
  // b submits again without the shared path: the version is published, b's shard 4 and a's 3.
  auto again = Part("b", 2, {4}, v0);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->kind, StagedState::kPublished) << again->message;
  std::map<std::string, fs::path> expected;
  for (int i = 0; i < kShards; ++i) expected[Shard(i)] = root_ / "v0" / Shard(i);
  expected[Shard(3)] = root_ / "part-a" / Shard(3);
  expected[Shard(4)] = root_ / "part-b" / Shard(4);
  ExpectVersionHolds("v1", expected);
}

TEST_F(StagedVersionTest, APartWithAnotherParentIsRefusedNamingBoth) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(0, 1);
  std::vector<PushFile> files = {WriteShard(root_ / "v0b", 0)};
  auto v0b = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v0b"}, v0, files, options_);
  ASSERT_TRUE(v0b.ok());
  ASSERT_TRUE(Part("a", 2, {0}, v0).ok());
  auto b = Part("b", 2, {1}, v0b->manifest);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().kind(), ErrorKind::kConflict);
  EXPECT_NE(b.status().message().find("v0b"), std::string::npos) << b.status().message();
  EXPECT_NE(b.status().message().find("parent v0 "), std::string::npos) << b.status().message();
  // Refused before anything of b was submitted.
  auto parts = StagedVersion(*bucket_, "acme/m", "v1").ReadParts();
  ASSERT_TRUE(parts.ok());
  EXPECT_EQ(parts->size(), 1u);
  // And a different N is refused too.
  auto c = Part("c", 3, {2}, v0);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("2 parts"), std::string::npos) << c.status().message();
}

TEST_F(StagedVersionTest, AOneWriterPushOfAStagedVersionIsRefused) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(2, 2);
  ASSERT_TRUE(Part("a", 2, {2}, v0).ok());
  std::vector<PushFile> files = {WriteShard(root_ / "alone", 3)};
  auto alone = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v1"}, v0, files, options_);
  ASSERT_FALSE(alone.ok());
  EXPECT_EQ(alone.status().kind(), ErrorKind::kConflict);
  EXPECT_NE(alone.status().message().find("--parts"), std::string::npos) << alone.status().message();
  EXPECT_FALSE(bucket_->store().Head(Bucket::ManifestKey("acme/m", "v1")).ok());
}

// The writer that completed the set died before publishing (its record is in, no head): a
// waiting writer publishes after the fallback delay.
TEST_F(StagedVersionTest, AWaiterPublishesWhenTheCompleterDiedBeforePublishing) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(0, 1);
  ASSERT_TRUE(Part("a", 2, {0}, v0).ok());
  auto records = StagedVersion(*bucket_, "acme/m", "v1").ReadParts();
  ASSERT_TRUE(records.ok());
  ASSERT_EQ(records->size(), 1u);
  // Part b (it writes nothing) puts its record and dies before it looks: the set is complete
  // and nobody has published.
  const PartRecord b = EmptyPart("b", 2);
  ASSERT_TRUE(bucket_->store().Put(StagedVersion::Prefix("acme/m", "v1") + "parts/b", StagedVersion::SerializeRecord(b)).ok());
  StagedVersion waiter(*bucket_, "acme/m", "v1");
  auto first = waiter.Step((*records)[0]);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->kind, StagedState::kWaiting) << "the fallback came before its delay";
  const auto start = std::chrono::steady_clock::now();
  auto st = waiter.Wait((*records)[0], start + 20s);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  EXPECT_EQ(st->kind, StagedState::kPublished);
  EXPECT_GE(std::chrono::steady_clock::now() - start, StagedVersion::kPublishFallback - 500ms);
  std::map<std::string, fs::path> expected;
  for (int i = 0; i < kShards; ++i) expected[Shard(i)] = root_ / "v0" / Shard(i);
  expected[Shard(0)] = root_ / "part-a" / Shard(0);
  ExpectVersionHolds("v1", expected);
}

TEST_F(StagedVersionTest, APartSubmittedTwiceCountsOnce) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  ASSERT_TRUE(Part("a", 3, {0}, v0).ok());
  Step(0, 9);
  auto again = Part("a", 3, {0}, v0);  // the same node after a restart, with newer bytes
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->kind, StagedState::kWaiting);
  EXPECT_EQ(again->in.size(), 1u);
  auto b = Part("b", 3, {1}, v0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->kind, StagedState::kWaiting) << "published with 2 of 3 parts";
  auto c = Part("c", 3, {2}, v0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->kind, StagedState::kPublished);
  std::map<std::string, fs::path> expected;
  for (int i = 0; i < kShards; ++i) expected[Shard(i)] = root_ / "v0" / Shard(i);
  expected[Shard(0)] = root_ / "part-a" / Shard(0);  // the second submission's bytes
  expected[Shard(1)] = root_ / "part-b" / Shard(1);
  expected[Shard(2)] = root_ / "part-c" / Shard(2);
  ExpectVersionHolds("v1", expected);
}

TEST_F(StagedVersionTest, WaitingTimesOutKeepingThePartAndDiscardStopsIt) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  auto a = Part("a", 2, {0}, v0, /*wait=*/true, 300ms);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().kind(), ErrorKind::kTimeout);
  EXPECT_NE(a.status().message().find("1 of 2"), std::string::npos) << a.status().message();
  auto listed = StagedVersion::List(*bucket_, "acme/m");
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].parts, 2);
  ASSERT_EQ((*listed)[0].in.size(), 1u);
  ASSERT_TRUE((*listed)[0].in[0].meta.has_value());
  EXPECT_EQ((*listed)[0].in[0].meta->files, 1u);
  // Discarded from another node: the waiter sees its record gone.
  StagedVersion staged(*bucket_, "acme/m", "v1");
  auto parts = staged.ReadParts();
  ASSERT_TRUE(parts.ok());
  ASSERT_EQ(parts->size(), 1u);
  auto removed = StagedVersion(*bucket_, "acme/m", "v1").Discard();
  ASSERT_TRUE(removed.ok());
  EXPECT_GE(*removed, 2u);
  auto st = staged.Step((*parts)[0]);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->kind, StagedState::kGone);
  EXPECT_NE(st->message.find("discard"), std::string::npos) << st->message;
  EXPECT_FALSE(bucket_->store().Head(Bucket::ManifestKey("acme/m", "v1")).ok());
}

TEST_F(StagedVersionTest, GcKeepsAStagedPartsPacksUntilItsGraceEnds) {
  auto v0 = PushBase();
  ASSERT_TRUE(v0);
  Step(5, 5);
  auto a = Part("a", 2, {5}, v0);
  ASSERT_TRUE(a.ok());
  auto record = StagedVersion(*bucket_, "acme/m", "v1").ReadParts();
  ASSERT_TRUE(record.ok());
  ASSERT_EQ(record->size(), 1u);
  std::vector<Hash128> own = (*record)[0].manifest.packs;
  ASSERT_FALSE(own.empty());
  auto gc = CollectGarbage(*bucket_, GcOptions{});
  ASSERT_TRUE(gc.ok()) << gc.status().ToString();
  EXPECT_EQ(gc->staged_parts, 1u);
  EXPECT_EQ(gc->live_leases, 0u) << "the part's lease outlived its push";
  for (const Hash128& p : own) EXPECT_TRUE(bucket_->store().Head(Bucket::PackKey(p)).ok()) << "gc took a staged pack";
  // Past the grace: the record and its own packs go (the parent's stay).
  GcOptions expire;
  expire.staged_grace = 0ms;
  gc = CollectGarbage(*bucket_, expire);
  ASSERT_TRUE(gc.ok());
  ASSERT_EQ(gc->expired_parts.size(), 1u);
  EXPECT_GT(gc->deleted_packs, 0u);
  EXPECT_TRUE(StagingEmpty());
  auto v0_again = bucket_->ReadFullManifest("acme/m", "v0");
  ASSERT_TRUE(v0_again.ok());
  for (const Hash128& p : v0_again->get()->packs) EXPECT_TRUE(bucket_->store().Head(Bucket::PackKey(p)).ok());
}

// The publish reads the part records, the parent's head and sections, and writes one table and
// one head: nothing that grows with the chunks (4x more here) beyond those objects' bytes.
TEST_F(StagedVersionTest, TheFinalPublishsRequestsDoNotGrowWithChunks) {
  std::vector<uint64_t> requests;
  for (uint64_t chunk : {64u << 10, 16u << 10}) {
    TearDown();
    SetUp();
    options_.chunk_bytes = chunk;
    auto v0 = PushBase();
    ASSERT_TRUE(v0);
    for (int k = 0; k < 3; ++k) ASSERT_TRUE(Part("p" + std::to_string(k), 4, {k}, v0).ok());
    // The last part writes nothing (it only takes part): its Submit is the publish alone.
    const PartRecord last = EmptyPart("p3", 4);
    StagedVersion staged(*bucket_, "acme/m", "v1");
    const uint64_t before = store_->counters().requests;
    auto st = staged.Submit(last);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    ASSERT_EQ(st->kind, StagedState::kPublished) << st->message;
    requests.push_back(store_->counters().requests - before);
    auto m = bucket_->ReadFullManifest("acme/m", "v1");
    ASSERT_TRUE(m.ok());
    EXPECT_EQ((*m)->files.size(), static_cast<size_t>(kShards));
  }
  EXPECT_EQ(requests[0], requests[1]) << "the publish's requests grew with the chunks";
  EXPECT_LT(requests[0], 40u + 2u * kShards);
}

}  // namespace
}  // namespace weightfs
