// The metrics of a real mount (`weightfs status --json`, `--prometheus`, `mount --metrics FILE`)
// move as reads go: a cold read of a version at the end of a delta chain builds every chunk from
// fetched payloads (depth 3: keyframe and two deltas), and a second mount on the same cache
// directory serves every chunk from the disk cache, fetching nothing. `--metrics-port` serves the
// same text over HTTP while the mount serves.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

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
  // (Whole files off: a file read whole would be read from its local copy by the kernel, and these
  // counters are the daemon's.)
  Mount& a = NewMount("a", "--no-whole-files --metrics " + prom.string() + " --metrics-interval 0.05");
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
  Mount& b = NewMount("b", "--no-whole-files", "", a.cache());
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

TEST_F(MetricsTest, DraftAndUploadCountersMoveWithWritesAndCommits) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Mount& a = NewMount("a");
  ASSERT_EQ(a.Start().exit_code, 0) << a.Describe();
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  uint64_t written = 0;
  for (const std::string& f : FilesUnder(Source(1))) {
    Result cp = Shell("cp " + (Source(1) / f).string() + " " + a.Dir("m/x@v1").string() + "/");
    ASSERT_EQ(cp.exit_code, 0) << cp.out;
    written += fs::file_size(Source(1) / f);
  }
  Json before = Metrics(a);
  EXPECT_EQ(before["drafts"]["open"], 1) << before.dump();
  EXPECT_EQ(before["drafts"]["versions_published"], 0) << before.dump();
  Result c = a.Commit("m/x@v1");
  ASSERT_EQ(c.exit_code, 0) << c.out;
  Json after = Metrics(a);
  EXPECT_EQ(after["drafts"]["open"], 0) << after.dump();
  EXPECT_EQ(after["drafts"]["pending_files"], 0) << after.dump();
  EXPECT_EQ(after["drafts"]["versions_published"], 1) << after.dump();
  EXPECT_EQ(after["drafts"]["commit_failures"], 0) << after.dump();
  EXPECT_GE(after["drafts"]["files_encoded"].get<uint64_t>(), 1u) << after.dump();
  EXPECT_GT(after["drafts"]["bytes_encoded"].get<uint64_t>(), 0u) << after.dump();
  EXPECT_LE(after["drafts"]["bytes_encoded"].get<uint64_t>(), written) << after.dump();
  EXPECT_GT(after["drafts"]["bytes_stored"].get<uint64_t>(), 0u) << after.dump();
  EXPECT_LT(after["drafts"]["bytes_stored"].get<uint64_t>(), after["drafts"]["bytes_encoded"].get<uint64_t>());
  Result prometheus = Cli("status " + a.mnt().string() + " --prometheus");
  EXPECT_NE(prometheus.out.find("weightfs_versions_published_total{mountpoint=\"" + a.mnt().string() + "\"} 1\n"),
            std::string::npos)
      << prometheus.out;
  EXPECT_NE(prometheus.out.find("weightfs_uploaded_bytes_total{"), std::string::npos) << prometheus.out;
  ExpectSameFiles(a.Dir("m/x@v1"), Source(1));
}

// A port nothing listens on now (bound, read, closed).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) return -1;
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

// GET http://127.0.0.1:PORT`path`: the whole reply (status line, headers, body), or "" if
// nothing answers.
std::string HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (fd >= 0) ::close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.1\r\nHost: localhost\r\n\r\n";
  (void)!::write(fd, request.data(), request.size());
  std::string reply;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) reply.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return reply;
}

TEST_F(MetricsTest, APrometheusEndpointServesTheMetricsWhileTheMountServes) {
  Generate("1M", 1);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const fs::path prom = root_ / "a.prom";
  Mount& a = NewMount("a", "--metrics-port " + std::to_string(port) + " --metrics " + prom.string());
  ASSERT_EQ(a.Start().exit_code, 0) << a.Describe();
  ExpectSameFiles(a.Dir("m/x@v0"), Source(0));
  const std::string labels = "{mountpoint=\"" + a.mnt().string() + "\"}";
  const std::string reply = HttpGet(port, "/metrics");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << reply;
  EXPECT_NE(reply.find("Content-Type: text/plain; version=0.0.4"), std::string::npos) << reply;
  EXPECT_NE(reply.find("\nweightfs_up" + labels + " 1\n"), std::string::npos) << reply;
  EXPECT_NE(reply.find("\n# TYPE weightfs_read_bytes_total counter\n"), std::string::npos) << reply;
  EXPECT_EQ(HttpGet(port, "/elsewhere").rfind("HTTP/1.1 404", 0), 0u);
  // The port is taken: a second mount says so and does not start.
  Mount& b = NewMount("b", "--metrics-port " + std::to_string(port));
  const Result refused = b.Start();
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("in use"), std::string::npos) << refused.out;
  ASSERT_EQ(a.Unmount().exit_code, 0);
  EXPECT_EQ(HttpGet(port, "/metrics"), "");  // gone with the mount
  EXPECT_NE(SlurpText(prom).find("weightfs_up" + labels + " 0\n"), std::string::npos) << SlurpText(prom);
}

}  // namespace
}  // namespace weightfs
