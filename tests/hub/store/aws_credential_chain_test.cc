// Issue 29, item 1: the AWS credential provider chain against fake endpoints on loopback
// (tests/testing/fake_aws_credentials.py: EC2 instance metadata v2, a container endpoint, STS,
// a credential_process helper), with S3 requests going to s3rver through
// s3_precondition_proxy.py --tokens-file: the proxy accepts only credentials the fake issued,
// refuses expired ones with ExpiredToken and checks every signature against the issued secret.
// So "it worked" means the store signed with the credentials the provider handed out.
#include "hub/store/aws_credential_chain.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "hub/store/s3_store.h"
#include "tests/testing/fake_aws.h"
#include "tests/testing/s3_test_server.h"
#include "tests/testing/test_servers.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::Bytes;

namespace fs = std::filesystem;
using std::chrono::seconds;

TEST(AwsTimeTest, ParsesTheFormsAwsSends) {
  const auto t = ParseAwsTime("2026-12-06T03:00:00Z");
  ASSERT_TRUE(t);
  EXPECT_EQ(std::chrono::system_clock::to_time_t(*t), 1796526000);
  EXPECT_EQ(ParseAwsTime("2026-12-06T03:00:00.123Z"), t);
  EXPECT_EQ(ParseAwsTime("2026-12-06T04:00:00+01:00"), t);
  EXPECT_EQ(ParseAwsTime("2026-12-06T03:00:00"), t);
  EXPECT_FALSE(ParseAwsTime("tomorrow"));
  EXPECT_FALSE(ParseAwsTime("2026-13-06T03:00:00Z"));
  EXPECT_FALSE(ParseAwsTime("2026-12-06T03:00:00 PST"));
}

class AwsChainTest : public ::testing::Test {
 protected:
  static constexpr const char* kContainerToken = "ecs-task-token";
  static constexpr const char* kWebIdentityToken = "eks-projected-token";

  static void SetUpTestSuite() {
    dir_ = new test::TempDir("aws-chain");
    tokens_ = dir_->Join("tokens.json");
    server_ = new test::S3rverServer("wfs-test");
    start_ = server_->Start();
    fake_ = new test::FakeAwsCredentials();
    if (start_) {
      start_ = fake_->Start(tokens_, {"--container-token", kContainerToken, "--web-identity-token", kWebIdentityToken,
                                      "--source-key-id", "AKIDSOURCE", "--source-secret", "source-secret"});
    }
    proxy_ = new test::S3PreconditionProxy();
    if (start_) start_ = proxy_->Start(server_->endpoint(), tokens_);
  }
  static void TearDownTestSuite() {
    delete proxy_;
    delete fake_;
    delete server_;
    delete dir_;
  }

  void SetUp() override {
    ASSERT_TRUE(start_) << start_.message();
    ASSERT_TRUE(fake_->Control("lifetime=3600&fail="));
    name_ = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    home_ = fs::path(dir_->path()) / name_;
    fs::create_directories(home_ / ".aws");
    env_ = {{"HOME", home_.string()}, {"AWS_REGION", "us-east-1"}, {"AWS_EC2_METADATA_DISABLED", "true"}};
    before_ = fake_->Stats();
  }

  void Write(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

  S3Options Options() {
    S3Options o;
    o.endpoint = proxy_->endpoint();
    o.region = "us-east-1";
    o.env = [this](std::string_view n) -> std::optional<std::string> {
      auto it = env_.find(std::string(n));
      return it == env_.end() ? std::nullopt : std::optional<std::string>(it->second);
    };
    return o;
  }
  Expected<std::unique_ptr<Store>> Open() {
    HttpOptions h;
    h.max_attempts = 2;
    h.total_timeout = seconds(20);
    return OpenS3Store("s3://wfs-test/" + name_, Options(), std::make_shared<HttpClient>(h));
  }
  // A put and a get through the proxy: only credentials the fake issued get through.
  void RoundTrip(Store& s, const std::string& key) {
    const Status put = s.Put(key, Bytes("bytes of " + key), PutMode::kOverwrite);
    ASSERT_TRUE(put.ok()) << put.ToString();
    auto got = s.Get(key);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, Bytes("bytes of " + key));
  }
  uint64_t Issued(const std::string& provider) {
    const std::string k = "issued_" + provider;
    auto now = fake_->Stats();
    return now[k] - before_[k];
  }
  std::vector<std::string> TokensUsedSince(size_t n) {
    auto all = proxy_->TokensUsed();
    return std::vector<std::string>(all.begin() + static_cast<long>(std::min(n, all.size())), all.end());
  }

  static test::TempDir* dir_;
  static std::string tokens_;
  static test::S3rverServer* server_;
  static test::FakeAwsCredentials* fake_;
  static test::S3PreconditionProxy* proxy_;
  static ::testing::AssertionResult start_;
  std::string name_;
  fs::path home_;
  std::map<std::string, std::string> env_;
  std::map<std::string, uint64_t> before_;
};
test::TempDir* AwsChainTest::dir_ = nullptr;
std::string AwsChainTest::tokens_;
test::S3rverServer* AwsChainTest::server_ = nullptr;
test::FakeAwsCredentials* AwsChainTest::fake_ = nullptr;
test::S3PreconditionProxy* AwsChainTest::proxy_ = nullptr;
::testing::AssertionResult AwsChainTest::start_ = ::testing::AssertionFailure();

TEST_F(AwsChainTest, InstanceMetadataV2SignsWithTheInstanceRole) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake_->endpoint();
  const size_t used = proxy_->TokensUsed().size();
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "imds");
  EXPECT_EQ(Issued("imds"), 1u);
  EXPECT_EQ(fake_->Stats()["rejected_imds_v1"], 0u) << "every metadata read carried an IMDSv2 session token";
  const auto tokens = TokensUsedSince(used);
  ASSERT_EQ(tokens.size(), 1u);
  EXPECT_TRUE(tokens[0].starts_with("tok-imds-")) << tokens[0];
}

// A mount runs for weeks: credentials are fetched again before they expire, and a request
// never goes out with expired ones. (Issued for 16 s, they are refreshed at half their life;
// an hour's are refreshed 5 minutes before expiry.)
TEST_F(AwsChainTest, CredentialsAreRefreshedBeforeTheyExpire) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake_->endpoint();
  ASSERT_TRUE(fake_->Control("lifetime=16"));
  const size_t used = proxy_->TokensUsed().size();
  const uint64_t expired_before = proxy_->Stats()["token_expired"];
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "a");
  RoundTrip(**store, "b");  // not refreshed yet
  EXPECT_EQ(Issued("imds"), 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(8500));
  RoundTrip(**store, "c");
  EXPECT_EQ(Issued("imds"), 2u);
  EXPECT_EQ(TokensUsedSince(used).size(), 2u);
  EXPECT_EQ(proxy_->Stats()["token_expired"], expired_before);
}

// A refresh that fails keeps the current credentials while they still hold (and tries again):
// an instance metadata hiccup costs nothing.
TEST_F(AwsChainTest, AFailedRefreshKeepsCredentialsThatStillHold) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake_->endpoint();
  ASSERT_TRUE(fake_->Control("lifetime=16"));
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "a");
  ASSERT_TRUE(fake_->Control("fail=imds:500"));
  std::this_thread::sleep_for(std::chrono::milliseconds(8500));
  RoundTrip(**store, "b");
  EXPECT_GE(fake_->Stats()["failed_imds"], 1u);
  EXPECT_EQ(Issued("imds"), 1u);
}

// The server says the token expired (a clock off, a revoked session): new credentials are
// fetched and the request is sent again, once.
TEST_F(AwsChainTest, AnExpiredTokenAnswerFetchesNewCredentialsAndRetries) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake_->endpoint();
  const uint64_t expired_before = proxy_->Stats()["token_expired"];
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "a");
  ASSERT_TRUE(fake_->Control("expire_all=1"));
  RoundTrip(**store, "b");
  EXPECT_EQ(proxy_->Stats()["token_expired"], expired_before + 1);
  EXPECT_EQ(Issued("imds"), 2u);
}

TEST_F(AwsChainTest, ContainerEndpointWithAnAuthorizationTokenFile) {
  Write(home_ / "ecs-token", std::string(kContainerToken) + "\n");
  env_["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = fake_->endpoint() + "/ecs/v2/credentials";
  env_["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] = (home_ / "ecs-token").string();
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "ecs");
  EXPECT_EQ(Issued("container"), 1u);
  // A wrong token: the open says which endpoint refused, and never shows the token.
  Write(home_ / "ecs-token", "not-the-token");
  auto refused = Open();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("container credentials endpoint"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("HTTP 401"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(refused.status().message().find("not-the-token"), std::string::npos);
  // Only https, or http to loopback or the ECS/EKS addresses.
  env_["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = "http://evil.example.com/creds";
  auto bad_url = Open();
  ASSERT_FALSE(bad_url.ok());
  EXPECT_NE(bad_url.status().message().find("AWS_CONTAINER_CREDENTIALS_FULL_URI must be https"), std::string::npos);
}

TEST_F(AwsChainTest, WebIdentityTokenFileOfEksIrsa) {
  Write(home_ / "token", kWebIdentityToken);
  env_["AWS_WEB_IDENTITY_TOKEN_FILE"] = (home_ / "token").string();
  env_["AWS_ROLE_ARN"] = "arn:aws:iam::123456789012:role/trainer";
  env_["AWS_ENDPOINT_URL_STS"] = fake_->endpoint();
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "irsa");
  EXPECT_EQ(Issued("sts_web"), 1u);
  Write(home_ / "token", "a-token-sts-refuses");
  auto refused = Open();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("InvalidIdentityToken"), std::string::npos) << refused.status().ToString();
  env_.erase("AWS_ROLE_ARN");
  auto half = Open();
  ASSERT_FALSE(half.ok());
  EXPECT_NE(half.status().message().find("AWS_ROLE_ARN"), std::string::npos);
}

// role_arn + source_profile: STS AssumeRole signed with the source profile's keys (the fake
// checks that signature), then S3 signed with the role's session.
TEST_F(AwsChainTest, AssumeRoleProfileSignsStsWithItsSourceProfile) {
  Write(home_ / ".aws" / "config",
        "[profile trainer]\nrole_arn = arn:aws:iam::123456789012:role/trainer\nsource_profile = base\n"
        "role_session_name = node-7\n");
  Write(home_ / ".aws" / "credentials", "[base]\naws_access_key_id = AKIDSOURCE\naws_secret_access_key = source-secret\n");
  env_["AWS_PROFILE"] = "trainer";
  env_["AWS_ENDPOINT_URL_STS"] = fake_->endpoint();
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "assumed");
  EXPECT_EQ(Issued("sts_assume"), 1u);
  Write(home_ / ".aws" / "credentials", "[base]\naws_access_key_id = AKIDSOURCE\naws_secret_access_key = wrong\n");
  auto refused = Open();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("SignatureDoesNotMatch"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(refused.status().message().find("wrong"), std::string::npos);
}

TEST_F(AwsChainTest, CredentialProcessOfTheProfile) {
  const std::string fetch = "python3 -c \"import urllib.request; print(urllib.request.urlopen('" + fake_->endpoint() +
                            "/process').read().decode())\"";
  Write(home_ / ".aws" / "config", "[default]\ncredential_process = " + fetch + "\n");
  auto store = Open();
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  RoundTrip(**store, "process");
  EXPECT_EQ(Issued("process"), 1u);
  Write(home_ / ".aws" / "config", "[default]\ncredential_process = sh -c 'echo token expired, run sso login >&2; exit 3'\n");
  auto failed = Open();
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("exit 3"), std::string::npos) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("run sso login"), std::string::npos) << failed.status().ToString();
}

// The chain's order: keys in the environment win, and nothing further is asked.
TEST_F(AwsChainTest, EnvironmentKeysComeFirstAndNothingElseIsAsked) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = fake_->endpoint();
  env_["AWS_ACCESS_KEY_ID"] = "AKIDENV";
  env_["AWS_SECRET_ACCESS_KEY"] = "env-secret";
  auto src = ResolveAwsCredentialChain({.env = Options().env, .region = "us-east-1"});
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  ASSERT_TRUE(src->source);
  EXPECT_EQ(src->source->Get()->access_key_id, "AKIDENV");
  EXPECT_EQ(fake_->Stats()["requests"], before_["requests"] + 1) << "only this test's own /stats read";
}

TEST_F(AwsChainTest, SsoProfilesSayWhatToRunInstead) {
  Write(home_ / ".aws" / "config", "[profile dev]\nsso_session = corp\nsso_account_id = 1\nsso_role_name = r\n");
  env_["AWS_PROFILE"] = "dev";
  auto refused = Open();
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("aws configure export-credentials --profile dev --format process"),
            std::string::npos)
      << refused.status().ToString();
}

// Outside EC2 (nothing answers at the metadata address) the chain ends in about a second, and
// the open fails saying where it looked and what to pass for anonymous access.
TEST_F(AwsChainTest, NothingFoundIsAnErrorWithinSecondsNotAnonymousAccess) {
  env_.erase("AWS_EC2_METADATA_DISABLED");
  env_["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = "http://127.0.0.1:" + std::to_string(test::FreeLoopbackPort());
  const auto start = std::chrono::steady_clock::now();
  auto refused = Open();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().kind(), ErrorKind::kAuth);
  EXPECT_LT(secs, 5.0);
  for (const std::string& said : std::vector<std::string>{"no AWS credentials found", "no answer from EC2 instance metadata",
                                 "--no-sign-request", (home_ / ".aws" / "credentials").string()}) {
    EXPECT_NE(refused.status().message().find(said), std::string::npos) << said << " in " << refused.status().ToString();
  }
}

}  // namespace
}  // namespace weightfs
