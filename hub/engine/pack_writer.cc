#include "hub/engine/pack_writer.h"

#include <spdlog/spdlog.h>

#include "hub/engine/bucket.h"

namespace weightfs {

PackWriter::PackWriter(Store* store, uint64_t target_bytes, size_t uploaders, size_t max_in_flight)
    : store_(store), target_bytes_(target_bytes), max_in_flight_(std::max<size_t>(1, max_in_flight)) {
  for (size_t i = 0; i < std::max<size_t>(1, uploaders); ++i) {
    try {
      uploaders_.emplace_back([this] { UploaderMain(); });
    } catch (const std::exception&) {
      if (uploaders_.empty()) throw;  // nothing would upload
      break;                          // fewer uploaders
    }
  }
}

PackWriter::~PackWriter() {
  {
    MutexLock lock(mu_);
    finishing_ = true;
  }
  cv_.NotifyAll();
  for (std::thread& t : uploaders_) t.join();
}

void PackWriter::SealLocked() {
  // Backpressure: wait for room before adding another sealed pack.
  cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return in_flight_ < max_in_flight_ || !error_.ok(); });
  if (!error_.ok()) return;
  queue_.push_back({open_seq_++, std::move(open_)});
  hashes_.emplace_back();
  open_ = {};
  ++in_flight_;
  cv_.NotifyAll();
}

Expected<PackSlot> PackWriter::Add(std::span<const uint8_t> payload) {
  MutexLock lock(mu_);
  if (!error_.ok()) return error_;
  if (!open_.empty() && open_.size() + payload.size() > target_bytes_) {
    SealLocked();
    if (!error_.ok()) return error_;
  }
  if (open_.empty()) open_.reserve(std::max<uint64_t>(target_bytes_, payload.size()));
  PackSlot slot{open_seq_, open_.size()};
  open_.insert(open_.end(), payload.begin(), payload.end());
  return slot;
}

Status PackWriter::Finish() {
  MutexLock lock(mu_);
  if (!open_.empty() && error_.ok()) SealLocked();
  cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return in_flight_ == 0 || !error_.ok(); });
  // Wait for uploads already running even after an error, so none outlives the caller's view.
  return error_;
}

void PackWriter::UploaderMain() {
  MutexLock lock(mu_);
  while (true) {
    cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return !queue_.empty() || finishing_; });
    if (queue_.empty()) return;
    Sealed pack = std::move(queue_.front());
    queue_.pop_front();
    if (!error_.ok()) {
      --in_flight_;
      cv_.NotifyAll();
      continue;
    }
    lock.Unlock();
    const Hash128 hash = HashChunk(pack.bytes);
    Status s;
    std::string key;
    try {  // on a thread of its own: nothing may escape (an allocation failing fails the upload)
      key = Bucket::PackKey(hash);
      s = store_->Put(key, pack.bytes);
    } catch (...) {
      s = StatusOfCurrentException("uploading a pack");
    }
    if (!s.ok()) spdlog::error("uploading {} ({} bytes) failed: {}", key, pack.bytes.size(), s.ToString());
    else spdlog::debug("uploaded {} ({} bytes)", key, pack.bytes.size());
    const size_t size = pack.bytes.size();
    pack.bytes = {};
    if (s.ok() && on_uploaded_) on_uploaded_(pack.seq, hash, size);
    lock.Lock();
    if (s.ok()) {
      hashes_[pack.seq] = hash;
      bytes_uploaded_ += size;
    } else if (error_.ok()) {
      error_ = std::move(s);
      try {
        error_ = error_.WithContext("uploading pack " + key);
      } catch (...) {
      }
    }
    --in_flight_;
    cv_.NotifyAll();
  }
}

}  // namespace weightfs
