// The background encoder: a file closed by its last writer is encoded against the parent's
// file of the same path (VersionEncoder) and its packs uploaded, one file at a time; small
// files (one chunk) wait for a pack's worth of others and are encoded together, their payloads
// in shared packs and their manifests in one part file.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include <spdlog/spdlog.h>

#include "hub/engine/lease.h"
#include "hub/engine/file_bytes.h"
#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

void Drafts::State::Enqueue(const std::string& draft, const std::string& path) {
  {
    MutexLock lock(queue_mu);
    queue.emplace_back(draft, path);
  }
  queue_cv.NotifyOne();
}

// Encodes the staged file at `path` unless it is encoded already. Waits for an encode of
// the same file in progress. Busy while the file is open for writing; InvalidArgument when a
// write to it failed (it must be written again).
Status Drafts::State::EnsureEncoded(const std::shared_ptr<Draft>& d, const std::string& path) {
  std::shared_ptr<DraftFile> f;
  uint64_t generation;
  {
    MutexLock lock(mu);
    for (;;) {
      auto it = d->files.find(path);
      if (it == d->files.end()) return Status::Ok();  // removed meanwhile
      f = it->second;
      MutexLock flock(f->mu);
      if (f->Encoded(path)) return Status::Ok();
      if (!f->write_error.empty()) {
        return Status::InvalidArgument("a write to " + d->name() + "/" + path + " failed (" + f->write_error +
                                       "); write the file again or remove it, then commit");
      }
      if (f->writers > 0) {
        return Status::Busy(d->name() + "/" + path + " is still open for writing");
      }
      if (!f->encoding) {
        f->encoding = true;
        generation = f->generation;
        break;
      }
      flock.Unlock();
      encoded_cv.Wait(mu);
    }
  }
  Status s = EncodeNow(d, f, path, generation);
  {
    MutexLock lock(mu);
    MutexLock flock(f->mu);
    f->encoding = false;
  }
  encoded_cv.NotifyAll();
  if (!s.ok()) {
    MutexLock lock(mu);
    d->encode_error = s.ToString();
  }
  return s;
}

void Drafts::State::WorkerMain() {
  using Clock = std::chrono::steady_clock;
  for (;;) {
    std::optional<std::pair<std::string, std::string>> job;
    {
      MutexLock lock(queue_mu);
      // Small files wait for more of them, or a second without another (`small`: this thread's).
      std::optional<Clock::time_point> due;
      for (const auto& [name, batch] : small) {
        if (!due || batch.last + kSmallIdle < *due) due = batch.last + kSmallIdle;
      }
      auto ready = [&]() WFS_REQUIRES(queue_mu) { return stopping || !queue.empty(); };
      if (due) {
        queue_cv.WaitFor(queue_mu, std::chrono::duration_cast<std::chrono::milliseconds>(*due - Clock::now()) +
                                       std::chrono::milliseconds(1), ready);
      } else {
        queue_cv.Wait(queue_mu, ready);
      }
      if (stopping) return;
      if (!queue.empty()) {
        job = std::move(queue.front());
        queue.pop_front();
      }
    }
    try {  // an exception (an allocation failing) fails this job, not the daemon
      if (job) RunJob(*job);
      // Batches of small files whose time has come.
      const Clock::time_point now = Clock::now();
      for (auto it = small.begin(); it != small.end();) {
        if (it->second.last + kSmallIdle > now && it->second.bytes < options.push.pack_bytes &&
            it->second.paths.size() < kSmallBatchFiles) {
          ++it;
          continue;
        }
        const std::string name = it->first;
        std::vector<std::string> paths = std::move(it->second.paths);
        it = small.erase(it);
        std::shared_ptr<Draft> d;
        {
          MutexLock lock(mu);
          d = DraftLocked(name);
        }
        if (!d) continue;
        if (Status s = EncodeSmall(d, std::move(paths)); !s.ok()) {
          spdlog::error("draft {}: encoding {} small files failed (the data stays staged; commit retries): {}",
                        name, paths.size(), s.ToString());
        }
      }
    } catch (...) {
      const std::string what = !job ? "small files" : job->second.empty() ? "committing" : "encoding";
      const Status st = StatusOfCurrentException(what);
      spdlog::error("draft {} {}: {}: {} (the data stays staged; commit retries)", job ? job->first : "",
                    job ? job->second : what, ErrorKindName(st.kind()), st.message());
    }
  }
}

void Drafts::State::RunJob(const std::pair<std::string, std::string>& job) {
  std::shared_ptr<Draft> d;
  bool batch = false;
  uint64_t size = 0;
  {
    MutexLock lock(mu);
    d = DraftLocked(job.first);
    if (d && !job.second.empty()) {
      if (auto it = d->files.find(job.second); it != d->files.end()) {
        const DraftFile& f = *it->second;
        MutexLock flock(f.mu);
        if (f.Encoded(job.second) || f.writers > 0 || f.encoding) return;  // nothing to do, or done elsewhere
        batch = Small(f) && f.write_error.empty();
        size = f.size;
      }
    }
  }
  if (!d) return;
  if (job.second.empty()) {
    Status s = CommitDraft(d, d->commit_as);
    if (!s.ok()) {
      spdlog::error("resuming the commit of draft {}: {}", job.first, s.ToString());
      MutexLock lock(mu);
      d->error = s.ToString();
    }
    return;
  }
  if (batch) {
    SmallBatch& b = small[job.first];
    b.paths.push_back(job.second);
    b.bytes += size;
    b.last = std::chrono::steady_clock::now();
    return;
  }
  Status s = EnsureEncoded(d, job.second);
  if (!s.ok() && s.kind() != ErrorKind::kInvalidArgument && s.kind() != ErrorKind::kBusy) {
    // The bucket (or the disk) failed: the draft's other queued files would most likely fail
    // the same way, one timeout after another. Commit encodes them when it runs.
    size_t dropped = 0;
    {
      MutexLock lock(queue_mu);
      const size_t before = queue.size();
      std::erase_if(queue, [&](const auto& j) { return j.first == job.first && !j.second.empty(); });
      dropped = before - queue.size();
    }
    spdlog::error("draft {}: encoding {} failed (the data stays staged; commit retries{}): {}", job.first,
                  job.second, dropped ? ", as it will the " + std::to_string(dropped) + " files queued after it" : "",
                  s.ToString());
  }
}

Status Drafts::State::EnsureAllEncoded(const std::shared_ptr<Draft>& d, const std::vector<std::string>& paths) {
  // The small ones first, together, in batches of a pack's worth.
  std::vector<std::vector<std::string>> batches(1);
  {
    MutexLock lock(mu);
    uint64_t bytes = 0;
    for (const std::string& path : paths) {
      auto it = d->files.find(path);
      if (it == d->files.end()) continue;
      const DraftFile& f = *it->second;
      MutexLock flock(f.mu);
      if (f.Encoded(path) || !Small(f) || f.encoding || f.writers > 0 || !f.write_error.empty()) continue;
      if (bytes + f.size > options.push.pack_bytes || batches.back().size() >= kSmallBatchFiles) {
        batches.emplace_back();
        bytes = 0;
      }
      batches.back().push_back(path);
      bytes += f.size;
    }
  }
  for (std::vector<std::string>& batch : batches) {
    if (!batch.empty()) WFS_TRY(EncodeSmall(d, std::move(batch)));
  }
  // The rest one by one (and the errors of files that cannot be encoded: open, failed writes).
  for (const std::string& path : paths) WFS_TRY(EnsureEncoded(d, path));
  return Status::Ok();
}

Status Drafts::State::EnsureLease(Draft& d) {
  MutexLock lock(mu);
  if (d.lease) return Status::Ok();
  lock.Unlock();
  Expected<std::unique_ptr<Lease>> lease = Lease::Acquire(&bucket->store(), d.name() + " (draft)");
  if (!lease.ok()) return lease.status().WithContext("taking a lease for the draft's packs");
  lock.Lock();
  if (!d.lease) d.lease = std::move(lease).value();
  return Status::Ok();
}

// A small staged file's bytes, read whole through its open descriptor; refused when the staging
// file's size is not the draft's (changed outside the mount; as in EncodeNow). REQUIRES f.mu.
static Status ReadSmallStaged(const Draft& d, const std::string& path, DraftFile& f, std::vector<uint8_t>* bytes)
    WFS_REQUIRES(f.mu) {
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) return LastErrnoStatus("stat of staging file " + f.staging);
  if (static_cast<uint64_t>(st.st_size) != f.size) {
    return Status::IOError("staging file " + f.staging + " of " + d.name() + "/" + path + " holds " +
                           std::to_string(st.st_size) + " bytes where the draft's file has " + std::to_string(f.size) +
                           ": it was changed outside the mount; write the file again (or remove it from the draft)");
  }
  bytes->resize(f.size);
  return PreadAll(f.fd, bytes->data(), bytes->size(), 0, "staging file " + f.staging);
}

Status Drafts::State::EncodeSmall(const std::shared_ptr<Draft>& d, std::vector<std::string> paths) {
  std::sort(paths.begin(), paths.end());  // (VersionEncoder takes files in path order)
  paths.erase(std::unique(paths.begin(), paths.end()), paths.end());
  struct Item {
    std::string path;
    std::shared_ptr<DraftFile> f;
    uint64_t generation = 0;
    std::vector<uint8_t> bytes;
    std::string staging;
    std::array<uint64_t, 4> tally{};
    bool current = false;
  };
  std::vector<Item> items;
  {
    MutexLock lock(mu);
    for (std::string& path : paths) {
      auto it = d->files.find(path);
      if (it == d->files.end()) continue;
      std::shared_ptr<DraftFile> f = it->second;
      MutexLock flock(f->mu);
      if (f->Encoded(path) || f->encoding || f->writers > 0 || !f->write_error.empty() || !Small(*f)) continue;
      f->encoding = true;
      const uint64_t generation = f->generation;
      items.push_back(Item{std::move(path), f, generation, {}, {}, {}, false});
    }
  }
  if (items.empty()) return Status::Ok();
  // Whatever happens, the files are not being encoded any more when this returns.
  struct Done {
    State& s;
    std::vector<Item>& items;
    ~Done() {
      {
        MutexLock lock(s.mu);
        for (Item& i : items) {
          MutexLock flock(i.f->mu);
          i.f->encoding = false;
        }
      }
      s.encoded_cv.NotifyAll();
    }
  } done{*this, items};
  Status st = [&]() -> Status {
    MutexLock serial(encode_mu);
    const auto start = std::chrono::steady_clock::now();
    WFS_TRY(EnsureLease(*d));
    // Each file's bytes, read under its lock (small: no map, nothing to guard against a
    // truncation from outside); a change since makes the file stale (its generation).
    uint64_t total = 0;
    for (Item& i : items) {
      MutexLock flock(i.f->mu);
      if (i.f->generation != i.generation) continue;
      WFS_TRY(i.f->EnsureFd());
      Status read = ReadSmallStaged(*d, i.path, *i.f, &i.bytes);
      i.f->CloseIdleFd();
      WFS_TRY(read);
      i.staging = i.f->staging;
      i.current = true;
      total += i.bytes.size();
    }
    // The staging files are on disk before the journal says they are encoded (their bytes are
    // the file's from then on): an fdatasync each for a few, one sync of the file system for
    // many (a disk flush each would cost more). Not syncfs for a few: it waits for every dirty
    // page of the file system, such as the shards a cp is writing into the draft meanwhile
    // (1.2 s for a config.json saved beside a 2 GB checkpoint).
    if (items.size() <= kSmallBatchSyncEach) {
      for (Item& i : items) {
        if (!i.current) continue;
        MutexLock flock(i.f->mu);
        if (i.f->generation != i.generation) continue;  // changed: encoded on its next close
        WFS_TRY(i.f->EnsureFd());
        Status synced = DataSync(i.f->fd, i.f->staging);
        i.f->CloseIdleFd();
        WFS_TRY(synced);
      }
    } else {
      WFS_TRY(SyncFileSystemOf(d->dir));
    }
    VersionEncoder encoder(*bucket, cache, pool, VersionRef{d->model, d->version}, d->parent_manifest,
                           options.push, total);
    size_t added = 0;
    for (Item& i : items) {
      if (!i.current) continue;
      const std::array<uint64_t, 4> before = encoder.Tally();
      WFS_TRY(encoder.AddFile(i.path, i.bytes, i.staging));
      const std::array<uint64_t, 4> after = encoder.Tally();
      for (size_t k = 0; k < 4; ++k) i.tally[k] = after[k] - before[k];
      i.bytes = {};
      added++;
    }
    if (added == 0) return Status::Ok();
    PushResult result;
    Expected<Manifest> encoded = encoder.Finish(&result);
    if (!encoded.ok()) return encoded.status();
    const std::string part_name = "s" + std::to_string(items.front().f->id) + "-" + std::to_string(NowNs());
    const std::vector<uint8_t> bytes = SerializeManifest(*encoded);
    WFS_TRY(WriteAtomically(d->PartPath(part_name),
                            std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())));
    std::vector<std::string> drop;  // parts replaced, used by no file any more
    size_t current = 0;
    {
      MutexLock lock(mu);
      for (Item& i : items) {
        if (!i.current) continue;
        auto it = d->files.find(i.path);
        if (it == d->files.end() || it->second != i.f) continue;
        MutexLock flock(i.f->mu);
        if (i.f->generation != i.generation) continue;  // changed: encoded on its next close
        if (d->ReleasePart(i.f->encoded)) drop.push_back(i.f->encoded);
        i.f->encoded = part_name;
        d->RetainPart(part_name);
        i.f->encoded_path = i.path;
        i.f->encoded_generation = i.generation;
        i.f->tally = i.tally;
        d->Changed(i.path);
        current++;
      }
    }
    if (current == 0) drop.push_back(part_name);
    for (const std::string& part : drop) ::unlink(d->PartPath(part).c_str());
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    spdlog::info("draft {}: encoded {} small files together ({} bytes -> {} stored in {} packs) in {:.2f} s",
                 d->name(), current, total, encoded->stats.stored_bytes, result.packs, secs);
    files_encoded += current;
    bytes_encoded += total;
    bytes_stored += encoded->stats.stored_bytes;
    return current ? SaveJournal(*d) : Status::Ok();
  }();
  if (!st.ok()) {
    MutexLock lock(mu);
    d->encode_error = st.ToString();
  }
  return st;
}

Status Drafts::State::EncodeNow(const std::shared_ptr<Draft>& d, const std::shared_ptr<DraftFile>& f,
                                 const std::string& path, uint64_t generation) {
  MutexLock serial(encode_mu);
  const auto start = std::chrono::steady_clock::now();
  WFS_TRY(Fill(*d, *f));
  WFS_TRY(EnsureLease(*d));
  // The staging file is opened under the file's lock and counted in `readers` until
  // it is closed: while it is, the file never shrinks in place (ResizeLocked moves it instead),
  // so the encoder reads the bytes of one file to their end. Writes may still change it: the
  // result is then stale (generation) and thrown away.
  std::string staging;
  uint64_t id;
  std::optional<FileBytes> source;
  {
    MutexLock lock(f->mu);
    if (f->generation != generation) return Status::Ok();  // changed: encoded on its next close
    staging = f->staging;
    id = f->id;
    Expected<FileBytes> opened =
        FileBytes::Open(staging, f->streamed.dropped() ? FileBytes::Access::kDirect : FileBytes::Access::kCached);
    if (!opened.ok()) return opened.status();
    if (opened->size() != f->size) {
      // Truncated or extended by something other than the mount (the mount keeps the two
      // equal): what it holds is not what the draft shows, and is never published.
      return Status::IOError("staging file " + staging + " of " + d->name() + "/" + path + " holds " +
                             std::to_string(opened->size()) + " bytes where the draft's file has " +
                             std::to_string(f->size) +
                             ": it was changed outside the mount; write the file again (or remove it from the draft)");
    }
    source = std::move(opened).value();
    f->readers++;
  }
  // The staging file is on disk before the journal says the file is encoded (its bytes are the
  // draft file's from then on): its writeback starts now and runs while it is encoded; the
  // fdatasync after the encode waits for what is left. (An fdatasync before the encode made the
  // encoder wait for the disk: 0.5-1 s per 500 MB shard of a checkpoint saved by cp.)
  StartWriteback(source->descriptor());
  struct Close {
    DraftFile& f;
    std::optional<FileBytes>& source;
    ~Close() {
      source.reset();
      MutexLock lock(f.mu);
      f.readers--;
    }
  };
  // Whether the bytes the encoder saw are not the file's any more (a write since).
  auto stale = [&] {
    MutexLock lock(f->mu);
    return f->generation != generation;
  };
  Expected<Manifest> encoded = Status::IOError("not encoded");
  PushResult result;
  const uint64_t size = source->size();
  bool shrank = false;
  double sync_secs = 0;  // waiting for the staging file's last writes to reach the disk
  {
    Close close{*f, source};
    VersionEncoder encoder(*bucket, cache, pool, VersionRef{d->model, d->version}, d->parent_manifest,
                           options.push, size);
    Status added = encoder.AddFile(path, *source, staging);
    encoded = added.ok() ? encoder.Finish(&result) : Expected<Manifest>(added);
    shrank = !added.ok() && source->Shrank();
    if (encoded.ok()) {
      const auto sync_start = std::chrono::steady_clock::now();
      if (Status synced = DataSync(source->descriptor(), staging); !synced.ok()) encoded = synced;
      sync_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
    }
  }
  if (stale()) return Status::Ok();  // encoded again on its next close
  if (shrank) {
    return Status::IOError("staging file " + staging + " of " + d->name() + "/" + path +
                           " shrank while it was encoded, not through the mount; write the file again");
  }
  if (!encoded.ok()) return encoded.status();
  Manifest part = std::move(encoded).value();
  const std::string part_name = std::to_string(id) + "-" + std::to_string(NowNs());
  const std::vector<uint8_t> bytes = SerializeManifest(part);
  WFS_TRY(WriteAtomically(d->PartPath(part_name),
                          std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size())));
  bool current = false;
  std::string old_part;  // replaced, and used by no other file: deleted
  {
    MutexLock lock(mu);
    auto it = d->files.find(path);
    if (it != d->files.end() && it->second == f) {
      MutexLock flock(f->mu);
      if (f->generation == generation) {
        if (d->ReleasePart(f->encoded)) old_part = f->encoded;
        f->tally = {result.tensor_elements, result.tensor_changed, result.other_elements, result.other_changed};
        f->encoded = part_name;
        d->RetainPart(part_name);
        f->encoded_path = path;
        f->encoded_generation = generation;
        d->Changed(path);
        current = true;
      }
    }
  }
  if (!current) {
    ::unlink(d->PartPath(part_name).c_str());
    return Status::Ok();
  }
  if (!old_part.empty()) ::unlink(d->PartPath(old_part).c_str());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("draft {}: encoded {} ({} bytes -> {} stored, {} full / {} delta / {} same chunks) in {:.2f} s "
               "({:.2f} s of it waiting for the staging file to reach the disk)",
               d->name(), path, size, part.stats.stored_bytes, result.full_chunks,
               result.delta_chunks, result.same_chunks, secs, sync_secs);
  files_encoded++;
  bytes_encoded += size;
  bytes_stored += part.stats.stored_bytes;
  return SaveJournal(*d);
}

}  // namespace weightfs
