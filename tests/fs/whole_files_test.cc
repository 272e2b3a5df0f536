// WholeFiles without FUSE (fs/whole_files.h): a reader's chunks written whole as it reads, in
// order or a little out of it, from several threads; a reader that jumps away or stops leaves
// every chunk it read in the disk cache; a file read in scattered order is copied after; the
// copy always holds the file's bytes. In reader_tests, which the sanitizer build runs too.
#include "fs/whole_files.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "hub/engine/chunk_cache.h"
#include "tests/fs/test_bucket.h"

namespace weightfs {
namespace {

using testing::RandomBytes;
using testing::TestBucket;

constexpr uint64_t kMiB = 1 << 20;
constexpr size_t kRows = 24;

class WholeFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    data_ = RandomBytes(kRows * kMiB - 4321, 11);
    manifest_ = bucket_.Push("acme/m", "v0", {{"data.bin", data_}}, kMiB);
    ASSERT_TRUE(manifest_);
    const ManifestFile* f = manifest_->FindFile("data.bin");
    ASSERT_TRUE(f);
    file_ = VersionFile{manifest_, f, std::shared_ptr<const ManifestFile>(manifest_, f)};
    auto c = ChunkCache::Open((bucket_.root() / "cache").string(), 1ull << 30);
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    cache_ = std::move(c).value();
    materializer_ = std::make_unique<Materializer>(&bucket_.bucket(), cache_.get());
    reader_ = std::make_unique<ChunkReader>(materializer_.get(), ChunkReaderOptions{.memory_limit = 256ull << 20});
    whole_ = std::make_unique<WholeFiles>(materializer_.get(), reader_.get(), cache_.get());
    reader_->set_skip_disk_cache([w = whole_.get()](const ManifestFile& f) { return w->Streaming(f); });
  }
  void TearDown() override {
    if (whole_) whole_->Stop();
    reader_.reset();
    whole_.reset();
  }

  // A read as the server passes it on: through the reader, then noted.
  void Read(uint64_t ino, uint64_t offset, size_t size) {
    Expected<ReadResult> r = reader_->Read(manifest_, file_.rows, offset, size, nullptr);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    whole_->NoteRead(ino, file_, offset, r->size, &*r);
  }
  std::vector<uint8_t> WholeBytes() {
    const int fd = cache_->OpenWholeFile(file_.file->sha256, file_.file->size);
    if (fd < 0) return {};
    std::vector<uint8_t> out(file_.file->size);
    const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
    ::close(fd);
    if (n != static_cast<ssize_t>(out.size())) return {};
    return out;
  }
  // Chunks with a chunk file of their own.
  size_t ChunkFiles() {
    size_t n = 0;
    for (const auto& e : std::filesystem::recursive_directory_iterator(bucket_.root() / "cache" / "chunks")) {
      n += e.is_regular_file() && e.path().filename().string().size() == 32;
    }
    return n;
  }
  bool WaitFor(const std::function<bool()>& done) {
    for (int i = 0; i < 3000 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  }

  TestBucket bucket_{::testing::UnitTest::GetInstance()->current_test_info()->name()};
  std::vector<uint8_t> data_;
  std::shared_ptr<const Manifest> manifest_;
  VersionFile file_;
  std::unique_ptr<ChunkCache> cache_;
  std::unique_ptr<Materializer> materializer_;
  std::unique_ptr<ChunkReader> reader_;
  std::unique_ptr<WholeFiles> whole_;
};

// Reads of 256 KiB from four threads, each taking the next range (so they arrive a little out
// of order, as the kernel's asynchronous reads do): the file is written whole as it is read,
// bit-exact, and its chunks past the first read never get chunk files.
TEST_F(WholeFilesTest, ReadsInOrderFromManyThreadsAreWrittenWhole) {
  std::atomic<uint64_t> next{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (uint64_t off; (off = next.fetch_add(256 << 10)) < data_.size();) Read(7, off, 256 << 10);
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_TRUE(WaitFor([&] { return whole_->stats().streamed.load() == 1; }))
      << "stream ends " << whole_->stats().stream_ends.load();
  EXPECT_EQ(whole_->stats().stream_ends.load(), 0u);
  EXPECT_EQ(WholeBytes(), data_);
  EXPECT_EQ(ChunkFiles(), 0u) << "chunk files beside the whole file";
  // Every chunk is found in it.
  for (const ManifestChunk& c : file_.file->chunks) {
    ByteBuffer b;
    ASSERT_TRUE(cache_->Get(c.hash, &b));
    EXPECT_TRUE(std::equal(b.begin(), b.end(), data_.begin() + static_cast<ptrdiff_t>(c.offset)));
  }
}

// A reader that reads the first chunks in order and then jumps to the end: the stream ends, and
// every chunk it read is in the disk cache (found again without the bucket).
TEST_F(WholeFilesTest, AReaderThatJumpsAwayLeavesEveryChunkItReadInTheDiskCache) {
  for (uint64_t off = 0; off < 4 * kMiB; off += 512 << 10) Read(3, off, 512 << 10);
  for (size_t k = kRows - 8; k < kRows; ++k) Read(3, k * kMiB, 4096);
  ASSERT_TRUE(WaitFor([&] { return whole_->stats().stream_ends.load() == 1; }));
  EXPECT_EQ(whole_->stats().streamed.load(), 0u);
  EXPECT_TRUE(WholeBytes().empty());
  std::vector<size_t> read;
  for (size_t k = 0; k < 4; ++k) read.push_back(k);
  for (size_t k = kRows - 8; k < kRows; ++k) read.push_back(k);
  for (size_t k : read) EXPECT_TRUE(cache_->Contains(file_.file->chunks[k].hash)) << "chunk " << k << " lost";
  // (Without the bucket: each is a disk-cache hit.)
  bucket_.faults().Fail(test::FaultStore::On(test::StoreOp::kGet, "packs/"), Status::IOError("the bucket is down"));
  Materializer offline(&bucket_.bucket(), cache_.get());
  for (size_t k : read) {
    Expected<ByteBuffer> b = offline.Chunk(*manifest_, *file_.file, k);
    ASSERT_TRUE(b.ok()) << "chunk " << k << ": " << b.status().ToString();
    EXPECT_TRUE(std::equal(b->begin(), b->end(), data_.begin() + static_cast<ptrdiff_t>(file_.file->chunks[k].offset)));
  }
}

// A file read in scattered order (every chunk, shuffled) is copied whole after the reads pause;
// Finish (unmount) copies what is queued at once.
TEST_F(WholeFilesTest, AFileReadInScatteredOrderIsCopiedAfter) {
  std::vector<uint64_t> offsets;
  for (uint64_t off = 0; off < data_.size(); off += 512 << 10) offsets.push_back(off);
  std::shuffle(offsets.begin() + 1, offsets.end(), std::mt19937_64(3));
  for (uint64_t off : offsets) Read(5, off, 512 << 10);
  whole_->Finish(std::chrono::seconds(30));
  EXPECT_EQ(whole_->stats().copied.load() + whole_->stats().streamed.load(), 1u);
  EXPECT_EQ(WholeBytes(), data_);
}

// A reader that stops short (no read for a while): the stream ends and keeps what was read.
TEST_F(WholeFilesTest, AReaderThatStopsShortEndsItsStream) {
  for (uint64_t off = 0; off < 5 * kMiB; off += 1 << 20) Read(9, off, 1 << 20);
  ASSERT_TRUE(WaitFor([&] { return whole_->stats().stream_ends.load() == 1; }));
  for (size_t k = 0; k < 5; ++k) EXPECT_TRUE(cache_->Contains(file_.file->chunks[k].hash)) << "chunk " << k;
  EXPECT_TRUE(WholeBytes().empty());
  // And a later whole read in order is written whole.
  for (uint64_t off = 0; off < data_.size(); off += 1 << 20) Read(9, off, 1 << 20);
  ASSERT_TRUE(WaitFor([&] { return whole_->stats().streamed.load() == 1; }));
  EXPECT_EQ(WholeBytes(), data_);
}

}  // namespace
}  // namespace weightfs
