#include "hub/store/aws_credentials.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

namespace weightfs {
namespace {

namespace fs = std::filesystem;

class AwsCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("wfs-aws-creds-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "home" / ".aws");
    env_["HOME"] = (dir_ / "home").string();
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const fs::path& p, const std::string& text) {
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
  }
  fs::path HomeFile(const std::string& name) { return dir_ / "home" / ".aws" / name; }
  AwsEnvLookup Env() {
    return [this](std::string_view name) -> std::optional<std::string> {
      auto it = env_.find(std::string(name));
      if (it == env_.end()) return std::nullopt;
      return it->second;
    };
  }

  fs::path dir_;
  std::map<std::string, std::string> env_;
};

TEST_F(AwsCredentialsTest, IniParsingToleratesSpacesCommentsAndNestedBlocks) {
  const auto sections = ParseAwsIni(
      "# leading comment\r\n"
      "stray = ignored\n"
      "[ default ]\r\n"
      "  aws_access_key_id   =  AKIDDEFAULT   \r\n"
      "AWS_Secret_Access_Key=secret/with+chars= # inline comment\n"
      "; another comment\n"
      "\n"
      "[profile  dev]\n"
      "region = eu-west-1 ; comment\n"
      "s3 =\n"
      "  addressing_style = path\n"
      "  region = nested-must-not-win\n"
      "output=json\n"
      "[broken\n"
      "key_without_equals\n");
  ASSERT_EQ(sections.size(), 2u);
  EXPECT_EQ(sections[0].name, "default");
  ASSERT_NE(sections[0].Find("aws_access_key_id"), nullptr);
  EXPECT_EQ(*sections[0].Find("aws_access_key_id"), "AKIDDEFAULT");
  ASSERT_NE(sections[0].Find("aws_secret_access_key"), nullptr);
  EXPECT_EQ(*sections[0].Find("aws_secret_access_key"), "secret/with+chars=");
  EXPECT_EQ(sections[1].name, "profile  dev");
  ASSERT_NE(sections[1].Find("region"), nullptr);
  EXPECT_EQ(*sections[1].Find("region"), "eu-west-1");
  ASSERT_NE(sections[1].Find("output"), nullptr);
  EXPECT_EQ(*sections[1].Find("output"), "json");
  EXPECT_EQ(sections[1].Find("addressing_style"), nullptr);
}

TEST_F(AwsCredentialsTest, NothingConfiguredMeansAnonymousInUsEast1) {
  auto s = LoadAwsSettings(Env());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_FALSE(s->credentials.has_value());
  EXPECT_EQ(s->region, "us-east-1");
  EXPECT_EQ(s->profile, "default");
}

TEST_F(AwsCredentialsTest, EnvironmentWinsOverFiles) {
  Write(HomeFile("credentials"), "[default]\naws_access_key_id=FILEID\naws_secret_access_key=FILESECRET\n");
  env_["AWS_ACCESS_KEY_ID"] = "ENVID";
  env_["AWS_SECRET_ACCESS_KEY"] = "ENVSECRET";
  env_["AWS_SESSION_TOKEN"] = "ENVTOKEN";
  auto s = LoadAwsSettings(Env());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->credentials.has_value());
  EXPECT_EQ(s->credentials->access_key_id, "ENVID");
  EXPECT_EQ(s->credentials->secret_access_key, "ENVSECRET");
  EXPECT_EQ(s->credentials->session_token, "ENVTOKEN");
  EXPECT_NE(s->credentials->source.find("environment"), std::string::npos);
}

TEST_F(AwsCredentialsTest, HalfSetEnvironmentIsAnErrorWithoutTheValue) {
  env_["AWS_ACCESS_KEY_ID"] = "ENVID-VISIBLE?";
  auto s = LoadAwsSettings(Env());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(s.status().message().find("AWS_SECRET_ACCESS_KEY"), std::string::npos);
  EXPECT_EQ(s.status().message().find("ENVID-VISIBLE"), std::string::npos);
}

TEST_F(AwsCredentialsTest, SharedCredentialsFileProfileFromEnvironment) {
  const fs::path file = dir_ / "elsewhere" / "creds.ini";
  Write(file,
        "[default]\naws_access_key_id = DEFID\naws_secret_access_key = DEFSECRET\n\n"
        "[ci]\naws_access_key_id = CIID\naws_secret_access_key = CISECRET\n"
        "aws_session_token = CITOKEN\n");
  env_["AWS_SHARED_CREDENTIALS_FILE"] = file.string();
  env_["AWS_PROFILE"] = "ci";
  auto s = LoadAwsSettings(Env());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->credentials.has_value());
  EXPECT_EQ(s->credentials->access_key_id, "CIID");
  EXPECT_EQ(s->credentials->secret_access_key, "CISECRET");
  EXPECT_EQ(s->credentials->session_token, "CITOKEN");
  EXPECT_NE(s->credentials->source.find("profile 'ci'"), std::string::npos);
  EXPECT_NE(s->credentials->source.find(file.string()), std::string::npos);
  EXPECT_EQ(s->profile, "ci");
}

TEST_F(AwsCredentialsTest, RegionFromConfigProfileUnlessEnvironmentSaysOtherwise) {
  Write(HomeFile("credentials"), "[dev]\naws_access_key_id=DEVID\naws_secret_access_key=DEVSECRET\n");
  Write(HomeFile("config"),
        "[default]\nregion = us-west-2\n[dev]\nregion = wrong-section-form\n"
        "[profile dev]\nregion = eu-central-1\n");
  env_["AWS_PROFILE"] = "dev";
  auto s = LoadAwsSettings(Env());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->region, "eu-central-1");
  EXPECT_EQ(s->credentials->access_key_id, "DEVID");

  env_["AWS_DEFAULT_REGION"] = "ap-south-1";
  EXPECT_EQ(LoadAwsSettings(Env())->region, "ap-south-1");
  env_["AWS_REGION"] = "sa-east-1";
  EXPECT_EQ(LoadAwsSettings(Env())->region, "sa-east-1");

  env_.erase("AWS_PROFILE");
  env_.erase("AWS_REGION");
  env_.erase("AWS_DEFAULT_REGION");
  auto d = LoadAwsSettings(Env());
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->region, "us-west-2");
  EXPECT_FALSE(d->credentials.has_value());  // [dev] has keys, [default] has none
}

TEST_F(AwsCredentialsTest, CredentialsInTheConfigFileAreUsedWhenTheCredentialsFileHasNone) {
  Write(HomeFile("config"),
        "[profile build]\naws_access_key_id=CFGID\naws_secret_access_key=CFGSECRET\nregion=eu-north-1\n");
  env_["AWS_PROFILE"] = "build";
  auto s = LoadAwsSettings(Env());
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->credentials.has_value());
  EXPECT_EQ(s->credentials->access_key_id, "CFGID");
  EXPECT_EQ(s->region, "eu-north-1");
}

TEST_F(AwsCredentialsTest, NamedProfileThatDoesNotExistIsAnError) {
  Write(HomeFile("credentials"), "[default]\naws_access_key_id=A\naws_secret_access_key=B\n");
  env_["AWS_PROFILE"] = "nope";
  auto s = LoadAwsSettings(Env());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(s.status().message().find("nope"), std::string::npos);
  EXPECT_NE(s.status().message().find(HomeFile("credentials").string()), std::string::npos);
}

TEST_F(AwsCredentialsTest, ProfileWithKeyIdButNoSecretIsAnErrorWithoutTheKeyId) {
  Write(HomeFile("credentials"), "[default]\naws_access_key_id=AKIDSHOULDNOTSHOW\n");
  auto s = LoadAwsSettings(Env());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(s.status().message().find("aws_secret_access_key"), std::string::npos);
  EXPECT_EQ(s.status().message().find("AKIDSHOULDNOTSHOW"), std::string::npos);
}

TEST_F(AwsCredentialsTest, TokenWithControlCharactersIsRejected) {
  env_["AWS_ACCESS_KEY_ID"] = "ID";
  env_["AWS_SECRET_ACCESS_KEY"] = "SECRET";
  env_["AWS_SESSION_TOKEN"] = "abc\r\nX-Injected: 1";
  auto s = LoadAwsSettings(Env());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message().find("Injected"), std::string::npos);
}

TEST_F(AwsCredentialsTest, ProcessEnvironmentIsReadThroughGetenv) {
  const fs::path file = dir_ / "process-creds";
  Write(file, "[default]\naws_access_key_id = PROCID\naws_secret_access_key = PROCSECRET\n");
  // Save and clear what the machine may have set, then restore it.
  const char* names[] = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                         "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
    ::unsetenv(n);
  }
  ::setenv("AWS_SHARED_CREDENTIALS_FILE", file.c_str(), 1);
  auto s = LoadAwsSettings();
  for (const auto& [n, v] : saved) {
    if (v) ::setenv(n.c_str(), v->c_str(), 1);
    else ::unsetenv(n.c_str());
  }
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_TRUE(s->credentials.has_value());
  EXPECT_EQ(s->credentials->access_key_id, "PROCID");
}

}  // namespace
}  // namespace weightfs
