// Materializer: produces the verified bytes of any chunk of any published version.
//
// For chunk c of version V it walks c's recipe chain back — V's payload is a delta against the
// same chunk of an older version, whose manifest holds that chunk's own recipe, and so on —
// until it reaches bytes already in the chunk cache (the nearest cached ancestor) or a
// keyframe. Only the payloads after that point are fetched (range reads into packs, in
// parallel), then applied forward, and the final bytes are checked against their Hash128 and
// inserted into the cache. A node that holds version N therefore fetches only N+1's deltas.
//
// Verification: the bytes returned always match the chunk's Hash128 (checked here, or by the
// cache when they come from it). Intermediate results of a chain are not hashed with Hash128 —
// the codec checks each delta's parent against the XXH3-64 in the payload before applying it,
// and any wrong intermediate makes the final check fail; only then is the chain replayed
// checking every step, so that the error names the chunk that is wrong.
//
// Memory: intermediate results live in a small pool of reused buffers (2 MiB pages), and codecs
// are pooled too: fresh memory costs a page fault per 4 KiB (~10 us each on the 2-core benchmark
// VM, about what decoding the page costs). Shared() hands out the pooled buffer a chunk was built
// in (written to the disk cache from there with O_DIRECT) or read from the disk cache into (and
// verified there); the buffer returns to the pool when its last reader lets go. Nothing handed
// out is a map of a cache file: such a file can be changed in place after it was checked.
//
// Fetching overlaps applying: payloads are fetched oldest first, and each step is applied as
// soon as its payload is in (the keyframe decodes while the deltas are still being fetched).
//
// Every failure names the version, file and chunk. Thread-safe: any number of threads may
// materialize at once (each call uses its own codec).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "core/bytes.h"
#include "core/chunk_codec.h"
#include "core/manifest.h"
#include "core/mutex.h"
#include "hub/engine/bucket.h"
#include "hub/engine/chunk_cache.h"

namespace weightfs {

struct MaterializerStats {
  std::atomic<uint64_t> chunks{0};            // chunks materialized (cache hits included)
  std::atomic<uint64_t> cache_hits{0};        // chunks served whole from the cache
  std::atomic<uint64_t> payloads_fetched{0};
  std::atomic<uint64_t> payload_bytes{0};     // payload bytes fetched from the bucket
  std::atomic<uint64_t> deltas_applied{0};
  // Chunks built from payloads (not cache hits): how many, their bytes, the payloads each
  // chain applied (keyframe or cached ancestor's successors: its depth) summed and at most,
  // and time: the whole build, and the part not spent waiting for fetches (decoding).
  std::atomic<uint64_t> builds{0};
  std::atomic<uint64_t> built_bytes{0};
  std::atomic<uint64_t> chain_steps{0};
  std::atomic<uint64_t> chain_depth_max{0};
  std::atomic<uint64_t> build_ns{0};
  std::atomic<uint64_t> decode_ns{0};
  // Chunks built again after a head of their chain was found rewritten in the bucket (gc).
  std::atomic<uint64_t> rewritten_heads{0};
};

class Materializer {
 public:
  // `cache` may be null (every chunk then comes from the bucket: what `verify` wants).
  Materializer(Bucket* bucket, ChunkCache* cache, DecodeLimits limits = {});

  // The bytes of chunk `index` of `file` in `manifest`, verified against the chunk's hash.
  Expected<ByteBuffer> Chunk(const Manifest& manifest, const ManifestFile& file,
                                       size_t index);
  // The same bytes, shared and immutable: chunks of at least kPooledMinBytes in the pooled buffer
  // they were read from the cache into or built in (a heap copy when they would fill less than
  // 8/9 of it), smaller ones in a heap buffer. The read path of the mount keeps these in memory.
  // Private memory either way: verified once, they cannot change.
  // `cache_result` false: a chunk built is not put into the disk cache (its caller keeps it).
  Expected<ChunkBytes> Shared(const Manifest& manifest, const ManifestFile& file, size_t index,
                              bool cache_result = true);

  // Puts a chunk built with cache_result false (verified) into the disk cache after all.
  void CacheResult(const Hash128& hash, std::span<const uint8_t> bytes) {
    if (cache_ && cache_results_) (void)cache_->Put(hash, bytes);
  }

  // Prepares `builds` concurrent chunk builds of up to `chunk_bytes`: codecs that have decoded a
  // FULL keyframe and a SPARSE delta of that size, and faulted-in scratch buffers, all returned
  // to the pools. The mount runs it in the background as it starts: a first read then costs its
  // decoding only, not ~40 ms of page faults and table set-up (measured on the 2-core VM).
  void Warm(size_t builds, uint64_t chunk_bytes);

  Bucket* bucket() const { return bucket_; }
  // Caps what the pools keep between builds (default 16 codecs, 64 MiB of scratch buffers);
  // what is pooled beyond the new caps is freed now. A mount sets them from its memory budget.
  void set_pool_limits(size_t codecs, uint64_t scratch_bytes) WFS_EXCLUDES(pool_mu_);

  // Below this size Shared() uses a heap buffer rather than a pooled one: small allocations are
  // recycled by malloc, and a pooled buffer is at least 2 MiB.
  static constexpr uint64_t kPooledMinBytes = 128 << 10;

  const MaterializerStats& stats() const { return stats_; }
  // Whether materialized chunks are copied into the cache (default). `pull` turns it off: it
  // records references to the files it writes instead.
  void set_cache_results(bool on) { cache_results_ = on; }

 private:
  // A reusable output buffer: anonymous memory in 2 MiB-aligned regions advised MADV_HUGEPAGE,
  // so that growing one costs a fault per 2 MiB instead of one per 4 KiB page.
  class Scratch {
   public:
    Scratch() = default;
    Scratch(Scratch&& other) noexcept;
    Scratch& operator=(Scratch&& other) noexcept;
    ~Scratch();
    // Sizes the buffer to `size` bytes (contents unspecified). Throws std::bad_alloc. The
    // buffer starts on a 2 MiB boundary with room for `size` rounded up to 2 MiB (the chunk
    // cache reads into it with O_DIRECT: GetInto's `aligned`).
    std::span<uint8_t> Resize(size_t size);
    std::span<const uint8_t> bytes() const { return {data_, size_}; }
    size_t capacity() const { return capacity_; }

   private:
    uint8_t* data_ = nullptr;
    size_t size_ = 0;
    size_t capacity_ = 0;
  };

  // Walks the chain of chunk `index` back to a cached ancestor or a keyframe, fetches and applies
  // it. The result goes into output(length), which returns a buffer of that many bytes. Does not
  // look the chunk itself up in the cache nor insert it. REQUIRES: index < file.chunks.size().
  //
  // Heads can be rewritten in place (gc --keep-last rebases the versions it keeps onto new
  // keyframes, then deletes the old tables and the retired versions' packs): a process that
  // read a head before holds rows whose payloads or bases may be gone. A chain that fails with
  // NotFound or Corruption is therefore checked once against the bucket (Bucket::Revalidate):
  // if a head of the chain was rewritten, the chunk is built again from the new ones, and the
  // chunk's hash must be the one asked for; if none was, the first error stands.
  // `output_aligned`: output's buffers are Scratch-like (4 KiB-aligned, room for the length
  // rounded up to 4 KiB), so a cached ancestor may be read into one with O_DIRECT.
  Status Build(const Manifest& manifest, const ManifestFile& file, size_t index,
               const std::function<std::span<uint8_t>(size_t)>& output, bool output_aligned = false);
  // Build without that check.
  Status BuildChain(const Manifest& manifest, const ManifestFile& file, size_t index,
                    const std::function<std::span<uint8_t>(size_t)>& output, bool output_aligned = false);
  // A chunk of a derived version (Manifest::derived): the bucket's DerivedVersions makes it;
  // neither verified nor cached here (its hash is an identifier).
  Status BuildDerived(const Manifest& manifest, const ManifestFile& file, size_t index,
                      const std::function<std::span<uint8_t>(size_t)>& output);
  // The bytes of `out` as Shared() hands them out: the buffer itself, back to the pool when the
  // last reader lets go, or a heap copy when the bytes fill little of it.
  ChunkBytes HandOut(Scratch out);
  // Whether HandOut hands out `out` itself (it fills at least 8/9 of its capacity).
  static bool HandsOutBuffer(const Scratch& out);
  // Reused buffers for intermediate results (at most max_scratch_bytes_ of capacity kept), and
  // codecs (their zstd contexts and tables are warm), shared by every thread.
  Scratch TakeScratch();
  void GiveScratch(Scratch buffer);
  std::unique_ptr<ChunkCodec> TakeCodec() WFS_EXCLUDES(pool_mu_);
  void GiveCodec(std::unique_ptr<ChunkCodec> codec) WFS_EXCLUDES(pool_mu_);
  bool cache_results_ = true;
  // The buffer pool is shared with the chunks Shared() hands out, which give their buffer back
  // when the last reference goes (possibly after the Materializer).
  struct ScratchPool {
    Mutex mu;
    uint64_t max_bytes WFS_GUARDED_BY(mu) = 64ull << 20;
    std::vector<Scratch> buffers WFS_GUARDED_BY(mu);
    size_t bytes WFS_GUARDED_BY(mu) = 0;  // capacity of buffers
    Scratch Take() WFS_EXCLUDES(mu);
    void Give(Scratch buffer) WFS_EXCLUDES(mu);
  };
  std::shared_ptr<ScratchPool> scratch_pool_ = std::make_shared<ScratchPool>();
  Mutex pool_mu_;
  size_t max_codecs_ WFS_GUARDED_BY(pool_mu_) = 16;
  std::vector<std::unique_ptr<ChunkCodec>> codecs_ WFS_GUARDED_BY(pool_mu_);
  Bucket* bucket_;
  ChunkCache* cache_;
  DecodeLimits limits_;
  MaterializerStats stats_;

  // Threads that fetch payloads while builds apply them, started with the first chain and kept:
  // a thread started per build cost ~5% of a cold read's CPU (clone3 and its stack's faults).
  class FetchThreads {
   public:
    ~FetchThreads();
    void Run(std::function<void()> task) WFS_EXCLUDES(mu_);  // on a pool thread; never blocks

   private:
    void Main() WFS_EXCLUDES(mu_);
    Mutex mu_;
    CondVar cv_;
    std::deque<std::function<void()>> queue_ WFS_GUARDED_BY(mu_);
    size_t idle_ WFS_GUARDED_BY(mu_) = 0;
    bool stop_ WFS_GUARDED_BY(mu_) = false;
    std::vector<std::thread> threads_ WFS_GUARDED_BY(mu_);
  };
  FetchThreads fetch_threads_;
};

}  // namespace weightfs
