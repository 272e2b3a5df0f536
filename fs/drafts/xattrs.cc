// The extended attributes of a draft directory: user.weightfs.parent (settable while nothing
// changed), .state, .error and .inherited.
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "fs/drafts/state.h"

namespace weightfs {

namespace {

constexpr const char* kXattrState = "user.weightfs.state";
constexpr const char* kXattrError = "user.weightfs.error";
// What the commit does with the inherited files (JSON: State::InheritedPlan).
constexpr const char* kXattrInherited = "user.weightfs.inherited";

}  // namespace

Status Drafts::GetXattr(uint64_t ino, std::string_view name, std::string* out) {
  State& s = *state_;
  MutexLock lock(s.mu);
  const State::Ref* r = s.RefLocked(ino);
  if (!r) return Status::NotFound("no such file or directory");
  if (r->type != State::Type::kDraftDir) return Status::NoAttribute("no such attribute");
  std::shared_ptr<Draft> d = s.DraftLocked(r->a);
  if (!d) return s.GoneLocked(r->a);
  if (name == kXattrParent) {
    if (!d->parent) return Status::NoAttribute("no such attribute");
    *out = *d->parent;
  } else if (name == kXattrState) {
    *out = d->committing ? "committing" : "draft";
  } else if (name == kXattrError) {
    if (d->error.empty()) return Status::NoAttribute("no such attribute");
    *out = d->error;
  } else if (name == kXattrInherited) {
    const State::InheritedPlan plan = s.PlanInheritedLocked(*d);
    nlohmann::json j = {{"kept", plan.kept}, {"dropped", nlohmann::json::object()}};
    for (const auto& [path, index] : plan.dropped) j["dropped"][path] = index;
    *out = j.dump();
  } else {
    return Status::NoAttribute("no such attribute");
  }
  return Status::Ok();
}

Status Drafts::ListXattr(uint64_t ino, std::vector<std::string>* out) {
  State& s = *state_;
  MutexLock lock(s.mu);
  const State::Ref* r = s.RefLocked(ino);
  if (!r) return Status::NotFound("no such file or directory");
  out->clear();
  if (r->type != State::Type::kDraftDir) return Status::Ok();
  std::shared_ptr<Draft> d = s.DraftLocked(r->a);
  if (!d) return s.GoneLocked(r->a);
  if (d->parent) out->push_back(kXattrParent);
  out->push_back(kXattrState);
  out->push_back(kXattrInherited);
  if (!d->error.empty()) out->push_back(kXattrError);
  return Status::Ok();
}

Status Drafts::SetXattr(uint64_t ino, std::string_view name, std::string_view value) {
  State& s = *state_;
  std::shared_ptr<Draft> d;
  {
    MutexLock lock(s.mu);
    const State::Ref* r = s.RefLocked(ino);
    if (!r) return Status::NotFound("no such file or directory");
    if (r->type != State::Type::kDraftDir || name != kXattrParent) return Status::Unsupported(std::string(name) + " cannot be set here");
    d = s.DraftLocked(r->a);
    if (!d) return s.GoneLocked(r->a);
    // Only an unchanged draft can change its parent: every file still the parent's.
    for (const auto& [p, f] : d->files) {
      MutexLock flock(f->mu);
      if (f->id != 0 || f->parent_path != p) {
        // The reason goes to the draft's user.weightfs.error, where `weightfs set-parent` reads
        // it: EBUSY alone does not say which of the refusals this is.
        d->error = "set-parent: " + p + " was written, renamed or removed already; a draft's parent can be set "
                   "only before anything changes in it (discard it and mkdir it again)";
        spdlog::warn("setxattr {} on {}: {}", name, d->name(), d->error);
        return Status::Busy(d->error);
      }
    }
  }
  std::string v(value);
  while (!v.empty() && (v.back() == '\n' || v.back() == '\0')) v.pop_back();
  if (const size_t at = v.rfind('@'); at != std::string::npos) v = v.substr(at + 1);
  Expected<std::shared_ptr<const Manifest>> pm = s.bucket->ReadCurrentManifest(d->model, v);
  if (!pm.ok()) {
    const bool bad_name = pm.status().kind() == ErrorKind::kNotFound || pm.status().kind() == ErrorKind::kInvalidArgument;
    MutexLock lock(s.mu);
    d->error = "set-parent: " + d->model + "@" + v + " cannot be the parent: " + pm.status().ToString() +
               (bad_name ? " (`weightfs log BUCKET " + d->model + "` lists its versions)" : "");
    spdlog::warn("setxattr {} on {}: {}", name, d->name(), d->error);
    return bad_name ? Status::InvalidArgument(d->error) : Status::IOError(d->error);
  }
  {
    MutexLock lock(s.mu);
    d->InheritAll(*pm, d->root.uid, d->root.gid);
    d->error.clear();
  }
  spdlog::info("draft {}: parent is now {}", d->name(), v);
  return s.SaveJournal(*d);
}

}  // namespace weightfs
