// Names: the draft directories and new model directories above the versions, and the tree
// inside a draft (lookup, readdir, mkdir, rmdir, unlink, rename).
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "fs/drafts/state.h"

namespace weightfs {

Status Drafts::LookupIn(const std::string& dir_path, std::string_view name, NodeAttr* out) {
  State& s = *state_;
  MutexLock lock(s.mu);
  const std::string n(name);
  if (const size_t at = n.rfind('@'); at != std::string::npos) {
    const std::string draft = Join(dir_path, n);
    if (!s.DraftLocked(draft)) return Status::NotFound("no such file or directory");
    return s.AttrLocked(s.InoLocked(State::Type::kDraftDir, draft), out);
  }
  const std::string path = Join(dir_path, n);
  if (!s.NewDirsInLocked(dir_path).count(path)) return Status::NotFound("no such file or directory");
  return s.AttrLocked(s.InoLocked(State::Type::kNewDir, path), out);
}

std::vector<DirEntry> Drafts::EntriesIn(const std::string& dir_path) {
  State& s = *state_;
  MutexLock lock(s.mu);
  std::vector<DirEntry> out;
  for (const std::string& p : s.NewDirsInLocked(dir_path)) {
    out.push_back({p.substr(p.rfind('/') == std::string::npos ? 0 : p.rfind('/') + 1),
                   s.InoLocked(State::Type::kNewDir, p), S_IFDIR});
  }
  for (const auto& [name, d] : s.drafts) {
    if (State::ModelDir(d->model) != dir_path) continue;
    out.push_back({State::Leaf(d->model) + "@" + d->version, s.InoLocked(State::Type::kDraftDir, name), S_IFDIR});
  }
  return out;
}

Status Drafts::MkdirIn(const std::string& dir_path, std::string_view name, mode_t mode, const Caller& who,
                    NodeAttr* out) {
  State& s = *state_;
  if (!enabled()) {
    spdlog::warn("mkdir {}: {}", Join(dir_path, name), s.disabled_reason.empty() ? "drafts are off" : s.disabled_reason);
    return Status::ReadOnly(s.disabled_reason.empty() ? "drafts are off" : s.disabled_reason);
  }
  const std::string n(name);
  const size_t at = n.rfind('@');
  const std::string& prefix = s.options.prefix;
  auto outside = [&](const std::string& what) {
    spdlog::warn("mkdir {}: this mount shows only the models under {} (--prefix)", what, prefix);
    return Status::ReadOnly(what + " is outside " + prefix + ", the part of the bucket this mount shows (--prefix)");
  };
  if (at == std::string::npos) {
    const std::string path = Join(dir_path, n);
    if (!ValidateModelName(path).ok()) return Status::InvalidArgument(path + " is not a valid model directory name");
    // On the way to the prefix ("acme" for acme/qwen), or under it.
    if (!ModelUnder(path, prefix) && !ModelUnder(prefix, path)) return outside(path);
    MutexLock lock(s.mu);
    if (s.NewDirsInLocked(dir_path).count(path)) return Status::Conflict(path + " exists already");
    s.new_dirs.insert(path);
    return s.AttrLocked(s.InoLocked(State::Type::kNewDir, path), out);
  }
  const std::string model = Join(dir_path, n.substr(0, at));
  const std::string version = n.substr(at + 1);
  if (Status v = ValidateModelName(model); !v.ok()) {
    spdlog::warn("mkdir {}: {}", n, v.message());
    return Status::InvalidArgument(n + ": not a valid model name");
  }
  if (!ModelUnder(model, prefix)) return outside(model + "@" + version);
  if (Status v = ValidateVersionName(version); !v.ok() || version == "latest") {
    const std::string why = v.ok() ? "'latest' is reserved for the newest version's link" : v.message();
    spdlog::warn("mkdir {}: not a valid version name: {} (docs/drafts.md, \"Names\")", n, why);
    return Status::InvalidArgument(n + ": not a valid version name: " + why);
  }
  const std::string draft_name = model + "@" + version;
  {
    MutexLock lock(s.mu);
    if (s.DraftLocked(draft_name)) return Status::Conflict("draft " + draft_name + " exists already");
  }
  if (s.bucket->store().Head(Bucket::ManifestKey(model, version)).ok()) return Status::Conflict("version " + draft_name + " exists already");
  auto d = std::make_shared<Draft>();
  d->model = model;
  d->version = version;
  d->created_ms = NowMs();
  d->root = NodeMeta::At(mode, who.uid, who.gid, d->created_ms * 1000000);
  d->journal_snapshot = true;  // its journal starts with a snapshot
  Expected<std::shared_ptr<const Manifest>> latest = s.bucket->Latest(model);
  // The parent's head as the bucket has it now: one this mount read before a gc rewrote it
  // (--keep-last rebases the versions it keeps) names rows that are gone.
  if (latest.ok()) latest = s.bucket->ReadCurrentManifest(model, (*latest)->version);
  if (latest.ok()) {
    d->InheritAll(*latest, who.uid, who.gid);
  } else if (latest.status().kind() != ErrorKind::kNotFound) {
    return ParentBytes(latest.status(), "mkdir " + draft_name + ": finding its parent");
  }
  char id[64];
  std::snprintf(id, sizeof id, "%lld-%d-%llx", static_cast<long long>(d->created_ms), static_cast<int>(::getpid()),
                static_cast<unsigned long long>(NowNs() & 0xffffff));
  d->id = id;
  d->dir = s.options.state_dir + "/" + d->id;
  std::error_code ec;
  std::filesystem::create_directories(d->dir + "/files", ec);
  if (!ec) std::filesystem::create_directories(d->dir + "/parts", ec);
  if (ec) {
    return StatusOfErrno(ec.value(), "mkdir " + draft_name + ": creating its staging directory " + d->dir);
  }
  {
    MutexLock lock(s.mu);
    if (s.DraftLocked(draft_name)) {
      std::filesystem::remove_all(d->dir, ec);
      return Status::Conflict("draft " + draft_name + " exists already");
    }
    s.RetireDraftLocked(draft_name);  // an earlier draft of this name (published as another)
    s.drafts[draft_name] = d;
  }
  if (Status js = s.SaveJournal(*d); !js.ok()) {
    MutexLock lock(s.mu);
    s.drafts.erase(draft_name);
    std::filesystem::remove_all(d->dir, ec);
    return js;
  }
  spdlog::info("draft {} created (parent {})", draft_name, d->parent.value_or("none: a base"));
  MutexLock lock(s.mu);
  return s.AttrLocked(s.InoLocked(State::Type::kDraftDir, draft_name), out);
}

Status Drafts::RmdirIn(const std::string& dir_path, std::string_view name) {
  State& s = *state_;
  const std::string n(name);
  std::shared_ptr<Draft> d;
  {
    MutexLock lock(s.mu);
    if (n.find('@') == std::string::npos) {
      const std::string path = Join(dir_path, n);
      if (!s.NewDirsInLocked(dir_path).count(path)) return Status::NotFound("no such file or directory");
      for (const auto& [k, dr] : s.drafts) {
        if (dr->model.starts_with(path + "/")) return Status::NotEmpty("directory not empty");
      }
      for (const std::string& nd : s.new_dirs) {
        if (nd.starts_with(path + "/")) return Status::NotEmpty("directory not empty");
      }
      s.new_dirs.erase(path);
      return Status::Ok();
    }
    d = s.DraftLocked(Join(dir_path, n));
    if (!d) return Status::NotFound("no such file or directory");
    if (!d->files.empty() || !d->dirs.empty()) return Status::NotEmpty("directory not empty");
  }
  return s.RemoveDraft(d);
}

std::optional<std::string> Drafts::DirPath(uint64_t ino) const {
  MutexLock lock(state_->mu);
  const State::Ref* r = state_->RefLocked(ino);
  if (!r || r->type != State::Type::kNewDir) return std::nullopt;
  return r->a;
}

Status Drafts::GetAttr(uint64_t ino, NodeAttr* out) {
  MutexLock lock(state_->mu);
  return state_->AttrLocked(ino, out);
}

Status Drafts::Lookup(uint64_t parent, std::string_view name, NodeAttr* out) {
  State& s = *state_;
  std::optional<std::string> new_dir = DirPath(parent);
  if (new_dir) return LookupIn(*new_dir, name, out);
  MutexLock lock(s.mu);
  std::shared_ptr<Draft> d;
  std::string dir;
  WFS_TRY(s.DirOfLocked(parent, &d, &dir));
  const std::string path = Join(dir, name);
  if (!d->files.count(path) && !d->dirs.count(path)) return Status::NotFound("no such file or directory");
  return s.AttrLocked(s.InoLocked(State::Type::kItem, d->name(), path), out);
}

Status Drafts::ReadDir(uint64_t ino, std::vector<DirEntry>* out) {
  State& s = *state_;
  out->clear();
  if (std::optional<std::string> nd = DirPath(ino)) {
    out->push_back({".", ino, S_IFDIR});
    out->push_back({"..", ino, S_IFDIR});  // the kernel resolves ".." itself
    for (DirEntry& e : EntriesIn(*nd)) out->push_back(std::move(e));
    return Status::Ok();
  }
  MutexLock lock(s.mu);
  std::shared_ptr<Draft> d;
  std::string dir;
  WFS_TRY(s.DirOfLocked(ino, &d, &dir));
  out->push_back({".", ino, S_IFDIR});
  out->push_back({"..", ino, S_IFDIR});
  // The nodes under `dir` are a range of each map (all of them for the draft's root).
  std::map<std::string, mode_t> names;
  const std::string prefix = dir.empty() ? std::string() : dir + "/";
  auto collect = [&](const auto& nodes, mode_t type) {
    for (auto it = nodes.lower_bound(prefix); it != nodes.end() && it->first.starts_with(prefix); ++it) {
      if (it->first.find('/', prefix.size()) == std::string::npos) names[it->first] = type;
    }
  };
  collect(d->dirs, S_IFDIR);
  collect(d->files, S_IFREG);
  for (const auto& [p, type] : names) {
    out->push_back({p.substr(dir.empty() ? 0 : dir.size() + 1), s.InoLocked(State::Type::kItem, d->name(), p), type});
  }
  return Status::Ok();
}

Status Drafts::Mkdir(uint64_t parent, std::string_view name, mode_t mode, const Caller& who, NodeAttr* out) {
  State& s = *state_;
  if (std::optional<std::string> nd = DirPath(parent)) return MkdirIn(*nd, name, mode, who, out);
  std::shared_ptr<Draft> d;
  std::string path;
  {
    MutexLock lock(s.mu);
    std::string dir;
    WFS_TRY(s.DirOfLocked(parent, &d, &dir));
    path = Join(dir, name);
    if (!ValidateFilePath(path).ok()) return Status::InvalidArgument(path + " is not a valid path");
    if (d->files.count(path) || d->dirs.count(path)) return Status::Conflict(path + " exists already");
    d->dirs.emplace(path, NodeMeta::At(mode, who.uid, who.gid, NowNs()));
    d->Changed(path);
    d->TouchDir(dir);
  }
  WFS_TRY(s.SaveJournal(*d));
  MutexLock lock(s.mu);
  return s.AttrLocked(s.InoLocked(State::Type::kItem, d->name(), path), out);
}

Status Drafts::Rmdir(uint64_t parent, std::string_view name) {
  State& s = *state_;
  if (std::optional<std::string> nd = DirPath(parent)) return RmdirIn(*nd, name);
  std::shared_ptr<Draft> d;
  {
    MutexLock lock(s.mu);
    std::string dir;
    WFS_TRY(s.DirOfLocked(parent, &d, &dir));
    const std::string path = Join(dir, name);
    if (d->files.count(path)) return Status::NotDirectory("not a directory");
    if (!d->dirs.count(path)) return Status::NotFound("no such file or directory");
    if (d->HasEntriesUnder(path)) return Status::NotEmpty("directory not empty");
    d->dirs.erase(path);
    d->Changed(path);
    d->TouchDir(dir);
    s.RetireLocked(d->name(), path, {});
  }
  return s.SaveJournal(*d);
}

Status Drafts::Unlink(uint64_t parent, std::string_view name) {
  State& s = *state_;
  if (DirPath(parent)) return Status::PermissionDenied("files live in versions");
  std::shared_ptr<Draft> d;
  std::shared_ptr<DraftFile> f;
  std::string part;  // its encoded part, if no other file shares it
  {
    MutexLock lock(s.mu);
    std::string dir;
    WFS_TRY(s.DirOfLocked(parent, &d, &dir));
    const std::string path = Join(dir, name);
    if (d->dirs.count(path)) return Status::IsDirectory("is a directory");
    auto it = d->files.find(path);
    if (it == d->files.end()) return Status::NotFound("no such file or directory");
    f = it->second;
    d->files.erase(it);
    f->path.clear();
    d->Changed(path);
    d->TouchDir(dir);
    s.RetireLocked(d->name(), path, f);
    MutexLock flock(f->mu);
    if (d->ReleasePart(f->encoded)) part = f->encoded;
    f->encoded.clear();
  }
  // The staging file goes first: on a full disk removing files is how space comes back, and
  // the journal write below needs some. (A journal still naming the file after a crash is
  // harmless: a file whose staging file is gone is dropped when the draft is loaded.)
  {
    MutexLock flock(f->mu);
    if (f->id != 0) {
      ::unlink(f->staging.c_str());  // open handles keep reading through their descriptor
      if (!part.empty()) ::unlink(d->PartPath(part).c_str());
      f->CloseIdleFd();  // nobody has it open: release the space now
    }
  }
  (void)s.SaveJournal(*d);  // logs its failure; the unlink itself is done
  return Status::Ok();
}

Status Drafts::Rename(uint64_t parent, std::string_view name, uint64_t new_parent, std::string_view new_name,
                   unsigned flags) {
  State& s = *state_;
  if (flags & ~1u) return Status::InvalidArgument("rename flags other than RENAME_NOREPLACE");  // RENAME_EXCHANGE, RENAME_WHITEOUT: not supported
  const bool noreplace = flags & 1u;
  if (DirPath(parent) || DirPath(new_parent)) return Status::CrossDevice("a rename above the versions");
  std::shared_ptr<Draft> d, d2;
  std::shared_ptr<DraftFile> replaced;
  std::string replaced_part;  // the replaced file's encoded part, if no other file shares it
  {
    MutexLock lock(s.mu);
    std::string dir, dir2;
    // (A node above the versions is refused as PermissionDenied: across a draft's edge, EXDEV.)
    auto within = [](Status st) {
      return st.kind() == ErrorKind::kPermissionDenied ? Status::CrossDevice(st.message()) : st;
    };
    WFS_TRY(within(s.DirOfLocked(parent, &d, &dir)));
    WFS_TRY(within(s.DirOfLocked(new_parent, &d2, &dir2)));
    if (d != d2) return Status::CrossDevice("a rename between two drafts");
    const std::string from = Join(dir, name), to = Join(dir2, new_name);
    if (!ValidateFilePath(to).ok()) return Status::InvalidArgument(to + " is not a valid path");
    if (from == to) return Status::Ok();
    const bool is_file = d->files.count(from) > 0;
    if (!is_file && !d->dirs.count(from)) return Status::NotFound("no such file or directory");
    if (to.starts_with(from + "/")) return Status::InvalidArgument("a directory cannot move into itself");
    const bool to_file = d->files.count(to) > 0, to_dir = d->dirs.count(to) > 0;
    if ((to_file || to_dir) && noreplace) return Status::Conflict(to + " exists already (RENAME_NOREPLACE)");
    if (is_file) {
      if (to_dir) return Status::IsDirectory("is a directory");
      if (to_file) {
        replaced = d->files[to];
        d->files.erase(to);
        replaced->path.clear();
        s.RetireLocked(d->name(), to, replaced);
        MutexLock rlock(replaced->mu);
        if (d->ReleasePart(replaced->encoded)) replaced_part = replaced->encoded;
        replaced->encoded.clear();
      }
      auto f = d->files[from];
      d->files.erase(from);
      d->files[to] = f;
      f->path = to;
      d->Changed(from);
      d->Changed(to);
      MutexLock flock(f->mu);
      if (f->id != 0 && f->writers == 0 && !f->Encoded(to) && !f->encoding) s.Enqueue(d->name(), to);
    } else {
      if (to_file) return Status::NotDirectory("not a directory");
      if (to_dir && d->HasEntriesUnder(to)) return Status::NotEmpty("directory not empty");
      if (to_dir) {
        d->dirs.erase(to);
        s.RetireLocked(d->name(), to, {});
      }
      // Only the nodes under `from` move: a range of each map.
      const std::string prefix = from + "/";
      std::vector<std::pair<std::string, std::shared_ptr<DraftFile>>> files;
      for (auto it = d->files.lower_bound(prefix); it != d->files.end() && it->first.starts_with(prefix);) {
        d->Changed(it->first);
        files.emplace_back(to + it->first.substr(from.size()), std::move(it->second));
        it = d->files.erase(it);
      }
      std::vector<std::pair<std::string, NodeMeta>> dirs;
      if (auto it = d->dirs.find(from); it != d->dirs.end()) {
        dirs.emplace_back(to, it->second);
        d->dirs.erase(it);
      }
      for (auto it = d->dirs.lower_bound(prefix); it != d->dirs.end() && it->first.starts_with(prefix);) {
        d->Changed(it->first);
        dirs.emplace_back(to + it->first.substr(from.size()), it->second);
        it = d->dirs.erase(it);
      }
      d->Changed(from);
      for (auto& [p, f] : files) {
        f->path = p;
        d->Changed(p);
        d->files[p] = std::move(f);
      }
      for (auto& [p, meta] : dirs) {
        d->Changed(p);
        d->dirs[p] = meta;
      }
      for (auto it = d->files.lower_bound(to + "/"); it != d->files.end() && it->first.starts_with(to + "/"); ++it) {
        MutexLock flock(it->second->mu);
        if (it->second->id != 0 && it->second->writers == 0 && !it->second->Encoded(it->first) &&
            !it->second->encoding) {
          s.Enqueue(d->name(), it->first);
        }
      }
    }
    s.RekeyLocked(d->name(), from, to);
    d->TouchDir(dir);
    d->TouchDir(dir2);
    const int64_t now = NowNs();
    if (is_file) {
      MutexLock flock(d->files[to]->mu);
      d->files[to]->meta.ctime_ns = now;
    } else if (NodeMeta* m = d->DirMeta(to)) {
      m->ctime_ns = now;
    }
  }
  if (replaced) {
    MutexLock flock(replaced->mu);
    if (replaced->id != 0) ::unlink(replaced->staging.c_str());
    if (!replaced_part.empty()) ::unlink(d->PartPath(replaced_part).c_str());
  }
  return s.SaveJournal(*d);
}

}  // namespace weightfs
