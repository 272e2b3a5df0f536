// Drafts::State's inode table (a stable number per node for the life of the mount) and the
// attributes (stat) of the nodes drafts own.
#include "fs/drafts/state.h"

namespace weightfs {

uint64_t Drafts::State::InoLocked(Type t, const std::string& a, const std::string& b) {
  auto [it, inserted] = inos.emplace(Key(t, a, b), next_ino);
  if (inserted) refs[next_ino++] = Ref{t, a, b};
  return it->second;
}

// Item `path` of draft `name` is gone: a new node at the path gets a new number (the kernel
// must not take it for the old one, which an open file may still hold).
void Drafts::State::RetireLocked(const std::string& name, const std::string& path, std::weak_ptr<DraftFile> file) {
  auto it = inos.find(Key(Type::kItem, name, path));
  if (it == inos.end()) return;
  Ref& r = refs[it->second];
  r.removed = true;
  r.removed_file = std::move(file);
  inos.erase(it);
}

// Moves the inodes of `from` (and everything under it) to `to` inside draft `name`.
void Drafts::State::RekeyLocked(const std::string& name, const std::string& from, const std::string& to) {
  std::vector<std::pair<std::string, uint64_t>> moved;
  const std::string k = Key(Type::kItem, name, from);
  if (auto it = inos.find(k); it != inos.end()) {
    moved.emplace_back(to, it->second);
    inos.erase(it);
  }
  // (Keys like "from-x" sort between "from" and "from/...": the children are a range of
  // their own.)
  const std::string prefix = k + "/";
  for (auto it = inos.lower_bound(prefix); it != inos.end() && it->first.starts_with(prefix);) {
    moved.emplace_back(to + it->first.substr(k.size()), it->second);
    it = inos.erase(it);
  }
  for (auto& [path, ino] : moved) {
    inos.erase(Key(Type::kItem, name, path));
    inos[Key(Type::kItem, name, path)] = ino;
    refs[ino] = Ref{Type::kItem, name, path};
  }
}

// Every node of draft `name` (removed, or published and replaced by a new draft of the same
// name): their numbers never name anything again.
void Drafts::State::RetireDraftLocked(const std::string& name) {
  for (Type t : {Type::kDraftDir, Type::kItem}) {
    const std::string prefix = Key(t, name, "");
    for (auto it = inos.lower_bound(prefix); it != inos.end() && it->first.starts_with(prefix);) {
      if (t == Type::kItem || it->first == prefix) {
        refs[it->second].removed = true;
        it = inos.erase(it);
      } else {
        ++it;
      }
    }
  }
}

// The errno for a node of draft `name`, which is gone: ESTALE if it was published (the
// kernel then walks the path again and finds the published version: a lookup that raced
// the commit retries instead of failing), else ENOENT.
Status Drafts::State::GoneLocked(const std::string& name) const {
  return published_names.count(name) ? Status::Stale("draft " + name + " was published")
                                     : Status::NotFound("draft " + name + " is gone");
}

// New directories shown in `dir_path`: made by mkdir, or above a draft of a new model.
std::set<std::string> Drafts::State::NewDirsInLocked(const std::string& dir_path) const {
  std::set<std::string> out;
  auto add_ancestors = [&](const std::string& path) {
    // `path` or its ancestor directly in dir_path, if any.
    std::string p = path;
    while (!p.empty()) {
      std::string parent = ParentPath(p);
      if (parent == dir_path) {
        out.insert(p);
        break;
      }
      p = parent;
    }
  };
  for (const std::string& d : new_dirs) add_ancestors(d);
  for (const auto& [name, d] : drafts) add_ancestors(ParentPath(d->model));
  return out;
}

// ---- attributes (REQUIRES mu) ----
void Drafts::State::DirAttr(uint64_t ino, const NodeMeta& meta, NodeAttr* out) const {
  out->ino = ino;
  out->st = {};
  out->st.st_ino = ino;
  out->st.st_mode = S_IFDIR | (meta.mode & 07777);
  out->st.st_nlink = 2;
  out->st.st_size = 4096;
  out->st.st_blksize = 1 << 20;
  meta.Fill(&out->st);
  // Names are looked up every time (a commit or set-parent changes what a name is), but the
  // attributes of a node change only through this mount's own operations, after which the
  // kernel drops what it cached: without a timeout, every permission check of a path walk
  // (default_permissions) and every fstat was a GETATTR round trip, four per file created.
  out->timeout_s = 0;
  out->attr_timeout_s = 1;
}

void Drafts::State::FileAttr(uint64_t ino, DraftFile& f, NodeAttr* out) const {
  MutexLock lock(f.mu);
  DirAttr(ino, f.meta, out);
  // A file's name in its draft changes through this mount's own operations (the kernel sees
  // them) or with the whole draft (a commit, a discard, a set-parent), whose own name the mount
  // then drops from the kernel's cache, and the names under it with it (fs/fuse_server.cc
  // ForgetDraftName). Cached, `ls -l` and `stat` of a draft's files need no lookup per file.
  out->timeout_s = kEntryTimeoutS;
  out->st.st_mode = S_IFREG | (f.meta.mode & 07777);
  out->st.st_nlink = 1;
  out->st.st_size = static_cast<off_t>(f.id == 0 && f.parent_file ? f.parent_file->size : f.size);
  out->st.st_blocks = (out->st.st_size + 511) / 512;
}

Status Drafts::State::AttrLocked(uint64_t ino, NodeAttr* out) {
  if (auto it = refs.find(ino); it != refs.end() && it->second.removed) {
    std::shared_ptr<DraftFile> f = it->second.removed_file.lock();
    if (!f) return Status::NotFound("no such file or directory");
    FileAttr(ino, *f, out);
    out->st.st_nlink = 0;
    return Status::Ok();
  }
  const Ref* r = RefLocked(ino);
  if (!r) return Status::NotFound("no such file or directory");
  switch (r->type) {
    case Type::kNewDir: {
      if (!new_dirs.count(r->a) && NewDirsInLocked(ParentPath(r->a)).count(r->a) == 0) return Status::NotFound("no such file or directory");
      DirAttr(ino, NodeMeta::At(0755, options.uid, options.gid, 0), out);
      return Status::Ok();
    }
    case Type::kDraftDir: {
      std::shared_ptr<Draft> d = DraftLocked(r->a);
      if (!d) return GoneLocked(r->a);
      DirAttr(ino, d->root, out);
      out->st.st_nlink = 2 + d->SubdirCount("");
      // Its name changes meaning without the kernel seeing it only when the mount says so:
      // a commit (on_gone), a discard or a set-parent (fs/fuse_server.cc ForgetDraftName).
      out->timeout_s = kEntryTimeoutS;
      return Status::Ok();
    }
    case Type::kItem: {
      std::shared_ptr<Draft> d = DraftLocked(r->a);
      if (!d) return GoneLocked(r->a);
      if (auto it = d->files.find(r->b); it != d->files.end()) {
        FileAttr(ino, *it->second, out);
        return Status::Ok();
      }
      if (auto it = d->dirs.find(r->b); it != d->dirs.end()) {
        DirAttr(ino, it->second, out);
        out->st.st_nlink = 2 + d->SubdirCount(r->b);
        return Status::Ok();
      }
      return Status::NotFound("no such file or directory");
    }
  }
  return Status::NotFound("no such file or directory");
}

Status Drafts::State::DirOfLocked(uint64_t ino, std::shared_ptr<Draft>* d, std::string* path) const {
  const Ref* r = RefLocked(ino);
  if (!r) return Status::NotFound("no such directory");
  if (r->type == Type::kNewDir) return Status::PermissionDenied("a directory above the versions");
  *d = DraftLocked(r->a);
  if (!*d) return GoneLocked(r->a);
  if (r->type == Type::kDraftDir) {
    path->clear();
    return Status::Ok();
  }
  if ((*d)->files.count(r->b)) return Status::NotDirectory(r->b + " is a file");
  if (!(*d)->dirs.count(r->b)) return Status::NotFound(r->b + ": no such directory");
  *path = r->b;
  return Status::Ok();
}

}  // namespace weightfs
