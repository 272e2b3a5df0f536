// The Hugging Face side: HfConfig from the environment, hf:// URL parsing (hostile ones too),
// HfBucketStore against the store contract (tests/testing/fake_hub.py for the Hub endpoints, s3rver
// behind the S3 gateway path, s3_precondition_proxy.py for atomic create-if-absent), and HfRepo /
// HfSources / OpenHfRepoVersions against fake model repos: revision resolution, tree pagination,
// ranged reads measured at the server, the local HF cache, offline mode, the token never sent to
// the CDN listener nor shown in errors, 401/403/404 messages, 429 retries.
#include "hub/hf/hf_repo.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/hash.h"
#include "core/manifest.h"
#include "hub/engine/bucket.h"
#include "hub/hf/hf_bucket_store.h"
#include "hub/hf/hf_api.h"
#include "tests/testing/log_capture.h"
#include "tests/testing/s3_test_server.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/test_servers.h"
#include "tests/testing/bytes.h"

namespace weightfs {
namespace {

using test::RandomBytes;

namespace fs = std::filesystem;

constexpr const char* kToken = "hf_TestSecretToken0123456789";

HfEnvLookup MapEnv(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

void WriteFile(const std::string& path, const std::vector<uint8_t>& data) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

std::vector<uint8_t> Slice(const std::vector<uint8_t>& v, uint64_t off, uint64_t n) {
  return {v.begin() + static_cast<ptrdiff_t>(off), v.begin() + static_cast<ptrdiff_t>(off + n)};
}

HttpOptions FastRetries() {
  HttpOptions o;
  o.max_attempts = 6;
  o.backoff_base = std::chrono::milliseconds(5);
  o.backoff_max = std::chrono::milliseconds(200);
  o.total_timeout = std::chrono::milliseconds(30'000);
  o.stall_timeout = std::chrono::milliseconds(10'000);
  return o;
}

// ---- configuration ------------------------------------------------------------------------------

TEST(HfConfigTest, DefaultsFollowHuggingFaceConventions) {
  auto c = LoadHfConfig(MapEnv({{"HOME", "/home/u"}}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->endpoint, "https://huggingface.co");
  EXPECT_EQ(c->home, "/home/u/.cache/huggingface");
  EXPECT_EQ(c->hub_cache, "/home/u/.cache/huggingface/hub");
  EXPECT_TRUE(c->token.empty());
  EXPECT_FALSE(c->offline);

  c = LoadHfConfig(MapEnv({{"HOME", "/home/u"}, {"XDG_CACHE_HOME", "/xdg"}, {"HF_ENDPOINT", "http://hub.local:8080/"},
                           {"HF_HUB_OFFLINE", "yes"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->endpoint, "http://hub.local:8080");
  EXPECT_EQ(c->home, "/xdg/huggingface");
  EXPECT_EQ(c->hub_cache, "/xdg/huggingface/hub");
  EXPECT_TRUE(c->offline);

  c = LoadHfConfig(MapEnv({{"HF_HOME", "/hf"}, {"HF_HUB_CACHE", "/cache"}, {"TRANSFORMERS_OFFLINE", "1"}}));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->home, "/hf");
  EXPECT_EQ(c->hub_cache, "/cache");
  EXPECT_TRUE(c->offline);
  EXPECT_EQ(LoadHfConfig(MapEnv({{"HF_HOME", "/hf"}, {"HUGGINGFACE_HUB_CACHE", "/legacy"}}))->hub_cache, "/legacy");
  EXPECT_FALSE(LoadHfConfig(MapEnv({{"HF_HUB_OFFLINE", "0"}}))->offline);
}

TEST(HfConfigTest, TokenPrecedenceEnvThenLegacyEnvThenTokenFile) {
  test::TempDir dir("hfcfg");
  WriteFile(dir.Join("home/token"), {'h', 'f', '_', 'f', 'i', 'l', 'e', '\n'});
  WriteFile(dir.Join("other-token"), {' ', 'h', 'f', '_', 'p', 'a', 't', 'h', '\r', '\n'});
  const std::string home = dir.Join("home");

  auto c = LoadHfConfig(MapEnv({{"HF_HOME", home}, {"HF_TOKEN", "hf_env"}, {"HUGGING_FACE_HUB_TOKEN", "hf_legacy"}}));
  EXPECT_EQ(c->token, "hf_env");
  EXPECT_EQ(c->token_source, "HF_TOKEN");
  c = LoadHfConfig(MapEnv({{"HF_HOME", home}, {"HUGGING_FACE_HUB_TOKEN", "hf_legacy"}}));
  EXPECT_EQ(c->token, "hf_legacy");
  c = LoadHfConfig(MapEnv({{"HF_HOME", home}}));
  EXPECT_EQ(c->token, "hf_file");
  EXPECT_NE(c->token_source.find("token file"), std::string::npos);
  c = LoadHfConfig(MapEnv({{"HF_HOME", home}, {"HF_TOKEN_PATH", dir.Join("other-token")}}));
  EXPECT_EQ(c->token, "hf_path");
  c = LoadHfConfig(MapEnv({{"HF_HOME", home}, {"HF_HUB_DISABLE_IMPLICIT_TOKEN", "1"}}));
  EXPECT_TRUE(c->token.empty());
  c = LoadHfConfig(MapEnv({{"HF_HOME", dir.Join("nowhere")}}));
  EXPECT_TRUE(c->token.empty());
  // An empty HF_TOKEN does not hide the file.
  c = LoadHfConfig(MapEnv({{"HF_HOME", home}, {"HF_TOKEN", ""}}));
  EXPECT_EQ(c->token, "hf_file");
}

TEST(HfConfigTest, RefusesBadEndpointsAndTokensWithoutEchoingSecrets) {
  for (const char* bad : {"ftp://x", "huggingface.co", "https://user:pw@hub", "https://hub/?q=1", "https://"}) {
    auto c = LoadHfConfig(MapEnv({{"HF_ENDPOINT", bad}}));
    EXPECT_EQ(c.status().kind(), ErrorKind::kInvalidArgument) << bad;
    EXPECT_EQ(c.status().message().find("pw@"), std::string::npos);
  }
  auto c = LoadHfConfig(MapEnv({{"HF_TOKEN", "hf_abc\ndef"}}));
  EXPECT_EQ(c.status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(c.status().message().find("hf_abc"), std::string::npos);
}

// huggingface_hub sends no implicit token at all under HF_HUB_DISABLE_IMPLICIT_TOKEN: not the
// file, and not HF_TOKEN either (only a token passed in code, which weightfs has none of).
TEST(HfConfigTest, DisablingImplicitTokensSendsNoTokenAtAll) {
  test::TempDir dir("hfcfg");
  WriteFile(dir.Join("home/token"), {'h', 'f', '_', 'f'});
  auto c = LoadHfConfig(MapEnv({{"HF_HOME", dir.Join("home")}, {"HF_TOKEN", "hf_env"},
                                {"HF_HUB_DISABLE_IMPLICIT_TOKEN", "true"}}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->token.empty());
  EXPECT_TRUE(c->token_file.empty());
  HfApi api(*c, nullptr);
  EXPECT_TRUE(api.Token().empty());
  // Without it, a token from the environment is fixed; one from the file is followed.
  c = LoadHfConfig(MapEnv({{"HF_HOME", dir.Join("home")}, {"HF_TOKEN", "hf_env"}}));
  EXPECT_EQ(c->token, "hf_env");
  EXPECT_TRUE(c->token_file.empty());
  c = LoadHfConfig(MapEnv({{"HF_HOME", dir.Join("home")}}));
  EXPECT_EQ(c->token, "hf_f");
  EXPECT_EQ(c->token_file, dir.Join("home/token"));
}

// As huggingface_hub's constants: expanduser(expandvars(...)) of HF_HOME, HF_HUB_CACHE,
// HF_TOKEN_PATH (and XDG_CACHE_HOME under HF_HOME's default).
TEST(HfConfigTest, PathsExpandTildeAndEnvironmentVariables) {
  test::TempDir dir("hfcfg");
  WriteFile(dir.Join("u/tokens/t"), {'h', 'f', '_', 't'});
  auto c = LoadHfConfig(MapEnv({{"HOME", dir.Join("u")}, {"SCRATCH", "/scratch"}, {"HF_HOME", "~/hf"},
                                {"HF_HUB_CACHE", "${SCRATCH}/hub-$USERX/$SCRATCH"},
                                {"HF_TOKEN_PATH", "~/tokens/t"}}));
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->home, dir.Join("u/hf"));
  EXPECT_EQ(c->hub_cache, "/scratch/hub-$USERX//scratch");  // unknown variables stay as written
  EXPECT_EQ(c->token, "hf_t");
  c = LoadHfConfig(MapEnv({{"HOME", "/home/u/"}, {"XDG_CACHE_HOME", "~/xdg"}}));
  EXPECT_EQ(c->home, "/home/u/xdg/huggingface");
  EXPECT_EQ(c->hub_cache, "/home/u/xdg/huggingface/hub");
  c = LoadHfConfig(MapEnv({{"HOME", "/home/u"}, {"HF_HOME", "~root/hf"}}));
  EXPECT_EQ(c->home, "/root/hf");
  EXPECT_EQ(hf::ExpandUserAndVars("a$/b${}c${X", MapEnv({})), "a$/b${}c${X");
  EXPECT_EQ(hf::ExpandUserAndVars("$A$B_1x", MapEnv({{"A", "1"}, {"B_1x", "2"}})), "12");
}

TEST(HfUrlTest, SignedUrlExpiryTakesTheEarliestOfS3AndCloudFront) {
  using std::chrono::system_clock;
  auto at = [](int64_t s) { return system_clock::time_point(std::chrono::seconds(s)); };
  // 2024-05-01T12:00:00Z = 1714564800.
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x?X-Amz-Date=20240501T120000Z&X-Amz-Expires=3600&X-Amz-Signature=s"),
            at(1714564800 + 3600));
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x?Expires=1714564900&Signature=s&X-Amz-Date=20240501T120000Z&"
                                "X-Amz-Expires=3600"),
            at(1714564900));
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x?Signature=s"), std::nullopt);
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x"), std::nullopt);
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x?X-Amz-Expires=3600"), std::nullopt);  // no date
  EXPECT_EQ(hf::SignedUrlExpiry("https://cdn/x?Expires=99999999999999999999"), std::nullopt);
  EXPECT_EQ(ParseRateLimitWindow("\"fixed window\";\"resolvers\";q=3000;w=300"), std::optional<uint64_t>(300));
  EXPECT_EQ(ParseRateLimitWindow("\"fixed window\";\"api\";q=500"), std::nullopt);
}

// ---- parsing ------------------------------------------------------------------------------------

TEST(HfUrlTest, ParsesRepoUrls) {
  auto r = ParseHfRepoUrl("hf://Qwen/Qwen3-8B");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->repo, "Qwen/Qwen3-8B");
  EXPECT_EQ(r->revision, "main");
  r = ParseHfRepoUrl("hf://org/m_1.5@v1.0");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->revision, "v1.0");
  r = ParseHfRepoUrl("hf://org/m@refs/pr/12");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->revision, "refs/pr/12");
  r = ParseHfRepoUrl("hf://gpt2@0123456789abcdef0123456789abcdef01234567");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->repo, "gpt2");
  for (const std::string& bad : std::vector<std::string>{
           "hf://", "hf://buckets/ns/b", "s3://org/m", "hf://org/m@", "hf://org/m@../x", "hf://org/../m",
        "hf://a/b/c", "hf://org/m@a//b", "hf://org/m@/abs", "hf://org/m?x=1", "hf://org/m#f", "hf://-org/m",
        "hf://org/m--x", "hf://org/m@x y", "hf://org/m@main\n", std::string("hf://org/m\0x", 11), "hf://org/m@%2e%2e",
        "hf://org/" + std::string(200, 'a')}) {
    EXPECT_FALSE(ParseHfRepoUrl(bad).ok()) << bad;
  }
}

TEST(HfUrlTest, ParsesBucketUrls) {
  auto b = ParseHfBucketUrl("hf://buckets/acme/runs");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->ns, "acme");
  EXPECT_EQ(b->name, "runs");
  EXPECT_EQ(b->prefix, "");
  b = ParseHfBucketUrl("hf://buckets/acme/runs/exp-1/weights/");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->prefix, "exp-1/weights");
  for (const char* bad : {"hf://buckets/", "hf://buckets/acme", "hf://buckets/acme/", "hf://buckets/a/b/../c",
                          "hf://buckets/a/b//c", "hf://buckets/a/b?x", "hf://buckets/a b/c", "hf://buckets/../b",
                          "hf://acme/runs", "hf://buckets/a/.hidden"}) {
    EXPECT_FALSE(ParseHfBucketUrl(bad).ok()) << bad;
  }
}

TEST(HfUrlTest, SourceStringsAreCheckedStrictly) {
  const std::string commit(40, 'a');
  auto p = HfSources::ParseSource("hf://org/m@" + commit + "/dir/model.safetensors");
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->repo, "org/m");
  EXPECT_EQ(p->commit, commit);
  EXPECT_EQ(p->path, "dir/model.safetensors");
  for (const std::string& bad : std::vector<std::string>{"hf://org/m@main/x", "hf://org/m@" + commit, "hf://org/m@" + commit + "/",
                                "hf://org/m@" + commit + "/../etc/passwd", "hf://org/m@" + commit + "//x",
                                "hf://org/m@" + std::string(40, 'A') + "/x", "hf://../m@" + commit + "/x",
                                "http://org/m@" + commit + "/x", "hf://org/m@" + commit + "/a\\b"}) {
    EXPECT_FALSE(HfSources::ParseSource(bad).ok()) << bad;
  }
  // Hostile sources are refused before any request: there is no server here at all.
  HfConfig config;
  config.endpoint = "http://127.0.0.1:1";
  HfSources sources(config, nullptr);
  EXPECT_EQ(sources.Read("hf://org/m@" + commit + "/../x", 0, 1).status().kind(), ErrorKind::kInvalidArgument);
  EXPECT_EQ(sources.Read("hf://org/m@" + commit + "/x", 0, kMaxChunkBytes + 1).status().kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(sources.requests(), 0u);
}

TEST(HfUrlTest, LinkOriginAndRedirectHelpers) {
  EXPECT_EQ(hf::ParseLinkNext("<https://hf.co/api/x?cursor=2>; rel=\"next\""), "https://hf.co/api/x?cursor=2");
  EXPECT_EQ(hf::ParseLinkNext("<https://a/1>; rel=\"prev\", <https://a/3>; rel=\"next\""), "https://a/3");
  EXPECT_EQ(hf::ParseLinkNext("<https://a/1>; rel=\"last\""), "");
  EXPECT_EQ(hf::ParseLinkNext(""), "");
  EXPECT_EQ(ParseRateLimitReset("\"api\";r=0;t=55"), std::optional<uint64_t>(55));
  EXPECT_EQ(ParseRateLimitReset("\"resolvers\"; r=10; t=3"), std::optional<uint64_t>(3));
  EXPECT_EQ(ParseRateLimitReset("\"api\";r=0"), std::nullopt);
  EXPECT_EQ(hf::UrlOrigin("https://HuggingFace.co/x"), "https://huggingface.co:443");
  EXPECT_EQ(hf::UrlOrigin("http://h:80/x"), "http://h:80");
  EXPECT_EQ(hf::UrlOrigin("https://user@h/x"), "");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b?q", "/c"), "https://h/c");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b", "c"), "https://h/a/c");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b", "//cdn/x"), "https://cdn/x");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b", "http://cdn/x"), "http://cdn/x");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b", "file:///etc/passwd"), "");
  HfConfig c;
  c.endpoint = "https://huggingface.co";
  HfApi api(c, nullptr);
  EXPECT_TRUE(api.IsHubOrigin("https://huggingface.co:443/api"));
  EXPECT_FALSE(api.IsHubOrigin("http://huggingface.co/api"));
  EXPECT_FALSE(api.IsHubOrigin("https://huggingface.co.evil.com/api"));
  EXPECT_FALSE(api.IsHubOrigin("https://cdn-lfs.huggingface.co/x"));
  EXPECT_FALSE(api.IsHubOrigin("https://huggingface.co:8443/x"));
}

// Found by tests/fuzz/hf_json_fuzz: a relative Location resolved against a base that is not
// http(s) came back as a URL of that scheme ("hdtp://cdn/x"), and a base whose authority ended
// in a query ("https://h?q") kept the query in front of the path.
TEST(HfUrlTest, ResolveUrlGivesOnlyHttpUrlsAndEndsTheAuthorityAtAQuery) {
  EXPECT_EQ(hf::ResolveUrl("hdtp://[::10:808]/a", "//cdn.e"), "");
  EXPECT_EQ(hf::ResolveUrl("file:///etc/passwd", "/x"), "");
  EXPECT_EQ(hf::ResolveUrl("ftp://h/a/b", "c"), "");
  EXPECT_EQ(hf::ResolveUrl("HTTPS://h/a/b", "//cdn/x"), "HTTPS://cdn/x");
  EXPECT_EQ(hf::ResolveUrl("https://h?q=/z", "/c"), "https://h/c");
  EXPECT_EQ(hf::ResolveUrl("https://h#f", "c"), "https://h/c");
  EXPECT_EQ(hf::ResolveUrl("https://h/a/b?q=/z", "c"), "https://h/a/c");
}

TEST(HfJsonTest, BucketTreePagesKeepFilesUnderThePrefixWithValidKeysAndSizes) {
  const auto page = nlohmann::json::parse(R"([
    {"type": "file", "path": "p/anchors/step_000001.safetensors", "size": 10},
    {"type": "directory", "path": "p/anchors"},
    {"type": "file", "path": "p/deltas/step_000002.safetensors", "size": 3},
    {"type": "file", "path": "p/anchors/../x", "size": 1},
    {"type": "file", "path": "q/anchors/other", "size": 1}
  ])");
  std::vector<ObjectInfo> out;
  size_t skipped = 0;
  ASSERT_TRUE(AppendHfBucketTreePage(page, "p/anchors/", "p/", &out, &skipped).ok());
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].key, "anchors/step_000001.safetensors");
  EXPECT_EQ(out[0].size, 10u);
  EXPECT_EQ(skipped, 1u);  // "anchors/../x"
  for (const char* bad : {R"({"type": "file"})", R"([1])", R"([{"type": "file", "path": 3}])",
                          R"([{"type": "file", "path": "a"}])", R"([{"type": "file", "path": "a", "size": -1}])",
                          R"([{"type": "file", "path": "a", "size": 1.5}])"}) {
    out.clear();
    EXPECT_EQ(AppendHfBucketTreePage(nlohmann::json::parse(bad), "", "", &out, &skipped).kind(),
              ErrorKind::kCorruption)
        << bad;
  }
}

TEST(HfJsonTest, RepoTreePagesTakeLfsSizesAndOidsAndSkipUnsafePaths) {
  const std::string oid(64, 'a');
  const auto page = nlohmann::json::parse(R"([
    {"type": "file", "path": "config.json", "size": 10, "oid": "abc"},
    {"type": "file", "path": "model.safetensors", "size": 134, "lfs": {"oid": ")" + oid + R"(", "size": 1000}},
    {"type": "file", "path": "w.bin", "lfs": {"oid": "NOTHEX", "size": 5}},
    {"type": "directory", "path": "sub"},
    {"type": "file", "path": "../evil", "size": 1}
  ])");
  std::vector<HfRepoFile> out;
  ASSERT_TRUE(AppendHfRepoTreePage(page, "hf://org/x@main", &out).ok());
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].path, "config.json");
  EXPECT_EQ(out[0].size, 10u);
  EXPECT_EQ(out[0].sha256, "");
  EXPECT_EQ(out[1].size, 1000u);
  EXPECT_EQ(out[1].sha256, oid);
  EXPECT_EQ(out[2].size, 5u);
  EXPECT_EQ(out[2].sha256, "");
  for (const char* bad : {R"({})", R"(["x"])", R"([{"path": "a", "size": 1}])", R"([{"type": "file", "path": "a"}])"}) {
    EXPECT_EQ(AppendHfRepoTreePage(nlohmann::json::parse(bad), "hf://org/x@main", &out).kind(),
              ErrorKind::kCorruption)
        << bad;
  }
}

TEST(HfJsonTest, RevisionAnswersNeedA40HexSha) {
  const std::string sha = "0123456789abcdef0123456789abcdef01234567";
  auto info = ParseHfRevisionInfo(nlohmann::json::parse(R"({"sha": ")" + sha +
                                                        R"(", "lastModified": "2024-05-01T12:00:00.000Z"})"),
                                  "hf://org/x@main");
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_EQ(info->commit, sha);
  EXPECT_GT(info->time_ms, 0);
  for (const char* bad : {R"([])", R"("x")", R"({"sha": 1})", R"({"sha": "ABC"})", R"({})"}) {
    auto r = ParseHfRevisionInfo(nlohmann::json::parse(bad), "hf://org/x@main");
    EXPECT_EQ(r.status().kind(), ErrorKind::kCorruption) << bad;
    EXPECT_NE(r.status().message().find("hf://org/x@main"), std::string::npos);
  }
}

// A hostile tree listing once made OpenHfRepoVersions plan 2^41 chunks for one claimed
// 2^63-byte file (out of memory), and passed duplicate paths and file/directory clashes on to the
// filesystem.
TEST(HfJsonTest, RepoManifestsRefuseClaimedSizesAndTreesNoFilesystemCanShow) {
  const std::string commit = "0123456789abcdef0123456789abcdef01234567";
  auto build = [&](std::vector<HfRepoFile> files) { return BuildHfRepoManifest("org/x", "main", commit, 1, files); };
  auto ok = build({{"b/w.safetensors", 9ull << 20, ""}, {"a.json", 3, ""}});
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  ASSERT_EQ((*ok)->files.size(), 2u);
  EXPECT_EQ((*ok)->files[0].path, "a.json");
  EXPECT_EQ((*ok)->files[1].chunks.size(), 3u);  // 4 + 4 + 1 MiB
  EXPECT_EQ((*ok)->version, "main");

  auto huge = build({{"w.bin", uint64_t{1} << 63, ""}});
  EXPECT_EQ(huge.status().kind(), ErrorKind::kCorruption);
  EXPECT_NE(huge.status().message().find("'w.bin'"), std::string::npos) << huge.status().message();
  std::vector<HfRepoFile> many;
  for (int i = 0; i < 5; ++i) many.push_back({"w" + std::to_string(i) + ".bin", kMaxHfRepoFileBytes, ""});
  EXPECT_EQ(build(many).status().kind(), ErrorKind::kResourceExhausted);
  EXPECT_EQ(build({{"a", 1, ""}, {"a", 2, ""}}).status().kind(), ErrorKind::kCorruption);
  EXPECT_EQ(build({{"a/b", 1, ""}, {"a", 2, ""}}).status().kind(), ErrorKind::kCorruption);
  EXPECT_EQ(build({{"a/b/c", 1, ""}, {"a.b", 1, ""}, {"a/b", 2, ""}}).status().kind(), ErrorKind::kCorruption);
  EXPECT_EQ(build({{"a/b", 1, ""}, {"a-c", 1, ""}, {"a", 2, ""}}).status().kind(), ErrorKind::kCorruption);
  EXPECT_TRUE(build({{"a.b", 1, ""}, {"a", 2, ""}, {"a-c/d", 1, ""}}).ok());
}

// ---- buckets: the store contract ----------------------------------------------------------------

class HfBucketStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    s3_ = new test::S3rverServer("wfs-test");  // the bucket namespace is the S3 bucket there
    start_ = s3_->Start();
    if (start_) {
      proxy_ = new test::S3PreconditionProxy();
      start_ = proxy_->Start(s3_->endpoint());
    }
    if (start_) {
      hub_ = new test::FakeHub();
      test::FakeHub::Options o;
      o.s3 = s3_->endpoint();
      o.gateway_target = proxy_->endpoint();  // the gateway fronts the atomic create-if-absent
      o.buckets = {"wfs-test/runs"};
      o.token = kToken;
      o.page_size = 3;
      start_ = hub_->Start(o);
    }
  }
  static void TearDownTestSuite() {
    delete hub_;
    delete proxy_;
    delete s3_;
    hub_ = nullptr;
    proxy_ = nullptr;
    s3_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(start_) << start_.message(); }

  std::unique_ptr<Store> Open(const std::string& url, const std::string& token = kToken,
                              const std::function<void(HfBucketOptions&)>& adjust = {}) {
    HfConfig config;
    config.endpoint = hub_->endpoint();
    config.token = token;
    config.token_source = "HF_TOKEN";
    HfBucketOptions o;
    o.s3_endpoint = hub_->gateway_url();
    o.s3.credentials = test::S3rverServer::Credentials();
    o.s3.env = MapEnv({});
    if (adjust) adjust(o);
    auto s = OpenHfBucketStore(url, config, o, std::make_shared<HttpClient>(FastRetries()));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(s).value() : nullptr;
  }

  static test::S3rverServer* s3_;
  static test::S3PreconditionProxy* proxy_;
  static test::FakeHub* hub_;
  static ::testing::AssertionResult start_;
};

test::S3rverServer* HfBucketStoreTest::s3_ = nullptr;
test::S3PreconditionProxy* HfBucketStoreTest::proxy_ = nullptr;
test::FakeHub* HfBucketStoreTest::hub_ = nullptr;
::testing::AssertionResult HfBucketStoreTest::start_ = ::testing::AssertionFailure() << "not started";

TEST_F(HfBucketStoreTest, MeetsTheStoreContract) {
  auto store = Open("hf://buckets/wfs-test/runs/exp-1");
  ASSERT_TRUE(store);
  ASSERT_TRUE(store->Put("conformance-neighbour/x", test::ConformanceBytes("keep")).ok());
  test::RunStoreConformance(*store, "conformance");
  EXPECT_EQ(*store->Get("conformance-neighbour/x"), test::ConformanceBytes("keep"));
  // Reads went through the Hub endpoints with the token, and the CDN never saw it.
  const auto stats = hub_->Stats();
  ASSERT_TRUE(stats.is_object());
  EXPECT_GT(stats["hub_authorized"].get<uint64_t>(), 0u);
  EXPECT_GT(stats["cdn_requests"].get<uint64_t>(), 0u);
  EXPECT_TRUE(stats["cdn_authorization"].empty()) << stats["cdn_authorization"].dump();
  EXPECT_EQ(store->Describe().find(kToken), std::string::npos);
}

TEST_F(HfBucketStoreTest, WritesThroughTheGatewayAreReadableThroughTheHubAndListedAcrossPages) {
  auto store = Open("hf://buckets/wfs-test/runs");
  ASSERT_TRUE(store);
  const auto big = RandomBytes(300'000, 7);
  ASSERT_TRUE(store->Put("pages/big.bin", big).ok());
  for (int i = 0; i < 7; ++i) ASSERT_TRUE(store->Put("pages/k" + std::to_string(i), std::vector<uint8_t>{uint8_t(i)}).ok());
  ASSERT_TRUE(hub_->Reset());
  auto got = store->Get("pages/big.bin", ByteRange{1000, 5000});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(big, 1000, 5000));
  // Only the range crossed the wire.
  EXPECT_EQ(hub_->BytesServed("buckets/wfs-test/runs/pages/big.bin"), 5000u);
  auto head = store->Head("pages/big.bin");
  ASSERT_TRUE(head.ok());
  EXPECT_EQ(head->size, big.size());
  const auto all = test::ConformanceListAll(*store, "pages/", 1000);
  EXPECT_EQ(all.size(), 8u);  // one List call, three server pages of 3
  auto prefixed = Open("hf://buckets/wfs-test/runs/pages");
  ASSERT_TRUE(prefixed);
  EXPECT_EQ(*prefixed->Get("k3"), std::vector<uint8_t>{3});
  for (const auto& o : all) ASSERT_TRUE(store->Delete(o.key).ok());
}

TEST_F(HfBucketStoreTest, ErrorsSayWhichOfTokenNameOrPermissionIsWrong) {
  auto anonymous = Open("hf://buckets/wfs-test/runs", "");
  ASSERT_TRUE(anonymous);
  Status s = anonymous->Get("any").status();
  EXPECT_EQ(s.kind(), ErrorKind::kAuth);
  EXPECT_NE(s.message().find("set HF_TOKEN or run `hf auth login`"), std::string::npos) << s.ToString();
  auto wrong = Open("hf://buckets/wfs-test/runs", "hf_wrong_token_value");
  s = wrong->List("").status();
  EXPECT_EQ(s.kind(), ErrorKind::kAuth);
  EXPECT_NE(s.message().find("invalid or expired"), std::string::npos) << s.ToString();
  EXPECT_EQ(s.message().find("hf_wrong_token_value"), std::string::npos);
  auto good = Open("hf://buckets/wfs-test/runs");
  s = good->Get("no/such/key").status();
  EXPECT_EQ(s.kind(), ErrorKind::kNotFound) << s.ToString();
  EXPECT_EQ(s.message().find(kToken), std::string::npos);
}

// The gateway checks If-None-Match on PutObject only, so a create-if-absent object must be one
// PUT: above the multipart threshold it still is, and above what one PUT may carry it is
// refused with nothing written. (Multipart create-if-absent would publish without the check.)
TEST_F(HfBucketStoreTest, CreateIfAbsentIsOneConditionalPutAndLargerObjectsAreRefused) {
  auto store = Open("hf://buckets/wfs-test/runs/atomic", kToken, [](HfBucketOptions& o) {
    o.s3.multipart_threshold = 5u << 20;
    o.s3.part_size = 5u << 20;
    o.s3.max_single_put = 12u << 20;
  });
  ASSERT_TRUE(store);
  const auto gateway_before = hub_->Stats()["gateway"];
  const auto eight = RandomBytes(8u << 20, 21);
  ASSERT_TRUE(store->Put("manifest", eight, PutMode::kCreateIfAbsent).ok());
  auto gateway = hub_->Stats()["gateway"];
  EXPECT_EQ(gateway["multipart_creates"].get<uint64_t>(), gateway_before["multipart_creates"].get<uint64_t>());
  EXPECT_EQ(gateway["conditional_puts"].get<uint64_t>(), gateway_before["conditional_puts"].get<uint64_t>() + 1);
  EXPECT_EQ(store->Put("manifest", RandomBytes(8u << 20, 22), PutMode::kCreateIfAbsent).kind(), ErrorKind::kConflict);
  EXPECT_EQ(*store->Get("manifest", ByteRange{0, 8u << 20}), eight);

  const Status big = store->Put("big-manifest", RandomBytes(13u << 20, 23), PutMode::kCreateIfAbsent);
  EXPECT_EQ(big.kind(), ErrorKind::kUnsupported) << big.ToString();
  EXPECT_NE(big.message().find("nothing was written"), std::string::npos) << big.ToString();
  EXPECT_EQ(store->Head("big-manifest").status().kind(), ErrorKind::kNotFound);
  // Objects that may be overwritten still go up in parts.
  ASSERT_TRUE(store->Put("pack", RandomBytes(13u << 20, 24), PutMode::kOverwrite).ok());
  EXPECT_EQ(hub_->Stats()["gateway"]["multipart_creates"].get<uint64_t>(),
            gateway_before["multipart_creates"].get<uint64_t>() + 1);
  for (const char* k : {"manifest", "pack"}) ASSERT_TRUE(store->Delete(k).ok());
}

// A create-if-absent whose answer was lost is resent, gets 412, and reads the object back to
// see whether it is ours. The gateway's ETags are not MD5s, so that takes a GET, which the
// gateway answers with a 302 to its CDN: followed, without the S3 signature.
TEST_F(HfBucketStoreTest, TheReadBackAfterALostAnswerFollowsTheGatewayRedirectWithoutCredentials) {
  auto store = Open("hf://buckets/wfs-test/runs/lost");
  ASSERT_TRUE(store);
  ASSERT_TRUE(hub_->Reset());
  ASSERT_TRUE(proxy_->Control("drop=1"));
  const auto data = RandomBytes(300'000, 31);
  const Status put = store->Put("head.json", data, PutMode::kCreateIfAbsent);
  ASSERT_TRUE(put.ok()) << put.ToString() << "\n" << hub_->Stats().dump();
  const auto stats = hub_->Stats();
  EXPECT_GE(stats["gateway"]["redirected"].get<uint64_t>(), 1u) << stats.dump();
  EXPECT_TRUE(stats["cdn_authorization"].empty()) << stats["cdn_authorization"].dump();
  EXPECT_EQ(*store->Get("head.json"), data);
  // Someone else's object under the same key is still a Conflict after the same read-back.
  ASSERT_TRUE(proxy_->Control("drop=1"));
  EXPECT_EQ(store->Put("head.json", RandomBytes(300'000, 32), PutMode::kCreateIfAbsent).kind(), ErrorKind::kConflict);
  ASSERT_TRUE(proxy_->Control("drop=0"));
  ASSERT_TRUE(store->Delete("head.json").ok());
}

// The gateway's key pair comes from variables or a profile of its own; a user's AWS keys (the
// environment, the default profile) are never signed and sent to the Hub.
TEST_F(HfBucketStoreTest, GatewayKeysNeverComeFromTheAwsChain) {
  test::TempDir home("hfkeys");
  WriteFile(home.Join(".aws/credentials"),
            [] {
              const std::string ini = "[default]\naws_access_key_id = AKIAUSERDEFAULTPROFILE\naws_secret_access_key = s1\n"
                                      "[hf]\naws_access_key_id = HFAKFROMPROFILE\naws_secret_access_key = s2\n"
                                      "[other]\naws_access_key_id = HFAKOTHER\naws_secret_access_key = s3\n";
              return std::vector<uint8_t>(ini.begin(), ini.end());
            }());
  const std::map<std::string, std::string> aws = {{"AWS_ACCESS_KEY_ID", "AKIAUSERENVIRONMENT"},
                                                  {"AWS_SECRET_ACCESS_KEY", "secret"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(aws.begin(), aws.end());
    return MapEnv(std::move(extra));
  };
  auto id = [](const Expected<std::optional<AwsCredentials>>& c) {
    return c.ok() && c->has_value() ? (*c)->access_key_id : std::string(c.ok() ? "<none>" : "<error>");
  };
  EXPECT_EQ(id(LoadHfGatewayCredentials(with({}))), "<none>");
  EXPECT_EQ(id(LoadHfGatewayCredentials(with({{"HOME", home.path()}}))), "HFAKFROMPROFILE");
  EXPECT_EQ(id(LoadHfGatewayCredentials(with({{"HOME", home.path()}, {"HF_S3_PROFILE", "other"}}))), "HFAKOTHER");
  EXPECT_EQ(id(LoadHfGatewayCredentials(with({{"HOME", home.path()}, {"HF_S3_PROFILE", "nope"}}))), "<error>");
  EXPECT_EQ(id(LoadHfGatewayCredentials(with({{"HOME", home.path()}, {"HF_S3_ACCESS_KEY_ID", "HFAKVAR"},
                                              {"HF_S3_SECRET_ACCESS_KEY", "x"}}))),
            "HFAKVAR");
  EXPECT_EQ(id(LoadHfGatewayCredentials(MapEnv({{"AWS_ACCESS_KEY_ID", "HFAKINAWSVARS"}, {"AWS_SECRET_ACCESS_KEY", "x"}}))),
            "HFAKINAWSVARS");
  EXPECT_EQ(id(LoadHfGatewayCredentials(MapEnv({{"HF_S3_ACCESS_KEY_ID", "HFAKHALF"}}))), "<error>");

  // End to end: a user with AWS keys in the environment and the default profile, none for the
  // Hub. The write fails saying what to set, and the gateway never saw an AWS key.
  test::TempDir plain_home("hfkeys");
  WriteFile(plain_home.Join(".aws/credentials"),
            [] {
              const std::string ini = "[default]\naws_access_key_id = AKIAUSERDEFAULTPROFILE\naws_secret_access_key = s1\n";
              return std::vector<uint8_t>(ini.begin(), ini.end());
            }());
  ASSERT_TRUE(hub_->Reset());
  auto store = Open("hf://buckets/wfs-test/runs/keys", kToken, [&](HfBucketOptions& o) {
    o.s3.credentials.reset();
    o.s3.env = with({{"HOME", plain_home.path()}});
  });
  ASSERT_TRUE(store);
  const Status put = store->Put("x", std::vector<uint8_t>{1}, PutMode::kCreateIfAbsent);
  EXPECT_EQ(put.kind(), ErrorKind::kAuth) << put.ToString();
  EXPECT_NE(put.message().find("HF_S3_ACCESS_KEY_ID"), std::string::npos) << put.ToString();
  const nlohmann::json stats = hub_->Stats();  // a range-for over a temporary's member dangles
  for (const auto& key : stats["gateway_keys"]) EXPECT_FALSE(key.get<std::string>().starts_with("AKIA")) << key;
}

// A bucket must exist before `weightfs init`: the error says how to create one.
TEST_F(HfBucketStoreTest, InitOfABucketNobodyCreatedSaysHowToCreateIt) {
  auto store = Open("hf://buckets/wfs-test/never-created");
  ASSERT_TRUE(store);
  const Status init = Bucket::Init(*store);
  EXPECT_EQ(init.kind(), ErrorKind::kNotFound) << init.ToString();
  EXPECT_NE(init.message().find("hf buckets create wfs-test/never-created"), std::string::npos) << init.ToString();
  const Status list = store->List("").status();
  EXPECT_NE(list.message().find("hf buckets create wfs-test/never-created"), std::string::npos) << list.ToString();
}

// ---- model repos --------------------------------------------------------------------------------

class HfRepoTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir("hfrepo");
    files_ = new std::map<std::string, std::vector<uint8_t>>{
        {"model-00001-of-00002.safetensors", RandomBytes(9 << 20, 1)},  // 3 chunks of 4 MiB
        {"model-00002-of-00002.safetensors", RandomBytes(100'000, 2)},
        {"config.json", {'{', '}', '\n'}},
        {"tokenizer/vocab.txt", RandomBytes(2000, 3)},
        {"tokenizer/big.bin", RandomBytes(50'000, 4)},
    };
    for (const auto& [path, data] : *files_) WriteFile(dir_->Join("repos/org/model/" + path), data);
    WriteFile(dir_->Join("repos/org/gated-model/x.bin"), RandomBytes(100, 5));
    hub_ = new test::FakeHub();
    test::FakeHub::Options o;
    o.repos_dir = dir_->Join("repos");
    o.token = kToken;
    o.gated = {"org/gated-model"};
    o.page_size = 2;
    start_ = hub_->Start(o);
  }
  static void TearDownTestSuite() {
    delete hub_;
    delete files_;
    delete dir_;
    hub_ = nullptr;
  }
  void SetUp() override {
    ASSERT_TRUE(start_) << start_.message();
    ASSERT_TRUE(hub_->Control("rate_limit_every=0&resolver_quota=0&window=300&time_scale=1&url_ttl=3600&token=" +
                              std::string(kToken)));
    ASSERT_TRUE(hub_->Reset());
  }
  uint64_t Resolves() const { return hub_->Stats()["resolver_requests"].get<uint64_t>(); }

  HfConfig Config(const std::string& token = kToken) const {
    HfConfig c;
    c.endpoint = hub_->endpoint();
    c.token = token;
    c.token_source = "HF_TOKEN";
    c.hub_cache = dir_->Join("hf-cache-" + std::to_string(++cache_n_));
    return c;
  }
  static std::shared_ptr<HttpClient> Http() { return std::make_shared<HttpClient>(FastRetries()); }
  static const std::vector<uint8_t>& File(const std::string& p) { return files_->at(p); }
  uint64_t HubRequests() const {
    auto s = hub_->Stats();
    return s["requests"].get<uint64_t>() + s["cdn_requests"].get<uint64_t>();
  }

  static test::TempDir* dir_;
  static std::map<std::string, std::vector<uint8_t>>* files_;
  static test::FakeHub* hub_;
  static ::testing::AssertionResult start_;
  static inline int cache_n_ = 0;  // every Config() gets a cache directory of its own
};

test::TempDir* HfRepoTest::dir_ = nullptr;
std::map<std::string, std::vector<uint8_t>>* HfRepoTest::files_ = nullptr;
test::FakeHub* HfRepoTest::hub_ = nullptr;
::testing::AssertionResult HfRepoTest::start_ = ::testing::AssertionFailure() << "not started";

TEST_F(HfRepoTest, ResolvesTheRevisionAndListsEveryPageOfTheTree) {
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  const std::string commit = (*repo)->commit();
  EXPECT_TRUE(hf::IsCommitSha(commit)) << commit;
  EXPECT_GT((*repo)->commit_time_ms(), 0);
  auto files = (*repo)->ListFiles();
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  ASSERT_EQ(files->size(), files_->size());
  for (const auto& f : *files) {
    ASSERT_TRUE(files_->count(f.path)) << f.path;
    EXPECT_EQ(f.size, File(f.path).size()) << f.path;
    const bool lfs = f.path.ends_with(".safetensors") || f.path.ends_with(".bin");
    EXPECT_EQ(f.sha256, lfs ? Sha256Hex(File(f.path)) : "") << f.path;
  }
  // 5 entries in pages of 2: three tree requests plus the revision call.
  EXPECT_EQ(hub_->Stats()["requests"].get<uint64_t>(), 4u);
  // A commit revision is taken as is, without a request.
  const uint64_t before = HubRequests();
  auto pinned = HfRepo::Open(Config(), Http(), "org/model", commit);
  ASSERT_TRUE(pinned.ok());
  EXPECT_EQ((*pinned)->commit(), commit);
  EXPECT_EQ(HubRequests(), before);
}

TEST_F(HfRepoTest, RangedReadsFetchOnlyTheRangeAndNeverSendTheTokenToTheCdn) {
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  const std::string big = "model-00001-of-00002.safetensors";
  auto got = (*repo)->Read(big, 5'000'000, 123'456);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File(big), 5'000'000, 123'456));
  got = (*repo)->Read("config.json", 1, 2);  // a small file, served by the Hub itself
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("config.json"), 1, 2));
  EXPECT_EQ((*repo)->Read(big, File(big).size() - 10, 11).status().kind(), ErrorKind::kCorruption);

  const auto stats = hub_->Stats();
  EXPECT_EQ(stats["bytes"]["org/model/" + big].get<uint64_t>(), 123'456u + 10u);
  EXPECT_GT(stats["cdn_requests"].get<uint64_t>(), 0u);
  EXPECT_GT(stats["hub_authorized"].get<uint64_t>(), 0u);
  EXPECT_TRUE(stats["cdn_authorization"].empty()) << stats["cdn_authorization"].dump();
  EXPECT_EQ((*repo)->stats().bytes_fetched.load(), 123'456u + 2u + 10u);
}

TEST_F(HfRepoTest, ReadsFromTheLocalHuggingFaceCacheWithoutTouchingTheServer) {
  HfConfig config = Config();
  auto repo = HfRepo::Open(config, Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok());
  const std::string commit = (*repo)->commit();
  // The huggingface_hub layout: snapshots/COMMIT/PATH -> ../../blobs/<sha256>.
  const std::string root = config.hub_cache + "/models--org--model";
  const std::string big = "model-00001-of-00002.safetensors";
  const std::string sha = Sha256Hex(File(big));
  WriteFile(root + "/blobs/" + sha, File(big));
  fs::create_directories(root + "/snapshots/" + commit);
  fs::create_symlink("../../blobs/" + sha, root + "/snapshots/" + commit + "/" + big);
  WriteFile(root + "/refs/main", std::vector<uint8_t>(commit.begin(), commit.end()));

  ASSERT_TRUE(hub_->Reset());
  auto got = (*repo)->Read(big, 4'000'000, 1'000'000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File(big), 4'000'000, 1'000'000));
  EXPECT_EQ(HubRequests(), 0u) << hub_->Stats().dump();
  EXPECT_EQ((*repo)->stats().cache_bytes.load(), 1'000'000u);

  // Offline: the revision comes from refs/main, files from the snapshot; still no request.
  config.offline = true;
  auto offline = HfRepo::Open(config, Http(), "org/model", "main");
  ASSERT_TRUE(offline.ok()) << offline.status().ToString();
  EXPECT_EQ((*offline)->commit(), commit);
  auto files = (*offline)->ListFiles();
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  ASSERT_EQ(files->size(), 1u);
  EXPECT_EQ((*files)[0].sha256, sha);
  EXPECT_EQ((*offline)->Read("config.json", 0, 1).status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(HfRepo::Open(config, Http(), "org/model", "v2").status().kind(), ErrorKind::kNotFound);
  EXPECT_EQ(HubRequests(), 0u);
}

TEST_F(HfRepoTest, FallsBackToTheCachedRefWhenTheHubIsUnreachable) {
  HfConfig config = Config();
  const std::string commit(40, 'c');
  WriteFile(config.hub_cache + "/models--org--model/refs/main", std::vector<uint8_t>(commit.begin(), commit.end()));
  config.endpoint = "http://127.0.0.1:" + std::to_string(test::FreeLoopbackPort());
  HttpOptions o = FastRetries();
  o.max_attempts = 2;
  auto repo = HfRepo::Open(config, std::make_shared<HttpClient>(o), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  EXPECT_EQ((*repo)->commit(), commit);
}

TEST_F(HfRepoTest, ErrorsSayWhichOfTokenNameOrPermissionIsWrongAndNeverShowTheToken) {
  auto no_token = HfRepo::Open(Config(""), Http(), "org/model", "main");
  EXPECT_EQ(no_token.status().kind(), ErrorKind::kAuth);
  EXPECT_NE(no_token.status().message().find("set HF_TOKEN or run `hf auth login`"), std::string::npos)
      << no_token.status().ToString();

  auto bad_token = HfRepo::Open(Config("hf_not_the_right_one"), Http(), "org/model", "main");
  EXPECT_EQ(bad_token.status().kind(), ErrorKind::kAuth);
  EXPECT_NE(bad_token.status().message().find("invalid or expired"), std::string::npos) << bad_token.status().ToString();
  EXPECT_EQ(bad_token.status().message().find("hf_not_the_right_one"), std::string::npos);

  auto missing = HfRepo::Open(Config(), Http(), "org/no-such-model", "main");
  EXPECT_EQ(missing.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(missing.status().message().find("repo 'org/no-such-model' does not exist"), std::string::npos)
      << missing.status().ToString();

  auto no_rev = HfRepo::Open(Config(), Http(), "org/model", "v9");
  EXPECT_EQ(no_rev.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(no_rev.status().message().find("revision 'v9' does not exist"), std::string::npos)
      << no_rev.status().ToString();

  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok());
  auto no_file = (*repo)->Read("nope.bin", 0, 1);
  EXPECT_EQ(no_file.status().kind(), ErrorKind::kNotFound);
  EXPECT_NE(no_file.status().message().find("'nope.bin' does not exist"), std::string::npos)
      << no_file.status().ToString();

  auto gated = HfRepo::Open(Config(), Http(), "org/gated-model", "main");
  ASSERT_TRUE(gated.ok()) << gated.status().ToString();
  auto denied = (*gated)->Read("x.bin", 0, 10);
  EXPECT_EQ(denied.status().kind(), ErrorKind::kAuth);
  EXPECT_NE(denied.status().message().find("is gated: accept its conditions"), std::string::npos)
      << denied.status().ToString();

  for (const Status& s : {no_token.status(), bad_token.status(), missing.status(), no_rev.status(),
                          no_file.status(), denied.status()}) {
    EXPECT_EQ(s.message().find(kToken), std::string::npos) << s.ToString();
  }
  EXPECT_TRUE(hub_->Stats()["cdn_authorization"].empty());
}

TEST_F(HfRepoTest, RetriesRateLimitedRequestsWithRetryAfterOrTheRateLimitHeader) {
  ASSERT_TRUE(hub_->Control("rate_limit_every=2&retry_after=0"));
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  auto files = (*repo)->ListFiles();
  ASSERT_TRUE(files.ok()) << files.status().ToString();
  EXPECT_EQ(files->size(), files_->size());
  // Only the IETF header this time (t=0), no Retry-After.
  ASSERT_TRUE(hub_->Control("rate_limit_every=2&ratelimit_header=1"));
  auto got = (*repo)->Read("tokenizer/vocab.txt", 10, 100);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("tokenizer/vocab.txt"), 10, 100));
  EXPECT_GE(hub_->Stats()["rate_limited"].get<uint64_t>(), 2u);
}

TEST_F(HfRepoTest, SourcesReadPinnedCommitsLazily) {
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok());
  HfSources sources(Config(), Http());
  const std::string src = "hf://org/model@" + (*repo)->commit() + "/model-00002-of-00002.safetensors";
  ASSERT_TRUE(hub_->Reset());
  auto got = sources.Read(src, 100, 4000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("model-00002-of-00002.safetensors"), 100, 4000));
  EXPECT_EQ(sources.bytes_fetched(), 4000u);
  EXPECT_EQ(hub_->BytesServed("org/model/model-00002-of-00002.safetensors"), 4000u);
  auto missing = sources.Read("hf://org/model@" + std::string(40, 'd') + "/config.json", 0, 1);
  EXPECT_EQ(missing.status().kind(), ErrorKind::kNotFound) << missing.status().ToString();
}

TEST_F(HfRepoTest, ARevisionIsOneDerivedVersion) {
  auto versions = OpenHfRepoVersions(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(versions.ok()) << versions.status().ToString();
  auto list = (*versions)->ListVersions("");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].model, "org/model");
  EXPECT_EQ((*list)[0].version, "main");
  EXPECT_EQ((*versions)->ReadManifest("org/model", "other").status().kind(), ErrorKind::kNotFound);
  auto manifest = (*versions)->ReadManifest("org/model", "main");
  ASSERT_TRUE(manifest.ok());
  const Manifest& m = **manifest;
  EXPECT_TRUE(m.derived);
  ASSERT_EQ(m.files.size(), files_->size());
  const std::string big = "model-00001-of-00002.safetensors";
  const ManifestFile* f = m.FindFile(big);
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(f->chunks.size(), 3u);
  EXPECT_EQ(f->sha256, Sha256Hex(File(big)));
  ASSERT_TRUE(hub_->Reset());
  std::vector<uint8_t> out(f->chunks[2].length);
  ASSERT_TRUE((*versions)->Materialize(m, *f, 2, out).ok());
  EXPECT_EQ(out, Slice(File(big), f->chunks[2].offset, f->chunks[2].length));
  EXPECT_EQ(hub_->BytesServed("org/model/" + big), f->chunks[2].length) << hub_->Stats().dump();
  // Chunk identifiers are unique.
  std::set<Hash128> ids;
  for (const auto& file : m.files) {
    for (const auto& c : file.chunks) EXPECT_TRUE(ids.insert(c.hash).second);
  }
  // A revision that is no version name (a commit is one; "refs/pr/1" is not) shows as the commit.
  const std::string commit = HfRepo::Open(Config(), Http(), "org/model", "main").value()->commit();
  auto pinned = OpenHfRepoVersions(Config(), Http(), "org/model", commit);
  ASSERT_TRUE(pinned.ok()) << pinned.status().ToString();
  EXPECT_EQ((*pinned)->ListVersions("org/model")->at(0).version, commit);
  EXPECT_EQ(HfRepoModelName("org/model"), "org/model");
  EXPECT_EQ(HfRepoModelName("org/m+x"), "org/m_x");
}

// Every ranged read of a file used to cost a call to the Hub's resolve endpoint (the most
// rate-limited one) plus the redirect. Now a file is resolved once, its signed CDN URL reused,
// and concurrent first reads share the one resolve.
TEST_F(HfRepoTest, ResolvesEachFileOnceAndReusesItsSignedUrl) {
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  const std::string big = "model-00001-of-00002.safetensors";
  ASSERT_TRUE(hub_->Reset());
  for (uint64_t off = 0; off < File(big).size(); off += 1'000'000) {
    const uint64_t n = std::min<uint64_t>(1'000'000, File(big).size() - off);
    auto got = (*repo)->Read(big, off, n);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(Sha256Hex(*got), Sha256Hex(Slice(File(big), off, n))) << off;
  }
  EXPECT_EQ(Resolves(), 1u) << hub_->Stats().dump();
  EXPECT_EQ(hub_->Stats()["cdn_requests"].get<uint64_t>(), 10u);

  // Eight threads read a file nobody has resolved yet, all at once: one resolve.
  const std::string other = "tokenizer/big.bin";
  std::vector<std::thread> threads;
  std::vector<Status> results(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      auto got = (*repo)->Read(other, static_cast<uint64_t>(t) * 5000, 5000);
      results[t] = !got.ok() ? got.status()
                             : (*got == Slice(File(other), static_cast<uint64_t>(t) * 5000, 5000)
                                    ? Status::Ok()
                                    : Status::Corruption("bytes differ"));
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& r : results) EXPECT_TRUE(r.ok()) << r.ToString();
  EXPECT_EQ(Resolves(), 2u) << hub_->Stats().dump();
  EXPECT_TRUE(hub_->Stats()["cdn_authorization"].empty());
}

// A signed URL is reused until shortly before the expiry it carries, then resolved again before
// the CDN refuses it; one the CDN refuses anyway (revoked) is resolved again, once.
TEST_F(HfRepoTest, ExpiringAndRevokedSignedUrlsAreResolvedAgain) {
  auto repo = HfRepo::Open(Config(), Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  const std::string big = "model-00001-of-00002.safetensors";
  ASSERT_TRUE(hub_->Control("url_ttl=4"));
  ASSERT_TRUE(hub_->Reset());
  ASSERT_EQ(*(*repo)->Read(big, 0, 1000), Slice(File(big), 0, 1000));
  ASSERT_EQ(*(*repo)->Read(big, 1000, 1000), Slice(File(big), 1000, 1000));
  EXPECT_EQ(Resolves(), 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(4100));  // the URL's lifetime passes
  ASSERT_EQ(*(*repo)->Read(big, 2000, 1000), Slice(File(big), 2000, 1000));
  EXPECT_EQ(Resolves(), 2u);
  EXPECT_EQ(hub_->Stats()["cdn_expired"].get<uint64_t>(), 0u) << "resolved again before it expired";

  // Another file, with an hour to live: revoked before that, it answers 403 and is resolved again.
  const std::string other = "tokenizer/big.bin";
  ASSERT_TRUE(hub_->Control("url_ttl=3600"));
  ASSERT_EQ(*(*repo)->Read(other, 0, 1000), Slice(File(other), 0, 1000));
  EXPECT_EQ(Resolves(), 3u);
  ASSERT_TRUE(hub_->Control("revoke_urls=1"));
  auto got = (*repo)->Read(other, 1000, 1000);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File(other), 1000, 1000));
  EXPECT_EQ(hub_->Stats()["cdn_expired"].get<uint64_t>(), 1u);
  EXPECT_EQ(Resolves(), 4u);
}

// The Hub's quotas are fixed 5-minute windows whose 429 says when the window resets
// (`RateLimit: "resolvers";r=0;t=N`). The request waits that long, says so in the log, and is
// not failed by the client's own retry budget (here 6 tries with backoff up to 200 ms in 30 s).
TEST_F(HfRepoTest, WaitsOutAnExhaustedResolverWindowAndSaysSo) {
  HttpOptions o = FastRetries();
  o.total_timeout = std::chrono::milliseconds(2'000);  // shorter than the window
  auto repo = HfRepo::Open(Config(), std::make_shared<HttpClient>(o), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  ASSERT_TRUE(hub_->Control("resolver_quota=1&window=6"));  // real seconds: time_scale 1
  test::LogCapture log;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(*(*repo)->Read("model-00002-of-00002.safetensors", 0, 100), Slice(File("model-00002-of-00002.safetensors"), 0, 100));
  auto got = (*repo)->Read("tokenizer/big.bin", 0, 100);  // the quota is spent: waits for the next window
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("tokenizer/big.bin"), 0, 100));
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 15.0);
  const auto stats = hub_->Stats();
  EXPECT_EQ(stats["resolver_limited"].get<uint64_t>(), 1u) << "waited exactly, no retry inside the window";
  bool said = false;
  for (const std::string& line : log.Lines()) {
    said |= line.starts_with("warning") && line.find("waiting") != std::string::npos &&
            line.find("rate-limit window") != std::string::npos;
  }
  EXPECT_TRUE(said) << "no log line says it waits";
}

// The Hub's real numbers: a 300 s window (t= up to 300). The fake Hub's clock runs 50 times
// faster and so does the client's wait (WEIGHTFS_TEST_TIME_SCALE): the same parse, cap and wait
// code runs with the Hub's values in the headers, in 6 s.
TEST_F(HfRepoTest, AFiveMinuteWindowIsWaitedOutToo) {
  HfConfig config = Config();
  config.time_scale = 50;
  HttpOptions o = FastRetries();
  o.total_timeout = std::chrono::milliseconds(2'000);
  auto repo = HfRepo::Open(config, std::make_shared<HttpClient>(o), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  ASSERT_TRUE(hub_->Control("resolver_quota=1&window=300&time_scale=50"));
  test::LogCapture log;
  ASSERT_TRUE((*repo)->Read("model-00002-of-00002.safetensors", 0, 100).ok());
  auto got = (*repo)->Read("tokenizer/big.bin", 100, 100);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("tokenizer/big.bin"), 100, 100));
  long said = 0;
  for (const std::string& line : log.Lines()) {
    // t= is in the Hub's seconds: close to 300 (the window had barely begun).
    const std::string what = "rate-limited (HTTP 429); waiting ";
    const size_t at = line.find(what);
    if (at != std::string::npos && line.find("rate-limit window") != std::string::npos) {
      said = std::atol(line.c_str() + at + what.size());
    }
  }
  EXPECT_GE(said, 100) << "no log line says it waits for the Hub's window";
  EXPECT_LE(said, 301);
  EXPECT_EQ(hub_->Stats()["resolver_limited"].get<uint64_t>(), 1u);
}

// `hf auth login` rewrites the token file, and OAuth login tokens expire and are refreshed in
// it: a long-running reader picks the new token up, and never shows the old or the new one.
TEST_F(HfRepoTest, FollowsTheTokenFileWhenItChanges) {
  test::TempDir home("hftoken");
  const std::string first = "hf_FirstTokenValue0001";
  const std::string second = "hf_SecondTokenValue002";
  WriteFile(home.Join("token"), std::vector<uint8_t>(first.begin(), first.end()));
  auto loaded = LoadHfConfig(MapEnv({{"HF_HOME", home.path()}, {"HF_ENDPOINT", hub_->endpoint()}}));
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  ASSERT_TRUE(hub_->Control("token=" + first));
  auto repo = HfRepo::Open(*loaded, Http(), "org/model", "main");
  ASSERT_TRUE(repo.ok()) << repo.status().ToString();
  ASSERT_TRUE((*repo)->Read("config.json", 0, 1).ok());
  // The token is refreshed: the Hub accepts only the new one from now on.
  ASSERT_TRUE(hub_->Control("token=" + second));
  WriteFile(home.Join("token"), std::vector<uint8_t>(second.begin(), second.end()));
  auto got = (*repo)->Read("config.json", 1, 1);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Slice(File("config.json"), 1, 1));
  // Logged out: anonymous, and the error says so without either token.
  fs::remove(home.Join("token"));
  auto anonymous = (*repo)->Read("config.json", 2, 1);
  EXPECT_EQ(anonymous.status().kind(), ErrorKind::kAuth);
  for (const std::string& t : {first, second}) {
    EXPECT_EQ(anonymous.status().message().find(t), std::string::npos);
  }
}

}  // namespace
}  // namespace weightfs
