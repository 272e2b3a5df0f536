// PackWriter: bundles chunk payloads into packs of about `target_bytes` and uploads each sealed
// pack in the background as packs/<XXH3-128 of its bytes>.
//
// A pack is just its payloads back to back (each payload is self-describing, and the
// manifest records every payload's offset and length), so a pack needs no header and its name
// is a checksum of all of it. Memory is bounded: at most `max_in_flight` sealed packs wait for
// or are in upload; Add blocks (backpressure on the encoders) when that many are pending.
//
// Thread-safe: Add may be called from many threads. Finish once, after the last Add.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "core/hash.h"
#include "core/mutex.h"
#include "core/status.h"
#include "hub/store/store.h"

namespace weightfs {

struct PackSlot {
  size_t pack = 0;      // sequence number of the pack (resolve with PackWriter::PackHash)
  uint64_t offset = 0;  // of the payload inside the pack
};

class PackWriter {
 public:
  PackWriter(Store* store, uint64_t target_bytes, size_t uploaders, size_t max_in_flight);
  ~PackWriter();  // joins the uploaders (call Finish first to see errors)
  PackWriter(const PackWriter&) = delete;
  PackWriter& operator=(const PackWriter&) = delete;

  // Appends a payload; fails only if an upload already failed.
  Expected<PackSlot> Add(std::span<const uint8_t> payload) WFS_EXCLUDES(mu_);
  // Seals the last pack and waits for every upload. Returns the first upload error.
  Status Finish() WFS_EXCLUDES(mu_);
  // Called on an uploader thread after pack `seq` is in the store (its hash and size), before
  // Finish can return; not under the writer's lock. Set before the first Add.
  void set_on_uploaded(std::function<void(size_t seq, const Hash128& hash, uint64_t bytes)> f) {
    on_uploaded_ = std::move(f);
  }

  // Call once Finish() returned OK.
  Hash128 PackHash(size_t pack) const WFS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return hashes_[pack];
  }
  size_t pack_count() const WFS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return hashes_.size();
  }
  uint64_t bytes_uploaded() const WFS_EXCLUDES(mu_) {
    MutexLock lock(mu_);
    return bytes_uploaded_;
  }

 private:
  struct Sealed {
    size_t seq;
    std::vector<uint8_t> bytes;
  };
  void SealLocked() WFS_REQUIRES(mu_);
  void UploaderMain() WFS_EXCLUDES(mu_);

  Store* store_;
  const uint64_t target_bytes_;
  const size_t max_in_flight_;

  mutable Mutex mu_;
  CondVar cv_;
  std::vector<uint8_t> open_ WFS_GUARDED_BY(mu_);  // the pack being filled
  size_t open_seq_ WFS_GUARDED_BY(mu_) = 0;
  std::deque<Sealed> queue_ WFS_GUARDED_BY(mu_);
  size_t in_flight_ WFS_GUARDED_BY(mu_) = 0;  // sealed and not yet uploaded (queued or uploading)
  bool finishing_ WFS_GUARDED_BY(mu_) = false;
  Status error_ WFS_GUARDED_BY(mu_);
  std::vector<Hash128> hashes_ WFS_GUARDED_BY(mu_);  // by sequence number
  uint64_t bytes_uploaded_ WFS_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> uploaders_;
  std::function<void(size_t, const Hash128&, uint64_t)> on_uploaded_;
};

}  // namespace weightfs
