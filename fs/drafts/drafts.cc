// Drafts: the lifecycle (load the drafts an earlier mount left, stop the encoder) and the
// status JSON of `weightfs status`.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

Drafts::Drafts(Bucket* bucket, ChunkCache* cache, Materializer* materializer, ChunkReader* reader,
               DraftsOptions options)
    : state_(std::make_unique<State>(bucket, cache, materializer, reader, std::move(options))) {}

Drafts::~Drafts() {
  {
    MutexLock lock(state_->queue_mu);
    state_->stopping = true;
  }
  state_->queue_cv.NotifyAll();
  if (state_->worker.joinable()) state_->worker.join();
  if (state_->lock_fd >= 0) ::close(state_->lock_fd);
}

bool Drafts::enabled() const { return state_->loaded && state_->disabled_reason.empty(); }

Status Drafts::Load() {
  State& s = *state_;
  std::error_code ec;
  std::filesystem::create_directories(s.options.state_dir, ec);
  if (ec) {
    s.disabled_reason = "cannot create " + s.options.state_dir + ": " + ec.message();
    return Status::IOError(s.disabled_reason);
  }
  const std::string lock_path = s.options.state_dir + "/lock";
  s.lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (s.lock_fd < 0 || ::flock(s.lock_fd, LOCK_EX | LOCK_NB) != 0) {
    s.disabled_reason = "another mount of this bucket with the same cache directory owns its drafts (" +
                        s.options.state_dir + "); mount with another --cache-dir to write here";
    s.loaded = true;
    return Status::Conflict(s.disabled_reason);
  }
  s.worker = std::thread([&s] { s.WorkerMain(); });
  Status first;
  for (const auto& entry : std::filesystem::directory_iterator(s.options.state_dir, ec)) {
    if (!entry.is_directory()) continue;
    const std::string dir = entry.path().string();
    if (::access((dir + "/journal.json").c_str(), F_OK) != 0) continue;  // a draft whose creation did not finish
    Status st;
    try {
      uint64_t seq = 0;
      Expected<nlohmann::json> j = State::ReplayJournal(dir, &seq);
      st = j.ok() ? s.LoadDraft(dir, *j, seq) : j.status();
    } catch (const std::exception& e) {
      st = Status::Corruption(std::string("bad journal: ") + e.what());
    }
    if (!st.ok()) {
      spdlog::error("draft in {} not loaded (kept on disk; the next mount tries again): {}", dir, st.ToString());
      if (first.ok()) first = st;
    }
  }
  s.loaded = true;
  return first;
}

size_t Drafts::queued_encodes() {
  MutexLock qlock(state_->queue_mu);
  return state_->queue.size();
}

Drafts::Metrics Drafts::metrics() {
  State& s = *state_;
  Metrics m;
  m.files_encoded = s.files_encoded.load();
  m.bytes_encoded = s.bytes_encoded.load();
  m.bytes_stored = s.bytes_stored.load();
  m.versions_published = s.versions_published.load();
  m.commit_failures = s.commit_failures.load();
  m.queued_encodes = queued_encodes();
  MutexLock lock(s.mu);
  for (auto& [name, d] : s.drafts) {
    m.open_drafts++;
    for (auto& [p, f] : d->files) {
      MutexLock flock(f->mu);
      if (f->id == 0 || f->Encoded(p)) continue;
      m.pending_files++;
      m.bytes_to_go += f->size;
    }
  }
  return m;
}

std::string Drafts::StatusJson() {
  State& s = *state_;
  nlohmann::json j;
  j["enabled"] = enabled();
  if (!s.disabled_reason.empty()) j["disabled_reason"] = s.disabled_reason;
  j["drafts"] = nlohmann::json::array();
  MutexLock lock(s.mu);
  for (auto& [name, d] : s.drafts) {
    nlohmann::json dj;
    dj["name"] = name;
    dj["parent"] = d->parent ? nlohmann::json(*d->parent) : nlohmann::json(nullptr);
    uint64_t staged = 0, encoded = 0, bytes_to_go = 0, staged_bytes = 0, writers = 0, encoding = 0;
    for (auto& [p, f] : d->files) {
      MutexLock flock(f->mu);
      if (f->id == 0) continue;
      staged++;
      encoding += f->readers > 0;
      staged_bytes += f->size;
      writers += static_cast<uint64_t>(f->writers);
      if (f->Encoded(p)) {
        encoded++;
      } else {
        bytes_to_go += f->size;
      }
    }
    dj["files"] = d->files.size();
    dj["unchanged"] = d->Unchanged();
    dj["staged_files"] = staged;
    dj["staged_bytes"] = staged_bytes;
    dj["encoded_files"] = encoded;
    dj["pending_files"] = staged - encoded;
    dj["bytes_to_go"] = bytes_to_go;
    dj["open_for_writing"] = writers;
    dj["encoding_now"] = encoding;  // files whose encode is reading them right now
    dj["state"] = d->committing ? "committing" : d->commit_requested ? "commit requested" : "draft";
    if (d->parts > 0) {
      dj["parts"] = d->parts;
      dj["part_id"] = d->part_id;
      dj["parts_in"] = d->parts_in;
      dj["part_state"] = d->part_state;
    }
    std::string error = !d->error.empty() ? d->error : d->encode_error;
    for (auto& [p, f] : d->files) {
      MutexLock flock(f->mu);
      if (!f->write_error.empty() && error.empty()) error = "a write to " + p + " failed: " + f->write_error;
    }
    dj["error"] = error;
    j["drafts"].push_back(std::move(dj));
  }
  {
    MutexLock qlock(s.queue_mu);
    j["queued_encodes"] = s.queue.size();
  }
  if (s.cache) j["cache"] = {{"size_bytes", s.cache->size_bytes()}, {"max_bytes", s.cache->max_bytes()}};
  j["state_dir"] = s.options.state_dir;
  return j.dump();
}

}  // namespace weightfs
