// The bucket commands against real servers on loopback: nginx (WebDAV) for http:// and s3rver
// for s3://, directly and through a fault-injecting proxy (503s, stalls, a bucket that is down).
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "tests/testing/command_runner.h"
#include "tests/testing/fake_aws.h"
#include "tests/testing/s3_test_server.h"
#include "tests/testing/test_servers.h"

namespace {

namespace fs = std::filesystem;
using weightfs::test::FaultProxy;
using weightfs::test::NginxServer;
using weightfs::test::S3rverServer;

using Result = weightfs::test::CommandResult;

Result RunS3Cli(const std::string& args) {
  // s3rver's only account; s3rver does not check signatures but does check the key id.
  return weightfs::test::RunShell("AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1 " +
                                  std::string(WEIGHTFS_BINARY) + " " + args + " 2>&1");
}

std::string Slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class RemoteBucketCli : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    data_ = fs::temp_directory_path() / ("wfs-remote-data-" + std::to_string(getpid()));
    fs::remove_all(data_);
    Result g = RunS3Cli("gen " + data_.string() + " --params 4M --versions 3 --lr 1e-6 --shard-size 4M --seed 5");
    ASSERT_EQ(g.exit_code, 0) << g.out;
  }
  static void TearDownTestSuite() { fs::remove_all(data_); }

  void SetUp() override {
    root_ = fs::temp_directory_path() / ("wfs-remote-" + std::to_string(getpid()) + "-" +
                                         std::to_string(counter_++));
    fs::remove_all(root_);
    fs::create_directories(root_);
    if (GetParam() == "http") {
      nginx_ = std::make_unique<NginxServer>();
      ASSERT_TRUE(nginx_->Start());
      origin_ = nginx_->url();
    } else {
      s3_ = std::make_unique<S3rverServer>("bench");
      ASSERT_TRUE(s3_->Start());
      origin_ = s3_->endpoint();
    }
  }
  void TearDown() override {
    proxy_.reset();
    nginx_.reset();
    s3_.reset();
    fs::remove_all(root_);
  }

  // The bucket URL and options for a server at `base` (the origin or a proxy in front of it).
  std::string Bucket(const std::string& base) const {
    if (GetParam() == "http") return base + "/bucket";
    return "s3://bench/run --endpoint " + base;
  }
  std::string Version(int k) const { return (data_ / ("v00" + std::to_string(k))).string(); }
  std::string Cache(const std::string& name) const { return " --cache-dir " + (root_ / name).string(); }

  void ExpectPulledEqual(const std::string& bucket, int k, const std::string& cache) {
    const fs::path dest = root_ / ("out" + std::to_string(k) + cache);
    Result pull = RunS3Cli("pull " + bucket + " acme/m@v" + std::to_string(k) + " " + dest.string() +
                         Cache(cache) + " --timeout 60 --stats");
    ASSERT_EQ(pull.exit_code, 0) << pull.out;
    for (const auto& e : fs::directory_iterator(Version(k))) {
      EXPECT_EQ(Slurp(e.path()), Slurp(dest / e.path().filename())) << e.path();
    }
  }

  static fs::path data_;
  static int counter_;
  fs::path root_;
  std::unique_ptr<NginxServer> nginx_;
  std::unique_ptr<S3rverServer> s3_;
  std::unique_ptr<FaultProxy> proxy_;
  std::string origin_;
};
fs::path RemoteBucketCli::data_;
int RemoteBucketCli::counter_ = 0;

TEST_P(RemoteBucketCli, PushPullVerifyGcRoundTrip) {
  const std::string bucket = Bucket(origin_);
  ASSERT_EQ(RunS3Cli("init " + bucket).exit_code, 0);
  for (int k = 0; k < 3; ++k) {
    Result p = RunS3Cli("push " + bucket + " acme/m@v" + std::to_string(k) + " " + Version(k) +
                      Cache("push") + " --pack-size 1M");
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  ExpectPulledEqual(bucket, 2, "cold");
  Result v = RunS3Cli("verify " + bucket + " acme/m@v2");
  EXPECT_EQ(v.exit_code, 0) << v.out;
  Result log = RunS3Cli("log " + bucket + " acme/m");
  EXPECT_EQ(log.exit_code, 0) << log.out;
  EXPECT_NE(log.out.find("acme/m@v2"), std::string::npos) << log.out;
  Result again = RunS3Cli("push " + bucket + " acme/m@v2 " + Version(2) + " --no-cache");
  EXPECT_EQ(again.exit_code, 1);
  EXPECT_NE(again.out.find("already"), std::string::npos) << again.out;
  Result gc = RunS3Cli("gc " + bucket + " --dry-run");
  EXPECT_EQ(gc.exit_code, 0) << gc.out;
  EXPECT_NE(gc.out.find("would remove 0 unreferenced packs"), std::string::npos) << gc.out;
}

TEST_P(RemoteBucketCli, FlakyBucketStillWorks) {
  proxy_ = std::make_unique<FaultProxy>();
  FaultProxy::Options o;
  o.error_rate = 0.2;
  o.stall_rate = 0.05;
  o.stall_seconds = 1;
  o.seed = 7;
  ASSERT_TRUE(proxy_->Start(origin_, o));
  const std::string bucket = Bucket(proxy_->url());
  ASSERT_EQ(RunS3Cli("init " + Bucket(origin_)).exit_code, 0);
  for (int k = 0; k < 2; ++k) {
    Result p = RunS3Cli("push " + bucket + " acme/m@v" + std::to_string(k) + " " + Version(k) +
                      Cache("push") + " --pack-size 1M --timeout 60 --stats");
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  ExpectPulledEqual(bucket, 1, "flaky");
  auto stats = proxy_->Stats();
  EXPECT_GT(stats["errors"], 0u);  // the faults did happen
}

TEST_P(RemoteBucketCli, BucketThatIsDownFailsWithinTheTimeout) {
  proxy_ = std::make_unique<FaultProxy>();
  ASSERT_TRUE(proxy_->Start(origin_));
  const std::string bucket = Bucket(proxy_->url());
  ASSERT_EQ(RunS3Cli("init " + bucket).exit_code, 0);
  ASSERT_EQ(RunS3Cli("push " + bucket + " acme/m@v0 " + Version(0) + " --no-cache").exit_code, 0);
  for (const char* mode : {"down", "stall"}) {
    SCOPED_TRACE(mode);
    proxy_->SetMode(mode);
    Result pull = RunS3Cli("pull " + bucket + " acme/m@v0 " + (root_ / "out").string() +
                         " --no-cache --timeout 4");
    EXPECT_EQ(pull.exit_code, 1) << pull.out;
    EXPECT_LT(pull.seconds, 30.0) << pull.out;
    Result push = RunS3Cli("push " + bucket + " acme/m@v1 " + Version(1) + " --no-cache --timeout 4");
    EXPECT_EQ(push.exit_code, 1) << push.out;
    EXPECT_LT(push.seconds, 30.0) << push.out;
  }
  proxy_->SetMode("normal");
  EXPECT_EQ(RunS3Cli("verify " + bucket + " acme/m@v0 --timeout 30").exit_code, 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, RemoteBucketCli, ::testing::Values("http", "s3"),
                         [](const auto& info) { return info.param; });

// Issue 29, item 1, as a node sees it: no keys anywhere, an instance role. The commands sign
// with what instance metadata (the fake on loopback) hands out; the proxy in front of s3rver
// accepts only those credentials and checks each signature. With no role and no keys the
// command refuses and says what to do, and --no-sign-request is the one way to go unsigned.
TEST(RemoteBucketCliCredentials, AnInstanceRoleSignsAndNothingIsEverUnsignedUnasked) {
  weightfs::test::TempDir dir("cli-creds");
  const std::string tokens = dir.Join("tokens.json");
  S3rverServer s3("bench");
  ASSERT_TRUE(s3.Start());
  weightfs::test::FakeAwsCredentials fake;
  ASSERT_TRUE(fake.Start(tokens));
  weightfs::test::S3PreconditionProxy proxy;
  ASSERT_TRUE(proxy.Start(s3.endpoint(), tokens));
  fs::create_directories(dir.Join("home"));
  const std::string node_env = "env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY -u AWS_SESSION_TOKEN -u AWS_PROFILE "
                               "-u AWS_WEB_IDENTITY_TOKEN_FILE -u AWS_CONTAINER_CREDENTIALS_FULL_URI "
                               "-u AWS_CONTAINER_CREDENTIALS_RELATIVE_URI HOME=" + dir.Join("home") +
                               " AWS_REGION=us-east-1 ";
  auto run = [&](const std::string& extra_env, const std::string& args) {
    return weightfs::test::RunShell(node_env + extra_env + " " + std::string(WEIGHTFS_BINARY) + " " + args + " 2>&1");
  };
  const std::string imds = "AWS_EC2_METADATA_SERVICE_ENDPOINT=" + fake.endpoint();
  const std::string bucket = "s3://bench/role --endpoint " + proxy.endpoint();
  const fs::path data = dir.Join("data");
  ASSERT_EQ(weightfs::test::RunShell(std::string(WEIGHTFS_BINARY) + " gen " + data.string() +
                                     " --params 1M --versions 1 --shard-size 4M --seed 3 2>&1").exit_code, 0);
  Result init = run(imds, "init " + bucket);
  ASSERT_EQ(init.exit_code, 0) << init.out;
  Result push = run(imds, "push " + bucket + " acme/m@v0 " + (data / "v000").string() + " --no-cache");
  ASSERT_EQ(push.exit_code, 0) << push.out;
  Result log = run(imds, "log " + bucket + " acme/m");
  EXPECT_EQ(log.exit_code, 0) << log.out;
  EXPECT_NE(log.out.find("acme/m@v0"), std::string::npos) << log.out;
  EXPECT_GE(fake.Stats()["issued_imds"], 3u);  // one per command
  EXPECT_EQ(proxy.Stats()["bad_signature"], 0u);
  EXPECT_EQ(proxy.Stats()["token_missing"], 0u);

  // No role, no keys (nothing answers at the metadata address): refused, said, fast.
  const std::string nowhere = "AWS_EC2_METADATA_SERVICE_ENDPOINT=http://127.0.0.1:" +
                              std::to_string(weightfs::test::FreeLoopbackPort());
  Result refused = run(nowhere, "log s3://bench/role --endpoint " + s3.endpoint() + " acme/m");
  EXPECT_EQ(refused.exit_code, 1) << refused.out;
  EXPECT_NE(refused.out.find("no AWS credentials found"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("--no-sign-request"), std::string::npos) << refused.out;
  EXPECT_LT(refused.seconds, 10.0);
  // Anonymous when asked (s3rver lets anyone read).
  Result anonymous = run(nowhere, "log s3://bench/role --endpoint " + s3.endpoint() + " acme/m --no-sign-request");
  EXPECT_EQ(anonymous.exit_code, 0) << anonymous.out;
  EXPECT_NE(anonymous.out.find("acme/m@v0"), std::string::npos) << anonymous.out;
}

}  // namespace
