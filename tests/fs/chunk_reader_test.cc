// The read path without FUSE: ranges map to the right bytes, concurrent readers share one
// materialization, memory stays within its limit, readahead runs ahead of sequential readers,
// and errors name the chunk and are not cached.
#include "fs/chunk_reader.h"


#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "core/safetensors.h"
#include "hub/engine/chunk_cache.h"
#include "tests/fs/test_bucket.h"
#include "tests/testing/safetensors_builder.h"

namespace weightfs {
namespace {

using testing::RandomBytes;
using testing::TestBucket;

constexpr uint64_t kChunk = 1 << 20;

std::vector<uint8_t> Gather(const ReadResult& r) {
  std::vector<uint8_t> out;
  for (const iovec& v : r.iov) {
    const uint8_t* p = static_cast<const uint8_t*>(v.iov_base);
    out.insert(out.end(), p, p + v.iov_len);
  }
  return out;
}

class ChunkReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = RandomBytes(6 * kChunk + 12345, 7);
    manifest_ = bucket_.Push("acme/m", "v0", {{"data.bin", data_}}, kChunk);
    ASSERT_TRUE(manifest_);
    file_ = manifest_->FindFile("data.bin");
    ASSERT_TRUE(file_);
    ASSERT_EQ(file_->chunks.size(), 7u);
  }

  TestBucket bucket_{::testing::UnitTest::GetInstance()->current_test_info()->name()};
  Materializer materializer_{&bucket_.bucket(), nullptr};
  std::vector<uint8_t> data_;
  std::shared_ptr<const Manifest> manifest_;
  const ManifestFile* file_ = nullptr;
};

TEST_F(ChunkReaderTest, RandomRangesMatchTheSource) {
  ChunkReader reader(&materializer_, {});
  std::mt19937_64 rng(1);
  for (int i = 0; i < 500; ++i) {
    uint64_t off = rng() % (data_.size() + 100);
    size_t len = rng() % (3 * kChunk);
    auto r = reader.Read(manifest_, *file_, off, len, nullptr);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    uint64_t end = std::min<uint64_t>(data_.size(), off + len);
    size_t expect = off >= data_.size() ? 0 : static_cast<size_t>(end - off);
    ASSERT_EQ(r->size, expect);
    std::vector<uint8_t> got = Gather(*r);
    ASSERT_EQ(got.size(), expect);
    ASSERT_TRUE(std::equal(got.begin(), got.end(), data_.begin() + static_cast<ptrdiff_t>(std::min<uint64_t>(off, data_.size()))))
        << "offset " << off << " length " << len;
  }
}

TEST_F(ChunkReaderTest, ConcurrentReadersOfOneChunkShareOneMaterialization) {
  ChunkReader reader(&materializer_, {.readahead_bytes = 0});
  // Every reader arrives while the first fetch is in flight.
  bucket_.faults().Delay(test::FaultStore::On(test::StoreOp::kGet, "packs/"), std::chrono::milliseconds(100));
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto r = reader.Read(manifest_, *file_, 1000 + static_cast<uint64_t>(t) * 100, 4096, nullptr);
      if (r.ok() && Gather(*r) == std::vector<uint8_t>(data_.begin() + 1000 + t * 100, data_.begin() + 1000 + t * 100 + 4096)) ok++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 8);
  EXPECT_EQ(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), 1u);
  EXPECT_EQ(reader.stats().materializations.load(), 1u);
  EXPECT_EQ(reader.stats().shared_waits.load() + reader.stats().memory_hits.load(), 7u);
}

TEST_F(ChunkReaderTest, MemoryStaysWithinTheLimit) {
  // What the process, one build and the metadata caches take, plus three chunks.
  const uint64_t limit = ChunkReader::kBaseBytes + ChunkReader::kBuildBytes + (16ull << 20) + 3 * kChunk;
  ASSERT_EQ(ChunkReader::MetadataBudget(limit), 16ull << 20);
  ASSERT_EQ(ChunkReader::MaxBuilds(limit), 1u);
  ASSERT_EQ(ChunkReader::CacheBudget(limit), 3 * kChunk);
  ChunkReader reader(&materializer_, {.memory_limit = limit, .readahead_bytes = 0});
  for (uint64_t off = 0; off < data_.size(); off += 100000) {
    auto r = reader.Read(manifest_, *file_, off, 100000, nullptr);
    ASSERT_TRUE(r.ok());
    EXPECT_LE(reader.cached_bytes(), ChunkReader::CacheBudget(limit));
  }
  EXPECT_GT(reader.stats().evictions.load(), 0u);
  // The most recent chunks are still there: re-reading the last one costs no fetch.
  uint64_t gets = bucket_.faults().Calls(test::StoreOp::kGet, "packs/");
  ASSERT_TRUE(reader.Read(manifest_, *file_, data_.size() - 10, 10, nullptr).ok());
  EXPECT_EQ(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), gets);
}

// Readers of different chunks wait for a build slot rather than each holding a build's memory:
// at the smallest limit one chunk is built at a time, and every reader still gets its bytes.
TEST_F(ChunkReaderTest, ConcurrentBuildsAreBoundedByTheMemoryLimit) {
  EXPECT_EQ(ChunkReader::MaxBuilds(ChunkReader::kMinMemoryLimit), 1u);
  EXPECT_EQ(ChunkReader::MaxBuilds(1ull << 30), 15u);
  // An eighth of the limit goes to metadata (heads, chunk tables); most of the rest to chunks.
  EXPECT_EQ(ChunkReader::MetadataBudget(1ull << 30), 128ull << 20);
  EXPECT_GE(ChunkReader::CacheBudget(1ull << 30), 560ull << 20);
  ChunkReader reader(&materializer_, {.memory_limit = ChunkReader::kMinMemoryLimit, .readahead_bytes = 0});
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t off = static_cast<uint64_t>(t) * kChunk + 100;
      auto r = reader.Read(manifest_, *file_, off, 5000, nullptr);
      if (r.ok() && Gather(*r) == std::vector<uint8_t>(data_.begin() + static_cast<ptrdiff_t>(off),
                                                       data_.begin() + static_cast<ptrdiff_t>(off) + 5000)) {
        ok++;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 6);
  EXPECT_EQ(reader.stats().materializations.load(), 6u);
  EXPECT_EQ(reader.stats().builds_peak.load(), 1u);
}

TEST_F(ChunkReaderTest, SequentialReadersGetReadahead) {
  ChunkReader reader(&materializer_, {.readahead_bytes = 4 * kChunk});
  ReadStream stream;
  // The first 2 MiB could be the kernel's own readahead: no readahead of ours yet.
  uint64_t off = 0;
  for (; off < (2 << 20); off += 64 << 10) {
    ASSERT_TRUE(reader.Read(manifest_, *file_, off, 64 << 10, &stream).ok());
  }
  EXPECT_EQ(reader.stats().readahead_queued.load(), 0u);
  ASSERT_TRUE(reader.Read(manifest_, *file_, off, 64 << 10, &stream).ok());
  off += 64 << 10;
  EXPECT_GE(reader.stats().readahead_queued.load(), 1u);
  // The chunks after the current one arrive without the reader asking: wait (bounded).
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (reader.cached_bytes() < 6 * kChunk && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_GE(reader.cached_bytes(), 6 * kChunk);
  const uint64_t materialized = reader.stats().materializations;
  for (; off < 6 * kChunk; off += 64 << 10) {
    ASSERT_TRUE(reader.Read(manifest_, *file_, off, 64 << 10, &stream).ok());
  }
  // Everything read since was already in memory, or being read ahead further.
  EXPECT_GE(reader.stats().memory_hits.load(), 10u);
  EXPECT_GE(reader.stats().materializations.load(), materialized);
}

// Issue 26, item 6: a queued readahead job once kept a raw pointer to a format 2 file's rows,
// which the bucket's byte-bounded table cache owns, not the manifest: with the file closed
// and its rows evicted before the job ran, the job read freed memory. Jobs now hold the rows.
// Here: a metadata budget of a few KiB, payload reads held while the reader queues readahead,
// the reader's rows dropped and the cache churned by other files' rows, then the jobs run. Under
// AddressSanitizer (reader_tests in the sanitizer build: scripts/test.sh) a job reading freed
// rows is a heap-use-after-free; here it must read the right bytes.
TEST(ChunkReaderRowsTest, QueuedReadaheadOutlivesTheOpenFileAndItsCachedRows) {
  TestBucket bucket{"QueuedReadaheadOutlivesTheOpenFile"};
  std::map<std::string, std::vector<uint8_t>> files;
  for (int i = 0; i < 8; ++i) files["f" + std::to_string(i) + ".bin"] = RandomBytes(8 * kChunk, 100 + i);
  std::shared_ptr<const Manifest> head = bucket.Push("acme/m", "v0", files, kChunk);
  ASSERT_TRUE(head);
  Expected<std::shared_ptr<const Manifest>> fresh = bucket.bucket().ReadManifest("acme/m", "v0");
  ASSERT_TRUE(fresh.ok());
  ASSERT_EQ((*fresh)->format, kManifestFormat2);
  bucket.bucket().set_metadata_budget(4 << 10);  // a few rows' worth: every File() evicts
  Materializer materializer(&bucket.bucket(), nullptr);
  ChunkReader reader(&materializer, {.readahead_bytes = 6 * kChunk});
  const std::vector<uint8_t>& want = files["f0.bin"];
  {
    Expected<std::shared_ptr<const ManifestFile>> rows = bucket.bucket().File(*fresh, "f0.bin");
    ASSERT_TRUE(rows.ok()) << rows.status().ToString();
    ReadStream stream;
    // Sequential reads up to the point where readahead starts; then the payload reads are held
    // so the queued jobs wait.
    uint64_t off = 0;
    for (; off < (2 << 20) + (64 << 10); off += 64 << 10) {
      Expected<ReadResult> r = reader.Read(*fresh, *rows, off, 64 << 10, &stream);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
    bucket.faults().Hold(test::FaultStore::On(test::StoreOp::kGet, "packs/"));
    for (; off < 3 * kChunk; off += 64 << 10) {
      (void)reader.Prefetch(*fresh, *rows, off / kChunk + 1);
    }
    EXPECT_GE(reader.stats().readahead_queued.load(), 1u);
  }  // the open file's rows go
  // Churn the table cache: the other files' rows evict f0's.
  for (int i = 1; i < 8; ++i) {
    Expected<std::shared_ptr<const ManifestFile>> other = bucket.bucket().File(*fresh, "f" + std::to_string(i) + ".bin");
    ASSERT_TRUE(other.ok());
  }
  bucket.faults().Release();
  // The jobs finish; what they built is f0's bytes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((reader.readahead_waiting() > 0 || reader.builds_running() > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  Expected<std::shared_ptr<const ManifestFile>> again = bucket.bucket().File(*fresh, "f0.bin");
  ASSERT_TRUE(again.ok());
  ReadStream stream;
  for (uint64_t off = 0; off < want.size(); off += kChunk) {
    Expected<ReadResult> r = reader.Read(*fresh, *again, off, kChunk, &stream);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    std::vector<uint8_t> got = Gather(*r);
    ASSERT_EQ(got.size(), kChunk);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + static_cast<std::ptrdiff_t>(off))) << off;
  }
}

TEST_F(ChunkReaderTest, RandomReadersGetNoReadahead) {
  ChunkReader reader(&materializer_, {.readahead_bytes = 4 * kChunk});
  ReadStream stream;
  for (uint64_t chunk : {5, 2, 0}) {
    ASSERT_TRUE(reader.Read(manifest_, *file_, chunk * kChunk + 1, 10, &stream).ok());
  }
  EXPECT_EQ(reader.stats().readahead_queued.load(), 0u);
}

TEST_F(ChunkReaderTest, FailuresNameTheChunkAndAreNotCached) {
  ChunkReader reader(&materializer_, {.readahead_bytes = 0});
  bucket_.faults().Fail(test::FaultStore::On(test::StoreOp::kGet, "packs/"), Status::IOError("injected failure reading a pack"));
  auto r = reader.Read(manifest_, *file_, 3 * kChunk + 5, 10, nullptr);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().kind(), ErrorKind::kIOError);
  EXPECT_NE(r.status().message().find("acme/m@v0 data.bin"), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("chunk 3"), std::string::npos) << r.status().ToString();
  bucket_.faults().Clear();
  auto again = reader.Read(manifest_, *file_, 3 * kChunk + 5, 10, nullptr);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(Gather(*again), std::vector<uint8_t>(data_.begin() + 3 * kChunk + 5, data_.begin() + 3 * kChunk + 15));
}

// With a disk cache (as in a mount) the reader serves chunks read from the cache files into
// private buffers: a new reader over the same cache fetches nothing, a corrupted cache file is
// never served, a cache file changed after it was read does not change what the reader serves,
// and Chunk (the heap-buffer interface) returns the same bytes.
TEST_F(ChunkReaderTest, WithADiskCacheChunksArePrivateCopiesOfCacheFiles) {
  const std::string dir = ::testing::TempDir() + "wfs-reader-cache-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  auto cache = ChunkCache::Open(dir, 1ull << 30);
  ASSERT_TRUE(cache.ok());
  auto read_all = [&](ChunkReader& reader) {
    auto r = reader.Read(manifest_, *file_, 0, data_.size(), nullptr);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return;
    EXPECT_EQ(Gather(*r), data_);
    ASSERT_EQ(r->chunks.size(), file_->chunks.size());
  };
  auto entry_of = [&](size_t i) {
    const std::string hex = file_->chunks[i].hash.ToHex();
    return dir + "/chunks/" + hex.substr(0, 2) + "/" + hex;
  };
  {
    Materializer m(&bucket_.bucket(), cache->get());
    ChunkReader reader(&m, {.readahead_bytes = 0});
    read_all(reader);
  }
  const uint64_t gets = bucket_.faults().Calls(test::StoreOp::kGet, "packs/");
  {
    Materializer m(&bucket_.bucket(), cache->get());
    ChunkReader reader(&m, {.readahead_bytes = 0});
    read_all(reader);
    EXPECT_EQ(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), gets);
    EXPECT_EQ(m.stats().cache_hits.load(), file_->chunks.size());
    auto copy = reader.Chunk(manifest_, *file_, 2);
    ASSERT_TRUE(copy.ok());
    EXPECT_TRUE(std::equal((*copy)->begin(), (*copy)->end(), data_.begin() + 2 * kChunk));
    // Every cache file changed in place after it was read (a byte flipped in each, one cut
    // short): the reader's chunks in memory stay right.
    for (size_t i = 0; i < file_->chunks.size(); ++i) {
      std::fstream f(entry_of(i), std::ios::in | std::ios::out | std::ios::binary);
      ASSERT_TRUE(f.good());
      f.seekp(static_cast<std::streamoff>(file_->chunks[i].length / 2));
      f.put('\x5a' ^ static_cast<char>(data_[i * kChunk + file_->chunks[i].length / 2]));
    }
    std::filesystem::resize_file(entry_of(1), 100);
    read_all(reader);
    EXPECT_EQ(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), gets);  // served from memory
  }
  // A new reader finds every file corrupt: it drops them and materializes the chunks again.
  {
    Materializer m(&bucket_.bucket(), cache->get());
    ChunkReader reader(&m, {.readahead_bytes = 0});
    read_all(reader);
    EXPECT_EQ((*cache)->stats().corrupt.load(), file_->chunks.size());
    EXPECT_EQ(m.stats().cache_hits.load(), 0u);
    EXPECT_GT(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), gets);
  }
  const uint64_t rebuilt = bucket_.faults().Calls(test::StoreOp::kGet, "packs/");
  // Corrupt chunk 3's (new) cache file: a new reader drops it and materializes the chunk again.
  const std::string entry = entry_of(3);
  {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekp(1000);
    f.put('\x5a' ^ static_cast<char>(data_[3 * kChunk + 1000]));
  }
  {
    Materializer m(&bucket_.bucket(), cache->get());
    ChunkReader reader(&m, {.readahead_bytes = 0});
    read_all(reader);  // chunk 3 built again
    EXPECT_EQ((*cache)->stats().corrupt.load(), file_->chunks.size() + 1);
    EXPECT_EQ(m.stats().cache_hits.load(), file_->chunks.size() - 1);
    EXPECT_GT(bucket_.faults().Calls(test::StoreOp::kGet, "packs/"), rebuilt);
  }
  std::filesystem::remove_all(dir);
}

TEST_F(ChunkReaderTest, ReadsPastTheEndAreEmpty) {
  ChunkReader reader(&materializer_, {});
  auto r = reader.Read(manifest_, *file_, data_.size(), 4096, nullptr);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size, 0u);
  EXPECT_TRUE(r->iov.empty());
}


// A loader that reads one tensor (safetensors mmap, vLLM picking shards) must not pay for the
// tensors after it; cat reading the whole file gets readahead across tensors.
TEST(ChunkReaderTensorTest, ReadaheadStaysInsideTheTensorUntilTheReaderCrossesTensors) {
  TestBucket bucket("tensor-readahead");
  constexpr uint64_t kSmall = 1 << 20;  // chunks; the readahead heuristics work in MiB
  const std::vector<uint8_t> values = RandomBytes(15 * kSmall, 3);
  test::SafetensorsBuilder st;
  for (uint64_t i = 0; i < 3; ++i) {  // a, b, c: five chunks each
    st.Add(std::string(1, static_cast<char>('a' + i)), DType::kBF16, {5 * kSmall / 2},
           std::vector<uint8_t>(values.begin() + static_cast<ptrdiff_t>(i * 5 * kSmall),
                                values.begin() + static_cast<ptrdiff_t>((i + 1) * 5 * kSmall)));
  }
  const std::vector<uint8_t> bytes = st.Build();
  const uint64_t data_offset = st.DataOffset();
  const std::vector<TensorInfo> tensors = st.Tensors();
  auto manifest = bucket.Push("acme/t", "v0", {{"model.safetensors", bytes}}, kSmall);
  ASSERT_TRUE(manifest);
  const ManifestFile& file = *manifest->FindFile("model.safetensors");
  ASSERT_EQ(file.chunks.size(), 16u);  // header + 3 x 5
  Materializer materializer(&bucket.bucket(), nullptr);

  // Read tensor b (chunks 6..10) from its start, as a loader does after parsing the header.
  ChunkReader one(&materializer, {.readahead_bytes = 64 * kSmall});
  ReadStream loader;
  const uint64_t b = data_offset + tensors[1].begin;
  for (uint64_t off = b; off < b + tensors[1].size(); off += 16 << 10) {
    ASSERT_TRUE(one.Read(manifest, file, off, 16 << 10, &loader).ok());
  }
  // Readahead starts 2 MiB in (chunk 8) and covers b's last two chunks, nothing of c.
  EXPECT_EQ(one.stats().readahead_queued.load(), 2u);

  // cat: from the header through a, and well into b (further than the kernel's readahead
  // overshoots a tensor): readahead then covers c too.
  ChunkReader all(&materializer, {.readahead_bytes = 64 * kSmall});
  ReadStream cat;
  for (uint64_t off = 0; off < data_offset + 5 * kSmall + (2 << 20) + (64 << 10); off += 16 << 10) {
    ASSERT_TRUE(all.Read(manifest, file, off, 16 << 10, &cat).ok());
  }
  // From 2 MiB in: a's chunks 4-5; in b: b's 7-10; streaming from 2 MiB past a: c's 11-15.
  EXPECT_EQ(all.stats().readahead_queued.load() + all.stats().readahead_dropped.load(), 11u);
}

}  // namespace
}  // namespace weightfs
