// Many nodes, one version (docs/parts.md) through real mounts: each "node" is a mount of the same
// bucket with its own cache directory; each writes its own shards into a draft of one version
// and runs `weightfs commit --parts N`. Local, WebDAV (nginx) and S3 (s3rver behind a proxy that
// honours If-None-Match) buckets; conflicts (on a parent's file and on a new one), timeouts, a
// discard from another node, the DCP file pattern, `push --parts` run again after the publish,
// and a node's daemon killed at random points of its part (while it writes, before and during
// its commit).
#include <signal.h>

#include <algorithm>
#include <future>
#include <random>
#include <set>

#include "tests/fs/draft_mount.h"
#include "tests/testing/s3_test_server.h"

namespace weightfs::test {
namespace {

constexpr const char* kS3Env = "env AWS_ACCESS_KEY_ID=S3RVER AWS_SECRET_ACCESS_KEY=S3RVER AWS_REGION=us-east-1 ";

class PartsMountTest : public DraftMountTest {
 protected:
  void SetUp() override {
    DraftMountTest::SetUp();
    // ~10 MB a version in 18 shards (+ config.json and the index, the same in every version).
    Generate("5M", 20, "--shard-size 400K");
    for (const auto& e : fs::directory_iterator(Source(1))) {
      if (e.path().extension() == ".safetensors") shards_.push_back(e.path().filename().string());
    }
    std::sort(shards_.begin(), shards_.end());
    ASSERT_GE(shards_.size(), 16u);
  }

  // Starts the bucket's server for `kind` ("local", "webdav", "s3"); sets bucket_, mount_extra_
  // and env_.
  void StartBucket(const std::string& kind) {
    if (kind == "webdav") {
      ASSERT_TRUE(Nginx().Start());
      bucket_ = Nginx().url() + "/bucket";
    } else if (kind == "s3") {
      s3_ = std::make_unique<S3rverServer>("parts");
      ASSERT_TRUE(s3_->Start());
      s3_proxy_ = std::make_unique<S3PreconditionProxy>();
      ASSERT_TRUE(s3_proxy_->Start(s3_->endpoint()));
      bucket_ = "s3://parts/run";
      mount_extra_ = "--endpoint " + s3_proxy_->endpoint();
      env_ = kS3Env;
    }
  }
  // A CLI command on the bucket, with its options (S3: endpoint and credentials).
  Result BucketCli(const std::string& command, const std::string& rest = "") {
    return Cli(command + " " + bucket_ + " " + rest + " " + mount_extra_, 180, env_);
  }
  void InitBase() {
    Result i = BucketCli("init");
    ASSERT_EQ(i.exit_code, 0) << i.out;
    Result p = BucketCli("push", "m/x@v0 " + Source(0).string() + " --no-cache");
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  Mount& Node(const std::string& name) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    MountOptions o;
    o.extra = mount_extra_;
    o.env = env_;
    mounts_.push_back(std::make_unique<Mount>(bucket_, dir, o));
    Mount& m = *mounts_.back();
    EXPECT_EQ(m.Start().exit_code, 0) << m.Describe();
    return m;
  }
  // Copies shard files (by index) of GEN/v<k> into the draft at `draft`.
  void CopyShards(const fs::path& draft, int k, const std::vector<size_t>& which) {
    for (size_t i : which) {
      Result cp = Shell("cp " + (Source(k) / shards_[i]).string() + " " + draft.string() + "/");
      ASSERT_EQ(cp.exit_code, 0) << cp.out;
    }
  }
  // Published versions of m/x (not staged ones).
  std::set<std::string> Published() {
    std::set<std::string> out;
    Json log = CliJson("log " + bucket_ + " m/x --json " + mount_extra_, env_);
    EXPECT_TRUE(log.is_array()) << log.dump();
    if (!log.is_array()) return out;
    for (const Json& v : log) {
      if (!v.value("staged", false)) out.insert(v.value("version", ""));
    }
    return out;
  }
  // A directory holding version k's files where `from_k` says which shards are new (else v<base>).
  fs::path Expected(const std::string& name, int base, const std::map<size_t, int>& from_k) {
    const fs::path dir = root_ / ("expect-" + name);
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(Source(base))) fs::copy_file(e.path(), dir / e.path().filename());
    for (const auto& [i, k] : from_k) {
      fs::copy_file(Source(k) / shards_[i], dir / shards_[i], fs::copy_options::overwrite_existing);
    }
    return dir;
  }

  std::vector<std::string> shards_;
  std::string mount_extra_, env_;
  std::unique_ptr<S3rverServer> s3_;
  std::unique_ptr<S3PreconditionProxy> s3_proxy_;
};

// ---- four nodes, each a quarter, on every kind of bucket ---------------------------------------

class PartsOnBucketTest : public PartsMountTest, public ::testing::WithParamInterface<std::string> {
 protected:
  void TearDown() override {
    mounts_.clear();
    s3_proxy_.reset();
    s3_.reset();
    PartsMountTest::TearDown();
  }
};

TEST_P(PartsOnBucketTest, FourMountsEachWriteAQuarterAndPublishOnce) {
  StartBucket(GetParam());
  InitBase();
  // Every shard changes in the step (so a parent's old shard in v1 cannot pass for a new one).
  for (const std::string& s : shards_) ASSERT_NE(Sha256Of(Source(1) / s), Sha256Of(Source(0) / s)) << s;
  std::vector<Mount*> nodes;
  for (int k = 0; k < 4; ++k) nodes.push_back(&Node("node" + std::to_string(k)));
  std::map<size_t, int> fresh;
  for (int k = 0; k < 4; ++k) {
    ASSERT_EQ(::mkdir(nodes[k]->Dir("m/x@v1").c_str(), 0755), 0) << std::strerror(errno);
    std::vector<size_t> mine;
    for (size_t i = static_cast<size_t>(k); i < shards_.size(); i += 4) mine.push_back(i), fresh[i] = 1;
    CopyShards(nodes[k]->Dir("m/x@v1"), 1, mine);
  }
  std::vector<std::future<Result>> commits;
  for (int k = 0; k < 4; ++k) {
    commits.push_back(std::async(std::launch::async, [&, k] {
      return nodes[k]->Commit("m/x@v1", "--parts 4 --part rank" + std::to_string(k) + " --timeout 120");
    }));
  }
  for (int k = 0; k < 4; ++k) {
    Result r = commits[k].get();
    EXPECT_EQ(r.exit_code, 0) << "node " << k << ": " << r.out << nodes[k]->Describe();
  }
  EXPECT_EQ(Published().count("v1"), 1u);
  // Every node's mount shows the version, and a fresh mount reads it all bit-exact.
  for (Mount* n : nodes) EXPECT_TRUE(fs::is_directory(n->Dir("m/x@v1")));
  MountOptions o;
  o.extra = mount_extra_;
  o.env = env_;
  Mount fresh_mount(bucket_, root_ / "fresh", o);
  ASSERT_EQ(fresh_mount.Start().exit_code, 0) << fresh_mount.Describe();
  ExpectSameFiles(fresh_mount.Dir("m/x@v1"), Source(1));
  // Stored bytes are the deltas of all shards: far below the files.
  Json log = CliJson("log " + bucket_ + " m/x --json " + mount_extra_, env_);
  int v1_entries = 0;
  for (const Json& v : log) {
    if (v.value("version", "") == "v1") {
      ++v1_entries;
      EXPECT_FALSE(v.value("staged", false)) << v.dump();
      EXPECT_LT(v.value("stored_bytes", uint64_t{0}) * 10, v.value("logical_bytes", uint64_t{0})) << v.dump();
      EXPECT_EQ(v.value("parent", ""), "v0");
    }
  }
  EXPECT_EQ(v1_entries, 1) << log.dump();
}

INSTANTIATE_TEST_SUITE_P(Buckets, PartsOnBucketTest, ::testing::Values("local", "webdav", "s3"));

// ---- the issue's two-node repro, and the ways a set of parts goes wrong -------------------------

TEST_F(PartsMountTest, TwoNodeReproPublishesBothNewShards) {
  InitBase();
  Mount& a = Node("a");
  Mount& b = Node("b");
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@v1").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v1"), 1, {0});
  CopyShards(b.Dir("m/x@v1"), 1, {1});
  ASSERT_NE(Sha256Of(Source(1) / shards_[1]), Sha256Of(Source(0) / shards_[1]));  // (the parent's old shard 2 fails)
  auto ca = std::async(std::launch::async, [&] { return a.Commit("m/x@v1", "--parts 2 --timeout 120"); });
  Result rb = b.Commit("m/x@v1", "--parts 2 --timeout 120");
  Result ra = ca.get();
  EXPECT_EQ(ra.exit_code, 0) << ra.out;
  EXPECT_EQ(rb.exit_code, 0) << rb.out;
  ExpectFreshMountReads({{"m/x@v1", Expected("v1", 0, {{0, 1}, {1, 1}})}});
  // A plain (one-node) commit of a name others stage in parts is refused, not published.
  ASSERT_EQ(::mkdir(a.Dir("m/x@v2").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@v2").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v2"), 2, {0});
  CopyShards(b.Dir("m/x@v2"), 2, {1});
  Result staged = a.Commit("m/x@v2", "--parts 2 --no-wait");
  EXPECT_EQ(staged.exit_code, 0) << staged.out;
  Result plain = b.Commit("m/x@v2");
  EXPECT_NE(plain.exit_code, 0) << plain.out;
  EXPECT_NE(plain.out.find("--parts"), std::string::npos) << plain.out;
  EXPECT_EQ(Published().count("v2"), 0u);
  Result part = b.Commit("m/x@v2", "--parts 2 --timeout 60");
  EXPECT_EQ(part.exit_code, 0) << part.out;
  ExpectFreshMountReads({{"m/x@v2", Expected("v2", 0, {{0, 2}, {1, 2}})}});
}

TEST_F(PartsMountTest, TwoPartsWritingOneFileAreRefusedAndKeepTheirData) {
  InitBase();
  Mount& a = Node("a");
  Mount& b = Node("b");
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@v1").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v1"), 1, {3});
  CopyShards(b.Dir("m/x@v1"), 2, {3, 4});  // shard 3 too, from another step
  auto ca = std::async(std::launch::async, [&] { return a.Commit("m/x@v1", "--parts 2 --part a --timeout 120"); });
  Result rb = b.Commit("m/x@v1", "--parts 2 --part b --timeout 120");
  Result ra = ca.get();
  for (const Result* r : {&ra, &rb}) {
    EXPECT_EQ(r->exit_code, 1) << r->out;
    EXPECT_NE(r->out.find(shards_[3]), std::string::npos) << r->out;
    EXPECT_NE(r->out.find("part a"), std::string::npos) << r->out;
    EXPECT_NE(r->out.find("part b"), std::string::npos) << r->out;
  }
  EXPECT_EQ(Published().count("v1"), 0u);
  // Both drafts keep their data.
  EXPECT_EQ(Sha256sum(a.Dir("m/x@v1") / shards_[3]), Sha256Of(Source(1) / shards_[3]));
  EXPECT_EQ(Sha256sum(b.Dir("m/x@v1") / shards_[3]), Sha256Of(Source(2) / shards_[3]));
  // Unlinking shard 3 in b's draft is a removal of the parent's file: still a conflict.
  ASSERT_EQ(::unlink((b.Dir("m/x@v1") / shards_[3]).c_str()), 0) << std::strerror(errno);
  Result removal = b.Commit("m/x@v1", "--parts 2 --part b --timeout 60");
  EXPECT_EQ(removal.exit_code, 1) << removal.out;
  EXPECT_NE(removal.out.find("removed by part b"), std::string::npos) << removal.out;
  EXPECT_EQ(Published().count("v1"), 0u);
  // As the message says: b discards (every part goes), writes again without shard 3, and
  // both commit again.
  Result d = Cli("discard " + b.Dir("m/x@v1").string());
  EXPECT_EQ(d.exit_code, 0) << d.out;
  ASSERT_EQ(::mkdir(b.Dir("m/x@v1").c_str(), 0755), 0) << std::strerror(errno);
  CopyShards(b.Dir("m/x@v1"), 2, {4});
  auto a_again = std::async(std::launch::async, [&] { return a.Commit("m/x@v1", "--parts 2 --part a --timeout 60"); });
  Result b_again = b.Commit("m/x@v1", "--parts 2 --part b --timeout 60");
  EXPECT_EQ(b_again.exit_code, 0) << b_again.out;
  Result ra2 = a_again.get();
  EXPECT_EQ(ra2.exit_code, 0) << ra2.out;
  ExpectFreshMountReads({{"m/x@v1", Expected("v1", 0, {{3, 1}, {4, 2}})}});
}

// Two parts write the same NEW path (the parent has none): refused, every part's data kept; the
// node that should not have written it removes it (no removal of a parent file, so no conflict
// left) and commits again, then the other node does: published, with the keeper's file. (In this
// order: a part re-committed while the other's stale record still writes the path is refused
// again, rightly, at that moment.)
TEST_F(PartsMountTest, TwoPartsWritingOneNewFileGoOnOnceOneRemovesIt) {
  InitBase();
  Mount& a = Node("a");
  Mount& b = Node("b");
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@v1").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v1"), 1, {7});
  CopyShards(b.Dir("m/x@v1"), 1, {8});
  const fs::path extra_a = root_ / "extra-a.bin", extra_b = root_ / "extra-b.bin";
  WriteFile(extra_a, RandomBytes(200000, 11));
  WriteFile(extra_b, RandomBytes(150000, 12));
  ASSERT_EQ(Shell("cp " + extra_a.string() + " " + (a.Dir("m/x@v1") / "extra.bin").string()).exit_code, 0);
  ASSERT_EQ(Shell("cp " + extra_b.string() + " " + (b.Dir("m/x@v1") / "extra.bin").string()).exit_code, 0);
  auto ca = std::async(std::launch::async, [&] { return a.Commit("m/x@v1", "--parts 2 --part a --timeout 120"); });
  Result rb = b.Commit("m/x@v1", "--parts 2 --part b --timeout 120");
  Result ra = ca.get();
  for (const Result* r : {&ra, &rb}) {
    EXPECT_EQ(r->exit_code, 1) << r->out;
    EXPECT_NE(r->out.find("extra.bin"), std::string::npos) << r->out;
    EXPECT_NE(r->out.find("part a"), std::string::npos) << r->out;
    EXPECT_NE(r->out.find("part b"), std::string::npos) << r->out;
  }
  EXPECT_EQ(Published().count("v1"), 0u);
  EXPECT_EQ(Sha256sum(a.Dir("m/x@v1") / "extra.bin"), Sha256Of(extra_a));
  EXPECT_EQ(Sha256sum(b.Dir("m/x@v1") / "extra.bin"), Sha256Of(extra_b));
  EXPECT_EQ(Sha256sum(b.Dir("m/x@v1") / shards_[8]), Sha256Of(Source(1) / shards_[8]));
  ASSERT_EQ(::unlink((b.Dir("m/x@v1") / "extra.bin").c_str()), 0) << std::strerror(errno);
  Result b_again = b.Commit("m/x@v1", "--parts 2 --part b --timeout 60");
  EXPECT_EQ(b_again.exit_code, 0) << b_again.out;
  Result a_again = a.Commit("m/x@v1", "--parts 2 --part a --timeout 60");
  EXPECT_EQ(a_again.exit_code, 0) << a_again.out;
  const fs::path want = Expected("v1", 0, {{7, 1}, {8, 1}});
  fs::copy_file(extra_a, want / "extra.bin");
  ExpectFreshMountReads({{"m/x@v1", want}});
}

// `weightfs push --parts` run again once the version is published (a job's retry): 0 when the
// version holds this part exactly, 1 naming the file when it holds another. (It encoded against
// the model's latest, the version itself, and died with SIGSEGV in VersionEncoder::Finish.)
TEST_F(PartsMountTest, PushPartAgainAfterThePublishIsCheckedAgainstIt) {
  InitBase();
  const fs::path da = root_ / "push-a", db = root_ / "push-b", dc = root_ / "push-a-other";
  for (const fs::path& d : {da, db, dc}) fs::create_directories(d);
  CopyShards(da, 1, {0});
  CopyShards(db, 1, {1});
  CopyShards(dc, 2, {0});
  Result a = BucketCli("push", "m/x@v1 " + da.string() + " --parts 2 --part a --no-wait --no-cache");
  EXPECT_EQ(a.exit_code, 0) << a.out;
  Result b = BucketCli("push", "m/x@v1 " + db.string() + " --parts 2 --part b --timeout 60 --no-cache");
  EXPECT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(Published().count("v1"), 1u);
  Result again = BucketCli("push", "m/x@v1 " + da.string() + " --parts 2 --part a --timeout 60 --no-cache");
  EXPECT_EQ(again.exit_code, 0) << again.out;
  Result other = BucketCli("push", "m/x@v1 " + dc.string() + " --parts 2 --part a --timeout 60 --no-cache");
  EXPECT_EQ(other.exit_code, 1) << other.out;
  EXPECT_NE(other.out.find(shards_[0]), std::string::npos) << other.out;
  Result log = BucketCli("log", "m/x");
  EXPECT_EQ(log.out.find("staged"), std::string::npos) << log.out;
  ExpectFreshMountReads({{"m/x@v1", Expected("v1", 0, {{0, 1}, {1, 1}})}});
}

TEST_F(PartsMountTest, ATimedOutPartStaysStagedAndRunningAgainGoesOn) {
  InitBase();
  Mount& a = Node("a");
  Mount& b = Node("b");
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@v1").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v1"), 1, {5});
  CopyShards(b.Dir("m/x@v1"), 1, {6});
  Result timed_out = a.Commit("m/x@v1", "--parts 2 --part rank0 --timeout 1");
  EXPECT_EQ(timed_out.exit_code, 124) << timed_out.out;
  EXPECT_NE(timed_out.out.find("1 of 2"), std::string::npos) << timed_out.out;
  EXPECT_EQ(Published().count("v1"), 0u);
  // Operators see who is in and who is late.
  Result status = Cli("status " + a.mnt().string());
  EXPECT_NE(status.out.find("staged m/x@v1"), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("1 of 2 parts in"), std::string::npos) << status.out;
  EXPECT_NE(status.out.find("part rank0"), std::string::npos) << status.out;
  Result log = BucketCli("log", "m/x");
  EXPECT_NE(log.out.find("staged m/x@v1"), std::string::npos) << log.out;
  EXPECT_NE(log.out.find("1 of 2 parts in"), std::string::npos) << log.out;
  EXPECT_NE(log.out.find("part rank0"), std::string::npos) << log.out;
  Result rb = b.Commit("m/x@v1", "--parts 2 --part rank1 --timeout 60");
  EXPECT_EQ(rb.exit_code, 0) << rb.out;
  Result ra = a.Commit("m/x@v1", "--parts 2 --timeout 60");  // its id is in its journal
  EXPECT_EQ(ra.exit_code, 0) << ra.out;
  ExpectFreshMountReads({{"m/x@v1", Expected("v1", 0, {{5, 1}, {6, 1}})}});
}

TEST_F(PartsMountTest, DiscardFromAnyNodeStopsTheWaiters) {
  InitBase();
  Mount& a = Node("a");
  Mount& c = Node("c");  // a node with no draft of the version
  ASSERT_EQ(::mkdir(a.Dir("m/x@v1").c_str(), 0755), 0);
  CopyShards(a.Dir("m/x@v1"), 1, {0});
  auto waiting = std::async(std::launch::async, [&] { return a.Commit("m/x@v1", "--parts 2 --timeout 120"); });
  ASSERT_TRUE(WaitFor([&] { return a.DraftStatus("m/x@v1").value("parts_in", 0) == 1; }, 60s))
      << a.DraftStatus("m/x@v1").dump();
  Result d = Cli("discard " + c.Dir("m/x@v1").string());
  EXPECT_EQ(d.exit_code, 0) << d.out;
  Result r = waiting.get();
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("discard"), std::string::npos) << r.out;
  EXPECT_EQ(Published().count("v1"), 0u);
  Result log = BucketCli("log", "m/x");
  EXPECT_EQ(log.out.find("staged"), std::string::npos) << log.out;
}

// torch.distributed.checkpoint's pattern: every rank writes __RANK_0.distcp, rank 0 also
// .metadata.tmp and renames it to .metadata; each rank commits its part.
TEST_F(PartsMountTest, DcpPatternPublishesEveryRanksFiles) {
  InitBase();
  Mount& a = Node("rank0");
  Mount& b = Node("rank1");
  ASSERT_EQ(::mkdir(a.Dir("m/x@dcp").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir(b.Dir("m/x@dcp").c_str(), 0755), 0);
  const fs::path want = root_ / "dcp";
  fs::create_directories(want);
  for (const auto& e : fs::directory_iterator(Source(0))) fs::copy_file(e.path(), want / e.path().filename());
  WriteFile(want / "__0_0.distcp", RandomBytes(300000, 1));
  WriteFile(want / "__1_0.distcp", RandomBytes(300000, 2));
  WriteFile(want / ".metadata", RandomBytes(5000, 3));
  ASSERT_EQ(Shell("cp " + (want / "__0_0.distcp").string() + " " + a.Dir("m/x@dcp").string() + "/").exit_code, 0);
  ASSERT_EQ(Shell("cp " + (want / "__1_0.distcp").string() + " " + b.Dir("m/x@dcp").string() + "/").exit_code, 0);
  ASSERT_EQ(Shell("cp " + (want / ".metadata").string() + " " + (a.Dir("m/x@dcp") / ".metadata.tmp").string()).exit_code, 0);
  ASSERT_EQ(::rename((a.Dir("m/x@dcp") / ".metadata.tmp").c_str(), (a.Dir("m/x@dcp") / ".metadata").c_str()), 0)
      << std::strerror(errno);
  auto ca = std::async(std::launch::async, [&] { return a.Commit("m/x@dcp", "--parts 2 --part 0 --timeout 120"); });
  Result rb = b.Commit("m/x@dcp", "--parts 2 --part 1 --timeout 120");
  Result ra = ca.get();
  EXPECT_EQ(ra.exit_code, 0) << ra.out;
  EXPECT_EQ(rb.exit_code, 0) << rb.out;
  ExpectFreshMountReads({{"m/x@dcp", want}});
}

// ---- a node killed at random points of its part -------------------------------------------------

// Node B's daemon is killed (SIGKILL) at a random moment: while it writes its shard, before its
// commit, or after its `commit --parts 2` starts (encoding, uploading, putting its record, or
// waiting). While B is down the version is never
// published partly: A's commit either completes the set with B's record (if it got in) or
// times out. B is mounted again (same cache directory); both commit; the version is published
// once, bit-exact. WEIGHTFS_PARTS_KILL_RUNS sets the runs (default 20).
TEST_F(PartsMountTest, KilledNodeResumesItsPartAndTheVersionIsNeverPartial) {
  InitBase();
  Mount& a = Node("a");
  Mount& b = Node("b");
  const char* runs_env = std::getenv("WEIGHTFS_PARTS_KILL_RUNS");
  const int runs = runs_env ? std::atoi(runs_env) : 20;
  const uint64_t seed = std::random_device{}();
  std::mt19937_64 rng(seed);
  SCOPED_TRACE("seed " + std::to_string(seed));
  int completed_by_a = 0, timed_out = 0;
  std::map<size_t, int> state;  // shard -> the generated version its bytes are from (else v0)
  struct Run {
    std::string v;
    size_t sa;
    int ka;
    size_t sb;
    int kb;
  };
  std::vector<Run> history;
  for (int run = 1; run <= runs && !HasFatalFailure(); ++run) {
    const std::string v = "k" + std::to_string(run);
    const std::string draft = "m/x@" + v;
    SCOPED_TRACE("run " + std::to_string(run));
    ASSERT_EQ(::mkdir(a.Dir(draft).c_str(), 0755), 0) << std::strerror(errno);
    ASSERT_EQ(::mkdir(b.Dir(draft).c_str(), 0755), 0) << std::strerror(errno) << b.Describe();
    // Each run writes two shards from a step of the generated run (new bytes every time).
    const size_t sa = rng() % shards_.size();
    const size_t sb = (sa + 1 + rng() % (shards_.size() - 1)) % shards_.size();
    const int ka = 1 + static_cast<int>(rng() % 20), kb = 1 + static_cast<int>(rng() % 20);
    // Killed while it writes its shard (it writes it again once it is back), before its commit
    // (its file written and closed), early in the commit (encoding, uploading), or anywhere in
    // it (its record in, waiting).
    const int when = static_cast<int>(rng() % 5);
    SCOPED_TRACE("kill point " + std::to_string(when));
    CopyShards(a.Dir(draft), ka, {sa});
    if (when == 4) {
      auto cp = std::async(std::launch::async, [&] {
        return Shell("cp " + (Source(kb) / shards_[sb]).string() + " " + b.Dir(draft).string() + "/");
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
      ASSERT_TRUE(b.Kill());
      (void)cp.get();  // (ENOTCONN, or 0 if it had finished)
    } else {
      CopyShards(b.Dir(draft), kb, {sb});
    }
    if (when == 0) {
      ASSERT_TRUE(b.Kill());
    } else if (when != 4) {
      auto cb = std::async(std::launch::async, [&] { return b.Commit(draft, "--parts 2 --timeout 60"); });
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % (when == 1 ? 60 : 400)));
      ASSERT_TRUE(b.Kill());
      (void)cb.get();  // (ENOTCONN, or 0 if it had finished; either way B's part is all it had)
    }
    EXPECT_EQ(Published().count(v), 0u) << "published with one of two parts";
    // A alone: completes the set if B's record got in, else times out; never half a version.
    Result ra = a.Commit(draft, "--parts 2 --timeout 1");
    ASSERT_TRUE(ra.exit_code == 0 || ra.exit_code == 124) << ra.out;
    if (ra.exit_code == 0) {
      ++completed_by_a;
    } else {
      ++timed_out;
      EXPECT_EQ(Published().count(v), 0u);
    }
    // B comes back; its journal resumes the part.
    UnmountIfMounted(b.mnt().string());
    ASSERT_EQ(b.Start().exit_code, 0) << b.Describe();
    if (when == 4) {
      ASSERT_TRUE(fs::is_directory(b.Dir(draft))) << b.Describe();
      CopyShards(b.Dir(draft), kb, {sb});
    }
    Result rb = b.Commit(draft, "--parts 2 --timeout 60");
    EXPECT_EQ(rb.exit_code, 0) << rb.out << b.Describe();
    if (ra.exit_code != 0) {
      ra = a.Commit(draft, "--parts 2 --timeout 60");
      EXPECT_EQ(ra.exit_code, 0) << ra.out;
    }
    state[sa] = ka;
    state[sb] = kb;
    history.push_back({v, sa, ka, sb, kb});
    // Bit-exact through A's mount: A's shard, B's (fetched from the bucket), and one inherited.
    ASSERT_TRUE(fs::is_directory(a.Dir(draft)));
    EXPECT_EQ(Sha256sum(a.Dir(draft) / shards_[sa]), Sha256Of(Source(ka) / shards_[sa]));
    EXPECT_EQ(Sha256sum(a.Dir(draft) / shards_[sb]), Sha256Of(Source(kb) / shards_[sb]));
    size_t other = (sa + 1) % shards_.size();
    while (other == sb || other == sa) other = (other + 1) % shards_.size();
    const int ko = state.count(other) ? state[other] : 0;
    EXPECT_EQ(Sha256sum(a.Dir(draft) / shards_[other]), Sha256Of(Source(ko) / shards_[other]));
  }
  // The last version whole, through a fresh mount.
  const fs::path last = root_ / "expect-last";
  fs::create_directories(last);
  for (const auto& e : fs::directory_iterator(Source(0))) fs::copy_file(e.path(), last / e.path().filename());
  for (const auto& [i, k] : state) {
    fs::copy_file(Source(k) / shards_[i], last / shards_[i], fs::copy_options::overwrite_existing);
  }
  ExpectFreshMountReads({{"m/x@k" + std::to_string(runs), last}});
  // Every run's version through another fresh mount (empty cache): both of its new shards.
  Mount& fresh = NewMount("fresh-every-run");
  ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
  for (const Run& r : history) {
    EXPECT_EQ(Sha256sum(fresh.Dir("m/x@" + r.v) / shards_[r.sa]), Sha256Of(Source(r.ka) / shards_[r.sa])) << r.v;
    EXPECT_EQ(Sha256sum(fresh.Dir("m/x@" + r.v) / shards_[r.sb]), Sha256Of(Source(r.kb) / shards_[r.sb])) << r.v;
  }
  std::printf("%d runs: A completed the set with the dead node's record %d times, timed out %d times\n", runs,
              completed_by_a, timed_out);
  EXPECT_EQ(Published().size(), static_cast<size_t>(runs) + 1);
}

}  // namespace
}  // namespace weightfs::test
