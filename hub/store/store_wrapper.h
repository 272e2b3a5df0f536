// StoreWrapper: a Store that forwards every call to another one — the base for stores that
// add one behaviour (counting, fault injection in tests) without re-implementing the rest.
// GetInto is not forwarded: it goes through the wrapper's Get (Store's default), so a wrapper
// that changes Get changes GetInto too; one that does not may forward it (CountingStore).
// CountingStore counts requests and payload bytes for `--stats`.
// Both are thread-safe when the wrapped store is.
#pragma once

#include <atomic>
#include <memory>

#include "hub/store/store.h"

namespace weightfs {

class StoreWrapper : public Store {
 public:
  explicit StoreWrapper(std::shared_ptr<Store> inner) : inner_(std::move(inner)) {}

  Expected<std::vector<uint8_t>> Get(std::string_view key,
                                     std::optional<ByteRange> range = std::nullopt) override {
    return inner_->Get(key, range);
  }
  Expected<std::vector<uint8_t>> GetUncached(std::string_view key,
                                             std::optional<ByteRange> range = std::nullopt) override {
    return inner_->GetUncached(key, range);
  }
  Status Put(std::string_view key, std::span<const uint8_t> data,
             PutMode mode = PutMode::kOverwrite) override {
    return inner_->Put(key, data, mode);
  }
  Expected<ObjectInfo> Head(std::string_view key) override { return inner_->Head(key); }
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                          size_t max_keys = 1000) override {
    return inner_->List(prefix, continuation, max_keys);
  }
  Status Delete(std::string_view key) override { return inner_->Delete(key); }
  Expected<std::vector<TemporaryObject>> ListTemporaries() override { return inner_->ListTemporaries(); }
  std::string Describe() const override { return inner_->Describe(); }

 protected:
  std::shared_ptr<Store> inner_;
};

struct StoreCounters {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> gets{0};
  std::atomic<uint64_t> puts{0};
  std::atomic<uint64_t> bytes_received{0};  // object bytes returned by Get
  std::atomic<uint64_t> bytes_sent{0};      // object bytes given to Put
};

class CountingStore : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;

  Expected<std::vector<uint8_t>> Get(std::string_view key,
                                     std::optional<ByteRange> range = std::nullopt) override {
    counters_.requests++;
    counters_.gets++;
    auto r = inner_->Get(key, range);
    if (r.ok()) counters_.bytes_received += r->size();
    return r;
  }
  Expected<std::vector<uint8_t>> GetUncached(std::string_view key,
                                             std::optional<ByteRange> range = std::nullopt) override {
    counters_.requests++;
    counters_.gets++;
    auto r = inner_->GetUncached(key, range);
    if (r.ok()) counters_.bytes_received += r->size();
    return r;
  }
  Status GetInto(std::string_view key, ByteRange range, ByteBuffer* out) override {
    counters_.requests++;
    counters_.gets++;
    Status s = inner_->GetInto(key, range, out);
    if (s.ok()) counters_.bytes_received += out->size();
    return s;
  }
  Status Put(std::string_view key, std::span<const uint8_t> data,
             PutMode mode = PutMode::kOverwrite) override {
    counters_.requests++;
    counters_.puts++;
    counters_.bytes_sent += data.size();
    return inner_->Put(key, data, mode);
  }
  Expected<ObjectInfo> Head(std::string_view key) override {
    counters_.requests++;
    return inner_->Head(key);
  }
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                          size_t max_keys = 1000) override {
    counters_.requests++;
    return inner_->List(prefix, continuation, max_keys);
  }
  Status Delete(std::string_view key) override {
    counters_.requests++;
    return inner_->Delete(key);
  }
  Expected<std::vector<TemporaryObject>> ListTemporaries() override {
    counters_.requests++;
    return inner_->ListTemporaries();
  }

  const StoreCounters& counters() const { return counters_; }

 private:
  StoreCounters counters_;
};

}  // namespace weightfs
