// End-to-end tests of the bucket engine on a local directory bucket: push, pull, verify, the
// cache's role in following a chain, keyframes, conflicts, corruption, gc.
#include <fcntl.h>
#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <new>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>

#include "core/safetensors.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/external_base.h"
#include "hub/engine/gc.h"
#include "hub/engine/lease.h"
#include "hub/engine/materializer.h"
#include "hub/engine/push_record.h"
#include "hub/engine/version_reader.h"
#include "hub/engine/version_writer.h"
#include "hub/store/local_store.h"
#include "hub/store/store_wrapper.h"
#include "tests/testing/fault_store.h"
#include "tests/testing/log_capture.h"
#include "tests/testing/safetensors_builder.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

void WriteFile(const std::string& path, std::span<const uint8_t> bytes) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A bf16 "model": a few tensors of small normal-ish values, and a training step that moves
// ~`fraction` of the elements by one unit in the last place.
struct Model {
  std::vector<TensorInfo> tensors;
  std::vector<std::vector<uint16_t>> values;

  static Model Make(uint64_t seed, std::vector<std::pair<std::string, uint64_t>> shapes) {
    Model m;
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (auto& [name, n] : shapes) {
      TensorInfo t;
      t.name = name;
      t.dtype = DType::kBF16;
      t.shape = {n};
      m.tensors.push_back(t);
      std::vector<uint16_t> v(n);
      for (auto& x : v) {
        float f = normal(rng);
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        x = static_cast<uint16_t>(bits >> 16);
      }
      m.values.push_back(std::move(v));
    }
    return m;
  }
  void Step(uint64_t seed, double fraction) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(0, 1);
    for (auto& v : values) {
      for (auto& x : v) {
        if (u(rng) < fraction) x = static_cast<uint16_t>(x + ((rng() & 1) ? 1 : -1));
      }
    }
  }
  std::vector<uint8_t> Bytes() {
    test::SafetensorsBuilder b;
    for (size_t i = 0; i < tensors.size(); ++i) {
      const uint8_t* p = reinterpret_cast<const uint8_t*>(values[i].data());
      b.Add(tensors[i].name, tensors[i].dtype, tensors[i].shape, std::vector<uint8_t>(p, p + values[i].size() * 2));
    }
    return b.Build();
  }
};

class BucketEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-engine-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "bucket");
    auto local = LocalStore::Open((root_ / "bucket").string());
    ASSERT_TRUE(local.ok());
    faulty_ = std::make_shared<test::FaultStore>(std::shared_ptr<Store>(std::move(local).value()));
    store_ = std::make_shared<CountingStore>(faulty_);
    ASSERT_TRUE(Bucket::Init(*store_).ok());
    auto b = Bucket::Open(store_);
    ASSERT_TRUE(b.ok()) << b.status().ToString();
    bucket_ = std::move(b).value();
    options_.chunk_bytes = 64 << 10;
    options_.pack_bytes = 256 << 10;
    model_ = Model::Make(1, {{"embed", 300000}, {"layer.0.q", 70000}, {"layer.0.k", 70000}, {"norm", 512}});
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<ChunkCache> Cache(const std::string& name, uint64_t size = 1ull << 30) {
    auto c = ChunkCache::Open((root_ / name).string(), size);
    EXPECT_TRUE(c.ok());
    return std::move(c).value();
  }

  // Writes version k's files to src/vk and returns the dir.
  std::string WriteVersion(int k) {
    std::string dir = (root_ / ("src/v" + std::to_string(k))).string();
    WriteFile(dir + "/model.safetensors", model_.Bytes());
    std::vector<uint8_t> opaque(100000 + static_cast<size_t>(k));
    for (size_t i = 0; i < opaque.size(); ++i) opaque[i] = static_cast<uint8_t>(i * 7 + (i % 1000 == 0 ? k : 0));
    WriteFile(dir + "/sub/optimizer.bin", opaque);
    return dir;
  }

  Expected<PushResult> Push(int k, ChunkCache* cache, std::shared_ptr<const Manifest> parent) {
    auto files = FilesUnder(WriteVersion(k));
    EXPECT_TRUE(files.ok());
    return PushVersion(*bucket_, cache, pool_, {"acme/m", "v" + std::to_string(k)}, parent, *files,
                       options_);
  }

  // Pushes versions 0..n-1, each a training step after the previous.
  std::vector<std::shared_ptr<const Manifest>> PushChain(int n, ChunkCache* cache) {
    std::vector<std::shared_ptr<const Manifest>> out;
    for (int k = 0; k < n; ++k) {
      if (k > 0) model_.Step(100 + k, 0.01);
      auto r = Push(k, cache, out.empty() ? nullptr : out.back());
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (!r.ok()) break;
      out.push_back(r->manifest);
    }
    return out;
  }

  void ExpectSameTree(const std::string& a, const std::string& b) {
    for (const auto& e : fs::recursive_directory_iterator(a)) {
      if (!e.is_regular_file()) continue;
      std::string rel = fs::relative(e.path(), a).string();
      EXPECT_EQ(ReadFile(e.path().string()), ReadFile(b + "/" + rel)) << rel;
    }
  }

  fs::path root_;
  std::shared_ptr<test::FaultStore> faulty_;  // lets a test fail Puts, or make pack reads and writes throw
  std::shared_ptr<CountingStore> store_;
  std::unique_ptr<Bucket> bucket_;
  ThreadPool pool_{4};
  PushOptions options_;
  Model model_;
};

TEST_F(BucketEngineTest, PushedChainPullsBackBitExact) {
  auto push_cache = Cache("push-cache");
  auto chain = PushChain(5, push_cache.get());
  ASSERT_EQ(chain.size(), 5u);
  EXPECT_FALSE(chain[0]->parent.has_value());
  EXPECT_EQ(chain[4]->parent.value(), "v3");
  EXPECT_LT(chain[1]->stats.stored_bytes * 10, chain[0]->stats.stored_bytes);
  EXPECT_NEAR(chain[2]->stats.changed_fraction(), 0.01, 0.005);
  for (int k = 0; k < 5; ++k) {
    // A cold cache per version: every chain is walked down to its keyframes.
    auto cache = Cache("pull-cache-" + std::to_string(k));
    Materializer mat(bucket_.get(), cache.get());
    std::string dest = (root_ / ("out/v" + std::to_string(k))).string();
    ASSERT_TRUE(PullVersion(mat, pool_, *chain[k], dest).ok());
    ExpectSameTree((root_ / ("src/v" + std::to_string(k))).string(), dest);
    Materializer verifier(bucket_.get(), nullptr);
    EXPECT_TRUE(VerifyVersion(verifier, pool_, *chain[k]).ok());
  }
}

// A file cut short while push reads it (by pread: no map, no SIGBUS) fails the push, naming
// the file; nothing is published. The cut comes after the first chunk is encoded.
TEST_F(BucketEngineTest, AFileTruncatedWhilePushReadsItFailsAndPublishesNothing) {
  auto chain = PushChain(1, nullptr);
  ASSERT_EQ(chain.size(), 1u);
  model_.Step(9, 0.01);
  const std::string dir = WriteVersion(1);
  auto files = FilesUnder(dir);
  ASSERT_TRUE(files.ok());
  const std::string victim = dir + "/model.safetensors";
  PushOptions options = options_;
  std::atomic<bool> cut{false};
  options.progress = [&](uint64_t, uint64_t) {
    if (!cut.exchange(true)) fs::resize_file(victim, 100);
  };
  auto pushed = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v1"}, chain[0], *files, options);
  ASSERT_FALSE(pushed.ok());
  EXPECT_EQ(pushed.status().kind(), ErrorKind::kIOError) << pushed.status().ToString();
  EXPECT_NE(pushed.status().message().find(victim + " was truncated while it was being read"), std::string::npos)
      << pushed.status().ToString();
  EXPECT_FALSE(bucket_->ReadManifest("acme/m", "v1").ok());
}

// push records each pushed file's chunks in the cache as one reference index file (not a cache
// file per chunk, not a copy); every chunk is then served from the pushed file, by this cache
// and by another instance on the same directory (the next process). The next push finds its
// parent's chunks there without reading a pack, and pull records its files the same way.
TEST_F(BucketEngineTest, PushAndPullRecordOneReferenceIndexPerFile) {
  auto cache = Cache("node");
  auto v0 = Push(0, cache.get(), nullptr);
  ASSERT_TRUE(v0.ok()) << v0.status().ToString();
  struct Walk {
    std::set<std::string> refs;
    size_t legacy = 0, chunks = 0;
  };
  auto walk = [&] {
    Walk w;
    for (const auto& e : fs::recursive_directory_iterator(root_ / "node")) {
      if (!e.is_regular_file()) continue;
      const std::string rel = fs::relative(e.path(), root_ / "node").string();
      if (rel.starts_with("refs/")) {
        w.refs.insert(e.path().filename().string());
      } else if (rel.ends_with(".ref")) {
        w.legacy++;
      } else if (!rel.starts_with("chunks/.tmp/") && rel != "chunks/.lock") {
        w.chunks++;
      }
    }
    return w;
  };
  auto name_of = [](const fs::path& p) {
    const std::string abs = fs::absolute(p).string();
    return HashChunk({reinterpret_cast<const uint8_t*>(abs.data()), abs.size()}).ToHex();
  };
  const fs::path src = root_ / "src/v0";
  Walk w = walk();
  EXPECT_EQ(w.refs, (std::set<std::string>{name_of(src / "model.safetensors"), name_of(src / "sub/optimizer.bin")}));
  EXPECT_EQ(w.legacy, 0u);
  EXPECT_EQ(w.chunks, 0u);
  auto again = Cache("node");
  size_t chunks = 0;
  for (const ManifestFile& f : v0->manifest->files) {
    const std::vector<uint8_t> bytes = ReadFile((src / f.path).string());
    for (const ManifestChunk& c : f.chunks) {
      for (ChunkCache* k : {cache.get(), again.get()}) {
        ByteBuffer out;
        ASSERT_TRUE(k->Get(c.hash, &out)) << f.path << " @" << c.offset;
        EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(c.offset),
                               bytes.begin() + static_cast<ptrdiff_t>(c.offset + c.length)));
      }
      ++chunks;
    }
  }
  EXPECT_GT(chunks, 10u);

  // The next push reads its parent's chunks from v0's files: a pack read would throw.
  faulty_->ThrowBadAlloc(test::FaultStore::On(test::StoreOp::kGet, "packs/"));
  model_.Step(101, 0.01);
  auto v1 = Push(1, again.get(), v0->manifest);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_GT(v1->delta_chunks, 0u);
  faulty_->Clear();

  // pull: one more index file per pulled file.
  Materializer mat(bucket_.get(), cache.get());
  ReadOptions read;
  read.cache = cache.get();
  const fs::path out = root_ / "out";
  ASSERT_TRUE(PullVersion(mat, pool_, *v1->manifest, out.string(), read).ok());
  w = walk();
  EXPECT_EQ(w.refs.size(), 6u);
  EXPECT_TRUE(w.refs.contains(name_of(out / "model.safetensors")));
  EXPECT_TRUE(w.refs.contains(name_of(out / "sub/optimizer.bin")));
  EXPECT_EQ(w.legacy, 0u);
}

// Issue 29, item 4: a delta push whose uploads failed part way (a job killed, a bucket that
// went away) keeps a record of the payloads that are in the bucket; the same push again reuses
// exactly those whose chunk bytes and parent chunk are unchanged, sends the rest, and the
// version reads back bit-exact. If the file changed in between, its changed chunks are encoded
// anew (the record is checked against the bytes, never trusted).
TEST_F(BucketEngineTest, AnInterruptedPushResumesFromItsRecord) {
  auto chain = PushChain(1, nullptr);
  ASSERT_EQ(chain.size(), 1u);
  model_.Step(77, 0.05);
  PushOptions options = options_;
  options.pack_bytes = 4 << 10;  // many small packs
  const std::string record_path = (root_ / "cache/pushes/v1.jsonl").string();
  auto files = FilesUnder(WriteVersion(1));
  ASSERT_TRUE(files.ok());
  for (const bool change_between : {false, true}) {
    SCOPED_TRACE(change_between ? "the file changed before the resume" : "the same bytes");
    const std::string version = change_between ? "v2" : "v1";
    {
      PushRecord record(record_path);
      options.record = &record;
      faulty_->Fail(test::FaultStore::On(test::StoreOp::kPut, "packs/").After(3), Status::IOError("bucket went away"));
      auto failed = PushVersion(*bucket_, nullptr, pool_, {"acme/m", version}, chain[0], *files, options);
      ASSERT_FALSE(failed.ok());
      faulty_->Clear();
      EXPECT_GT(record.recorded_bytes(), 0u) << "the packs that went up are recorded";
    }
    if (change_between) {
      model_.Step(78, 0.05);
      files = FilesUnder(WriteVersion(1));
      ASSERT_TRUE(files.ok());
    }
    const uint64_t sent_before = store_->counters().bytes_sent;
    PushRecord record(record_path);
    options.record = &record;
    auto pushed = PushVersion(*bucket_, nullptr, pool_, {"acme/m", version}, chain[0], *files, options);
    ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
    const uint64_t sent = store_->counters().bytes_sent - sent_before;
    EXPECT_GT(record.loaded_chunks(), 0u);
    EXPECT_FALSE(fs::exists(record_path)) << "published: the record is gone";
    if (!change_between) {
      EXPECT_EQ(pushed->resumed_chunks, record.loaded_chunks());
      EXPECT_GT(pushed->delta_chunks, pushed->resumed_chunks) << "deltas, and not all of them resumed";
      // What this run sent: the payloads it did not resume, and the manifest.
      EXPECT_LT(sent, pushed->manifest->stats.stored_bytes - pushed->resumed_bytes + (64u << 10));
    } else {
      EXPECT_LT(pushed->resumed_chunks, record.loaded_chunks()) << "changed chunks are not reused";
    }
    Materializer mat(bucket_.get(), nullptr);
    const std::string out = (root_ / ("out-" + version)).string();
    ASSERT_TRUE(PullVersion(mat, pool_, *pushed->manifest, out).ok());
    ExpectSameTree((root_ / "src/v1").string(), out);
    EXPECT_TRUE(VerifyVersion(mat, pool_, *pushed->manifest).ok());
  }
}

// The record itself: lines are written only for uploaded packs; on reading, a line damaged on
// disk (its own check fails), a line cut by a crash, garbage, and the lines of a pack the bucket
// no longer has are all dropped, never trusted.
TEST_F(BucketEngineTest, APushRecordKeepsOnlyIntactLinesOfPacksTheBucketHas) {
  const std::string path = (root_ / "rec/pushes/x.jsonl").string();
  const std::vector<uint8_t> pack_a(5000, 1), pack_b(6000, 2);
  const Hash128 ha = HashChunk(pack_a), hb = HashChunk(pack_b);
  ASSERT_TRUE(store_->Put(Bucket::PackKey(ha), pack_a).ok());
  ASSERT_TRUE(store_->Put(Bucket::PackKey(hb), pack_b).ok());
  {
    PushRecord r(path);
    ASSERT_TRUE(r.Load(*store_, pool_).ok());
    for (size_t i = 0; i < 6; ++i) {
      PushRecord::Chunk c;
      c.offset = i * 100;
      c.length = 100;
      c.input = HashChunk(std::vector<uint8_t>(1, static_cast<uint8_t>(i)));
      c.pack_offset = i * 10;
      c.payload_bytes = 10;
      r.Add("f", i, c, i < 3 ? 0 : 1);
    }
    r.Add("f", 6, PushRecord::Chunk{}, 2);  // its pack never uploads: never written
    r.PackUploaded(0, ha, pack_a.size());
    r.PackUploaded(1, hb, pack_b.size());
    EXPECT_EQ(r.recorded_bytes(), pack_a.size() + pack_b.size());
  }
  std::vector<std::string> lines;
  {
    std::ifstream in(path);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  ASSERT_EQ(lines.size(), 7u);  // the header and six chunks
  const size_t digit = lines[1].find("\"o\":0");
  ASSERT_NE(digit, std::string::npos) << lines[1];
  lines[1][digit + 4] = '7';               // a flipped byte in chunk 0's line
  lines.push_back("{\"f\":\"f\",\"i\":9");  // cut by a crash
  lines.push_back("not json at all");
  {
    std::ofstream out(path, std::ios::trunc);
    for (const std::string& l : lines) out << l << "\n";
  }
  ASSERT_TRUE(store_->Delete(Bucket::PackKey(hb)).ok());  // gc took pack b meanwhile
  PushRecord again(path);
  ASSERT_TRUE(again.Load(*store_, pool_).ok());
  EXPECT_EQ(again.loaded_chunks(), 2u);  // chunks 1 and 2: 0 is damaged, 3-5 lost their pack
  EXPECT_EQ(again.Find("f", 0), nullptr);
  ASSERT_NE(again.Find("f", 1), nullptr);
  EXPECT_EQ(again.Find("f", 1)->pack, ha);
  EXPECT_EQ(again.Find("f", 1)->pack_offset, 10u);
  EXPECT_EQ(again.Find("f", 3), nullptr);
  EXPECT_EQ(again.loaded_packs(), 1u);
  EXPECT_EQ(again.loaded_bytes(), pack_a.size());
}

// What a mount's drafts do: each file encoded on its own (a one-file manifest per file, under
// the draft's name), an untouched file inherited from the parent, the parts assembled under
// another version name. The result stores what a push of the same files stores, with the same
// recipes, and pulls back bit-exact.
TEST_F(BucketEngineTest, FilesEncodedOneAtATimeAssembleIntoWhatPushMakes) {
  auto chain = PushChain(2, nullptr);
  ASSERT_EQ(chain.size(), 2u);
  model_.Step(300, 0.01);
  const std::string dir = WriteVersion(2);
  auto pushed = Push(2, nullptr, chain[1]);
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();

  // Only model.safetensors is "written"; sub/optimizer.bin is inherited from v1 (so its bytes
  // are v1's, and the expected tree is v1's file there).
  const std::string written = dir + "/model.safetensors";
  std::vector<uint8_t> bytes = ReadFile(written);
  VersionEncoder encoder(*bucket_, nullptr, pool_, {"acme/m", "draft"}, chain[1], options_);
  ASSERT_TRUE(encoder.AddFile("model.safetensors", bytes, written).ok());
  Expected<Manifest> part = encoder.Finish();
  ASSERT_TRUE(part.ok()) << part.status().ToString();
  // A part survives serialization (drafts keep them on disk).
  Expected<Manifest> reread = ParseManifest(SerializeManifest(*part));
  ASSERT_TRUE(reread.ok()) << reread.status().ToString();

  Manifest m;
  m.model = "acme/m";
  m.version = "v2b";
  m.versions = {"v2b"};
  m.parent = "v1";
  m.chunk_bytes = options_.chunk_bytes;
  AppendFileFrom(*chain[1], *chain[1]->FindFile("sub/optimizer.bin"), &m, /*src_is_dst=*/false);
  AppendFileFrom(*reread, reread->files[0], &m, /*src_is_dst=*/true);
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files[0].path, "model.safetensors") << "files stay sorted by path";
  m.stats = reread->stats;
  m.created = FormatUtc(NowMs());
  ASSERT_TRUE(bucket_->PublishManifest(m).ok());
  auto published = bucket_->ReadFullManifest("acme/m", "v2b");  // (its rows, not only its head)
  ASSERT_TRUE(published.ok()) << published.status().ToString();

  // The written file's recipes are push's: same encodings, lengths, bases (by name).
  const ManifestFile& a = *(*published)->FindFile("model.safetensors");
  const ManifestFile& b = *pushed->manifest->FindFile("model.safetensors");
  ASSERT_EQ(a.chunks.size(), b.chunks.size());
  for (size_t i = 0; i < a.chunks.size(); ++i) {
    EXPECT_EQ(a.chunks[i].hash, b.chunks[i].hash) << i;
    EXPECT_EQ(a.chunks[i].encoding, b.chunks[i].encoding) << i;
    EXPECT_EQ(a.chunks[i].ref.length, b.chunks[i].ref.length) << i;
    EXPECT_EQ((*published)->versions[a.chunks[i].origin] == "v2b",
              pushed->manifest->versions[b.chunks[i].origin] == "v2") << i;
  }
  EXPECT_EQ((*published)->stats.stored_bytes + 0, reread->stats.stored_bytes);

  auto cache = Cache("assembled");
  Materializer mat(bucket_.get(), cache.get());
  const std::string out = (root_ / "out-assembled").string();
  ASSERT_TRUE(PullVersion(mat, pool_, **published, out).ok());
  EXPECT_EQ(ReadFile(out + "/model.safetensors"), bytes);
  EXPECT_EQ(ReadFile(out + "/sub/optimizer.bin"), ReadFile((root_ / "src/v1/sub/optimizer.bin").string()));
}

TEST_F(BucketEngineTest, NodeHoldingVersionNFetchesOnlyTheDeltaOfNPlus1) {
  auto chain = PushChain(4, nullptr);
  auto cache = Cache("node");
  {
    Materializer mat(bucket_.get(), cache.get());
    ASSERT_TRUE(PullVersion(mat, pool_, *chain[2], (root_ / "out2").string()).ok());
  }
  Materializer mat(bucket_.get(), cache.get());
  ASSERT_TRUE(PullVersion(mat, pool_, *chain[3], (root_ / "out3").string()).ok());
  // Exactly the payloads v3 wrote: unchanged chunks hit the cache, changed ones apply one delta.
  EXPECT_EQ(mat.stats().payload_bytes.load(), chain[3]->stats.stored_bytes);
  ExpectSameTree((root_ / "src/v3").string(), (root_ / "out3").string());
}

TEST_F(BucketEngineTest, ColdPullFetchesEachNeededPayloadOnce) {
  auto chain = PushChain(4, nullptr);
  auto cache = Cache("cold");
  Materializer mat(bucket_.get(), cache.get());
  ASSERT_TRUE(PullVersion(mat, pool_, *chain[3], (root_ / "out").string()).ok());
  // What the chain needs: for every chunk, its keyframe and every delta up to v3.
  uint64_t needed = 0;
  for (const auto& m : chain) needed += m->stats.stored_bytes;
  EXPECT_LE(mat.stats().payload_bytes.load(), needed);
  EXPECT_GE(mat.stats().payload_bytes.load(), chain[0]->stats.stored_bytes);
}

TEST_F(BucketEngineTest, KeyframePolicyBoundsChainDepth) {
  options_.keyframes.max_depth = 2;
  auto chain = PushChain(6, nullptr);
  ASSERT_EQ(chain.size(), 6u);
  bool saw_refresh = false;
  for (const auto& f : chain[5]->files) {
    for (const auto& c : f.chunks) {
      EXPECT_LE(c.depth, 2u);
      if (c.origin == 0 && !c.is_delta()) saw_refresh = true;
    }
  }
  EXPECT_TRUE(saw_refresh);
  auto cache = Cache("c");
  Materializer mat(bucket_.get(), cache.get());
  ASSERT_TRUE(PullVersion(mat, pool_, *chain[5], (root_ / "out").string()).ok());
  ExpectSameTree((root_ / "src/v5").string(), (root_ / "out").string());
}

TEST_F(BucketEngineTest, UnchangedVersionStoresNothing) {
  auto chain = PushChain(1, nullptr);
  auto r = Push(1, nullptr, chain[0]);  // same model bytes; the opaque file differs slightly
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->delta_chunks + r->full_chunks, 2u);  // only the opaque file's two changed chunks
  EXPECT_LT(r->manifest->stats.stored_bytes, 1000u);
}

// A version is never encoded against a parent whose history holds it (itself, or a descendant
// of it): its inherited chunks would point at its own fresh packs. Refused before anything is
// uploaded, on every path (one file at a time, and a whole push), with the published chain
// untouched. (push --parts once run again after its publish encoded v1 against the latest, v1
// itself, and died in VersionEncoder::Finish.)
TEST_F(BucketEngineTest, AParentWhoseHistoryHoldsTheTargetIsRefused) {
  auto chain = PushChain(3, nullptr);
  ASSERT_EQ(chain.size(), 3u);
  const uint64_t puts_before = store_->counters().puts.load();
  for (const char* target : {"v2", "v1", "v0"}) {
    SCOPED_TRACE(target);
    VersionEncoder encoder(*bucket_, nullptr, pool_, {"acme/m", target}, chain[2], options_);
    const std::string written = (root_ / "src/v2/model.safetensors").string();
    std::vector<uint8_t> bytes = ReadFile(written);
    Status added = encoder.AddFile("model.safetensors", bytes, written);
    EXPECT_EQ(added.kind(), ErrorKind::kInvalidArgument) << added.ToString();
    EXPECT_NE(added.message().find("history already holds"), std::string::npos) << added.ToString();
    Expected<Manifest> finished = encoder.Finish();
    EXPECT_FALSE(finished.ok());
  }
  auto files = FilesUnder((root_ / "src/v2").string());
  ASSERT_TRUE(files.ok());
  auto pushed = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v1"}, chain[2], *files, options_);
  ASSERT_FALSE(pushed.ok());  // (v1 exists: a conflict before the encode; either way nothing written)
  EXPECT_TRUE(pushed.status().kind() == ErrorKind::kInvalidArgument || pushed.status().kind() == ErrorKind::kConflict)
      << pushed.status().ToString();
  EXPECT_EQ(store_->counters().puts.load(), puts_before) << "nothing is uploaded for a refused encode";
  // A sibling name (not in the parent's history) is still fine.
  auto sibling = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v3"}, chain[2], *files, options_);
  EXPECT_TRUE(sibling.ok()) << sibling.status().ToString();
  Materializer verifier(bucket_.get(), nullptr);
  for (const auto& m : chain) EXPECT_TRUE(VerifyVersion(verifier, pool_, *m).ok()) << m->version;
}

TEST_F(BucketEngineTest, ConcurrentPushesOfOneVersionHaveOneWinner) {
  auto chain = PushChain(1, nullptr);
  WriteVersion(1);
  std::vector<Status> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      ThreadPool pool(2);
      auto files = FilesUnder((root_ / "src/v1").string());
      auto r = PushVersion(*bucket_, nullptr, pool, {"acme/m", "race"}, chain[0], *files, options_);
      results[t] = r.status();
    });
  }
  for (auto& t : threads) t.join();
  int ok = 0;
  for (const Status& s : results) {
    if (s.ok()) ++ok;
    else EXPECT_EQ(s.kind(), ErrorKind::kConflict) << s.ToString();
  }
  EXPECT_EQ(ok, 1);
  auto m = bucket_->ReadManifest("acme/m", "race");
  ASSERT_TRUE(m.ok());
  Materializer verifier(bucket_.get(), nullptr);
  EXPECT_TRUE(VerifyVersion(verifier, pool_, **m).ok());
}

TEST_F(BucketEngineTest, FailedUploadPublishesNothing) {
  auto chain = PushChain(1, nullptr);
  model_.Step(5, 0.01);
  // The lease goes through, the first pack fails.
  faulty_->Fail(test::FaultStore::On(test::StoreOp::kPut).After(1), Status::IOError("injected: bucket refuses writes"));
  auto r = Push(1, nullptr, chain[0]);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(bucket_->ReadManifest("acme/m", "v1").status().kind(), ErrorKind::kNotFound);
  faulty_->Clear();
  auto again = Push(1, nullptr, chain[0]);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

void FlipByteIn(const fs::path& file, uint64_t offset) {
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ::close(fd);
}

// A pack with a flipped byte, or shorter than the manifest says — ending inside a payload, or
// before it starts (the store then refuses the range: not a bad request but a truncated pack) —
// is Corruption naming the pack, the version, the file and the chunk; pull writes no file.
TEST_F(BucketEngineTest, CorruptOrTruncatedPackFailsNamingTheChunkAndWritesNoFile) {
  auto chain = PushChain(2, nullptr);
  for (const auto& f : chain[1]->files) {
    for (size_t i = 0; i < f.chunks.size(); ++i) {
      const ManifestChunk& c = f.chunks[i];
      if (c.origin != 0 || c.ref.offset == 0) continue;
      const std::string key = Bucket::PackKey(chain[1]->packs[c.ref.pack]);
      for (const std::string how : {"flip", "truncate inside", "truncate before"}) {
        SCOPED_TRACE(how);
        fs::path pack = root_ / "bucket" / key;
        std::vector<uint8_t> saved = ReadFile(pack.string());
        if (how == "flip") FlipByteIn(pack, c.ref.offset + c.ref.length / 2);
        if (how == "truncate inside") fs::resize_file(pack, c.ref.offset + c.ref.length / 2);
        if (how == "truncate before") fs::resize_file(pack, c.ref.offset / 2);
        auto cache = Cache("cache-" + how.substr(how.size() - 4));
        Materializer mat(bucket_.get(), cache.get());
        Expected<ChunkBytes> one = mat.Shared(*chain[1], f, i);
        ASSERT_FALSE(one.ok());
        EXPECT_EQ(one.status().kind(), ErrorKind::kCorruption) << one.status().ToString();
        EXPECT_NE(one.status().message().find("acme/m@v1 " + f.path), std::string::npos) << one.status().ToString();
        if (how != "flip") {
          EXPECT_NE(one.status().message().find(key + " is truncated"), std::string::npos) << one.status().ToString();
        }
        fs::path dest = root_ / "out";
        fs::remove_all(dest);
        Status s = PullVersion(mat, pool_, *chain[1], dest.string());
        EXPECT_FALSE(s.ok());
        EXPECT_EQ(s.kind(), ErrorKind::kCorruption) << s.ToString();
        EXPECT_NE(s.message().find(f.path), std::string::npos) << s.ToString();
        EXPECT_NE(s.message().find("chunk"), std::string::npos) << s.ToString();
        EXPECT_FALSE(fs::exists(dest / f.path));
        EXPECT_FALSE(fs::exists(dest / (f.path + ".weightfs-partial")));
        Materializer verifier(bucket_.get(), nullptr);
        EXPECT_EQ(VerifyVersion(verifier, pool_, *chain[1]).kind(), ErrorKind::kCorruption);
        WriteFile(pack.string(), saved);
      }
      return;  // one changed chunk is enough
    }
  }
  FAIL() << "no fresh chunk of v1 after the start of its pack";
}

// The mount's read path: Shared hands out the bytes Chunk does, from the buffer it built them in
// (first pass; the cache files are written from it) or from a private copy of the cache file it
// found and verified (second pass, a new materializer: all cache hits). The bytes handed out do
// not change when the cache file is changed in place afterwards.
TEST_F(BucketEngineTest, SharedChunksHaveTheBytesAndCacheHitsArePrivateCopies) {
  options_.chunk_bytes = 256 << 10;  // most chunks are large enough for pooled buffers
  auto chain = PushChain(4, nullptr);
  ASSERT_EQ(chain.size(), 4u);
  auto cache = Cache("cache");
  Materializer verifier(bucket_.get(), nullptr);
  size_t changed = 0;
  for (int pass = 0; pass < 2; ++pass) {
    Materializer mat(bucket_.get(), cache.get());
    for (const ManifestFile& f : chain[3]->files) {
      for (size_t i = 0; i < f.chunks.size(); ++i) {
        Expected<ByteBuffer> want = verifier.Chunk(*chain[3], f, i);
        Expected<ChunkBytes> got = mat.Shared(*chain[3], f, i);
        ASSERT_TRUE(want.ok()) << want.status().ToString();
        ASSERT_TRUE(got.ok()) << got.status().ToString();
        ASSERT_EQ(got->size(), want->size());
        EXPECT_TRUE(std::equal(want->begin(), want->end(), got->data())) << f.path << " " << i;
        if (pass == 0) continue;
        // Change the file the hit came from, in place: the bytes handed out stay right.
        const std::string hex = f.chunks[i].hash.ToHex();
        const fs::path entry = root_ / "cache" / "chunks" / hex.substr(0, 2) / hex;
        ASSERT_TRUE(fs::exists(entry)) << entry;
        FlipByteIn(entry, f.chunks[i].length / 2);
        ++changed;
        EXPECT_TRUE(std::equal(want->begin(), want->end(), got->data())) << f.path << " " << i;
      }
    }
    if (pass == 1) {
      EXPECT_EQ(mat.stats().cache_hits.load(), mat.stats().chunks.load());
    }
  }
  EXPECT_GE(changed, 4u);
}

// Intermediate results of a chain are not hashed on the way (only the final one is), yet a bad
// payload in the middle of a chain is still an error naming the version that wrote it, and
// nothing unverified reaches the cache.
// The materializer fetches a chain's payloads on threads of its own: an allocation failing there
// fails that chunk with ResourceExhausted. It used to end the process (an exception leaving a
// thread), and the build would have waited for the payload forever.
TEST_F(BucketEngineTest, AllocationFailureFetchingAPayloadFailsOnlyThatChunk) {
  auto chain = PushChain(3, nullptr);
  ASSERT_EQ(chain.size(), 3u);
  const ManifestFile& file = *chain[2]->FindFile("model.safetensors");
  size_t deep = file.chunks.size();
  for (size_t i = 0; i < file.chunks.size() && deep == file.chunks.size(); ++i) {
    if (file.chunks[i].depth >= 2) deep = i;  // three payloads, so fetched in parallel
  }
  ASSERT_LT(deep, file.chunks.size()) << "no chunk with a chain of two deltas";
  Materializer mat(bucket_.get(), nullptr);
  faulty_->ThrowBadAlloc(test::FaultStore::On(test::StoreOp::kGet, "packs/"));
  Expected<ByteBuffer> got = mat.Chunk(*chain[2], file, deep);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().kind(), ErrorKind::kResourceExhausted) << got.status().ToString();
  EXPECT_NE(got.status().message().find("out of memory"), std::string::npos) << got.status().ToString();
  EXPECT_NE(got.status().message().find("acme/m@v"), std::string::npos) << got.status().ToString();
  faulty_->Clear();
  got = mat.Chunk(*chain[2], file, deep);  // the materializer and its threads carry on
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(HashChunk(*got), file.chunks[deep].hash);
}

// Packs are uploaded on PackWriter's threads: an allocation failing there fails the push,
// which publishes nothing.
TEST_F(BucketEngineTest, AllocationFailureUploadingAPackFailsThePush) {
  faulty_->ThrowBadAlloc(test::FaultStore::On(test::StoreOp::kPut, "packs/"));
  auto r = Push(0, nullptr, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kResourceExhausted) << r.status().ToString();
  EXPECT_EQ(bucket_->ReadManifest("acme/m", "v0").status().kind(), ErrorKind::kNotFound);
  faulty_->Clear();
  r = Push(0, nullptr, nullptr);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
}

TEST_F(BucketEngineTest, CorruptPayloadInsideAChainIsNamed) {
  options_.chunk_bytes = 256 << 10;
  auto chain = PushChain(3, nullptr);
  ASSERT_EQ(chain.size(), 3u);
  for (const ManifestFile& f2 : chain[2]->files) {
    const ManifestFile* f1 = chain[1]->FindFile(f2.path);
    for (size_t i = 0; f1 && i < f2.chunks.size(); ++i) {
      // A chunk v2 wrote as a delta on v1's, which v1 wrote itself.
      const ManifestChunk& c2 = f2.chunks[i];
      if (c2.origin != 0 || !c2.is_delta() || chain[2]->versions[c2.base] != "v1") continue;
      std::optional<size_t> j = f1->FindChunk(c2.key);
      if (!j || f1->chunks[*j].origin != 0 || !f1->chunks[*j].is_delta()) continue;
      const ManifestChunk& c1 = f1->chunks[*j];
      FlipByteIn(root_ / "bucket" / Bucket::PackKey(chain[1]->packs[c1.ref.pack]),
                 c1.ref.offset + c1.ref.length / 2);
      for (bool shared : {false, true}) {
        auto cache = Cache(shared ? "shared" : "plain");
        Materializer mat(bucket_.get(), cache.get());
        Status s = shared ? mat.Shared(*chain[2], f2, i).status() : mat.Chunk(*chain[2], f2, i).status();
        ASSERT_FALSE(s.ok());
        EXPECT_EQ(s.kind(), ErrorKind::kCorruption) << s.ToString();
        EXPECT_NE(s.message().find("acme/m@v1 " + f2.path), std::string::npos) << s.ToString();
        EXPECT_EQ(cache->size_bytes(), 0u);
        EXPECT_FALSE(cache->Contains(c2.hash));
      }
      return;
    }
  }
  FAIL() << "no chunk of v2 is a delta on a delta of v1";
}

// A node that holds v1 reads v2: v1's chunk comes from the cache straight into the buffer v2's
// chunk is built in, and v2's delta is applied there. The bytes are v2's; a corrupt v2 delta on
// a cached v1 is named (the replay reads v1 from the cache again), and v1's entry stays good.
TEST_F(BucketEngineTest, ADeltaOnACachedAncestorIsAppliedInItsOutputAndABadOneIsNamed) {
  options_.chunk_bytes = 256 << 10;
  auto chain = PushChain(3, nullptr);
  ASSERT_EQ(chain.size(), 3u);
  auto cache = Cache("holder");
  Materializer verifier(bucket_.get(), nullptr);
  {
    Materializer mat(bucket_.get(), cache.get());
    for (const ManifestFile& f : chain[1]->files) {
      for (size_t i = 0; i < f.chunks.size(); ++i) ASSERT_TRUE(mat.Shared(*chain[1], f, i).ok());
    }
  }
  // v2's chunks that are deltas on v1's, of v1's chunk's length.
  const ManifestFile& f2 = *chain[2]->FindFile("model.safetensors");
  const ManifestFile& f1 = *chain[1]->FindFile("model.safetensors");
  std::vector<size_t> on_v1;
  for (size_t i = 0; i < f2.chunks.size(); ++i) {
    const ManifestChunk& c = f2.chunks[i];
    if (c.origin != 0 || !c.is_delta() || chain[2]->versions[c.base] != "v1" || c.length < Materializer::kPooledMinBytes) {
      continue;
    }
    std::optional<size_t> j = f1.FindChunk(c.key);
    if (j && f1.chunks[*j].length == c.length && cache->Contains(f1.chunks[*j].hash)) on_v1.push_back(i);
  }
  ASSERT_GE(on_v1.size(), 2u) << "no chunk of v2 is a delta on a cached chunk of v1";
  {
    Materializer mat(bucket_.get(), cache.get());
    for (size_t i : on_v1) {
      Expected<ByteBuffer> want = verifier.Chunk(*chain[2], f2, i);
      Expected<ChunkBytes> got = mat.Shared(*chain[2], f2, i);
      ASSERT_TRUE(want.ok() && got.ok()) << want.status().ToString() << got.status().ToString();
      ASSERT_EQ(got->size(), want->size());
      EXPECT_TRUE(std::equal(want->begin(), want->end(), got->data())) << i;
    }
    EXPECT_EQ(mat.stats().payloads_fetched.load(), on_v1.size());  // v2's deltas, nothing of v1
  }
  // A corrupt v2 delta on a cached v1 chunk.
  const size_t bad = on_v1.back();
  const ManifestChunk& c2 = f2.chunks[bad];
  const ManifestChunk& c1 = f1.chunks[*f1.FindChunk(c2.key)];
  const std::string hex = c2.hash.ToHex();
  fs::remove(root_ / "holder" / "chunks" / hex.substr(0, 2) / hex);  // (v2's chunk was cached above)
  FlipByteIn(root_ / "bucket" / Bucket::PackKey(chain[2]->packs[c2.ref.pack]), c2.ref.offset + c2.ref.length / 2);
  Materializer mat(bucket_.get(), cache.get());
  Expected<ChunkBytes> got = mat.Shared(*chain[2], f2, bad);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().kind(), ErrorKind::kCorruption) << got.status().ToString();
  EXPECT_NE(got.status().message().find("acme/m@v2 model.safetensors"), std::string::npos) << got.status().ToString();
  EXPECT_FALSE(cache->Contains(c2.hash));
  Expected<ChunkBytes> v1 = mat.Shared(*chain[1], f1, static_cast<size_t>(&c1 - f1.chunks.data()));
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_EQ(HashChunk(std::span<const uint8_t>(v1->data(), v1->size())), c1.hash);
  EXPECT_EQ(cache->stats().corrupt.load(), 0u);
}

TEST_F(BucketEngineTest, GcRemovesOrphansOnlyWhenNoPushIsLive) {
  auto chain = PushChain(2, nullptr);
  // An orphan pack and the dead lease of a push that was killed (a pid that cannot exist).
  std::vector<uint8_t> junk(1000, 7);
  const std::string orphan = Bucket::PackKey(HashChunk(junk));
  ASSERT_TRUE(store_->Put(orphan, junk).ok());
  std::string dead = R"({"host":")" + HostName() + R"(","pid":999999999,"what":"acme/m@x","expires_ms":)" +
                     std::to_string(NowMs() + 600000) + "}";
  ASSERT_TRUE(store_->Put("leases/dead.json", {reinterpret_cast<const uint8_t*>(dead.data()), dead.size()}).ok());
  {
    // A live push (this process) protects every unreferenced pack.
    auto lease = Lease::Acquire(store_.get(), "acme/m@live");
    ASSERT_TRUE(lease.ok());
    auto r = CollectGarbage(*bucket_, {});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->live_leases, 1u);
    EXPECT_EQ(r->deleted_packs, 0u);
    EXPECT_TRUE(store_->Head(orphan).ok());
  }
  auto dry = CollectGarbage(*bucket_, {.dry_run = true});
  ASSERT_TRUE(dry.ok());
  EXPECT_EQ(dry->deleted_packs, 1u);
  EXPECT_TRUE(store_->Head(orphan).ok());
  auto r = CollectGarbage(*bucket_, {});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->deleted_packs, 1u);
  EXPECT_EQ(store_->Head(orphan).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(store_->Head("leases/dead.json").status().kind(), ErrorKind::kNotFound);
  Materializer verifier(bucket_.get(), nullptr);
  for (const auto& m : chain) EXPECT_TRUE(VerifyVersion(verifier, pool_, *m).ok());
}

// Writes that die between the upload of a temporary object and its rename leave it in
// .weightfs-tmp/. gc removes those an hour old (not younger ones: writes in progress) while no
// push holds a live lease, counts them, and removes nothing with --dry-run.
TEST_F(BucketEngineTest, GcRemovesOldTemporariesOfKilledWritesWhenNoPushIsLive) {
  auto chain = PushChain(2, nullptr);
  const fs::path tmp = root_ / "bucket" / ".weightfs-tmp";
  const std::vector<uint8_t> junk(12345, 9);
  WriteFile((tmp / "111-0-42").string(), junk);  // a killed push's pack upload, 2 hours old
  WriteFile((tmp / "222-5-43").string(), std::vector<uint8_t>(100, 1));  // just written
  const timespec two_hours_ago[2] = {{::time(nullptr) - 7200, 0}, {::time(nullptr) - 7200, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, (tmp / "111-0-42").c_str(), two_hours_ago, 0), 0);

  auto listed = store_->ListTemporaries();
  ASSERT_TRUE(listed.ok()) << listed.status().ToString();
  ASSERT_EQ(listed->size(), 2u);
  EXPECT_EQ((*listed)[0].key, ".weightfs-tmp/111-0-42");
  EXPECT_EQ((*listed)[0].size, junk.size());
  EXPECT_NEAR(static_cast<double>((*listed)[0].modified_ms), (::time(nullptr) - 7200) * 1000.0, 2000.0);
  auto page = store_->List("");
  ASSERT_TRUE(page.ok());
  for (const ObjectInfo& o : page->objects) EXPECT_EQ(o.key.find(".weightfs-tmp"), std::string::npos) << o.key;
  {
    // A live push may own any temporary: none is removed.
    auto lease = Lease::Acquire(store_.get(), "acme/m@live");
    ASSERT_TRUE(lease.ok());
    auto r = CollectGarbage(*bucket_, {});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->temporaries, 2u);
    EXPECT_EQ(r->deleted_temporaries, 0u);
    EXPECT_TRUE(fs::exists(tmp / "111-0-42"));
  }
  auto dry = CollectGarbage(*bucket_, {.dry_run = true});
  ASSERT_TRUE(dry.ok());
  EXPECT_EQ(dry->deleted_temporaries, 1u);
  EXPECT_EQ(dry->deleted_temporary_bytes, junk.size());
  EXPECT_EQ(dry->recent_temporaries, 1u);
  EXPECT_TRUE(fs::exists(tmp / "111-0-42"));
  auto r = CollectGarbage(*bucket_, {});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->temporaries, 2u);
  EXPECT_EQ(r->deleted_temporaries, 1u);
  EXPECT_EQ(r->recent_temporaries, 1u);
  EXPECT_FALSE(fs::exists(tmp / "111-0-42"));
  EXPECT_TRUE(fs::exists(tmp / "222-5-43"));
  // With a shorter minimum age the young one goes too; the versions are untouched.
  auto all = CollectGarbage(*bucket_, {.temporary_min_age = std::chrono::milliseconds(0)});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->deleted_temporaries, 1u);
  EXPECT_FALSE(fs::exists(tmp / "222-5-43"));
  Materializer verifier(bucket_.get(), nullptr);
  for (const auto& m : chain) EXPECT_TRUE(VerifyVersion(verifier, pool_, *m).ok());
}

TEST_F(BucketEngineTest, GcKeepLastWithoutRebaseKeepsWhatKeptVersionsBuildOn) {
  options_.keyframes.max_depth = 1;  // v0 FULL, v1 delta, v2 FULL again, v3 delta
  auto chain = PushChain(4, nullptr);
  auto r = CollectGarbage(*bucket_, {.keep_last = 1, .rebase = false});
  ASSERT_TRUE(r.ok());
  // v3's deltas build on v2, so v2 stays; v0 and v1 go (v3's unchanged chunks still point at
  // v0's keyframe payloads, which need only their packs).
  EXPECT_EQ(r->kept_as_base, std::vector<std::string>{"acme/m@v2"});
  EXPECT_EQ(r->retired, (std::vector<std::string>{"acme/m@v0", "acme/m@v1"}));
  for (const std::string& v : r->retired) {
    EXPECT_EQ(bucket_->ReadManifest("acme/m", v.substr(v.find('@') + 1)).status().kind(), ErrorKind::kNotFound) << v;
  }
  auto fresh = Bucket::Open(store_);
  ASSERT_TRUE(fresh.ok());
  auto m = (*fresh)->ReadManifest("acme/m", "v3");
  ASSERT_TRUE(m.ok());
  Materializer verifier(fresh->get(), nullptr);
  EXPECT_TRUE(VerifyVersion(verifier, pool_, **m).ok());
}

TEST_F(BucketEngineTest, GcKeepLastRebasesKeptVersionsAndRemovesTheRest) {
  auto chain = PushChain(5, nullptr);  // one keyframe, four deltas deep
  uint64_t packs_before = 0;
  for (const auto& e : fs::directory_iterator(root_ / "bucket/packs")) packs_before += e.is_regular_file();
  auto dry = CollectGarbage(*bucket_, {.dry_run = true, .keep_last = 2});
  ASSERT_TRUE(dry.ok());
  EXPECT_EQ(dry->retired.size(), 3u);
  EXPECT_TRUE(bucket_->ReadManifest("acme/m", "v0").ok());  // dry run: nothing changed
  auto r = CollectGarbage(*bucket_, {.keep_last = 2});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->retired, (std::vector<std::string>{"acme/m@v0", "acme/m@v1", "acme/m@v2"}));
  EXPECT_TRUE(r->kept_as_base.empty());
  EXPECT_EQ(r->rebased.size(), 1u);  // v3 (its deltas were on v2); v4 builds on v3, kept
  EXPECT_GT(r->deleted_packs, 0u);   // v1's and v2's deltas
  EXPECT_LE(r->deleted_packs, packs_before);
  auto fresh = Bucket::Open(store_);
  ASSERT_TRUE(fresh.ok());
  for (const char* v : {"v3", "v4"}) {
    auto m = (*fresh)->ReadManifest("acme/m", v);
    ASSERT_TRUE(m.ok()) << v;
    Materializer verifier(fresh->get(), nullptr);
    EXPECT_TRUE(VerifyVersion(verifier, pool_, **m).ok()) << v;
    auto cache = Cache(std::string("c") + v);
    Materializer mat(fresh->get(), cache.get());
    ASSERT_TRUE(PullVersion(mat, pool_, **m, (root_ / "out" / v).string()).ok());
    ExpectSameTree((root_ / "src" / v).string(), (root_ / "out" / v).string());
  }
  EXPECT_EQ((*fresh)->ReadManifest("acme/m", "v2").status().kind(), ErrorKind::kNotFound);
}

// gc in another process rewrites the parent a push is encoding against (and retires the version
// its rows build on) before the push publishes: the push's inherited rows are taken from the
// parent's new head when it publishes, so the version reads back bit-exact from a fresh
// process, and this process's chain reads see the rewrite too (Bucket::Revalidate).
TEST_F(BucketEngineTest, APushWhoseParentGcRewroteMeanwhilePublishesOnItsNewHead) {
  auto chain = PushChain(3, nullptr);  // v0 keyframes, v1 and v2 deltas
  // This process holds v2's old head and rows; another process runs gc --keep-last 1.
  auto other = Bucket::Open(store_);
  ASSERT_TRUE(other.ok());
  auto r = CollectGarbage(**other, {.keep_last = 1});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->rebased.size(), 1u);
  ASSERT_EQ(r->retired, (std::vector<std::string>{"acme/m@v0", "acme/m@v1"}));
  model_.Step(300, 0.01);
  auto pushed = Push(3, nullptr, chain[2]);  // encoded against v2's old rows
  ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
  auto fresh = Bucket::Open(store_);
  ASSERT_TRUE(fresh.ok());
  auto v3 = (*fresh)->ReadManifest("acme/m", "v3");
  ASSERT_TRUE(v3.ok());
  Materializer verifier(fresh->get(), nullptr);
  EXPECT_TRUE(VerifyVersion(verifier, pool_, **v3).ok());
  {
    Materializer mat(fresh->get(), nullptr);
    ASSERT_TRUE(PullVersion(mat, pool_, **v3, (root_ / "out3").string()).ok());
    ExpectSameTree((root_ / "src/v3").string(), (root_ / "out3").string());
  }
  // This process: v2's old head is still what it has cached; a chain read through it fails on
  // the retired base, finds the rewrite, and reads right.
  Materializer mine(bucket_.get(), nullptr);
  ASSERT_TRUE(PullVersion(mine, pool_, *chain[2], (root_ / "out2").string()).ok());
  ExpectSameTree((root_ / "src/v2").string(), (root_ / "out2").string());
  EXPECT_GT(mine.stats().rewritten_heads.load(), 0u);
  // A parent retired meanwhile: an error (its chunks cannot be read, or it is gone when the
  // push publishes), nothing published.
  auto gone = PushVersion(*bucket_, nullptr, pool_, {"acme/m", "v9"}, chain[1], *FilesUnder((root_ / "src/v3").string()),
                          options_);
  ASSERT_FALSE(gone.ok());
  EXPECT_NE(gone.status().message().find("v1"), std::string::npos) << gone.status().ToString();
  EXPECT_EQ((*fresh)->ReadManifest("acme/m", "v9").status().kind(), ErrorKind::kNotFound);
}

TEST_F(BucketEngineTest, HeaderChangeKeepsDeltasAndPullsExactly) {
  auto chain = PushChain(2, nullptr);
  // v2 adds a tensor: every data offset shifts, chunk identity by (tensor, index) survives.
  model_.Step(77, 0.01);
  Model extra = Model::Make(9, {{"extra_head", 1000}});
  model_.tensors.insert(model_.tensors.begin(), extra.tensors[0]);
  model_.values.insert(model_.values.begin(), extra.values[0]);
  auto r = Push(2, nullptr, chain[1]);
  ASSERT_TRUE(r.ok());
  EXPECT_GT(r->delta_chunks, 5u);
  auto cache = Cache("c");
  Materializer mat(bucket_.get(), cache.get());
  ASSERT_TRUE(PullVersion(mat, pool_, *r->manifest, (root_ / "out").string()).ok());
  ExpectSameTree((root_ / "src/v2").string(), (root_ / "out").string());
}

// Counts the bytes read from chunk tables (tables/...).
class TableReads : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;
  Status GetInto(std::string_view key, ByteRange range, ByteBuffer* out) override {
    Status s = inner_->GetInto(key, range, out);
    if (s.ok() && key.starts_with("tables/")) {
      bytes += out->size();
      reads++;
    }
    return s;
  }
  std::atomic<uint64_t> bytes{0}, reads{0};
};

// Sections in blocks (core/chunk_table.h; 2 rows a block here, so that every file of a few
// chunks has several): every version reads back bit-exact, also after a new tensor in front
// moved every row (a delta's base row is then in another block of its version), and one chunk
// read from a head reads the index and one block in each version of its chain, not the file's
// rows.
TEST_F(BucketEngineTest, SectionsInBlocksReadOnlyTheBlocksAChunkNeeds) {
  bucket_->set_table_block_rows(2);
  auto chain = PushChain(4, nullptr);
  ASSERT_EQ(chain.size(), 4u);
  model_.Step(77, 0.01);
  Model extra = Model::Make(9, {{"extra_head", 70000}});  // 140 KB in front: rows move by 2-3
  model_.tensors.insert(model_.tensors.begin(), extra.tensors[0]);
  model_.values.insert(model_.values.begin(), extra.values[0]);
  auto moved = Push(4, nullptr, chain[3]);
  ASSERT_TRUE(moved.ok()) << moved.status().ToString();
  EXPECT_GT(moved->delta_chunks, 5u);
  chain.push_back(moved->manifest);
  for (int k = 0; k < 5; ++k) {
    SCOPED_TRACE("v" + std::to_string(k));
    auto cache = Cache("pull-" + std::to_string(k));
    Materializer mat(bucket_.get(), cache.get());
    const std::string dest = (root_ / ("out/v" + std::to_string(k))).string();
    ASSERT_TRUE(PullVersion(mat, pool_, *chain[k], dest).ok());
    ExpectSameTree((root_ / ("src/v" + std::to_string(k))).string(), dest);
    Materializer verifier(bucket_.get(), nullptr);
    EXPECT_TRUE(VerifyVersion(verifier, pool_, *chain[k]).ok());
  }

  // A process that has read nothing reads one chunk near the end of v3's model (depth 3).
  auto tables = std::make_shared<TableReads>(store_);
  std::unique_ptr<Bucket> fresh = Bucket::Open(tables).value();
  std::shared_ptr<const Manifest> head = fresh->ReadManifest("acme/m", "v3").value();
  const ManifestFile* f = head->FindFile("model.safetensors");
  ASSERT_NE(f, nullptr);
  ASSERT_GT(f->section.index_length, 0u);
  ASSERT_GT(f->section.rows, 8u);
  const uint64_t row = f->section.rows - 2;
  Materializer mat(fresh.get(), nullptr);
  Expected<ByteBuffer> bytes = mat.Chunk(*head, *f, row);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(mat.stats().deltas_applied.load(), 3u);
  Expected<std::shared_ptr<const ManifestFile>> block = fresh->RowsOfRow(*head, *f, row);
  ASSERT_TRUE(block.ok());
  EXPECT_EQ((*block)->first_row, row / 2 * 2);
  EXPECT_FALSE((*block)->AllRows());
  const ManifestChunk& c = (*block)->chunks[row - (*block)->first_row];
  EXPECT_TRUE((*block)->Holds(c.offset));
  const std::vector<uint8_t> src = ReadFile((root_ / "src/v3/model.safetensors").string());
  EXPECT_TRUE(std::equal(bytes->begin(), bytes->end(), src.begin() + static_cast<std::ptrdiff_t>(c.offset)));
  // Per version of the chain one read: sections this small (a few KB, under
  // Bucket::kWholeSectionBytes) are read whole, index and block from the same bytes. (Larger
  // ones read the index, then the block: tests/tools/bench_scale_command_test.cc.)
  EXPECT_EQ(tables->reads.load(), 4u);
  // The whole file's rows (what tools read) are every block's.
  Expected<std::shared_ptr<const ManifestFile>> all = fresh->File(*head, *f);
  ASSERT_TRUE(all.ok());
  EXPECT_TRUE((*all)->AllRows());
  ASSERT_EQ((*all)->chunks.size(), f->section.rows);
  EXPECT_EQ((*all)->chunks[row].hash, c.hash);
}

// An ExternalSources over local files ("hf://acme/base@<commit>/<path>" -> dir/<path>) that
// counts what it reads and can be told to return wrong bytes.
class LocalSources : public ExternalSources {
 public:
  explicit LocalSources(std::string dir) : dir_(std::move(dir)) {}
  Expected<std::vector<uint8_t>> Read(std::string_view source, uint64_t offset, uint64_t length) override {
    const std::string path = dir_ + "/" + std::string(source.substr(source.find('/', 5 + 11) + 1));
    std::vector<uint8_t> all = ReadFile(path);
    if (offset + length > all.size()) return Status::IOError("short read of " + std::string(source));
    reads++;
    bytes += length;
    std::vector<uint8_t> out(all.begin() + static_cast<std::ptrdiff_t>(offset),
                             all.begin() + static_cast<std::ptrdiff_t>(offset + length));
    if (corrupt && !out.empty()) out[0] ^= 1;
    return out;
  }
  std::atomic<uint64_t> reads{0}, bytes{0};
  std::atomic<bool> corrupt{false};

 private:
  std::string dir_;
};

constexpr const char* kCommit = "0123456789abcdef0123456789abcdef01234567";

Expected<Manifest> ExternalBaseOf(const std::string& dir, ThreadPool& pool, uint64_t chunk_bytes) {
  std::vector<ExternalBaseFile> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    ExternalBaseFile f;
    f.path = fs::relative(e.path(), dir).string();
    f.source = std::string("hf://acme/base@") + kCommit + "/" + f.path;
    f.size = e.file_size();
    const std::string local = e.path().string();
    f.read = [local](uint64_t offset, uint64_t length) -> Expected<std::vector<uint8_t>> {
      std::vector<uint8_t> all = ReadFile(local);
      if (offset + length > all.size()) return Status::IOError("short");
      return std::vector<uint8_t>(all.begin() + static_cast<std::ptrdiff_t>(offset),
                                  all.begin() + static_cast<std::ptrdiff_t>(offset + length));
    };
    files.push_back(std::move(f));
  }
  return BuildExternalBase({"acme/m", "hf-base"}, std::move(files), pool, chunk_bytes);
}

TEST_F(BucketEngineTest, ExternalBaseIsReadFromItsSourceOnlyWhereNeeded) {
  const std::string base_dir = WriteVersion(0);
  auto sources = std::make_shared<LocalSources>(base_dir);
  bucket_->set_external_sources(sources);
  Expected<Manifest> base = ExternalBaseOf(base_dir, pool_, options_.chunk_bytes);
  ASSERT_TRUE(base.ok()) << base.status().ToString();
  EXPECT_TRUE(base->packs.empty());
  EXPECT_EQ(base->sources.size(), 2u);
  EXPECT_EQ(base->stats.stored_bytes, 0u);
  ASSERT_TRUE(bucket_->PublishManifest(*base).ok());
  const uint64_t bucket_bytes_before = store_->counters().bytes_sent.load();
  auto base_m = bucket_->ReadManifest("acme/m", "hf-base");
  ASSERT_TRUE(base_m.ok()) << base_m.status().ToString();

  // A version on top stores only deltas; unchanged chunks keep reading the source.
  model_.Step(7, 0.01);
  Expected<PushResult> v1 = Push(1, nullptr, *base_m);
  ASSERT_TRUE(v1.ok()) << v1.status().ToString();
  EXPECT_GT(v1->delta_chunks, 0u);
  EXPECT_EQ(v1->full_chunks, 0u);
  EXPECT_LT(store_->counters().bytes_sent.load() - bucket_bytes_before, 200000u);
  EXPECT_FALSE(v1->manifest->sources.empty());  // inherited external recipes

  // Cold pulls of both are bit-exact.
  {
    Materializer mat(bucket_.get(), nullptr);
    ASSERT_TRUE(PullVersion(mat, pool_, **base_m, (root_ / "out0").string()).ok());
    ExpectSameTree(base_dir, (root_ / "out0").string());
    auto reread = bucket_->ReadManifest("acme/m", "v1");
    ASSERT_TRUE(reread.ok());
    ASSERT_TRUE(PullVersion(mat, pool_, **reread, (root_ / "out1").string()).ok());
    ExpectSameTree((root_ / "src/v1").string(), (root_ / "out1").string());
  }

  // One chunk of one tensor reads exactly that chunk's bytes from the source.
  sources->bytes = 0;
  sources->reads = 0;
  auto f_rows = bucket_->File(*base_m, "model.safetensors");  // (a head's file, with its rows)
  ASSERT_TRUE(f_rows.ok()) << f_rows.status().ToString();
  const ManifestFile* f = f_rows->get();
  const size_t idx = f->chunks.size() / 2;
  Materializer mat(bucket_.get(), nullptr);
  auto chunk = mat.Chunk(**base_m, *f, idx);
  ASSERT_TRUE(chunk.ok()) << chunk.status().ToString();
  EXPECT_EQ(sources->reads.load(), 1u);
  EXPECT_EQ(sources->bytes.load(), f->chunks[idx].length);

  // Wrong bytes from the source are refused, naming the chunk.
  sources->corrupt = true;
  auto bad = mat.Chunk(**base_m, *f, idx);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(bad.status().ToString().find("acme/m@hf-base model.safetensors"), std::string::npos)
      << bad.status().ToString();

  // Without a way to read sources the error says so.
  bucket_->set_external_sources(nullptr);
  auto none = mat.Chunk(**base_m, *f, idx);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().ToString().find("external"), std::string::npos) << none.status().ToString();
}

TEST_F(BucketEngineTest, ExternalBaseChecksTheSha256ItIsGiven) {
  const std::string base_dir = WriteVersion(0);
  std::vector<ExternalBaseFile> files(1);
  files[0].path = "model.safetensors";
  files[0].source = std::string("hf://acme/base@") + kCommit + "/model.safetensors";
  const std::vector<uint8_t> bytes = ReadFile(base_dir + "/model.safetensors");
  files[0].size = bytes.size();
  files[0].sha256 = std::string(64, 'a');
  files[0].read = [&](uint64_t o, uint64_t n) -> Expected<std::vector<uint8_t>> {
    return std::vector<uint8_t>(bytes.begin() + static_cast<std::ptrdiff_t>(o),
                                bytes.begin() + static_cast<std::ptrdiff_t>(o + n));
  };
  Expected<Manifest> m = BuildExternalBase({"acme/m", "b"}, files, pool_, 64 << 10);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().kind(), ErrorKind::kCorruption);
  files[0].sha256 = Sha256Hex(bytes);
  m = BuildExternalBase({"acme/m", "b"}, files, pool_, 64 << 10);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->files[0].sha256, files[0].sha256);
}

TEST(ExternalSourceNameTest, RefusesHostileSources) {
  const std::string c = kCommit;
  EXPECT_TRUE(ValidateSourceName("hf://acme/base@" + c + "/model.safetensors").ok());
  EXPECT_TRUE(ValidateSourceName("hf://gpt2@" + c + "/sub/model.safetensors").ok());
  for (const std::string& bad : std::vector<std::string>{
           std::string("s3://x@") + c + "/a", "hf://acme/base@main/model.safetensors",
        "hf://acme/base@" + c + "/../etc/passwd", "hf://acme/base@" + c + "/",
        "hf://acme/base@" + c, "hf://buckets/acme/b@" + c + "/a", "hf://a/b/c@" + c + "/x",
        "hf://acme/base@" + c.substr(0, 39) + "G/a", "hf://../x@" + c + "/a",
        "hf://acme/base@" + c + "//a"}) {
    EXPECT_FALSE(ValidateSourceName(bad).ok()) << bad;
  }
}

TEST(ChunkCacheTest, EvictsLeastRecentlyUsedAndDropsCorruptEntries) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto cache = ChunkCache::Open(dir.string(), 10 * 1000);
  ASSERT_TRUE(cache.ok());
  std::vector<Hash128> hashes;
  for (int i = 0; i < 20; ++i) {
    std::vector<uint8_t> bytes(1000, static_cast<uint8_t>(i));
    hashes.push_back(HashChunk(bytes));
    ASSERT_TRUE((*cache)->Put(hashes.back(), bytes).ok());
    EXPECT_LE((*cache)->size_bytes(), 10u * 1000);
  }
  ByteBuffer out;
  EXPECT_TRUE((*cache)->Get(hashes.back(), &out));
  EXPECT_EQ(std::vector<uint8_t>(out.begin(), out.end()), std::vector<uint8_t>(1000, 19));
  EXPECT_FALSE((*cache)->Get(hashes.front(), &out));  // evicted
  // A corrupted entry is a miss and disappears.
  std::string hex = hashes.back().ToHex();
  fs::path entry = dir / "chunks" / hex.substr(0, 2) / hex;
  FlipByteIn(entry, 10);
  EXPECT_FALSE((*cache)->Get(hashes.back(), &out));
  EXPECT_FALSE(fs::exists(entry));
  // Reopening sees what is on disk.
  auto again = ChunkCache::Open(dir.string(), 10 * 1000);
  ASSERT_TRUE(again.ok());
  EXPECT_LE((*again)->size_bytes(), 10u * 1000);
  EXPECT_GT((*again)->size_bytes(), 0u);
  fs::remove_all(dir);
}

// GetInto reads an entry into the caller's buffer and verifies that copy: it outlives the
// entry's eviction, a corrupted entry is a miss and is dropped.
TEST(ChunkCacheTest, GetIntoFillsTheCallersBufferVerifiedAndItOutlivesEviction) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-into-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opened = ChunkCache::Open(dir.string(), 1 << 30);
  ASSERT_TRUE(opened.ok());
  ChunkCache& cache = **opened;
  std::mt19937_64 rng(5);
  std::vector<uint8_t> big(1 << 20);
  for (auto& b : big) b = static_cast<uint8_t>(rng());
  const Hash128 hb = HashChunk(big);
  ASSERT_TRUE(cache.Put(hb, big).ok());

  std::vector<uint8_t> buffer(3 << 20, 0xEE);
  size_t asked = 0;
  auto into = [&](size_t n) {
    asked = n;
    return std::span<uint8_t>(buffer.data(), n);
  };
  ASSERT_TRUE(cache.GetInto(hb, into));
  EXPECT_EQ(asked, big.size());
  EXPECT_TRUE(std::equal(big.begin(), big.end(), buffer.begin()));
  EXPECT_EQ(buffer[big.size()], 0xEE);  // nothing past the entry's size

  // Eviction unlinks the file; the copy stays.
  ASSERT_TRUE(cache.EvictTo(0).ok());
  EXPECT_FALSE(cache.Contains(hb));
  EXPECT_FALSE(cache.GetInto(hb, into));
  EXPECT_TRUE(std::equal(big.begin(), big.end(), buffer.begin()));

  // A corrupted entry is a miss, and is dropped.
  ASSERT_TRUE(cache.Put(hb, big).ok());
  std::string hex = hb.ToHex();
  fs::path entry = dir / "chunks" / hex.substr(0, 2) / hex;
  FlipByteIn(entry, 12345);
  EXPECT_FALSE(cache.GetInto(hb, into));
  EXPECT_FALSE(fs::exists(entry));
  EXPECT_EQ(cache.stats().corrupt.load(), 1u);
  fs::remove_all(dir);
}

// A cache file changed in place — by another process, a disk tool — is a miss, never wrong
// data, whatever the change (a flipped byte, an overwrite, a truncation, an append) and whenever
// it happens: before a read (the copy fails its hash or its length), or after one (the bytes
// handed out are the caller's copy, not the file). The entry is dropped, and a fresh insert of
// the chunk works again.
TEST(ChunkCacheTest, AFileChangedInPlaceIsAMissNeverWrongBytes) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-inplace-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opened = ChunkCache::Open(dir.string(), 1 << 30);
  ASSERT_TRUE(opened.ok());
  ChunkCache& cache = **opened;
  std::mt19937_64 rng(9);
  std::vector<uint8_t> bytes(4 << 20);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  const Hash128 h = HashChunk(bytes);
  const std::string hex = h.ToHex();
  const fs::path entry = dir / "chunks" / hex.substr(0, 2) / hex;

  // The change, made through a descriptor of the entry itself (same inode: in place).
  using Change = std::function<void(int fd)>;
  const std::vector<std::pair<std::string, Change>> changes = {
      {"flip", [&](int fd) {
         uint8_t b = static_cast<uint8_t>(bytes[3 << 20] ^ 0x01);
         ASSERT_EQ(::pwrite(fd, &b, 1, 3 << 20), 1);
       }},
      {"overwrite", [&](int fd) {
         std::vector<uint8_t> other(bytes.size());
         for (auto& b : other) b = static_cast<uint8_t>(rng());
         ASSERT_EQ(::pwrite(fd, other.data(), other.size(), 0), static_cast<ssize_t>(other.size()));
       }},
      {"truncate", [&](int fd) { ASSERT_EQ(::ftruncate(fd, 1 << 20), 0); }},
      {"truncate to zero", [&](int fd) { ASSERT_EQ(::ftruncate(fd, 0), 0); }},
      {"append", [&](int fd) {
         const uint8_t tail[3] = {1, 2, 3};
         ASSERT_EQ(::pwrite(fd, tail, 3, static_cast<off_t>(bytes.size())), 3);
       }},
  };
  uint64_t corrupt = 0;
  for (const auto& [name, change] : changes) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(cache.Put(h, bytes).ok());
    ByteBuffer got;
    ASSERT_TRUE(cache.Get(h, &got));
    ASSERT_TRUE(std::equal(bytes.begin(), bytes.end(), got.begin(), got.end()));
    int fd = ::open(entry.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    change(fd);
    ::close(fd);
    // After a read: what it returned is unchanged.
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), got.begin(), got.end()));
    // Before a read: a miss, the entry dropped, never other bytes.
    ByteBuffer again;
    EXPECT_FALSE(cache.Get(h, &again));
    EXPECT_FALSE(fs::exists(entry));
    EXPECT_EQ(cache.stats().corrupt.load(), ++corrupt);
    // The chunk can be cached again.
    ASSERT_TRUE(cache.Put(h, bytes).ok());
    ASSERT_TRUE(cache.Get(h, &again));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), again.begin(), again.end()));
    ASSERT_TRUE(cache.EvictTo(0).ok());
  }
  fs::remove_all(dir);
}

// Reads into aligned buffers (the materializer's) go around the page cache (O_DIRECT) and give
// the same bytes as buffered ones, whatever the entry's size; a changed entry is still a miss.
TEST(ChunkCacheTest, AlignedReadsGiveTheEntryAndAChangedEntryIsStillAMiss) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-direct-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opened = ChunkCache::Open(dir.string(), 1 << 30);
  ASSERT_TRUE(opened.ok());
  ChunkCache& cache = **opened;
  constexpr size_t kRoom = 8 << 20;
  std::unique_ptr<uint8_t, decltype(&std::free)> room(static_cast<uint8_t*>(std::aligned_alloc(4096, kRoom)), &std::free);
  ASSERT_TRUE(room);
  auto into = [&](size_t n) { return std::span<uint8_t>(room.get(), n); };
  std::mt19937_64 rng(21);
  uint64_t corrupt = 0;
  for (size_t size : {size_t{1}, size_t{4095}, size_t{4096}, size_t{5000}, (size_t{1} << 20) + 123, size_t{4} << 20}) {
    SCOPED_TRACE("size " + std::to_string(size));
    std::vector<uint8_t> bytes(size);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const Hash128 h = HashChunk(bytes);
    ASSERT_TRUE(cache.PutAligned(h, bytes, 0).ok());
    std::memset(room.get(), 0xEE, kRoom);
    ASSERT_TRUE(cache.GetInto(h, into, /*aligned=*/true));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), room.get()));
    const std::string hex = h.ToHex();
    const fs::path entry = dir / "chunks" / hex.substr(0, 2) / hex;
    FlipByteIn(entry, size / 2);
    EXPECT_FALSE(cache.GetInto(h, into, /*aligned=*/true));
    EXPECT_FALSE(fs::exists(entry));
    EXPECT_EQ(cache.stats().corrupt.load(), ++corrupt);
    ASSERT_TRUE(cache.Put(h, bytes).ok());
    fs::resize_file(entry, size - 1);
    EXPECT_FALSE(cache.GetInto(h, into, /*aligned=*/true));
    EXPECT_EQ(cache.stats().corrupt.load(), ++corrupt);
  }
  fs::remove_all(dir);
}

// Changes racing with reads: a thread keeps changing the entry in place (flipping, overwriting,
// truncating, appending, restoring) while readers read it. Every hit has exactly the bytes.
TEST(ChunkCacheTest, ChangesRacingWithReadsNeverYieldWrongBytes) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-race-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opened = ChunkCache::Open(dir.string(), 1 << 30);
  ASSERT_TRUE(opened.ok());
  ChunkCache& cache = **opened;
  std::mt19937_64 rng(13);
  std::vector<uint8_t> bytes(1 << 20);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  const Hash128 h = HashChunk(bytes);
  const std::string hex = h.ToHex();
  const fs::path entry = dir / "chunks" / hex.substr(0, 2) / hex;
  ASSERT_TRUE(cache.Put(h, bytes).ok());
  std::atomic<bool> stop{false};
  std::thread changer([&] {
    std::mt19937_64 r(17);
    while (!stop.load()) {
      if (!fs::exists(entry)) (void)cache.Put(h, bytes);  // dropped by a reader: put it back
      int fd = ::open(entry.c_str(), O_RDWR);
      if (fd < 0) continue;
      const off_t at = static_cast<off_t>(r() % bytes.size());
      switch (r() % 5) {
        case 0: {
          uint8_t b = static_cast<uint8_t>(bytes[at] ^ (1 + r() % 255));
          (void)!::pwrite(fd, &b, 1, at);
          break;
        }
        case 1: {
          std::vector<uint8_t> junk(64 << 10, static_cast<uint8_t>(r()));
          (void)!::pwrite(fd, junk.data(), junk.size(), at);
          break;
        }
        case 2: (void)!::ftruncate(fd, at); break;
        case 3: (void)!::pwrite(fd, "xyz", 3, static_cast<off_t>(bytes.size())); break;
        default:  // restore the right bytes in place
          (void)!::ftruncate(fd, static_cast<off_t>(bytes.size()));
          (void)!::pwrite(fd, bytes.data(), bytes.size(), 0);
      }
      ::close(fd);
    }
  });
  size_t hits = 0, misses = 0;
  std::vector<uint8_t> buffer(bytes.size() + (128 << 10));  // appends and junk past the end grow it
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < deadline) {
    std::fill(buffer.begin(), buffer.end(), 0);
    const bool hit = cache.GetInto(h, [&](size_t n) {
      EXPECT_LE(n, buffer.size());
      return std::span<uint8_t>(buffer.data(), std::min(n, buffer.size()));
    });
    if (!hit) {
      ++misses;
      continue;
    }
    ++hits;
    ASSERT_TRUE(std::equal(bytes.begin(), bytes.end(), buffer.begin())) << "wrong bytes on hit " << hits;
  }
  stop = true;
  changer.join();
  EXPECT_GT(misses, 0u);
  std::printf("%zu hits, %zu misses\n", hits, misses);
  fs::remove_all(dir);
}

// A full disk fails every insert (the cache is an optimization: the reads go on); the warning
// for it is logged once a minute with a count of the failures not logged, not once per chunk.
// The disk: a 1 MiB tmpfs (mounting it needs root) filled by another file, so that eviction
// cannot make room.
TEST(ChunkCacheTest, AFullDiskLogsOneWarningPerMinuteWithACountNotOnePerChunk) {
  const fs::path dir = fs::temp_directory_path() / ("wfs-cache-full-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) {
    const int err = errno;
    fs::remove_all(dir);
    GTEST_SKIP() << "cannot mount a tmpfs (needs root): " << std::strerror(err);
  }
  constexpr int kChunks = 200;
  {
    test::LogCapture capture;
    auto opened = ChunkCache::Open((dir / "cache").string(), 1ull << 30);
    ASSERT_TRUE(opened.ok());
    {
      std::ofstream filler(dir / "filler", std::ios::binary);
      const std::vector<char> block(4096, 'x');
      while (filler.write(block.data(), static_cast<std::streamsize>(block.size()))) {
        filler.flush();
      }
    }
    std::vector<uint8_t> bytes(64 << 10);
    for (int i = 0; i < kChunks; ++i) {
      bytes[0] = static_cast<uint8_t>(i);
      bytes[1] = static_cast<uint8_t>(i >> 8);
      const Status s = (*opened)->Put(HashChunk(bytes), bytes);
      EXPECT_EQ(s.kind(), ErrorKind::kResourceExhausted) << s.ToString();
    }
    std::vector<std::string> lines = capture.Lines();
    ASSERT_EQ(lines.size(), 1u) << lines.back();
    EXPECT_NE(lines[0].find("warning chunk cache: "), std::string::npos) << lines[0];
    EXPECT_NE(lines[0].find("No space left on device"), std::string::npos) << lines[0];
    opened->reset();  // the count not logged yet is logged now
    lines = capture.Lines();
    ASSERT_EQ(lines.size(), 2u);
    EXPECT_NE(lines[1].find(std::to_string(kChunks - 1) + " more failed chunk cache inserts"), std::string::npos)
        << lines[1];
  }
  ::umount2(dir.c_str(), MNT_DETACH);
  fs::remove_all(dir);
}

// PutAligned writes with O_DIRECT from a 4 KiB-aligned buffer (whole blocks, then the file is
// cut to the chunk's length) and through the page cache when the buffer does not allow it; every
// way stores exactly the bytes.
TEST(ChunkCacheTest, PutAlignedStoresExactlyTheBytes) {
  fs::path dir = fs::temp_directory_path() / ("wfs-cache-aligned-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto opened = ChunkCache::Open(dir.string(), 1 << 30);
  ASSERT_TRUE(opened.ok());
  ChunkCache& cache = **opened;
  constexpr size_t kCapacity = 3 << 20;
  std::unique_ptr<uint8_t, decltype(&std::free)> buffer(
      static_cast<uint8_t*>(std::aligned_alloc(4096, kCapacity)), &std::free);
  ASSERT_NE(buffer, nullptr);
  std::mt19937_64 rng(11);
  for (size_t i = 0; i < kCapacity; ++i) buffer.get()[i] = static_cast<uint8_t>(rng());
  struct Case {
    size_t offset, size, capacity;
  };
  for (const Case& c : {Case{0, 2 << 20, 2 << 20}, Case{0, (1 << 20) + 123, kCapacity},
                        Case{0, 1, 4096}, Case{0, 5000, 5000} /* capacity short: buffered */,
                        Case{1, 70000, kCapacity - 1} /* unaligned: buffered */}) {
    SCOPED_TRACE(std::to_string(c.offset) + " " + std::to_string(c.size) + " " + std::to_string(c.capacity));
    buffer.get()[c.offset] ^= 0x5A;  // every case a different chunk
    const std::span<const uint8_t> bytes(buffer.get() + c.offset, c.size);
    const Hash128 h = HashChunk(bytes);
    ASSERT_TRUE(cache.PutAligned(h, bytes, c.capacity).ok());
    const std::string hex = h.ToHex();
    EXPECT_EQ(fs::file_size(dir / "chunks" / hex.substr(0, 2) / hex), c.size);
    ByteBuffer out;
    ASSERT_TRUE(cache.Get(h, &out));
    EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), out.begin(), out.end()));
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace weightfs
