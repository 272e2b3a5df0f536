// The shared cache tier (--shared-cache, hub/engine/shared_tier.h; issue 28) through real mounts.
// Four nodes, each a mount with its own cache directory, read a WebDAV bucket (nginx behind a
// proxy that counts the bytes it serves: the origin's egress, measured at the origin) through one
// tier: WebDAV on the same nginx, or S3 (s3rver behind the proxy that gives it S3's
// create-if-absent). They read step N, then step N+1, all at once: the origin serves about the
// stored bytes once, not four times, and every file is bit-exact. A tier that is corrupted,
// emptied while nodes read, or down: every file bit-exact still.
#include <future>

#include "tests/fs/draft_mount.h"
#include "tests/testing/s3_test_server.h"

namespace weightfs::test {
namespace {

constexpr const char* kS3Env = "env AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1 ";

class SharedCacheTest : public DraftMountTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void SetUp() override {
    DraftMountTest::SetUp();
    // ~24 MB a version in 3 shards: a keyframe pack and a delta pack per version.
    Generate("12M", 2, "--shard-size 9M");
    std::string direct;
    StartProxiedWebDav(1.0, &direct, &origin_);
    InitWithBase(direct);
    Result p = Cli("push " + direct + " m/x@v1 " + Source(1).string() + " --cache-dir " + (root_ / "c0").string());
    ASSERT_EQ(p.exit_code, 0) << p.out;
    for (const auto& e : fs::recursive_directory_iterator(Nginx().root() + "/bucket")) {
      if (e.is_regular_file() && e.path().string().find(".weightfs-tmp") == std::string::npos) stored_ += e.file_size();
    }
    if (GetParam() == "s3") {
      s3_ = std::make_unique<S3rverServer>("tier");
      ASSERT_TRUE(s3_->Start());
      s3_proxy_ = std::make_unique<S3PreconditionProxy>();
      ASSERT_TRUE(s3_proxy_->Start(s3_->endpoint()));
      tier_ = "s3://tier/cache";
      tier_options_ = " --shared-cache-endpoint " + s3_proxy_->endpoint();
      env_ = kS3Env;
    } else {
      tier_ = Nginx().url() + "/tier";
    }
  }
  void TearDown() override {
    mounts_.clear();
    tier_proxy_.reset();
    s3_proxy_.reset();
    s3_.reset();
    DraftMountTest::TearDown();
  }

  // A node: a mount of the bucket through the proxy, reading through `tier`.
  Mount& Node(const std::string& name, const std::string& tier) {
    MountOptions o;
    o.extra = "--shared-cache " + tier + tier_options_;
    o.env = env_;
    mounts_.push_back(std::make_unique<Mount>(origin_, root_ / name, o));
    Mount& m = *mounts_.back();
    EXPECT_EQ(m.Start().exit_code, 0) << m.Describe();
    return m;
  }
  // Every node reads every file of `version` at the same time; each file must equal `source`'s.
  void ReadAllAtOnce(const std::vector<Mount*>& nodes, const std::string& version, const fs::path& source) {
    std::vector<std::future<std::string>> readers;
    for (Mount* n : nodes) {
      readers.push_back(std::async(std::launch::async, [n, &version, &source]() -> std::string {
        std::string wrong;
        for (const std::string& f : FilesUnder(source)) {
          if (Sha256sum(n->Dir(version) / f) != Sha256Of(source / f)) wrong += " " + f;
        }
        return wrong;
      }));
    }
    for (size_t k = 0; k < readers.size(); ++k) EXPECT_EQ(readers[k].get(), "") << "node " << k << ", " << version;
  }
  uint64_t OriginBytes() { return Proxy().Stats()["sent_bytes_GET"]; }
  static uint64_t Shared(const Mount& m, const char* what) {
    nlohmann::json s = m.Stats();
    return s.is_object() && s.contains("shared_cache") ? s["shared_cache"].value(what, uint64_t{0}) : 0;
  }

  std::string origin_, tier_, tier_options_, env_;
  uint64_t stored_ = 0;
  std::unique_ptr<S3rverServer> s3_;
  std::unique_ptr<S3PreconditionProxy> s3_proxy_;
  std::unique_ptr<FaultProxy> tier_proxy_;
};

TEST_P(SharedCacheTest, FourNodesFollowingARunCostTheOriginOneCopy) {
  std::vector<Mount*> nodes;
  for (int k = 0; k < 4; ++k) nodes.push_back(&Node("node" + std::to_string(k), tier_));
  const uint64_t before = OriginBytes();
  ReadAllAtOnce(nodes, "m/x@v0", Source(0));
  const uint64_t after_v0 = OriginBytes();
  ReadAllAtOnce(nodes, "m/x@v1", Source(1));
  const uint64_t origin = OriginBytes() - before;
  uint64_t fills = 0, hits = 0, received = 0;
  std::string per_node;  // what each node did, for a failure's message
  for (Mount* n : nodes) {
    fills += Shared(*n, "fills");
    hits += Shared(*n, "hits");
    received += n->BytesReceived();
    per_node += "\n  " + n->mnt().filename().string() + ": fills " + std::to_string(Shared(*n, "fills")) + ", hits " +
                std::to_string(Shared(*n, "hits")) + ", waits " + std::to_string(Shared(*n, "waits")) + ", errors " +
                std::to_string(Shared(*n, "errors")) + ", bypassed " + std::to_string(Shared(*n, "bypassed")) +
                ", from the bucket " + std::to_string(n->BytesReceived());
    if (Shared(*n, "errors") > 0) {  // its log's words about the tier
      std::istringstream log(SlurpText(n->mnt().parent_path() / "log.txt"));
      for (std::string line; std::getline(log, line);) {
        if (line.find("shared cache") != std::string::npos) per_node += "\n    " + line.substr(0, 400);
      }
    }
    EXPECT_EQ(Shared(*n, "corrupt"), 0u);
    EXPECT_EQ(Shared(*n, "wait_timeouts"), 0u);
  }
  std::printf("stored %llu bytes; origin served %llu (v0 %llu, v1 %llu) = %.3fx stored to 4 nodes; "
              "the nodes counted %llu from the bucket; tier fills %llu, hits %llu\n",
              (unsigned long long)stored_, (unsigned long long)origin, (unsigned long long)(after_v0 - before),
              (unsigned long long)(origin - (after_v0 - before)), double(origin) / double(stored_),
              (unsigned long long)received, (unsigned long long)fills, (unsigned long long)hits);
  EXPECT_LE(origin, stored_ + stored_ / 10) << "the origin served more than 1.1x the stored bytes to 4 nodes:" << per_node;
  EXPECT_GT(hits, 0u);
  EXPECT_GT(fills, 0u);
  // The same counts for Prometheus.
  Result prometheus = Cli("status " + nodes[0]->mnt().string() + " --prometheus");
  EXPECT_EQ(prometheus.exit_code, 0) << prometheus.out;
  EXPECT_NE(prometheus.out.find("weightfs_shared_cache_hits_total "), std::string::npos) << prometheus.out;
  EXPECT_NE(prometheus.out.find("weightfs_shared_cache_filled_bytes_total "), std::string::npos) << prometheus.out;
}

INSTANTIATE_TEST_SUITE_P(Tiers, SharedCacheTest, ::testing::Values("webdav", "s3"));

// A WebDAV tier behind a proxy that can take it down; its files on disk can be damaged.
using SharedCacheFaultTest = SharedCacheTest;

TEST_P(SharedCacheFaultTest, ATierCorruptedEmptiedOrDownCostsSpeedNeverAWrongByte) {
  tier_proxy_ = std::make_unique<FaultProxy>();
  ASSERT_TRUE(tier_proxy_->Start(Nginx().url(), FaultProxy::Options{}));
  const std::string tier = tier_proxy_->url() + "/tier";
  const fs::path tier_dir = Nginx().root() + "/tier";
  // Node a fills the tier.
  Mount& a = Node("a", tier);
  ReadAllAtOnce({&a}, "m/x@v0", Source(0));
  ReadAllAtOnce({&a}, "m/x@v1", Source(1));
  ASSERT_GT(Shared(a, "fills"), 0u);

  // Damaged: a byte of every tier object near its end (in its data) flipped.
  int damaged = 0;
  for (const auto& e : fs::recursive_directory_iterator(tier_dir)) {
    if (!e.is_regular_file() || e.file_size() < 200) continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(e.file_size() - 100));
    char c = 0;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(static_cast<std::streamoff>(e.file_size() - 100));
    f.write(&c, 1);
    ++damaged;
  }
  ASSERT_GT(damaged, 0);
  Mount& b = Node("b", tier);
  ReadAllAtOnce({&b}, "m/x@v0", Source(0));
  ReadAllAtOnce({&b}, "m/x@v1", Source(1));
  EXPECT_GT(Shared(b, "corrupt"), 0u);

  // Emptied while a node reads.
  Mount& c = Node("c", tier);
  auto reading = std::async(std::launch::async, [&] { ReadAllAtOnce({&c}, "m/x@v0", Source(0)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (const auto& e : fs::directory_iterator(tier_dir)) fs::remove_all(e.path());
  reading.get();
  ReadAllAtOnce({&c}, "m/x@v1", Source(1));

  // Down: every tier request answered 503.
  tier_proxy_->SetMode("down");
  Mount& d = Node("d", tier);
  ReadAllAtOnce({&d}, "m/x@v0", Source(0));
  ReadAllAtOnce({&d}, "m/x@v1", Source(1));
  EXPECT_GT(Shared(d, "errors"), 0u);
  tier_proxy_->SetMode("normal");
}

INSTANTIATE_TEST_SUITE_P(Tiers, SharedCacheFaultTest, ::testing::Values("webdav"));

}  // namespace
}  // namespace weightfs::test
