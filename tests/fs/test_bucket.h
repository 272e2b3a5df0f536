// TestBucket: a local-directory bucket in a temporary directory, filled in-process with
// versions of opaque files — for the fs unit tests (no FUSE). Its store is a test::FaultStore
// (tests/testing/fault_store.h): calls can be slowed down or made to fail, and are counted.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "hub/engine/bucket.h"
#include "hub/engine/version_writer.h"
#include "hub/store/local_store.h"
#include "tests/testing/fault_store.h"

namespace weightfs::testing {

inline std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; i += 8) {
    uint64_t x = rng();
    for (size_t k = 0; k < 8 && i + k < n; ++k) v[i + k] = static_cast<uint8_t>(x >> (8 * k));
  }
  return v;
}

class TestBucket {
 public:
  explicit TestBucket(const std::string& name)
      : root_(std::filesystem::temp_directory_path() /
              ("wfs-fs-" + name + "-" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_ / "bucket");
    auto local = LocalStore::Open((root_ / "bucket").string());
    EXPECT_TRUE(local.ok());
    faults_ = std::make_shared<test::FaultStore>(std::shared_ptr<Store>(std::move(local).value()));
    EXPECT_TRUE(Bucket::Init(*faults_).ok());
    auto b = Bucket::Open(faults_);
    EXPECT_TRUE(b.ok()) << b.status().ToString();
    bucket_ = std::move(b).value();
  }
  ~TestBucket() { std::filesystem::remove_all(root_); }

  // Publishes model@version with `files` (path -> bytes); its parent is the model's previous
  // push, if any.
  std::shared_ptr<const Manifest> Push(const std::string& model, const std::string& version,
                                       const std::map<std::string, std::vector<uint8_t>>& files,
                                       uint64_t chunk_bytes = 256 << 10) {
    const auto dir = root_ / "src" / model / version;
    std::vector<PushFile> push;
    for (const auto& [path, bytes] : files) {
      const auto p = dir / path;
      std::filesystem::create_directories(p.parent_path());
      std::ofstream(p, std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
      push.push_back({path, p.string()});
    }
    PushOptions options;
    options.chunk_bytes = chunk_bytes;
    options.pack_bytes = 1 << 20;
    options.cache_new_chunks = false;
    auto r = PushVersion(*bucket_, nullptr, pool_, {model, version}, parents_[model], push, options);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return nullptr;
    parents_[model] = r->manifest;
    return r->manifest;
  }

  Bucket& bucket() { return *bucket_; }
  test::FaultStore& faults() { return *faults_; }
  std::filesystem::path root() const { return root_; }

 private:
  std::filesystem::path root_;
  std::shared_ptr<test::FaultStore> faults_;
  std::unique_ptr<Bucket> bucket_;
  ThreadPool pool_{2};
  std::map<std::string, std::shared_ptr<const Manifest>> parents_;
};

}  // namespace weightfs::testing
