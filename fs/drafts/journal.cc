// The journal of a draft: written atomically on every change of its tree, read back when a
// mount loads the drafts an earlier one left.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "fs/drafts/posix_io.h"
#include "fs/drafts/state.h"

namespace weightfs {

// ---- journal ----
nlohmann::json Drafts::State::JournalLocked(Draft& d, bool published) {
  nlohmann::json j;
  j["format"] = 1;
  j["model"] = d.model;
  j["version"] = d.version;
  j["parent"] = d.parent ? nlohmann::json(*d.parent) : nlohmann::json(nullptr);
  j["created_ms"] = d.created_ms;
  j["next_id"] = d.next_id;
  j["commit"] = d.commit_requested;
  j["commit_as"] = d.commit_as;
  j["parts"] = d.parts;
  j["part_id"] = d.part_id;
  j["published"] = published;
  j["root"] = d.root.ToJson();
  j["dirs"] = nlohmann::json::array();
  for (const auto& [path, meta] : d.dirs) {
    nlohmann::json e = meta.ToJson();
    e["path"] = path;
    j["dirs"].push_back(std::move(e));
  }
  j["files"] = nlohmann::json::array();
  for (auto& [path, f] : d.files) {
    MutexLock lock(f->mu);
    nlohmann::json e;
    e = f->meta.ToJson();
    e["path"] = path;
    e["id"] = f->id;
    e["parent_path"] = f->parent_path;
    e["backed"] = f->backed;
    if (f->backed) {
      e["present"] = std::string(f->present.begin(), f->present.end());
      e["backing_limit"] = f->backing_limit;
    }
    const bool valid = f->id != 0 && f->Encoded(path);
    e["encoded"] = valid ? f->encoded : "";
    e["encoded_path"] = valid ? f->encoded_path : "";
    e["write_error"] = f->write_error;
    e["tally"] = f->tally;
    f->journal_dirty = false;
    j["files"].push_back(std::move(e));
  }
  return j;
}

// Writes the draft's journal as it is now. REQUIRES mu not held.
Status Drafts::State::SaveJournal(Draft& d, bool published) {
  std::string text;
  uint64_t seq;
  {
    MutexLock lock(mu);
    text = JournalLocked(d, published).dump();
    seq = ++d.journal_seq;
  }
  std::lock_guard<std::mutex> lock(d.journal_mu);
  if (seq <= d.journal_written) return Status::Ok();  // a newer state was written already
  Status s = WriteAtomically(d.dir + "/journal.json", text);
  if (s.ok()) d.journal_written = seq;
  if (!s.ok()) spdlog::error("draft {}: cannot write its journal: {}", d.name(), s.ToString());
  return s;
}

Status Drafts::State::LoadDraft(const std::string& dir, const nlohmann::json& j) {
  auto d = std::make_shared<Draft>();
  d->dir = dir;
  d->id = std::filesystem::path(dir).filename().string();
  d->model = j.at("model").get<std::string>();
  d->version = j.at("version").get<std::string>();
  WFS_TRY(ValidateModelName(d->model));
  WFS_TRY(ValidateVersionName(d->version));
  if (j.at("published").get<bool>()) {
    MutexLock lock(mu);
    published_dirs[d->model].push_back(dir);
    return Status::Ok();
  }
  if (!j.at("parent").is_null()) d->parent = j.at("parent").get<std::string>();
  d->created_ms = j.at("created_ms").get<int64_t>();
  d->next_id = j.at("next_id").get<uint64_t>();
  d->commit_requested = j.at("commit").get<bool>();
  d->commit_as = j.at("commit_as").get<std::string>();
  d->parts = j.value("parts", 0);
  d->part_id = j.value("part_id", std::string());
  if (d->parent) {
    Expected<std::shared_ptr<const Manifest>> pm = bucket->ReadCurrentManifest(d->model, *d->parent);
    if (!pm.ok()) return pm.status().WithContext("reading the parent of draft " + d->name());
    d->parent_manifest = *pm;
  }
  // (A journal of an older weightfs lists directories by name and has no owners or times.)
  const NodeMeta defaults = NodeMeta::At(0755, options.uid, options.gid, d->created_ms * 1000000);
  d->root = j.contains("root") ? NodeMeta::FromJson(j.at("root"), defaults) : defaults;
  for (const auto& dj : j.at("dirs")) {
    if (dj.is_string()) {
      d->dirs.emplace(dj.get<std::string>(), defaults);
    } else {
      const std::string path = dj.at("path").get<std::string>();
      WFS_TRY(ValidateFilePath(path));
      d->dirs.emplace(path, NodeMeta::FromJson(dj, defaults));
    }
  }
  for (const auto& e : j.at("files")) {
    auto f = std::make_shared<DraftFile>();
    MutexLock flock(f->mu);  // (not shared yet: for the analysis)
    const std::string path = e.at("path").get<std::string>();
    WFS_TRY(ValidateFilePath(path));
    f->meta = NodeMeta::FromJson(e, NodeMeta::At(0644, options.uid, options.gid, 0));
    f->id = e.at("id").get<uint64_t>();
    f->parent_path = e.at("parent_path").get<std::string>();
    if (!f->parent_path.empty()) {
      if (!d->parent_manifest || !(f->parent_file = d->parent_manifest->FindFile(f->parent_path))) {
        return Status::Corruption("draft " + d->name() + ": " + path + " names a parent file that does not exist");
      }
    }
    if (f->id == 0 && !f->parent_file) return Status::Corruption("draft " + d->name() + ": " + path + " has no data");
    if (f->id != 0) {
      f->staging = d->StagingPath(f->id);
      f->fd = ::open(f->staging.c_str(), O_RDWR | O_CLOEXEC);
      if (f->fd < 0) {
        spdlog::error("draft {}: {}; the file is dropped", d->name(),
                      LastErrnoStatus("the staging file of " + path + " is gone").message());
        continue;
      }
      struct stat st {};
      ::fstat(f->fd, &st);
      f->size = static_cast<uint64_t>(st.st_size);
      f->backed = e.at("backed").get<bool>();
      if (f->backed) {
        const std::string present = e.at("present").get<std::string>();
        if (!f->parent_file || present.size() != RowCount(*f->parent_file)) {
          return Status::Corruption("draft " + d->name() + ": " + path + " has a bad copy-up map");
        }
        f->present.assign(present.begin(), present.end());
        f->backing_limit = e.at("backing_limit").get<uint64_t>();
      }
      f->write_error = e.value("write_error", std::string());
      if (e.contains("tally")) f->tally = e.at("tally").get<std::array<uint64_t, 4>>();
      f->encoded = e.at("encoded").get<std::string>();
      f->encoded_path = e.at("encoded_path").get<std::string>();
      if (!f->encoded.empty() && ::access(d->PartPath(f->encoded).c_str(), R_OK) != 0) f->encoded.clear();
    }
    d->files.emplace(path, std::move(f));
  }
  std::vector<std::string> pending;
  for (auto& [path, f] : d->files) {
    MutexLock flock(f->mu);
    if (!f->Encoded(path)) pending.push_back(path);
  }
  const std::string name = d->name();
  const bool commit = d->commit_requested;
  {
    MutexLock lock(mu);
    drafts[name] = d;
  }
  spdlog::info("draft {} resumed ({} files, {} to encode{})", name, d->files.size(), pending.size(),
               commit ? ", commit requested" : "");
  for (const std::string& p : pending) {
    if (d->files.at(p)->id != 0) Enqueue(name, p);
  }
  if (commit) Enqueue(name, "");
  return Status::Ok();
}

}  // namespace weightfs
