// Materializer: produces the verified bytes of any chunk of any published version.
//
// For chunk c of version V it walks c's recipe chain back — V's payload is a delta against the
// same chunk of an older version, whose manifest holds that chunk's own recipe, and so on —
// until it reaches bytes already in the chunk cache (the nearest cached ancestor) or a
// keyframe. Only the payloads after that point are fetched (range reads into packs, in
// parallel), then applied forward; every intermediate result is checked against its Hash128
// and the final bytes are inserted into the cache. A node that holds version N therefore
// fetches only N+1's deltas.
//
// Every failure names the version, file and chunk. Thread-safe: any number of threads may
// materialize at once (each call uses its own codec).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/bytes.h"
#include "core/chunk_codec.h"
#include "core/manifest.h"
#include "hub/bucket.h"
#include "hub/chunk_cache.h"

namespace weightfs {

struct MaterializerStats {
  std::atomic<uint64_t> chunks{0};            // chunks materialized (cache hits included)
  std::atomic<uint64_t> cache_hits{0};        // chunks served whole from the cache
  std::atomic<uint64_t> payloads_fetched{0};
  std::atomic<uint64_t> payload_bytes{0};     // payload bytes fetched from the bucket
  std::atomic<uint64_t> deltas_applied{0};
};

class Materializer {
 public:
  // `cache` may be null (every chunk then comes from the bucket: what `verify` wants).
  Materializer(Bucket* bucket, ChunkCache* cache, DecodeLimits limits = {});

  // The bytes of chunk `index` of `file` in `manifest`, verified against the chunk's hash.
  Expected<ByteBuffer> Chunk(const Manifest& manifest, const ManifestFile& file,
                                       size_t index);

  const MaterializerStats& stats() const { return stats_; }
  // Whether materialized chunks are copied into the cache (default). `pull` turns it off: it
  // records references to the files it writes instead.
  void set_cache_results(bool on) { cache_results_ = on; }

 private:
  bool cache_results_ = true;
  Bucket* bucket_;
  ChunkCache* cache_;
  DecodeLimits limits_;
  MaterializerStats stats_;
};

// "acme/qwen@v3 model.safetensors tensor 'wte' chunk 2" for messages.
std::string DescribeChunkOf(const Manifest& manifest, const ManifestFile& file, size_t index);

}  // namespace weightfs
