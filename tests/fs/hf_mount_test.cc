// Hugging Face end to end, through real mounts and a local fake of the Hub (tests/testing/fake_hub.py)
// whose Storage Buckets sit on a real S3-compatible server (s3rver) reached through the Hub's S3
// gateway path:
//
//   - a generated base model is published as a model repo on the fake Hub;
//   - `weightfs push hf://buckets/... --base hf://ORG/REPO` registers it as the model's base (a
//     manifest whose chunks are byte ranges of the repo's files) and pushes later versions as
//     deltas into the hf:// bucket;
//   - a mount of the hf:// bucket with an empty cache reads every version bit-exact, and reading
//     one tensor fetches from the "repo" only that tensor's chunks (bytes counted by the server);
//   - a mount of the repo itself (hf://ORG/REPO@main) shows it as REPO@main;
//   - the token never reaches the CDN host, the logs or the cache directory.
#include <fcntl.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/chunk_plan.h"
#include "core/hash.h"
#include "core/safetensors.h"
#include "fs/mount_point.h"
#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/s3_test_server.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Result = weightfs::test::CommandResult;
using weightfs::test::Slurp;
using weightfs::test::SlurpText;
using namespace std::chrono_literals;

constexpr const char* kToken = "hf_fakeTokenValue0123456789abcdefXYZ";

using weightfs::test::FilesUnder;

// Whether `needle` occurs in any regular file under `dir` (the cache must never hold the token).
bool AnyFileContains(const fs::path& dir, const std::string& needle) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_regular_file() && SlurpText(it->path()).find(needle) != std::string::npos) return true;
  }
  return false;
}

class HfMountTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = CheckFuseDevice(); !s.ok()) FAIL() << "these tests need FUSE: " << s.message();
    ASSERT_TRUE(tmp_.ok());
    root_ = tmp_.path();
    ASSERT_TRUE(s3_.Start());
    ASSERT_TRUE(proxy_.Start(s3_.endpoint()));
    // The base model: a generated checkpoint sequence; v000 becomes the repo acme/base.
    Result g = Cli("gen " + (root_ / "gen").string() + " --params 3M --versions 2 --lr 1e-6 --shard-size 4MB");
    ASSERT_EQ(g.exit_code, 0) << g.out;
    fs::create_directories(root_ / "repos/acme");
    fs::copy(root_ / "gen/v000", root_ / "repos/acme/base", fs::copy_options::recursive);
    test::FakeHub::Options o;
    o.repos_dir = (root_ / "repos").string();
    o.s3 = s3_.endpoint();
    o.gateway_target = proxy_.endpoint();
    o.buckets = {"wfs-test/runs"};
    o.token = kToken;
    o.time_scale = TimeScale();
    ASSERT_TRUE(hub_.Start(o));
    fs::create_directories(root_ / "hfhome");
  }
  void TearDown() override {
    mounts_.clear();  // (unmounts before the Hub and the servers go)
  }

  // The environment a user of the Hub has: endpoint, token, HF_HOME (an empty HF cache), the
  // S3 gateway's key pair, and AWS keys of their own that must never reach the Hub.
  std::string Env() const {
    return "env HF_ENDPOINT=" + hub_.endpoint() + " HF_TOKEN=" + kToken + " HF_HOME=" + (root_ / "hfhome").string() +
           " HF_S3_ENDPOINT=" + hub_.gateway_url() + " HF_S3_ACCESS_KEY_ID=S3RVER HF_S3_SECRET_ACCESS_KEY=S3RVER" +
           " AWS_ACCESS_KEY_ID=AKIAUSERSOWNAWSKEY AWS_SECRET_ACCESS_KEY=x AWS_REGION=us-east-1" +
           " WEIGHTFS_TEST_TIME_SCALE=" + std::to_string(TimeScale()) + " ";
  }
  // The fake Hub's clock (and so the client's rate-limit waits) runs this much faster than real
  // time: 60 makes the Hub's 300 s window 5 s. WEIGHTFS_HF_TEST_TIME_SCALE=1 runs it for real.
  static int TimeScale() {
    const char* v = std::getenv("WEIGHTFS_HF_TEST_TIME_SCALE");
    return v != nullptr && std::atoi(v) >= 1 ? std::atoi(v) : 60;
  }
  Result Cli(const std::string& args, int seconds = 120) const { return test::Cli(args, seconds, Env()); }
  // A mount of `bucket` at ROOT/<name>/mnt (cache and log.txt beside it), with the user's
  // environment and the product's refresh interval; unmounted at teardown.
  fs::path Mount(const std::string& bucket, const std::string& name, const std::string& extra = "") {
    test::Mount::Options options;
    options.extra = extra;
    options.refresh_seconds = 0;
    options.env = Env();
    mounts_.push_back(std::make_unique<test::Mount>(bucket, root_ / name, options));
    const Result& r = mounts_.back()->Start();
    EXPECT_EQ(r.exit_code, 0) << mounts_.back()->Describe();
    return mounts_.back()->mnt();
  }
  void ExpectSameFiles(const fs::path& version_dir, const fs::path& source) {
    SCOPED_TRACE(version_dir.string() + " vs " + source.string());
    EXPECT_EQ(FilesUnder(version_dir), FilesUnder(source));
    for (const std::string& f : FilesUnder(source)) {
      EXPECT_EQ(Sha256Hex(Slurp(version_dir / f)), Sha256Hex(Slurp(source / f))) << f;
    }
  }

  test::TempDir tmp_{"hf-mount"};
  fs::path root_;
  test::S3rverServer s3_{"wfs-test"};
  test::S3PreconditionProxy proxy_;
  test::FakeHub hub_;
  std::vector<std::unique_ptr<test::Mount>> mounts_;
};

TEST_F(HfMountTest, BaseInAModelRepoDeltasInAnHfBucket) {
  const std::string bucket = "hf://buckets/wfs-test/runs";
  Result init = Cli("init " + bucket);
  ASSERT_EQ(init.exit_code, 0) << init.out;
  Result p1 = Cli("push " + bucket + " acme/m@step-1 " + (root_ / "gen/v001").string() +
                  " --base hf://acme/base --cache-dir " + (root_ / "push-cache").string());
  ASSERT_EQ(p1.exit_code, 0) << p1.out;
  EXPECT_NE(p1.out.find("registered acme/m@hf-"), std::string::npos) << p1.out;
  Result p2 = Cli("push " + bucket + " acme/m@step-2 " + (root_ / "gen/v002").string() + " --cache-dir " +
                  (root_ / "push-cache").string());
  ASSERT_EQ(p2.exit_code, 0) << p2.out;
  // Writes went through the gateway signed with its key pair, never with the user's AWS keys.
  const Json keys = hub_.Stats()["gateway_keys"];
  ASSERT_FALSE(keys.empty());
  for (const Json& k : keys) EXPECT_EQ(k.get<std::string>(), "S3RVER");

  // The base costs the bucket a manifest, not the model.
  Json log = Json::parse(Cli("log " + bucket + " --json 2>/dev/null").out, nullptr, false);
  ASSERT_TRUE(log.is_array()) << log.dump();
  std::string base_version;
  for (const Json& v : log) {
    if (v.value("version", "").starts_with("hf-")) {
      base_version = v.value("version", "");
      EXPECT_EQ(v.value("stored_bytes", 1ull), 0u) << v.dump();
    }
  }
  ASSERT_FALSE(base_version.empty()) << log.dump();

  // A fresh mount (empty weightfs cache, empty HF cache) reads every version bit-exact.
  const fs::path mnt = Mount(bucket, "a");
  ExpectSameFiles(mnt / "acme" / ("m@" + base_version), root_ / "gen/v000");
  ExpectSameFiles(mnt / "acme/m@step-1", root_ / "gen/v001");
  ExpectSameFiles(mnt / "acme/m@step-2", root_ / "gen/v002");

  // Reading one tensor of step-2 on another fresh mount fetches from the repo only that
  // tensor's chunks: each is a delta chain whose keyframe is the base's chunk in the repo.
  const fs::path mnt2 = Mount(bucket, "b");
  const std::string shard = "model-00001-of-00002.safetensors";
  ASSERT_TRUE(fs::exists(root_ / "gen/v002" / shard)) << "the generator's shard names changed";
  const std::vector<uint8_t> src = Slurp(root_ / "gen/v002" / shard);
  Expected<SafetensorsHeader> header = ParseSafetensorsHeader(src, src.size());
  ASSERT_TRUE(header.ok()) << header.status().ToString();
  const TensorInfo* biggest = nullptr;
  for (const TensorInfo& t : header->tensors) {
    if (!biggest || t.size() > biggest->size()) biggest = &t;
  }
  ASSERT_NE(biggest, nullptr);
  const uint64_t begin = header->data_offset + biggest->begin;
  const uint64_t length = biggest->size();
  hub_.Reset();
  {
    std::vector<uint8_t> got(length);
    const int fd = ::open((mnt2 / "acme/m@step-2" / shard).c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, got.data(), got.size(), static_cast<off_t>(begin)), static_cast<ssize_t>(length));
    ::close(fd);
    EXPECT_TRUE(std::equal(got.begin(), got.end(), src.begin() + static_cast<std::ptrdiff_t>(begin)))
        << "tensor " << biggest->name << " differs";
  }
  const uint64_t chunk = kDefaultChunkBytes;
  const uint64_t rounded = (length + chunk - 1) / chunk * chunk;
  const uint64_t served = hub_.BytesServed("acme/base/" + shard);
  EXPECT_GT(served, 0u);
  EXPECT_LE(served, rounded + rounded / 10) << "tensor " << biggest->name << " is " << length << " bytes";
  std::printf("[ metric ] one tensor (%s, %llu bytes) of step-2 fetched %llu bytes from the repo (%.3fx)\n",
              biggest->name.c_str(), (unsigned long long)length, (unsigned long long)served,
              static_cast<double>(served) / static_cast<double>(length));

  // The token went to the Hub only: not to the CDN host, not into logs or caches.
  const Json stats = hub_.Stats();
  ASSERT_TRUE(stats.is_object());
  for (const Json& a : stats["cdn_authorization"]) EXPECT_TRUE(a.get<std::string>().empty()) << a.dump();
  for (const char* dir : {"a", "b", "push-cache"}) {
    EXPECT_FALSE(AnyFileContains(root_ / dir / "cache", kToken)) << dir;
    EXPECT_FALSE(AnyFileContains(root_ / dir, kToken)) << dir;
  }
  for (const std::string& out : {init.out, p1.out, p2.out}) EXPECT_EQ(out.find(kToken), std::string::npos);
}

// Four nodes reading one step through a shared tier (--shared-cache, a WebDAV tier on nginx)
// cost the Hub the resolves of one node reading it alone (+10%), not four times them.
TEST_F(HfMountTest, FourNodesThroughASharedTierCostTheResolvesOfOne) {
  const std::string bucket = "hf://buckets/wfs-test/runs";
  ASSERT_EQ(Cli("init " + bucket).exit_code, 0);
  for (int k = 0; k < 2; ++k) {
    Result p = Cli("push " + bucket + " acme/m@step-" + std::to_string(k) + " " +
                   (root_ / ("gen/v00" + std::to_string(k))).string() + " --cache-dir " + (root_ / "push-cache").string());
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  auto read_step = [&](const fs::path& mnt) { ExpectSameFiles(mnt / "acme/m@step-1", root_ / "gen/v001"); };
  ASSERT_TRUE(hub_.Reset());
  read_step(Mount(bucket, "alone"));
  const uint64_t one = hub_.Stats()["resolver_requests"].get<uint64_t>();

  test::NginxServer nginx;
  ASSERT_TRUE(nginx.Start());
  ASSERT_TRUE(hub_.Reset());  // (the mounts' own reads count too, as the lone node's did)
  std::vector<fs::path> nodes;
  for (int k = 0; k < 4; ++k) nodes.push_back(Mount(bucket, "node" + std::to_string(k), "--shared-cache " + nginx.url() + "/tier"));
  std::vector<std::thread> readers;
  for (const fs::path& n : nodes) readers.emplace_back([&, n] { read_step(n); });
  for (std::thread& t : readers) t.join();
  const uint64_t four = hub_.Stats()["resolver_requests"].get<uint64_t>();
  std::printf("[ metric ] one step read by 1 node alone: %llu resolver calls; by 4 nodes through a shared tier: %llu\n",
              (unsigned long long)one, (unsigned long long)four);
  EXPECT_GT(one, 0u);
  EXPECT_LE(static_cast<double>(four), static_cast<double>(one) * 1.1);
  mounts_.clear();  // before nginx goes
}

TEST_F(HfMountTest, AModelRepoMountsAsOneReadOnlyVersion) {
  const fs::path mnt = Mount("hf://acme/base@main", "repo");
  ExpectSameFiles(mnt / "acme/base@main", root_ / "gen/v000");
  EXPECT_NE(::mkdir((mnt / "acme/base@v2").c_str(), 0755), 0);
  const Json stats = hub_.Stats();
  for (const Json& a : stats["cdn_authorization"]) EXPECT_TRUE(a.get<std::string>().empty()) << a.dump();
  EXPECT_FALSE(AnyFileContains(root_ / "repo", kToken));
}

// A ~1 GB model repo (18 files) read whole through `mount hf://ORG/REPO`: each file costs one
// call to the Hub's resolve endpoint (the signed CDN URL is reused for every chunk of it), and
// when the resolver quota runs out mid-read (a fresh 5-minute window with its quota spent) the
// mount waits for the reset with a log line saying so: every byte exact, no EIO.
TEST_F(HfMountTest, ARepoCostsOneResolvePerFileAndWaitsOutAnExhaustedQuota) {
  Result g = Cli("gen " + (root_ / "big").string() + " --params 500M --versions 1 --lr 1e-6 --shard-size 64MB", 300);
  ASSERT_EQ(g.exit_code, 0) << g.out;
  fs::rename(root_ / "big/v000", root_ / "repos/acme/big");
  const std::set<std::string> listed = FilesUnder(root_ / "repos/acme/big");
  const std::vector<std::string> files(listed.begin(), listed.end());
  uint64_t bytes = 0;
  for (const std::string& f : files) bytes += fs::file_size(root_ / "repos/acme/big" / f);
  ASSERT_GE(files.size(), 10u);
  ASSERT_GE(bytes, 900ull << 20);

  const fs::path mnt = Mount("hf://acme/big@main", "bigmnt", "--memory-limit 256M");
  const fs::path version = mnt / "acme/big@main";
  ASSERT_TRUE(hub_.Control("resolver_quota=1000&window=300"));
  ASSERT_TRUE(hub_.Reset());
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < files.size(); ++i) {
    // Halfway, the quota is gone for a whole window: t=300 in the Hub's seconds.
    if (i == files.size() / 2) {
      ASSERT_TRUE(hub_.Control("exhaust=1"));
    }
    const std::vector<uint8_t> got = Slurp(version / files[i]);
    ASSERT_EQ(got.size(), fs::file_size(root_ / "repos/acme/big" / files[i])) << files[i] << " (EIO?)";
    EXPECT_EQ(Sha256Hex(got), Sha256Hex(Slurp(root_ / "repos/acme/big" / files[i]))) << files[i];
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Json stats = hub_.Stats();
  const uint64_t resolves = stats["resolver_requests"].get<uint64_t>();
  const uint64_t limited = stats["resolver_limited"].get<uint64_t>();
  std::printf("[ metric ] %zu files, %.2f GB through mount hf://acme/big@main in %.1f s: %llu resolver calls "
              "(%llu answered 429 with the Hub's 300 s reset, time scale %d), %llu CDN requests\n",
              files.size(), static_cast<double>(bytes) / 1e9, seconds, (unsigned long long)resolves,
              (unsigned long long)limited, TimeScale(), (unsigned long long)stats["cdn_requests"].get<uint64_t>());
  EXPECT_LE(static_cast<double>(resolves), static_cast<double>(files.size()) * 1.1) << stats.dump().substr(0, 2000);
  EXPECT_GE(limited, 1u) << "the quota never ran out: the test did not test the wait";
  const std::string log = weightfs::test::ReadFileOrEmpty((root_ / "bigmnt/log.txt").string());
  EXPECT_NE(log.find("rate-limit window"), std::string::npos) << weightfs::test::TailOfFile((root_ / "bigmnt/log.txt").string());
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("rate-limit window") != std::string::npos) std::printf("[ log    ] %s\n", line.c_str());
  }
  EXPECT_EQ(log.find("Input/output error"), std::string::npos);
}

TEST_F(HfMountTest, WrongTokenSaysWhatIsWrongWithoutPrintingIt) {
  ASSERT_EQ(Cli("init " + (root_ / "bucket").string()).exit_code, 0);
  Result r = weightfs::test::RunShell("env HF_ENDPOINT=" + hub_.endpoint() + " HF_TOKEN=hf_wrongwrongwrong HF_HOME=" +
                                      (root_ / "hfhome").string() + " timeout 60 " + WEIGHTFS_BINARY +
                                      " push " + (root_ / "bucket").string() + " acme/m@x --base hf://acme/base 2>&1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_EQ(r.out.find("hf_wrongwrongwrong"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("token"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace weightfs
