#include "fs/whole_files.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

namespace weightfs {
namespace {

// The copying thread yields the CPU to the readers and builds (nice 10): on a node with two
// cores, a reader of the next file must not wait for the copy of the last one.
constexpr int kCopyNice = 10;

// MemAvailable of /proc/meminfo in bytes; 0 where it cannot be read.
uint64_t AvailableMemory() {
  FILE* f = std::fopen("/proc/meminfo", "re");
  if (!f) return 0;
  char line[256];
  unsigned long long kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
  }
  std::fclose(f);
  return static_cast<uint64_t>(kb) << 10;
}

}  // namespace

WholeFiles::WholeFiles(Materializer* materializer, ChunkReader* reader, ChunkCache* cache, uint64_t min_bytes)
    : materializer_(materializer), reader_(reader), cache_(cache), min_bytes_(min_bytes) {}

WholeFiles::~WholeFiles() { Stop(); }

void WholeFiles::Stop() {
  {
    MutexLock lock(stream_mu_);
    stream_stop_ = true;
  }
  stream_cv_.NotifyAll();
  if (stream_thread_.joinable()) stream_thread_.join();
  EndStreams("the mount ends");
  abort_ = true;
  std::deque<Job> left;
  {
    MutexLock lock(mu_);
    stop_ = true;
    left.swap(queue_);
  }
  cv_.NotifyAll();
  if (thread_.joinable()) thread_.join();
  // Files written whole as they were read, waiting for their sync: kept (a sync, not a copy).
  for (Job& job : left) {
    if (!job.writer) continue;
    if (Status s = job.writer->Commit(); !s.ok()) spdlog::warn("whole files: {}", s.ToString());
  }
}

void WholeFiles::set_on_copied(std::function<void(uint64_t)> on_copied) { on_copied_ = std::move(on_copied); }
void WholeFiles::set_kernel_pages(KernelPages pages) { kernel_pages_ = std::move(pages); }

bool WholeFiles::Wanted(const VersionFile& f) const {
  return f.manifest && f.file && !f.manifest->derived && f.file->size >= min_bytes_ && f.file->sha256.size() == 64;
}

int WholeFiles::Open(const VersionFile& f) {
  if (!Wanted(f)) return -1;
  return cache_->OpenWholeFile(f.file->sha256, f.file->size);
}

void WholeFiles::HandOver(uint64_t ino, const VersionFile& f, std::unique_ptr<WholeFileWriter> writer) {
  MutexLock lock(mu_);
  if (stop_) {
    lock.Unlock();
    if (Status s = writer->Commit(); !s.ok()) spdlog::warn("whole files: {}", s.ToString());
    return;
  }
  // (The file's key stays in pending_, from the stream's start, until the commit.)
  queue_.push_back(Job{ino, f, std::move(writer)});
  if (!thread_.joinable()) thread_ = std::thread([this] { Main(); });
  cv_.NotifyAll();
}

size_t WholeFiles::queue_depth() const {
  MutexLock lock(mu_);
  return queue_.size() + (copying_ ? 1 : 0);
}

namespace {
std::string KeyOf(const ManifestFile& f) { return f.sha256 + "-" + std::to_string(f.size); }
}  // namespace

bool WholeFiles::Streaming(const ManifestFile& file) const {
  MutexLock lock(stream_mu_);
  return !streaming_keys_.empty() && streaming_keys_.contains(KeyOf(file));
}

void WholeFiles::NoteRead(uint64_t ino, const VersionFile& f, uint64_t offset, uint64_t size, const ReadResult* read) {
  last_read_ns_ = std::chrono::steady_clock::now().time_since_epoch().count();
  if (size == 0 || !Wanted(f)) return;
  const uint64_t file_size = f.file->size;
  uint64_t begin = offset, end = std::min(file_size, offset + size);
  if (begin >= end) return;
  const std::string key = KeyOf(*f.file);
  if (read && !read->rows.empty() && read->rows.size() == read->chunks.size()) {
    MutexLock slock(stream_mu_);
    std::shared_ptr<Stream> st;
    if (auto it = streams_.find(ino); it != streams_.end()) {
      st = it->second;
    } else if (!stream_stop_ && read->rows.front().offset == 0 && !streaming_keys_.contains(key) &&
               streams_.size() < kMaxStreams) {
      // A read of the first chunk starts a stream, unless the file is being copied already.
      bool free = false;
      {
        MutexLock lock(mu_);
        free = !stop_ && !finishing_ && pending_.insert(key).second;
      }
      if (free) {
        st = std::make_shared<Stream>();
        st->file = f;
        st->key = key;
        st->kernel = kernel_pages_ && file_size <= AvailableMemory() / kKernelFraction;
        streams_.emplace(ino, st);
        streaming_keys_.insert(key);
        if (!stream_thread_.joinable()) stream_thread_ = std::thread([this] { StreamMain(); });
      }
    }
    if (st && !st->ended && !st->overrun) {
      for (size_t i = 0; i < read->rows.size(); ++i) {
        const ChunkRef& row = read->rows[i];
        if (row.offset < st->queued_until || st->queued_beyond.contains(row.offset)) continue;  // (queued by an earlier read)
        if (st->kernel && row.offset > st->queued_until && st->queued_beyond.size() >= kStreamAhead) {
          st->overrun = true;  // a reader that jumped away: ended by the stream thread
          break;
        }
        if (!st->kernel && pieces_bytes_ + row.length > kStreamQueueBytes) {
          // The writer is behind: the reader waits for it (as a build waits for the disk cache's
          // write-behind), for a while; then the stream is given up.
          stream_cv_.WaitFor(stream_mu_, kStreamWait, [&]() WFS_REQUIRES(stream_mu_) {
            return stream_stop_ || st->ended || pieces_bytes_ + row.length <= kStreamQueueBytes;
          });
          if (stream_stop_ || st->ended) break;
          if (pieces_bytes_ + row.length > kStreamQueueBytes) {
            st->overrun = true;  // it cannot complete
            break;
          }
        }
        if (!st->kernel) {
          pieces_.push_back(Piece{ino, row, read->chunks[i]});
          pieces_bytes_ += row.length;
        }
        if (row.offset == st->queued_until) {
          st->queued_until = row.offset + row.length;
          for (auto b = st->queued_beyond.begin(); b != st->queued_beyond.end() && b->first == st->queued_until;
               b = st->queued_beyond.erase(b)) {
            st->queued_until = b->second;
          }
        } else {
          st->queued_beyond.emplace(row.offset, row.offset + row.length);
        }
      }
      st->last = std::chrono::steady_clock::now();
      if (st->kernel && !st->ended && st->queued_until >= file_size) {
        // Read whole, in order: copied from the kernel's pages once the reads pause (Main).
        st->ended = true;
        streaming_keys_.erase(key);
        streams_.erase(ino);
        MutexLock lock(mu_);  // (stream_mu_ before mu_)
        if (stop_) {
          pending_.erase(key);
        } else {
          queue_.push_back(Job{ino, f, nullptr, true, 0});  // (its key stays in pending_)
          if (!thread_.joinable()) thread_ = std::thread([this] { Main(); });
          cv_.NotifyAll();
        }
      }
      stream_cv_.NotifyAll();
    }
  }
  MutexLock lock(mu_);
  if (stop_ || finishing_) return;
  auto found = coverage_.find(ino);
  if (found == coverage_.end()) {
    // Bounded: the inodes followed are those being read now, mostly. When there are too many,
    // all that are not queued start over (a whole read since is queued by its next reads).
    if (coverage_.size() >= kMaxInodes) std::erase_if(coverage_, [](const auto& kv) { return !kv.second.done; });
    found = coverage_.emplace(ino, Coverage{}).first;
  }
  Coverage& c = found->second;
  if (c.done) return;
  // Merge [begin, end) with the runs it touches.
  auto it = c.runs.upper_bound(begin);
  if (it != c.runs.begin()) {
    auto prev = std::prev(it);
    if (prev->second >= begin) {
      begin = prev->first;
      end = std::max(end, prev->second);
      it = c.runs.erase(prev);
    }
  }
  while (it != c.runs.end() && it->first <= end) {
    end = std::max(end, it->second);
    it = c.runs.erase(it);
  }
  c.runs.emplace(begin, end);
  if (c.runs.size() > kMaxRuns) {
    c.done = true;  // a scattered reader: not followed
    c.runs.clear();
    return;
  }
  if (!(c.runs.size() == 1 && c.runs.begin()->first == 0 && c.runs.begin()->second == file_size)) return;
  c.file = f;  // covered: copied now, or when the stream that holds its name ends (DropStream)
  QueueCopyLocked(ino, c);
}

void WholeFiles::QueueCopyLocked(uint64_t ino, Coverage& c) {
  if (c.done || !c.file.file) return;
  if (queue_.size() >= kMaxQueued) {
    stats_.dropped++;
    return;
  }
  // Being copied or streamed already (the same bytes, maybe by another name): for a stream,
  // DropStream comes back here if it ends without the file.
  if (!pending_.insert(KeyOf(*c.file.file)).second) return;
  c.done = true;
  c.runs.clear();
  queue_.push_back(Job{ino, c.file});
  stats_.queued++;
  if (!thread_.joinable()) thread_ = std::thread([this] { Main(); });
  cv_.NotifyAll();
}

bool WholeFiles::Hurry(std::chrono::milliseconds limit) {
  MutexLock lock(mu_);
  ++hurry_;
  cv_.NotifyAll();
  const bool done = cv_.WaitFor(mu_, limit, [&]() WFS_REQUIRES(mu_) { return queue_.empty() && !copying_; });
  --hurry_;
  return done;
}

void WholeFiles::Finish(std::chrono::milliseconds limit) {
  // Streams first: what is queued is appended (the stream thread drains its queue before it
  // stops); those not complete go to the disk cache.
  {
    MutexLock lock(stream_mu_);
    stream_stop_ = true;
  }
  stream_cv_.NotifyAll();
  if (stream_thread_.joinable()) stream_thread_.join();
  EndStreams("the mount ends");
  // What the mount kept, for the operator (and the test of `weightfs unmount`'s request).
  auto summary = [&] {
    const uint64_t kept = stats_.streamed.load() + stats_.copied.load();
    if (kept == 0 && stats_.failed.load() == 0) return;
    spdlog::info("whole files: {} kept whole by this mount ({} bytes from the kernel's pages, {} from its memory, {} chunks built "
                 "again), {} failed",
                 kept, stats_.kernel_bytes.load(), stats_.memory_bytes.load(), stats_.rebuilt.load(), stats_.failed.load());
  };
  MutexLock lock(mu_);
  finishing_ = true;
  if (queue_.empty() && !copying_) {
    summary();
    return;
  }
  spdlog::info("whole files: finishing the local copies of {} file(s) read whole", queue_.size() + (copying_ ? 1 : 0));
  cv_.NotifyAll();
  auto idle = [&]() WFS_REQUIRES(mu_) { return queue_.empty() && !copying_; };
  if (cv_.WaitFor(mu_, limit, idle)) {
    summary();
    return;
  }
  spdlog::warn("whole files: {} file(s) left without a local copy (the unmount waited {} s); they are read through "
               "the daemon", queue_.size() + (copying_ ? 1 : 0), limit.count() / 1000);
  queue_.clear();
  abort_ = true;
  cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return !copying_; });
}

void WholeFiles::Main() {
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), kCopyNice);
  MutexLock lock(mu_);
  for (;;) {
    cv_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
    if (stop_) return;
    // Readers first: wait for a pause in the daemon's reads (bounded), unless unmounting.
    const auto deferred = std::chrono::steady_clock::now() + kMaxDefer;
    while (!stop_ && !finishing_ && hurry_ == 0 && std::chrono::steady_clock::now() < deferred) {
      const auto last = std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(last_read_ns_.load()));
      const auto quiet_at = last + kIdle;
      if (std::chrono::steady_clock::now() >= quiet_at) break;
      cv_.WaitUntil(mu_, std::min(quiet_at, deferred), [&]() WFS_REQUIRES(mu_) { return stop_ || finishing_ || hurry_ > 0; });
    }
    if (stop_) return;
    if (queue_.empty()) continue;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    copying_ = true;
    lock.Unlock();
    const auto t0 = std::chrono::steady_clock::now();
    if (job.spill_until > 0) {
      const size_t put = SpillFromKernel(job);
      spdlog::debug("whole files: {}@{}/{}: {} chunks read before its stream ended to the disk cache",
                    job.file.manifest->model, job.file.manifest->version, job.file.file->path, put);
      lock.Lock();
      copying_ = false;
      cv_.NotifyAll();
      continue;
    }
    const bool streamed = job.writer != nullptr || job.from_kernel;
    Status s = job.writer ? job.writer->Commit() : Copy(job);
    stats_.copy_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    const std::string what = job.file.manifest->model + "@" + job.file.manifest->version + "/" + job.file.file->path;
    const bool there = s.ok() || s.kind() == ErrorKind::kConflict;  // (Conflict: it was there already)
    if (s.ok()) {
      (streamed ? stats_.streamed : stats_.copied)++;
      stats_.copied_bytes += job.file.file->size;
      spdlog::debug("whole files: {} is on local disk ({} bytes{})", what, job.file.file->size,
                    streamed ? ", written as it was read" : "");
    } else if (!there && !abort_.load()) {
      stats_.failed++;
      // A stream's chunks were built for the file alone: into the disk cache, from what was written.
      const size_t spilled = streamed ? job.writer->Spill() : 0;
      spdlog::warn("whole files: no local copy of {}: {}{}", what, s.ToString(),
                   streamed ? " (" + std::to_string(spilled) + " chunks to the disk cache)" : "");
    }
    job.writer.reset();
    if (there && on_copied_) on_copied_(job.ino);
    lock.Lock();
    pending_.erase(job.file.file->sha256 + "-" + std::to_string(job.file.file->size));
    // Followed afresh: should the copy go (changed on disk, evicted), a whole read copies it again.
    coverage_.erase(job.ino);
    copying_ = false;
    cv_.NotifyAll();
  }
}

Status WholeFiles::ChunkOf(uint64_t ino, const VersionFile& f, const ManifestFile& rows, size_t i, ByteBuffer* scratch,
                           ChunkBytes* held, std::span<const uint8_t>* out, bool build) {
  const ManifestChunk& c = rows.chunks[i];
  // From the kernel's copy of the file's pages (a file read through the daemon is in FUSE's
  // page cache until memory is short; first, so that this path is the one every copy takes,
  // not only those whose chunks left the reader's memory); else from memory if the reader
  // still holds it; else the materializer's read of the disk cache (verified) or a build, not
  // through the reader, whose memory it would fill.
  if (kernel_pages_ && ino != 0) {
    scratch->resize(c.length);
    const size_t got = kernel_pages_(ino, c.offset, scratch->data(), c.length);
    if (got == c.length && HashChunk(*scratch) == c.hash) {
      stats_.kernel_bytes += c.length;
      *out = *scratch;
      return Status::Ok();
    }
    spdlog::debug("whole files: the kernel held {} of the {} bytes at {} of inode {}{}", got, c.length, c.offset, ino,
                  got == c.length ? " (not the chunk's bytes)" : "");
  }
  if (std::optional<ChunkBytes> m = reader_->Cached(c.hash)) {
    if (kernel_pages_) stats_.memory_bytes += c.length;
    *held = std::move(*m);
    *out = held->span();
    return Status::Ok();
  }
  if (!build) return Status::NotFound("not held");
  if (kernel_pages_) stats_.rebuilt++;
  WFS_ASSIGN_OR_RETURN(*held, materializer_->Shared(*f.manifest, rows, i, /*cache_result=*/false));
  *out = held->span();
  return Status::Ok();
}

Status WholeFiles::Copy(const Job& job) {
  const VersionFile& f = job.file;
  const ManifestFile& head = *f.file;
  WFS_ASSIGN_OR_RETURN(std::unique_ptr<WholeFileWriter> writer, cache_->BeginWholeFile(head.sha256, head.size));
  // The rows, block by block for a section in blocks (as ChunkReader::Read walks them).
  std::shared_ptr<const ManifestFile> rows = f.rows ? f.rows : std::shared_ptr<const ManifestFile>(f.manifest, f.file);
  ByteBuffer scratch;
  uint64_t pos = 0;
  while (pos < head.size) {
    if (abort_.load()) return Status::IOError("stopped");
    if (!rows->Holds(pos)) {
      WFS_ASSIGN_OR_RETURN(rows, materializer_->bucket()->RowsAt(*f.manifest, *rows, pos));
      if (!rows->Holds(pos)) return Status::Corruption("the rows of " + head.path + " do not hold byte " + std::to_string(pos));
    }
    const ManifestFile& file = *rows;
    for (size_t i = file.ChunkAt(pos); i < file.chunks.size(); ++i) {
      if (abort_.load()) return Status::IOError("stopped");
      const ManifestChunk& c = file.chunks[i];
      ChunkBytes held;
      std::span<const uint8_t> bytes;
      WFS_TRY(ChunkOf(job.ino, f, file, i, &scratch, &held, &bytes, true));
      WFS_TRY(writer->Append(ChunkRef{c.hash, c.offset, c.length}, bytes));
      pos = c.offset + c.length;
    }
  }
  return writer->Finish();
}

size_t WholeFiles::SpillFromKernel(const Job& job) {
  const VersionFile& f = job.file;
  std::shared_ptr<const ManifestFile> rows = f.rows ? f.rows : std::shared_ptr<const ManifestFile>(f.manifest, f.file);
  ByteBuffer scratch;
  size_t put = 0;
  for (uint64_t pos = 0; pos < job.spill_until && !abort_.load();) {
    if (!rows->Holds(pos)) {
      Expected<std::shared_ptr<const ManifestFile>> block = materializer_->bucket()->RowsAt(*f.manifest, *rows, pos);
      if (!block.ok() || !(*block)->Holds(pos)) return put;
      rows = std::move(block).value();
    }
    for (size_t i = rows->ChunkAt(pos); i < rows->chunks.size() && pos < job.spill_until; ++i) {
      const ManifestChunk& c = rows->chunks[i];
      pos = c.offset + c.length;
      if (cache_->Contains(c.hash)) continue;
      ChunkBytes held;
      std::span<const uint8_t> bytes;
      if (ChunkOf(job.ino, f, *rows, i, &scratch, &held, &bytes, false).ok() && cache_->Put(c.hash, bytes).ok()) ++put;
    }
  }
  return put;
}

}  // namespace weightfs

namespace weightfs {

// ---- streams ------------------------------------------------------------------------------------

namespace {

// A chunk of a stream that ends before it is written whole: into the disk cache, unless the
// cache has it (its build skipped the disk cache).
void SpillPiece(ChunkCache* cache, const ChunkRef& row, const ChunkBytes& bytes) {
  if (bytes.size() == row.length && !cache->Contains(row.hash)) (void)cache->Put(row.hash, bytes.span());
}

}  // namespace

void WholeFiles::StreamMain() {
  MutexLock lock(stream_mu_);
  for (;;) {
    stream_cv_.WaitFor(stream_mu_, std::chrono::seconds(1),
                       [&]() WFS_REQUIRES(stream_mu_) { return stream_stop_ || !pieces_.empty(); });
    if (pieces_.empty()) {
      if (stream_stop_) return;
      // Streams that stopped short (the reader closed the file, or jumped away) or fell behind.
      const auto now = std::chrono::steady_clock::now();
      std::vector<std::pair<uint64_t, std::shared_ptr<Stream>>> stale;
      for (const auto& [ino, st] : streams_) {
        if (!st->ended && (st->overrun || now - st->last > kStreamIdle)) stale.emplace_back(ino, st);
      }
      for (auto& [ino, st] : stale) {
        const bool overrun = st->overrun;
        lock.Unlock();
        EndStream(ino, *st, overrun ? "the reader outran the writer" : "no read for a while");
        lock.Lock();
      }
      continue;
    }
    Piece piece = std::move(pieces_.front());
    pieces_.pop_front();
    pieces_bytes_ -= piece.row.length;
    appending_ = true;
    std::shared_ptr<Stream> st;
    if (auto it = streams_.find(piece.ino); it != streams_.end()) st = it->second;
    lock.Unlock();
    if (st) {
      (void)Append(piece.ino, *st, std::move(piece));
    } else {
      SpillPiece(cache_, piece.row, piece.bytes);  // (its stream ended)
    }
    piece = Piece{};
    lock.Lock();
    appending_ = false;
    stream_cv_.NotifyAll();
  }
}

bool WholeFiles::Append(uint64_t ino, Stream& s, Piece piece) {
  bool overrun = false;
  {
    MutexLock lock(stream_mu_);
    if (s.ended) {
      lock.Unlock();
      SpillPiece(cache_, piece.row, piece.bytes);
      return true;
    }
    overrun = s.overrun;
  }
  if (overrun) {
    EndStream(ino, s, "the reader outran the writer");
    SpillPiece(cache_, piece.row, piece.bytes);
    return true;
  }
  const ManifestFile& head = *s.file.file;
  if (!s.writer) {
    Expected<std::unique_ptr<WholeFileWriter>> w =
        cache_->BeginWholeFile(head.sha256, head.size, WholeFileWriter::Mode::kPageCache);
    if (!w.ok()) {
      if (w.status().kind() == ErrorKind::kConflict) {
        // Whole already (its chunks are found in it): nothing to write, nothing to spill.
        {
          MutexLock lock(stream_mu_);
          s.ended = true;
        }
        DropStream(ino);
        return true;
      }
      EndStream(ino, s, w.status().ToString());
      SpillPiece(cache_, piece.row, piece.bytes);
      return true;
    }
    s.writer = std::move(w).value();
  }
  WholeFileWriter& w = *s.writer;
  if (piece.row.offset < w.written()) return false;  // appended already
  if (piece.row.offset > w.written()) {
    if (s.ahead.size() >= kStreamAhead) {
      EndStream(ino, s, "a read jumped ahead of the file's next chunk");
      SpillPiece(cache_, piece.row, piece.bytes);
      return true;
    }
    s.ahead.emplace(piece.row.offset, std::make_pair(piece.row, std::move(piece.bytes)));
    return false;
  }
  Status st = w.Append(piece.row, piece.bytes.span());
  piece.bytes = ChunkBytes();
  while (st.ok() && !s.ahead.empty() && s.ahead.begin()->first <= w.written()) {
    auto next = s.ahead.extract(s.ahead.begin());
    if (next.key() == w.written()) st = w.Append(next.mapped().first, next.mapped().second.span());
  }
  if (!st.ok()) {
    EndStream(ino, s, st.ToString());
    return true;
  }
  if (w.written() < w.size()) return false;
  if (Status done = w.Complete(); !done.ok()) {
    EndStream(ino, s, done.ToString());
    return true;
  }
  // Written through the page cache; synced and put in place by the copying thread once the
  // reads pause (Main): the writeback does not take the disk from the reads.
  spdlog::debug("whole files: {}@{}/{} written as it was read ({} bytes), to be synced", s.file.manifest->model,
                s.file.manifest->version, head.path, head.size);
  const VersionFile file = s.file;
  std::unique_ptr<WholeFileWriter> writer = std::move(s.writer);
  {
    MutexLock lock(stream_mu_);
    s.ended = true;
    streaming_keys_.erase(s.key);
    streams_.erase(ino);
  }
  HandOver(ino, file, std::move(writer));
  return true;
}

void WholeFiles::EndStream(uint64_t ino, Stream& s, const std::string& why) {
  {
    MutexLock lock(stream_mu_);
    if (s.ended) return;
    s.ended = true;
    streaming_keys_.erase(s.key);  // builds of its chunks go to the disk cache again
  }
  size_t spilled = s.writer ? s.writer->Spill() : 0;
  for (auto& [offset, held] : s.ahead) {
    SpillPiece(cache_, held.first, held.second);
    ++spilled;
  }
  s.ahead.clear();
  uint64_t written = s.writer ? s.writer->written() : 0;
  if (s.kernel) {
    // What it read skipped the disk cache and is in the kernel's pages: into the disk cache
    // from them, by the copying thread once reads pause.
    {
      MutexLock lock(stream_mu_);
      written = s.queued_until;
      if (!s.queued_beyond.empty()) written = std::max(written, std::prev(s.queued_beyond.end())->second);
    }
    MutexLock lock(mu_);
    if (written > 0 && !stop_) {
      queue_.push_back(Job{ino, s.file, nullptr, true, written});
      if (!thread_.joinable()) thread_ = std::thread([this] { Main(); });
      cv_.NotifyAll();
    }
  }
  // Chunks built for it that it never saw (readahead past the reads, a read noted after it
  // ended): from memory into the disk cache. The builds that finish from now on put theirs
  // there themselves (ChunkReader::set_skip_disk_cache).
  spilled += RescueBuilt(s.file, written, std::min<uint64_t>(s.file.file->size, written + kRescueBytes));
  s.writer.reset();
  stats_.stream_ends++;
  spdlog::debug("whole files: {}@{}/{} not written as it was read ({}; at byte {} of {}): {} chunks to the disk cache",
                s.file.manifest->model, s.file.manifest->version, s.file.file->path, why, written, s.file.file->size,
                spilled);
  DropStream(ino);
}

size_t WholeFiles::RescueBuilt(const VersionFile& f, uint64_t from, uint64_t to) {
  std::shared_ptr<const ManifestFile> rows = f.rows ? f.rows : std::shared_ptr<const ManifestFile>(f.manifest, f.file);
  size_t put = 0;
  for (uint64_t pos = from; pos < to;) {
    if (!rows->Holds(pos)) {
      Expected<std::shared_ptr<const ManifestFile>> block = materializer_->bucket()->RowsAt(*f.manifest, *rows, pos);
      if (!block.ok() || !(*block)->Holds(pos)) return put;
      rows = std::move(block).value();
    }
    for (size_t i = rows->ChunkAt(pos); i < rows->chunks.size() && pos < to; ++i) {
      const ManifestChunk& c = rows->chunks[i];
      if (std::optional<ChunkBytes> held = reader_->Cached(c.hash); held && !cache_->Contains(c.hash)) {
        if (cache_->Put(c.hash, held->span()).ok()) ++put;
      }
      pos = c.offset + c.length;
    }
  }
  return put;
}

void WholeFiles::DropStream(uint64_t ino) {
  std::string key;
  {
    MutexLock lock(stream_mu_);
    auto it = streams_.find(ino);
    if (it == streams_.end()) return;
    key = it->second->key;
    streaming_keys_.erase(key);
    streams_.erase(it);
  }
  MutexLock lock(mu_);
  pending_.erase(key);
  // A reader that covered the file while the stream held its name gets the copy now (unless
  // the stream wrote it: the copy then finds it there).
  if (auto c = coverage_.find(ino); c != coverage_.end() && !stop_) QueueCopyLocked(ino, c->second);
}

void WholeFiles::EndStreams(const std::string& why) {
  std::vector<std::pair<uint64_t, std::shared_ptr<Stream>>> all;
  {
    MutexLock lock(stream_mu_);
    for (const auto& kv : streams_) all.push_back(kv);
    // Pieces no stream will take: their chunks go to the disk cache.
    while (!pieces_.empty()) {
      Piece p = std::move(pieces_.front());
      pieces_.pop_front();
      pieces_bytes_ -= p.row.length;
      lock.Unlock();
      auto it = std::find_if(all.begin(), all.end(), [&](const auto& kv) { return kv.first == p.ino; });
      if (it != all.end()) {
        (void)Append(p.ino, *it->second, std::move(p));
      } else {
        SpillPiece(cache_, p.row, p.bytes);
      }
      lock.Lock();
    }
  }
  for (auto& [ino, st] : all) EndStream(ino, *st, why);
}

}  // namespace weightfs
