// `weightfs upgrade` of a format 2 bucket written before table blocks (docs/format2.md "Blocks"):
// every version holding a file of more than kTableBlockRows rows in one table section gets its
// table rewritten in blocks, and every version reads back bit-exact through the CLI after it.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/engine/version_writer.h"
#include "hub/store/local_store.h"
#include "tests/testing/command_runner.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using test::RunCli;
using test::Slurp;

void WriteBytes(const fs::path& path, const std::vector<uint8_t>& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// The version's table sections of `path`, as a fresh reader of the bucket sees them.
TableSection SectionOf(const fs::path& bucket_dir, const std::string& version, const std::string& path) {
  auto store = LocalStore::Open(bucket_dir.string());
  EXPECT_TRUE(store.ok());
  auto bucket = Bucket::Open(std::shared_ptr<Store>(std::move(store).value()));
  EXPECT_TRUE(bucket.ok());
  auto m = (*bucket)->ReadManifest("acme/m", version);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  const ManifestFile* f = (*m)->FindFile(path);
  EXPECT_NE(f, nullptr);
  return f ? f->section : TableSection{};
}

TEST(UpgradeCli, RewritesOneTableSectionsInBlocksAndEveryVersionReadsTheSame) {
  const fs::path root = fs::temp_directory_path() / ("wfs-upgrade-cli-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const fs::path bucket_dir = root / "bucket";
  fs::create_directories(bucket_dir);
  constexpr int kVersions = 3;
  constexpr uint64_t kChunk = 4096;
  constexpr size_t kRows = 3 * kTableBlockRows / 2;  // 768 rows: one block and a half
  {
    auto local = LocalStore::Open(bucket_dir.string());
    ASSERT_TRUE(local.ok());
    std::shared_ptr<Store> store(std::move(local).value());
    ASSERT_TRUE(Bucket::Init(*store).ok());
    auto bucket = Bucket::Open(store);
    ASSERT_TRUE(bucket.ok());
    (*bucket)->set_table_block_rows(1'000'000'000);  // every section one table, as before blocks
    ThreadPool pool(2);
    PushOptions options;
    options.chunk_bytes = kChunk;
    options.pack_bytes = 1 << 20;
    std::mt19937_64 rng(7);
    std::vector<uint8_t> data(kRows * kChunk);
    for (auto& b : data) b = static_cast<uint8_t>(rng());
    std::shared_ptr<const Manifest> parent;
    for (int k = 0; k < kVersions; ++k) {
      for (int i = 0; i < 2000; ++i) data[rng() % data.size()] ^= 1;  // a step: a few bytes of most chunks
      WriteBytes(root / ("src/v" + std::to_string(k)) / "data.bin", data);
      auto files = FilesUnder((root / ("src/v" + std::to_string(k))).string());
      ASSERT_TRUE(files.ok());
      auto pushed = PushVersion(**bucket, nullptr, pool, {"acme/m", "v" + std::to_string(k)}, parent, *files, options);
      ASSERT_TRUE(pushed.ok()) << pushed.status().ToString();
      if (k > 0) {
        EXPECT_GT(pushed->delta_chunks, 0u);
      }
      parent = pushed->manifest;
    }
  }
  for (int k = 0; k < kVersions; ++k) {
    const TableSection s = SectionOf(bucket_dir, "v" + std::to_string(k), "data.bin");
    ASSERT_EQ(s.rows, kRows);
    ASSERT_TRUE(s.ShouldBeBlocks()) << "v" << k << " was not written in one table";
  }

  const test::CommandResult dry = RunCli("upgrade " + bucket_dir.string() + " --dry-run");
  ASSERT_EQ(dry.exit_code, 0) << dry.out;
  EXPECT_NE(dry.out.find("would rewrite the tables of 3 versions in blocks of 512 rows"), std::string::npos) << dry.out;
  EXPECT_TRUE(SectionOf(bucket_dir, "v0", "data.bin").ShouldBeBlocks()) << "--dry-run changed the bucket";

  const test::CommandResult upgraded = RunCli("upgrade " + bucket_dir.string());
  ASSERT_EQ(upgraded.exit_code, 0) << upgraded.out;
  EXPECT_NE(upgraded.out.find("rewrote the tables of 3 versions in blocks of 512 rows"), std::string::npos) << upgraded.out;
  for (int k = 0; k < kVersions; ++k) {
    const std::string v = "v" + std::to_string(k);
    SCOPED_TRACE(v);
    const TableSection s = SectionOf(bucket_dir, v, "data.bin");
    EXPECT_EQ(s.rows, kRows);
    EXPECT_GT(s.index_length, 0u);
    EXPECT_FALSE(s.ShouldBeBlocks());
    const fs::path out = root / ("out/" + v);
    const test::CommandResult pull = RunCli("pull " + bucket_dir.string() + " acme/m@" + v + " " + out.string() +
                                            " --cache-dir " + (root / ("cache-" + v)).string());
    ASSERT_EQ(pull.exit_code, 0) << pull.out;
    EXPECT_TRUE(Slurp(out / "data.bin") == Slurp(root / ("src/" + v) / "data.bin")) << v << " reads back wrong";
    const test::CommandResult verify = RunCli("verify " + bucket_dir.string() + " acme/m@" + v);
    EXPECT_EQ(verify.exit_code, 0) << verify.out;
  }
  // Run again: nothing left to rewrite, the bucket unchanged.
  const test::CommandResult again = RunCli("upgrade " + bucket_dir.string());
  EXPECT_EQ(again.exit_code, 0) << again.out;
  EXPECT_EQ(again.out.find("rewrote"), std::string::npos) << again.out;
  EXPECT_GT(SectionOf(bucket_dir, "v2", "data.bin").index_length, 0u);
  fs::remove_all(root);
}

}  // namespace
}  // namespace weightfs
