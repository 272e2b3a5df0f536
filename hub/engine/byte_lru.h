// ByteLru: a cache of immutable values by key, bounded by the bytes they take (each value's
// size is given when it is inserted), least recently used out first. Values are shared: one
// evicted while a caller still holds it lives on with that caller. GetOrLoad loads a missing
// value once however many callers want it at the same time (single flight). Thread-safe.
// (The read path's memory cache of chunks, fs/chunk_reader.h, keeps its own: keyed by chunk
// hash, holding mapped or pooled buffers, its single flight bounded by the build slots.)
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>

#include "core/mutex.h"
#include "core/status.h"

namespace weightfs {

template <class T>
class ByteLru {
 public:
  explicit ByteLru(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  std::shared_ptr<const T> Get(const std::string& key) {
    MutexLock lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second.pos);
    return it->second.value;
  }
  bool Contains(const std::string& key) const {
    MutexLock lock(mu_);
    return map_.count(key) > 0;
  }
  // Inserts (or keeps the value already there, which it returns: racing loaders agree).
  std::shared_ptr<const T> Put(const std::string& key, std::shared_ptr<const T> value, uint64_t bytes) {
    MutexLock lock(mu_);
    if (auto it = map_.find(key); it != map_.end()) return it->second.value;
    if (bytes > max_bytes_) return value;  // larger than the whole cache: not kept
    order_.push_front(key);
    map_.emplace(key, Entry{value, bytes, order_.begin()});
    bytes_ += bytes;
    while (bytes_ > max_bytes_ && !order_.empty()) {
      auto victim = map_.find(order_.back());
      bytes_ -= victim->second.bytes;
      map_.erase(victim);
      order_.pop_back();
    }
    return value;
  }
  // The value of `key`, loaded by `load` when it is missing and kept at the size `bytes` gives.
  // Concurrent callers of a missing key wait for one load; it runs without the lock, and a
  // failure (or a null value) is not kept. `*hit`: whether the value was there or another
  // caller's load.
  using Value = std::shared_ptr<const T>;
  Expected<Value> GetOrLoad(const std::string& key, const std::function<Expected<Value>()>& load,
                            const std::function<uint64_t(const T&)>& bytes, bool* hit = nullptr) {
    std::shared_ptr<std::promise<Expected<Value>>> mine;
    std::shared_future<Expected<Value>> theirs;
    {
      MutexLock lock(mu_);
      if (auto it = map_.find(key); it != map_.end()) {
        order_.splice(order_.begin(), order_, it->second.pos);
        if (hit) *hit = true;
        return it->second.value;
      }
      if (auto it = loading_.find(key); it != loading_.end()) {
        theirs = it->second;
      } else {
        mine = std::make_shared<std::promise<Expected<Value>>>();
        loading_.emplace(key, mine->get_future().share());
      }
    }
    if (hit) *hit = !mine;
    if (!mine) return theirs.get();
    Expected<Value> result = Status::IOError("not loaded");
    try {
      result = load();
    } catch (const std::bad_alloc&) {
      result = Status::ResourceExhausted("out of memory loading " + key);
    }
    if (result.ok() && *result) result = Put(key, *result, bytes(**result));
    {
      MutexLock lock(mu_);
      loading_.erase(key);
    }
    mine->set_value(result);
    return result;
  }
  void Erase(const std::string& key) {
    MutexLock lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) return;
    bytes_ -= it->second.bytes;
    order_.erase(it->second.pos);
    map_.erase(it);
  }
  // Erases every key starting with `prefix`.
  void ErasePrefix(const std::string& prefix) {
    MutexLock lock(mu_);
    for (auto it = order_.begin(); it != order_.end();) {
      if (it->starts_with(prefix)) {
        auto e = map_.find(*it);
        bytes_ -= e->second.bytes;
        map_.erase(e);
        it = order_.erase(it);
      } else {
        ++it;
      }
    }
  }
  void set_max_bytes(uint64_t max_bytes) {
    MutexLock lock(mu_);
    max_bytes_ = max_bytes;
    while (bytes_ > max_bytes_ && !order_.empty()) {
      auto victim = map_.find(order_.back());
      bytes_ -= victim->second.bytes;
      map_.erase(victim);
      order_.pop_back();
    }
  }
  uint64_t bytes() const {
    MutexLock lock(mu_);
    return bytes_;
  }
  uint64_t max_bytes() const {
    MutexLock lock(mu_);
    return max_bytes_;
  }

 private:
  struct Entry {
    std::shared_ptr<const T> value;
    uint64_t bytes;
    std::list<std::string>::iterator pos;
  };
  mutable Mutex mu_;
  uint64_t max_bytes_ WFS_GUARDED_BY(mu_);
  uint64_t bytes_ WFS_GUARDED_BY(mu_) = 0;
  std::list<std::string> order_ WFS_GUARDED_BY(mu_);  // most recent first
  std::unordered_map<std::string, Entry> map_ WFS_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::shared_future<Expected<Value>>> loading_ WFS_GUARDED_BY(mu_);
};

}  // namespace weightfs
