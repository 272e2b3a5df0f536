// The journal of a draft: a snapshot and the records appended after it on every change of its
// tree (format below), read back when a mount loads the drafts an earlier one left.
#include <algorithm>
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "hub/store/local_file.h"
#include "fs/drafts/state.h"

namespace weightfs {

// ---- journal ----
//
// A draft's journal is two files in its directory:
//   journal.json  a snapshot: {"format":1, "seq":S, "model", "version", "parent", "created_ms",
//                 "next_id", "commit", "commit_as", "parts", "part_id", "published", "root",
//                 "dirs":[{path, meta}], "files":[entry]}
//   journal.log   records after it, one JSON object a line, in sequence order:
//                 {"seq":N, "h":{next_id, commit, commit_as, parts, part_id, root},
//                  "f":[entry], "d":[{path, meta}], "x":[path removed]}
// A file entry is {path, id, meta (mode uid gid atime_ns mtime_ns ctime_ns), parent_path,
// backed, present, backing_limit, encoded, encoded_path, write_error, tally}; fields at their
// defaults (empty, false, 0) are left out. Loading applies the records whose seq is above the
// snapshot's and stops at the first line that is not a whole record (the tail of an append cut
// by a crash). A snapshot is written atomically (temporary, fsync, rename, fsync the
// directory) and the log is emptied after it: a crash in between leaves records the snapshot
// holds already, which their seq skips. Compaction writes a snapshot once the log is larger
// than the last snapshot (and 1 MiB): the journal stays within about twice the draft's size,
// and each change costs its own record plus, amortized, as much again.
namespace {

constexpr uint64_t kCompactAbove = 1 << 20;

nlohmann::json FileEntry(const std::string& path, const DraftFile& f) WFS_REQUIRES(f.mu) {
  nlohmann::json e = f.meta.ToJson();
  e["path"] = path;
  if (f.id != 0) e["id"] = f.id;
  if (!f.parent_path.empty()) e["parent_path"] = f.parent_path;
  if (f.backed) {
    e["backed"] = true;
    std::string present(f.present.size(), '0');
    std::transform(f.present.begin(), f.present.end(), present.begin(), [](ChunkState c) { return static_cast<char>(c); });
    e["present"] = std::move(present);
    e["backing_limit"] = f.backing_limit;
  }
  if (f.id != 0 && f.Encoded(path)) {
    e["encoded"] = f.encoded;
    if (f.encoded_path != path) e["encoded_path"] = f.encoded_path;
  }
  if (!f.write_error.empty()) e["write_error"] = f.write_error;
  if (f.tally != std::array<uint64_t, 4>{}) e["tally"] = f.tally;
  return e;
}

nlohmann::json DirEntryJson(const std::string& path, const NodeMeta& meta) {
  nlohmann::json e = meta.ToJson();
  e["path"] = path;
  return e;
}

}  // namespace

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
  nlohmann::json dirs = nlohmann::json::array();
  for (const auto& [path, meta] : d.dirs) dirs.push_back(DirEntryJson(path, meta));
  j["dirs"] = std::move(dirs);
  nlohmann::json files = nlohmann::json::array();
  for (auto& [path, f] : d.files) {
    MutexLock lock(f->mu);
    files.push_back(FileEntry(path, *f));
    f->journal_dirty = false;
  }
  j["files"] = std::move(files);
  return j;
}

std::string Drafts::State::RecordLocked(Draft& d, uint64_t seq) {
  nlohmann::json r;
  r["seq"] = seq;
  r["h"] = {{"next_id", d.next_id}, {"commit", d.commit_requested}, {"commit_as", d.commit_as},
            {"parts", d.parts},     {"part_id", d.part_id},          {"root", d.root.ToJson()}};
  nlohmann::json files = nlohmann::json::array(), dirs = nlohmann::json::array(), gone = nlohmann::json::array();
  for (const std::string& path : d.journal_paths) {
    if (auto f = d.files.find(path); f != d.files.end()) {
      MutexLock lock(f->second->mu);
      files.push_back(FileEntry(path, *f->second));
      f->second->journal_dirty = false;
    } else if (auto dir = d.dirs.find(path); dir != d.dirs.end()) {
      dirs.push_back(DirEntryJson(path, dir->second));
    } else {
      gone.push_back(path);
    }
  }
  if (!files.empty()) r["f"] = std::move(files);
  if (!dirs.empty()) r["d"] = std::move(dirs);
  if (!gone.empty()) r["x"] = std::move(gone);
  d.journal_paths.clear();
  return r.dump() + "\n";
}

Status Drafts::State::SaveJournal(Draft& d, JournalWrite w) {
  uint64_t seq;
  {
    MutexLock lock(mu);
    if (w.file && !w.file->path.empty() && DraftLocked(d.name()).get() == &d) d.Changed(w.file->path);
    const bool snapshot = w.published || d.journal_snapshot || d.journal_failed.load() ||
                          d.journal_log_bytes.load() > std::max<uint64_t>(kCompactAbove, d.journal_snapshot_bytes.load());
    seq = ++d.journal_seq;
    std::string text;
    if (snapshot) {
      nlohmann::json j = JournalLocked(d, w.published);
      j["seq"] = seq;
      text = j.dump();
      d.journal_paths.clear();
      d.journal_snapshot = false;
      d.journal_failed = false;
    } else {
      text = RecordLocked(d, seq);
    }
    MutexLock out(d.journal_out_mu);
    if (snapshot) {
      d.journal_out.snapshot = std::move(text);
      d.journal_out.records.clear();  // (the snapshot holds them)
    } else {
      d.journal_out.records += text;
    }
    d.journal_out.last_seq = seq;
  }
  MutexLock lock(d.journal_mu);
  Draft::JournalOut out;
  {
    MutexLock o(d.journal_out_mu);
    std::swap(out, d.journal_out);
  }
  auto fail = [&](const Status& st) {
    d.journal_failed = true;  // the next write is a snapshot: it holds what this lost
    spdlog::error("draft {}: cannot write its journal: {}", d.name(), st.ToString());
    return st;
  };
  const std::string log_path = d.dir + "/journal.log";
  if (out.snapshot) {
    if (Status s = WriteAtomically(d.dir + "/journal.json", *out.snapshot); !s.ok()) return fail(s);
    if (d.journal_fd < 0) {
      d.journal_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (d.journal_fd < 0) return fail(LastErrnoStatus("cannot open " + log_path));
    }
    if (::ftruncate(d.journal_fd, 0) != 0) return fail(LastErrnoStatus("emptying " + log_path));
    d.journal_log_bytes = 0;
    d.journal_snapshot_bytes = out.snapshot->size();
    d.journal_unsynced = false;
    d.journal_synced_ns = NowNs();
  }
  if (!out.records.empty()) {
    if (d.journal_fd < 0) {
      d.journal_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
      if (d.journal_fd < 0) return fail(LastErrnoStatus("cannot open " + log_path));
    }
    size_t done = 0;
    while (done < out.records.size()) {
      const ssize_t n = ::write(d.journal_fd, out.records.data() + done, out.records.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const Status st = n == 0 ? StatusOfErrno(EIO, "appending to " + log_path) : LastErrnoStatus("appending to " + log_path);
        // A record cut in the middle would end the log for the next mount: cut it off.
        (void)::ftruncate(d.journal_fd, static_cast<off_t>(d.journal_log_bytes.load()));
        return fail(st);
      }
      done += static_cast<size_t>(n);
    }
    d.journal_log_bytes += out.records.size();
    d.journal_unsynced = true;
  }
  if (d.journal_unsynced && d.journal_fd >= 0 && (w.sync || NowNs() - d.journal_synced_ns > 1000000000)) {
    if (Status s = DataSync(d.journal_fd, log_path); !s.ok()) return fail(s);
    d.journal_unsynced = false;
    d.journal_synced_ns = NowNs();
  }
  d.journal_written = std::max(d.journal_written, out.last_seq);
  if (d.journal_written < seq) {
    // Another writer took this record and failed; the next write (a snapshot) will hold it.
    return Status::IOError("draft " + d.name() + ": its journal could not be written");
  }
  return Status::Ok();
}

// The draft as its journal says: the snapshot with the records of the log after it applied.
// `max_seq` gets the last record's number.
Expected<nlohmann::json> Drafts::State::ReplayJournal(const std::string& dir, uint64_t* max_seq) {
  Expected<std::string> text = ReadWholeFile(dir + "/journal.json");
  if (!text.ok()) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text);  // (the caller catches a bad snapshot)
  const uint64_t base = j.value("seq", uint64_t{0});
  *max_seq = base;
  Expected<std::string> log = ReadWholeFile(dir + "/journal.log");
  if (!log.ok() || log->empty() || j.value("published", false)) return j;
  std::map<std::string, nlohmann::json> files, dirs;
  // (The key first: `m[key(e)] = std::move(e)` moves e before it reads the key.)
  for (auto& e : j.at("files")) {
    const std::string p = e.at("path").get<std::string>();
    files[p] = std::move(e);
  }
  for (auto& e : j.at("dirs")) {
    const std::string p = e.is_string() ? e.get<std::string>() : e.at("path").get<std::string>();
    dirs[p] = e.is_string() ? nlohmann::json::object({{"path", p}}) : std::move(e);
  }
  size_t pos = 0, applied = 0;
  while (pos < log->size()) {
    const size_t nl = log->find('\n', pos);
    if (nl == std::string::npos) break;  // the tail of an append a crash cut
    nlohmann::json r = nlohmann::json::parse(log->begin() + static_cast<std::ptrdiff_t>(pos),
                                             log->begin() + static_cast<std::ptrdiff_t>(nl), nullptr, false);
    pos = nl + 1;
    if (r.is_discarded() || !r.is_object() || !r.contains("seq") || !r["seq"].is_number_unsigned()) {
      spdlog::warn("journal of {}: a record cut short ends the log (a crash while it was written)", dir);
      break;
    }
    const uint64_t seq = r["seq"].get<uint64_t>();
    if (seq <= *max_seq) continue;  // the snapshot holds it (a crash before the log was emptied)
    *max_seq = seq;
    if (r.contains("h")) {
      for (auto& [k, v] : r["h"].items()) j[k] = v;
    }
    for (const char* key : {"x", "d", "f"}) {
      if (!r.contains(key)) continue;
      for (auto& e : r[key]) {
        if (key[0] == 'x') {
          const std::string p = e.get<std::string>();
          files.erase(p);
          dirs.erase(p);
        } else {
          const std::string p = e.at("path").get<std::string>();
          (key[0] == 'f' ? dirs : files).erase(p);
          (key[0] == 'f' ? files : dirs)[p] = std::move(e);
        }
      }
    }
    applied++;
  }
  nlohmann::json fa = nlohmann::json::array(), da = nlohmann::json::array();
  for (auto& [p, e] : files) fa.push_back(std::move(e));
  for (auto& [p, e] : dirs) da.push_back(std::move(e));
  j["files"] = std::move(fa);
  j["dirs"] = std::move(da);
  spdlog::debug("journal of {}: snapshot at {} and {} records", dir, base, applied);
  return j;
}

Status Drafts::State::LoadDraft(const std::string& dir, const nlohmann::json& j, uint64_t seq) {
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
  std::map<std::string, bool> part_exists;  // part file -> there
  for (const auto& e : j.at("files")) {
    auto f = std::make_shared<DraftFile>();
    MutexLock flock(f->mu);  // (not shared yet: for the analysis)
    const std::string path = e.at("path").get<std::string>();
    WFS_TRY(ValidateFilePath(path));
    f->meta = NodeMeta::FromJson(e, NodeMeta::At(0644, options.uid, options.gid, 0));
    f->path = path;
    f->id = e.value("id", uint64_t{0});
    f->parent_path = e.value("parent_path", std::string());
    if (!f->parent_path.empty()) {
      if (!d->parent_manifest || !(f->parent_file = d->parent_manifest->FindFile(f->parent_path))) {
        return Status::Corruption("draft " + d->name() + ": " + path + " names a parent file that does not exist");
      }
    }
    if (f->id == 0 && !f->parent_file) return Status::Corruption("draft " + d->name() + ": " + path + " has no data");
    if (f->id != 0) {
      f->staging = d->StagingPath(f->id);
      struct stat st {};
      if (::stat(f->staging.c_str(), &st) != 0) {  // (opened when it is used: DraftFile::EnsureFd)
        spdlog::error("draft {}: {}; the file is dropped", d->name(),
                      LastErrnoStatus("the staging file of " + path + " is gone").message());
        continue;
      }
      f->size = static_cast<uint64_t>(st.st_size);
      f->backed = e.value("backed", false);
      if (f->backed) {
        const std::string present = e.at("present").get<std::string>();
        f->present.resize(present.size());
        std::transform(present.begin(), present.end(), f->present.begin(), [](char c) { return ChunkState{c}; });
        f->backing_limit = e.at("backing_limit").get<uint64_t>();
      }
      if (Status ok = f->CheckInvariants(); !ok.ok()) {
        return Status::Corruption("draft " + d->name() + ": " + path + " has a bad copy-up map (" + ok.message() + ")");
      }
      f->write_error = e.value("write_error", std::string());
      if (e.contains("tally")) f->tally = e.at("tally").get<std::array<uint64_t, 4>>();
      f->encoded = e.value("encoded", std::string());
      f->encoded_path = e.value("encoded_path", path);
      if (!f->encoded.empty()) {
        auto [it, fresh] = part_exists.emplace(f->encoded, false);
        if (fresh) it->second = ::access(d->PartPath(f->encoded).c_str(), R_OK) == 0;
        if (it->second) {
          d->RetainPart(f->encoded);
        } else {
          f->encoded.clear();
        }
      }
    }
    d->files.emplace(path, std::move(f));
  }
  std::vector<std::string> pending;
  for (auto& [path, f] : d->files) {
    MutexLock flock(f->mu);
    if (!f->Encoded(path)) pending.push_back(path);
  }
  // Part files no file names any more (encoded again, removed, or written by an encode the
  // crash cut before its record).
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/parts", ec)) {
    const std::string part = entry.path().filename().string();
    if (!d->part_refs.count(part)) std::filesystem::remove(entry.path(), ec);
  }
  // The journal starts again from a snapshot of what was loaded (a record cut short, files
  // dropped).
  d->journal_seq = seq;
  d->journal_snapshot = true;
  const std::string name = d->name();
  const bool commit = d->commit_requested;
  {
    MutexLock lock(mu);
    drafts[name] = d;
  }
  WFS_TRY(SaveJournal(*d));
  spdlog::info("draft {} resumed ({} files, {} to encode{})", name, d->files.size(), pending.size(),
               commit ? ", commit requested" : "");
  for (const std::string& p : pending) {
    if (d->files.at(p)->id != 0) Enqueue(name, p);
  }
  if (commit) Enqueue(name, "");
  return Status::Ok();
}

}  // namespace weightfs
