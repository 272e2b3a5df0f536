// A save encoded while it is written: `cp model.safetensors draft/`, or torch/safetensors
// saving into the draft, writes the file front to back, and the encoder follows the writes
// chunk by chunk instead of starting once the file is closed.
//
// Why: a checkpoint's save through a draft was `cp` (1-2 s for 2 GB) and then the encode of
// the files in turn, the last one starting when `cp` ended; and by then the staging file's
// bytes had left the page cache (StreamedWrites, hub/store/direct_file.h) and were read back
// from the disk. Following the writer, the encoder reads each window while it is still cached,
// the writer drops it after, and the encode of the last file ends shortly after its last write.
//
// How it stays correct: the encode is only a guess until the writer closes the file. It is
// kept only if every change of the file since it was opened empty was a write in order
// (DraftFile::StreamIntact), the file closed at the size its safetensors header declared, and
// no write failed; the SHA-256 and chunk hashes are of the bytes read, which were final when
// read (a write before the stream's end is not in order). Otherwise it is dropped and the
// file's close queues its encode as before. The writer never waits on the encoder more than a
// second in all (Drafts::Write), and the encoder waits for a writer at most kStalledWriter.
#include <chrono>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/safetensors.h"
#include "hub/engine/file_bytes.h"
#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {
namespace {

// A writer that writes nothing for this long is not followed any further (its close encodes it).
constexpr auto kStalledWriter = std::chrono::seconds(30);
// After its last byte, how long the encoder waits for the writer's close.
constexpr auto kCloseWait = std::chrono::seconds(5);

// The staging file as the encoder reads it while it is written (FileBytes::Growth).
class StreamGrowth final : public FileBytes::Growth {
 public:
  StreamGrowth(DraftFile& f, std::string staging, std::function<bool()> stopping)
      : f_(f), staging_(std::move(staging)), stopping_(std::move(stopping)) {}

  Status Await(uint64_t offset, uint64_t end, bool* direct) override {
    MutexLock lock(f_.mu);
    in_flight_.insert(offset);
    auto progress = std::chrono::steady_clock::now();
    uint64_t seen = f_.stream_end;
    for (;;) {
      Status why;
      if (f_.staging != staging_ || !f_.StreamIntact()) {
        why = Status::Busy("changed other than by writes in order");
      } else if (f_.stream_end >= end) {
        *direct = offset < f_.streamed.dropped_to();  // (its first windows went before the encoder came)
        return Status::Ok();
      } else if (f_.writers == 0) {
        why = Status::Busy("closed at " + std::to_string(f_.size) + " bytes, short of its header's size");
      } else if (f_.stream_end != seen) {
        seen = f_.stream_end;
        progress = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - progress > kStalledWriter) {
        why = Status::Busy("its writer stalled");
      }
      if (!why.ok()) {
        in_flight_.erase(in_flight_.find(offset));
        return why;
      }
      f_.stream_cv.WaitUntil(f_.mu, std::chrono::steady_clock::now() + std::chrono::milliseconds(100),
                             [&]() WFS_REQUIRES(f_.mu) {
                               return f_.stream_end >= end || f_.writers == 0 || !f_.StreamIntact();
                             });
      lock.Unlock();
      const bool stop = stopping_();
      lock.Lock();
      if (stop) {
        in_flight_.erase(in_flight_.find(offset));
        return Status::Busy("the mount is stopping");
      }
    }
  }

  void Consumed(uint64_t offset, uint64_t end) override {
    MutexLock lock(f_.mu);
    in_flight_.erase(in_flight_.find(offset));
    read_end_ = std::max(read_end_, end);
    f_.stream_read = in_flight_.empty() ? read_end_ : *in_flight_.begin();
    f_.stream_cv.NotifyAll();  // (a writer waiting for the encoder to move on)
  }

 private:
  DraftFile& f_;
  const std::string staging_;
  const std::function<bool()> stopping_;
  std::multiset<uint64_t> in_flight_;  // offsets being read (guarded by f_.mu)
  uint64_t read_end_ = 0;
};

// The size a safetensors file will have, from its header (`prefix`: its first 8 + N bytes):
// nullopt when the header does not say (not JSON, no tensors...: the close-time encode reports it).
std::optional<uint64_t> DeclaredSize(std::span<const uint8_t> prefix) {
  const nlohmann::json j = nlohmann::json::parse(prefix.begin() + 8, prefix.end(), nullptr, false);
  if (!j.is_object()) return std::nullopt;
  uint64_t end = 0;
  for (const auto& [name, t] : j.items()) {
    if (name == "__metadata__") continue;
    if (!t.is_object() || !t.contains("data_offsets") || !t["data_offsets"].is_array() ||
        t["data_offsets"].size() != 2 || !t["data_offsets"][1].is_number_unsigned()) {
      return std::nullopt;
    }
    end = std::max(end, t["data_offsets"][1].get<uint64_t>());
  }
  return prefix.size() + end;
}

}  // namespace

void Drafts::State::EncodeStream(const std::shared_ptr<Draft>& d, const std::string& path) {
  MutexLock serial(encode_mu);
  const auto start = std::chrono::steady_clock::now();
  std::shared_ptr<DraftFile> f;
  std::string staging;
  {
    MutexLock lock(mu);
    auto it = d->files.find(path);
    if (it == d->files.end()) return;
    f = it->second;
    MutexLock flock(f->mu);
    // Still the save it was queued for: one writer, every change a write in order.
    if (f->encoding || f->writers != 1 || f->direct_writers != 1 || f->backed || f->id == 0 || !f->StreamIntact() ||
        !f->write_error.empty()) {
      return;
    }
    f->encoding = true;
    f->streaming = true;
    f->stream_read = 0;
    f->readers++;
    staging = f->staging;
  }
  files_following++;
  struct Done {
    State& s;
    DraftFile& f;
    ~Done() {
      {
        MutexLock lock(s.mu);
        MutexLock flock(f.mu);
        f.encoding = false;
        f.streaming = false;
        f.readers--;
      }
      s.files_following--;
      f.stream_cv.NotifyAll();
      s.encoded_cv.NotifyAll();
    }
  } done{*this, *f};
  auto skip = [&](const Status& why) {
    spdlog::debug("draft {}: {} is encoded at its close, not as it is written: {}", d->name(), path, why.ToString());
  };
  StreamGrowth growth(*f, staging, [this] {
    MutexLock lock(queue_mu);
    return stopping;
  });
  // The header first: the size the file will have, which the chunk plan needs.
  std::vector<uint8_t> prefix(8);
  uint64_t size = 0;
  {
    Expected<FileBytes> head = FileBytes::OpenGrowing(staging, UINT64_MAX, &growth);
    if (!head.ok()) return skip(head.status());
    if (Status st = head->Read(0, prefix); !st.ok()) return skip(st);
    Expected<uint64_t> prefix_size = SafetensorsPrefixLength(prefix);
    if (!prefix_size.ok()) return skip(prefix_size.status());
    prefix.resize(*prefix_size);
    if (Status st = head->Read(8, std::span<uint8_t>(prefix).subspan(8)); !st.ok()) return skip(st);
    const std::optional<uint64_t> declared = DeclaredSize(prefix);
    if (!declared) return skip(Status::InvalidArgument("its header declares no size"));
    size = *declared;
  }
  if (size <= options.push.chunk_bytes) return skip(Status::InvalidArgument("one chunk: encoded with other small files"));
  if (Status st = EnsureLease(*d); !st.ok()) return skip(st);
  Expected<FileBytes> source = FileBytes::OpenGrowing(staging, size, &growth);
  if (!source.ok()) return skip(source.status());
  PushResult result;
  VersionEncoder encoder(*bucket, cache, pool, VersionRef{d->model, d->version}, d->parent_manifest, options.push,
                         size);
  Status added = encoder.AddFile(path, *source, staging);
  if (!added.ok()) return skip(added);
  Expected<Manifest> encoded = encoder.Finish(&result);
  if (!encoded.ok()) return skip(encoded.status());
  // Kept only once the writer closed the file as the stream it began.
  uint64_t generation;
  {
    MutexLock flock(f->mu);
    f->stream_cv.WaitUntil(f->mu, std::chrono::steady_clock::now() + kCloseWait,
                           [&]() WFS_REQUIRES(f->mu) { return f->writers == 0 || !f->StreamIntact(); });
    if (f->writers != 0) return skip(Status::Busy("not closed within 5 s of its last byte"));
    if (!f->StreamIntact() || f->staging != staging) return skip(Status::Busy("changed other than by writes in order"));
    if (f->size != size || f->stream_end != size) {
      return skip(Status::Busy("closed at " + std::to_string(f->size) + " bytes; its header declares " +
                               std::to_string(size)));
    }
    if (!f->write_error.empty()) return skip(Status::IOError("a write failed"));
    generation = f->generation;
  }
  // The staging file on disk before the journal says the file is encoded (as EncodeNow).
  const auto sync_start = std::chrono::steady_clock::now();
  if (Status synced = DataSync(source->descriptor(), staging); !synced.ok()) return skip(synced);
  const double sync_secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
  if (Status st = RecordEncoded(d, f, path, generation, std::move(encoded).value(), result, size, start, sync_secs,
                                " as it was written");
      !st.ok()) {
    skip(st);
  }
}

}  // namespace weightfs
