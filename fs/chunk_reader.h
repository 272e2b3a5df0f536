// ChunkReader: the read path of the mount — turns a byte range of a file of a published version
// into verified bytes, chunk by chunk:
//
//   memory cache (this class; LRU, bounded by `memory_limit` bytes)
//     -> disk cache (hub ChunkCache, consulted by the Materializer)
//       -> Materializer (nearest cached ancestor or keyframe, parallel range reads, verified)
//
// Chunks are keyed by their content hash, so identical chunks of different versions or files
// share one entry. Bytes are handed out as ChunkBytes (hub/engine/chunk_cache.h): the materializer's
// pooled buffer the chunk was built in or read from the disk cache into, or a heap buffer —
// private memory, verified once, that no change to a cache file can reach. A reply can point
// into them (fuse_reply_iov) while the cache is free to evict them; Read never copies them.
//
// Single flight: concurrent readers of one chunk share one materialization. The first caller
// materializes on its own thread; the others wait on its shared_future. No lock is held across
// the materialization (network and disk I/O, decoding).
//
// Readahead: a ReadStream (one per open file handle) notices sequential reads and queues the
// chunks after the current one, up to `readahead_bytes`, on a small pool of background threads
// with a bounded queue. "Sequential" means more than the kernel's own readahead window
// (which reads past whatever an application reads) of consecutive bytes. A reader that reads
// one tensor (safetensors' mmap, a loader picking tensors) must not pay for its neighbours: the
// window stays inside the tensor being read until the stream has read well past the end of the
// tensor it started in (it reads the file, like cat or cp).
// Readahead never blocks a read and its failures are not reported (the read that needs the
// chunk materializes it again and reports the error).
//
// Memory: at most `memory_limit` bytes of cached chunks, plus the chunks in flight (one per
// reading thread and per readahead thread) and the buffers that replies still hold.
//
// Thread-safe.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/bytes.h"
#include "core/manifest.h"
#include "core/mutex.h"
#include "core/thread_annotations.h"
#include "hub/engine/materializer.h"
#include "fs/work_queue.h"

namespace weightfs {

struct ChunkReaderOptions {
  // The mount's memory budget: chunks kept in memory get what is left of it after a reserve
  // for the work in flight (ChunkReader::CacheBudget).
  uint64_t memory_limit = 1ull << 30;
  // How far ahead of a sequential reader; 0 = off. Raised to keep every readahead thread busy.
  uint64_t readahead_bytes = 32ull << 20;
  size_t readahead_threads = 0;  // 0: one per core, at least 2, at most 8 (and what memory allows)
  size_t readahead_queue = 16;  // waiting readahead jobs beyond which new ones are dropped
};

struct ChunkReaderStats {
  std::atomic<uint64_t> reads{0};
  std::atomic<uint64_t> read_bytes{0};
  std::atomic<uint64_t> memory_hits{0};
  std::atomic<uint64_t> materializations{0};  // Materializer calls (a disk-cache hit counts)
  std::atomic<uint64_t> shared_waits{0};      // callers that joined a materialization in flight
  std::atomic<uint64_t> failures{0};
  std::atomic<uint64_t> readahead_queued{0};
  std::atomic<uint64_t> readahead_dropped{0};  // queue full
  std::atomic<uint64_t> evictions{0};
  std::atomic<uint64_t> builds_peak{0};  // most materializations running at once
};

// Sequential-access state of one open file: a heuristic. Thread-safe (reads of one handle run
// concurrently with FUSE's async reads); a race between them only affects readahead.
class ReadStream {
 public:
  ReadStream() = default;

 private:
  friend class ChunkReader;
  static constexpr uint64_t kNoRead = ~0ull;
  std::atomic<uint64_t> next_offset_{kNoRead};  // end of the previous read
  std::atomic<uint64_t> run_start_{0};     // where this sequential run started
  std::atomic<uint64_t> home_end_{0};      // end of the first tensor of this sequential run
  std::atomic<int64_t> queued_until_{-1};  // last chunk index queued for readahead
  std::atomic<bool> streaming_{false};     // read well past home_end_: readahead across tensors
};

// The bytes of one read: `iov` points into `chunks`, valid while this object lives; `rows` are
// the chunks' rows (hash, offset and length in the file), one for each of `chunks`.
struct ReadResult {
  std::vector<ChunkBytes> chunks;
  std::vector<ChunkRef> rows;
  std::vector<iovec> iov;
  size_t size = 0;
};

class ChunkReader {
 public:
  using ChunkResult = Expected<std::shared_ptr<const ByteBuffer>>;
  using BytesResult = Expected<ChunkBytes>;

  // `materializer` must outlive the reader.
  ChunkReader(Materializer* materializer, ChunkReaderOptions options);
  // Drops queued readahead and waits for running readahead jobs.
  ~ChunkReader();
  ChunkReader(const ChunkReader&) = delete;
  ChunkReader& operator=(const ChunkReader&) = delete;

  // Verified bytes of chunk `index` of `file` (a file of `*manifest`).
  // REQUIRES: index < file.chunks.size().
  BytesResult Bytes(const std::shared_ptr<const Manifest>& manifest, const ManifestFile& file,
                    size_t index);
  // The same as a heap buffer: shared when the chunk is held as one, else a copy of the pooled
  // buffer (prefer Bytes, which never copies).
  ChunkResult Chunk(const std::shared_ptr<const Manifest>& manifest, const ManifestFile& file,
                    size_t index);

  // Bytes [offset, offset + size) of `file`, clipped to its size (empty past the end).
  // `stream` (may be null) drives readahead. An error names the version, file and chunk.
  // Readahead jobs hold `file` (a format 2 file's rows are their own object in the bucket's
  // byte-bounded cache, not the manifest's: a job that outlived the open file and the cache's
  // copy would read freed rows).
  Expected<ReadResult> Read(const std::shared_ptr<const Manifest>& manifest,
                            const std::shared_ptr<const ManifestFile>& file, uint64_t offset, size_t size,
                            ReadStream* stream);
  // The same for a file whose rows are the manifest's own (format 1, a full manifest).
  Expected<ReadResult> Read(const std::shared_ptr<const Manifest>& manifest, const ManifestFile& file,
                            uint64_t offset, size_t size, ReadStream* stream) {
    return Read(manifest, std::shared_ptr<const ManifestFile>(manifest, &file), offset, size, stream);
  }

  // The chunk with this hash if it is in the memory cache now (its place in the LRU unchanged:
  // a copy reading a file back must not push out what readers use), else empty.
  std::optional<ChunkBytes> Cached(const Hash128& hash) const;

  // Chunks of the files this says yes to are built without a copy into the disk cache (their
  // reader writes them elsewhere: fs/whole_files.h). Called for every build, from any thread,
  // before and after it: a chunk built while it said yes is put into the disk cache if it says
  // no once the chunk is in memory. Set once, before the first read.
  void set_skip_disk_cache(std::function<bool(const ManifestFile&)> skip) { skip_disk_cache_ = std::move(skip); }

  // Queues the materialization of a chunk unless it is cached, in flight or queued already.
  // Never blocks. False if the queue was full (the chunk was not queued). The job holds `file`.
  bool Prefetch(const std::shared_ptr<const Manifest>& manifest, const std::shared_ptr<const ManifestFile>& file,
                size_t index);

  uint64_t cached_bytes() const;
  // Queue depths, now: chunk builds running, and readahead jobs waiting to start.
  size_t builds_running() const;
  size_t readahead_waiting() const { return readahead_.pending(); }
  const ChunkReaderStats& stats() const { return stats_; }

  // How memory_limit is spent. The process itself (code, libraries, manifests, FUSE request
  // buffers, the disk cache's write-behind queue of at most 16 MiB, the whole files being
  // written: two 8 MiB staging buffers each, at most two at once, fs/whole_files.h) gets
  // kBaseBytes; each chunk build in flight kBuildBytes (its output, payloads, a
  // pooled codec with its planes and class buffers, scratch); the chunks kept in memory the
  // rest. MaxBuilds() builds run at once, readers beyond wait: without that bound, 16 FUSE
  // threads reading 16 chunks measured twice a 128 MiB limit. memory_limit >= kMinMemoryLimit.
  static constexpr uint64_t kBaseBytes = 64ull << 20;
  static constexpr uint64_t kBuildBytes = 16ull << 20;
  static constexpr uint64_t kMinMemoryLimit = 128ull << 20;
  // A quarter of what the base leaves, in builds, 1 to 16.
  static size_t MaxBuilds(uint64_t memory_limit);
  static uint64_t CacheBudget(uint64_t memory_limit);
  // What the bucket's caches of version heads and file tables get (Bucket::set_metadata_budget):
  // an eighth, 16 MiB to 1 GiB. The chunks kept in memory get the rest after it.
  static uint64_t MetadataBudget(uint64_t memory_limit);
  // Readahead threads for `options` (see ChunkReaderOptions::readahead_threads), at most
  // MaxBuilds.
  static size_t ReadaheadThreads(const ChunkReaderOptions& options);

 private:
  struct HashOf {
    size_t operator()(const Hash128& h) const { return static_cast<size_t>(h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull)); }
  };
  struct Entry {
    ChunkBytes bytes;
    std::list<Hash128>::iterator lru;
  };

  // Notes the read [offset, end) (ending in chunk `last`) on `stream` and queues readahead
  // if the stream is sequential.
  void Readahead(const std::shared_ptr<const Manifest>& manifest, const std::shared_ptr<const ManifestFile>& file,
                 uint64_t offset, uint64_t end, size_t last, ReadStream* stream);
  void InsertLocked(const Hash128& hash, ChunkBytes bytes) WFS_REQUIRES(mu_);

  Materializer* const materializer_;
  const ChunkReaderOptions options_;
  std::function<bool(const ManifestFile&)> skip_disk_cache_;
  const size_t max_builds_;         // MaxBuilds(options_.memory_limit)
  const uint64_t cache_budget_;     // CacheBudget(options_.memory_limit)
  const size_t readahead_threads_;  // ReadaheadThreads(options_)
  const uint64_t readahead_bytes_;  // options_.readahead_bytes, adjusted (see the constructor)

  // Lock order: mu_ is never held across a materialization, a reply or a readahead_ call.
  mutable Mutex mu_;
  std::unordered_map<Hash128, Entry, HashOf> cache_ WFS_GUARDED_BY(mu_);
  std::list<Hash128> lru_ WFS_GUARDED_BY(mu_);  // most recently used first
  uint64_t cached_bytes_ WFS_GUARDED_BY(mu_) = 0;
  std::unordered_map<Hash128, std::shared_future<BytesResult>, HashOf> inflight_ WFS_GUARDED_BY(mu_);
  std::unordered_set<Hash128, HashOf> queued_ WFS_GUARDED_BY(mu_);  // readahead jobs not started yet

  // Builds running (at most max_builds_); a reader that would exceed it waits on build_done_.
  mutable Mutex builds_mu_;
  CondVar build_done_;
  size_t builds_ WFS_GUARDED_BY(builds_mu_) = 0;

  ChunkReaderStats stats_;
  // Last member: destroyed first, so no readahead job outlives the state above.
  WorkQueue readahead_;
};

}  // namespace weightfs
