// Tests of the chunk cache's references (hub/engine/chunk_cache.h, hub/engine/reference_index.h): one index
// file per local file under refs/, read lazily into a bounded in-memory index, verified on
// every read, dropped when the file changes or the index file is not valid. (Tests of chunk
// files themselves and of push/pull through the cache are in bucket_engine_test.cc.)
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "core/hash.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/reference_index.h"
#include "hub/store/direct_file.h"
#include "tests/testing/log_capture.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kChunk = 4096;

class ChunkCacheReferencesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-refs-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_ / "data");
  }
  void TearDown() override { fs::remove_all(root_); }

  std::unique_ptr<ChunkCache> Open(ChunkCacheOptions options = {}, uint64_t max_bytes = 1ull << 30) {
    auto c = ChunkCache::Open((root_ / "cache").string(), max_bytes, options);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  // Writes `chunks` chunks of kChunk random bytes (seeded) to data/<name>; returns the path.
  std::string WriteData(const std::string& name, int chunks, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint8_t> bytes(chunks * kChunk);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const std::string path = (root_ / "data" / name).string();
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  static std::vector<uint8_t> Read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
  }

  // The rows of a file cut into kChunk chunks.
  static std::vector<ChunkRef> RowsOf(const std::string& path) {
    const std::vector<uint8_t> bytes = Read(path);
    std::vector<ChunkRef> rows;
    for (uint64_t off = 0; off < bytes.size(); off += kChunk) {
      const uint64_t len = std::min<uint64_t>(kChunk, bytes.size() - off);
      rows.push_back({HashChunk(std::span<const uint8_t>(bytes).subspan(off, len)), off, len});
    }
    return rows;
  }

  // A whole file's index file: named after the whole file's name (relocatable with the cache).
  fs::path WholeIndexFileOf(const std::string& path) const {
    const std::string name = "weightfs whole file " + fs::path(path).filename().string();
    return root_ / "cache" / "refs" / HashChunk({reinterpret_cast<const uint8_t*>(name.data()), name.size()}).ToHex();
  }
  fs::path IndexFileOf(const std::string& path) const {
    return root_ / "cache" / "refs" / HashChunk({reinterpret_cast<const uint8_t*>(path.data()), path.size()}).ToHex();
  }

  // Files under the cache directory: index files, legacy .ref files, everything else (chunk
  // files; .lock and .tmp/ not counted).
  struct Walk {
    std::vector<fs::path> refs, legacy, chunks;
  };
  Walk WalkCache() const {
    Walk w;
    for (const auto& e : fs::recursive_directory_iterator(root_ / "cache")) {
      if (!e.is_regular_file() && !e.is_symlink()) continue;
      const std::string rel = fs::relative(e.path(), root_ / "cache").string();
      if (rel.starts_with("refs/")) {
        w.refs.push_back(e.path());
      } else if (rel.ends_with(".ref")) {
        w.legacy.push_back(e.path());
      } else if (!rel.starts_with("chunks/.tmp/") && rel != "chunks/.lock") {
        w.chunks.push_back(e.path());
      }
    }
    return w;
  }

  // Every row of `path` is a hit with exactly the file's bytes.
  static void ExpectAllHit(ChunkCache& cache, const std::string& path) {
    const std::vector<uint8_t> bytes = Read(path);
    for (const ChunkRef& r : RowsOf(path)) {
      ByteBuffer out;
      ASSERT_TRUE(cache.Get(r.hash, &out)) << path << " @" << r.offset;
      ASSERT_EQ(out.size(), r.length);
      EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(r.offset)));
    }
  }

  static int64_t MtimeNs(const std::string& path) {
    struct stat st;
    EXPECT_EQ(::stat(path.c_str(), &st), 0);
    return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
  }
  static void SetMtimeNs(const std::string& path, int64_t ns) {
    const timespec t[2] = {{ns / 1000000000, ns % 1000000000}, {ns / 1000000000, ns % 1000000000}};
    ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), t, AT_SYMLINK_NOFOLLOW), 0);
  }

  fs::path root_;
};

TEST_F(ChunkCacheReferencesTest, OneIndexFileServesEveryChunkOfItsFile) {
  auto cache = Open();
  const std::string a = WriteData("a.bin", 20, 1);
  const uint64_t before = cache->size_bytes();
  ASSERT_TRUE(cache->PutReferences(a, RowsOf(a)).ok());
  ExpectAllHit(*cache, a);
  Walk w = WalkCache();
  ASSERT_EQ(w.refs.size(), 1u);
  EXPECT_EQ(w.refs[0], IndexFileOf(a));
  EXPECT_TRUE(w.legacy.empty());
  EXPECT_TRUE(w.chunks.empty());  // references, not copies
  // Counted in the cache's size: the header, the path and 32 bytes a row.
  EXPECT_EQ(cache->size_bytes() - before, kReferenceIndexOverhead + a.size() + 20 * kReferenceRowBytes);
  EXPECT_EQ(fs::file_size(w.refs[0]), kReferenceIndexOverhead + a.size() + 20 * kReferenceRowBytes);

  // Recording the file again replaces its index file, it does not add one.
  ASSERT_TRUE(cache->PutReferences(a, RowsOf(a)).ok());
  EXPECT_EQ(WalkCache().refs.size(), 1u);
  ExpectAllHit(*cache, a);

  // Another instance (the next process) reads it from disk.
  auto other = Open();
  for (const ChunkRef& r : RowsOf(a)) EXPECT_TRUE(other->Contains(r.hash));
  ExpectAllHit(*other, a);
  EXPECT_EQ(other->stats().hits.load(), 20u);
}

// A referenced file that changed — a byte flipped with its mtime put back (only the hash can
// tell), a flip, a truncation, a touch, removal, replacement — is a miss, never other bytes; its
// whole index file is dropped (other chunks of the file too) and removed; recording the file
// again works.
TEST_F(ChunkCacheReferencesTest, AReferencedFileThatChangedIsAMissAndItsIndexFileGoes) {
  struct Change {
    std::string name;
    std::function<void(const std::string&)> apply;
  };
  const std::vector<Change> changes = {
      {"flip, mtime restored",
       [](const std::string& p) {
         const int64_t m = MtimeNs(p);
         const int fd = ::open(p.c_str(), O_RDWR);
         uint8_t b = 0;
         ASSERT_EQ(::pread(fd, &b, 1, 5 * kChunk + 17), 1);
         b ^= 0x01;
         ASSERT_EQ(::pwrite(fd, &b, 1, 5 * kChunk + 17), 1);
         ::close(fd);
         SetMtimeNs(p, m);
       }},
      {"flip",
       [](const std::string& p) {
         const int fd = ::open(p.c_str(), O_RDWR);
         const uint8_t b = 0xAB;
         ASSERT_EQ(::pwrite(fd, &b, 1, 5 * kChunk), 1);
         ::close(fd);
         SetMtimeNs(p, MtimeNs(p) + 1);  // whatever the filesystem's timestamp granularity
       }},
      {"truncate", [](const std::string& p) { fs::resize_file(p, 7 * kChunk + 3); }},
      {"truncate to zero", [](const std::string& p) { fs::resize_file(p, 0); }},
      {"touch", [](const std::string& p) { SetMtimeNs(p, MtimeNs(p) - 1000); }},
      {"remove", [](const std::string& p) { fs::remove(p); }},
      {"replace", [this](const std::string& p) {
         const std::string other = WriteData("other.bin", 10, 77);
         fs::rename(other, p);
       }},
  };
  auto cache = Open();
  for (const Change& change : changes) {
    SCOPED_TRACE(change.name);
    const std::string a = WriteData("a.bin", 10, 3);
    const std::vector<uint8_t> original = Read(a);
    const std::vector<ChunkRef> rows = RowsOf(a);
    ASSERT_TRUE(cache->PutReferences(a, rows).ok());
    ExpectAllHit(*cache, a);
    change.apply(a);
    std::vector<uint8_t> buffer(kChunk);
    size_t asked = 0;
    const bool hit = cache->GetInto(rows[5].hash, [&](size_t n) {
      asked = n;
      return std::span<uint8_t>(buffer.data(), std::min<size_t>(n, buffer.size()));
    });
    EXPECT_FALSE(hit);
    EXPECT_FALSE(fs::exists(IndexFileOf(a)));
    // The whole index is gone, not only the chunk that changed.
    EXPECT_FALSE(cache->Contains(rows[0].hash));
    ByteBuffer out;
    EXPECT_FALSE(cache->Get(rows[0].hash, &out));
    // A fresh instance does not find it either.
    auto fresh = Open();
    EXPECT_FALSE(fresh->Get(rows[0].hash, &out));

    // Recorded again: served again.
    WriteData("a.bin", 10, 3);
    ASSERT_TRUE(cache->PutReferences(a, RowsOf(a)).ok());
    ExpectAllHit(*cache, a);
    EXPECT_EQ(WalkCache().refs.size(), 1u);
    fs::remove(a);
    ASSERT_TRUE(cache->EvictTo(0).ok());
  }
}

// Index files that are not what they claim — wrong magic, a row count larger than the file, a
// row past the file's end or with an overflowing offset, a path length beyond the bytes, a
// torn or truncated file, garbage, an empty file, a name that is not its path's hash, a
// relative path, a symlink — are skipped, removed and logged; none is trusted, nothing crashes,
// and a good index file beside them is served.
TEST_F(ChunkCacheReferencesTest, CorruptOrHostileIndexFilesAreSkippedRemovedAndLogged) {
  const fs::path refs = root_ / "cache" / "refs";
  {
    auto writer = Open();  // creates the directories
  }
  auto put64 = [](std::vector<uint8_t>& b, size_t at, uint64_t v) {
    for (int i = 0; i < 8; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
  };
  // Recomputes the checksum, so that the change is judged by the checks behind it.
  auto resum = [&](std::vector<uint8_t>& b) {
    put64(b, b.size() - 8, Hash64(std::span<const uint8_t>(b).first(b.size() - 8)));
  };
  constexpr size_t kRowsAt = 22 + 16, kPathLengthAt = 22 + 24;
  using Mutation = std::function<void(std::vector<uint8_t>&, size_t rows_at, uint64_t file_size)>;
  const std::vector<std::pair<std::string, Mutation>> cases = {
      {"wrong magic", [&](auto& b, size_t, uint64_t) { b[3] = 'X'; resum(b); }},
      {"more rows than the file holds", [&](auto& b, size_t, uint64_t) { put64(b, kRowsAt, 1000); resum(b); }},
      {"row count that overflows", [&](auto& b, size_t, uint64_t) { put64(b, kRowsAt, 1ull << 59); resum(b); }},
      {"path length past the end", [&](auto& b, size_t, uint64_t) {
         b[kPathLengthAt] = b[kPathLengthAt + 1] = 0xFF;
         resum(b);
       }},
      {"offset past the file's end", [&](auto& b, size_t at, uint64_t size) {
         put64(b, at + 16, size);
         resum(b);
       }},
      {"length past the file's end", [&](auto& b, size_t at, uint64_t size) {
         put64(b, at + 16 + 32, size - kChunk);
         put64(b, at + 24 + 32, 2 * kChunk);
         resum(b);
       }},
      {"offset that overflows", [&](auto& b, size_t at, uint64_t) {
         put64(b, at + 16, ~0ull - 10);
         resum(b);
       }},
      {"length 0", [&](auto& b, size_t at, uint64_t) { put64(b, at + 24, 0); resum(b); }},
      {"torn (checksum)", [&](auto& b, size_t at, uint64_t) { b[at + 3] ^= 1; }},
      {"truncated", [&](auto& b, size_t, uint64_t) { b.resize(b.size() - 40); }},
      {"garbage", [&](auto& b, size_t, uint64_t) {
         std::mt19937_64 r(5);
         for (auto& x : b) x = static_cast<uint8_t>(r());
       }},
      {"empty", [&](auto& b, size_t, uint64_t) { b.clear(); }},
  };
  std::vector<Hash128> hostile_hashes;
  int n = 0;
  for (const auto& [name, mutate] : cases) {
    ++n;
    const std::string path = WriteData("hostile" + std::to_string(n), 4, 100 + n);
    ReferenceIndex index{path, fs::file_size(path), MtimeNs(path), RowsOf(path)};
    for (const ChunkRef& r : index.rows) hostile_hashes.push_back(r.hash);
    std::vector<uint8_t> bytes = SerializeReferenceIndex(index);
    mutate(bytes, 22 + 28 + path.size(), index.file_size);
    std::ofstream(IndexFileOf(path), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  // A valid index of one file under another file's name.
  const std::string misnamed = WriteData("misnamed", 4, 200);
  const std::string other_name = WriteData("other-name", 1, 201);
  {
    ReferenceIndex index{misnamed, fs::file_size(misnamed), MtimeNs(misnamed), RowsOf(misnamed)};
    for (const ChunkRef& r : index.rows) hostile_hashes.push_back(r.hash);
    const std::vector<uint8_t> bytes = SerializeReferenceIndex(index);
    std::ofstream(IndexFileOf(other_name), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  // A relative path, under its own hash's name.
  {
    const std::string rel = "data/relative";
    ReferenceIndex index{rel, 4 * kChunk, 0, {{Hash128{1, 2}, 0, kChunk}}};
    const std::vector<uint8_t> bytes = SerializeReferenceIndex(index);
    std::ofstream(IndexFileOf(rel), std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  // A symlink named like an index file (to a file that would block a reader, and to a good one).
  const std::string linked = WriteData("linked", 2, 300);
  {
    ReferenceIndex index{linked, fs::file_size(linked), MtimeNs(linked), RowsOf(linked)};
    for (const ChunkRef& r : index.rows) hostile_hashes.push_back(r.hash);
    const std::vector<uint8_t> bytes = SerializeReferenceIndex(index);
    const fs::path target = root_ / "elsewhere";
    std::ofstream(target, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    fs::create_symlink(target, IndexFileOf(linked));
  }
  ASSERT_EQ(::mkfifo((refs / std::string(32, 'f')).c_str(), 0600), 0);
  const size_t hostile_files = cases.size() + 4;
  // A file that is not ours by its name is left alone.
  std::ofstream(refs / "README").put('x');
  // And one good index file.
  const std::string good = WriteData("good", 6, 400);
  {
    auto writer = Open();
    ASSERT_TRUE(writer->PutReferences(good, RowsOf(good)).ok());
  }

  test::LogCapture capture;
  auto cache = Open();
  ExpectAllHit(*cache, good);  // the first lookup loads the index
  for (const Hash128& h : hostile_hashes) {
    ByteBuffer out;
    EXPECT_FALSE(cache->Get(h, &out));
  }
  EXPECT_EQ(cache->stats().corrupt.load(), hostile_files);
  Walk w = WalkCache();
  ASSERT_EQ(w.refs.size(), 2u);  // the good one, README
  EXPECT_TRUE(fs::exists(IndexFileOf(good)));
  EXPECT_TRUE(fs::exists(refs / "README"));
  EXPECT_FALSE(fs::exists(refs / std::string(32, 'f')));
  EXPECT_TRUE(fs::exists(root_ / "elsewhere")) << "a symlink is removed, not what it points at";
  cache.reset();  // flushes the count of lines not logged
  const std::vector<std::string> lines = capture.Lines();
  ASSERT_GE(lines.size(), 1u);
  EXPECT_NE(lines[0].find("is corrupt"), std::string::npos) << lines[0];
  EXPECT_NE(lines.back().find("corrupt chunk cache entries dropped"), std::string::npos) << lines.back();
  EXPECT_LE(lines.size(), 2u) << "rate-limited, not a line per file";
}

// Another instance on the same directory — as a `pull` running beside a mount would — records
// references after this one loaded its index: a miss here rescans refs/ (its mtime changed) and
// finds them. Rescans are rate-limited.
TEST_F(ChunkCacheReferencesTest, AnotherProcessesReferencesAreFoundAfterAMiss) {
  ChunkCacheOptions fast;
  fast.rescan_interval = std::chrono::milliseconds(0);
  ChunkCacheOptions slow;
  slow.rescan_interval = std::chrono::hours(1);
  auto reader = Open(fast);
  auto lazy = Open(slow);
  auto writer = Open();
  const std::string a = WriteData("a.bin", 5, 1);
  const std::string b = WriteData("b.bin", 5, 2);
  ASSERT_TRUE(writer->PutReferences(a, RowsOf(a)).ok());
  ExpectAllHit(*reader, a);  // loaded now
  ExpectAllHit(*lazy, a);
  ByteBuffer out;
  EXPECT_FALSE(lazy->Get(RowsOf(b)[0].hash, &out));  // its one rescan for now
  ASSERT_TRUE(writer->PutReferences(b, RowsOf(b)).ok());
  ExpectAllHit(*reader, b);
  EXPECT_FALSE(lazy->Get(RowsOf(b)[0].hash, &out)) << "rescanned within its interval";
  ExpectAllHit(*Open(slow), b);

  // The default interval (a second): found within a bounded number of tries.
  auto normal = Open();
  const std::string c = WriteData("c.bin", 3, 3);
  EXPECT_FALSE(normal->Get(RowsOf(c)[0].hash, &out));
  ASSERT_TRUE(writer->PutReferences(c, RowsOf(c)).ok());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool found = false;
  while (!found && std::chrono::steady_clock::now() < deadline) {
    found = normal->Get(RowsOf(c)[0].hash, &out);
    if (!found) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(found);

  // A file that changed is a miss for every instance (the first to see it removes its index).
  SetMtimeNs(a, MtimeNs(a) + 5);
  EXPECT_FALSE(writer->Get(RowsOf(a)[0].hash, &out));
  EXPECT_FALSE(fs::exists(IndexFileOf(a)));
  EXPECT_FALSE(reader->Get(RowsOf(a)[0].hash, &out));
}

// With a tiny memory bound only what fits is loaded (newest index files first); the rest are
// misses, logged once, and nothing breaks: not lookups, not further PutReferences.
TEST_F(ChunkCacheReferencesTest, BeyondTheMemoryBoundIndexFilesAreNotLoadedAndTheirChunksMiss) {
  const std::string old_file = WriteData("old.bin", 8, 1);
  const std::string new_file = WriteData("new.bin", 8, 2);
  {
    auto writer = Open();
    ASSERT_TRUE(writer->PutReferences(old_file, RowsOf(old_file)).ok());
    ASSERT_TRUE(writer->PutReferences(new_file, RowsOf(new_file)).ok());
  }
  const int64_t now = MtimeNs(IndexFileOf(new_file).string());
  SetMtimeNs(IndexFileOf(old_file).string(), now - 3600ll * 1000000000);
  ChunkCacheOptions tiny;
  tiny.reference_index_bytes = 1500;  // one file of 8 rows (64 bytes each, 256 + its path)
  tiny.rescan_interval = std::chrono::milliseconds(0);
  test::LogCapture capture;
  auto cache = Open(tiny);
  ExpectAllHit(*cache, new_file);
  ByteBuffer out;
  for (const ChunkRef& r : RowsOf(old_file)) EXPECT_FALSE(cache->Get(r.hash, &out));
  // Recording more: kept on disk, not in memory; a miss here, found by an instance with room.
  const std::string more = WriteData("more.bin", 8, 3);
  ASSERT_TRUE(cache->PutReferences(more, RowsOf(more)).ok());
  EXPECT_FALSE(cache->Get(RowsOf(more)[0].hash, &out));
  EXPECT_TRUE(fs::exists(IndexFileOf(more)));
  ExpectAllHit(*Open(), more);
  // more.bin's refresh and old.bin's below can fall in one tick of the kernel's file-time clock
  // (a few ms), and then the order between them is a coin toss. Make more.bin's index older
  // outright, so that only old.bin's refresh by the hits puts it first.
  SetMtimeNs(IndexFileOf(more).string(), now - 1800ll * 1000000000);
  ExpectAllHit(*Open(), old_file);
  // Once memory is freed (the loaded file changed), a rescan loads what was left out, most
  // recently used first: old.bin, whose index file the other instance's hits just refreshed.
  SetMtimeNs(new_file, MtimeNs(new_file) + 5);
  EXPECT_FALSE(cache->Get(RowsOf(new_file)[0].hash, &out));
  ExpectAllHit(*cache, old_file);
  EXPECT_FALSE(cache->Get(RowsOf(more)[0].hash, &out));
  size_t bound_lines = 0;
  for (const std::string& line : capture.Lines()) bound_lines += line.find("memory bound") != std::string::npos;
  EXPECT_EQ(bound_lines, 1u);
}

// An index file is an entry like a chunk file: counted in the size and evicted (oldest first);
// an evicted one is forgotten in memory too.
TEST_F(ChunkCacheReferencesTest, IndexFilesAreCountedAndEvicted) {
  auto cache = Open();
  const std::string a = WriteData("a.bin", 10, 1);
  const std::string b = WriteData("b.bin", 10, 2);
  ASSERT_TRUE(cache->PutReferences(a, RowsOf(a)).ok());
  ASSERT_TRUE(cache->PutReferences(b, RowsOf(b)).ok());
  SetMtimeNs(IndexFileOf(a).string(), MtimeNs(IndexFileOf(b).string()) - 1000000000);
  const uint64_t each = fs::file_size(IndexFileOf(a));
  EXPECT_EQ(cache->size_bytes(), 2 * each);
  ASSERT_TRUE(cache->EvictTo(each).ok());
  EXPECT_FALSE(fs::exists(IndexFileOf(a)));
  ByteBuffer out;
  EXPECT_FALSE(cache->Get(RowsOf(a)[0].hash, &out));
  ExpectAllHit(*cache, b);
  EXPECT_EQ(cache->size_bytes(), each);
  EXPECT_EQ(Open()->size_bytes(), each);
}

// A cache written before refs/ holds one .ref file per chunk: still served after an upgrade,
// and dropped when the file changes.
TEST_F(ChunkCacheReferencesTest, LegacyRefFilesAreStillHonoured) {
  const std::string a = WriteData("a.bin", 3, 1);
  const std::vector<ChunkRef> rows = RowsOf(a);
  const ChunkRef& r = rows[1];
  const std::string hex = r.hash.ToHex();
  const fs::path ref = root_ / "cache" / "chunks" / hex.substr(0, 2) / (hex + ".ref");
  fs::create_directories(ref.parent_path());
  std::ofstream(ref) << "weightfs-chunk-ref 1\n" << r.offset << " " << r.length << " " << fs::file_size(a)
                     << " " << MtimeNs(a) << "\n" << a;
  auto cache = Open();
  EXPECT_TRUE(cache->Contains(r.hash));
  ByteBuffer out;
  ASSERT_TRUE(cache->Get(r.hash, &out));
  const std::vector<uint8_t> bytes = Read(a);
  EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + kChunk, bytes.begin() + 2 * kChunk));
  SetMtimeNs(a, MtimeNs(a) + 1);
  EXPECT_FALSE(cache->Get(r.hash, &out));
  EXPECT_FALSE(fs::exists(ref));
}

// Lookups from many threads while other files' references are recorded, dropped and recorded
// again (their file rewritten in place): every hit has exactly its chunk's bytes.
TEST_F(ChunkCacheReferencesTest, ConcurrentLookupsAndChangesNeverYieldWrongBytes) {
  ChunkCacheOptions options;
  options.rescan_interval = std::chrono::milliseconds(0);
  auto cache = Open(options);
  const std::string stable = WriteData("stable.bin", 16, 1);
  const std::string moving = WriteData("moving.bin", 16, 2);
  ASSERT_TRUE(cache->PutReferences(stable, RowsOf(stable)).ok());
  std::vector<std::pair<Hash128, std::vector<uint8_t>>> expected;
  for (const std::string& p : {stable, moving}) {
    const std::vector<uint8_t> bytes = Read(p);
    for (const ChunkRef& r : RowsOf(p)) {
      expected.push_back({r.hash, {bytes.begin() + static_cast<ptrdiff_t>(r.offset),
                                   bytes.begin() + static_cast<ptrdiff_t>(r.offset + r.length)}});
    }
  }
  const std::vector<ChunkRef> moving_rows = RowsOf(moving);
  const std::vector<uint8_t> moving_bytes = Read(moving);
  std::atomic<bool> stop{false};
  std::thread changer([&] {
    std::mt19937_64 r(3);
    while (!stop.load()) {
      // Rewrite in place: a wrong byte, then the right ones back, re-recorded each time.
      const int fd = ::open(moving.c_str(), O_RDWR);
      const off_t at = static_cast<off_t>(r() % moving_bytes.size());
      const uint8_t junk = static_cast<uint8_t>(moving_bytes[at] ^ 0x80);
      (void)!::pwrite(fd, &junk, 1, at);
      (void)!::pwrite(fd, moving_bytes.data() + at, 1, at);
      ::close(fd);
      (void)cache->PutReferences(moving, moving_rows);
      if (r() % 4 == 0) (void)cache->PutReferences(stable, RowsOf(stable));
    }
  });
  std::atomic<size_t> hits{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 4; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 r(10 + t);
      std::vector<uint8_t> buffer(kChunk);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      while (std::chrono::steady_clock::now() < deadline) {
        const auto& [h, bytes] = expected[r() % expected.size()];
        std::fill(buffer.begin(), buffer.end(), 0);
        if (cache->GetInto(h, [&](size_t n) { return std::span<uint8_t>(buffer.data(), std::min(n, buffer.size())); })) {
          hits++;
          ASSERT_TRUE(std::equal(bytes.begin(), bytes.end(), buffer.begin()));
        }
      }
    });
  }
  for (auto& t : readers) t.join();
  stop = true;
  changer.join();
  EXPECT_GT(hits.load(), 0u);
  EXPECT_LE(WalkCache().refs.size(), 2u);
}

// Write-behind (the mount's builds): entries are written by the cache's own thread, the queue
// never holds more than its bound (the caller writes beyond it), every entry lands with its
// bytes, each buffer is let go once written, and what is queued when the cache is destroyed is
// written first.
TEST_F(ChunkCacheReferencesTest, WriteBehindWritesEveryEntryAndLetsItsBufferGo) {
  constexpr size_t kEntry = 64 << 10;
  constexpr size_t kEntries = 24;
  std::atomic<int> alive{0};  // buffers not freed yet
  struct Made {
    Hash128 hash;
    std::vector<uint8_t> bytes;
  };
  std::vector<Made> made;
  auto make = [&](size_t i) {  // an aligned buffer whose owner counts itself
    auto* bytes = static_cast<uint8_t*>(std::aligned_alloc(4096, kEntry));
    std::mt19937_64 rng(i);
    for (size_t k = 0; k < kEntry; ++k) bytes[k] = static_cast<uint8_t>(rng());
    alive++;
    std::shared_ptr<const void> owner(bytes, [&alive](const void* q) {
      std::free(const_cast<void*>(q));
      alive--;
    });
    const std::span<const uint8_t> span(bytes, kEntry);
    made.push_back({HashChunk(span), std::vector<uint8_t>(span.begin(), span.end())});
    return ChunkBytes(std::move(owner), span);
  };
  auto expect_all = [&](ChunkCache& cache) {
    for (size_t i = 0; i < made.size(); ++i) {
      ByteBuffer out;
      ASSERT_TRUE(cache.Get(made[i].hash, &out)) << i;
      EXPECT_TRUE(std::equal(out.begin(), out.end(), made[i].bytes.begin(), made[i].bytes.end())) << i;
    }
  };
  {
    std::unique_ptr<ChunkCache> cache = Open();
    ASSERT_TRUE(cache);
    // Off (the default): the caller writes, and the entry is there when PutBehind returns.
    {
      ChunkBytes first = make(0);
      cache->PutBehind(made[0].hash, first, kEntry);
      EXPECT_TRUE(cache->Contains(made[0].hash));
    }
    EXPECT_EQ(alive.load(), 0);
    cache->set_write_behind(3 * kEntry);
    for (size_t i = 1; i < kEntries / 2; ++i) {
      ChunkBytes b = make(i);
      cache->PutBehind(made.back().hash, std::move(b), kEntry);
      EXPECT_LE(alive.load(), 4) << "more than the bound queued (3) plus the one being written";
    }
    cache->Flush();
    EXPECT_EQ(alive.load(), 0) << "a buffer outlived its write";
    expect_all(*cache);
    for (size_t i = kEntries / 2; i < kEntries; ++i) {
      ChunkBytes b = make(i);
      cache->PutBehind(made.back().hash, std::move(b), kEntry);
    }
  }  // destroyed with entries queued
  EXPECT_EQ(alive.load(), 0);
  std::unique_ptr<ChunkCache> again = Open();
  ASSERT_TRUE(again);
  ASSERT_EQ(made.size(), kEntries);
  expect_all(*again);
}

// PutCopyBehind (what `weightfs patch` caches NEW's chunks with) copies the caller's bytes:
// the buffer is the caller's again at once (here overwritten before the write can have
// happened), and every entry is written as it was given, with write-behind off (a Put) and
// on (queued; written by Flush, and by the destructor).
TEST_F(ChunkCacheReferencesTest, PutCopyBehindWritesACopyOfTheCallersBytes) {
  constexpr size_t kEntry = (1 << 20) + 12345;  // not a multiple of the block size
  std::vector<std::pair<Hash128, std::vector<uint8_t>>> made;
  std::vector<uint8_t> buffer(kEntry);  // the caller's, reused for each entry
  auto put = [&](ChunkCache& cache, size_t i) {
    std::mt19937_64 rng(100 + i);
    for (auto& b : buffer) b = static_cast<uint8_t>(rng());
    made.emplace_back(HashChunk(buffer), buffer);
    cache.PutCopyBehind(made.back().first, buffer);
    std::fill(buffer.begin(), buffer.end(), uint8_t{0xee});
  };
  auto expect_all = [&](ChunkCache& cache) {
    for (size_t i = 0; i < made.size(); ++i) {
      ByteBuffer out;
      ASSERT_TRUE(cache.Get(made[i].first, &out)) << i;
      EXPECT_TRUE(std::equal(out.begin(), out.end(), made[i].second.begin(), made[i].second.end())) << i;
    }
  };
  {
    std::unique_ptr<ChunkCache> cache = Open();
    ASSERT_TRUE(cache);
    put(*cache, 0);
    EXPECT_TRUE(cache->Contains(made[0].first)) << "write-behind off: written at once";
    cache->set_write_behind(2 * kEntry);
    for (size_t i = 1; i < 12; ++i) put(*cache, i);
    cache->Flush();
    expect_all(*cache);
    for (size_t i = 12; i < 20; ++i) put(*cache, i);
  }  // destroyed with entries queued
  std::unique_ptr<ChunkCache> again = Open();
  ASSERT_TRUE(again);
  expect_all(*again);
}

// ---- whole files ---------------------------------------------------------------------------

// A whole file (a published file's complete copy, ChunkCache's layout): its chunks are put as
// chunk files first (a mount read them), then written whole in order; afterwards every chunk
// is found in the whole file, the chunk files are gone, the size bound counts the whole file
// and its index once, and OpenWholeFile hands out its bytes. Another instance (the next mount)
// finds it too.
TEST_F(ChunkCacheReferencesTest, AWholeFileReplacesItsChunkFilesAndServesThem) {
  auto cache = Open();
  // Chunks of uneven sizes, so that they start anywhere in a block; bigger than the staging
  // buffer, so that it is written in several parts.
  std::mt19937_64 rng(7);
  std::vector<uint8_t> bytes(WholeFileWriter::kStagingBytes * 2 + 123457);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<ChunkRef> rows;
  for (uint64_t off = 0; off < bytes.size();) {
    const uint64_t len = std::min<uint64_t>(bytes.size() - off, 1000003 + (rows.size() % 3) * 77);
    rows.push_back({HashChunk(std::span<const uint8_t>(bytes).subspan(off, len)), off, len});
    ASSERT_TRUE(cache->Put(rows.back().hash, std::span<const uint8_t>(bytes).subspan(off, len)).ok());
    off += len;
  }
  ASSERT_GE(WalkCache().chunks.size(), rows.size());
  const std::string sha(64, 'a');
  EXPECT_FALSE(cache->HasWholeFile(sha, bytes.size()));
  EXPECT_EQ(cache->OpenWholeFile(sha, bytes.size()), -1);
  {
    auto w = cache->BeginWholeFile(sha, bytes.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    // Out of order, and the wrong length, are refused.
    EXPECT_FALSE((*w)->Append(rows[1], std::span<const uint8_t>(bytes).subspan(rows[1].offset, rows[1].length)).ok());
    EXPECT_FALSE((*w)->Append(rows[0], std::span<const uint8_t>(bytes).subspan(0, rows[0].length - 1)).ok());
    for (const ChunkRef& r : rows) {
      ASSERT_TRUE((*w)->Append(r, std::span<const uint8_t>(bytes).subspan(r.offset, r.length)).ok());
    }
    Status done = (*w)->Finish();
    ASSERT_TRUE(done.ok()) << done.ToString();
  }
  const std::string path = cache->WholeFilePath(sha, bytes.size());
  EXPECT_EQ(Read(path), bytes);
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  Walk walk = WalkCache();
  size_t chunk_files = 0;
  for (const fs::path& c : walk.chunks) chunk_files += c.string().find("/chunks/") != std::string::npos;
  EXPECT_EQ(chunk_files, 0u) << "the whole file replaces the chunk files";
  ASSERT_EQ(walk.refs.size(), 1u);
  const uint64_t index_bytes = fs::file_size(walk.refs[0]);
  EXPECT_EQ(cache->size_bytes(), bytes.size() + index_bytes);
  std::unique_ptr<ChunkCache> other = Open();  // (the next mount)
  for (ChunkCache* c : {cache.get(), other.get()}) {
    for (const ChunkRef& r : rows) {
      ByteBuffer out;
      ASSERT_TRUE(c->Get(r.hash, &out)) << r.offset;
      EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(r.offset)));
    }
    const int fd = c->OpenWholeFile(sha, bytes.size());
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> got(bytes.size());
    EXPECT_EQ(::pread(fd, got.data(), got.size(), 0), static_cast<ssize_t>(got.size()));
    ::close(fd);
    EXPECT_EQ(got, bytes);
    EXPECT_EQ(c->size_bytes(), bytes.size() + index_bytes);
  }
  // Once there, it is not written again.
  EXPECT_EQ(cache->BeginWholeFile(sha, bytes.size()).status().kind(), ErrorKind::kConflict);
  EXPECT_TRUE(fs::exists(WholeIndexFileOf(path)));

  // A cache directory moved elsewhere (or copied with cp -a) keeps its whole files.
  cache.reset();
  other.reset();
  fs::rename(root_ / "cache", root_ / "moved");
  auto moved = ChunkCache::Open((root_ / "moved").string(), 1ull << 30);
  ASSERT_TRUE(moved.ok());
  EXPECT_TRUE((*moved)->HasWholeFile(sha, bytes.size()));
  for (const ChunkRef& r : rows) {
    ByteBuffer out;
    ASSERT_TRUE((*moved)->Get(r.hash, &out)) << r.offset;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(r.offset)));
  }
  EXPECT_EQ((*moved)->size_bytes(), bytes.size() + index_bytes);
}

// A mount's cache (whole_reads_around_page_cache) serves a whole file's chunks with the same
// bytes, and those it read from the disk stay out of the page cache (where the file system does
// direct I/O): the reader of the new version has its own pages.
TEST_F(ChunkCacheReferencesTest, AMountReadsAWholeFileAroundThePageCache) {
  std::mt19937_64 rng(17);
  std::vector<uint8_t> bytes(3 * 1000003 + 4321);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<ChunkRef> rows;
  const std::string sha(64, 'b');
  std::string path;
  {
    auto cache = Open();
    path = cache->WholeFilePath(sha, bytes.size());
    auto w = cache->BeginWholeFile(sha, bytes.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (uint64_t off = 0; off < bytes.size();) {
      const uint64_t len = std::min<uint64_t>(bytes.size() - off, 1000003);
      rows.push_back({HashChunk(std::span<const uint8_t>(bytes).subspan(off, len)), off, len});
      ASSERT_TRUE((*w)->Append(rows.back(), std::span<const uint8_t>(bytes).subspan(off, len)).ok());
      off += len;
    }
    ASSERT_TRUE((*w)->Finish().ok());
  }
  ASSERT_TRUE(fs::exists(path));
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  const bool dropped = !AllInPageCache(fd, 0, bytes.size());  // (tmpfs keeps its pages)
  ChunkCacheOptions around;
  around.whole_reads_around_page_cache = true;
  auto cache = Open(around);
  for (const ChunkRef& r : rows) {
    ByteBuffer out;
    ASSERT_TRUE(cache->Get(r.hash, &out)) << r.offset;
    ASSERT_EQ(out.size(), r.length);
    EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(r.offset))) << r.offset;
  }
  const int direct = OpenDirect(path, O_RDONLY);
  if (dropped && direct >= 0) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    for (uint64_t off = 0; off + page <= bytes.size(); off += page) {
      ASSERT_FALSE(AllInPageCache(fd, off, page)) << "the read filled the page cache at " << off;
    }
  }
  if (direct >= 0) ::close(direct);
  ::close(fd);
}

// A whole file written through the page cache (a stream's: Mode::kPageCache, no staging
// buffers) is nothing until its Commit, which a mount runs once reads pause: Complete alone
// serves nothing, and a completed file given up on still puts every chunk it holds into the
// cache (Spill); committed, it is the same whole file as one written O_DIRECT.
TEST_F(ChunkCacheReferencesTest, AWholeFileWrittenThroughThePageCacheIsServedOnceCommitted) {
  auto cache = Open();
  std::mt19937_64 rng(11);
  std::vector<uint8_t> bytes(3 * 1000003 + 4097);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  std::vector<ChunkRef> rows;
  for (uint64_t off = 0; off < bytes.size();) {
    const uint64_t len = std::min<uint64_t>(bytes.size() - off, 1000003);
    rows.push_back({HashChunk(std::span<const uint8_t>(bytes).subspan(off, len)), off, len});
    off += len;
  }
  auto append_all = [&](WholeFileWriter& w) {
    for (const ChunkRef& r : rows) {
      ASSERT_TRUE(w.Append(r, std::span<const uint8_t>(bytes).subspan(r.offset, r.length)).ok());
    }
  };
  const std::string sha(64, 'd');
  {
    // Given up on after Complete: its chunks go into the cache as chunk files.
    auto w = cache->BeginWholeFile(sha, bytes.size(), WholeFileWriter::Mode::kPageCache);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    append_all(**w);
    ASSERT_TRUE((*w)->Complete().ok());
    EXPECT_FALSE((*w)->Complete().ok()) << "once";
    EXPECT_EQ((*w)->Spill(), rows.size());
  }
  EXPECT_TRUE(fs::is_empty(root_ / "cache" / "files" / ".tmp"));
  EXPECT_FALSE(cache->HasWholeFile(sha, bytes.size()));
  for (const ChunkRef& r : rows) EXPECT_TRUE(cache->Contains(r.hash)) << r.offset;

  auto w = cache->BeginWholeFile(sha, bytes.size(), WholeFileWriter::Mode::kPageCache);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_FALSE((*w)->Commit().ok()) << "not complete";
  append_all(**w);
  ASSERT_TRUE((*w)->Complete().ok());
  EXPECT_FALSE(cache->HasWholeFile(sha, bytes.size()));
  EXPECT_EQ(cache->OpenWholeFile(sha, bytes.size()), -1) << "served before its sync";
  Status committed = (*w)->Commit();
  ASSERT_TRUE(committed.ok()) << committed.ToString();
  w->reset();
  const std::string path = cache->WholeFilePath(sha, bytes.size());
  EXPECT_EQ(Read(path), bytes);
  EXPECT_TRUE(fs::is_empty(root_ / "cache" / "files" / ".tmp"));
  const int fd = cache->OpenWholeFile(sha, bytes.size());
  ASSERT_GE(fd, 0);
  ::close(fd);
  for (const ChunkRef& r : rows) {
    ByteBuffer out;
    ASSERT_TRUE(cache->Get(r.hash, &out)) << r.offset;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), bytes.begin() + static_cast<ptrdiff_t>(r.offset)));
  }
  size_t chunk_files = 0;
  for (const fs::path& c : WalkCache().chunks) chunk_files += c.string().find("/chunks/") != std::string::npos;
  EXPECT_EQ(chunk_files, 0u) << "the whole file replaces the chunk files";
}

// A whole file written but not finished leaves nothing; bad digests and files too large for
// the bound are refused.
TEST_F(ChunkCacheReferencesTest, AnUnfinishedWholeFileLeavesNothing) {
  auto cache = Open({}, 64ull << 20);
  const std::vector<uint8_t> bytes(1 << 20, 7);
  const ChunkRef row{HashChunk(bytes), 0, bytes.size()};
  const std::string sha(64, 'b');
  {
    auto w = cache->BeginWholeFile(sha, 2 * bytes.size());
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE((*w)->Append(row, bytes).ok());
    EXPECT_FALSE((*w)->Finish().ok()) << "half of the file";
  }
  EXPECT_TRUE(fs::is_empty(root_ / "cache" / "files" / ".tmp"));
  EXPECT_FALSE(fs::exists(cache->WholeFilePath(sha, 2 * bytes.size())));
  EXPECT_EQ(cache->OpenWholeFile(sha, 2 * bytes.size()), -1);
  EXPECT_EQ(cache->size_bytes(), 0u);
  EXPECT_EQ(cache->BeginWholeFile("not a digest", 10).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(cache->BeginWholeFile(std::string(64, 'A'), 10).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(cache->BeginWholeFile(sha, 40ull << 20).status().kind(), ErrorKind::kResourceExhausted);
}

// A whole file changed after it was written (a flipped byte moves its mtime; a flip with the
// mtime put back is only seen by the chunk's hash) is never handed out whole again: it and its
// index go, and its chunks are misses (the mount builds them again), never other bytes.
TEST_F(ChunkCacheReferencesTest, AWholeFileChangedInPlaceIsDroppedNeverServed) {
  for (bool restore_mtime : {false, true}) {
    SCOPED_TRACE(restore_mtime ? "mtime restored" : "mtime moved");
    fs::remove_all(root_ / "cache");
    auto cache = Open();
    std::vector<uint8_t> bytes(3 << 20);
    std::mt19937_64 rng(restore_mtime);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    std::vector<ChunkRef> rows;
    for (uint64_t off = 0; off < bytes.size(); off += 1 << 20) {
      rows.push_back({HashChunk(std::span<const uint8_t>(bytes).subspan(off, 1 << 20)), off, 1 << 20});
    }
    const std::string sha(64, restore_mtime ? 'c' : 'd');
    auto w = cache->BeginWholeFile(sha, bytes.size());
    ASSERT_TRUE(w.ok());
    for (const ChunkRef& r : rows) ASSERT_TRUE((*w)->Append(r, std::span<const uint8_t>(bytes).subspan(r.offset, r.length)).ok());
    ASSERT_TRUE((*w)->Finish().ok());
    const std::string path = cache->WholeFilePath(sha, bytes.size());
    const int64_t mtime = MtimeNs(path);
    {
      const int fd = ::open(path.c_str(), O_RDWR);
      ASSERT_GE(fd, 0);
      uint8_t b = bytes[(1 << 20) + 5] ^ 0x40;
      ASSERT_EQ(::pwrite(fd, &b, 1, (1 << 20) + 5), 1);
      ::close(fd);
    }
    if (restore_mtime) {
      SetMtimeNs(path, mtime);
      // Handed out (only a read of every byte could tell), but its changed chunk is a miss.
      ByteBuffer out;
      EXPECT_TRUE(cache->Get(rows[0].hash, &out));
      EXPECT_FALSE(cache->Get(rows[1].hash, &out));
      EXPECT_FALSE(fs::exists(path)) << "the chunk's mismatch drops the whole file";
    } else {
      EXPECT_EQ(cache->OpenWholeFile(sha, bytes.size()), -1);
      EXPECT_FALSE(fs::exists(path));
      ByteBuffer out;
      for (const ChunkRef& r : rows) EXPECT_FALSE(cache->Get(r.hash, &out));
    }
    EXPECT_EQ(cache->OpenWholeFile(sha, bytes.size()), -1);
    EXPECT_TRUE(WalkCache().refs.empty());
    EXPECT_EQ(cache->size_bytes(), 0u);
  }
}

// A whole file and its index file are one entry of the bound: evicted together, in LRU order
// (the index file's mtime, which OpenWholeFile refreshes), and counted again by the next
// instance.
TEST_F(ChunkCacheReferencesTest, WholeFilesAreEvictedWithTheirIndexFiles) {
  auto cache = Open();
  std::vector<std::string> shas;
  const std::vector<uint8_t> bytes(2 << 20, 1);
  for (int k = 0; k < 3; ++k) {
    std::vector<uint8_t> b = bytes;
    b[0] = static_cast<uint8_t>(k);
    shas.push_back(std::string(64, static_cast<char>('0' + k)));
    auto w = cache->BeginWholeFile(shas.back(), b.size());
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append({HashChunk(b), 0, b.size()}, b).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  Walk walk = WalkCache();
  ASSERT_EQ(walk.refs.size(), 3u);
  const uint64_t each = bytes.size() + fs::file_size(walk.refs[0]);
  EXPECT_EQ(cache->size_bytes(), 3 * each);
  EXPECT_EQ(Open()->size_bytes(), 3 * each);
  // Oldest first: file 1's index, then 0's, then 2's.
  const int64_t now = MtimeNs(walk.refs[0].string());
  for (int k : {0, 1, 2}) {
    SetMtimeNs(WholeIndexFileOf(cache->WholeFilePath(shas[k], bytes.size())).string(), now - (k == 1 ? 3 : k == 0 ? 2 : 1) * 1000000000ll);
  }
  ASSERT_TRUE(cache->EvictTo(2 * each).ok());
  EXPECT_FALSE(fs::exists(cache->WholeFilePath(shas[1], bytes.size())));
  EXPECT_FALSE(fs::exists(WholeIndexFileOf(cache->WholeFilePath(shas[1], bytes.size()))));
  EXPECT_TRUE(cache->HasWholeFile(shas[0], bytes.size()));
  EXPECT_TRUE(cache->HasWholeFile(shas[2], bytes.size()));
  EXPECT_EQ(cache->size_bytes(), 2 * each);
  ASSERT_TRUE(cache->EvictTo(each).ok());
  EXPECT_FALSE(fs::exists(cache->WholeFilePath(shas[0], bytes.size())));
  EXPECT_TRUE(cache->HasWholeFile(shas[2], bytes.size()));
  EXPECT_EQ(Open()->size_bytes(), each);
}

}  // namespace
}  // namespace weightfs
