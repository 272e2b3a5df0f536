#include "hub/materializer.h"

#include <mutex>
#include <thread>

#include "core/file_codec.h"

namespace weightfs {
namespace {

constexpr size_t kFetchParallelism = 8;

struct Step {
  std::shared_ptr<const Manifest> holder;  // keeps `manifest` alive (null for the caller's)
  const Manifest* manifest;
  const ManifestFile* file;
  const ManifestChunk* chunk;
  std::vector<uint8_t> payload;
};

// The chunk of `file` with `key`, trying the same position first (versions usually share
// their layout), then a scan.
const ManifestChunk* FindByKey(const ManifestFile& file, const ChunkKey& key, size_t hint) {
  if (hint < file.chunks.size() && file.chunks[hint].key == key) return &file.chunks[hint];
  std::optional<size_t> i = file.FindChunk(key);
  return i ? &file.chunks[*i] : nullptr;
}

ChunkCodec& ThreadCodec() {
  thread_local ChunkCodec codec;
  return codec;
}

}  // namespace

std::string DescribeChunkOf(const Manifest& manifest, const ManifestFile& file, size_t index) {
  std::string s = manifest.model + "@" + manifest.version + " " + file.path;
  if (index < file.chunks.size()) s += " " + DescribeChunk(file.chunks[index].key);
  return s;
}

Materializer::Materializer(Bucket* bucket, ChunkCache* cache, DecodeLimits limits)
    : bucket_(bucket), cache_(cache), limits_(limits) {
  limits_.verify_output = false;  // every result is checked against its Hash128 below
}

Expected<ByteBuffer> Materializer::Chunk(const Manifest& manifest,
                                                   const ManifestFile& file, size_t index) {
  stats_.chunks++;
  auto where = [&](const Status& s) { return s.WithContext(DescribeChunkOf(manifest, file, index)); };
  if (index >= file.chunks.size()) return where(Status::InvalidArgument("no such chunk"));
  ByteBuffer current;
  if (cache_ && cache_->Get(file.chunks[index].hash, &current)) {
    stats_.cache_hits++;
    return current;
  }

  // Walk back to a keyframe or a cached ancestor. Depth strictly decreases along the walk
  // (checked), so a hostile manifest cannot make it loop.
  std::vector<Step> steps;
  steps.push_back({nullptr, &manifest, &file, &file.chunks[index], {}});
  bool have_base = false;
  while (steps.back().chunk->is_delta()) {
    const Step& s = steps.back();
    const std::string& base_version = s.manifest->versions[s.chunk->base];
    Expected<std::shared_ptr<const Manifest>> bm = bucket_->ReadManifest(s.manifest->model, base_version);
    if (!bm.ok()) return where(bm.status().WithContext("reading base version " + base_version));
    const ManifestFile* bf = (*bm)->FindFile(s.file->path);
    const ManifestChunk* bc =
        bf ? FindByKey(*bf, s.chunk->key, static_cast<size_t>(s.chunk - s.file->chunks.data())) : nullptr;
    if (!bc) {
      return where(Status::Corruption("the delta's base chunk is missing from " + s.manifest->model +
                                      "@" + base_version));
    }
    // Strictly decreasing, not "one less": gc's rebasing turns a base into a keyframe (depth 0)
    // under deltas that still say they are deeper.
    if (bc->depth >= s.chunk->depth) {
      return where(Status::Corruption("delta chain depth does not decrease at " + s.manifest->model +
                                      "@" + base_version));
    }
    if (cache_ && cache_->Get(bc->hash, &current)) {
      have_base = true;
      break;
    }
    std::shared_ptr<const Manifest> holder = *bm;
    steps.push_back({holder, holder.get(), bf, bc, {}});
  }

  // Fetch the payloads, several at a time.
  std::atomic<size_t> next{0};
  std::mutex mu;
  Status first_error;
  auto fetch = [&] {
    for (size_t i; (i = next.fetch_add(1)) < steps.size();) {
      Step& s = steps[i];
      const PayloadRef& ref = s.chunk->ref;
      const std::string key = Bucket::PackKey(s.manifest->packs[ref.pack]);
      Expected<std::vector<uint8_t>> bytes =
          bucket_->store().Get(key, ByteRange{ref.offset, ref.length});
      Status st;
      if (!bytes.ok()) {
        st = bytes.status().WithContext("fetching " + key);
      } else if (bytes->size() != ref.length) {
        st = Status::Corruption("pack " + key + " is truncated: " + std::to_string(bytes->size()) +
                                " of " + std::to_string(ref.length) + " payload bytes at offset " +
                                std::to_string(ref.offset));
      } else {
        stats_.payloads_fetched++;
        stats_.payload_bytes += bytes->size();
        s.payload = std::move(bytes).value();
      }
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) {
          first_error = st.WithContext(DescribeChunkOf(*s.manifest, *s.file,
                                                       static_cast<size_t>(s.chunk - s.file->chunks.data())));
        }
      }
    }
  };
  size_t workers = std::min(steps.size(), kFetchParallelism) - 1;
  std::vector<std::thread> threads;
  for (size_t t = 0; t < workers; ++t) threads.emplace_back(fetch);
  fetch();
  for (std::thread& t : threads) t.join();
  if (!first_error.ok()) return first_error;

  // Apply oldest first.
  ChunkCodec& codec = ThreadCodec();
  ByteBuffer next_bytes;
  for (size_t i = steps.size(); i-- > 0;) {
    const Step& s = steps[i];
    const size_t at = static_cast<size_t>(s.chunk - s.file->chunks.data());
    if (s.chunk->is_delta() && i == steps.size() - 1 && !have_base) {
      return where(Status::Corruption("delta chain has no keyframe"));
    }
    next_bytes.resize(s.chunk->length);
    Status st = codec.Decode(s.payload, current, next_bytes, limits_);
    if (!st.ok()) return st.WithContext(DescribeChunkOf(*s.manifest, *s.file, at));
    if (HashChunk(next_bytes) != s.chunk->hash) {
      return Status::Corruption("decoded bytes do not match the chunk hash")
          .WithContext(DescribeChunkOf(*s.manifest, *s.file, at));
    }
    if (s.chunk->is_delta()) stats_.deltas_applied++;
    current.swap(next_bytes);
  }
  if (cache_ && cache_results_) (void)cache_->Put(file.chunks[index].hash, current);
  return current;
}

}  // namespace weightfs
