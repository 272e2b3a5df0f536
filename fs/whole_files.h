// WholeFiles: the mount keeps a local copy of each published file it has read whole, so that
// the kernel can serve the file from local disk from then on (fs/passthrough.h).
//
// Three ways to a copy:
//   - From the kernel's pages (a kernel stream; set_kernel_pages): a reader that starts at the
//     file's first byte and goes on in order (cat, cp, a loader reading every tensor) of a file
//     of at most 1/kKernelFraction of the memory available has its chunks built without a chunk
//     file of their own (ChunkReader::set_skip_disk_cache), and nothing is written while it
//     reads: the reads put the file's bytes into FUSE's page cache anyway, and once the reads
//     pause, the copy is made from there (FUSE_NOTIFY_RETRIEVE: the kernel answers with the
//     pages it holds; each chunk verified against its hash), O_DIRECT. A page the kernel has
//     dropped since (memory pressure) is taken from the reader's memory, else the chunk is built
//     again (counted: `rebuilt`). Why: on the benchmark VM, a node holding N read N+1 in 1.15 s
//     when nothing was written, 2.1-2.4 s writing the copy O_DIRECT as it read (the writes took
//     the disk from the reads), and 1.6-4.3 s writing it through the page cache (the kernel's
//     copy into fresh page-cache pages: 1-5 CPU-s for 2 GB, by what the machine freed before);
//     from the kernel's pages after the read, 1.5-2.1 s and a third of the CPU. A reader that
//     jumps away (kStreamAhead chunks out of order) or stops (kStreamIdle) ends the stream: what
//     it read goes into the disk cache as chunk files, the same way (SpillFromKernel).
//   - As it is read (a stream with pieces): the same readers of a larger file, or without the
//     kernel's pages, have each chunk appended to the whole file as their reads pass it (on the
//     stream thread, behind the replies), through the page cache (WholeFileWriter::Mode::
//     kPageCache): the kernel's writeback, and the sync before the file gets its name, which
//     the copying thread does once reads pause, do not take the disk from the reads. Reads a
//     little out of order (the kernel's asynchronous readahead) are put back in order; a reader
//     more than kStreamQueueBytes ahead of the writer waits for it (kStreamWait at most, as a
//     build waits for the disk cache's write-behind); a reader that jumps further, stops for
//     kStreamIdle, or outruns the writer for longer ends the stream, whose chunks then go into
//     the disk cache as chunk files (WholeFileWriter::Spill): nothing read is lost.
//   - After it was read: any other reader whose reads covered the file, from the chunks it was
//     read from (below).
//
// Which files: those whose every byte a reader has had from the daemon (NoteRead records the
// ranges each inode's reads covered; `cat`, `cp`, a loader reading or mapping every tensor all
// get there), of at least `min_bytes`, with a SHA-256 in their manifest (not a derived
// version's). Each is copied once, on one background thread of low priority, from the chunks
// it was read from: the kernel's pages, else the mount's memory cache, else the disk cache
// (verified, as every chunk is), into the chunk cache's whole file (hub/engine/chunk_cache.h:
// written O_DIRECT, synced, indexed), which then replaces those chunks' files in the disk
// cache. A node following a run thus keeps each version once, as whole files, and the next
// version is built from them as from chunk files.
//
// When: a copy (and a stream's sync) waits until the daemon has served no read for kIdle (a reader of the next file,
// or of the next version, goes first: both compete for the same disk and cores), at most
// kMaxDefer; when `weightfs unmount` asks (Hurry: while the kernel still holds the pages); at
// unmount (Finish) at once.
//
// Bounds: at most kMaxStreams streams, each writing from two 8 MiB staging buffers; the pieces
// waiting for the writers hold at most kStreamQueueBytes of chunks (buffers the memory cache
// mostly holds anyway), and a stream at most kStreamAhead chunks out of order; the tracked ranges are at most kMaxRuns per inode (a reader that scatters more is
// not followed) and kMaxInodes inodes at once; one copy runs at a time, its memory one staging
// buffer (8 MiB) and one chunk; the queue holds at most kMaxQueued files (more are dropped: a
// later whole read queues them again). A copy that fails (a full disk, a chunk the bucket cannot
// give) is logged and counted; the file is still read through the daemon.
//
// Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "core/mutex.h"
#include "core/thread_annotations.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"
#include "fs/chunk_reader.h"
#include "fs/namespace.h"

namespace weightfs {

struct WholeFilesStats {
  std::atomic<uint64_t> streamed{0};      // whole files written as they were read
  std::atomic<uint64_t> stream_ends{0};   // streams given up (their chunks spilled to chunk files)
  std::atomic<uint64_t> queued{0};        // files queued for a copy
  std::atomic<uint64_t> copied{0};        // whole files written
  std::atomic<uint64_t> copied_bytes{0};
  std::atomic<uint64_t> failed{0};        // copies that failed (logged)
  std::atomic<uint64_t> dropped{0};       // not queued: the queue was full
  std::atomic<uint64_t> copy_ns{0};       // time spent copying
  std::atomic<uint64_t> kernel_bytes{0};  // bytes copied from the kernel's pages (kernel streams)
  std::atomic<uint64_t> memory_bytes{0};  // bytes of kernel streams the kernel no longer held, from the reader's memory
  std::atomic<uint64_t> rebuilt{0};       // chunks of kernel streams the kernel no longer held, built again
};

class WholeFiles {
 public:
  static constexpr uint64_t kDefaultMinBytes = 1 << 20;
  static constexpr size_t kMaxRuns = 256;
  static constexpr size_t kMaxInodes = 4096;
  static constexpr size_t kMaxQueued = 4096;
  static constexpr std::chrono::milliseconds kIdle{500};
  static constexpr std::chrono::milliseconds kMaxDefer{10000};
  static constexpr std::chrono::milliseconds kStreamIdle{3000};
  static constexpr uint64_t kStreamQueueBytes = 32ull << 20;
  static constexpr std::chrono::milliseconds kStreamWait{2000};  // a reader waits for the writer
  // How far past a stream's end EndStream looks for chunks built for it (readahead's window
  // and the reads in flight are well within it).
  static constexpr uint64_t kRescueBytes = 256ull << 20;
  // Streams at once: each holds two staging buffers (16 MiB) and its queue's share; more
  // readers in order at once get the copy after their reads instead.
  static constexpr size_t kMaxStreams = 2;
  static constexpr size_t kStreamAhead = 6;  // chunks held for a gap before them to fill

  // All must outlive this object.
  WholeFiles(Materializer* materializer, ChunkReader* reader, ChunkCache* cache,
             uint64_t min_bytes = kDefaultMinBytes);
  // Stop, and then nothing is left to do.
  ~WholeFiles();
  // Ends the streams (their chunks to the disk cache), drops the copies queued (but syncs the
  // files streams completed: those hold chunks nothing else does) and waits for the one in
  // progress (Finish first to copy them all). Idempotent; after it, NoteRead ignores
  // reads and Streaming says no.
  void Stop() WFS_EXCLUDES(mu_, stream_mu_);
  WholeFiles(const WholeFiles&) = delete;
  WholeFiles& operator=(const WholeFiles&) = delete;

  // Whether `f` is a file this keeps whole copies of.
  bool Wanted(const VersionFile& f) const;
  // A read of [offset, offset + size) of inode `ino`, file `f`, was served by the daemon, with
  // the chunks in `read` (may be null). It goes on a stream, or once the reads cover the file,
  // its copy is queued.
  void NoteRead(uint64_t ino, const VersionFile& f, uint64_t offset, uint64_t size, const ReadResult* read = nullptr)
      WFS_EXCLUDES(mu_, stream_mu_);
  // Whether builds of `file`'s chunks skip the disk cache (a stream writes them): what
  // ChunkReader::set_skip_disk_cache is given.
  bool Streaming(const ManifestFile& file) const WFS_EXCLUDES(stream_mu_);
  // A read-only descriptor of the whole copy of `f` (ChunkCache::OpenWholeFile), or -1.
  int Open(const VersionFile& f);
  // Called on the copying thread after the copy of inode `ino` is in place (or found there).
  void set_on_copied(std::function<void(uint64_t ino)> on_copied);
  // What the kernel's page cache holds of inode `ino` (FUSE_NOTIFY_RETRIEVE): copies up to
  // `size` bytes from `offset` into `out`, returns how many (a prefix: up to the first page it
  // does not hold). With it, a stream of a file that fits in memory (kKernelFraction of what is
  // available) writes nothing while it is read: the copy is made from the kernel's pages once
  // the reads pause (a "kernel stream"). Set before the first read; may be unset.
  using KernelPages = std::function<size_t(uint64_t ino, uint64_t offset, uint8_t* out, size_t size)>;
  void set_kernel_pages(KernelPages pages);
  // A kernel stream is used for files of at most this fraction of the memory available.
  static constexpr uint64_t kKernelFraction = 4;
  // Runs what is queued now, without waiting for the reads to pause, and returns once the queue
  // is empty (or after `limit`: false). While the session is up, kernel streams are copied from
  // the kernel's pages: `weightfs unmount` asks for this before it unmounts (after, those pages
  // are gone, and the chunks are built again).
  bool Hurry(std::chrono::milliseconds limit) WFS_EXCLUDES(mu_);
  // Copies everything queued, then returns (unmount: a whole read just before it is kept);
  // after `limit`, drops what is left (unmount must not outlast `weightfs unmount`'s wait).
  void Finish(std::chrono::milliseconds limit) WFS_EXCLUDES(mu_, stream_mu_);

  const WholeFilesStats& stats() const { return stats_; }
  size_t queue_depth() const WFS_EXCLUDES(mu_);

 private:
  struct Coverage {
    std::map<uint64_t, uint64_t> runs;  // start -> end of the byte ranges read, disjoint, apart
    bool done = false;                  // queued (or given up on): not followed further
    VersionFile file;                   // once the runs cover it: what to copy
  };
  // Queues the copy of a covered file unless it is queued, copied or streamed already.
  void QueueCopyLocked(uint64_t ino, Coverage& c) WFS_REQUIRES(mu_);
  struct Job {
    uint64_t ino = 0;
    VersionFile file;
    std::unique_ptr<WholeFileWriter> writer;  // a stream's complete file, to commit (not copy)
    // A kernel stream's: its chunks are in the kernel's pages (else rebuilt), none in the disk
    // cache. `spill_until` > 0: the stream ended at that byte; its chunks before it go into
    // the disk cache (chunk files), and no whole file is made.
    bool from_kernel = false;
    uint64_t spill_until = 0;
  };
  // A stream's file is complete: its commit is queued (Main).
  void HandOver(uint64_t ino, const VersionFile& f, std::unique_ptr<WholeFileWriter> writer) WFS_EXCLUDES(mu_);
  void Main() WFS_EXCLUDES(mu_);
  Status Copy(const Job& job);
  // The bytes of chunk i of `rows` (of inode ino's file `f`) in *out: from memory (held keeps
  // them), else the kernel's pages (into scratch; verified), else, if `build`, the disk cache
  // or a build (not put into the disk cache; NotFound when not `build`).
  Status ChunkOf(uint64_t ino, const VersionFile& f, const ManifestFile& rows, size_t i, ByteBuffer* scratch,
                 ChunkBytes* held, std::span<const uint8_t>* out, bool build);
  // A kernel stream that ended short: its chunks before job.spill_until into the disk cache.
  size_t SpillFromKernel(const Job& job);

  // A file written as it is read. Its pieces (the chunks of each read) go through `pieces_`
  // to the stream thread, which appends them in order.
  struct Stream {
    VersionFile file;
    std::string key;  // sha256-size
    std::unique_ptr<WholeFileWriter> writer;  // the stream thread's; made by its first piece
    std::map<uint64_t, std::pair<ChunkRef, ChunkBytes>> ahead;  // by offset: waiting for a gap
    // Of the readers' side (under stream_mu_): every row below queued_until is queued, and
    // these beyond it.
    uint64_t queued_until = 0;
    std::map<uint64_t, uint64_t> queued_beyond;  // offset -> end
    std::chrono::steady_clock::time_point last;  // the last piece queued
    bool ended = false;    // given up or done: pieces are spilled or dropped
    bool overrun = false;  // a piece was not queued (the queue was full): it cannot complete
    bool kernel = false;   // a kernel stream: no pieces; the reads' order is followed only
  };
  struct Piece {
    uint64_t ino = 0;
    ChunkRef row;
    ChunkBytes bytes;
  };
  void StreamMain() WFS_EXCLUDES(stream_mu_, mu_);
  // On the stream thread: appends a piece; true once the stream is over (done or given up).
  bool Append(uint64_t ino, Stream& s, Piece piece) WFS_EXCLUDES(stream_mu_, mu_);
  // Ends a stream that will not complete: its chunks go to the disk cache.
  void EndStream(uint64_t ino, Stream& s, const std::string& why) WFS_EXCLUDES(stream_mu_, mu_);
  void DropStream(uint64_t ino) WFS_EXCLUDES(stream_mu_, mu_);
  // Puts the chunks of [from, to) of `f` that the reader holds in memory and the disk cache
  // does not into the disk cache; returns how many.
  size_t RescueBuilt(const VersionFile& f, uint64_t from, uint64_t to);
  // Appends what is queued, then ends every stream left (Finish, the destructor).
  void EndStreams(const std::string& why) WFS_EXCLUDES(stream_mu_, mu_);

  Materializer* const materializer_;
  ChunkReader* const reader_;
  ChunkCache* const cache_;
  const uint64_t min_bytes_;
  std::function<void(uint64_t)> on_copied_;
  KernelPages kernel_pages_;

  mutable Mutex mu_;
  CondVar cv_;
  std::unordered_map<uint64_t, Coverage> coverage_ WFS_GUARDED_BY(mu_);
  std::deque<Job> queue_ WFS_GUARDED_BY(mu_);
  std::unordered_set<std::string> pending_ WFS_GUARDED_BY(mu_);  // digests queued or being copied
  bool copying_ WFS_GUARDED_BY(mu_) = false;
  bool finishing_ WFS_GUARDED_BY(mu_) = false;  // Finish: copy what is queued, then stop
  int hurry_ WFS_GUARDED_BY(mu_) = 0;           // Hurry calls waiting: no wait for a pause
  bool stop_ WFS_GUARDED_BY(mu_) = false;
  std::atomic<bool> abort_{false};  // the destructor: the copy in progress stops early
  std::atomic<int64_t> last_read_ns_{0};  // steady clock of the last NoteRead
  // Lock order: stream_mu_ before mu_.
  mutable Mutex stream_mu_ WFS_ACQUIRED_BEFORE(mu_);
  CondVar stream_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Stream>> streams_ WFS_GUARDED_BY(stream_mu_);
  std::unordered_set<std::string> streaming_keys_ WFS_GUARDED_BY(stream_mu_);
  std::deque<Piece> pieces_ WFS_GUARDED_BY(stream_mu_);
  uint64_t pieces_bytes_ WFS_GUARDED_BY(stream_mu_) = 0;
  bool appending_ WFS_GUARDED_BY(stream_mu_) = false;  // the stream thread holds a piece
  bool stream_stop_ WFS_GUARDED_BY(stream_mu_) = false;

  WholeFilesStats stats_;
  std::thread thread_;  // started by the first copy queued
  std::thread stream_thread_;  // started by the first stream
};

}  // namespace weightfs
