// The metrics of a real mount (`weightfs status --json`, `--prometheus`, `mount --metrics FILE`)
// move as reads go: a cold read of a version at the end of a delta chain builds every chunk from
// fetched payloads (depth 3: keyframe and two deltas), and a second mount on the same cache
// directory serves every chunk from the disk cache, fetching nothing.
#include <string>

#include <gtest/gtest.h>

#include "tests/fs/draft_mount.h"

namespace weightfs {
namespace {

using namespace weightfs::test;

class MetricsTest : public DraftMountTest {
 protected:
  // The metrics section of `weightfs status MNT --json`.
  static Json Metrics(const Mount& m) {
    Json st = m.Status();
    EXPECT_TRUE(st.is_object() && st.contains("metrics")) << st.dump();
    return st.is_object() && st.contains("metrics") ? st["metrics"] : Json::object();
  }
  // Reads every file of m/x@v2 through `m` and checks it against the source by SHA-256.
  void ReadV2(const Mount& m) { ExpectSameFiles(m.Dir("m/x@v2"), Source(2)); }
  uint64_t V2Bytes() const {
    uint64_t n = 0;
    for (const std::string& f : FilesUnder(Source(2))) n += fs::file_size(Source(2) / f);
    return n;
  }
};

TEST_F(MetricsTest, BytesFetchedMaterializedAndCacheHitsMoveWithReads) {
  Generate("1M", 2);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  for (int k : {1, 2}) {
    Result p = Cli("push " + bucket_ + " m/x@v" + std::to_string(k) + " " + Source(k).string() + " --no-cache");
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  const fs::path prom = root_ / "a.prom";
  Mount& a = NewMount("a", "--metrics " + prom.string() + " --metrics-interval 0.05");
  ASSERT_EQ(a.Start().exit_code, 0) << a.Describe();
  Json before = Metrics(a);
  EXPECT_EQ(before["materializer"]["builds"], 0) << before.dump();
  EXPECT_EQ(before["materializer"]["payload_bytes"], 0) << before.dump();

  // Cold: every chunk built once from the bucket, the newest through the whole chain.
  ReadV2(a);
  Json cold = Metrics(a);
  const uint64_t chunks = cold["materializer"]["chunks"].get<uint64_t>();
  EXPECT_GT(chunks, 0u);
  EXPECT_EQ(cold["materializer"]["builds"], chunks) << cold.dump();
  EXPECT_EQ(cold["materializer"]["built_bytes"], V2Bytes()) << cold.dump();
  EXPECT_GT(cold["materializer"]["payload_bytes"].get<uint64_t>(), 0u) << cold.dump();
  EXPECT_EQ(cold["materializer"]["chain_depth_max"], 3) << cold.dump();
  EXPECT_GE(cold["rates"]["mean_chain_depth"].get<double>(), 1.0);
  EXPECT_LE(cold["rates"]["mean_chain_depth"].get<double>(), 3.0);
  EXPECT_GT(cold["materializer"]["decode_seconds"].get<double>(), 0.0);
  EXPECT_LE(cold["materializer"]["decode_seconds"].get<double>(), cold["materializer"]["build_seconds"].get<double>());
  // Hits only where two reads of the kernel fell in one chunk (memory): none from the disk.
  EXPECT_EQ(cold["materializer"]["cache_hits"], 0) << cold.dump();
  EXPECT_LT(cold["rates"]["cache_hit_ratio"].get<double>(), 0.5) << cold.dump();
  EXPECT_EQ(cold["reader"]["builds_running"], 0);
  EXPECT_EQ(cold["drafts"]["queued_encodes"], 0);
  // The metrics file catches up within a few of its intervals.
  const std::string line = "weightfs_materialized_bytes_total{mountpoint=\"" + a.mnt().string() + "\"} " +
                           std::to_string(V2Bytes()) + "\n";
  EXPECT_TRUE(WaitFor([&] { return SlurpText(prom).find(line) != std::string::npos; }, 10s)) << SlurpText(prom);
  EXPECT_NE(SlurpText(prom).find("# TYPE weightfs_fetched_bytes_total counter\n"), std::string::npos);
  ASSERT_EQ(a.Unmount().exit_code, 0);

  // Warm: a new mount on the same cache directory fetches nothing and builds nothing.
  Mount& b = NewMount("b", "", "", a.cache());
  ASSERT_EQ(b.Start().exit_code, 0) << b.Describe();
  ReadV2(b);
  Json warm = Metrics(b);
  EXPECT_EQ(warm["materializer"]["chunks"], chunks) << warm.dump();
  EXPECT_EQ(warm["materializer"]["cache_hits"], chunks) << warm.dump();
  EXPECT_EQ(warm["materializer"]["builds"], 0) << warm.dump();
  EXPECT_EQ(warm["materializer"]["payload_bytes"], 0) << warm.dump();
  EXPECT_EQ(warm["rates"]["cache_hit_ratio"], 1.0) << warm.dump();
  Result prometheus = Cli("status " + b.mnt().string() + " --prometheus");
  ASSERT_EQ(prometheus.exit_code, 0) << prometheus.out;
  EXPECT_NE(prometheus.out.find("weightfs_disk_cache_hits_total{mountpoint=\"" + b.mnt().string() + "\"} " +
                                std::to_string(chunks) + "\n"),
            std::string::npos)
      << prometheus.out;
  Result text = Cli("status " + b.mnt().string());
  EXPECT_NE(text.out.find("from memory or disk cache 100.0%, built 0"), std::string::npos) << text.out;
}

}  // namespace
}  // namespace weightfs
