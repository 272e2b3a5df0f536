// MountTree: the mount's one tree of names, made of three owners, and the rules for which owner
// answers for a name or a node:
//   the published versions (Namespace): models, MODEL@VERSION, @latest, their files;
//   the drafts (Drafts, when the mount writes): MODEL@VERSION being written, new model
//     directories, and everything inside a draft;
//   the .patch views (PatchView, when on): MODEL@VERSION/.patch and what is under it.
// The rules: inside a draft, the draft answers; in a directory above the versions, a draft
// shadows a published version of its name, a published name shadows a new directory of the
// drafts; a version's ".patch" is the view's unless the version has a real entry of that name.
// Changes go to the drafts or are refused as read-only (published versions do not change).
//
// The FUSE adapter (fuse_server.cc) asks the tree and turns its answer into the kernel's reply:
// the tree knows nothing of the kernel's protocol, so its rules are tested in process
// (tests/fs/drafts_test.cc, with a bucket in memory). Thread-safe as its owners are.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "fs/drafts/drafts.h"
#include "fs/namespace.h"
#include "fs/patch_view.h"

namespace weightfs {

class MountTree {
 public:
  // `drafts` and `patches` may be null (a read-only mount, no .patch view). `derived`: the
  // bucket's versions are derived from another layout (a TRL bucket): mkdir says why it fails.
  MountTree(Namespace* names, Drafts* drafts, PatchView* patches, bool derived)
      : names_(names), drafts_(drafts), patches_(patches), derived_(derived) {}

  // Which owner a node belongs to (by its inode number's range).
  bool IsDraft(uint64_t ino) const { return drafts_ && Drafts::Owns(ino); }
  bool IsPatch(uint64_t ino) const { return patches_ && PatchView::Owns(ino); }

  Expected<NodeAttr> Lookup(uint64_t parent, std::string_view name);
  Expected<NodeAttr> GetAttr(uint64_t ino);
  // The attributes of many nodes at once (a readdirplus): the versions' read their manifests in
  // parallel; a .patch view's file is left out (its attributes cost its generation), and so is
  // a node whose attributes fail. In no particular order.
  std::vector<NodeAttr> GetAttrs(std::vector<uint64_t> inos);
  struct Listing {
    std::vector<DirEntry> entries;
    bool immutable = false;  // never changes: the kernel may keep it (inside a version, a patch view)
  };
  Expected<Listing> ReadDir(uint64_t ino);
  // A directory above the versions (the Namespace's or a new one of the drafts), where mkdir
  // makes drafts; nullopt for any other node.
  std::optional<std::string> DirPath(uint64_t ino) const;

  // ---- changes -------------------------------------------------------------------------------
  // mkdir: MODEL@VERSION makes a draft, another name a new model directory (above the
  // versions), or a directory inside a draft.
  Expected<NodeAttr> Mkdir(uint64_t parent, std::string_view name, mode_t mode, const Caller& who);
  // rmdir: an empty draft or new directory, or a directory inside a draft.
  Status Rmdir(uint64_t parent, std::string_view name);
  Status Unlink(uint64_t parent, std::string_view name);
  Status Rename(uint64_t parent, std::string_view name, uint64_t new_parent, std::string_view new_name,
                unsigned flags);
  // The refusal of a change to a node no draft owns.
  static Status ReadOnly(std::string_view op, uint64_t ino);

 private:
  Namespace* names_;
  Drafts* drafts_;
  PatchView* patches_;
  bool derived_;
};

}  // namespace weightfs
