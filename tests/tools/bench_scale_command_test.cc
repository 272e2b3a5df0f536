// `weightfs bench scale` at a reduced size, as CI runs it: a real bucket, a real mount. What is
// asserted is growth, never time: the bucket requests and bytes of each metadata operation, the
// daemon's peak RSS and the CLI's, when the versions grow 16-fold and when the chunks grow
// 10-fold (docs/format2.md says why none of them may grow with versions x chunks).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/testing/command_runner.h"

namespace {

struct Figures {
  std::map<std::string, nlohmann::json> lines;  // by "what"
  nlohmann::json all;
  uint64_t requests(const std::string& what) const { return lines.at(what).at("requests").get<uint64_t>(); }
  uint64_t bytes(const std::string& what) const { return lines.at(what).at("bytes").get<uint64_t>(); }
  uint64_t peak_rss(const std::string& what) const { return lines.at(what).at("peak_rss").get<uint64_t>(); }
};

class BenchScale : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/weightfs-bench-scale-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  Figures Run(int chunks, int versions, const std::string& shape = "--files 8") {
    const std::string cmd = std::string(WEIGHTFS_BINARY) + " bench scale --json " + shape +
                            " --keyframe-depth 16 --chunks " + std::to_string(chunks) + " --versions " +
                            std::to_string(versions) + " --memory-limit 256MiB --dir " + dir_ + " 2>&1";
    weightfs::test::CommandResult r = weightfs::test::RunShell(cmd);
    Figures f;
    EXPECT_EQ(r.exit_code, 0) << r.out;
    f.all = nlohmann::json::parse(r.out, nullptr, false);
    if (!f.all.is_object()) {
      ADD_FAILURE() << "not JSON: " << r.out;
      return f;
    }
    for (const nlohmann::json& l : f.all["lines"]) {
      const std::string note = l.value("note", "");
      EXPECT_EQ(note.find("fail"), std::string::npos) << l.dump();
      EXPECT_EQ(note.find("short read"), std::string::npos) << l.dump();
      f.lines[l.value("what", "")] = l;
    }
    return f;
  }

  std::string dir_;
};

constexpr const char* kMountOps[] = {
    "mount + first ls of the model dir", "ls -l of the model dir (every version)", "ls -l of a version dir (not yet read)",
    "first chunk read at depth 1",       "first chunk read at depth 16",           "mkdir of a draft"};

TEST_F(BenchScale, MetadataCostsDoNotGrowWithVersionsOrWithChunksBeyondOneFile) {
  // 40 versions: a depth-16 chain older than the 16 versions the mount preloads.
  const Figures small = Run(4000, 40);
  const Figures versions = Run(4000, 640);
  const Figures chunks = Run(40000, 40);
  if (HasFailure()) return;
  for (const char* op : kMountOps) {
    SCOPED_TRACE(op);
    ASSERT_TRUE(small.lines.count(op) && versions.lines.count(op) && chunks.lines.count(op));
    // 16x the versions: the same requests (a listing may take a page more).
    EXPECT_LE(versions.requests(op), small.requests(op) + 2);
    // 10x the chunks: the same requests; bytes grow at most with the rows of the one file read.
    EXPECT_LE(chunks.requests(op), small.requests(op) + 2);
    EXPECT_LE(chunks.bytes(op), small.bytes(op) * 10 + (64 << 10));
  }
  // Only the model directory's listing grows with the versions (names and times: O(versions)
  // in one listing), never with heads or tables read per version.
  for (const char* op : {"ls -l of a version dir (not yet read)", "first chunk read at depth 1",
                         "first chunk read at depth 16", "mkdir of a draft"}) {
    SCOPED_TRACE(op);
    EXPECT_LE(versions.bytes(op), small.bytes(op) + small.bytes(op) / 4 + (16 << 10));
  }
  const uint64_t listing_growth = versions.bytes("mount + first ls of the model dir") -
                                  std::min(versions.bytes("mount + first ls of the model dir"),
                                           small.bytes("mount + first ls of the model dir"));
  EXPECT_LE(listing_growth, 600u * 1024) << "more than ~1 KB a version for the listing";
  // Memory: the daemon's peak and the CLI's (log, push) do not grow with versions.
  const auto rss = [](const Figures& f) { return f.all.at("daemon_peak_rss").get<uint64_t>(); };
  EXPECT_LE(rss(versions), rss(small) + (48u << 20));
  EXPECT_LE(rss(chunks), rss(small) + (48u << 20));
  EXPECT_LE(rss(versions), 256u << 20) << "over --memory-limit";
  for (const char* op : {"log (every version)", "log --last 10", "push of a delta version (one chunk)"}) {
    SCOPED_TRACE(op);
    EXPECT_LE(versions.peak_rss(op), small.peak_rss(op) + (32u << 20));
  }
  // The metadata a version stores stays a small fraction of its delta (1% changed).
  EXPECT_LT(chunks.all.at("metadata_per_version").get<double>(), 0.02 * chunks.all.at("delta_per_version").get<double>());
  EXPECT_LE(chunks.all.at("real_row_bytes").get<double>(), 22.0);
}

// One file of many rows (docs/format2.md "Blocks"): a reader of one chunk reads its block of
// rows in each version of the chain, so what a first read costs does not grow with the file's
// chunk count (it did, whole sections: 367 MB for one chunk at depth 64 of 300,000 rows).
// Every row its own (random hashes, payloads one after another), as a real run's are.
TEST_F(BenchScale, AChunkOfOneFileOfManyRowsCostsTheSameAtTenTimesTheRows) {
  const std::string shape = "--files 1 --chunk-bytes 16KiB --real-rows";
  // 20,000 rows: a section of ~400 KB, read as its index and a block (a smaller one is read
  // whole: Bucket::kWholeSectionBytes).
  const Figures small = Run(20000, 40, shape);
  const Figures large = Run(200000, 40, shape);
  if (HasFailure()) return;
  for (const char* op : {"ls -l of a version dir (not yet read)", "first chunk read at depth 1",
                         "first chunk read at depth 16", "mkdir of a draft"}) {
    SCOPED_TRACE(op);
    ASSERT_TRUE(small.lines.count(op) && large.lines.count(op));
    EXPECT_LE(large.requests(op), small.requests(op) + 2);
    // The block index grows by a few bytes a block of 512 rows; nothing else may.
    EXPECT_LE(large.bytes(op), small.bytes(op) + small.bytes(op) / 8 + (8 << 10));
  }
  // A first read at depth 16: the chain's 17 versions, a block of rows each, not 70 MB of them.
  EXPECT_LT(large.bytes("first chunk read at depth 16"), 1u << 20);
  const auto rss = [](const Figures& f) { return f.all.at("daemon_peak_rss").get<uint64_t>(); };
  EXPECT_LE(rss(large), rss(small) + (32u << 20));
  EXPECT_LE(rss(large), 256u << 20) << "over --memory-limit";
}

}  // namespace
