// The kit of the tests that drive real mounts of the weightfs binary with drafts (write path):
// DraftMountTest (its mounts are tests/testing/mount_fixture.h's Mount, torn down even when a
// test fails), a fixture with a generated model, a local bucket, fresh-mount read
// back checks, a tmpfs and servers (nginx, a fault-injecting proxy) on demand.
//
// Every wait is bounded; a hung command fails the test instead of leaving mounts behind.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/hash.h"
#include "fs/mount_point.h"
#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/test_servers.h"

namespace weightfs::test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;
using Result = CommandResult;
using namespace std::chrono_literals;

// ---- files -------------------------------------------------------------------------------------

inline void WriteFile(const fs::path& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t x = rng();
    for (size_t k = 0; k < 8 && i + k < n; ++k) v[i + k] = static_cast<uint8_t>(x >> (8 * k));
  }
  return v;
}

inline std::string Sha256Of(const fs::path& p) { return Sha256Hex(Slurp(p)); }

// sha256sum (a real reader of the mount) of `p`.
inline std::string Sha256sum(const fs::path& p) {
  Result r = Shell("sha256sum " + p.string());
  return r.exit_code == 0 ? r.out.substr(0, 64) : "sha256sum failed: " + r.out;
}

// ---- the fixture -------------------------------------------------------------------------------

class DraftMountTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = CheckFuseDevice(); !s.ok()) FAIL() << "these tests need FUSE: " << s.message();
    ASSERT_TRUE(tmp_.ok());
    root_ = tmp_.path();
    bucket_ = (root_ / "bucket").string();
  }
  void TearDown() override {
    mounts_.clear();  // (unmounts before the servers and the tmpfs below go)
    proxy_.reset();
    nginx_.reset();
    for (auto it = tmpfs_.rbegin(); it != tmpfs_.rend(); ++it) {
      if (::umount2(it->c_str(), 0) != 0) ::umount2(it->c_str(), MNT_DETACH);
    }
  }

  // gen OUT --params P --versions N --lr 1e-6 (OUT/v000..).
  fs::path Generate(const std::string& params, int versions, const std::string& extra = "") {
    const fs::path out = root_ / "gen";
    Result g = Cli("gen " + out.string() + " --params " + params + " --versions " + std::to_string(versions) +
                   " --lr 1e-6 " + extra);
    EXPECT_EQ(g.exit_code, 0) << g.out;
    gen_ = out;
    return out;
  }
  fs::path Source(int k) const {
    char buf[16];
    std::snprintf(buf, sizeof buf, "v%03d", k);
    return gen_ / buf;
  }

  // init the bucket and push GEN/v000 as m/x@v0.
  void InitWithBase(const std::string& bucket = "") {
    const std::string b = bucket.empty() ? bucket_ : bucket;
    Result i = Cli("init " + b);
    ASSERT_EQ(i.exit_code, 0) << i.out;
    Result p = Cli("push " + b + " m/x@v0 " + Source(0).string() + " --cache-dir " + (root_ / "c0").string());
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }

  // A mount of the bucket (or `bucket`) at ROOT/<name>/mnt with cache ROOT/<name>/cache.
  Mount& NewMount(const std::string& name, const std::string& extra = "", const std::string& bucket = "",
                  const fs::path& cache = {}) {
    const fs::path dir = root_ / name;
    fs::create_directories(dir);
    mounts_.push_back(std::make_unique<Mount>(bucket.empty() ? bucket_ : bucket, dir / "mnt",
                                              cache.empty() ? dir / "cache" : cache, dir / "log.txt", extra));
    return *mounts_.back();
  }

  // `weightfs log BUCKET --json`: version -> entry, for model m/x (or `model`).
  std::map<std::string, Json> Versions(const std::string& bucket = "", const std::string& model = "m/x") {
    std::map<std::string, Json> out;
    Json log = CliJson("log " + (bucket.empty() ? bucket_ : bucket) + " --json");
    EXPECT_TRUE(log.is_array()) << log.dump();
    if (!log.is_array()) return out;
    for (const Json& v : log) {
      if (v.value("model", "") == model) out[v.value("version", "")] = v;
    }
    return out;
  }

  // Every file of `version_dir` (on a mount) equals the file of the same path in `source`, and
  // there are no others. sha256sum reads the mount; the version's xattrs must agree.
  void ExpectSameFiles(const fs::path& version_dir, const fs::path& source) {
    SCOPED_TRACE(version_dir.string() + " vs " + source.string());
    EXPECT_EQ(FilesUnder(version_dir), FilesUnder(source));
    for (const std::string& f : FilesUnder(source)) {
      const std::string want = Sha256Of(source / f);
      EXPECT_EQ(Sha256sum(version_dir / f), want) << f;
      if (auto x = GetXattr(version_dir / f, "user.weightfs.sha256")) {
        EXPECT_EQ(*x, want) << f;
      }
    }
  }

  // Mounts the bucket afresh (new mount point, empty cache directory) and checks every
  // version in `expect` (model@version -> source directory) file by file.
  void ExpectFreshMountReads(const std::map<std::string, fs::path>& expect, const std::string& bucket = "",
                             const std::string& extra = "") {
    Mount& fresh = NewMount("fresh" + std::to_string(++fresh_mounts_), extra, bucket);
    ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
    for (const auto& [name, source] : expect) {
      ASSERT_TRUE(fs::is_directory(fresh.Dir(name))) << name << " is not on a fresh mount";
      ExpectSameFiles(fresh.Dir(name), source);
    }
    Result u = fresh.Unmount();
    EXPECT_EQ(u.exit_code, 0) << u.out;
  }

  // A tmpfs of `size` at `dir`, unmounted at teardown.
  bool MountTmpfs(const fs::path& dir, const std::string& size) {
    fs::create_directories(dir);
    const std::string opts = "size=" + size;
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) != 0) return false;
    tmpfs_.push_back(dir);
    return true;
  }

  // Python (with numpy) runs `script`, written to a file first.
  Result Python(const std::string& script, const std::string& args) {
    const fs::path file = root_ / ("script" + std::to_string(++scripts_) + ".py");
    std::ofstream(file) << script;
    return Shell("timeout -k 5 120 /usr/bin/python3 " + file.string() + " " + args);
  }

  // A WebDAV bucket's server (and a proxy in front of it), stopped after the mounts are gone.
  NginxServer& Nginx() {
    if (!nginx_) nginx_ = std::make_unique<NginxServer>();
    return *nginx_;
  }
  weightfs::test::FaultProxy& Proxy() {
    if (!proxy_) proxy_ = std::make_unique<weightfs::test::FaultProxy>();
    return *proxy_;
  }
  // Starts both: a WebDAV bucket at *direct, and the same through the proxy at *via_proxy,
  // whose stalls (once the test sets a stall mode) last `stall_seconds`.
  void StartProxiedWebDav(double stall_seconds, std::string* direct, std::string* via_proxy) {
    ASSERT_TRUE(Nginx().Start());
    weightfs::test::FaultProxy::Options options;
    options.stall_seconds = stall_seconds;
    ASSERT_TRUE(Proxy().Start(Nginx().url(), options));
    *direct = Nginx().url() + "/bucket";
    *via_proxy = Proxy().url() + "/bucket";
  }

  TempDir tmp_{"write"};
  std::unique_ptr<NginxServer> nginx_;
  std::unique_ptr<weightfs::test::FaultProxy> proxy_;
  fs::path root_, gen_;
  std::string bucket_;
  std::vector<std::unique_ptr<Mount>> mounts_;
  std::vector<fs::path> tmpfs_;
  int fresh_mounts_ = 0, scripts_ = 0;
};


inline int Errno(int rc) { return rc == 0 ? 0 : errno; }

}  // namespace weightfs::test
