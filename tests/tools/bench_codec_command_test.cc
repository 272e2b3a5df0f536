// End-to-end tests of `weightfs bench codec`: the real binary on generated checkpoints.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/testing/command_runner.h"

namespace {

using weightfs::test::CommandResult;

CommandResult RunWeightfs(const std::string& args) {
  return weightfs::test::RunShell(std::string(WEIGHTFS_BINARY) + " " + args + " 2>/dev/null");
}

std::vector<nlohmann::json> JsonLines(const std::string& text) {
  std::vector<nlohmann::json> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] == '{') out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

TEST(BenchCodecCommand, GeneratedPairsReportExactDeltasSmallerThanFull) {
  CommandResult r = RunWeightfs("bench codec --generate --params 2M --scenarios rl-1e-6,header-change,sft "
                      "--json --zstd19 none");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto rows = JsonLines(r.out);
  ASSERT_EQ(rows.size(), 3u) << r.out;
  for (const auto& j : rows) {
    SCOPED_TRACE(j.dump());
    for (const char* key : {"changed_fraction", "new_bytes", "delta_bytes", "full_bytes",
                            "entropy_floor_bytes", "encode_mb_s", "decode_mb_s", "exact"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
    EXPECT_TRUE(j["exact"].get<bool>());
    EXPECT_GT(j["changed_fraction"].get<double>(), 0.0);
    EXPECT_LT(j["delta_bytes"].get<uint64_t>(), j["full_bytes"].get<uint64_t>());
    EXPECT_LT(j["full_bytes"].get<uint64_t>(), j["new_bytes"].get<uint64_t>());
    // A delta never costs more than FULL + 1%, and FULL beats plain zstd -3 on bf16 weights.
    EXPECT_LE(j["delta_bytes"].get<double>(), 1.01 * j["full_bytes"].get<double>());
    if (j.contains("zstd3_bytes")) {
      EXPECT_LT(j["full_bytes"].get<uint64_t>(), j["zstd3_bytes"].get<uint64_t>());
    }
  }
  // The rl-like pair is far below the sparse index+value format.
  EXPECT_LT(rows[0]["delta_bytes"].get<double>(),
            0.5 * rows[0]["sparse_index_value_bytes"].get<double>());
}

TEST(BenchCodecCommand, PairOfFilesAndBadArguments) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("wfs-bench-test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& data) {
    FILE* f = std::fopen((dir / name).c_str(), "wb");
    std::fwrite(data.data(), 1, data.size(), f);
    std::fclose(f);
  };
  std::string a(1 << 20, 'a'), b = a;
  for (size_t i = 0; i < b.size(); i += 4099) b[i] = 'b';
  write("old.bin", a);
  write("new.bin", b);
  CommandResult r = RunWeightfs("bench codec " + (dir / "old.bin").string() + " " + (dir / "new.bin").string() +
                      " --json --no-zstd");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto rows = JsonLines(r.out);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_TRUE(rows[0]["exact"].get<bool>());
  EXPECT_LT(rows[0]["delta_bytes"].get<uint64_t>(), 4096u);

  EXPECT_NE(RunWeightfs("bench codec " + (dir / "missing").string() + " " + (dir / "new.bin").string()).exit_code, 0);
  EXPECT_NE(RunWeightfs("bench codec --no-such-flag").exit_code, 0);
  EXPECT_EQ(RunWeightfs("bench codec --help").exit_code, 0);
  fs::remove_all(dir);
}

TEST(BenchCodecCommand, VersionDirectoriesPairFilesByNameAndReportATotal) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("wfs-bench-dirs-" + std::to_string(getpid()));
  fs::remove_all(dir);
  CommandResult gen = RunWeightfs("gen " + dir.string() +
                                  " --params 2M --versions 1 --lr 1e-6 --shard-size 2MB");
  ASSERT_EQ(gen.exit_code, 0) << gen.out;
  CommandResult r = RunWeightfs("bench codec " + (dir / "v000").string() + " " +
                                (dir / "v001").string() + " --json --no-zstd");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  auto rows = JsonLines(r.out);
  ASSERT_GE(rows.size(), 3u) << r.out;  // two or more shards (+ config, index) and the total
  const auto& total = rows.back();
  EXPECT_EQ(total["name"], "total");
  EXPECT_TRUE(total["exact"].get<bool>());
  uint64_t delta = 0, bytes = 0;
  for (size_t i = 0; i + 1 < rows.size(); ++i) {
    delta += rows[i]["delta_bytes"].get<uint64_t>();
    bytes += rows[i]["new_bytes"].get<uint64_t>();
  }
  EXPECT_EQ(total["delta_bytes"].get<uint64_t>(), delta);
  EXPECT_EQ(total["new_bytes"].get<uint64_t>(), bytes);
  EXPECT_LT(delta * 20, bytes);  // a 1e-6 step is a small fraction of the version
  fs::remove_all(dir);
}

}  // namespace
