// ChunkCache: a local directory of materialized chunks, content-addressed by their Hash128 —
// the disk tier between a bucket and its readers.
//
// Layout: <dir>/chunks/<first 2 hex>/<32 hex> holds a chunk's raw bytes; <32 hex>.ref instead
// holds a reference to the chunk's bytes in a local file (path, offset, file size and mtime):
// what `push` and `pull` record for the files they read or wrote, so that the next push or pull
// finds its parent's chunks without a second copy on disk. A reference whose file changed or
// vanished is a miss (and is dropped). <dir>/chunks/.tmp/ holds inserts in progress;
// <dir>/chunks/.lock serializes eviction between processes.
//
// - Verified on read: every Get hashes the bytes and drops an entry that does not match (a torn
//   or corrupted file is a miss, never wrong data).
// - Size-bounded: at most `max_bytes` of chunk files. When an insert takes the total above it,
//   the least recently used entries (file mtime, refreshed on hits) are removed until the total
//   is below 90% of the bound. A chunk larger than the bound is not cached at all.
// - Safe for concurrent processes: an insert writes a temporary file and renames it into
//   place (two processes inserting the same hash write the same bytes); eviction runs under
//   flock(.lock) and rescans the directory, so it sees what other processes inserted.
// - A full disk (ENOSPC) on insert evicts and retries once, then gives up on that insert: the
//   cache is an optimization, a failed insert never fails the read that caused it.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/bytes.h"
#include "core/hash.h"
#include "core/status.h"

namespace weightfs {

struct ChunkCacheStats {
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> misses{0};
  std::atomic<uint64_t> inserts{0};
  std::atomic<uint64_t> evictions{0};
  std::atomic<uint64_t> corrupt{0};  // entries that failed verification and were dropped
};

class ChunkCache {
 public:
  // Creates the directory if needed and scans it for the current size.
  static Expected<std::unique_ptr<ChunkCache>> Open(const std::string& dir, uint64_t max_bytes);

  // True and the bytes in *out if the chunk is cached and verifies.
  bool Get(const Hash128& hash, ByteBuffer* out);
  // True if an entry exists (not verified; Get may still miss).
  bool Contains(const Hash128& hash) const;
  // Inserts a chunk whose bytes the caller has verified against `hash`. Errors are logged and
  // returned but callers may ignore them.
  Status Put(const Hash128& hash, std::span<const uint8_t> bytes);
  // Records that bytes [offset, offset + length) of the local file `path` are the chunk `hash`
  // (the caller verified them). Costs a small entry, not a copy.
  Status PutReference(const Hash128& hash, const std::string& path, uint64_t offset,
                      uint64_t length);

  uint64_t size_bytes() const { return total_.load(); }
  uint64_t max_bytes() const { return max_bytes_; }
  const std::string& dir() const { return dir_; }
  const ChunkCacheStats& stats() const { return stats_; }

  // Removes least recently used entries until the total is at most `target` bytes.
  Status EvictTo(uint64_t target);

 private:
  ChunkCache(std::string dir, uint64_t max_bytes) : dir_(std::move(dir)), max_bytes_(max_bytes) {}
  std::string PathOf(const Hash128& hash) const;
  Status WriteEntry(const std::string& path, std::span<const uint8_t> bytes);
  bool GetReference(const Hash128& hash, ByteBuffer* out);

  const std::string dir_;  // <dir>/chunks
  const uint64_t max_bytes_;
  std::atomic<uint64_t> total_{0};  // this process's view; resynced by every eviction scan
  std::mutex evict_mu_;             // one eviction at a time in this process (flock for others)
  ChunkCacheStats stats_;
};

}  // namespace weightfs
