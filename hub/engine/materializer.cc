#include "hub/engine/materializer.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <thread>
#include <utility>

#include <spdlog/spdlog.h>

#include "core/file_codec.h"

namespace weightfs {
namespace {

constexpr size_t kFetchParallelism = 8;

// A link of the chain being built, with its payload once fetched.
struct Step : ChainLink {
  ByteBuffer payload;
};

}  // namespace

Materializer::Materializer(Bucket* bucket, ChunkCache* cache, DecodeLimits limits)
    : bucket_(bucket), cache_(cache), limits_(limits) {
  limits_.verify_output = false;  // every result is checked against its Hash128 below
}

namespace {
constexpr size_t kHugePage = 2 << 20;
}  // namespace

Materializer::FetchThreads::~FetchThreads() {
  {
    MutexLock lock(mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  for (std::thread& t : threads_) t.join();
}

void Materializer::FetchThreads::Run(std::function<void()> task) {
  MutexLock lock(mu_);
  if (queue_.size() + 1 > idle_ && threads_.size() < 2 * kFetchParallelism) {
    try {
      threads_.emplace_back([this] { Main(); });
    } catch (...) {
      if (threads_.empty()) throw;  // nothing would run the task: not queued
    }
  }
  queue_.push_back(std::move(task));
  lock.Unlock();
  cv_.NotifyOne();
}

void Materializer::FetchThreads::Main() {
  MutexLock lock(mu_);
  for (;;) {
    ++idle_;
    cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    lock.Unlock();
    try {
      task();  // Build's fetch tasks do not throw; this keeps the process up if one ever does
    } catch (...) {
      spdlog::error("{}", StatusOfCurrentException("payload fetch task").ToString());
    }
    task = nullptr;
    lock.Lock();
  }
}

Materializer::Scratch::Scratch(Scratch&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

Materializer::Scratch& Materializer::Scratch::operator=(Scratch&& other) noexcept {
  if (this != &other) {
    if (data_) ::munmap(data_, capacity_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

Materializer::Scratch::~Scratch() {
  if (data_) ::munmap(data_, capacity_);
}

std::span<uint8_t> Materializer::Scratch::Resize(size_t size) {
  if (size > capacity_) {
    const size_t capacity = (size + kHugePage - 1) / kHugePage * kHugePage;
    // Over-map by a huge page and trim, so the region starts on a 2 MiB boundary.
    void* p = ::mmap(nullptr, capacity + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t start = reinterpret_cast<uintptr_t>(p);
    const uintptr_t aligned = (start + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
    if (aligned > start) ::munmap(p, aligned - start);
    if (start + kHugePage > aligned) {
      ::munmap(reinterpret_cast<void*>(aligned + capacity), start + kHugePage - aligned);
    }
    ::madvise(reinterpret_cast<void*>(aligned), capacity, MADV_HUGEPAGE);
    if (data_) ::munmap(data_, capacity_);
    data_ = reinterpret_cast<uint8_t*>(aligned);
    capacity_ = capacity;
  }
  size_ = size;
  return {data_, size_};
}

Materializer::Scratch Materializer::ScratchPool::Take() {
  MutexLock lock(mu);
  if (buffers.empty()) return {};
  Scratch b = std::move(buffers.back());
  buffers.pop_back();
  bytes -= b.capacity();
  return b;
}

void Materializer::ScratchPool::Give(Scratch buffer) {
  if (buffer.capacity() == 0) return;
  MutexLock lock(mu);
  if (bytes + buffer.capacity() > max_bytes) return;  // unmapped here
  bytes += buffer.capacity();
  buffers.push_back(std::move(buffer));
}

Materializer::Scratch Materializer::TakeScratch() { return scratch_pool_->Take(); }

void Materializer::GiveScratch(Scratch buffer) { scratch_pool_->Give(std::move(buffer)); }

std::unique_ptr<ChunkCodec> Materializer::TakeCodec() {
  {
    MutexLock lock(pool_mu_);
    if (!codecs_.empty()) {
      std::unique_ptr<ChunkCodec> c = std::move(codecs_.back());
      codecs_.pop_back();
      return c;
    }
  }
  return std::make_unique<ChunkCodec>();
}

void Materializer::GiveCodec(std::unique_ptr<ChunkCodec> codec) {
  MutexLock lock(pool_mu_);
  if (codecs_.size() < max_codecs_) codecs_.push_back(std::move(codec));
}

void Materializer::set_pool_limits(size_t codecs, uint64_t scratch_bytes) {
  std::vector<Scratch> freed_scratch;
  std::vector<std::unique_ptr<ChunkCodec>> freed_codecs;
  {
    MutexLock lock(pool_mu_);
    max_codecs_ = codecs;
    while (codecs_.size() > max_codecs_) {
      freed_codecs.push_back(std::move(codecs_.back()));
      codecs_.pop_back();
    }
  }
  {
    ScratchPool& pool = *scratch_pool_;
    MutexLock lock(pool.mu);
    pool.max_bytes = scratch_bytes;
    while (pool.bytes > pool.max_bytes && !pool.buffers.empty()) {
      pool.bytes -= pool.buffers.back().capacity();
      freed_scratch.push_back(std::move(pool.buffers.back()));
      pool.buffers.pop_back();
    }
  }  // freed outside the locks
}

void Materializer::Warm(size_t builds, uint64_t chunk_bytes) {
  chunk_bytes = std::min<uint64_t>(chunk_bytes, kMaxChunkBytes) & ~uint64_t{1};
  if (builds == 0 || chunk_bytes == 0) return;
  // A bf16 chunk and a child with ~1% of its elements moved by one unit, like a training step.
  std::vector<uint8_t> parent(chunk_bytes), child;
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < parent.size(); i += 2) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const uint16_t v = static_cast<uint16_t>(0x3C00 + (x & 0x03FF));  // small positive values
    std::memcpy(&parent[i], &v, 2);
  }
  // ~1% of the elements one unit up, mostly the small ones (as a training step moves them:
  // core/codec/sparse/sparse_coder.h), so that the delta uses exponent classes and the decoder's
  // class and change buffers grow to a real delta's size here rather than on a first read.
  child = parent;
  for (size_t i = 0; i + 1 < child.size(); i += 2) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const bool small = (child[i + 1] & 0x7F) < 0x3E;  // exponent below 124
    if (x % 1000 < (small ? 20u : 2u)) child[i] ^= 1;
  }
  std::vector<uint8_t> full, sparse;
  {
    ChunkCodec encoder;
    encoder.EncodeFull(DType::kBF16, parent, &full);
    (void)encoder.EncodeDelta(DType::kBF16, parent, child, &sparse);
  }
  std::vector<std::unique_ptr<ChunkCodec>> codecs;
  std::vector<Scratch> buffers;
  for (size_t b = 0; b < builds; ++b) {
    std::unique_ptr<ChunkCodec> codec = TakeCodec();
    // Two intermediate buffers per build and one output (Shared's).
    Scratch s[3];
    for (Scratch& one : s) {
      one = TakeScratch();
      std::memset(one.Resize(chunk_bytes).data(), 0, chunk_bytes);
    }
    (void)codec->Decode(full, {}, s[0].Resize(chunk_bytes), limits_);
    (void)codec->Decode(sparse, s[0].bytes(), s[1].Resize(chunk_bytes), limits_);
    codecs.push_back(std::move(codec));
    for (Scratch& one : s) buffers.push_back(std::move(one));
  }
  for (auto& c : codecs) GiveCodec(std::move(c));
  for (Scratch& b : buffers) GiveScratch(std::move(b));
}

Expected<ByteBuffer> Materializer::Chunk(const Manifest& manifest, const ManifestFile& file,
                                         size_t index) {
  if (!file.rows_loaded) {  // a format 2 head's file: its rows first (the block of them holding `index`)
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, bucket_->RowsOfRow(manifest, file, index));
    return Chunk(manifest, *rows, index - rows->first_row);
  }
  stats_.chunks++;
  auto where = [&](const Status& s) { return s.WithContext(DescribeChunkOf(manifest, file, index)); };
  if (index >= file.chunks.size()) return where(Status::InvalidArgument("no such chunk"));
  ByteBuffer out;
  if (manifest.derived) {
    WFS_TRY(BuildDerived(manifest, file, index, [&](size_t n) {
      out.resize(n);
      return std::span<uint8_t>(out);
    }));
    return out;
  }
  if (cache_ && cache_->Get(file.chunks[index].hash, &out)) {
    stats_.cache_hits++;
    return out;
  }
  WFS_TRY(Build(manifest, file, index, [&](size_t n) {
    out.resize(n);
    return std::span<uint8_t>(out);
  }));
  if (cache_ && cache_results_) (void)cache_->Put(file.chunks[index].hash, out);
  return out;
}

Expected<ChunkBytes> Materializer::Shared(const Manifest& manifest, const ManifestFile& file,
                                          size_t index, bool cache_result) {
  if (!file.rows_loaded) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, bucket_->RowsOfRow(manifest, file, index));
    Expected<ChunkBytes> bytes = Shared(manifest, *rows, index - rows->first_row, cache_result);
    return bytes;
  }
  cache_result = cache_result && cache_results_;
  stats_.chunks++;
  auto where = [&](const Status& s) { return s.WithContext(DescribeChunkOf(manifest, file, index)); };
  if (index >= file.chunks.size()) return where(Status::InvalidArgument("no such chunk"));
  const ManifestChunk& chunk = file.chunks[index];
  if (manifest.derived) {
    ByteBuffer out;
    WFS_TRY(BuildDerived(manifest, file, index, [&](size_t n) {
      out.resize(n);
      return std::span<uint8_t>(out);
    }));
    return ChunkBytes(std::move(out));
  }
  if (chunk.length < kPooledMinBytes) {
    ByteBuffer out;
    if (cache_ && cache_->Get(chunk.hash, &out)) {
      stats_.cache_hits++;
      return ChunkBytes(std::move(out));
    }
    WFS_TRY(Build(manifest, file, index, [&](size_t n) {
      out.resize(n);
      return std::span<uint8_t>(out);
    }));
    if (cache_ && cache_result) (void)cache_->Put(chunk.hash, out);
    return ChunkBytes(std::move(out));
  }
  // A cache hit is read into a reused buffer and verified there: the bytes handed out are a
  // private copy, so nothing done to the cache file afterwards reaches a reader (a shared map
  // of the file did: hub/engine/chunk_cache.h).
  Scratch out = TakeScratch();
  if (cache_ && cache_->GetInto(chunk.hash, [&](size_t n) { return out.Resize(n); }, /*aligned=*/true)) {
    stats_.cache_hits++;
    return HandOut(std::move(out));
  }
  // Decode into a reused buffer, write it to the cache straight from there (O_DIRECT: no page
  // cache copy) and hand the buffer itself out; it returns to the pool, its pages still faulted
  // in, when the last reader lets go. The alternative measured before, a map of the cache file
  // just written, paid a kernel copy into fresh page-cache pages per chunk (~14% of a cold
  // read's CPU) and an munmap on eviction (~3%).
  Status st = Build(manifest, file, index, [&](size_t n) { return out.Resize(n); }, /*output_aligned=*/true);
  if (!st.ok()) {
    GiveScratch(std::move(out));
    return st;
  }
  if (cache_ && cache_result) {
    const size_t capacity = out.capacity();
    if (HandsOutBuffer(out)) {
      // The buffer itself is what readers get: the disk cache's copy is written behind them
      // (ChunkCache::PutBehind, when the mount turned it on), not before the reply.
      ChunkBytes handed = HandOut(std::move(out));
      cache_->PutBehind(chunk.hash, handed, capacity);
      return handed;
    }
    (void)cache_->PutAligned(chunk.hash, out.bytes(), capacity);
  }
  return HandOut(std::move(out));
}

bool Materializer::HandsOutBuffer(const Scratch& out) {
  const size_t size = out.bytes().size();
  return out.capacity() - size <= size / 8;
}

ChunkBytes Materializer::HandOut(Scratch out) {
  if (!HandsOutBuffer(out)) {
    // A short chunk in a large buffer: a copy sized to it (the buffer serves the next build).
    ChunkBytes copy(ByteBuffer(out.bytes().begin(), out.bytes().end()));
    GiveScratch(std::move(out));
    return copy;
  }
  std::shared_ptr<ScratchPool> pool = scratch_pool_;
  std::shared_ptr<Scratch> held(new Scratch(std::move(out)), [pool](Scratch* b) {
    pool->Give(std::move(*b));
    delete b;
  });
  const std::span<const uint8_t> bytes = held->bytes();
  return ChunkBytes(std::shared_ptr<const void>(std::move(held)), bytes);
}

Status Materializer::BuildDerived(const Manifest& manifest, const ManifestFile& file, size_t index,
                                  const std::function<std::span<uint8_t>(size_t)>& output) {
  DerivedVersions* derived = bucket_->derived();
  if (!derived) {
    return Status::InvalidArgument("a derived version's manifest given to a weightfs bucket")
        .WithContext(DescribeChunkOf(manifest, file, index));
  }
  return derived->Materialize(manifest, file, index, output(file.chunks[index].length));
}

Status Materializer::Build(const Manifest& manifest, const ManifestFile& file, size_t index,
                           const std::function<std::span<uint8_t>(size_t)>& output, bool output_aligned) {
  const uint64_t generation = bucket_->head_generation();
  Status first = BuildChain(manifest, file, index, output, output_aligned);
  if (first.ok() || manifest.derived) return first;
  if (first.kind() != ErrorKind::kNotFound && first.kind() != ErrorKind::kCorruption) return first;
  Expected<size_t> changed = bucket_->Revalidate(manifest.model, manifest.versions, std::chrono::steady_clock::now());
  if (!changed.ok()) return first;
  Expected<std::shared_ptr<const Manifest>> now = bucket_->ReadManifest(manifest.model, manifest.version);
  if (!now.ok()) return first;  // (the version itself is gone: retired by gc)
  if (Bucket::SameHead(**now, manifest)) {
    if (*changed == 0 && bucket_->head_generation() == generation) return first;
    spdlog::info("{}@{}: a version it builds on was rewritten in the bucket (gc's rebase); reading with its new "
                 "metadata", manifest.model, manifest.version);
    stats_.rewritten_heads++;
    return BuildChain(manifest, file, index, output, output_aligned);
  }
  // This version's own head was rewritten: its rows of this file, from the new table.
  const ManifestFile* now_file = (*now)->FindFile(file.path);
  const uint64_t row = file.first_row + index;
  if (!now_file || row >= now_file->RowCount()) return first;
  Expected<std::shared_ptr<const ManifestFile>> rows = bucket_->RowsOfRow(**now, *now_file, row);
  if (!rows.ok()) return first;
  const ManifestChunk& want = file.chunks[index];
  const size_t now_index = static_cast<size_t>(row - (*rows)->first_row);
  if (now_index >= (*rows)->chunks.size() || (*rows)->chunks[now_index].hash != want.hash ||
      (*rows)->chunks[now_index].length != want.length) {
    return Status::Corruption(manifest.model + "@" + manifest.version + " was rewritten in the bucket with other " +
                              "bytes (a rewrite keeps the bytes: another writer replaced the version?); " +
                              first.message())
        .WithContext(DescribeChunkOf(manifest, file, index));
  }
  spdlog::info("{}@{} was rewritten in the bucket (gc's rebase); reading with its new metadata", manifest.model,
               manifest.version);
  stats_.rewritten_heads++;
  const std::shared_ptr<const Manifest> held = *now;
  const std::shared_ptr<const ManifestFile> held_rows = *rows;
  return BuildChain(*held, *held_rows, now_index, output, output_aligned);
}

Status Materializer::BuildChain(const Manifest& manifest, const ManifestFile& file, size_t index,
                                const std::function<std::span<uint8_t>(size_t)>& output, bool output_aligned) {
  auto where = [&](const Status& s) { return s.WithContext(DescribeChunkOf(manifest, file, index)); };
  const bool timing = spdlog::should_log(spdlog::level::debug);
  const auto t0 = std::chrono::steady_clock::now();

  // Walk back to a keyframe or a cached ancestor. Depth strictly decreases along the walk
  // (checked), so a hostile manifest cannot make it loop.
  // Every version of the chain, at once: their heads, then the file's rows in each (format 2
  // keeps a file's rows in a section of its own, read by range).
  if (file.chunks[index].is_delta()) {
    bucket_->PrefetchManifests(manifest.model, manifest.versions);
    bucket_->PrefetchFiles(manifest.model, std::span<const std::string>(manifest.versions).subspan(1), file.path,
                           file.first_row + index);
  }
  std::vector<Step> steps;
  steps.push_back(Step{ChainLink{nullptr, &manifest, nullptr, &file, &file.chunks[index]}, {}});
  Scratch base_buffer;  // the cached ancestor's bytes, read (and verified) into a pooled buffer
  bool have_base = false;
  // A cached ancestor of the chunk's own length is read straight into the output (when that is
  // an aligned buffer) and the deltas after it applied there in place: a training step then
  // costs its changed elements, with no copy of the chunk and no second buffer (whose fresh
  // pages the kernel zeroed: 10% of the daemon's CPU following a run).
  std::span<uint8_t> out;  // output(), taken before the first step (or for the base)
  bool base_in_out = false;
  Hash128 base_hash;
  while (steps.back().chunk->is_delta()) {
    Expected<ChainLink> base = bucket_->DeltaBase(steps.back());
    if (!base.ok()) return where(base.status());
    const ManifestChunk* bc = base->chunk;
    const uint64_t final_length = steps.front().chunk->length;
    bool went_to_out = false;
    if (cache_ && cache_->GetInto(bc->hash, [&](size_t n) {
          went_to_out = output_aligned && n == final_length;
          if (went_to_out) {
            if (out.empty()) out = output(n);
            return out;
          }
          if (base_buffer.capacity() == 0) base_buffer = TakeScratch();
          return base_buffer.Resize(n);
        }, /*aligned=*/true)) {
      have_base = true;
      base_in_out = went_to_out;
      base_hash = bc->hash;
      break;
    }
    steps.push_back(Step{std::move(base).value(), {}});
  }
  if (steps.back().chunk->is_delta() && !have_base) {
    const Step& s = steps.back();
    return Status::Corruption("delta chain has no keyframe")
        .WithContext(s.Describe());
  }

  // Fetch the payloads, several at a time and oldest first, while this thread applies them
  // oldest first as they arrive: the keyframe is decoded while the deltas are still in flight.
  const size_t n = steps.size();
  // Locals cannot carry WFS_GUARDED_BY: "guarded by mu" below is for the reader only.
  Mutex mu;
  CondVar arrived;
  std::vector<Status> fetched(n);     // guarded by mu
  std::vector<char> done(n, 0);       // guarded by mu
  std::atomic<size_t> next{0};
  std::atomic<bool> abandon{false};   // an error: fetch nothing more
  // Never throws: it runs on a fetch thread, and the applying thread waits for done[i].
  auto fetch_one = [&](size_t i) {
    Step& s = steps[i];
    Status st;
    try {
      st = bucket_->ReadPayload(*s.manifest, *s.chunk, &s.payload);
      if (st.ok()) {
        stats_.payloads_fetched++;
        stats_.payload_bytes += s.payload.size();
      } else {
        st = st.WithContext(s.Describe());
      }
    } catch (...) {  // an allocation failing (the payload buffer): this build fails
      st = StatusOfCurrentException("fetching a payload");
      try {
        st = st.WithContext(s.Describe());
      } catch (...) {
      }
    }
    MutexLock lock(mu);
    fetched[i] = std::move(st);
    done[i] = 1;
    arrived.NotifyAll();
  };
  auto fetch = [&] {
    for (size_t k; !abandon.load() && (k = next.fetch_add(1)) < n;) fetch_one(n - 1 - k);
  };
  // Waits for step i's payload; its fetch error if it failed.
  auto wait_for = [&](size_t i) -> Status {
    MutexLock lock(mu);
    arrived.Wait(mu, [&] { return done[i] != 0; });
    return fetched[i];
  };
  size_t running = 0;  // guarded by mu: fetch tasks not yet finished
  CondVar finished;
  if (n == 1) {
    fetch();
  } else {
    const size_t workers = std::min(n, kFetchParallelism);
    try {
      for (size_t t = 0; t < workers; ++t) {
        {
          MutexLock lock(mu);
          ++running;
        }
        fetch_threads_.Run([&] {
          fetch();
          // Notified under the lock: the waiter cannot return (and destroy mu and finished)
          // before this task is done with them.
          MutexLock lock(mu);
          if (--running == 0) finished.NotifyAll();
        });
      }
    } catch (...) {
      MutexLock lock(mu);
      if (--running == 0) throw;  // the one that failed was not queued; any queued fetch all
    }
  }
  auto join = [&] {
    MutexLock lock(mu);
    finished.Wait(mu, [&] { return running == 0; });
  };
  double fetch_wait_ms = 0;

  // Apply oldest first. The result of each step lives in the output buffer (final length),
  // a scratch buffer, or (before the first step) the cached ancestor's buffer, which is never
  // written: a replay (below) starts from it again. A SPARSE
  // or DENSE delta is decoded in place, on the buffer that holds its parent: a training step's
  // delta then costs its changed elements, not a copy of the chunk. Other steps decode into the
  // output when the length fits and it does not hold their parent, else into a scratch buffer;
  // the result is copied to the output only if it ends elsewhere.
  std::unique_ptr<ChunkCodec> codec;
  Scratch scratch[2];
  enum : int { kInBase = -1, kInOut = 2 };  // else the index of a scratch buffer
  std::vector<std::span<const uint8_t>> run;  // payloads of a run of in-place steps
  auto apply = [&](bool verify_each) -> Status {
    DecodeLimits limits = limits_;
    limits.verify_parent = verify_each;  // the final Hash128 check covers the chain
    std::span<const uint8_t> parent =
        !have_base ? std::span<const uint8_t>() : base_in_out ? std::span<const uint8_t>(out) : base_buffer.bytes();
    int held = base_in_out ? kInOut : kInBase;  // the buffer holding `parent`
    for (size_t i = steps.size(); i-- > 0;) {
      const Step& s = steps[i];
      const auto w0 = std::chrono::steady_clock::now();
      WFS_TRY(wait_for(i));
      fetch_wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w0).count();
      const uint64_t length = s.chunk->length;
      bool in_place = false;
      if (held != kInBase && !s.chunk->is_external() && parent.size() == length) {
        Expected<PayloadInfo> info = ChunkCodec::Inspect(s.payload, limits);
        in_place = info.ok() && info->decodes_in_place();
      }
      int into;
      if (in_place) {
        into = held;
      } else if (length == out.size() && held != kInOut) {
        into = kInOut;
      } else {
        into = held == 0 ? 1 : 0;
      }
      std::span<uint8_t> target;
      if (into == kInOut) {
        target = out;
      } else {
        if (scratch[into].capacity() == 0) scratch[into] = TakeScratch();
        target = scratch[into].Resize(length);  // keeps the bytes when decoding in place
      }
      if (in_place && !verify_each) {
        // This step and the in-place deltas after it in one call: a run of SPARSE steps shares
        // one sweep over the chunk (ChunkCodec::DecodeChainInPlace).
        run.assign(1, s.payload);
        size_t last = i;
        while (last > 0) {
          const Step& t = steps[last - 1];
          if (t.chunk->is_external() || t.chunk->length != length) break;
          const auto w1 = std::chrono::steady_clock::now();
          WFS_TRY(wait_for(last - 1));
          fetch_wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - w1).count();
          Expected<PayloadInfo> info = ChunkCodec::Inspect(t.payload, limits);
          if (!info.ok() || !info->decodes_in_place()) break;
          run.push_back(t.payload);
          --last;
        }
        size_t bad = 0;
        Status st = codec->DecodeChainInPlace(run, target, limits, &bad);
        if (!st.ok()) {
          const Step& f = steps[i - std::min(bad, i - last)];
          return st.WithContext(f.Describe());
        }
        i = last;
        if (i == 0 && HashChunk(target) != steps[0].chunk->hash) {
          return Status::Corruption("decoded bytes do not match the chunk hash")
              .WithContext(steps[0].Describe());
        }
        parent = target;
        held = into;
        continue;
      }
      if (s.chunk->is_external()) {
        // Raw bytes of the source's range (the walk stops at it: it is a keyframe).
        if (s.payload.size() != target.size()) {
          return Status::Corruption("external source returned the wrong length")
              .WithContext(s.Describe());
        }
        std::memcpy(target.data(), s.payload.data(), target.size());
      } else {
        Status st = codec->Decode(s.payload, parent, target, limits);
        if (!st.ok()) return st.WithContext(s.Describe());
      }
      if ((i == 0 || verify_each) && HashChunk(target) != s.chunk->hash) {
        return Status::Corruption("decoded bytes do not match the chunk hash")
            .WithContext(s.Describe());
      }
      parent = target;
      held = into;
    }
    if (held != kInOut) std::memcpy(out.data(), parent.data(), out.size());
    return Status::Ok();
  };
  Status st;
  try {
    codec = TakeCodec();
    if (!base_in_out) out = output(steps.front().chunk->length);
    st = apply(false);
  } catch (...) {
    abandon = true;
    join();
    throw;
  }
  if (!st.ok()) abandon = true;
  join();
  if (st.ok()) {
    stats_.deltas_applied += n - (steps.back().chunk->is_delta() ? 0 : 1);
    const double total_ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    stats_.builds++;
    stats_.built_bytes += steps.front().chunk->length;
    stats_.chain_steps += n;
    for (uint64_t max = stats_.chain_depth_max.load(); n > max && !stats_.chain_depth_max.compare_exchange_weak(max, n);) {
    }
    stats_.build_ns += static_cast<uint64_t>(total_ns);
    stats_.decode_ns += static_cast<uint64_t>(std::max(0.0, total_ns - fetch_wait_ms * 1e6));
  } else if (st.kind() == ErrorKind::kCorruption && n > 1 &&
             std::all_of(done.begin(), done.end(), [](char d) { return d != 0; }) &&
             std::all_of(fetched.begin(), fetched.end(), [](const Status& f) { return f.ok(); })) {
    // Something in the chain decodes wrong: replay it checking every step, to name the first
    // bad one (from the cached ancestor read again, when the first run applied onto it).
    const bool base_again = !base_in_out || cache_->GetInto(base_hash, [&](size_t n) {
      return n == out.size() ? out : std::span<uint8_t>();
    }, /*aligned=*/true);
    if (base_again) {
      Status named = apply(true);
      if (!named.ok()) st = named;
    }
  }
  GiveCodec(std::move(codec));
  for (Scratch& b : scratch) GiveScratch(std::move(b));
  GiveScratch(std::move(base_buffer));
  if (timing && st.ok()) {
    const double total = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    spdlog::debug("built {}: {} payloads from {} in {:.1f} ms ({:.1f} ms waiting for fetches)",
                  DescribeChunkOf(manifest, file, index), n,
                  have_base ? "a cached ancestor" : "the keyframe", total, fetch_wait_ms);
  }
  return st;
}

}  // namespace weightfs
