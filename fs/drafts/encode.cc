// The background encoder: a file closed by its last writer is encoded against the parent's
// file of the same path (VersionEncoder) and its packs uploaded, one file at a time.
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "engine/lease.h"
#include "engine/mapped_file.h"
#include "fs/drafts/posix_io.h"
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
// the same file in progress. Busy (InvalidArgument) while the file is open for writing.
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
        return Status::InvalidArgument(d->name() + "/" + path + " is still open for writing");
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
  for (;;) {
    std::pair<std::string, std::string> job;
    {
      MutexLock lock(queue_mu);
      queue_cv.Wait(queue_mu, [&]() WFS_REQUIRES(queue_mu) { return stopping || !queue.empty(); });
      if (stopping) return;
      job = std::move(queue.front());
      queue.pop_front();
    }
    try {  // an exception (an allocation failing) fails this job, not the daemon
    std::shared_ptr<Draft> d;
    {
      MutexLock lock(mu);
      d = DraftLocked(job.first);
    }
    if (!d) continue;
    if (job.second.empty()) {
      Status s = CommitDraft(d, d->commit_as);
      if (!s.ok()) {
        spdlog::error("resuming the commit of draft {}: {}", job.first, s.ToString());
        MutexLock lock(mu);
        d->error = s.ToString();
      }
      continue;
    }
    Status s = EnsureEncoded(d, job.second);
    if (!s.ok() && s.kind() != ErrorKind::kInvalidArgument) {
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
    } catch (...) {
      const Status st = StatusOfCurrentException(job.second.empty() ? "committing" : "encoding");
      spdlog::error("draft {} {}: {}: {} (the data stays staged; commit retries)", job.first, job.second,
                    ErrorKindName(st.kind()), st.message());
    }
  }
}

Status Drafts::State::EncodeNow(const std::shared_ptr<Draft>& d, const std::shared_ptr<DraftFile>& f,
                                 const std::string& path, uint64_t generation) {
  MutexLock serial(encode_mu);
  const auto start = std::chrono::steady_clock::now();
  WFS_TRY(Fill(*d, *f));
  {
    MutexLock lock(mu);
    if (!d->lease) {
      lock.Unlock();
      Expected<std::unique_ptr<Lease>> lease = Lease::Acquire(&bucket->store(), d->name() + " (draft)");
      if (!lease.ok()) return lease.status().WithContext("taking a lease for the draft's packs");
      lock.Lock();
      if (!d->lease) d->lease = std::move(lease).value();
    }
  }
  // The staging file is mapped under the file's lock and counted in `mapped` until the map
  // goes: while it is, the file never shrinks in place (ResizeLocked moves it instead), so
  // the encoder cannot fault on pages cut off under it. Writes may still change it: the
  // result is then stale (generation) and thrown away.
  std::string staging;
  uint64_t id;
  MappedFile mapped;
  {
    MutexLock lock(f->mu);
    if (f->generation != generation) return Status::Ok();  // changed: encoded on its next close
    WFS_TRY(DataSync(f->fd, f->staging));
    staging = f->staging;
    id = f->id;
    Expected<MappedFile> m = MappedFile::Open(staging);
    if (!m.ok()) return m.status();
    if (m->size() != f->size) {
      // Truncated or extended by something other than the mount (the mount keeps the two
      // equal): what it holds is not what the draft shows, and is never published.
      return Status::IOError("staging file " + staging + " of " + d->name() + "/" + path + " holds " +
                             std::to_string(m->size()) + " bytes where the draft's file has " + std::to_string(f->size) +
                             ": it was changed outside the mount; write the file again (or remove it from the draft)");
    }
    mapped = std::move(m).value();
    f->mapped++;
  }
  struct Unmap {
    DraftFile& f;
    MappedFile& mapped;
    ~Unmap() {
      mapped = MappedFile();
      MutexLock lock(f.mu);
      f.mapped--;
    }
  };
  // Whether the bytes the encoder saw are not the file's any more (a write since, or a
  // truncation from outside weightfs that the map's guard caught).
  auto stale = [&] {
    MutexLock lock(f->mu);
    return f->generation != generation;
  };
  Expected<Manifest> encoded = Status::IOError("not encoded");
  PushResult result;
  const uint64_t size = mapped.size();
  bool faulted = false;
  {
    Unmap unmap{*f, mapped};
    VersionEncoder encoder(*bucket, cache, pool, VersionRef{d->model, d->version}, d->parent_manifest,
                           options.push, size);
    Status added = encoder.AddFile(path, mapped.bytes(), staging);
    encoded = added.ok() ? encoder.Finish(&result) : Expected<Manifest>(added);
    faulted = mapped.faulted();
  }
  if (stale()) return Status::Ok();  // encoded again on its next close
  if (faulted) {
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
  std::string old_part;
  {
    MutexLock lock(mu);
    auto it = d->files.find(path);
    if (it != d->files.end() && it->second == f) {
      MutexLock flock(f->mu);
      if (f->generation == generation) {
        old_part = f->encoded;
        f->tally = {result.tensor_elements, result.tensor_changed, result.other_elements, result.other_changed};
        f->encoded = part_name;
        f->encoded_path = path;
        f->encoded_generation = generation;
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
  spdlog::info("draft {}: encoded {} ({} bytes -> {} stored, {} full / {} delta / {} same chunks) in {:.2f} s",
               d->name(), path, size, part.stats.stored_bytes, result.full_chunks,
               result.delta_chunks, result.same_chunks, secs);
  return SaveJournal(*d);
}

}  // namespace weightfs
