// ChunkCache: a local directory of materialized chunks, content-addressed by their Hash128 —
// the disk tier between a bucket and its readers.
//
// Layout:
// - <dir>/chunks/<first 2 hex>/<32 hex> holds a chunk's raw bytes.
// - <dir>/refs/<32 hex of HashChunk(absolute path)> is the reference index of one local file:
//   which of its byte ranges are which chunks. Push writes one per file it read, PullVersion
//   (given ReadOptions::cache) one per file it wrote (PutReferences), so that the next push or
//   pull finds its parent's chunks in those files without a second copy on disk, and without a
//   cache file per chunk (a 2 TB checkpoint of 4 MiB chunks is 500,000 chunks: 500,000 tiny
//   files cost gigabytes of inodes and minutes). (`weightfs pull` caches copies instead: a
//   pulled directory is often deleted once loaded.)
//   The bytes (spec in hub/engine/reference_index.h): a magic line, the file's size and mtime (ns),
//   the path, rows of {hash, offset, length} (32 bytes a row), a checksum. The size and mtime
//   are the file's when the index was written: a file whose size or mtime differ now
//   (rewritten, truncated, touched) or that is gone makes the whole index stale; a read
//   through it is a miss, and the index file is removed. An index file that fails validation
//   (magic, lengths, a row past the file's end, the checksum, a name that is not its path's
//   hash, not a regular file) is skipped, removed and logged — never trusted, never a crash.
//   Lookups go through an in-memory index (hash -> file, offset, length) built on the first
//   lookup from every file under refs/ (newest first), updated by this process's
//   PutReferences, and rescanned on a miss when refs/ changed (its mtime; at most once a
//   `rescan_interval`): another process's pull shows up in a running mount. It is bounded by
//   `reference_index_bytes` (about 64 bytes a row: a hash-map node and its bucket; the default
//   64 MiB holds about a million rows, 4 TB of 4 MiB chunks); index files beyond it are not
//   loaded (logged once) and their chunks are misses: fetched from the bucket, correct but
//   slower. Index files count in the cache's size like chunk files, and are evicted with them
//   (least recently used first; a hit refreshes its index file's mtime at most once a minute).
// - <dir>/chunks/<first 2 hex>/<32 hex>.ref is the older form of a reference (one file per
//   chunk: magic line, offset, length, file size and mtime, path), still read so that an
//   upgraded node finds what it recorded before; nothing writes them any more.
// - <dir>/chunks/.tmp/ holds inserts in progress (of chunks and of index files);
//   <dir>/chunks/.lock serializes eviction between processes.
// - <dir>/files/<sha256>-<size> is a whole file: a complete copy of a published file that a
//   mount read whole (fs/whole_files.h), written once front to back by a WholeFileWriter from
//   verified chunks (<dir>/files/.tmp/ while in progress), synced, renamed into place and
//   indexed in refs/ like any local file (its index file named after the whole file's name, not
//   its path, so that the cache directory can move), so that its chunks are found in it; the chunk files it
//   replaces are then removed (a node following a run keeps each version once, as files, not
//   as a copy of every chunk beside them). A whole file and its index file are one entry of
//   the size bound: the index file's mtime is their LRU time, and eviction removes both.
//   OpenWholeFile hands out a descriptor of one only while its size and mtime are the ones
//   indexed; one changed since (or without its index) is dropped. The mount gives that
//   descriptor to the kernel (FUSE passthrough: docs/mount.md), which then serves reads and
//   maps of the file from it without asking the daemon: those bytes are not hashed on each
//   read, as a local file's are not; every chunk read out of it here still is.
//
// - Verified on read, never served from the file: every read copies the entry into memory the
//   caller owns (a heap buffer, or a buffer the caller provides: GetInto) and hashes that copy,
//   so what a caller gets is exactly what was verified whatever happens to the file afterwards.
//   Entries are files that anyone with access can change in place — another process, a disk
//   tool, a repair — and a shared map of one would show such a change to readers after the
//   check (a flipped byte served as a wrong byte, a truncated file as zeros or SIGBUS). So a
//   file flipped, overwritten, truncated or appended to, at any moment, is a miss, never wrong
//   data: the read sees a hash mismatch, or fewer bytes than the file had when it was opened,
//   and drops the entry (if the path still names the file it read).
// - Cheap hits: GetInto reads into the caller's buffer, so the materializer reads hits into its
//   pooled buffers, already faulted in; a hit costs the kernel's copy out of the page cache
//   (fresh anonymous pages would cost a fault per 4 KiB, ~10 us each on the 2-core benchmark VM).
// - Zero-copy writes: PutAligned writes from the builder's (reused, aligned) buffer with
//   O_DIRECT, so inserting a chunk neither copies it into the page cache nor fills the page
//   cache with a second copy of what the reader's own page cache is about to hold. Entries are
//   only ever replaced by rename and removed by unlink. References point at users' files,
//   which may change in place: their bytes are read into the caller's buffer and verified the
//   same way.
// - Size-bounded: at most `max_bytes` of chunk, index and whole files. When an insert takes the total
//   above it, the least recently used entries (file mtime, refreshed on hits) are removed until
//   the total is below 90% of the bound. A chunk larger than the bound is not cached at all.
// - Safe for concurrent processes: an insert writes a temporary file and renames it into
//   place (two processes inserting the same hash write the same bytes); eviction runs under
//   flock(.lock) and rescans the directory, so it sees what other processes inserted.
// - A full disk (ENOSPC) on insert evicts and retries once, then gives up on that insert: the
//   cache is an optimization, a failed insert never fails the read that caused it. Failures of
//   inserts, evictions and corrupt entries are logged at most once a minute each, with a count
//   of the ones not logged (RateLimitedLog): a full disk fails every chunk.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/bytes.h"
#include "core/hash.h"
#include "core/mutex.h"
#include "core/status.h"
#include "hub/engine/rate_limited_log.h"
#include "hub/engine/reference_index.h"

namespace weightfs {

// The bytes of one chunk, shared and immutable: a heap buffer, or memory held by an owner (the
// materializer's pooled buffers). Copies share the bytes, which stay valid while any copy (or
// owner()) lives. Never a map of a file (see ChunkCache).
class ChunkBytes {
 public:
  ChunkBytes() = default;
  // Heap bytes.
  explicit ChunkBytes(ByteBuffer buffer);
  explicit ChunkBytes(std::shared_ptr<const ByteBuffer> buffer);
  // Bytes owned by `owner`, which nothing else writes while it lives.
  ChunkBytes(std::shared_ptr<const void> owner, std::span<const uint8_t> bytes)
      : owner_(std::move(owner)), data_(bytes.data()), size_(bytes.size()) {}

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  std::span<const uint8_t> span() const { return {data_, size_}; }
  // Keeps the bytes alive.
  const std::shared_ptr<const void>& owner() const { return owner_; }
  // The heap buffer when the bytes are one (null for an owner's bytes).
  const std::shared_ptr<const ByteBuffer>& buffer() const { return buffer_; }

 private:
  std::shared_ptr<const void> owner_;
  std::shared_ptr<const ByteBuffer> buffer_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct ChunkCacheStats {
  std::atomic<uint64_t> hits{0};
  std::atomic<uint64_t> misses{0};
  std::atomic<uint64_t> inserts{0};
  std::atomic<uint64_t> evictions{0};
  std::atomic<uint64_t> corrupt{0};  // entries that failed verification and were dropped
};

struct ChunkCacheOptions {
  // Memory bound of the in-memory reference index (about 64 bytes a row; see the layout above).
  uint64_t reference_index_bytes = 64ull << 20;
  // A lookup that misses rescans refs/ for other processes' index files at most this often
  // (and only when the directory's mtime changed).
  std::chrono::steady_clock::duration rescan_interval = std::chrono::seconds(1);
  // How the bytes of a whole file (an older version a delta applies to) are read when they are
  // not in the page cache: false, through it (with readahead: `weightfs patch`, which reads the
  // same OLD at every step); true, around it (O_DIRECT: the mount, whose reader is the kernel's
  // page cache of the new version; reading the base through the page cache too took twice the
  // fresh memory and, on the benchmark VM, 1.5x the time of row 3 of scripts/bench_step.sh).
  // Either way a range whose pages are all cached is read from the cache.
  bool whole_reads_around_page_cache = false;
};

class ChunkCache;

// Writes one whole file (see ChunkCache's layout) front to back: ChunkCache::BeginWholeFile,
// then Append of each of its chunks in order, then Finish (or Complete, and Commit later).
// Destroyed uncommitted, it removes what it wrote. Two ways to the disk:
//   - kDirect: with O_DIRECT from aligned staging buffers (through the page cache where the
//     filesystem refuses it), so that the copy does not fill the page cache, on a thread of its
//     own: Append fills one buffer while the one before is written (a reader whose chunks are
//     appended as it reads waits for the disk only when it is a buffer ahead).
//   - kPageCache: each Append is a plain write of the caller's bytes (no staging buffer): the
//     kernel writes the file back when it chooses, or at Commit's sync. For a file written as a
//     reader reads it (fs/whole_files.h): its writes then do not take the disk from the reads
//     (on the benchmark VM, reading N+1 while writing it O_DIRECT took 2x the time of the read
//     alone), and its pages are the ones the kernel serves the next opens from. The dirty pages
//     are bounded by the kernel's dirty limits (vm.dirty_*), whose writeback throttles Append.
// The file is allocated at its full size first (fallocate: a full disk fails at the start, and
// the file is not fragmented by the reads interleaved with its writes). Not thread-safe.
class WholeFileWriter {
 public:
  static constexpr size_t kStagingBytes = 8 << 20;  // written in parts of this much
  static constexpr size_t kBuffers = 2;             // one filled while the other is written
  enum class Mode { kDirect, kPageCache };
  ~WholeFileWriter();
  WholeFileWriter(const WholeFileWriter&) = delete;
  WholeFileWriter& operator=(const WholeFileWriter&) = delete;

  // The file's next chunk: `row` says where it is and its hash, which the caller has verified
  // `bytes` against. Rows come in file order and tile the file.
  Status Append(const ChunkRef& row, std::span<const uint8_t> bytes);
  // Complete, then Commit.
  Status Finish();
  // Writes the rest (the staging buffers, the last block's padding cut off). REQUIRES: the
  // rows appended tile the whole file.
  Status Complete();
  // After Complete: syncs the file, moves it into place, indexes it and removes the chunk
  // files it replaces. Nothing serves the file before (a crash before it leaves no file).
  Status Commit();
  bool complete() const { return complete_; }
  // Gives up on the file (before Commit): every chunk appended so far that the cache holds
  // nowhere else is put into it as a chunk file (read back from what was written, verified), so
  // that what a reader had stays cached; the partial file then goes with this object. Returns
  // the chunks put.
  size_t Spill();
  // Bytes appended so far.
  uint64_t written() const { return flushed_ + used_; }
  uint64_t size() const { return size_; }

 private:
  friend class ChunkCache;
  WholeFileWriter(ChunkCache* cache, std::string tmp, std::string dest, uint64_t size, int fd, bool direct,
                  Mode mode);
  // kPageCache: writes `bytes` at flushed_.
  Status WriteThrough(std::span<const uint8_t> bytes);
  // Hands the staging buffer's first `length` bytes (at file offset flushed_) to the writing
  // thread and moves on to a free buffer (waiting for one). The first error of any write.
  Status Submit(size_t length) WFS_EXCLUDES(mu_);
  // Waits until everything handed over is written; the first error of any write.
  Status Drain() WFS_EXCLUDES(mu_);
  void WriterMain() WFS_EXCLUDES(mu_);

  ChunkCache* const cache_;
  const std::string tmp_, dest_;
  const uint64_t size_;
  int fd_;
  uint8_t* region_ = nullptr;   // kBuffers x kStagingBytes, aligned (2 MiB), huge pages advised
  size_t region_bytes_ = 0;
  size_t current_ = 0;          // the buffer being filled
  uint8_t* staging_ = nullptr;  // region_ + current_ * kStagingBytes
  size_t used_ = 0;             // bytes in staging_
  uint64_t flushed_ = 0;        // file offset of staging_[0]: bytes handed over before it
  std::vector<ChunkRef> rows_;
  const Mode mode_;
  bool complete_ = false;
  bool finished_ = false;  // committed

  struct Write {
    size_t buffer;
    uint64_t offset;
    size_t length;
  };
  Mutex mu_;
  CondVar cv_;
  std::deque<Write> writes_ WFS_GUARDED_BY(mu_);
  bool busy_[kBuffers] WFS_GUARDED_BY(mu_) = {};  // handed over, not yet written
  bool direct_ WFS_GUARDED_BY(mu_);
  Status error_ WFS_GUARDED_BY(mu_);
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::thread writer_;
};

class ChunkCache {
 public:
  // Creates the directory if needed and scans it for the current size. The reference index is
  // read on the first lookup, not here.
  static Expected<std::unique_ptr<ChunkCache>> Open(const std::string& dir, uint64_t max_bytes,
                                                    const ChunkCacheOptions& options = {});
  ~ChunkCache();

  // Where GetInto reads an entry: called with the entry's size, returns a buffer of exactly that
  // many bytes that nothing else writes until GetInto returns. May throw (std::bad_alloc), which
  // GetInto passes on.
  using Output = std::function<std::span<uint8_t>(size_t size)>;

  // True if the chunk is cached and the copy of it read into output(size) verifies against
  // `hash`. False is a miss; output may have been called, and what it returned then holds
  // unspecified bytes. `aligned`: output's buffers start on a 4 KiB boundary and have room for
  // the size rounded up to 4 KiB; an entry is then read with O_DIRECT, straight into them.
  bool GetInto(const Hash128& hash, const Output& output, bool aligned = false);
  // GetInto a heap buffer: true and the bytes in *out.
  bool Get(const Hash128& hash, ByteBuffer* out);
  // True if an entry or a reference exists (not verified; Get may still miss). May load the
  // reference index (the first lookup does).
  bool Contains(const Hash128& hash);
  // Inserts a chunk whose bytes the caller has verified against `hash`. Errors are logged and
  // returned but callers may ignore them.
  Status Put(const Hash128& hash, std::span<const uint8_t> bytes);
  // Put from a buffer that starts on a 4 KiB boundary and may be read up to `capacity` bytes
  // (at least bytes.size() rounded up to 4 KiB): written with O_DIRECT, so the bytes go to the
  // disk without a copy into (and without filling) the page cache. Falls back to Put where the
  // filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE filesystems).
  Status PutAligned(const Hash128& hash, std::span<const uint8_t> bytes, size_t capacity);
  // PutAligned on a background thread, so that the builder (and the reader waiting for its
  // chunk) does not wait for the disk: `bytes` keeps the buffer alive until it is written.
  // Written at once by the caller, as PutAligned, when write-behind is off or the queue holds
  // its bound already (back-pressure: an entry is never dropped for want of room).
  void PutBehind(const Hash128& hash, ChunkBytes bytes, size_t capacity) WFS_EXCLUDES(behind_mu_);
  // Put on the write-behind thread when write-behind is on: `bytes` is copied into an aligned
  // buffer of a small pool (reused, so no fresh pages per chunk) and queued as PutBehind (the
  // caller's buffer is free at once); Put when it is off. For `weightfs patch`, which caches
  // each chunk of NEW it builds: its builds no longer wait for an O_DIRECT write each (the
  // patch waited on the disk for a third of its time).
  void PutCopyBehind(const Hash128& hash, std::span<const uint8_t> bytes) WFS_EXCLUDES(behind_mu_, copies_mu_);
  // Lets PutBehind queue up to `bytes` of entries (0, the default: no queue). The queue is
  // written out before the cache is destroyed, and by Flush().
  void set_write_behind(uint64_t bytes) WFS_EXCLUDES(behind_mu_);
  // Waits until every entry queued so far is written.
  void Flush() WFS_EXCLUDES(behind_mu_);
  // Records that the rows' byte ranges of the local file `path` (absolute) are their chunks (the
  // caller verified them): one index file for the whole file, replacing the one written for
  // `path` before, stamped with the file's size and mtime as stat'ed now. Costs 32 bytes a
  // row on disk, not a copy. Empty rows write nothing. Errors are logged and returned but
  // callers may ignore them.
  Status PutReferences(const std::string& path, std::span<const ChunkRef> rows);

  // Whole files (see the layout above). The name a file of this content has in files/.
  std::string WholeFilePath(const std::string& sha256, uint64_t size) const;
  // Starts the whole file of a published file (its manifest's SHA-256, lowercase hex, and size),
  // making room for it in the bound first. InvalidArgument for a bad digest; Conflict
  // when the cache holds it already; ResourceExhausted when it is larger than half the bound
  // (its copy would evict what the cache holds for it).
  Expected<std::unique_ptr<WholeFileWriter>> BeginWholeFile(
      const std::string& sha256, uint64_t size, WholeFileWriter::Mode mode = WholeFileWriter::Mode::kDirect);
  // A read-only descriptor (O_RDONLY | O_CLOEXEC; the caller closes it) of the whole file of this
  // content if the cache holds it as it was indexed (same size and mtime); -1 if not. Refreshes
  // its LRU time (at most once a minute). A whole file that changed since it was indexed, or
  // whose index is gone, is removed.
  int OpenWholeFile(const std::string& sha256, uint64_t size);
  bool HasWholeFile(const std::string& sha256, uint64_t size);

  uint64_t size_bytes() const { return total_.load(); }
  uint64_t max_bytes() const { return max_bytes_; }
  const std::string& dir() const { return dir_; }
  const ChunkCacheStats& stats() const { return stats_; }

  // Removes least recently used entries until the total is at most `target` bytes.
  Status EvictTo(uint64_t target) WFS_EXCLUDES(evict_mu_);

 private:
  struct RefIndex;  // the in-memory reference index (chunk_cache.cc)
  struct RefHit;
  friend class WholeFileWriter;

  // After a whole file was written and renamed to `path`: counts it, indexes `rows` and removes
  // the chunk files they replace (once the index is loaded: else they stay).
  Status AddWholeFile(const std::string& path, uint64_t size, std::span<const ChunkRef> rows);
  // Whether `path` is a whole file of this cache's.
  bool IsWholeFile(const std::string& path) const { return path.starts_with(files_dir_ + "/"); }
  // The name of `path`'s index file under refs/: the hash of its path, or of a whole file's name.
  std::string IndexNameOf(const std::string& path) const;
  // The bytes [offset, +length) of a whole file (`fd`, opened by the caller for this read) into
  // `out`: from the page cache if it holds them all, else as options_.whole_reads_around_page_cache
  // says (through the cache with readahead of the next 2 * length, or O_DIRECT).
  bool ReadWholeRange(int fd, uint8_t* out, uint64_t length, uint64_t offset) const;

  ChunkCache(std::string dir, uint64_t max_bytes, const ChunkCacheOptions& options);
  std::string PathOf(const Hash128& hash) const;
  // Writes `bytes` to a temporary file and renames it to `path`; with a `direct_capacity` (as
  // PutAligned's capacity) through O_DIRECT where the filesystem allows.
  Status WriteEntry(const std::string& path, std::span<const uint8_t> bytes, size_t direct_capacity);
  Status PutImpl(const Hash128& hash, std::span<const uint8_t> bytes, size_t direct_capacity);
  // WriteEntry within the size bound: evicts first when the entry takes the total above it, and
  // once more on a full disk. `replaced`: bytes of the entry it replaces (0 if none).
  Status Insert(const std::string& path, std::span<const uint8_t> bytes, size_t direct_capacity,
                uint64_t replaced);
  // A hit through the reference index (loaded, or rescanned after a miss, as needed).
  bool GetIndexed(const Hash128& hash, const Output& output);
  // Finds `hash` in the index; a rescan of refs/ after a miss when `rescan`.
  bool FindIndexed(const Hash128& hash, bool rescan, RefHit* hit);
  // Reads refs/ into the index: every index file it does not hold yet (the first time, all),
  // and forgets the ones gone. REQUIRES: refs_->scan_mu held (not an attribute: RefIndex is
  // incomplete here).
  void ScanRefs();
  // Forgets the index file `id` (if still loaded): its file changed or is gone. Removes the index
  // file if it is still the one (dev, ino) that was loaded.
  void DropStaleRefs(uint32_t id, const std::string& why);
  // An index file from the format before refs/: <hash>.ref beside the chunk files.
  bool GetLegacyReference(const Hash128& hash, const Output& output);
  // Removes the entry at `path` (`size` bytes) if it is still the file (dev, ino) that was read —
  // another process may have replaced it with a good one meanwhile — and logs why.
  void DropCorrupt(const std::string& path, uint64_t dev, uint64_t ino, uint64_t size,
                   const std::string& why);

  const std::string dir_;       // <dir>/chunks
  const std::string refs_dir_;  // <dir>/refs
  const std::string files_dir_;  // <dir>/files
  const uint64_t max_bytes_;
  const ChunkCacheOptions options_;
  const std::unique_ptr<RefIndex> refs_;
  std::atomic<uint64_t> total_{0};  // this process's view; resynced by every eviction scan
  Mutex evict_mu_;                  // one eviction at a time in this process (flock for others)
  // Write-behind (PutBehind): entries waiting for the writer thread, and their bytes.
  struct Behind {
    Hash128 hash;
    ChunkBytes bytes;
    size_t capacity = 0;
  };
  void WriterMain() WFS_EXCLUDES(behind_mu_);
  // PutCopyBehind's aligned buffers, free for the next (at most kMaxFreeCopies kept).
  static constexpr size_t kMaxFreeCopies = 8;
  Mutex copies_mu_;
  std::vector<std::pair<uint8_t*, size_t>> copies_free_ WFS_GUARDED_BY(copies_mu_);  // buffer, capacity
  Mutex behind_mu_;
  CondVar behind_cv_;
  std::deque<Behind> behind_ WFS_GUARDED_BY(behind_mu_);
  uint64_t behind_bytes_ WFS_GUARDED_BY(behind_mu_) = 0;
  uint64_t behind_limit_ WFS_GUARDED_BY(behind_mu_) = 0;
  bool behind_writing_ WFS_GUARDED_BY(behind_mu_) = false;  // the writer holds an entry
  bool behind_stop_ WFS_GUARDED_BY(behind_mu_) = false;
  std::thread writer_;  // started by the first set_write_behind with a bound
  std::atomic<bool> direct_ok_{true};  // false once the filesystem refused O_DIRECT
  // Staging buffers of whole files (WholeFileWriter::kBuffers of them a region), kept for the next.
  uint8_t* TakeStaging() WFS_EXCLUDES(staging_mu_);
  void GiveStaging(uint8_t* region) WFS_EXCLUDES(staging_mu_);
  Mutex staging_mu_;
  std::vector<uint8_t*> staging_free_ WFS_GUARDED_BY(staging_mu_);
  ChunkCacheStats stats_;
  RateLimitedLog failed_inserts_{"failed chunk cache inserts"};
  RateLimitedLog failed_evictions_{"failed chunk cache evictions"};
  RateLimitedLog corrupt_entries_{"corrupt chunk cache entries dropped"};
};

}  // namespace weightfs
