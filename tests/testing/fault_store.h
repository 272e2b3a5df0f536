// FaultStore: a Store wrapper (hub/store/store_wrapper.h) that injects faults into the calls it
// forwards, for tests of how callers handle a failing or slow bucket. A rule picks calls by
// operation and key prefix and then fails them with a given Status (the next N, after M that pass,
// or all), throws std::bad_alloc (an allocation failing inside the store), delays them, or holds
// them: a held call blocks until the test releases it, so a race can be made deterministic
// (WaitHeld says when the calls are parked). Every call is counted by operation and key.
// Thread-safe when the wrapped store is. Header-only, without GoogleTest.
//
// (tests/testing/fault_proxy.py is the same idea for HTTP buckets, in front of a real server.)
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "hub/store/store_wrapper.h"

namespace weightfs::test {

// GetInto goes through Get (StoreWrapper does not forward it), so kGet covers both.
enum class StoreOp { kGet, kPut, kHead, kList, kDelete, kListTemporaries, kAny };

class FaultStore : public StoreWrapper {
 public:
  using StoreWrapper::StoreWrapper;

  // Which calls a rule applies to: `op` (kAny: every operation) on keys starting with
  // `key_prefix` (a List's prefix, ListTemporaries' ""; empty: every key), after the first
  // `after` matching calls pass, for `times` calls (-1: for ever). Made by On(...).After(n).Times(n).
  struct Match {
    StoreOp op = StoreOp::kAny;
    std::string key_prefix;
    int after = 0;
    int times = -1;
    Match& After(int n) {
      after = n;
      return *this;
    }
    Match& Times(int n) {
      times = n;
      return *this;
    }
  };
  static Match On(StoreOp op, std::string key_prefix = {}) {
    Match m;
    m.op = op;
    m.key_prefix = std::move(key_prefix);
    return m;
  }

  // Matching calls return `status` without reaching the wrapped store.
  void Fail(Match m, Status status) { AddRule(std::move(m), Action::kFail, std::move(status), {}); }
  // Matching calls throw std::bad_alloc.
  void ThrowBadAlloc(Match m) { AddRule(std::move(m), Action::kThrow, Status::Ok(), {}); }
  // Matching calls wait `delay`, then go through.
  void Delay(Match m, std::chrono::milliseconds delay) { AddRule(std::move(m), Action::kDelay, Status::Ok(), delay); }
  // Matching calls block until Release(); then they go through.
  void Hold(Match m) { AddRule(std::move(m), Action::kHold, Status::Ok(), {}); }

  // Lets every held call go on, and removes the hold rules (a later Hold holds again).
  void Release() {
    std::lock_guard<std::mutex> lock(mu_);
    std::erase_if(rules_, [](const Rule& r) { return r.action == Action::kHold; });
    ++release_generation_;
    cv_.notify_all();
  }
  // Waits until at least `n` calls are blocked in a hold; false on timeout.
  bool WaitHeld(int n, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return held_ >= n; });
  }
  int held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }
  // Removes every rule and releases held calls; counts stay.
  void Clear() {
    Release();
    std::lock_guard<std::mutex> lock(mu_);
    rules_.clear();
  }

  // Calls of `op` (kAny: all) whose key starts with `key_prefix`, failed or not.
  uint64_t Calls(StoreOp op = StoreOp::kAny, std::string_view key_prefix = {}) const {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t n = 0;
    for (const auto& [o, k] : calls_) {
      if ((op == StoreOp::kAny || op == o) && k.starts_with(key_prefix)) ++n;
    }
    return n;
  }

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range = std::nullopt) override {
    if (auto s = Enter(StoreOp::kGet, key)) return *s;
    return inner_->Get(key, range);
  }
  Status Put(std::string_view key, std::span<const uint8_t> data, PutMode mode = PutMode::kOverwrite) override {
    if (auto s = Enter(StoreOp::kPut, key)) return *s;
    return inner_->Put(key, data, mode);
  }
  Expected<ObjectInfo> Head(std::string_view key) override {
    if (auto s = Enter(StoreOp::kHead, key)) return *s;
    return inner_->Head(key);
  }
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation = {},
                          size_t max_keys = 1000) override {
    if (auto s = Enter(StoreOp::kList, prefix)) return *s;
    return inner_->List(prefix, continuation, max_keys);
  }
  Status Delete(std::string_view key) override {
    if (auto s = Enter(StoreOp::kDelete, key)) return *s;
    return inner_->Delete(key);
  }
  Expected<std::vector<TemporaryObject>> ListTemporaries() override {
    if (auto s = Enter(StoreOp::kListTemporaries, "")) return *s;
    return inner_->ListTemporaries();
  }

 private:
  enum class Action { kFail, kThrow, kDelay, kHold };
  struct Rule {
    Match match;
    Action action;
    Status status;
    std::chrono::milliseconds delay{0};
    int seen = 0;  // matching calls so far
  };

  void AddRule(Match m, Action action, Status status, std::chrono::milliseconds delay) {
    std::lock_guard<std::mutex> lock(mu_);
    rules_.push_back(Rule{std::move(m), action, std::move(status), delay, 0});
  }

  // Counts the call and applies the rules: a Status to return instead of forwarding, or nullopt.
  std::optional<Status> Enter(StoreOp op, std::string_view key) {
    std::chrono::milliseconds delay{0};
    bool hold = false, fail = false, throw_bad_alloc = false;
    Status status;
    {
      // One critical section from the decision to the wait, so a Release between them is not missed.
      std::unique_lock<std::mutex> lock(mu_);
      calls_.emplace_back(op, std::string(key));
      for (Rule& r : rules_) {
        if ((r.match.op != StoreOp::kAny && r.match.op != op) || !key.starts_with(r.match.key_prefix)) continue;
        const int i = r.seen++;
        if (i < r.match.after || (r.match.times >= 0 && i >= r.match.after + r.match.times)) continue;
        switch (r.action) {
          case Action::kFail:
            if (!fail && !throw_bad_alloc) {
              fail = true;
              status = r.status;
            }
            break;
          case Action::kThrow:
            if (!fail) throw_bad_alloc = true;
            break;
          case Action::kDelay:
            delay += r.delay;
            break;
          case Action::kHold:
            hold = true;
            break;
        }
      }
      if (hold) {
        const uint64_t generation = release_generation_;
        ++held_;
        cv_.notify_all();
        cv_.wait(lock, [&] { return release_generation_ != generation; });
        --held_;
      }
    }
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (throw_bad_alloc) throw std::bad_alloc();
    if (fail) return status;
    return std::nullopt;
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Rule> rules_;
  std::vector<std::pair<StoreOp, std::string>> calls_;
  int held_ = 0;
  uint64_t release_generation_ = 0;
};

}  // namespace weightfs::test
