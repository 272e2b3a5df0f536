// MemStore: the Store contract (hub/store/store.h) over a map in memory, for tests and fuzz targets
// that need a bucket without a disk or a server. It validates keys, honours PutMode
// (create-if-absent is a Conflict when the key exists), clips ranges, paginates listings by the
// last key, and passes the store conformance suite (tests/hub/store/mem_store_conformance_test.cc).
// It can also record the byte ranges its Gets served (SetRecordReads, TakeReads), and hands out
// an object's bytes for a test to inspect or damage in place (Object). Thread-safe, except
// Object's reference.
// Header-only, without GoogleTest (the fuzz targets use it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hub/store/store.h"

namespace weightfs::test {

class MemStore : public Store {
 public:
  explicit MemStore(std::string name = "mem://test") : name_(std::move(name)) {}

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range = std::nullopt) override {
    if (Status v = ValidateKey(key); !v.ok()) return v;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return Status::NotFound(std::string(key));
    const std::vector<uint8_t>& b = it->second;
    const uint64_t off = range ? range->offset : 0;
    if (off > b.size()) {
      return Status::InvalidArgument("offset " + std::to_string(off) + " past the end of " + std::string(key));
    }
    uint64_t len = b.size() - off;
    if (range && range->length) len = std::min(len, *range->length);
    if (record_reads_) reads_.push_back({std::string(key), off, off + len});
    return std::vector<uint8_t>(b.begin() + static_cast<std::ptrdiff_t>(off),
                                b.begin() + static_cast<std::ptrdiff_t>(off + len));
  }

  Status Put(std::string_view key, std::span<const uint8_t> data, PutMode mode = PutMode::kOverwrite) override {
    if (Status v = ValidateKey(key); !v.ok()) return v;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it != objects_.end()) {
      if (mode == PutMode::kCreateIfAbsent) return Status::Conflict(std::string(key) + " exists");
      it->second.assign(data.begin(), data.end());
    } else {
      objects_.emplace(std::string(key), std::vector<uint8_t>(data.begin(), data.end()));
    }
    return Status::Ok();
  }

  Expected<ObjectInfo> Head(std::string_view key) override {
    if (Status v = ValidateKey(key); !v.ok()) return v;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return Status::NotFound(std::string(key));
    return ObjectInfo{it->first, it->second.size()};
  }

  // Keys starting with `prefix`, after `continuation` (any string: "keys after it"), at most
  // `max_keys`; the continuation is the page's last key when more follow, else empty.
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                          size_t max_keys = 1000) override {
    std::lock_guard<std::mutex> lock(mu_);
    ListPage page;
    const size_t limit = std::max<size_t>(max_keys, 1);
    auto it = continuation.empty() || continuation < prefix ? objects_.lower_bound(prefix)
                                                            : objects_.upper_bound(continuation);
    for (; it != objects_.end() && it->first.starts_with(prefix); ++it) {
      if (page.objects.size() == limit) {
        page.continuation = page.objects.back().key;
        break;
      }
      page.objects.push_back({it->first, it->second.size()});
    }
    return page;
  }

  Status Delete(std::string_view key) override {
    if (Status v = ValidateKey(key); !v.ok()) return v;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(key);
    if (it == objects_.end()) return Status::NotFound(std::string(key));
    objects_.erase(it);
    return Status::Ok();
  }

  std::string Describe() const override { return name_; }

  // A byte range one Get served: [begin, end) of `key`.
  struct Read {
    std::string key;
    uint64_t begin = 0, end = 0;
  };
  // The reads served since the last call, once SetRecordReads(true) turned recording on.
  std::vector<Read> TakeReads() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(reads_, {});
  }
  void SetRecordReads(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    record_reads_ = on;
    if (!on) reads_.clear();
  }

  // The stored bytes of `key` (created empty if absent), to inspect or change in place. The
  // reference is not guarded: use it while no other thread calls the store.
  std::vector<uint8_t>& Object(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu_);
    return objects_[key];
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return objects_.size();
  }

 private:
  const std::string name_;
  mutable std::mutex mu_;
  std::map<std::string, std::vector<uint8_t>, std::less<>> objects_;
  bool record_reads_ = false;
  std::vector<Read> reads_;
};

}  // namespace weightfs::test
