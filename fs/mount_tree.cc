#include "fs/mount_tree.h"

#include <algorithm>

#include <spdlog/spdlog.h>

namespace weightfs {
namespace {

bool HasAt(std::string_view name) { return name.find('@') != std::string_view::npos; }

}  // namespace

Status MountTree::ReadOnly(std::string_view op, uint64_t ino) {
  return Status::ReadOnly(std::string(op) + " on inode " + std::to_string(ino) + ": published versions do not change");
}

std::optional<std::string> MountTree::DirPath(uint64_t ino) const {
  if (Drafts::Owns(ino)) return drafts_ ? drafts_->DirPath(ino) : std::nullopt;
  return names_->DirPath(ino);
}

Expected<NodeAttr> MountTree::Lookup(uint64_t parent, std::string_view name) {
  NodeAttr a;
  // The hidden .patch directory of a published version, and everything in it.
  if (patches_ && !Drafts::Owns(parent)) {
    if (PatchView::Owns(parent)) {
      WFS_TRY(patches_->Lookup(parent, name, &a));
      return a;
    }
    if (name == PatchView::kDirName) {
      if (std::optional<std::pair<std::string, std::string>> version = names_->VersionOf(parent)) {
        // A version that has a real ".patch" entry keeps it (the view is then out of reach).
        if (Expected<NodeAttr> real = names_->Lookup(parent, name); real.ok()) return real;
        WFS_TRY(patches_->LookupRoot(parent, version->first, version->second, &a));
        return a;
      }
    }
  }
  if (drafts_) {
    if (Drafts::Owns(parent)) {
      WFS_TRY(drafts_->Lookup(parent, name, &a));
      return a;
    }
    if (std::optional<std::string> dir = names_->DirPath(parent)) {
      if (HasAt(name)) {
        if (drafts_->LookupIn(*dir, name, &a).ok()) return a;  // a draft shadows a version of its name
      } else {
        // A published model's directory first; else a new directory of the drafts.
        Expected<NodeAttr> published = names_->Lookup(parent, name);
        if (!published.ok() && published.status().kind() == ErrorKind::kNotFound &&
            drafts_->LookupIn(*dir, name, &a).ok()) {
          return a;
        }
        return published;
      }
    }
  }
  return names_->Lookup(parent, name);
}

Expected<NodeAttr> MountTree::GetAttr(uint64_t ino) {
  NodeAttr a;
  if (IsDraft(ino)) {
    WFS_TRY(drafts_->GetAttr(ino, &a));
    return a;
  }
  if (IsPatch(ino)) {
    WFS_TRY(patches_->GetAttr(ino, &a));
    return a;
  }
  return names_->GetAttr(ino);
}

std::vector<NodeAttr> MountTree::GetAttrs(std::vector<uint64_t> inos) {
  std::vector<uint64_t> draft_inos, patch_inos;
  if (drafts_) {
    auto owned = std::stable_partition(inos.begin(), inos.end(), [](uint64_t i) { return !Drafts::Owns(i); });
    draft_inos.assign(owned, inos.end());
    inos.erase(owned, inos.end());
  }
  if (patches_) {
    auto owned = std::stable_partition(inos.begin(), inos.end(), [](uint64_t i) { return !PatchView::Owns(i); });
    patch_inos.assign(owned, inos.end());
    inos.erase(owned, inos.end());
  }
  std::vector<NodeAttr> attrs = names_->GetAttrs(inos);
  for (uint64_t i : patch_inos) {
    NodeAttr a;
    if (!patches_->IsFile(i) && patches_->GetAttr(i, &a).ok()) attrs.push_back(a);
  }
  for (uint64_t i : draft_inos) {
    NodeAttr a;
    if (drafts_->GetAttr(i, &a).ok()) attrs.push_back(a);
  }
  return attrs;
}

Expected<MountTree::Listing> MountTree::ReadDir(uint64_t ino) {
  Listing l;
  if (IsDraft(ino)) {
    WFS_TRY(drafts_->ReadDir(ino, &l.entries));
    return l;
  }
  if (IsPatch(ino)) {
    WFS_TRY(patches_->ReadDir(ino, &l.entries));
    l.immutable = true;
    return l;
  }
  WFS_ASSIGN_OR_RETURN(l.entries, names_->ReadDir(ino));
  std::optional<std::string> path;
  if (drafts_ && (path = names_->DirPath(ino))) {
    // Drafts and new directories join the listing; a draft shadows a version of its name.
    for (DirEntry& e : drafts_->EntriesIn(*path)) {
      auto same = std::find_if(l.entries.begin(), l.entries.end(), [&](const DirEntry& d) { return d.name == e.name; });
      if (same == l.entries.end()) {
        l.entries.push_back(std::move(e));
      } else if (HasAt(e.name)) {
        *same = std::move(e);
      }
    }
  }
  // Inside a version the listing never changes.
  l.immutable = names_->IsImmutable(ino);
  return l;
}

Expected<NodeAttr> MountTree::Mkdir(uint64_t parent, std::string_view name, mode_t mode, const Caller& who) {
  if (!drafts_) {
    if (derived_) {
      spdlog::warn("mkdir {}: the bucket's versions are derived from another layout (a TRL delta-sync "
                   "bucket) and it takes no new versions; `weightfs import` it into a weightfs bucket",
                   name);
    }
    return ReadOnly("mkdir", parent);
  }
  NodeAttr a;
  if (Drafts::Owns(parent)) {
    WFS_TRY(drafts_->Mkdir(parent, name, mode, who, &a));
    return a;
  }
  if (std::optional<std::string> dir = names_->DirPath(parent)) {
    if (names_->Lookup(parent, name).ok()) return Status::Conflict(std::string(name) + " exists already");
    WFS_TRY(drafts_->MkdirIn(*dir, name, mode, who, &a));
    return a;
  }
  return ReadOnly("mkdir", parent);
}

Status MountTree::Rmdir(uint64_t parent, std::string_view name) {
  if (!drafts_) return ReadOnly("rmdir", parent);
  if (Drafts::Owns(parent)) return drafts_->Rmdir(parent, name);
  std::optional<std::string> dir = names_->DirPath(parent);
  if (!dir) return ReadOnly("rmdir", parent);
  // A published name is not the drafts' to remove.
  NodeAttr a;
  if (!HasAt(name) && names_->Lookup(parent, name).ok()) return ReadOnly("rmdir", parent);
  if (HasAt(name) && !drafts_->LookupIn(*dir, name, &a).ok()) return ReadOnly("rmdir", parent);
  return drafts_->RmdirIn(*dir, name);
}

Status MountTree::Unlink(uint64_t parent, std::string_view name) {
  if (!IsDraft(parent)) return ReadOnly("unlink", parent);
  return drafts_->Unlink(parent, name);
}

Status MountTree::Rename(uint64_t parent, std::string_view name, uint64_t new_parent, std::string_view new_name,
                         unsigned flags) {
  if (!IsDraft(parent) && !IsDraft(new_parent)) return ReadOnly("rename", parent);
  if (!IsDraft(parent) || !IsDraft(new_parent)) return Status::CrossDevice("a rename between a draft and a version");
  return drafts_->Rename(parent, name, new_parent, new_name, flags);
}

}  // namespace weightfs
