// Real mounts: the weightfs binary mounts a local bucket through /dev/fuse, and the tests read
// it the way users do (ls, stat, cat, cp, sha256sum, pread, mmap, Python + numpy, threads),
// check xattrs and EROFS, watch a version published while mounted appear, unmount with a file
// open, and break things: a corrupted pack, a bucket that disappears mid-read, a killed daemon.
//
// A missing /dev/fuse fails every test (with a message): CI runs as root with /dev/fuse.
// The generated model and its bucket are built once per build tree, under a lock, and shared
// by every test process (ctest runs each test in its own process); tests that change the
// bucket work on a copy. Every wait is bounded.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/file_codec.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "hub/engine/bucket.h"
#include "fs/mount_point.h"
#include "hub/store/local_store.h"
#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kVersions = 4;  // acme/tiny@v0 .. v3
const char* const kShards[] = {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                               "model-00003-of-00003.safetensors"};

using Result = weightfs::test::CommandResult;
using weightfs::test::Cli;
using weightfs::test::GetXattr;
using weightfs::test::ProcessGone;
using weightfs::test::Shell;
using weightfs::test::Slurp;
using weightfs::test::SlurpText;
using weightfs::test::WaitFor;

std::string VersionDir(int k) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "v%03d", k);
  return buf;
}

// The generated model (data/v000..v003) and a bucket with acme/tiny@v0..v3, built once.
struct SharedData {
  fs::path root, data, bucket;
  std::string error;  // why it could not be built
};

const SharedData& Shared() {
  static SharedData shared = [] {
    SharedData s;
    s.root = WEIGHTFS_FS_TEST_DIR;
    s.data = s.root / "data";
    s.bucket = s.root / "bucket";
    fs::create_directories(s.root);
    struct stat bin;
    if (::stat(WEIGHTFS_BINARY, &bin) != 0) {
      s.error = std::string("no weightfs binary at ") + WEIGHTFS_BINARY;
      return s;
    }
    const std::string stamp = std::to_string(bin.st_size) + " " + std::to_string(bin.st_mtim.tv_sec) + "." +
                              std::to_string(bin.st_mtim.tv_nsec) + " 2";
    int lock = ::open((s.root / ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    ::flock(lock, LOCK_EX);
    if (SlurpText(s.root / "ready") != stamp) {
      fs::remove_all(s.data);
      fs::remove_all(s.bucket);
      fs::remove(s.root / "ready");
      // ~23 MB per version in 3 safetensors shards and two small JSON files.
      Result g = Cli("gen " + s.data.string() + " --params 12M --versions " + std::to_string(kVersions - 1) +
                     " --lr 1e-6 --shard-size 10M --seed 5",
                     600);  // (bounded generously: built once, on a loaded machine)
      if (g.exit_code != 0) s.error = "gen failed: " + g.out;
      if (s.error.empty()) {
        Result i = Cli("init " + s.bucket.string());
        if (i.exit_code != 0) s.error = "init failed: " + i.out;
      }
      for (int k = 0; k < kVersions && s.error.empty(); ++k) {
        Result p = Cli("push " + s.bucket.string() + " acme/tiny@v" + std::to_string(k) + " " +
                       (s.data / VersionDir(k)).string() + " --no-cache",
                       600);
        if (p.exit_code != 0) s.error = "push failed: " + p.out;
      }
      if (s.error.empty()) std::ofstream(s.root / "ready") << stamp;
    }
    ::flock(lock, LOCK_UN);
    ::close(lock);
    return s;
  }();
  return shared;
}

// A mount (tests/testing/mount_fixture.h) of `bucket` under TMP/wfs-mount-PID-NAME (removed
// with it), mounted at once. Its cache directory is its own unless `cache_dir` names one (which
// outlives it).
class TinyMount : public weightfs::test::Mount {
 public:
  TinyMount(const fs::path& bucket, const std::string& name, const std::string& extra = "",
            const fs::path& cache_dir = {})
      : weightfs::test::Mount(bucket.string(), FreshDir(name) / "mnt",
                              cache_dir.empty() ? DirOf(name) / "cache" : cache_dir, DirOf(name) / "log.txt", extra),
        dir_(DirOf(name)) {
    RemoveAtTeardown(dir_);
    Start();
  }
  fs::path dir() const { return dir_; }
  fs::path Version(int k) const { return mnt() / "acme" / ("tiny@v" + std::to_string(k)); }

 private:
  static fs::path DirOf(const std::string& name) {
    return fs::temp_directory_path() / ("wfs-mount-" + std::to_string(::getpid()) + "-" + name);
  }
  static fs::path FreshDir(const std::string& name) {
    fs::remove_all(DirOf(name));
    return DirOf(name);
  }
  fs::path dir_;
};

class MountTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Status s = CheckFuseDevice(); !s.ok()) {
      setup_error_ = "these tests need FUSE: " + s.message();
      return;
    }
    if (!Shared().error.empty()) {
      setup_error_ = Shared().error;
      return;
    }
    mount_ = new TinyMount(Shared().bucket, "shared");
    if (!mount_->ok()) setup_error_ = "weightfs mount failed: " + mount_->result().out;
  }
  static void TearDownTestSuite() {
    delete mount_;
    mount_ = nullptr;
  }
  void SetUp() override {
    if (!setup_error_.empty()) FAIL() << setup_error_;
  }

  static const TinyMount& M() { return *mount_; }
  static fs::path Source(int k, const std::string& file) { return Shared().data / VersionDir(k) / file; }
  static const std::vector<uint8_t>& SourceBytes(int k, const std::string& file) {
    static std::map<std::string, std::vector<uint8_t>> cache;
    std::string key = std::to_string(k) + "/" + file;
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, Slurp(Source(k, file))).first;
    return it->second;
  }
  // Version k's manifest with every file's rows (format 2 keeps them in the version's table).
  static Manifest ManifestOf(const fs::path& bucket, int k) {
    Expected<std::unique_ptr<LocalStore>> store = LocalStore::Open(bucket.string());
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    if (!store.ok()) return Manifest{};
    Expected<std::unique_ptr<Bucket>> b = Bucket::Open(std::shared_ptr<Store>(std::move(store).value()));
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    if (!b.ok()) return Manifest{};
    auto m = (*b)->ReadFullManifest("acme/tiny", "v" + std::to_string(k));
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? **m : Manifest{};
  }
  // A copy of the shared bucket, for tests that change it.
  fs::path CopyBucket(const std::string& name) {
    fs::path copy = fs::temp_directory_path() / ("wfs-bucket-" + std::to_string(::getpid()) + "-" + name);
    fs::remove_all(copy);
    fs::copy(Shared().bucket, copy, fs::copy_options::recursive);
    copies_.push_back(copy);
    return copy;
  }
  void TearDown() override {
    for (const fs::path& p : copies_) fs::remove_all(p);
  }

  static std::string setup_error_;
  static TinyMount* mount_;
  std::vector<fs::path> copies_;
};
std::string MountTest::setup_error_;
TinyMount* MountTest::mount_ = nullptr;

// ---- the tree ----------------------------------------------------------------------------------

TEST_F(MountTest, ListsVersionsAndTheLatestLink) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(M().mnt() / "acme")) names.insert(e.path().filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"tiny@latest", "tiny@v0", "tiny@v1", "tiny@v2", "tiny@v3"}));
  EXPECT_EQ(fs::read_symlink(M().mnt() / "acme/tiny@latest").string(), "tiny@v3");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(M().mnt() / "acme/tiny@latest")));
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(M().mnt() / "acme/tiny@latest")) files.insert(e.path().filename().string());
  std::set<std::string> source;
  for (const auto& e : fs::directory_iterator(Source(3, ""))) source.insert(e.path().filename().string());
  EXPECT_EQ(files, source);
  Result ls = Shell("ls -l " + (M().mnt() / "acme").string());
  EXPECT_EQ(ls.exit_code, 0);
  EXPECT_NE(ls.out.find("tiny@latest -> tiny@v3"), std::string::npos) << ls.out;
}

TEST_F(MountTest, StatShowsSizesModesOwnerAndCreationTime) {
  for (int k : {0, 2}) {
    const Manifest m = ManifestOf(Shared().bucket, k);
    struct stat dir;
    ASSERT_EQ(::stat(M().Version(k).c_str(), &dir), 0);
    EXPECT_EQ(dir.st_mode, S_IFDIR | 0555);
    // 1 ("unknown": find does not count sub-directories by links) until the version's head is
    // read, then exact.
    EXPECT_TRUE(dir.st_nlink == 1u || dir.st_nlink == 2u) << dir.st_nlink;
    for (const auto& e : fs::directory_iterator(M().Version(k))) (void)e;
    ASSERT_EQ(::stat(M().Version(k).c_str(), &dir), 0);
    EXPECT_EQ(dir.st_nlink, 2u);
    EXPECT_EQ(dir.st_uid, ::getuid());
    EXPECT_EQ(dir.st_gid, ::getgid());
    EXPECT_EQ(dir.st_mtim.tv_sec * 1000 + dir.st_mtim.tv_nsec / 1000000, m.created_ms);
    for (const auto& e : fs::directory_iterator(Source(k, ""))) {
      struct stat st;
      const fs::path p = M().Version(k) / e.path().filename();
      ASSERT_EQ(::stat(p.c_str(), &st), 0) << p;
      EXPECT_EQ(st.st_mode, S_IFREG | 0444) << p;
      EXPECT_EQ(static_cast<uint64_t>(st.st_size), fs::file_size(e.path())) << p;
      EXPECT_EQ(st.st_nlink, 1u);
      EXPECT_EQ(st.st_mtim.tv_sec * 1000 + st.st_mtim.tv_nsec / 1000000, m.created_ms) << p;
      EXPECT_EQ(st.st_ctim.tv_sec, st.st_mtim.tv_sec);
    }
  }
  struct stat link;
  ASSERT_EQ(::lstat((M().mnt() / "acme/tiny@latest").c_str(), &link), 0);
  EXPECT_EQ(link.st_mode, S_IFLNK | 0777);
  struct statvfs sv;
  ASSERT_EQ(::statvfs(M().mnt().c_str(), &sv), 0);
  EXPECT_GT(sv.f_bsize, 0u);
  EXPECT_GT(sv.f_files, 0u);
}

// ---- reading -----------------------------------------------------------------------------------

TEST_F(MountTest, CatCpAndSha256sumMatchTheSource) {
  const fs::path out = fs::temp_directory_path() / ("wfs-cp-" + std::to_string(::getpid()));
  fs::remove_all(out);
  fs::create_directories(out);
  for (int k : {1, 3}) {
    for (const auto& e : fs::directory_iterator(Source(k, ""))) {
      const std::string name = e.path().filename().string();
      const fs::path p = M().Version(k) / name;
      ASSERT_EQ(Slurp(p), SourceBytes(k, name)) << p;
      ASSERT_EQ(Shell("cp " + p.string() + " " + (out / name).string()).exit_code, 0);
      EXPECT_EQ(Slurp(out / name), SourceBytes(k, name)) << name;
      Result sum = Shell("sha256sum " + p.string());
      ASSERT_EQ(sum.exit_code, 0) << sum.out;
      EXPECT_EQ(sum.out.substr(0, 64), Sha256Hex(SourceBytes(k, name))) << name;
      Result cat = Shell("cat " + p.string() + " | cmp - " + e.path().string());
      EXPECT_EQ(cat.exit_code, 0) << cat.out;
    }
  }
  fs::remove_all(out);
}

TEST_F(MountTest, ThousandsOfRandomPreadsMatchTheSource) {
  std::mt19937_64 rng(11);
  for (int k : {2, 0}) {
    for (const char* shard : {kShards[0], kShards[1]}) {
      const std::vector<uint8_t>& src = SourceBytes(k, shard);
      int fd = ::open((M().Version(k) / shard).c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      std::vector<uint8_t> buf;
      for (int i = 0; i < 1000; ++i) {
        const uint64_t off = rng() % (src.size() + 1000);
        const size_t len = (i % 10 == 0) ? rng() % (3 << 20) : rng() % 70000;
        buf.resize(len);
        ssize_t n = ::pread(fd, buf.data(), len, static_cast<off_t>(off));
        const size_t expect = off >= src.size() ? 0 : std::min<size_t>(len, src.size() - off);
        ASSERT_EQ(n, static_cast<ssize_t>(expect)) << "offset " << off << " length " << len;
        ASSERT_TRUE(std::equal(buf.begin(), buf.begin() + static_cast<ptrdiff_t>(expect),
                               src.begin() + static_cast<ptrdiff_t>(std::min<uint64_t>(off, src.size()))))
            << "offset " << off << " length " << len;
      }
      ::close(fd);
    }
  }
}

// Files of more than a block of rows (8 KiB chunks: ~1,200 rows a shard, sections in blocks of
// 512: core/chunk_table.h) read through the mount as they were written: whole, by random
// preads, and by reads that straddle a block's last row and the next block's first, for the
// base and a delta version (whose chain reads a block in each version).
TEST_F(MountTest, FilesWhoseSectionsAreInBlocksReadBitExact) {
  const fs::path bucket = fs::temp_directory_path() / ("wfs-bucket-" + std::to_string(::getpid()) + "-blocks");
  fs::remove_all(bucket);
  copies_.push_back(bucket);
  ASSERT_EQ(Cli("init " + bucket.string()).exit_code, 0);
  for (int k : {0, 1}) {
    const Result p = Cli("push " + bucket.string() + " acme/tiny@v" + std::to_string(k) + " " +
                         (Shared().data / VersionDir(k)).string() + " --no-cache --chunk-size 8KiB", 600);
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  // Where the blocks start in each shard (the rows of rows 512, 1024...).
  std::map<std::string, std::vector<uint64_t>> boundaries;
  {
    std::unique_ptr<Bucket> b = Bucket::Open(std::shared_ptr<Store>(LocalStore::Open(bucket.string()).value())).value();
    std::shared_ptr<const Manifest> head = b->ReadManifest("acme/tiny", "v1").value();
    for (const char* shard : kShards) {
      const ManifestFile* f = head->FindFile(shard);
      ASSERT_NE(f, nullptr);
      ASSERT_GT(f->section.index_length, 0u) << shard << ": " << f->section.rows << " rows, in one table";
      std::shared_ptr<const ManifestFile> all = b->File(*head, *f).value();
      for (uint64_t row = kTableBlockRows; row < all->chunks.size(); row += kTableBlockRows) {
        boundaries[shard].push_back(all->chunks[row].offset);
      }
      ASSERT_FALSE(boundaries[shard].empty());
    }
  }
  TinyMount m(bucket, "blocks");
  ASSERT_TRUE(m.ok()) << m.result().out;
  std::mt19937_64 rng(17);
  for (int k : {1, 0}) {
    for (const char* shard : kShards) {
      SCOPED_TRACE("v" + std::to_string(k) + "/" + shard);
      const std::vector<uint8_t>& src = SourceBytes(k, shard);
      const fs::path path = m.Version(k) / shard;
      int fd = ::open(path.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // each read reaches the daemon as asked
      std::vector<uint8_t> buf;
      auto check = [&](uint64_t off, size_t len) {
        buf.resize(len);
        const ssize_t n = ::pread(fd, buf.data(), len, static_cast<off_t>(off));
        const size_t expect = off >= src.size() ? 0 : std::min<size_t>(len, src.size() - off);
        ASSERT_EQ(n, static_cast<ssize_t>(expect)) << "offset " << off << " length " << len;
        ASSERT_TRUE(std::equal(buf.begin(), buf.begin() + static_cast<ptrdiff_t>(expect),
                               src.begin() + static_cast<ptrdiff_t>(std::min<uint64_t>(off, src.size()))))
            << "offset " << off << " length " << len;
      };
      for (uint64_t at : boundaries[shard]) {
        check(at - 1, 2);
        check(at - 3000, 70000);
      }
      for (int i = 0; i < 300; ++i) check(rng() % (src.size() + 100), rng() % 200000);
      ::close(fd);
      EXPECT_EQ(weightfs::test::Slurp(path), src);  // sequential: readahead runs across blocks
    }
  }
}

TEST_F(MountTest, MmapReadsMatchTheSource) {
  for (int k : {1, 3}) {
    for (const char* shard : kShards) {
      const std::vector<uint8_t>& src = SourceBytes(k, shard);
      int fd = ::open((M().Version(k) / shard).c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      void* p = ::mmap(nullptr, src.size(), PROT_READ, MAP_SHARED, fd, 0);
      ASSERT_NE(p, MAP_FAILED);
      const uint8_t* bytes = static_cast<const uint8_t*>(p);
      // Random slices first (page faults in no particular order), then everything.
      std::mt19937_64 rng(k);
      for (int i = 0; i < 200; ++i) {
        size_t off = rng() % src.size();
        size_t len = std::min<size_t>(rng() % 100000, src.size() - off);
        ASSERT_EQ(std::memcmp(bytes + off, src.data() + off, len), 0) << shard << " at " << off;
      }
      EXPECT_EQ(std::memcmp(bytes, src.data(), src.size()), 0) << shard;
      ::munmap(p, src.size());
      ::close(fd);
    }
  }
}

TEST_F(MountTest, EightThreadsReadFourVersionsAtOnce) {
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  std::vector<std::string> errors(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const int k = t % kVersions;
      const char* shard = kShards[t % 3];
      const std::vector<uint8_t>& src = SourceBytes(k, shard);  // loaded before the threads start
      int fd = ::open((M().Version(k) / shard).c_str(), O_RDONLY);
      if (fd < 0) {
        errors[t] = "open failed";
        return;
      }
      std::vector<uint8_t> buf(128 << 10);
      bool same = true;
      for (size_t off = 0; off < src.size() && same; off += buf.size()) {
        ssize_t n = ::pread(fd, buf.data(), buf.size(), static_cast<off_t>(off));
        size_t expect = std::min(buf.size(), src.size() - off);
        same = n == static_cast<ssize_t>(expect) && std::memcmp(buf.data(), src.data() + off, expect) == 0;
        if (!same) errors[t] = "mismatch at " + std::to_string(off) + " (n=" + std::to_string(n) + ")";
      }
      ::close(fd);
      if (same) good++;
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(good.load(), 8);
  for (int t = 0; t < 8; ++t) EXPECT_TRUE(errors[t].empty()) << "thread " << t << ": " << errors[t];
}

// Warm the source cache on the main thread before the threads read it.
TEST_F(MountTest, PythonReadsSafetensorsThroughMmap) {
  const fs::path script = fs::temp_directory_path() / ("wfs-read-" + std::to_string(::getpid()) + ".py");
  std::ofstream(script) << R"PY(
import json, mmap, struct, sys
import numpy as np

DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "U8": np.uint8}

def tensors(path):
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (n,) = struct.unpack("<Q", m[:8])
    header = json.loads(m[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        out[name] = np.frombuffer(m, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                  offset=8 + n + begin).reshape(info["shape"])
    return out

count = 0
for mounted, source in zip(sys.argv[1::2], sys.argv[2::2]):
    got, want = tensors(mounted), tensors(source)
    assert sorted(got) == sorted(want), (mounted, sorted(got), sorted(want))
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert np.array_equal(got[name], want[name]), (mounted, name)
        count += 1
    whole = np.memmap(mounted, dtype=np.uint8, mode="r")
    assert np.array_equal(whole, np.memmap(source, dtype=np.uint8, mode="r")), mounted
print("tensors equal:", count)
)PY";
  std::string args;
  for (const char* shard : kShards) {
    args += " " + (M().Version(2) / shard).string() + " " + Source(2, shard).string();
  }
  Result py = Shell("/usr/bin/python3 " + script.string() + args);
  fs::remove(script);
  ASSERT_EQ(py.exit_code, 0) << py.out;
  EXPECT_NE(py.out.find("tensors equal:"), std::string::npos) << py.out;
}

// ---- extended attributes -----------------------------------------------------------------------

TEST_F(MountTest, ExtendedAttributesOfVersionsAndFiles) {
  const Manifest m2 = ManifestOf(Shared().bucket, 2);
  int err = 0;
  EXPECT_EQ(GetXattr(M().Version(2), "user.weightfs.parent", &err).value_or(""), "acme/tiny@v1");
  EXPECT_EQ(err, 0);
  EXPECT_EQ(GetXattr(M().Version(2), "user.weightfs.stored_bytes", &err).value_or(""),
            std::to_string(m2.stats.stored_bytes));
  double changed = std::stod(GetXattr(M().Version(2), "user.weightfs.changed_fraction", &err).value_or(""));
  EXPECT_NEAR(changed, m2.stats.changed_fraction(), 1e-6);
  EXPECT_GT(changed, 0.001);
  EXPECT_LT(changed, 0.05);
  GetXattr(M().Version(0), "user.weightfs.parent", &err);
  EXPECT_EQ(err, ENODATA);  // a base has no parent
  const fs::path shard = M().Version(2) / kShards[0];
  EXPECT_EQ(GetXattr(shard, "user.weightfs.sha256", &err).value_or(""), Sha256Hex(SourceBytes(2, kShards[0])));
  EXPECT_EQ(GetXattr(shard, "user.weightfs.parent", &err).value_or(""), "acme/tiny@v1");
  EXPECT_GT(std::stoull(GetXattr(shard, "user.weightfs.stored_bytes", &err).value_or("")), 0u);
  GetXattr(shard, "user.weightfs.nope", &err);
  EXPECT_EQ(err, ENODATA);
  // Security labels and ACLs are not supported (ENOTSUP): `ls -l` then stops asking for them
  // file after file; the user.weightfs attributes still answer after it.
  for (const char* name : {"security.selinux", "system.posix_acl_access"}) {
    GetXattr(shard, name, &err);
    EXPECT_EQ(err, ENOTSUP) << name;
    GetXattr(M().Version(2), name, &err);
    EXPECT_EQ(err, ENOTSUP) << name;
  }
  EXPECT_EQ(GetXattr(shard, "user.weightfs.parent", &err).value_or(""), "acme/tiny@v1");
  // Through the latest link (getxattr follows it).
  EXPECT_EQ(GetXattr(M().mnt() / "acme/tiny@latest", "user.weightfs.parent", &err).value_or(""), "acme/tiny@v2");
  // The size probe and a buffer too small.
  ssize_t size = ::getxattr(shard.c_str(), "user.weightfs.sha256", nullptr, 0);
  EXPECT_EQ(size, 64);
  char small[10];
  EXPECT_EQ(::getxattr(shard.c_str(), "user.weightfs.sha256", small, sizeof small), -1);
  EXPECT_EQ(errno, ERANGE);
  // listxattr, with the same protocol.
  ssize_t list_size = ::listxattr(shard.c_str(), nullptr, 0);
  ASSERT_GT(list_size, 0);
  std::string list(static_cast<size_t>(list_size), '\0');
  ASSERT_EQ(::listxattr(shard.c_str(), list.data(), list.size()), list_size);
  EXPECT_NE(list.find("user.weightfs.sha256"), std::string::npos);
  EXPECT_NE(list.find("user.weightfs.stored_bytes"), std::string::npos);
  EXPECT_EQ(::listxattr(shard.c_str(), small, 1), -1);
  EXPECT_EQ(errno, ERANGE);
  // The mount's own: the daemon's pid and its counters.
  EXPECT_EQ(GetXattr(M().mnt(), "user.weightfs.pid", &err).value_or(""), std::to_string(M().pid()));
  EXPECT_NE(GetXattr(M().mnt(), "user.weightfs.stats", &err).value_or("").find("\"bucket\""), std::string::npos);
}

// ---- published versions are read-only ---------------------------------------------------------

// --memory-limit bounds the whole daemon, not only the chunks it keeps: twelve readers of
// different files at the smallest limit (one chunk build at a time, 48 MiB of chunks kept)
// all get their bytes, and the daemon's peak RSS stays within the limit.
TEST_F(MountTest, MemoryLimitBoundsTheDaemonUnderManyReaders) {
  TinyMount m(Shared().bucket, "memory", "--memory-limit 128MiB");
  ASSERT_TRUE(m.ok()) << m.result().out;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(12);
  for (int t = 0; t < 12; ++t) {
    const std::vector<uint8_t>& src = SourceBytes(t % kVersions, kShards[t % 3]);  // before the threads
    threads.emplace_back([&, t, src_ptr = &src] {
      std::vector<uint8_t> got = Slurp(m.Version(t % kVersions) / kShards[t % 3]);
      if (got != *src_ptr) errors[t] = "bytes differ (" + std::to_string(got.size()) + " read)";
    });
  }
  for (auto& t : threads) t.join();
  for (int t = 0; t < 12; ++t) EXPECT_TRUE(errors[t].empty()) << "reader " << t << ": " << errors[t];
  int err = 0;
  const std::string stats = GetXattr(m.mnt(), "user.weightfs.stats", &err).value_or("");
  ASSERT_EQ(err, 0);
  const nlohmann::json j = nlohmann::json::parse(stats, nullptr, false);
  ASSERT_TRUE(j.is_object()) << stats;
  EXPECT_EQ(j["reader"]["builds_peak"], 1u) << stats;
  EXPECT_LE(j["peak_rss_bytes"].get<uint64_t>(), 128ull << 20) << stats;
  EXPECT_GT(j["reader"]["evictions"].get<uint64_t>(), 0u) << stats;  // ~90 MB through 48 MiB kept
}

TEST_F(MountTest, EveryChangeFailsWithErofs) {
  const fs::path v = M().Version(1);
  const fs::path file = v / kShards[2];
  auto expect_erofs = [](int rc, const char* what) {
    int err = errno;
    EXPECT_EQ(rc, -1) << what;
    EXPECT_EQ(err, EROFS) << what << ": " << std::strerror(err);
  };
  expect_erofs(::open(file.c_str(), O_WRONLY), "open O_WRONLY");
  expect_erofs(::open(file.c_str(), O_RDWR), "open O_RDWR");
  expect_erofs(::open(file.c_str(), O_RDONLY | O_TRUNC), "open O_TRUNC");
  expect_erofs(::open((v / "new.bin").c_str(), O_CREAT | O_WRONLY, 0644), "create");
  expect_erofs(::mkdir((v / "newdir").c_str(), 0755), "mkdir in a version");
  // (mkdir of a new version makes a draft: tests/fs/write_test.cc.) An existing one is there.
  EXPECT_EQ(::mkdir(v.c_str(), 0755), -1);
  EXPECT_EQ(errno, EEXIST) << "mkdir of a published version: " << std::strerror(errno);
  expect_erofs(::mknod((v / "fifo").c_str(), S_IFIFO | 0644, 0), "mknod");
  expect_erofs(::unlink(file.c_str()), "unlink");
  expect_erofs(::rmdir(v.c_str()), "rmdir");
  expect_erofs(::rename(file.c_str(), (v / "renamed").c_str()), "rename");
  expect_erofs(::symlink("x", (v / "link").c_str()), "symlink");
  expect_erofs(::link(file.c_str(), (v / "hard").c_str()), "link");
  expect_erofs(::chmod(file.c_str(), 0644), "chmod");
  expect_erofs(::truncate(file.c_str(), 0), "truncate");
  expect_erofs(::utimensat(AT_FDCWD, file.c_str(), nullptr, 0), "utimensat");
  expect_erofs(::setxattr(file.c_str(), "user.x", "1", 1, 0), "setxattr");
  expect_erofs(::removexattr(file.c_str(), "user.weightfs.sha256"), "removexattr");
  // access(2) is the kernel's to answer (the mount runs with default_permissions): the file's
  // mode 0444 says no to other users; root's access(W_OK) is 0 as on any file system where
  // root bypasses modes, and its writes still get EROFS above.
  if (::geteuid() != 0) {
    EXPECT_EQ(::access(file.c_str(), W_OK), -1);
    EXPECT_EQ(errno, EACCES);
  }
  EXPECT_EQ(::access(file.c_str(), R_OK), 0);
  EXPECT_EQ(Slurp(file), SourceBytes(1, kShards[2]));  // and nothing changed
}

// ---- the bucket changes while mounted ----------------------------------------------------------

TEST_F(MountTest, AVersionPushedWhileMountedAppearsWithinTheRefreshInterval) {
  const fs::path bucket = CopyBucket("refresh");
  TinyMount m(bucket, "refresh");
  ASSERT_TRUE(m.ok()) << m.result().out;
  ASSERT_TRUE(fs::exists(m.Version(3)));
  ASSERT_FALSE(fs::exists(m.Version(4)));
  Result push = Cli("push " + bucket.string() + " acme/tiny@v4 " + Source(1, "").string() + " --no-cache");
  ASSERT_EQ(push.exit_code, 0) << push.out;
  const auto start = Clock::now();
  ASSERT_TRUE(WaitFor([&] { return fs::exists(m.Version(4)); }, std::chrono::seconds(10)));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(seconds, 4.0);  // --refresh 1 (and a loaded machine)
  EXPECT_TRUE(WaitFor([&] { return fs::read_symlink(m.mnt() / "acme/tiny@latest") == "tiny@v4"; },
                      std::chrono::seconds(5)));
  EXPECT_EQ(Slurp(m.Version(4) / kShards[1]), SourceBytes(1, kShards[1]));
}

TEST_F(MountTest, UnmountWithAFileOpenIsBusyThenLazyKeepsTheFileReadable) {
  TinyMount m(Shared().bucket, "busy");
  ASSERT_TRUE(m.ok()) << m.result().out;
  const std::vector<uint8_t>& src = SourceBytes(1, kShards[1]);
  int fd = ::open((m.Version(1) / kShards[1]).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> buf(1 << 20);
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  Result busy = Cli("unmount " + m.mnt().string());
  EXPECT_EQ(busy.exit_code, 1) << busy.out;
  EXPECT_NE(busy.out.find("busy"), std::string::npos) << busy.out;
  EXPECT_TRUE(FindMount(m.mnt().string()).has_value());
  Result lazy = Cli("unmount --lazy " + m.mnt().string());
  ASSERT_EQ(lazy.exit_code, 0) << lazy.out;
  EXPECT_FALSE(FindMount(m.mnt().string()).has_value());
  // The open file still reads, also where nothing was read before.
  const size_t tail = src.size() - buf.size();
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(tail)), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(std::memcmp(buf.data(), src.data() + tail, buf.size()), 0);
  EXPECT_FALSE(ProcessGone(m.pid()));
  ::close(fd);
  EXPECT_TRUE(WaitFor([&] { return ProcessGone(m.pid()); }, std::chrono::seconds(10)));
}

TEST_F(MountTest, FusermountUnmountEndsTheDaemon) {
  TinyMount m(Shared().bucket, "fusermount");
  ASSERT_TRUE(m.ok()) << m.result().out;
  ASSERT_EQ(Slurp(m.Version(0) / "config.json"), SourceBytes(0, "config.json"));
  Result u = Shell("fusermount3 -u " + m.mnt().string());
  ASSERT_EQ(u.exit_code, 0) << u.out;
  EXPECT_TRUE(WaitFor([&] { return ProcessGone(m.pid()); }, std::chrono::seconds(10)));
  EXPECT_NE(SlurpText(m.log()).find("unmounted " + m.mnt().string()), std::string::npos) << SlurpText(m.log());
}

TEST_F(MountTest, SigtermUnmountsCleanly) {
  TinyMount m(Shared().bucket, "sigterm");
  ASSERT_TRUE(m.ok()) << m.result().out;
  ASSERT_EQ(::kill(m.pid(), SIGTERM), 0);
  EXPECT_TRUE(WaitFor([&] { return ProcessGone(m.pid()); }, std::chrono::seconds(10)));
  EXPECT_FALSE(FindMount(m.mnt().string()).has_value());
  struct stat st;
  EXPECT_EQ(::stat(m.mnt().c_str(), &st), 0);  // an ordinary empty directory again
}

TEST_F(MountTest, AMountLeftByAKilledDaemonIsRecovered) {
  TinyMount m(Shared().bucket, "stale");
  ASSERT_TRUE(m.ok()) << m.result().out;
  ASSERT_EQ(::kill(m.pid(), SIGKILL), 0);
  ASSERT_TRUE(WaitFor([&] { return ProcessGone(m.pid()); }, std::chrono::seconds(10)));
  struct statfs st;  // (stat may be answered from the kernel's attribute cache)
  EXPECT_EQ(::statfs(m.mnt().c_str(), &st), -1);
  EXPECT_TRUE(errno == ENOTCONN || errno == ECONNABORTED) << std::strerror(errno);
  Result again = Cli("mount " + Shared().bucket.string() + " " + m.mnt().string() + " --cache-dir " +
                     (m.dir() / "cache").string() + " --log-file " + m.log().string());
  ASSERT_EQ(again.exit_code, 0) << again.out;
  EXPECT_NE(again.out.find("daemon is gone"), std::string::npos) << again.out;
  EXPECT_EQ(Slurp(m.Version(3) / "config.json"), SourceBytes(3, "config.json"));
}

TEST_F(MountTest, MountErrorsAreOneClearLine) {
  const std::string bucket = Shared().bucket.string();
  Result missing = Cli("mount " + bucket + " /nonexistent/weightfs/mnt");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.out.find("does not exist"), std::string::npos) << missing.out;
  Result file = Cli("mount " + bucket + " " + Source(0, "config.json").string());
  EXPECT_EQ(file.exit_code, 1);
  EXPECT_NE(file.out.find("not a directory"), std::string::npos) << file.out;
  Result busy = Cli("mount " + bucket + " " + M().mnt().string());
  EXPECT_EQ(busy.exit_code, 1);
  EXPECT_NE(busy.out.find("busy"), std::string::npos) << busy.out;
  const fs::path empty = fs::temp_directory_path() / ("wfs-empty-" + std::to_string(::getpid()));
  fs::create_directories(empty / "mnt");
  Result not_bucket = Cli("mount " + empty.string() + " " + (empty / "mnt").string());
  EXPECT_EQ(not_bucket.exit_code, 1);
  EXPECT_NE(not_bucket.out.find("weightfs init"), std::string::npos) << not_bucket.out;
  EXPECT_FALSE(FindMount((empty / "mnt").string()).has_value());
  Result no_bucket = Cli("mount /nonexistent/bucket " + (empty / "mnt").string());
  EXPECT_EQ(no_bucket.exit_code, 1);
  EXPECT_NE(no_bucket.out.find("does not exist"), std::string::npos) << no_bucket.out;
  Result usage = Cli("mount " + bucket);
  EXPECT_EQ(usage.exit_code, 2);
  Result bad_option = Cli("mount " + bucket + " " + (empty / "mnt").string() + " -o no_such_option");
  EXPECT_EQ(bad_option.exit_code, 1);
  EXPECT_FALSE(FindMount((empty / "mnt").string()).has_value());
  for (const Result* r : {&missing, &file, &busy, &not_bucket, &no_bucket}) {
    EXPECT_EQ(std::count(r->out.begin(), r->out.end(), '\n'), 1) << r->out;
  }
  fs::remove_all(empty);
}

// ---- failures ----------------------------------------------------------------------------------

TEST_F(MountTest, ACorruptedPackGivesEioForThatChunkAndALogLineNamingIt) {
  const fs::path bucket = CopyBucket("corrupt");
  const Manifest m0 = ManifestOf(bucket, 0);
  const ManifestFile* file = m0.FindFile(kShards[1]);
  ASSERT_TRUE(file);
  // A keyframe chunk at least 3 MiB into the file, so that reads near the start of the file
  // (and the kernel's readahead around them) do not touch it.
  const ManifestChunk* bad = nullptr;
  for (const ManifestChunk& c : file->chunks) {
    if (c.offset >= (3u << 20) && !c.is_delta() && c.origin == 0) {
      bad = &c;
      break;
    }
  }
  ASSERT_TRUE(bad);
  {
    std::fstream pack(bucket / "packs" / m0.packs[bad->ref.pack].ToHex(), std::ios::in | std::ios::out | std::ios::binary);
    const auto at = static_cast<std::streamoff>(bad->ref.offset + bad->ref.length / 2);
    pack.seekg(at);
    char c = 0;
    pack.get(c);
    pack.seekp(at);
    pack.put(static_cast<char>(c ^ 0x5a));
  }
  TinyMount m(bucket, "corrupt");
  ASSERT_TRUE(m.ok()) << m.result().out;
  int fd = ::open((m.Version(0) / kShards[1]).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> buf(4096);
  const auto start = Clock::now();
  EXPECT_EQ(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(bad->offset + 100)), -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  // Other chunks read fine: the start of this file, and all of another file.
  const std::vector<uint8_t>& src = SourceBytes(0, kShards[1]);
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(std::memcmp(buf.data(), src.data(), buf.size()), 0);
  ::close(fd);
  EXPECT_EQ(Slurp(m.Version(0) / kShards[0]), SourceBytes(0, kShards[0]));
  // The log names the version, the file and the chunk.
  const std::string log = SlurpText(m.log());
  const std::string where = "acme/tiny@v0 " + std::string(kShards[1]) + " tensor '" + bad->key.tensor +
                            "' chunk " + std::to_string(bad->key.index);
  EXPECT_NE(log.find(where), std::string::npos) << "no '" << where << "' in\n" << log;
}

// A pack shorter than the manifest says — cut before a payload, so the store refuses the range
// — is corrupt data: EIO (not EINVAL) for the chunks it held, a log line naming the pack, the
// version and the file, the rest of the version readable, the daemon up.
TEST_F(MountTest, ATruncatedPackGivesEioAndALogLineNamingThePackVersionAndFile) {
  const fs::path bucket = CopyBucket("truncated");
  const Manifest m0 = ManifestOf(bucket, 0);
  const ManifestFile* file = m0.FindFile(kShards[1]);
  ASSERT_TRUE(file);
  // A keyframe chunk at least 3 MiB into the file whose payload is not at the start of its pack.
  const ManifestChunk* bad = nullptr;
  for (const ManifestChunk& c : file->chunks) {
    if (c.offset >= (3u << 20) && !c.is_delta() && c.origin == 0 && c.ref.offset > 0) {
      bad = &c;
      break;
    }
  }
  ASSERT_TRUE(bad);
  const std::string pack_key = "packs/" + m0.packs[bad->ref.pack].ToHex();
  const uint64_t cut = bad->ref.offset - 1;
  fs::resize_file(bucket / pack_key, cut);
  // A chunk whose payload the cut left whole, to read next.
  std::string good_file;
  const ManifestChunk* good = nullptr;
  for (const ManifestFile& f : m0.files) {
    for (const ManifestChunk& c : f.chunks) {
      if (!good && c.origin == 0 && !c.is_delta() && c.length >= 4096 &&
          (c.ref.pack != bad->ref.pack || c.ref.offset + c.ref.length <= cut)) {
        good = &c;
        good_file = f.path;
      }
    }
  }
  ASSERT_TRUE(good);
  TinyMount m(bucket, "truncated");
  ASSERT_TRUE(m.ok()) << m.result().out;
  int fd = ::open((m.Version(0) / kShards[1]).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> buf(4096);
  EXPECT_EQ(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(bad->offset + 100)), -1);
  EXPECT_EQ(errno, EIO) << std::strerror(errno);
  ::close(fd);
  fd = ::open((m.Version(0) / good_file).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  const std::vector<uint8_t>& src = SourceBytes(0, good_file);
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), static_cast<off_t>(good->offset)), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(std::memcmp(buf.data(), src.data() + good->offset, buf.size()), 0);
  ::close(fd);
  EXPECT_FALSE(ProcessGone(m.pid()));
  const std::string log = SlurpText(m.log());
  bool found = false;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    if (line.find(pack_key + " is truncated") != std::string::npos) {
      found = true;
      EXPECT_NE(line.find("acme/tiny@v0"), std::string::npos) << line;
      EXPECT_NE(line.find(kShards[1]), std::string::npos) << line;
      EXPECT_NE(line.find("error"), std::string::npos) << line;
      EXPECT_NE(line.find("(errno 5)"), std::string::npos) << line;
    }
  }
  EXPECT_TRUE(found) << "no line naming " << pack_key << " in\n" << log;
}

// ---- the disk cache ----------------------------------------------------------------------------

// Changes a chunk cache file in place (same inode), as another process or a disk tool would:
// "flip" one byte 3/4 into it, "overwrite" all of it, "truncate" it to half, "append" to it.
void ChangeInPlace(const fs::path& file, const std::string& how) {
  int fd = ::open(file.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << file << ": " << std::strerror(errno);
  struct stat st;
  ASSERT_EQ(::fstat(fd, &st), 0);
  const auto size = static_cast<uint64_t>(st.st_size);
  if (how == "flip") {
    uint8_t b = 0;
    const auto at = static_cast<off_t>(size * 3 / 4);
    ASSERT_EQ(::pread(fd, &b, 1, at), 1);
    b ^= 0x10;
    ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
  } else if (how == "overwrite") {
    std::vector<uint8_t> junk(size);
    for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<uint8_t>(i * 31 + 7);
    ASSERT_EQ(::pwrite(fd, junk.data(), junk.size(), 0), static_cast<ssize_t>(junk.size()));
  } else if (how == "truncate") {
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size / 2)), 0);
  } else {
    ASSERT_EQ(how, "append");
    std::vector<uint8_t> tail(4096, 0xAB);
    ASSERT_EQ(::pwrite(fd, tail.data(), tail.size(), static_cast<off_t>(size)), 4096);
  }
  ::close(fd);
}

// The promise of the disk cache: a cache file changed in place is a miss, never wrong data, at
// any moment — at rest between mounts, after the daemon has read and checked it (while the
// chunk is still being served), and while it reads it. A fill mount reads every version (the
// cache holds all their chunks); each later mount reads through the same cache directory:
//   1. per change (flip, overwrite, truncate, append), a new mount reads the first page of each
//      large chunk (the daemon reads and verifies the chunk's cache file), the file is changed,
//      then the rest of the chunk is read (readahead off: these bytes come from the daemon, not
//      the kernel's page cache);
//   2. a last mount reads every version while a thread keeps changing random cache files.
// Every byte read is compared with the source; the daemon stays up; the log says it dropped
// corrupt entries.
// (The chunk files, with whole files off: WholeFilesChangedInPlaceAreNeverServed has those.)
TEST_F(MountTest, CacheFilesChangedInPlaceAreMissesNeverWrongData) {
  const fs::path cache = fs::temp_directory_path() / ("wfs-inplace-cache-" + std::to_string(::getpid()));
  fs::remove_all(cache);
  {
    TinyMount fill(Shared().bucket, "inplace-fill", "--no-whole-files", cache);
    ASSERT_TRUE(fill.ok()) << fill.result().out;
    for (int k = 0; k < kVersions; ++k) {
      for (const char* shard : kShards) ASSERT_EQ(Slurp(fill.Version(k) / shard), SourceBytes(k, shard));
    }
  }
  auto entry_of = [&](const ManifestChunk& c) {
    const std::string hex = c.hash.ToHex();
    return cache / "chunks" / hex.substr(0, 2) / hex;
  };
  const Manifest m3 = ManifestOf(Shared().bucket, 3);
  struct Target {
    const char* shard;
    const ManifestChunk* chunk;
  };
  std::vector<Target> targets;  // chunks big enough to read in two parts
  for (const char* shard : kShards) {
    const ManifestFile* f = m3.FindFile(shard);
    ASSERT_TRUE(f);
    for (const ManifestChunk& c : f->chunks) {
      if (c.length >= (256u << 10)) targets.push_back({shard, &c});
    }
  }
  ASSERT_GE(targets.size(), 8u);
  const std::vector<std::string> changes = {"flip", "overwrite", "truncate", "append"};
  for (size_t mode = 0; mode < changes.size(); ++mode) {
    SCOPED_TRACE(changes[mode]);
    TinyMount m(Shared().bucket, "inplace-" + changes[mode], "--no-whole-files", cache);
    ASSERT_TRUE(m.ok()) << m.result().out;
    size_t changed = 0;
    for (size_t t = 0; t < targets.size(); ++t) {
      const ManifestChunk& c = *targets[t].chunk;
      const std::vector<uint8_t>& src = SourceBytes(3, targets[t].shard);
      int fd = ::open((m.Version(3) / targets[t].shard).c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);  // no kernel readahead
      std::vector<uint8_t> buf(c.length);
      ASSERT_EQ(::pread(fd, buf.data(), 4096, static_cast<off_t>(c.offset)), 4096);
      // Each change on its own chunks, which are still good cache entries when read here.
      if (t % changes.size() == mode && fs::exists(entry_of(c))) {
        ChangeInPlace(entry_of(c), changes[mode]);
        ++changed;
      }
      const size_t rest = c.length - 4096;
      ASSERT_EQ(::pread(fd, buf.data() + 4096, rest, static_cast<off_t>(c.offset + 4096)), static_cast<ssize_t>(rest))
          << targets[t].shard << " " << DescribeChunk(c.key) << ": " << std::strerror(errno);
      ::close(fd);
      ASSERT_TRUE(std::equal(buf.begin(), buf.end(), src.begin() + static_cast<ptrdiff_t>(c.offset)))
          << "wrong bytes served for " << targets[t].shard << " " << DescribeChunk(c.key);
    }
    EXPECT_GE(changed, 2u);
    for (const char* shard : kShards) EXPECT_EQ(Sha256Hex(Slurp(m.Version(3) / shard)), Sha256Hex(SourceBytes(3, shard)));
    EXPECT_FALSE(ProcessGone(m.pid())) << SlurpText(m.log());
  }

  // Changes racing with reads of every version.
  TinyMount m(Shared().bucket, "inplace-race", "--no-whole-files", cache);
  ASSERT_TRUE(m.ok()) << m.result().out;
  std::vector<fs::path> entries;
  for (const auto& e : fs::recursive_directory_iterator(cache / "chunks")) {
    if (e.is_regular_file() && e.path().filename().string().size() == 32) entries.push_back(e.path());
  }
  ASSERT_FALSE(entries.empty());
  std::atomic<bool> stop{false};
  std::atomic<size_t> made{0};
  std::thread changer([&] {
    std::mt19937_64 rng(23);
    while (!stop.load()) {
      const fs::path& e = entries[rng() % entries.size()];
      int fd = ::open(e.c_str(), O_RDWR);
      if (fd < 0) continue;  // dropped by the daemon (and not rebuilt yet)
      struct stat st;
      if (::fstat(fd, &st) == 0 && st.st_size > 0) {
        const auto at = static_cast<off_t>(rng() % static_cast<uint64_t>(st.st_size));
        uint8_t b = static_cast<uint8_t>(rng());
        switch (rng() % 4) {
          case 0: (void)!::pwrite(fd, &b, 1, at); break;
          case 1: (void)!::ftruncate(fd, at); break;
          case 2: (void)!::pwrite(fd, &b, 1, st.st_size); break;
          default: {
            std::vector<uint8_t> junk(static_cast<size_t>(st.st_size) - static_cast<size_t>(at), b);
            (void)!::pwrite(fd, junk.data(), junk.size(), at);
          }
        }
        made++;
      }
      ::close(fd);
    }
  });
  for (int k = kVersions - 1; k >= 0; --k) {
    for (const char* shard : kShards) {
      const std::vector<uint8_t> got = Slurp(m.Version(k) / shard);
      EXPECT_TRUE(got == SourceBytes(k, shard)) << "v" << k << " " << shard << ": wrong bytes ("
                                                << got.size() << " of " << SourceBytes(k, shard).size() << ")";
    }
  }
  stop = true;
  changer.join();
  EXPECT_GT(made.load(), 0u);
  EXPECT_FALSE(ProcessGone(m.pid())) << SlurpText(m.log());
  EXPECT_EQ(Slurp(m.Version(0) / "config.json"), SourceBytes(0, "config.json"));
  // The entries changed by the first part were found and dropped (logged at most once a minute).
  const std::string log = SlurpText(m.log());
  EXPECT_NE(log.find("is corrupt"), std::string::npos) << log;
  fs::remove_all(cache);
}

TEST_F(MountTest, ABucketThatDisappearsMidReadGivesEioNotAHang) {
  const fs::path bucket = CopyBucket("vanish");
  TinyMount m(bucket, "vanish");
  ASSERT_TRUE(m.ok()) << m.result().out;
  ASSERT_EQ(Slurp(m.Version(3) / kShards[0]), SourceBytes(3, kShards[0]));
  fs::rename(bucket / "packs", bucket / "packs.away");
  const auto start = Clock::now();
  int fd = ::open((m.Version(3) / kShards[1]).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::vector<uint8_t> buf(1 << 20);
  EXPECT_EQ(::pread(fd, buf.data(), buf.size(), 0), -1);
  EXPECT_EQ(errno, EIO);
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  // What was read before stays readable (memory and disk cache), and the failure is not
  // remembered: once the packs are back, the file reads.
  EXPECT_EQ(Slurp(m.Version(3) / kShards[0]), SourceBytes(3, kShards[0]));
  fs::rename(bucket / "packs.away", bucket / "packs");
  const std::vector<uint8_t>& src = SourceBytes(3, kShards[1]);
  ASSERT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(std::memcmp(buf.data(), src.data(), buf.size()), 0);
  ::close(fd);
  EXPECT_NE(SlurpText(m.log()).find("(errno 5)"), std::string::npos);
}

// ---- whole files and passthrough (fs/whole_files.h, fs/passthrough.h) ------------------------

// The mount's counters of whole files and passthrough.
nlohmann::json WholeStats(const TinyMount& m) {
  nlohmann::json s = m.Stats();
  return s.is_object() ? nlohmann::json{{"whole", s.value("whole_files", nlohmann::json())},
                                        {"passthrough", s.value("passthrough", nlohmann::json())},
                                        {"reads", s["reader"].value("reads", uint64_t{0})}}
                       : nlohmann::json();
}
// Files kept whole: written as they were read, or copied after.
uint64_t Copied(const TinyMount& m) {
  nlohmann::json s = WholeStats(m);
  return s.is_object() ? s["whole"].value("copied", uint64_t{0}) + s["whole"].value("streamed", uint64_t{0}) : 0;
}
bool PassthroughOn(const TinyMount& m) {
  nlohmann::json s = WholeStats(m);
  return s.is_object() && s["passthrough"].value("enabled", false);
}
uint64_t PassthroughOpens(const TinyMount& m) {
  nlohmann::json s = WholeStats(m);
  return s.is_object() ? s["passthrough"].value("opens", uint64_t{0}) : 0;
}
// Every byte of `p` read through a map of it.
std::vector<uint8_t> ReadMapped(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return {};
  struct stat st;
  ::fstat(fd, &st);
  std::vector<uint8_t> out(static_cast<size_t>(st.st_size));
  void* map = ::mmap(nullptr, out.size(), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return {};
  std::memcpy(out.data(), map, out.size());
  ::munmap(map, out.size());
  return out;
}

// A file read whole through the mount is copied into the cache whole, in place of its chunk
// files (a part of a file is not); the copy has the file's bytes. Later opens are served by the
// kernel from it (FUSE passthrough, where this kernel and privilege allow: no read reaches the
// daemon), by read and by map, bit-exact; a new mount on the same cache serves it so from its
// first open.
TEST_F(MountTest, AFileReadWholeIsKeptWholeAndThenServedByTheKernel) {
  const fs::path cache = fs::temp_directory_path() / ("wfs-whole-cache-" + std::to_string(::getpid()));
  fs::remove_all(cache);
  const char* shard = kShards[0];
  const std::vector<uint8_t>& src = SourceBytes(2, shard);
  const Manifest m2 = ManifestOf(Shared().bucket, 2);
  const ManifestFile* mf = m2.FindFile(shard);
  ASSERT_TRUE(mf);
  const fs::path whole = cache / "files" / (mf->sha256 + "-" + std::to_string(mf->size));
  {
    TinyMount m(Shared().bucket, "whole", "", cache);
    ASSERT_TRUE(m.ok()) << m.Describe();
    const fs::path file = m.Version(2) / shard;
    {
      const int fd = ::open(file.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      std::vector<uint8_t> part(src.size() / 2);
      ASSERT_EQ(::pread(fd, part.data(), part.size(), 0), static_cast<ssize_t>(part.size()));
      ::close(fd);
    }
    EXPECT_EQ(WholeStats(m)["whole"].value("queued", 99u), 0u) << "half of a file is not copied";
    EXPECT_EQ(Slurp(file), src);
    ASSERT_TRUE(WaitFor([&] { return Copied(m) == 1; }, std::chrono::seconds(30))) << WholeStats(m).dump() << m.Describe();
    EXPECT_EQ(Slurp(whole), src);
    for (const ManifestChunk& c : mf->chunks) {
      const std::string hex = c.hash.ToHex();
      EXPECT_FALSE(fs::exists(cache / "chunks" / hex.substr(0, 2) / hex)) << "a chunk file beside the whole file";
    }
    if (!PassthroughOn(m)) {
      std::cerr << "note: FUSE passthrough is not available here (Linux 6.9+ and CAP_SYS_ADMIN): the copy is read "
                   "through the daemon\n";
    }
    const uint64_t reads = WholeStats(m)["reads"].get<uint64_t>();
    const uint64_t opens = PassthroughOpens(m);
    EXPECT_EQ(Slurp(file), src);
    EXPECT_EQ(ReadMapped(file), src);
    if (PassthroughOn(m)) {
      EXPECT_EQ(PassthroughOpens(m), opens + 2);
      EXPECT_EQ(WholeStats(m)["reads"].get<uint64_t>(), reads) << "a read reached the daemon";
    }
    EXPECT_EQ(Sha256Hex(Slurp(m.Version(2) / shard)), Sha256Hex(src));
    ASSERT_EQ(m.Unmount().exit_code, 0);
  }
  TinyMount again(Shared().bucket, "whole-again", "", cache);
  ASSERT_TRUE(again.ok()) << again.Describe();
  EXPECT_EQ(Slurp(again.Version(2) / shard), src);
  EXPECT_EQ(ReadMapped(again.Version(2) / shard), src);
  if (PassthroughOn(again)) {
    EXPECT_EQ(PassthroughOpens(again), 2u);
    EXPECT_EQ(WholeStats(again)["reads"].get<uint64_t>(), 0u);
  }
  // The other files of the version are still read through the daemon, and copied in turn.
  for (const char* other : {kShards[1], kShards[2]}) EXPECT_EQ(Slurp(again.Version(2) / other), SourceBytes(2, other));
  EXPECT_TRUE(WaitFor([&] { return Copied(again) == 2; }, std::chrono::seconds(30))) << WholeStats(again).dump();
  again.Teardown();
  fs::remove_all(cache);
}

// A file read in order from its first byte is written whole as it is read, without chunk files
// of its own; one whose reader stops short (here: the first quarter, then nothing) is not kept
// whole, and what was read of it is in the disk cache all the same: a new mount on the cache,
// with the bucket's packs gone, reads that part.
TEST_F(MountTest, AFileReadInOrderIsWrittenWholeAsItIsReadAndAStopShortLosesNothing) {
  const fs::path bucket = CopyBucket("stream");
  const fs::path cache = fs::temp_directory_path() / ("wfs-stream-cache-" + std::to_string(::getpid()));
  fs::remove_all(cache);
  const char* shard = kShards[1];
  const std::vector<uint8_t>& src = SourceBytes(3, shard);
  const size_t part = src.size() / 4;
  {
    TinyMount m(bucket, "stream", "", cache);
    ASSERT_TRUE(m.ok()) << m.Describe();
    EXPECT_EQ(Slurp(m.Version(2) / shard), SourceBytes(2, shard));
    ASSERT_TRUE(WaitFor([&] { return WholeStats(m)["whole"].value("streamed", 0u) == 1u; }, std::chrono::seconds(30)))
        << WholeStats(m).dump();
    EXPECT_EQ(WholeStats(m)["whole"].value("copied", 99u), 0u) << "no copy after the read";
    // Made from the kernel's pages (FUSE_NOTIFY_RETRIEVE), nothing built again. The kernel does
    // not promise to keep a page: in 1 run of 5-10 right after the full suite (none of 100
    // later, nor with the page cache full), it answered short for some chunks, 1.8-4.3 of the
    // 9.7 MB, which then came from the reader's memory. Every byte from one or the other.
    const nlohmann::json w = WholeStats(m)["whole"];
    EXPECT_GT(w.value("kernel_bytes", 0u), 0u) << WholeStats(m).dump();
    EXPECT_EQ(w.value("kernel_bytes", 0u) + w.value("memory_bytes", 0u), SourceBytes(2, shard).size()) << WholeStats(m).dump();
    EXPECT_EQ(w.value("rebuilt", 99u), 0u);
    // Its chunks past the first few were never chunk files.
    const Manifest m2 = ManifestOf(bucket, 2);
    size_t chunk_files = 0;
    for (const ManifestChunk& c : m2.FindFile(shard)->chunks) {
      const std::string hex = c.hash.ToHex();
      chunk_files += fs::exists(cache / "chunks" / hex.substr(0, 2) / hex);
    }
    EXPECT_EQ(chunk_files, 0u);
    // A reader that stops short.
    const int fd = ::open((m.Version(3) / shard).c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    std::vector<uint8_t> buf(part);
    ASSERT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
    EXPECT_TRUE(std::equal(buf.begin(), buf.end(), src.begin()));
    ASSERT_TRUE(WaitFor([&] { return WholeStats(m)["whole"].value("stream_ends", 0u) == 1u; }, std::chrono::seconds(30)))
        << WholeStats(m).dump();
    ::close(fd);
    EXPECT_EQ(WholeStats(m)["whole"].value("streamed", 0u), 1u);
    ASSERT_EQ(m.Unmount().exit_code, 0);
  }
  fs::rename(bucket / "packs", bucket / "packs.away");
  TinyMount again(bucket, "stream-again", "", cache);
  ASSERT_TRUE(again.ok()) << again.Describe();
  const int fd = ::open((again.Version(3) / shard).c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  // (What the kernel's readahead read beyond `part` may be cached too; `part` must be.)
  std::vector<uint8_t> buf(part);
  EXPECT_EQ(::pread(fd, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size())) << std::strerror(errno);
  ::close(fd);
  EXPECT_TRUE(std::equal(buf.begin(), buf.end(), src.begin()));
  EXPECT_EQ(again.Stats()["materializer"].value("payload_bytes", 1u), 0u) << "built from the bucket: " << again.Stats().dump();
  EXPECT_EQ(Slurp(again.Version(2) / shard), SourceBytes(2, shard)) << "the whole file, from the copy";
  again.Teardown();
  fs::remove_all(cache);
}

// `weightfs unmount` right after a file was read whole: the unmount first asks the daemon for
// the local copies (user.weightfs.finish_whole_files), which are then made from the kernel's
// pages while it still has them, not built again after the unmount; the next mount reads the
// file from the copy with the bucket's packs gone.
TEST_F(MountTest, AnUnmountRightAfterAWholeReadHasTheCopyMadeFromTheKernelsPages) {
  const fs::path bucket = CopyBucket("hurry");
  const fs::path cache = fs::temp_directory_path() / ("wfs-hurry-cache-" + std::to_string(::getpid()));
  fs::remove_all(cache);
  const char* shard = kShards[1];
  const std::vector<uint8_t>& want = SourceBytes(2, shard);
  {
    TinyMount m(bucket, "hurry", "", cache);
    ASSERT_TRUE(m.ok()) << m.Describe();
    EXPECT_EQ(Slurp(m.Version(2) / shard), want);
    ASSERT_EQ(m.Unmount().exit_code, 0);
    const std::vector<uint8_t> log = Slurp(m.dir() / "log.txt");
    const std::string text(log.begin(), log.end());
    // (From the kernel's pages, and from the daemon's memory what the kernel did not keep: see
    // AFileReadInOrderIsWrittenWholeAsItIsReadAndAStopShortLosesNothing.)
    std::smatch kept;
    ASSERT_TRUE(std::regex_search(text, kept, std::regex("whole files: 1 kept whole by this mount \\(([0-9]+) bytes from the "
                                                         "kernel's pages, ([0-9]+) from its memory, 0 chunks built again\\), 0 failed")))
        << text;
    EXPECT_GT(std::stoull(kept[1]), 0u) << text;
    EXPECT_EQ(std::stoull(kept[1]) + std::stoull(kept[2]), want.size()) << text;
  }
  fs::rename(bucket / "packs", bucket / "packs.away");
  TinyMount again(bucket, "hurry-again", "", cache);
  ASSERT_TRUE(again.ok()) << again.Describe();
  EXPECT_EQ(Slurp(again.Version(2) / shard), want);
  EXPECT_EQ(again.Stats()["materializer"].value("payload_bytes", 1u), 0u) << again.Stats().dump();
  again.Teardown();
  fs::remove_all(cache);
}

// The kernel wants every open file of an inode in one mode. A file held open through the daemon
// while its copy is made keeps its later opens there too (none fails), and one held open on
// the copy keeps them on it; each set of opens reads the right bytes, and once all are closed
// the next open uses the copy.
TEST_F(MountTest, OpensOfAFileShareOneModeWhileItIsCopied) {
  TinyMount m(Shared().bucket, "whole-modes");
  ASSERT_TRUE(m.ok()) << m.Describe();
  const fs::path file = m.Version(3) / kShards[1];
  const std::vector<uint8_t>& src = SourceBytes(3, kShards[1]);
  const int held = ::open(file.c_str(), O_RDONLY);
  ASSERT_GE(held, 0);
  std::vector<uint8_t> buf(src.size());
  ASSERT_EQ(::pread(held, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(buf, src);
  ASSERT_TRUE(WaitFor([&] { return Copied(m) == 1; }, std::chrono::seconds(30))) << WholeStats(m).dump();
  const uint64_t opens = PassthroughOpens(m);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(Slurp(file), src) << "an open beside one through the daemon";
    EXPECT_EQ(ReadMapped(file), src);
  }
  EXPECT_EQ(PassthroughOpens(m), opens);
  ::close(held);
  if (!PassthroughOn(m)) GTEST_SKIP() << "FUSE passthrough is not available here";
  // (The release reaches the daemon after close returns.)
  ASSERT_TRUE(WaitFor([&] {
    EXPECT_EQ(Slurp(file), src);
    return PassthroughOpens(m) > opens;
  }, std::chrono::seconds(10)));
  const int on_copy = ::open(file.c_str(), O_RDONLY);
  ASSERT_GE(on_copy, 0);
  const uint64_t after = PassthroughOpens(m);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Slurp(file), src) << "an open beside one on the copy";
  EXPECT_EQ(PassthroughOpens(m), after + 3);
  ASSERT_EQ(::pread(on_copy, buf.data(), buf.size(), 0), static_cast<ssize_t>(buf.size()));
  EXPECT_EQ(buf, src);
  ::close(on_copy);
  EXPECT_FALSE(ProcessGone(m.pid()));
}

// A whole file changed on disk after it was written (a flipped byte, a truncation) is never
// served: the next open finds it changed, removes it and reads through the daemon, bit-exact
// (its chunks come from the bucket again), and a whole read copies it anew.
TEST_F(MountTest, WholeFilesChangedInPlaceAreNeverServed) {
  for (const std::string how : {"flip", "truncate"}) {
    SCOPED_TRACE(how);
    TinyMount m(Shared().bucket, "whole-changed-" + how);
    ASSERT_TRUE(m.ok()) << m.Describe();
    const fs::path file = m.Version(1) / kShards[2];
    const std::vector<uint8_t>& src = SourceBytes(1, kShards[2]);
    EXPECT_EQ(Slurp(file), src);
    ASSERT_TRUE(WaitFor([&] { return Copied(m) == 1; }, std::chrono::seconds(30))) << WholeStats(m).dump();
    std::vector<fs::path> wholes;
    for (const auto& e : fs::directory_iterator(m.dir() / "cache" / "files")) {
      if (e.is_regular_file()) wholes.push_back(e.path());
    }
    ASSERT_EQ(wholes.size(), 1u);
    ChangeInPlace(wholes[0], how);
    EXPECT_EQ(Slurp(file), src);
    EXPECT_EQ(ReadMapped(file), src);
    EXPECT_TRUE(WaitFor([&] { return Copied(m) == 2; }, std::chrono::seconds(30))) << WholeStats(m).dump();
    EXPECT_EQ(Slurp(wholes[0]), src) << "copied anew";
    EXPECT_EQ(Slurp(file), src);
    EXPECT_NE(SlurpText(m.log()).find("removed the whole file"), std::string::npos);
    EXPECT_FALSE(ProcessGone(m.pid()));
  }
}

// --no-whole-files: no copies, every read through the daemon.
TEST_F(MountTest, NoWholeFilesKeepsOnlyChunks) {
  TinyMount m(Shared().bucket, "no-whole", "--no-whole-files");
  ASSERT_TRUE(m.ok()) << m.Describe();
  EXPECT_EQ(Slurp(m.Version(0) / kShards[0]), SourceBytes(0, kShards[0]));
  EXPECT_EQ(Slurp(m.Version(0) / kShards[0]), SourceBytes(0, kShards[0]));
  nlohmann::json s = m.Stats();
  EXPECT_FALSE(s.contains("whole_files")) << s.dump();
  size_t wholes = 0;
  if (fs::exists(m.dir() / "cache" / "files")) {
    for (const auto& e : fs::directory_iterator(m.dir() / "cache" / "files")) wholes += e.is_regular_file();
  }
  EXPECT_EQ(wholes, 0u);
}

}  // namespace
}  // namespace weightfs
