// Publishing a draft (commit: every file encoded, the packs checked, the manifest written
// create-if-absent) and removing one (rmdir of an empty draft, discard).
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "hub/engine/staged_version.h"
#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

namespace {
// The bytes a file of an encoded part stored itself (its fresh payloads; an inherited chunk
// stores nothing), as the part's stats counted them when it held the file alone.
uint64_t StoredBytes(const ManifestFile& f) {
  uint64_t n = 0;
  for (const ManifestChunk& c : f.chunks) {
    if (c.origin == 0 && !c.is_external()) n += c.ref.length;
  }
  return n;
}
}  // namespace

// Tensor elements and other bytes of an unchanged file, as push counts them: a safetensors
// file's header chunk is parsed for its tensors (it is small and usually cached).
Expected<std::pair<uint64_t, uint64_t>> Drafts::State::ElementsOf(const Manifest& pm, const ManifestFile& pf) {
  return ElementsOfFile(*materializer, pm, pf);
}

// Whether the published manifest of m's name has exactly m's parent and files (the same
// recipes): then it is this draft's own, published by a commit that was cut short.
bool Drafts::State::IsOurs(const Manifest& m) {
  Expected<std::shared_ptr<const Manifest>> there = bucket->ReadFullManifest(m.model, m.version);
  if (!there.ok() || (*there)->parent != m.parent || (*there)->files.size() != m.files.size()) return false;
  for (size_t i = 0; i < m.files.size(); ++i) {
    const ManifestFile& a = m.files[i];
    const ManifestFile& b = (*there)->files[i];
    if (a.path != b.path || a.size != b.size || a.sha256 != b.sha256 || a.chunks.size() != b.chunks.size()) return false;
    // The same bytes chunk by chunk, wherever their payloads are: a commit run again may have
    // packed its payloads otherwise, and publishing may have taken inherited rows from a head
    // gc rewrote meanwhile (Bucket::PublishManifest).
    for (size_t c = 0; c < a.chunks.size(); ++c) {
      if (a.chunks[c].hash != b.chunks[c].hash || a.chunks[c].length != b.chunks[c].length) return false;
    }
  }
  return true;
}

Status Drafts::State::BeginCommit(const std::shared_ptr<Draft>& d, const std::string& as_in, bool part,
                                  bool wait_for_resumed, std::vector<std::string>* paths) {
  MutexLock lock(mu);
  // A part's commit resumed in the background after a remount is short (it submits and does
  // not wait): a user's `commit --parts` that comes meanwhile waits for it.
  if (wait_for_resumed) {
    encoded_cv.WaitFor(mu, std::chrono::minutes(10), [&]() WFS_REQUIRES(mu) { return !d->committing; });
    // That commit may have found the version published (the other parts came in): done.
    if (DraftLocked(d->name()) != d) {
      return published_names.count(d->name()) ? Status::Stale(d->name() + " is published")
                                              : Status::NotFound("the draft " + d->name() + " is gone");
    }
  }
  if (d->committing) return Status::Busy("draft " + d->name() + " is being committed already");
  // The kernel sends RELEASE after close() has returned: a commit that follows a close at
  // once may still see the writer. Give those a moment.
  auto writing = [&] {
    for (auto& [path, f] : d->files) {
      MutexLock flock(f->mu);
      if (f->writers > 0) return true;
    }
    return false;
  };
  encoded_cv.WaitFor(mu, std::chrono::seconds(2), [&]() WFS_REQUIRES(mu) { return !writing(); });
  for (auto& [path, f] : d->files) {
    MutexLock flock(f->mu);
    if (f->writers > 0) {
      return Status::Busy(d->name() + "/" + path + " is still open for writing; close it, then commit");
    }
    if (!f->write_error.empty()) {
      return Status::InvalidArgument("a write to " + d->name() + "/" + path + " failed (" + f->write_error +
                                     "); write the file again or remove it, then commit");
    }
    if (f->id != 0 || f->parent_path != path) paths->push_back(path);
  }
  if (d->files.empty() && !part) return Status::InvalidArgument("draft " + d->name() + " has no files");
  d->committing = true;
  d->commit_requested = true;
  d->commit_as = as_in;
  return Status::Ok();
}

Expected<std::map<std::string, Drafts::State::EncodedFile>> Drafts::State::EncodedFiles(
    const std::shared_ptr<Draft>& d, const std::vector<std::string>& paths) {
  // A renamed inherited file is materialized under its new path (its recipes name the old one).
  for (const std::string& path : paths) {
    MutexLock lock(mu);
    auto it = d->files.find(path);
    if (it == d->files.end()) continue;
    std::shared_ptr<DraftFile> f = it->second;
    MutexLock flock(f->mu);
    if (f->id == 0) {
      WFS_TRY(StageLocked(*d, *f, /*backed=*/true).WithContext("staging " + path));
      f->generation++;
      d->Changed(path);
    }
  }
  for (int attempt = 0;; ++attempt) {
    WFS_TRY(EnsureAllEncoded(d, paths));
    std::map<std::string, EncodedFile> files;
    std::vector<std::pair<std::string, std::string>> part_files;  // path, part
    {
      MutexLock lock(mu);
      for (auto& [path, f] : d->files) {
        MutexLock flock(f->mu);
        if (f->id == 0) continue;
        if (!f->Encoded(path)) return Status::Busy(d->name() + "/" + path + " changed during the commit; commit again");
        part_files.emplace_back(path, f->encoded);
      }
    }
    // Each part file read once (small files share one).
    std::map<std::string, std::shared_ptr<const Manifest>> parts;
    for (auto& [path, part] : part_files) {
      std::shared_ptr<const Manifest>& pm = parts[part];
      if (!pm) {
        Expected<std::string> text = ReadWholeFile(d->PartPath(part));
        if (!text.ok()) return text.status();
        Expected<Manifest> parsed = ParseManifest(std::span<const uint8_t>(
            reinterpret_cast<const uint8_t*>(text->data()), text->size()));
        if (!parsed.ok()) return parsed.status().WithContext("the encoded part of " + path);
        pm = std::make_shared<const Manifest>(std::move(parsed).value());
      }
      // Encoded under this path (Encoded checked encoded_path): the part's file of that name.
      const ManifestFile* mf = pm->FindFile(path);
      if (!mf) return Status::Corruption("the encoded part " + part + " of " + d->name() + " has no " + path);
      files.emplace(path, EncodedFile{pm, mf});
    }
    // A draft left alone longer than its lease may have lost its packs to gc: each pack its
    // files wrote is checked once.
    std::map<Hash128, std::vector<std::string>> packs;  // pack -> files with payloads in it
    for (auto& [path, ef] : files) {
      std::set<uint32_t> own;
      for (const ManifestChunk& c : ef.file->chunks) {
        if (c.origin == 0 && !c.is_external()) own.insert(c.ref.pack);
      }
      for (uint32_t p : own) packs[ef.part->packs[p]].push_back(path);
    }
    std::set<std::string> lost;
    for (auto& [pack, users] : packs) {
      Expected<bool> there = bucket->HasPack(pack);
      if (!there.ok()) return there.status().WithContext("checking the draft's packs");
      if (!*there) lost.insert(users.begin(), users.end());
    }
    if (lost.empty()) return files;
    if (attempt > 0) return Status::IOError("packs of " + *lost.begin() + " vanished from the bucket twice");
    std::vector<std::string> drop;  // part files no file uses any more
    {
      MutexLock lock(mu);
      for (const std::string& path : lost) {
        spdlog::warn("draft {}: the packs of {} are gone from the bucket (gc?); encoding it again", d->name(), path);
        if (auto it = d->files.find(path); it != d->files.end()) {
          MutexLock flock(it->second->mu);
          if (d->ReleasePart(it->second->encoded)) drop.push_back(it->second->encoded);
          it->second->encoded.clear();
          d->Changed(path);
        }
      }
    }
    for (const std::string& part : drop) ::unlink(d->PartPath(part).c_str());
  }
}

void Drafts::State::FinishPublished(const std::shared_ptr<Draft>& d, std::shared_ptr<const Manifest> published) {
  versions_published++;
  // The mount shows the version before the draft that held its name goes (null: not read back).
  if (options.on_published && published) options.on_published(std::move(published));
  // Published: the draft becomes history; its staging files stay as the cache's source for
  // the next draft of this model, until a newer one is published from here.
  std::vector<std::string> retire;
  {
    MutexLock lock(mu);
    drafts.erase(d->name());
    published_names.insert(d->name());
    auto& older = published_dirs[d->model];
    retire = std::move(older);
    older = {d->dir};
    d->error.clear();
    d->encode_error.clear();
  }
  if (options.on_gone) options.on_gone(d->model, d->version);
  (void)SaveJournal(*d, {.published = true});
  d->lease.reset();
  for (const std::string& dir : retire) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
}

namespace {
// Clears the draft's committing mark when a commit ends, however it ends.
struct CommitDone {
  Drafts::State* s;
  Draft* d;
  ~CommitDone() {
    MutexLock lock(s->mu);
    d->committing = false;
    s->encoded_cv.NotifyAll();
  }
};
}  // namespace

Status Drafts::State::CommitDraft(const std::shared_ptr<Draft>& d, const std::string& as_in) {
  if (d->parts > 0) {
    // A part resumed (a remount) or published at unmount: put it again, do not wait. One a
    // running `weightfs commit --parts` is submitting or waiting for is left to it.
    {
      MutexLock lock(mu);
      if (d->committing) {
        spdlog::info("draft {}: its part is being committed by a running `weightfs commit --parts`", d->name());
        return Status::Ok();
      }
    }
    PartCommit again;
    again.parts = d->parts;
    again.wait = false;
    again.resumed = true;
    return CommitPartOf(d, again);
  }
  const auto start = std::chrono::steady_clock::now();
  std::string as = as_in.empty() ? d->version : as_in;
  WFS_TRY(ValidateVersionName(as));
  if (as == "latest") return Status::InvalidArgument("'latest' is reserved for the newest version's link");
  std::vector<std::string> paths;
  WFS_TRY(BeginCommit(d, as_in, /*part=*/false, /*wait_for_resumed=*/false, &paths));
  CommitDone done{this, d.get()};
  WFS_TRY(SaveJournal(*d, {.sync = true}));
  WFS_ASSIGN_OR_RETURN(auto parts, EncodedFiles(d, paths));

  Manifest m;
  m.model = d->model;
  m.version = as;
  m.versions = {as};
  m.parent = d->parent;
  // Its files were encoded (and its inherited rows read) against the parent's head as this
  // mount had it, maybe before a gc rewrote it: checked, and rebound, when it is published.
  if (d->parent) m.inherited_from = Hash128{};
  m.chunk_bytes = options.push.chunk_bytes;
  std::array<uint64_t, 4> tally{};  // as DraftFile::tally, summed over the version
  std::vector<const ManifestFile*> inherited;
  // The rows of the files the version inherits (read from the parent's table first).
  {
    std::vector<std::shared_ptr<DraftFile>> unchanged;
    {
      MutexLock lock(mu);
      for (auto& [path, f] : d->files) {
        MutexLock flock(f->mu);
        if (f->id == 0) unchanged.push_back(f);
      }
    }
    for (const std::shared_ptr<DraftFile>& f : unchanged) WFS_TRY(EnsureRows(*d, *f));
  }
  {
    MutexLock lock(mu);
    const InheritedPlan plan = PlanInheritedLocked(*d);
    for (const auto& [path, index] : plan.dropped) {
      spdlog::info("{}: {} of {} is left out: {}, written into the draft, does not name it", d->name(), path,
                   d->parent.value_or("?"), index);
    }
    for (auto& [path, f] : d->files) {
      if (plan.dropped.count(path)) continue;
      MutexLock flock(f->mu);
      if (f->id == 0) {
        if (!f->rows) return Status::Busy(d->name() + "/" + path + " changed during the commit; commit again");
        AppendFileFrom(*d->parent_manifest, *f->rows, &m, /*src_is_dst=*/false);
        m.stats.logical_bytes += f->rows->size;
        inherited.push_back(f->rows);
        continue;
      }
      for (size_t i = 0; i < 4; ++i) tally[i] += f->tally[i];
      auto part = parts.find(path);
      if (part == parts.end()) {
        return Status::Busy(d->name() + "/" + path + " changed during the commit; commit again");
      }
      AppendFileFrom(*part->second.part, *part->second.file, &m, /*src_is_dst=*/true);
      m.stats.logical_bytes += part->second.file->size;
      m.stats.stored_bytes += StoredBytes(*part->second.file);
    }
  }
  // Inherited files count as unchanged, with the elements push would count for them.
  for (const ManifestFile* pf : inherited) {
    Expected<std::pair<uint64_t, uint64_t>> e = ElementsOf(*d->parent_manifest, *pf);
    if (!e.ok()) return e.status().WithContext("counting the elements of " + pf->path);
    tally[0] += e->first;
    tally[2] += e->second;
  }
  const bool tensors = tally[0] > 0;
  m.stats.elements = tensors ? tally[0] : tally[2];
  m.stats.changed_elements = tensors ? tally[1] : tally[3];
  m.chunk_bytes = parts.empty() ? (d->parent_manifest ? d->parent_manifest->chunk_bytes : m.chunk_bytes)
                                : parts.begin()->second.part->chunk_bytes;
  m.created = FormatUtc(NowMs());
  // Other nodes writing this version in parts: publishing it from here alone would publish one
  // node's view of it (its files beside the parent's old ones).
  if (Expected<bool> staged = StagedVersion::IsStaged(*bucket, d->model, as); !staged.ok()) {
    return staged.status().WithContext("checking for parts of " + d->model + "@" + as);
  } else if (*staged) {
    return Status::Conflict("version " + d->model + "@" + as + " is being written in parts by other nodes "
                            "(`weightfs status` lists them); nothing was published and the draft is kept: "
                            "commit it with `weightfs commit --parts N` as they do, or under another name with --as");
  }
  Status published = bucket->PublishManifest(m);
  if (published.kind() == ErrorKind::kConflict && IsOurs(m)) {
    spdlog::info("draft {}: {}@{} is already published with exactly its files (a commit interrupted "
                 "after publishing); finishing it", d->name(), d->model, as);
    published = Status::Ok();
  }
  if (published.kind() == ErrorKind::kConflict) {
    return Status::Conflict("version " + d->model + "@" + as + " already exists in " + bucket->Describe() +
                            " (another writer published it); the draft is kept: commit it under another "
                            "name with `weightfs commit --as NEWNAME` (if other nodes write this version with "
                            "you, every node commits it with `weightfs commit --parts N`)");
  }
  WFS_TRY(published);
  Expected<std::shared_ptr<const Manifest>> back = bucket->ReadManifest(d->model, as);
  if (!back.ok()) {
    // Published all the same: the commit succeeded (a retry would find it ours); the mount
    // shows the version once a listing or a lookup finds it.
    spdlog::warn("draft {}: published as {}@{}, but reading it back failed ({}); it shows up with the next listing",
                 d->name(), d->model, as, back.status().ToString());
  }
  FinishPublished(d, back.ok() ? *back : nullptr);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("published draft {} as {}@{} in {:.2f} s", d->name(), d->model, as, secs);
  return Status::Ok();
}

Status Drafts::State::CommitPartOf(const std::shared_ptr<Draft>& d, const PartCommit& part) {
  const auto start = std::chrono::steady_clock::now();
  const std::string name = d->name();
  if (part.parts < 1) return Status::InvalidArgument("--parts must be at least 1");
  if (!part.id.empty()) WFS_TRY(StagedVersion::ValidatePartId(part.id));
  {
    MutexLock lock(mu);
    if (d->parts > 0 && d->parts != part.parts) {
      return Status::InvalidArgument("the part of " + name + " was committed for " + std::to_string(d->parts) +
                                     " parts; give the same --parts (or discard the staged version)");
    }
    if (!d->part_id.empty() && !part.id.empty() && d->part_id != part.id) {
      return Status::InvalidArgument("the part of " + name + " is in the bucket as part " + d->part_id +
                                     "; commit it again with --part " + d->part_id + " (or without --part)");
    }
  }
  std::vector<std::string> paths;
  if (Status begun = BeginCommit(d, "", /*part=*/true, /*wait_for_resumed=*/!part.resumed, &paths); !begun.ok()) {
    return begun.kind() == ErrorKind::kStale ? Status::Ok() : begun;
  }
  CommitDone done{this, d.get()};
  {
    MutexLock lock(mu);
    d->parts = part.parts;
    if (d->part_id.empty()) {
      d->part_id = !part.id.empty() ? part.id
                                    : StagedVersion::SanitizePartId(HostName()) + "-" + HashChunk(std::span<const uint8_t>(
                                          reinterpret_cast<const uint8_t*>(d->dir.data()), d->dir.size()))
                                                                                          .ToHex()
                                                                                          .substr(0, 8);
    }
    d->part_state = "encoding";
  }
  // The part's id is in the journal before anything of it is in the bucket.
  WFS_TRY(SaveJournal(*d, {.sync = true}));
  StagedVersion staged(*bucket, d->model, d->version);
  staged.set_element_counter([this](const Manifest& pm, const ManifestFile& pf) { return ElementsOf(pm, pf); });
  // Refuse before encoding against the wrong parent (the first part fixed it).
  // Timeout (ETIMEDOUT, exit 124) means "waited out --timeout, the part is safe": a bucket
  // request that timed out before that is an I/O error.
  auto io = [](Status st) { return st.kind() == ErrorKind::kTimeout ? Status::IOError(st.message()) : st; };
  WFS_TRY(io(staged.Join(part.parts, d->parent)));
  Expected<std::map<std::string, EncodedFile>> encoded = EncodedFiles(d, paths);
  if (!encoded.ok()) return io(encoded.status());
  std::map<std::string, EncodedFile> files = std::move(encoded).value();

  PartRecord record;
  record.meta.parts = part.parts;
  record.meta.parent = d->parent;
  record.meta.host = HostName();
  record.meta.pid = ::getpid();
  record.meta.created_ms = NowMs();
  Manifest& m = record.manifest;
  m.model = d->model;
  m.version = d->version;
  m.versions = {d->version};
  m.parent = d->parent;
  m.chunk_bytes = d->parent_manifest ? d->parent_manifest->chunk_bytes : options.push.chunk_bytes;
  if (!files.empty()) m.chunk_bytes = files.begin()->second.part->chunk_bytes;
  {
    MutexLock lock(mu);
    record.meta.id = d->part_id;
    for (auto& [path, ef] : files) {
      AppendFileFrom(*ef.part, *ef.file, &m, /*src_is_dst=*/true);
      record.meta.logical_bytes += ef.file->size;
      record.meta.stored_bytes += StoredBytes(*ef.file);
      if (auto it = d->files.find(path); it != d->files.end()) {
        MutexLock flock(it->second->mu);
        for (size_t i = 0; i < 4; ++i) record.meta.tally[i] += it->second->tally[i];
      }
    }
    // The parent's files this draft no longer has at their path (removed or renamed away).
    if (d->parent_manifest) {
      for (const ManifestFile& pf : d->parent_manifest->files) {
        if (!d->files.count(pf.path)) record.meta.removed.push_back(pf.path);
      }
    }
  }
  record.meta.files = m.files.size();
  m.stats.logical_bytes = record.meta.logical_bytes;
  m.stats.stored_bytes = record.meta.stored_bytes;
  m.created = FormatUtc(record.meta.created_ms);

  auto note = [&](const StagedState& st) {
    MutexLock lock(mu);
    d->parts_in = st.in.size();
    d->part_state = st.kind == StagedState::kPublished ? "published"
                    : st.kind == StagedState::kWaiting  ? "waiting for parts: " + std::to_string(st.in.size()) +
                                                             " of " + std::to_string(part.parts) + " in"
                                                       : st.message;
  };
  Expected<StagedState> submitted = staged.Submit(record);
  if (!submitted.ok()) return io(submitted.status());
  StagedState st = std::move(submitted).value();
  note(st);
  spdlog::info("draft {}: part {} submitted ({} of {} parts in)", name, record.meta.id, st.in.size(), part.parts);
  if (st.kind == StagedState::kConflict || st.kind == StagedState::kGone) return Status::Conflict(st.message);
  if (st.kind == StagedState::kWaiting && part.wait) {
    const auto deadline = part.deadline.value_or(std::chrono::steady_clock::time_point::max());
    WFS_ASSIGN_OR_RETURN(st, staged.Wait(record, deadline, part.cancelled, note));
  }
  if (st.kind != StagedState::kPublished) return Status::Ok();  // --no-wait: the part is safe
  FinishPublished(d, st.published);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  spdlog::info("published {} ({} parts; this node's part {}) in {:.2f} s", name, part.parts, record.meta.id, secs);
  return Status::Ok();
}

Status Drafts::State::RemoveDraft(const std::shared_ptr<Draft>& d) {
  {
    MutexLock lock(mu);
    if (d->committing) return Status::Busy("the draft is being committed");
    if (DraftLocked(d->name()) != d) return Status::NotFound("no such file or directory");
    drafts.erase(d->name());
    RetireDraftLocked(d->name());
  }
  // A part of a staged version: the whole version is abandoned, on every node.
  if (d->parts > 0) {
    Expected<size_t> n = StagedVersion(*bucket, d->model, d->version).Discard();
    if (!n.ok()) spdlog::warn("draft {}: its staged version stays in the bucket: {}", d->name(), n.status().ToString());
    else if (*n > 0) spdlog::info("draft {}: the staged version is discarded from the bucket ({} objects)", d->name(), *n);
  }
  // Queued encodes of it find no draft and do nothing; one running holds its own references.
  std::error_code ec;
  std::filesystem::remove_all(d->dir, ec);
  if (ec) spdlog::warn("draft {}: cannot remove its staging directory {}: {}", d->name(), d->dir, ec.message());
  spdlog::info("draft {} removed (nothing of it was published)", d->name());
  return Status::Ok();
}

Status Drafts::Discard(uint64_t draft_ino) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  {
    MutexLock lock(s.mu);
    const State::Ref* r = s.RefLocked(draft_ino);
    if (!r || r->type != State::Type::kDraftDir) return Status::Unsupported("not a draft directory");
    d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    for (auto& [path, f] : d->files) {
      MutexLock flock(f->mu);
      if (f->writers > 0) {
        spdlog::warn("discard {}: {} is open for writing; close it first", d->name(), path);
        return Status::Busy(d->name() + "/" + path + " is open for writing");
      }
    }
  }
  return s.RemoveDraft(d);
}

std::optional<VersionRef> Drafts::DraftRef(uint64_t ino) const {
  State& s = *state_;
  MutexLock lock(s.mu);
  const State::Ref* r = s.RefLocked(ino);
  if (!r || r->type != State::Type::kDraftDir) return std::nullopt;
  const std::shared_ptr<Draft> d = s.DraftLocked(r->a);
  if (!d) return std::nullopt;
  return VersionRef{d->model, d->version};
}

Status Drafts::DiscardStaged(std::string_view name) {
  WFS_ASSIGN_OR_RETURN(VersionRef ref, ParseVersionRef(name, /*version_required=*/true));
  WFS_ASSIGN_OR_RETURN(size_t n, StagedVersion(*state_->bucket, ref.model, ref.version).Discard());
  if (n == 0) return Status::NotFound("no staged version " + std::string(name) + " in " + state_->bucket->Describe());
  spdlog::info("discarded the staged version {} ({} objects; its packs go at the next gc)", name, n);
  return Status::Ok();
}

Expected<std::shared_ptr<Draft>> Drafts::State::DraftOfDir(uint64_t draft_ino) {
  std::shared_ptr<Draft> d;
  {
    MutexLock lock(mu);
    const Ref* r = RefLocked(draft_ino);
    if (!r || r->type != Type::kDraftDir) return Status::InvalidArgument("not a draft directory");
    d = DraftLocked(r->a);
  }
  if (!d) return Status::NotFound("the draft is gone (published or removed)");
  return d;
}

Status Drafts::Commit(uint64_t draft_ino, const std::string& as) {
  State& s = *state_;
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<Draft> d, s.DraftOfDir(draft_ino));
  Status st = s.CommitDraft(d, as);
  if (!st.ok()) {
    s.commit_failures++;
    MutexLock lock(s.mu);
    d->error = st.ToString();
    spdlog::error("commit of draft {}: {}", d->name(), st.ToString());
  }
  return st;
}

Status Drafts::CommitPart(uint64_t draft_ino, const PartCommit& part) {
  State& s = *state_;
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<Draft> d, s.DraftOfDir(draft_ino));
  Status st = s.CommitPartOf(d, part);
  if (!st.ok()) {
    s.commit_failures++;
    MutexLock lock(s.mu);
    d->error = st.ToString();
    if (st.kind() == ErrorKind::kTimeout) {
      spdlog::warn("commit of part {} of {}: {}", d->part_id, d->name(), st.ToString());
    } else {
      spdlog::error("commit of part {} of {}: {}", d->part_id, d->name(), st.ToString());
    }
  }
  return st;
}

std::string Drafts::StagedJson() {
  Expected<std::vector<StagedSummary>> staged = StagedVersion::List(*state_->bucket);
  if (!staged.ok()) return nlohmann::json{{"error", staged.status().ToString()}}.dump();
  return weightfs::StagedJson(*staged);
}

Drafts::State::InheritedPlan Drafts::State::PlanInheritedLocked(Draft& d) {
  InheritedPlan plan;
  // The shards each written index names, by the index's directory ("" = the draft's own).
  constexpr std::string_view kIndex = ".safetensors.index.json";
  std::map<std::string, std::pair<std::string, std::set<std::string>>> named;  // dir -> (index, shards)
  for (auto& [path, f] : d.files) {
    if (!path.ends_with(kIndex)) continue;
    MutexLock flock(f->mu);
    if (f->id == 0 || f->size > (64u << 20)) continue;
    std::ifstream in(f->staging, std::ios::binary);
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
      spdlog::warn("{}: {} has no weight_map: the inherited shards of its directory are kept", d.name(), path);
      continue;
    }
    const std::string dir = ParentPath(path);
    auto& [index, shards] = named[dir];
    if (!index.empty()) {  // two indexes in one directory: which rules is not ours to guess
      named.erase(dir);
      continue;
    }
    index = path;
    for (const auto& [tensor, shard] : j["weight_map"].items()) {
      if (shard.is_string()) shards.insert((dir.empty() ? "" : dir + "/") + shard.get<std::string>());
    }
  }
  for (auto& [path, f] : d.files) {
    MutexLock flock(f->mu);
    if (f->id != 0) continue;
    auto it = named.find(ParentPath(path));
    if (it != named.end() && path.ends_with(".safetensors") && !it->second.second.count(path)) {
      plan.dropped.emplace(path, it->second.first);
    } else {
      plan.kept.push_back(path);
    }
  }
  return plan;
}

Status Drafts::CommitAll() {
  State& s = *state_;
  std::vector<std::shared_ptr<Draft>> all;
  {
    MutexLock lock(s.mu);
    for (auto& [name, d] : s.drafts) all.push_back(d);
  }
  Status first;
  for (auto& d : all) {
    bool empty, unchanged;
    {
      MutexLock lock(s.mu);
      // A commit in progress (one resumed after a remount runs in the background) decides
      // this draft: wait for it rather than fail it as "being committed already" (an unmount
      // right after a remount did).
      s.encoded_cv.WaitFor(s.mu, std::chrono::minutes(10), [&]() WFS_REQUIRES(s.mu) { return !d->committing; });
      if (s.DraftLocked(d->name()) != d) continue;  // published by that commit (or removed)
      empty = d->files.empty();
      unchanged = !d->commit_requested && d->Unchanged();
    }
    if (empty) {
      spdlog::info("draft {} has no files: not published", d->name());
      continue;
    }
    if (unchanged) {
      spdlog::info("draft {} is unchanged from its parent {}: not published (it stays a draft; `weightfs commit` "
                   "publishes it)", d->name(), d->parent.value_or("?"));
      continue;
    }
    Status st = s.CommitDraft(d, d->commit_as);
    if (!st.ok()) {
      s.commit_failures++;
      MutexLock lock(s.mu);
      d->error = st.ToString();
      spdlog::error("publishing draft {}: {} (its data stays staged; the next mount resumes it)", d->name(), st.ToString());
      if (first.ok()) first = st.WithContext("publishing " + d->name());
    }
  }
  return first;
}

}  // namespace weightfs
