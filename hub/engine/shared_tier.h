// SharedTierStore: a read-through cache of a bucket's objects on a store that every node of a
// cluster can reach (issue 28, `--shared-cache URL`): an in-cluster S3-compatible store, a WebDAV
// server, or a directory on a shared file system. K inference nodes following one RL run then
// fetch each step's packs from the bucket once, not K times. It is a Store wrapper: the Bucket
// reads through it and knows nothing of it. docs/shared-cache.md has the design and figures.
//
// What goes through the tier, by key (hub/engine/bucket.h names them):
//   packs/, tables/           immutable (named by their contents' hash): cached in fixed slices
//                             of `slice_bytes`, so a reader of 4 MiB never waits for a whole
//                             1 GiB pack; a slice is read back from the tier by range.
//   models/*/versions/*.json  heads, and weightfs.json: rewritten in place now and then (gc's
//                             rebase, `weightfs upgrade`), so a copy in the tier is used for
//                             `head_ttl` after it was filled and fetched again after that; a
//                             reader that must see a rewrite (Bucket::Revalidate) calls
//                             GetUncached, which also refreshes the tier's copy.
//   everything else           (listings, time markers, leases, staging, writes): the bucket.
//
// A miss is filled once for the cluster: the first node to miss a slice creates its fill marker
// in the tier (create-if-absent, holding an expiry), fetches the slice from the bucket and puts
// it; nodes that miss meanwhile poll for it, at most `max_wait` and never past the marker's
// expiry (a dead filler's marker is removed), then fetch from the bucket themselves. In one
// process, concurrent misses of a slice share one fill.
//
// Nothing from the tier is trusted: each tier object carries a header (magic, the bucket key
// and offset it holds, its fill time) and an XXH3-64 per block of `block_bytes`, checked on
// every read. A corrupt, truncated, foreign or stale object is a miss and a log line (then
// filled again); a tier that fails or times out is skipped for `backoff` and costs speed, never
// an error: every read the tier cannot serve goes to the bucket. Errors from the bucket itself
// are returned as they are.
//
// Bounded: with `max_bytes` set, a node that filled `max_bytes`/16 since its last check lists
// the tier and removes the objects filled longest ago (by their names' fill epoch) until the
// tier is back under 90% of it. Without it the tier's own lifecycle rules bound it.
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/mutex.h"
#include "hub/engine/byte_lru.h"
#include "hub/engine/rate_limited_log.h"
#include "hub/store/store_wrapper.h"

namespace weightfs {

struct SharedTierOptions {
  // Packs and tables are cached in slices of this many bytes; a pack (at most ~32 MiB plus a
  // payload when weightfs writes it) is then one or two tier objects and one fill.
  uint64_t slice_bytes = 32ull << 20;
  // Each slice is checked in blocks of this size: a reader of one payload reads (and checks)
  // only the blocks it needs.
  uint32_t block_bytes = 64u << 10;
  // Fill the next slice of an object ahead of a reader reading its slices one after another.
  bool read_ahead = true;
  // A fill fetches its slice from the bucket in this many ranged reads at once.
  uint64_t fetch_parts = 4;
  // A fill marker says the filler is done or dead after this long (it fetches one slice).
  std::chrono::milliseconds fill_timeout{60'000};
  // The longest a node waits for another node's fill before fetching the bucket itself.
  std::chrono::milliseconds max_wait{30'000};
  // How long a head copied into the tier is used (heads can be rewritten in place).
  std::chrono::milliseconds head_ttl{60'000};
  // After the tier fails (down, timing out, refusing), reads go to the bucket this long.
  std::chrono::milliseconds backoff{10'000};
  // Parsed slice headers kept in memory (a header is ~8 KiB for a 32 MiB slice).
  uint64_t header_cache_bytes = 16ull << 20;
  // --shared-cache-size: 0 leaves the bound to the tier's lifecycle rules.
  uint64_t max_bytes = 0;
  // Names this node in fill markers (host and pid by default).
  std::string node;
};

struct SharedTierStats {
  std::atomic<uint64_t> hits{0};            // reads served from the tier
  std::atomic<uint64_t> misses{0};          // reads the tier did not have (filled or waited for)
  std::atomic<uint64_t> fills{0};           // objects this node fetched from the bucket and put
  std::atomic<uint64_t> waits{0};           // misses that waited for another node's fill
  std::atomic<uint64_t> wait_timeouts{0};   // ... and gave up waiting (then read the bucket)
  std::atomic<uint64_t> corrupt{0};         // tier objects that failed their checks
  std::atomic<uint64_t> errors{0};          // tier requests that failed (then the bucket)
  std::atomic<uint64_t> bypassed{0};        // reads sent to the bucket while the tier backs off
  std::atomic<uint64_t> evictions{0};       // tier objects this node removed for --shared-cache-size
  std::atomic<uint64_t> bytes_received{0};  // bytes read from the tier
  std::atomic<uint64_t> bytes_filled{0};    // bytes this node put into the tier
  std::atomic<uint64_t> prefetches{0};      // slices filled ahead of a reader reading on
};

class SharedTierStore : public StoreWrapper {
 public:
  // `origin`: the bucket. `tier`: the shared store. `bucket_id`: names the bucket in the tier
  // (its URL), so one tier can serve several buckets.
  SharedTierStore(std::shared_ptr<Store> origin, std::shared_ptr<Store> tier, const std::string& bucket_id,
                  SharedTierOptions options = {});
  ~SharedTierStore() override;

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range = std::nullopt) override;
  Expected<std::vector<uint8_t>> GetUncached(std::string_view key, std::optional<ByteRange> range = std::nullopt) override;

  // Returns once every fill this process fetched is in the tier (or failed to go there).
  void Flush();

  const SharedTierStats& stats() const { return stats_; }
  const std::string& tier_prefix() const { return prefix_; }
  std::string DescribeTier() const { return tier_->Describe(); }

 private:
  enum class Kind { kNone, kSliced, kTimed };
  struct Header;
  // What a fill left: the slice's bytes when this process fetched them; else they are in the tier
  // (in_tier), or nobody could put them there (read the bucket).
  struct FillResult {
    std::shared_ptr<const std::vector<uint8_t>> data;
    bool in_tier = false;
  };

  static Kind KindOf(std::string_view key);
  std::string SliceKey(std::string_view key, uint64_t index) const;
  // Bytes [offset, offset+length) of slice `index` of `key`, and the slice's size (short: the
  // object ends in it).
  // nullopt: the tier cannot serve it (read the bucket).
  Expected<std::optional<std::pair<std::vector<uint8_t>, uint64_t>>> ReadSlice(std::string_view key, Kind kind,
                                                                                uint64_t index, uint64_t offset,
                                                                                uint64_t length);
  // The slice's header from memory or the tier; nullptr: not in the tier (or not usable).
  Expected<std::shared_ptr<const Header>> ReadHeader(const std::string& tier_key, std::string_view key, Kind kind,
                                                     uint64_t index);
  // Blocks of the slice covering [offset, offset+length) from the tier, checked.
  Expected<std::vector<uint8_t>> ReadBlocks(const std::string& tier_key, const Header& h, uint64_t offset,
                                            uint64_t length);
  // One fill of the slice for this process (concurrent callers share it). `recheck`: look in the
  // tier again once the fill marker is taken (not when the tier's copy just failed its checks).
  Expected<FillResult> Fill(std::string_view key, Kind kind, uint64_t index, bool recheck);
  Expected<FillResult> FillAcrossNodes(std::string_view key, Kind kind, uint64_t index, bool recheck);
  // Fetches the slice from the bucket and puts it into the tier.
  // Fetches the slice from the bucket for its reader, and queues it for the tier.
  Expected<FillResult> FetchAndPut(std::string_view key, Kind kind, uint64_t index, const std::string& tier_key);
  // A fetched slice on its way into the tier; its fill marker goes once it is there.
  struct PendingPut {
    std::string key;
    Kind kind;
    uint64_t index;
    std::string tier_key;
    std::shared_ptr<const std::vector<uint8_t>> data;
  };
  void PutFilled(const PendingPut& p);
  void PutLoop();
  // Slice `index` of `key` was served: when it follows the slice served before it, the next one
  // is filled ahead, by one thread (at most 4 waiting).
  void ReadOn(std::string_view key, uint64_t index);
  void PrefetchLoop();
  // The tier object of `data` (the bytes at `offset` of `key`): header, block hashes, bytes.
  std::vector<uint8_t> BuildObject(std::string_view key, uint64_t offset, std::span<const uint8_t> data,
                                   Header* header) const;
  Expected<std::vector<uint8_t>> FetchSlice(std::string_view key, Kind kind, uint64_t index);

  // A tier request failed: counts and logs it, and backs off.
  void TierFailed(const Status& status);
  void Corrupt(const std::string& tier_key, const std::string& why);
  bool BackingOff() const;
  void MaybeEvict(uint64_t filled_now);

  std::shared_ptr<Store> tier_;
  SharedTierOptions options_;
  std::string prefix_;  // "weightfs-tier/<16 hex>/"
  SharedTierStats stats_;
  ByteLru<Header> headers_;
  RateLimitedLog tier_log_{"shared cache failures (reads went to the bucket)"};
  RateLimitedLog corrupt_log_{"corrupt shared cache objects (read from the bucket instead)"};
  std::atomic<int64_t> backoff_until_ms_{0};  // steady clock, ms
  Mutex fills_mu_;
  std::map<std::string, std::shared_future<Expected<FillResult>>> fills_ WFS_GUARDED_BY(fills_mu_);
  // Puts behind the readers: at most kMaxQueuedSlices slices' bytes waiting (then the filler
  // puts its own), by kPutThreads threads.
  static constexpr int kPutThreads = 2;
  static constexpr uint64_t kMaxQueuedSlices = 4;
  Mutex put_mu_;
  CondVar put_cv_;
  std::deque<PendingPut> puts_ WFS_GUARDED_BY(put_mu_);
  // The bytes of every slice on its way into the tier, by tier key: this process's readers
  // read them here (the tier has not got them, and their marker is this process's own).
  std::map<std::string, std::shared_ptr<const std::vector<uint8_t>>> pending_ WFS_GUARDED_BY(put_mu_);
  uint64_t queued_bytes_ WFS_GUARDED_BY(put_mu_) = 0;
  int putting_ WFS_GUARDED_BY(put_mu_) = 0;
  bool stopping_ WFS_GUARDED_BY(put_mu_) = false;
  std::vector<std::thread> putters_;
  Mutex prefetch_mu_;
  CondVar prefetch_cv_;
  std::deque<std::pair<std::string, uint64_t>> prefetch_queue_ WFS_GUARDED_BY(prefetch_mu_);
  std::map<std::string, uint64_t> last_slice_ WFS_GUARDED_BY(prefetch_mu_);  // object -> furthest slice read
  std::set<std::string> prefetched_ WFS_GUARDED_BY(prefetch_mu_);            // tier keys queued once
  std::atomic<bool> closing_{false};
  std::thread prefetcher_;
  std::atomic<uint64_t> filled_since_check_{0};
  std::atomic<bool> evicting_{false};
};

}  // namespace weightfs
