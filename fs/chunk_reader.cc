#include "fs/chunk_reader.h"

#include <algorithm>
#include <new>
#include <thread>

#include <spdlog/spdlog.h>

#include "core/chunk_plan.h"

namespace weightfs {
namespace {

// Reads that start within this distance of the previous read's end count as sequential:
// with FUSE_CAP_ASYNC_READ the kernel's readahead requests can arrive slightly out of order.
constexpr uint64_t kSequentialSlack = 2ull << 20;

}  // namespace

size_t ChunkReader::MaxBuilds(uint64_t memory_limit) {
  const uint64_t spare = memory_limit > kBaseBytes ? memory_limit - kBaseBytes : 0;
  return static_cast<size_t>(std::clamp<uint64_t>(spare / 4 / kBuildBytes, 1, 16));
}

uint64_t ChunkReader::MetadataBudget(uint64_t memory_limit) {
  return std::clamp<uint64_t>(memory_limit / 8, 16ull << 20, 1ull << 30);
}

uint64_t ChunkReader::CacheBudget(uint64_t memory_limit) {
  const uint64_t reserve = kBaseBytes + MaxBuilds(memory_limit) * kBuildBytes + MetadataBudget(memory_limit);
  return memory_limit > reserve ? memory_limit - reserve : 0;
}

size_t ChunkReader::ReadaheadThreads(const ChunkReaderOptions& options) {
  size_t threads = options.readahead_threads;
  if (threads == 0) {
    threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 2, 8);
  }
  return std::min(threads, MaxBuilds(options.memory_limit));
}

namespace {

// Readahead must keep its threads busy (two chunks ahead each) but not evict what it reads
// ahead for: at most a quarter of the cache budget.
uint64_t ReadaheadBytes(const ChunkReaderOptions& options, size_t threads, uint64_t budget) {
  if (options.readahead_bytes == 0) return 0;
  return std::min(std::max<uint64_t>(options.readahead_bytes, threads * 2 * kDefaultChunkBytes), budget / 4);
}

}  // namespace

ChunkReader::ChunkReader(Materializer* materializer, ChunkReaderOptions options)
    : materializer_(materializer),
      options_(options),
      max_builds_(MaxBuilds(options.memory_limit)),
      cache_budget_(CacheBudget(options.memory_limit)),
      readahead_threads_(ReadaheadThreads(options)),
      readahead_bytes_(ReadaheadBytes(options, readahead_threads_, cache_budget_)),
      readahead_(readahead_bytes_ ? readahead_threads_ : 0, options.readahead_queue) {
  // The materializer's pools hold what the builds in flight use, no more.
  materializer_->set_pool_limits(max_builds_, max_builds_ * 2 * kDefaultChunkBytes);
}

ChunkReader::~ChunkReader() = default;

size_t ChunkReader::builds_running() const {
  MutexLock lock(builds_mu_);
  return builds_;
}

uint64_t ChunkReader::cached_bytes() const {
  MutexLock lock(mu_);
  return cached_bytes_;
}

void ChunkReader::InsertLocked(const Hash128& hash, ChunkBytes bytes) {
  const uint64_t size = bytes.size();
  if (size > cache_budget_ || cache_.count(hash)) return;
  lru_.push_front(hash);
  cache_.emplace(hash, Entry{std::move(bytes), lru_.begin()});
  cached_bytes_ += size;
  while (cached_bytes_ > cache_budget_ && !lru_.empty()) {
    auto it = cache_.find(lru_.back());
    cached_bytes_ -= it->second.bytes.size();
    cache_.erase(it);
    lru_.pop_back();
    stats_.evictions++;
  }
}

std::optional<ChunkBytes> ChunkReader::Cached(const Hash128& hash) const {
  MutexLock lock(mu_);
  auto it = cache_.find(hash);
  if (it == cache_.end()) return std::nullopt;
  return it->second.bytes;
}

ChunkReader::ChunkResult ChunkReader::Chunk(const std::shared_ptr<const Manifest>& manifest,
                                            const ManifestFile& file, size_t index) {
  BytesResult bytes = Bytes(manifest, file, index);
  if (!bytes.ok()) return bytes.status();
  if (bytes->buffer()) return bytes->buffer();
  return std::shared_ptr<const ByteBuffer>(
      std::make_shared<const ByteBuffer>(bytes->data(), bytes->data() + bytes->size()));
}

ChunkReader::BytesResult ChunkReader::Bytes(const std::shared_ptr<const Manifest>& manifest,
                                            const ManifestFile& file, size_t index) {
  const Hash128& hash = file.chunks[index].hash;
  std::promise<BytesResult> promise;
  {
    MutexLock lock(mu_);
    if (auto it = cache_.find(hash); it != cache_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      stats_.memory_hits++;
      return it->second.bytes;
    }
    if (auto it = inflight_.find(hash); it != inflight_.end()) {
      std::shared_future<BytesResult> future = it->second;
      lock.Unlock();
      stats_.shared_waits++;
      return future.get();
    }
    inflight_.emplace(hash, promise.get_future().share());
  }

  // This thread materializes; everyone else asking for `hash` meanwhile waits on `promise`,
  // which is therefore fulfilled on every path, exceptions included.
  stats_.materializations++;
  if (spdlog::should_log(spdlog::level::debug)) {
    spdlog::debug("materializing {}", DescribeChunkOf(*manifest, file, index));
  }
  BytesResult result = Status::IOError("not materialized");
  const bool skip = skip_disk_cache_ && skip_disk_cache_(file);
  {
    MutexLock lock(builds_mu_);
    build_done_.Wait(builds_mu_, [&]() WFS_REQUIRES(builds_mu_) { return builds_ < max_builds_; });
    ++builds_;
    if (builds_ > stats_.builds_peak.load()) stats_.builds_peak = builds_;
  }
  try {
    result = materializer_->Shared(*manifest, file, index, !skip);
  } catch (const std::bad_alloc&) {
    result = Status::ResourceExhausted("out of memory materializing " +
                                       DescribeChunkOf(*manifest, file, index));
  } catch (const std::exception& e) {
    result = Status::IOError(std::string("materializing ") + DescribeChunkOf(*manifest, file, index) +
                             ": " + e.what());
  }
  {
    MutexLock lock(builds_mu_);
    --builds_;
  }
  build_done_.NotifyOne();
  if (result.ok() && result->size() != file.chunks[index].length) {
    // The Materializer verified the hash, so this cannot happen with a valid manifest; a
    // reply must never be built on a short buffer all the same.
    result = Status::Corruption("materialized " + std::to_string(result->size()) +
                                " bytes where the manifest says " +
                                std::to_string(file.chunks[index].length) + ": " +
                                DescribeChunkOf(*manifest, file, index));
  }
  {
    MutexLock lock(mu_);
    inflight_.erase(hash);
    if (result.ok()) {
      InsertLocked(hash, *result);
    } else {
      stats_.failures++;
    }
  }
  // Built for a stream that ended meanwhile: the disk cache gets it after all. (Asked after the
  // insert above: a stream that ends after this answer finds the chunk in memory and puts it
  // there itself, WholeFiles::EndStream.)
  if (skip && result.ok() && !skip_disk_cache_(file)) materializer_->CacheResult(hash, result->span());
  promise.set_value(result);
  return result;
}

bool ChunkReader::Prefetch(const std::shared_ptr<const Manifest>& manifest,
                           const std::shared_ptr<const ManifestFile>& file, size_t index) {
  if (index >= file->chunks.size()) return true;
  const Hash128 hash = file->chunks[index].hash;
  {
    MutexLock lock(mu_);
    if (cache_.count(hash) || inflight_.count(hash) || !queued_.insert(hash).second) return true;
  }
  bool queued = readahead_.TryPush([this, manifest, f = file, index, hash] {
    {
      MutexLock lock(mu_);
      queued_.erase(hash);
    }
    try {
      BytesResult r = Bytes(manifest, *f, index);
      if (!r.ok()) spdlog::debug("readahead: {}", r.status().ToString());
    } catch (...) {
      // Readahead is optional work: a failure here is reported by the read that needs it.
    }
  });
  if (queued) {
    stats_.readahead_queued++;
    return true;
  }
  stats_.readahead_dropped++;
  MutexLock lock(mu_);
  queued_.erase(hash);
  return false;
}

void ChunkReader::Readahead(const std::shared_ptr<const Manifest>& manifest,
                            const std::shared_ptr<const ManifestFile>& file_ref, uint64_t offset, uint64_t end,
                            size_t last, ReadStream* stream) {
  const ManifestFile& file = *file_ref;
  // A stream's first read starts no run: a loader reads the header first and then jumps to
  // the tensors it wants; cat's second read comes soon enough.
  const uint64_t previous_end = stream->next_offset_.exchange(end);
  const bool sequential = previous_end != ReadStream::kNoRead &&
                          offset <= previous_end + kSequentialSlack &&
                          offset + kSequentialSlack >= previous_end;
  if (!sequential) {
    // A new run starts here: forget the old one's window.
    stream->run_start_ = offset;
    stream->home_end_ = 0;
    stream->streaming_ = false;
    stream->queued_until_ = static_cast<int64_t>(file.first_row + last);
    return;
  }
  // Until the run is longer than the kernel's readahead, it may be the kernel reading past the
  // header or past the end of a tensor, not the application.
  if (offset < stream->run_start_.load() + kSequentialSlack) return;
  const std::string& tensor = file.chunks[last].key.tensor;
  if (stream->home_end_.load() == 0 && tensor != kHeaderChunkName) {
    // The run's first data tensor: where does it end?
    size_t i = last;
    while (i + 1 < file.chunks.size() && file.chunks[i + 1].key.tensor == tensor) ++i;
    stream->home_end_ = file.chunks[i].offset + file.chunks[i].length;
  }
  const uint64_t home_end = stream->home_end_.load();
  if (home_end != 0 && offset >= home_end + kSequentialSlack) stream->streaming_ = true;
  const bool streaming = stream->streaming_;

  // The chunks after `last`, up to readahead_bytes_. The stream remembers how far it has
  // queued (in rows of the whole file: `file` may be a block of them, and the window stops at
  // its end until a read reaches the next), so that each read only adds what the window newly
  // covers; a full queue stops the window there (a later read tries again).
  uint64_t budget = readahead_bytes_;
  int64_t queued = stream->queued_until_.load();
  int64_t until = queued;
  for (size_t i = last + 1; i < file.chunks.size() && budget > 0; ++i) {
    if (!streaming && file.chunks[i].key.tensor != tensor) break;
    budget -= std::min(budget, file.chunks[i].length);
    const int64_t row = static_cast<int64_t>(file.first_row + i);
    if (row <= queued) continue;
    if (!Prefetch(manifest, file_ref, i)) break;
    until = row;
  }
  while (queued < until && !stream->queued_until_.compare_exchange_weak(queued, until)) {
  }
}

Expected<ReadResult> ChunkReader::Read(const std::shared_ptr<const Manifest>& manifest,
                                       const std::shared_ptr<const ManifestFile>& file_ref, uint64_t offset,
                                       size_t size, ReadStream* stream) {
  std::shared_ptr<const ManifestFile> rows = file_ref;
  ReadResult out;
  stats_.reads++;
  if (offset >= rows->size || size == 0) return out;
  const uint64_t end = std::min<uint64_t>(rows->size, offset + size);
  bool readahead = stream && readahead_bytes_ > 0;
  // `rows` may be a block of the file's rows (a section in blocks, hub/engine/bucket.h RowsAt):
  // the block holding each part of the range, from the bucket's cache of them.
  for (uint64_t pos = offset; pos < end;) {
    if (!rows->Holds(pos)) {
      Expected<std::shared_ptr<const ManifestFile>> block = materializer_->bucket()->RowsAt(*manifest, *rows, pos);
      if (!block.ok()) return block.status();
      rows = std::move(block).value();
      if (!rows->Holds(pos)) return Status::Corruption("the rows of " + rows->path + " do not hold byte " + std::to_string(pos));
    }
    const ManifestFile& file = *rows;
    const size_t first = file.ChunkAt(pos);
    const size_t last = file.Holds(end - 1) ? file.ChunkAt(end - 1) : file.chunks.size() - 1;
    if (readahead) Readahead(manifest, rows, offset, end, last, stream);
    readahead = false;
    for (size_t i = first; i <= last; ++i) {
      BytesResult bytes = Bytes(manifest, file, i);
      if (!bytes.ok()) return bytes.status();
      const ManifestChunk& c = file.chunks[i];
      const uint64_t from = std::max(pos, c.offset);
      const uint64_t to = std::min(end, c.offset + c.length);
      out.iov.push_back({const_cast<uint8_t*>(bytes->data() + (from - c.offset)),
                         static_cast<size_t>(to - from)});
      out.chunks.push_back(std::move(bytes).value());
      out.rows.push_back(ChunkRef{c.hash, c.offset, c.length});
    }
    pos = file.chunks[last].offset + file.chunks[last].length;
  }
  out.size = static_cast<size_t>(end - offset);
  stats_.read_bytes += out.size;
  return out;
}

}  // namespace weightfs
