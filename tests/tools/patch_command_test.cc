// `weightfs patch` as users run it: a generated model pushed as four versions into a local
// bucket, patches from the parent and from further back written by the real binary, applied by
// an independent reader (tests/tools/apply_patch.py, the standard library's struct and json)
// and checked tensor by tensor against NEW's files.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/command_runner.h"

namespace {

namespace fs = std::filesystem;

using Result = weightfs::test::CommandResult;

using weightfs::test::RunCli;

Result Apply(const fs::path& old_file, const fs::path& patch, const fs::path& new_file) {
  return weightfs::test::RunShell("python3 " + std::string(WEIGHTFS_APPLY_PATCH) + " " + old_file.string() + " " +
                                  patch.string() + " " + new_file.string() + " 2>&1");
}

// The same with numpy (the Debian python3-numpy of /usr/bin/python3), as an engine applies it.
Result ApplyWithNumpy(const fs::path& old_file, const fs::path& patch, const fs::path& new_file) {
  const std::string script = std::string(WEIGHTFS_APPLY_PATCH).substr(0, std::string(WEIGHTFS_APPLY_PATCH).rfind('/')) +
                             "/apply_patch_numpy.py";
  return weightfs::test::RunShell("/usr/bin/python3 " + script + " " + old_file.string() + " " + patch.string() + " " +
                                  new_file.string() + " 2>&1");
}

class PatchCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / ("wfs-patch-cli-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    // 2 shards; v003 adds a tensor (model.extra_head.weight) and changes the headers.
    Result g = RunCli("gen " + (root_ / "data").string() +
                      " --params 3M --versions 3 --lr 1e-6 --shard-size 4M --seed 7 --header-change-at 3");
    ASSERT_EQ(g.exit_code, 0) << g.out;
    bucket_ = (root_ / "bucket").string();
    ASSERT_EQ(RunCli("init " + bucket_).exit_code, 0);
    for (int k = 0; k <= 3; ++k) {
      Result p = RunCli("push " + bucket_ + " acme/m@v" + std::to_string(k) + " " + Version(k).string() +
                        " --no-cache --chunk-size 256K");
      ASSERT_EQ(p.exit_code, 0) << p.out;
    }
  }
  static void TearDownTestSuite() { fs::remove_all(root_); }

  static fs::path Version(int k) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "v%03d", k);
    return root_ / "data" / buf;
  }
  static std::vector<std::string> Shards() {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(Version(0))) {
      if (e.path().extension() == ".safetensors") out.push_back(e.path().filename().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  static fs::path root_;
  static std::string bucket_;
};
fs::path PatchCli::root_;
std::string PatchCli::bucket_;

TEST_F(PatchCli, PatchesApplyToTheOldFilesAndGiveTheNewOnes) {
  ASSERT_EQ(Shards().size(), 2u);
  for (int from : {2, 1, 0}) {
    SCOPED_TRACE("v" + std::to_string(from) + " -> v3");
    const fs::path out = root_ / ("out" + std::to_string(from));
    Result r = RunCli("patch " + bucket_ + " acme/m@v3 --from v" + std::to_string(from) + " -o " + out.string() +
                      " --cache-dir " + (root_ / "cache").string() + " --stats");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("patch/stored"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("fetched"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("total:"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("from deltas"), std::string::npos) << r.out;
    for (const std::string& shard : Shards()) {
      ASSERT_TRUE(fs::exists(out / shard)) << shard << "\n" << r.out;
      EXPECT_NE(r.out.find(shard + ": "), std::string::npos) << r.out;
      Result a = Apply(Version(from) / shard, out / shard, Version(3) / shard);
      EXPECT_EQ(a.exit_code, 0) << shard << ": " << a.out;
      EXPECT_NE(a.out.find("ok: "), std::string::npos) << a.out;
      Result n = ApplyWithNumpy(Version(from) / shard, out / shard, Version(3) / shard);
      EXPECT_EQ(n.exit_code, 0) << shard << ": " << n.out;
      EXPECT_NE(n.out.find("with numpy"), std::string::npos) << n.out;
    }
    // No temporary is left next to the patches.
    for (const auto& e : fs::directory_iterator(out)) {
      EXPECT_EQ(e.path().extension(), ".safetensors") << e.path();
    }
  }
}

TEST_F(PatchCli, NamedFilesOnly) {
  const std::string shard = Shards()[1];
  const fs::path out = root_ / "named";
  Result r = RunCli("patch " + bucket_ + " acme/m@v2 --from acme/m@v1 " + shard + " -o " + out.string() + " --no-cache");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(fs::exists(out / shard));
  EXPECT_FALSE(fs::exists(out / Shards()[0]));
  Result a = Apply(Version(1) / shard, out / shard, Version(2) / shard);
  EXPECT_EQ(a.exit_code, 0) << a.out;
}

TEST_F(PatchCli, ErrorsAreClear) {
  const std::string out = " -o " + (root_ / "err").string() + " --no-cache";
  Result backwards = RunCli("patch " + bucket_ + " acme/m@v1 --from v3" + out);
  EXPECT_EQ(backwards.exit_code, 1) << backwards.out;
  EXPECT_NE(backwards.out.find("acme/m@v3 is not an ancestor of acme/m@v1"), std::string::npos) << backwards.out;
  Result missing = RunCli("patch " + bucket_ + " acme/m@v3 --from v9" + out);
  EXPECT_EQ(missing.exit_code, 1) << missing.out;
  EXPECT_NE(missing.out.find("v9"), std::string::npos) << missing.out;
  Result missing_new = RunCli("patch " + bucket_ + " acme/m@v8 --from v1" + out);
  EXPECT_EQ(missing_new.exit_code, 1) << missing_new.out;
  EXPECT_NE(missing_new.out.find("v8"), std::string::npos) << missing_new.out;
  Result no_file = RunCli("patch " + bucket_ + " acme/m@v3 --from v1 nope.safetensors" + out);
  EXPECT_EQ(no_file.exit_code, 1) << no_file.out;
  EXPECT_NE(no_file.out.find("nope.safetensors"), std::string::npos) << no_file.out;
  EXPECT_EQ(RunCli("patch " + bucket_ + " acme/m@v3 --from v1").exit_code, 2);        // no -o
  EXPECT_EQ(RunCli("patch " + bucket_ + " acme/m@v3" + out).exit_code, 2);            // no --from
  EXPECT_EQ(RunCli("patch " + bucket_ + " acme/m@v3 --from v1 --bogus" + out).exit_code, 2);
  Result help = RunCli("patch --help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.out.find("NAME.idx"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("flat[idx] = val"), std::string::npos) << help.out;
}

}  // namespace
