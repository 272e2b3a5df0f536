// `weightfs push` refuses the two mistakes that used to publish a wrong @latest silently: a
// source with no weight files, and the parent of version directories (tools/push_sources.h).
// Unit tests of the checks, then the real binary: refused with the fix named, nothing published;
// published with the flag.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/testing/command_runner.h"
#include "tools/push_sources.h"

namespace weightfs::cli {
namespace {

namespace fs = std::filesystem;
using Result = weightfs::test::CommandResult;

Result RunCli(const std::string& args) {
  return weightfs::test::RunShell(std::string(WEIGHTFS_BINARY) + " " + args + " 2>&1");
}

TEST(PushSources, WeightFilesAreKnownByTheirExtension) {
  for (const char* w : {"model-00001-of-00002.safetensors", "pytorch_model.bin", "x.PT", "a/b.pth", "m.gguf",
                        "w.npz", "tf_model.h5", "flax_model.msgpack", "__0_0.distcp"}) {
    EXPECT_TRUE(IsWeightFile(w)) << w;
  }
  for (const char* o : {"config.json", "tokenizer.model", "README.md", "model.safetensors.index.json", "binary"}) {
    EXPECT_FALSE(IsWeightFile(o)) << o;
  }
}

TEST(PushSources, TheParentOfCheckpointDirectoriesIsRefusedNamingTwoOfThem) {
  std::vector<PushFile> run = {{"step-100/model.safetensors", ""}, {"step-100/config.json", ""},
                               {"step-200/model.safetensors", ""}, {"step-300/model.safetensors", ""}};
  Status s = CheckNotVersionParent("ckpts", run);
  ASSERT_EQ(s.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(s.message().find("3 checkpoint directories (step-100/, step-200/, ..."), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("(ckpts/step-100)"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("--allow-nested"), std::string::npos) << s.message();
  Status at = CheckNotVersionParent("mnt/acme", {{"qwen@v1/model.safetensors", ""}});
  EXPECT_NE(at.message().find("version directory qwen@v1/"), std::string::npos) << at.message();
}

TEST(PushSources, ModelsWithComponentSubdirectoriesAreNotVersionParents) {
  // A diffusers layout: same file names in sibling directories whose names differ in letters.
  std::vector<PushFile> diffusers = {{"unet/diffusion_pytorch_model.safetensors", ""},
                                     {"vae/diffusion_pytorch_model.safetensors", ""},
                                     {"text_encoder/model.safetensors", ""},
                                     {"text_encoder_2/model.safetensors", ""},
                                     {"model.safetensors", ""}};
  EXPECT_TRUE(CheckNotVersionParent("sdxl", diffusers).ok());
  // Numbered directories without weights (logs/run1, logs/run2) are not checkpoints.
  EXPECT_TRUE(CheckNotVersionParent("m", {{"logs1/a.txt", ""}, {"logs2/a.txt", ""}, {"w.bin", ""}}).ok());
}

class PushSourcesCli : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-push-sources-" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    bucket_ = (root_ / "bucket").string();
    ASSERT_EQ(RunCli("init " + bucket_).exit_code, 0);
    Result g = RunCli("gen " + (root_ / "run").string() + " --params 1M --versions 1 --shard-size 1M --seed 2");
    ASSERT_EQ(g.exit_code, 0) << g.out;
  }
  void TearDown() override { fs::remove_all(root_); }

  // The versions of acme/m in the bucket, as `weightfs log` prints them.
  std::string Log() { return RunCli("log " + bucket_ + " acme/m").out; }

  fs::path root_;
  std::string bucket_;
};

TEST_F(PushSourcesCli, ADirectoryWithoutWeightsIsRefusedAndNothingIsPublished) {
  fs::create_directories(root_ / "configs");
  std::ofstream(root_ / "configs/config.json") << "{}";
  Result r = RunCli("push " + bucket_ + " acme/m@v1 " + (root_ / "configs").string() + " --no-cache");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("holds 1 file(s) (config.json) but no weight file"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--allow-no-weights"), std::string::npos) << r.out;
  fs::create_directories(root_ / "empty");
  Result e = RunCli("push " + bucket_ + " acme/m@v1 " + (root_ / "empty").string() + " --no-cache");
  EXPECT_EQ(e.exit_code, 1) << e.out;
  EXPECT_NE(e.out.find("holds no files"), std::string::npos) << e.out;
  EXPECT_NE(Log().find("no model acme/m in"), std::string::npos) << Log();
  // Meant: the flag publishes it.
  Result forced = RunCli("push " + bucket_ + " acme/m@v1 " + (root_ / "configs").string() +
                         " --no-cache --allow-no-weights");
  EXPECT_EQ(forced.exit_code, 0) << forced.out;
  EXPECT_NE(Log().find("acme/m@v1"), std::string::npos) << Log();
}

TEST_F(PushSourcesCli, TheParentOfVersionDirectoriesIsRefusedAndNothingIsPublished) {
  // gen wrote run/v000 and run/v001, each a sharded checkpoint.
  const std::string run = (root_ / "run").string();
  Result r = RunCli("push " + bucket_ + " acme/m@v1 " + run + " --no-cache");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find(run + " holds 2 checkpoint directories (v000/, v001/"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Push one per version (" + run + "/v000)"), std::string::npos) << r.out;
  EXPECT_NE(Log().find("no model acme/m in"), std::string::npos) << Log();
  Result one = RunCli("push " + bucket_ + " acme/m@v0 " + run + "/v000 --no-cache");
  EXPECT_EQ(one.exit_code, 0) << one.out;
  Result nested = RunCli("push " + bucket_ + " acme/m@all " + run + " --no-cache --allow-nested");
  EXPECT_EQ(nested.exit_code, 0) << nested.out;
}

}  // namespace
}  // namespace weightfs::cli
