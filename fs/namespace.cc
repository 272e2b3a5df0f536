#include "fs/namespace.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "hub/store/http_client.h"

namespace weightfs {
namespace {

constexpr const char* kXattrSha256 = "user.weightfs.sha256";
constexpr const char* kXattrStoredBytes = "user.weightfs.stored_bytes";
constexpr const char* kXattrChangedFraction = "user.weightfs.changed_fraction";

// Manifests read at once when many versions need their summaries (a listing of a model).
constexpr size_t kManifestReaders = 8;
// Reported as st_blksize of files: coreutils (cat, cp) size their buffers from it, and the
// mount serves up to 1 MiB per request.
constexpr blksize_t kFileBlockSize = 1 << 20;

timespec TimespecOfMs(int64_t ms) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(ms / 1000);
  ts.tv_nsec = static_cast<long>((ms % 1000) * 1000000);
  if (ts.tv_nsec < 0) {
    ts.tv_sec -= 1;
    ts.tv_nsec += 1000000000;
  }
  return ts;
}

std::vector<std::string_view> SplitPath(std::string_view path) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t slash = path.find('/', start);
    if (slash == std::string_view::npos) slash = path.size();
    if (slash > start) parts.push_back(path.substr(start, slash - start));
    start = slash + 1;
  }
  return parts;
}

}  // namespace

Namespace::Namespace(Bucket* bucket, NamespaceOptions options)
    : bucket_(bucket), options_(options), start_ms_(NowMs()) {
  MutexLock lock(mu_);
  Node& root = NewNodeLocked(Kind::kDir, kRootIno, "");
  root.mtime_ms = start_ms_;
}

Namespace::~Namespace() = default;

int64_t Namespace::NowMs() const {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// ---- node table ---------------------------------------------------------------------------

Namespace::Node* Namespace::NodeLocked(uint64_t ino) const {
  if (ino == 0 || ino > nodes_.size()) return nullptr;
  return nodes_[ino - 1].get();
}

Namespace::Node& Namespace::NewNodeLocked(Kind kind, uint64_t parent, std::string name) {
  nodes_.push_back(std::make_unique<Node>());
  Node& n = *nodes_.back();
  n.ino = nodes_.size();
  n.kind = kind;
  n.parent = parent;
  n.name = std::move(name);
  return n;
}

void Namespace::AddChildLocked(Node& dir, const std::string& name, uint64_t child) {
  RemoveChildLocked(dir, name);
  dir.children.emplace(name, child);
  if (IsDir(NodeLocked(child)->kind)) dir.subdirs++;
  if (dir.kind == Kind::kDir) dir.mtime_ms = NowMs();
}

void Namespace::RemoveChildLocked(Node& dir, const std::string& name) {
  auto it = dir.children.find(name);
  if (it == dir.children.end()) return;
  if (IsDir(NodeLocked(it->second)->kind)) dir.subdirs--;
  dir.children.erase(it);
  if (dir.kind == Kind::kDir) dir.mtime_ms = NowMs();
}

void Namespace::Invalidate() {
  MutexLock lock(mu_);
  invalidated_ = true;
}

void Namespace::AddPublished(std::shared_ptr<const Manifest> manifest) {
  if (!ModelUnder(manifest->model, options_.prefix)) return;
  MutexLock lock(mu_);
  AddFoundLocked(manifest->model, manifest->version, std::nullopt);
  Model& m = models_[manifest->model];
  m.generation++;  // the newest may have changed even if the name was known
  UpdateLatestLinkLocked(manifest->model, m);
  Node& v = *NodeLocked(m.versions[manifest->version]);
  if (!v.summary) v.summary = Summarize(*manifest);
  invalidated_ = true;  // versions published elsewhere meanwhile come with the next listing
}

void Namespace::AddFoundLocked(const std::string& model, const std::string& version,
                               std::optional<int64_t> created_ms) {
  const size_t known = models_[model].versions.size();
  AddVersionLocked(model, version, created_ms);
  Model& m = models_[model];
  if (m.versions.size() != known) UpdateLatestLinkLocked(model, m);
  published_[model + "@" + version] = ++publish_seq_;
  absent_.erase(model + "@" + version);
}

bool Namespace::TakeProbeTokenLocked() {
  if (options_.probe_rate <= 0) return false;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - tokens_at_).count();
  tokens_at_ = now;
  probe_tokens_ = std::min(std::max(options_.probe_rate, 1.0), probe_tokens_ + elapsed * options_.probe_rate);
  if (probe_tokens_ < 1) return false;
  probe_tokens_ -= 1;
  return true;
}

Expected<bool> Namespace::Probe(uint64_t dir, std::string_view name) {
  const size_t at = name.find('@');
  if (at == std::string_view::npos || at == 0 || at + 1 == name.size()) return false;
  const std::string leaf(name.substr(0, at)), version(name.substr(at + 1));
  if (version == "latest" || leaf.find('/') != std::string::npos) return false;
  std::string model;
  {
    MutexLock lock(mu_);
    const Node* d = NodeLocked(dir);
    if (!d || d->kind != Kind::kDir) return false;
    model = d->model.empty() ? leaf : d->model + "/" + leaf;
    if (!ModelUnder(model, options_.prefix)) return false;  // not shown by this mount (--prefix)
    const std::string key = model + "@" + version;
    const auto now = std::chrono::steady_clock::now();
    if (auto it = absent_.find(key); it != absent_.end() && now - it->second < options_.probe_negative_ttl) return false;
    if (!TakeProbeTokenLocked()) return false;  // over the rate: the listing will tell
  }
  Expected<std::shared_ptr<const Manifest>> m = bucket_->ReadManifest(model, version);
  MutexLock lock(mu_);
  if (!m.ok()) {
    if (m.status().kind() != ErrorKind::kNotFound && m.status().kind() != ErrorKind::kInvalidArgument) {
      return m.status().WithContext("checking for " + model + "@" + version);
    }
    if (absent_.size() >= kMaxAbsent) absent_.erase(absent_.begin());
    absent_[model + "@" + version] = std::chrono::steady_clock::now();
    return false;
  }
  AddFoundLocked(model, version, (*m)->created_ms);
  Node& v = *NodeLocked(models_[model].versions[version]);
  if (!v.summary) v.summary = Summarize(**m);
  return true;
}

Expected<std::string> Namespace::NewestVersion(uint64_t link_ino) {
  std::string model;
  bool relist = false;
  {
    MutexLock lock(mu_);
    const Node* n = NodeLocked(link_ino);
    if (!n || (n->kind != Kind::kLatestLink && n->kind != Kind::kVersionDir)) {
      return Status::InvalidArgument("not a version directory");
    }
    model = n->model;
    auto it = model_listed_.find(model);
    const auto now = std::chrono::steady_clock::now();
    const auto min_gap = std::chrono::duration<double>(options_.probe_rate > 0 ? 1.0 / options_.probe_rate : 1e9);
    relist = it == model_listed_.end() || now - it->second.first >= min_gap;
    if (!relist && !it->second.second.empty()) return it->second.second;
    if (relist) model_listed_[model].first = now;  // one re-listing at a time per interval
  }
  if (relist) {
    WFS_ASSIGN_OR_RETURN(std::vector<VersionTime> times, bucket_->VersionTimes(model));
    MutexLock lock(mu_);
    for (const VersionTime& t : times) AddFoundLocked(model, t.version, t.created_ms);
    if (!times.empty()) model_listed_[model].second = times.back().version;  // sorted by (time, name)
  }
  WFS_ASSIGN_OR_RETURN(std::string target, EnsureLatest(model));
  const size_t at = target.rfind('@');
  return at == std::string::npos ? target : target.substr(at + 1);
}

std::optional<std::string> Namespace::DirPath(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  if (!n || n->kind != Kind::kDir) return std::nullopt;
  return n->model;
}

bool Namespace::IsDirectory(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  return n && IsDir(n->kind);
}

std::optional<std::pair<std::string, std::string>> Namespace::VersionOf(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  if (!n || n->kind != Kind::kVersionDir) return std::nullopt;
  return std::make_pair(n->model, n->version);
}

bool Namespace::IsImmutable(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  return n && (n->kind == Kind::kVersionDir || n->kind == Kind::kVersionSubdir || n->kind == Kind::kFile);
}

size_t Namespace::inode_count() const {
  MutexLock lock(mu_);
  return nodes_.size();
}

// ---- listing ------------------------------------------------------------------------------

uint64_t Namespace::DirForModelLocked(const std::string& model, std::string* leaf) {
  std::vector<std::string_view> parts = SplitPath(model);
  uint64_t dir = kRootIno;
  std::string path;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    path += (path.empty() ? "" : "/") + std::string(parts[i]);
    Node* d = NodeLocked(dir);
    auto it = d->children.find(parts[i]);
    if (it != d->children.end()) {
      dir = it->second;  // names without '@' above versions are always directories
      continue;
    }
    Node& sub = NewNodeLocked(Kind::kDir, dir, std::string(parts[i]));
    sub.model = path;
    sub.mtime_ms = NowMs();
    AddChildLocked(*NodeLocked(dir), sub.name, sub.ino);
    dir = sub.ino;
  }
  *leaf = parts.empty() ? model : std::string(parts.back());
  return dir;
}

void Namespace::ApplyListingLocked(const std::vector<VersionInfo>& versions, uint64_t listing_seq) {
  std::map<std::string, std::map<std::string, std::optional<int64_t>>> listed;
  for (const VersionInfo& v : versions) {
    if (ModelUnder(v.model, options_.prefix)) listed[v.model][v.version] = v.created_ms;
  }

  // Versions that are gone (retired by gc): their entries go, their inodes stay.
  for (auto& [name, m] : models_) {
    auto now_listed = listed.find(name);
    for (auto it = m.versions.begin(); it != m.versions.end();) {
      const bool listed_here = now_listed != listed.end() && now_listed->second.count(it->first);
      // A version this mount published after the listing began is not in it, yet it exists.
      auto pinned = published_.find(name + "@" + it->first);
      const bool newer = pinned != published_.end() && pinned->second > listing_seq;
      if (!listed_here && !newer) {
        Node& dir = *NodeLocked(m.dir);
        auto entry = dir.children.find(m.leaf + "@" + it->first);
        if (entry != dir.children.end() && entry->second == it->second) {
          RemoveChildLocked(dir, entry->first);
        }
        it = m.versions.erase(it);
        m.generation++;
      } else {
        ++it;
      }
    }
  }
  // New versions.
  for (const auto& [name, vs] : listed) {
    for (const auto& [version, created] : vs) AddVersionLocked(name, version, created);
  }
  for (auto& [name, m] : models_) UpdateLatestLinkLocked(name, m);
}

uint64_t Namespace::AddVersionLocked(const std::string& model, const std::string& version,
                                     std::optional<int64_t> created_ms) {
  Model& m = models_[model];
  if (m.dir == 0) m.dir = DirForModelLocked(model, &m.leaf);
  if (auto it = m.versions.find(version); it != m.versions.end()) {
    Node& v = *NodeLocked(it->second);
    if (created_ms && !v.listed_created_ms) v.listed_created_ms = created_ms;
    return it->second;
  }
  Node& v = NewNodeLocked(Kind::kVersionDir, m.dir, m.leaf + "@" + version);
  v.model = model;
  v.version = version;
  v.listed_created_ms = created_ms;
  AddChildLocked(*NodeLocked(m.dir), v.name, v.ino);
  m.versions.emplace(version, v.ino);
  m.generation++;
  return v.ino;
}

void Namespace::UpdateLatestLinkLocked(const std::string& name, Model& m) {
  // name@latest, unless a version is itself called "latest" (then that directory wins).
  Node& dir = *NodeLocked(m.dir);
  const std::string link_name = m.leaf + "@latest";
  const bool want = !m.versions.empty() && !m.versions.count("latest");
  auto entry = dir.children.find(link_name);
  const bool present = entry != dir.children.end() && m.link != 0 && entry->second == m.link;
  if (want && !present) {
    if (m.link == 0) {
      Node& l = NewNodeLocked(Kind::kLatestLink, m.dir, link_name);
      l.model = name;
      m.link = l.ino;
    }
    AddChildLocked(dir, link_name, m.link);
  } else if (!want && present) {
    RemoveChildLocked(dir, link_name);
  }
}

Status Namespace::RefreshIfStale() {
  MutexLock lock(mu_);
  if (listed_ && !invalidated_ && std::chrono::steady_clock::now() - listed_at_ < options_.refresh) {
    return Status::Ok();
  }
  if (refreshing_) {
    if (listed_) return Status::Ok();  // serve the previous listing meanwhile
    refreshed_.Wait(mu_, [this]() WFS_REQUIRES(mu_) { return !refreshing_; });
    return listed_ ? Status::Ok() : last_refresh_;
  }
  refreshing_ = true;
  invalidated_ = false;
  const uint64_t listing_seq = publish_seq_;
  lock.Unlock();
  // Whatever happens below (exceptions included), the next refresh must be possible.
  struct Done {
    Namespace* ns;
    ~Done() {
      MutexLock l(ns->mu_);
      ns->refreshing_ = false;
      ns->refreshed_.NotifyAll();
    }
  };
  Expected<std::vector<VersionInfo>> versions = Status::IOError("not listed");
  {
    Done done{this};
    versions = bucket_->ListVersions(options_.prefix, /*with_sub_models=*/true);
    MutexLock l(mu_);
    listed_at_ = std::chrono::steady_clock::now();
    if (versions.ok()) {
      ApplyListingLocked(*versions, listing_seq);
      listed_ = true;
      last_refresh_ = Status::Ok();
    } else {
      last_refresh_ = versions.status().WithContext("listing the versions of " + bucket_->Describe());
    }
  }
  if (versions.ok()) return Status::Ok();
  MutexLock l(mu_);
  if (listed_) {
    spdlog::warn("{}; showing the previous listing", last_refresh_.ToString());
    return Status::Ok();
  }
  return last_refresh_;
}

// ---- manifests ----------------------------------------------------------------------------

Namespace::VersionSummary Namespace::Summarize(const Manifest& m) {
  VersionSummary s;
  s.created_ms = m.created_ms;
  s.parent = m.parent;
  s.stored_bytes = m.stats.stored_bytes;
  s.changed_fraction = m.stats.changed_fraction();
  std::set<std::string_view> top;
  for (const ManifestFile& f : m.files) {
    size_t slash = f.path.find('/');
    if (slash != std::string::npos) top.insert(std::string_view(f.path).substr(0, slash));
  }
  s.top_subdirs = static_cast<uint32_t>(top.size());
  return s;
}

Status Namespace::EnsureSummaries(std::span<const uint64_t> inos) {
  struct Todo {
    uint64_t ino;
    std::string model, version;
    std::shared_ptr<const Manifest> manifest;
    Status status;
  };
  std::vector<Todo> todo;
  {
    MutexLock lock(mu_);
    for (uint64_t ino : inos) {
      Node* n = NodeLocked(ino);
      if (n && n->kind == Kind::kVersionDir && !n->summary) todo.push_back({ino, n->model, n->version, nullptr, {}});
    }
  }
  if (todo.empty()) return Status::Ok();
  RequestsInParallel(todo.size(), kManifestReaders, [&](size_t i) {
    Todo& t = todo[i];
    try {
      Expected<std::shared_ptr<const Manifest>> m = bucket_->ReadManifest(t.model, t.version);
      if (m.ok()) {
        t.manifest = *m;
      } else {
        t.status = m.status();
      }
    } catch (...) {  // fn must not throw: an allocation failing fails this version only
      t.status = StatusOfCurrentException("reading its manifest");
      try {
        t.status = t.status.WithContext(t.model + "@" + t.version);
      } catch (...) {
      }
    }
  });
  Status first;
  MutexLock lock(mu_);
  for (Todo& t : todo) {
    if (!t.status.ok()) {
      if (first.ok()) first = t.status;
      continue;
    }
    Node* n = NodeLocked(t.ino);
    if (!n->summary) n->summary = Summarize(*t.manifest);
  }
  return first;
}

Status Namespace::EnsureContents(uint64_t version_ino) {
  std::string model, version;
  {
    MutexLock lock(mu_);
    Node* n = NodeLocked(version_ino);
    if (!n || n->kind != Kind::kVersionDir) return Status::InvalidArgument("not a version directory");
    if (n->contents_built) return Status::Ok();
    model = n->model;
    version = n->version;
  }
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> manifest, bucket_->ReadManifest(model, version));
  MutexLock lock(mu_);
  Node* n = NodeLocked(version_ino);
  if (!n->summary) n->summary = Summarize(*manifest);
  if (!n->contents_built) BuildContentsLocked(*n, std::move(manifest));
  return Status::Ok();
}

void Namespace::BuildContentsLocked(Node& version, std::shared_ptr<const Manifest> manifest) {
  const uint64_t version_ino = version.ino;
  for (const ManifestFile& f : manifest->files) {
    std::vector<std::string_view> parts = SplitPath(f.path);
    if (parts.empty()) continue;
    uint64_t dir = version_ino;
    bool ok = true;
    for (size_t i = 0; i + 1 < parts.size() && ok; ++i) {
      Node* d = NodeLocked(dir);
      auto it = d->children.find(parts[i]);
      if (it == d->children.end()) {
        Node& sub = NewNodeLocked(Kind::kVersionSubdir, dir, std::string(parts[i]));
        sub.manifest = manifest;
        sub.version_ino = version_ino;
        AddChildLocked(*NodeLocked(dir), sub.name, sub.ino);
        dir = sub.ino;
      } else if (NodeLocked(it->second)->kind == Kind::kVersionSubdir) {
        dir = it->second;
      } else {
        ok = false;
      }
    }
    Node* d = NodeLocked(dir);
    if (!ok || d->children.count(parts.back())) {
      spdlog::warn("{}@{}: '{}' clashes with another path of the version; not shown",
                   manifest->model, manifest->version, f.path);
      continue;
    }
    Node& file = NewNodeLocked(Kind::kFile, dir, std::string(parts.back()));
    file.manifest = manifest;
    file.file = &f;
    file.version_ino = version_ino;
    AddChildLocked(*NodeLocked(dir), file.name, file.ino);
  }
  // Set last: the files hold the manifest too, so the version's summary is all that is needed
  // once nobody looks inside anymore.
  version.manifest = std::move(manifest);
  version.contents_built = true;
}

Expected<std::string> Namespace::EnsureLatest(const std::string& model) {
  std::vector<uint64_t> inos;
  uint64_t generation = 0;
  {
    MutexLock lock(mu_);
    auto it = models_.find(model);
    if (it == models_.end()) return Status::NotFound("model " + model + " has no versions");
    Model& m = it->second;
    if (m.latest_generation == m.generation) return m.latest;
    generation = m.generation;
    // Only versions whose time the listing did not give (no time marker) need their heads.
    for (const auto& [v, ino] : m.versions) {
      if (!CreatedMs(*NodeLocked(ino))) inos.push_back(ino);
    }
  }
  Status s = EnsureSummaries(inos);
  if (!s.ok()) spdlog::warn("{}@latest ignores versions whose manifest cannot be read: {}", model, s.ToString());
  MutexLock lock(mu_);
  Model& m = models_[model];
  const Node* best = nullptr;
  for (const auto& [v, ino] : m.versions) {
    const Node* n = NodeLocked(ino);
    if (!CreatedMs(*n)) continue;
    if (!best || std::make_pair(*CreatedMs(*n), n->version) > std::make_pair(*CreatedMs(*best), best->version)) {
      best = n;
    }
  }
  if (!best) return s.ok() ? Status::NotFound("model " + model + " has no versions") : s;
  std::string target = best->name;
  if (m.generation == generation) {
    m.latest = target;
    m.latest_generation = generation;
  }
  return target;
}

Status Namespace::EnsureAttrInputs(uint64_t ino) {
  std::string link_model;
  {
    MutexLock lock(mu_);
    Node* n = NodeLocked(ino);
    if (!n) return Status::NotFound("no inode " + std::to_string(ino));
    if (n->kind == Kind::kLatestLink) {
      link_model = n->model;
    } else if (n->kind != Kind::kVersionDir || CreatedMs(*n)) {
      return Status::Ok();
    }
  }
  if (!link_model.empty()) return EnsureLatest(link_model).status();
  const uint64_t one[] = {ino};
  return EnsureSummaries(one);
}

// ---- attributes ---------------------------------------------------------------------------

Status Namespace::FillAttrLocked(const Node& node, NodeAttr* out) const {
  struct stat& st = out->st;
  st = {};
  out->ino = node.ino;
  st.st_ino = node.ino;
  st.st_uid = options_.uid;
  st.st_gid = options_.gid;
  int64_t time_ms = start_ms_;
  out->timeout_s = options_.immutable_timeout_s;
  switch (node.kind) {
    case Kind::kDir:
      st.st_mode = S_IFDIR | options_.dir_mode | (options_.writable_dirs ? S_IWUSR : 0);
      st.st_nlink = 2 + node.subdirs;
      st.st_size = 4096;
      time_ms = node.mtime_ms;
      out->timeout_s = std::chrono::duration<double>(options_.refresh).count();
      break;
    case Kind::kVersionDir:
      if (!CreatedMs(node)) return Status::IOError(node.name + ": attributes not loaded");
      st.st_mode = S_IFDIR | options_.dir_mode;
      // Without the summary the number of subdirectories is unknown: 1 says so (find and
      // friends then do not rely on it, as on btrfs).
      st.st_nlink = node.contents_built ? 2 + node.subdirs : node.summary ? 2 + node.summary->top_subdirs : 1;
      st.st_size = 4096;
      time_ms = *CreatedMs(node);
      break;
    case Kind::kVersionSubdir:
      st.st_mode = S_IFDIR | options_.dir_mode;
      st.st_nlink = 2 + node.subdirs;
      st.st_size = 4096;
      time_ms = node.manifest->created_ms;
      break;
    case Kind::kFile:
      st.st_mode = S_IFREG | options_.file_mode;
      st.st_nlink = 1;
      st.st_size = static_cast<off_t>(node.file->size);
      st.st_blocks = static_cast<blkcnt_t>((node.file->size + 511) / 512);
      st.st_blksize = kFileBlockSize;
      time_ms = node.manifest->created_ms;
      break;
    case Kind::kLatestLink: {
      st.st_mode = S_IFLNK | 0777;
      st.st_nlink = 1;
      auto m = models_.find(node.model);
      if (m != models_.end() && m->second.latest.size() > m->second.leaf.size()) {
        const Model& model = m->second;
        st.st_size = static_cast<off_t>(model.latest.size());
        auto v = model.versions.find(model.latest.substr(model.leaf.size() + 1));
        if (v != model.versions.end()) {
          const Node* target = NodeLocked(v->second);
          if (CreatedMs(*target)) time_ms = *CreatedMs(*target);
        }
      }
      out->timeout_s = std::chrono::duration<double>(options_.refresh).count();
      break;
    }
  }
  st.st_atim = st.st_mtim = st.st_ctim = TimespecOfMs(time_ms);
  return Status::Ok();
}

Expected<NodeAttr> Namespace::GetAttr(uint64_t ino) {
  bool above_versions = false;
  {
    MutexLock lock(mu_);
    const Node* n = NodeLocked(ino);
    above_versions = n && n->kind == Kind::kDir;
  }
  // A directory's link count and mtime follow its entries. It exists whether or not the
  // listing works, so a failed listing does not fail its getattr.
  if (above_versions) (void)RefreshIfStale();
  WFS_TRY(EnsureAttrInputs(ino));
  MutexLock lock(mu_);
  NodeAttr out;
  WFS_TRY(FillAttrLocked(*NodeLocked(ino), &out));
  return out;
}

std::vector<NodeAttr> Namespace::GetAttrs(std::span<const uint64_t> inos) {
  std::set<std::string> link_models;
  {
    MutexLock lock(mu_);
    for (uint64_t ino : inos) {
      const Node* n = NodeLocked(ino);
      if (n && n->kind == Kind::kLatestLink) link_models.insert(n->model);
    }
  }
  std::vector<uint64_t> unknown;  // version directories the listing gave no time for
  {
    MutexLock lock(mu_);
    for (uint64_t ino : inos) {
      const Node* n = NodeLocked(ino);
      if (n && n->kind == Kind::kVersionDir && !CreatedMs(*n)) unknown.push_back(ino);
    }
  }
  Status s = EnsureSummaries(unknown);
  if (!s.ok()) spdlog::warn("listing: {}", s.ToString());
  for (const std::string& model : link_models) (void)EnsureLatest(model);
  std::vector<NodeAttr> out;
  MutexLock lock(mu_);
  for (uint64_t ino : inos) {
    const Node* n = NodeLocked(ino);
    NodeAttr a;
    if (n && FillAttrLocked(*n, &a).ok()) out.push_back(a);
  }
  return out;
}

Expected<NodeAttr> Namespace::Lookup(uint64_t parent, std::string_view name) {
  Kind kind;
  {
    MutexLock lock(mu_);
    const Node* p = NodeLocked(parent);
    if (!p) return Status::NotFound("no inode " + std::to_string(parent));
    kind = p->kind;
  }
  if (!IsDir(kind)) return Status::NotFound("not a directory");
  if (kind == Kind::kDir) WFS_TRY(RefreshIfStale());
  if (kind == Kind::kVersionDir) WFS_TRY(EnsureContents(parent));
  uint64_t child = 0;
  for (bool probed = false;; probed = true) {
    {
      MutexLock lock(mu_);
      const Node* p = NodeLocked(parent);
      auto it = p->children.find(name);
      if (it != p->children.end()) {
        child = it->second;
        break;
      }
      if (probed || kind != Kind::kDir) {
        return Status::NotFound("no entry '" + std::string(name) + "' in " + (p->name.empty() ? "/" : p->name));
      }
    }
    WFS_ASSIGN_OR_RETURN(bool found, Probe(parent, name));
    (void)found;  // found: the next pass finds its entry; not: it answers NotFound
  }
  return GetAttr(child);
}

Expected<std::vector<DirEntry>> Namespace::ReadDir(uint64_t ino) {
  Kind kind;
  {
    MutexLock lock(mu_);
    const Node* n = NodeLocked(ino);
    if (!n) return Status::NotFound("no inode " + std::to_string(ino));
    kind = n->kind;
  }
  if (!IsDir(kind)) return Status::InvalidArgument("not a directory");
  if (kind == Kind::kDir) WFS_TRY(RefreshIfStale());
  if (kind == Kind::kVersionDir) WFS_TRY(EnsureContents(ino));
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  std::vector<DirEntry> out;
  out.reserve(n->children.size() + 2);
  out.push_back({".", ino, S_IFDIR});
  out.push_back({"..", n->parent, S_IFDIR});
  for (const auto& [name, child] : n->children) {
    Kind k = NodeLocked(child)->kind;
    mode_t type = k == Kind::kFile ? S_IFREG : k == Kind::kLatestLink ? S_IFLNK : S_IFDIR;
    out.push_back({name, child, type});
  }
  return out;
}

Expected<std::string> Namespace::ReadLink(uint64_t ino) {
  std::string model;
  {
    MutexLock lock(mu_);
    const Node* n = NodeLocked(ino);
    if (!n || n->kind != Kind::kLatestLink) return Status::InvalidArgument("not a symbolic link");
    model = n->model;
  }
  return EnsureLatest(model);
}

Expected<VersionFile> Namespace::Open(uint64_t ino) {
  std::shared_ptr<const Manifest> manifest;
  const ManifestFile* head_file;
  {
    MutexLock lock(mu_);
    const Node* n = NodeLocked(ino);
    if (!n) return Status::NotFound("no inode " + std::to_string(ino));
    if (n->kind != Kind::kFile) return Status::InvalidArgument(n->name + " is not a regular file");
    manifest = n->manifest;
    head_file = n->file;
  }
  // The file's rows: its section of the version's table (format 2), read once per open at most;
  // of a section in blocks, the first block (reads load the others: ChunkReader::Read).
  auto rows_of = [&](const ManifestFile& f) {
    return f.section.index_length ? bucket_->RowsAt(*manifest, f, 0) : bucket_->File(manifest, f);
  };
  Expected<std::shared_ptr<const ManifestFile>> rows = rows_of(*head_file);
  if (!rows.ok() && (rows.status().kind() == ErrorKind::kCorruption || rows.status().kind() == ErrorKind::kNotFound)) {
    // Its old table gone: the head may have been rewritten (gc's rebase) since it was read.
    Expected<std::shared_ptr<const Manifest>> now = TakeRewrittenHead(*manifest);
    if (!now.ok()) return rows.status();
    const ManifestFile* f = (*now)->FindFile(head_file->path);
    if (!f) return rows.status();
    manifest = *now;
    rows = rows_of(*f);
  }
  if (!rows.ok()) return rows.status();
  return VersionFile{manifest, rows->get(), *rows};
}

Expected<std::shared_ptr<const Manifest>> Namespace::TakeRewrittenHead(const Manifest& old) {
  const std::string versions[] = {old.version};
  WFS_TRY(bucket_->Revalidate(old.model, versions, std::chrono::steady_clock::now()).status());
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> now, bucket_->ReadManifest(old.model, old.version));
  if (Bucket::SameHead(*now, old)) return Status::NotFound("not rewritten");
  // A rewrite keeps the files and their bytes; anything else is not one (shown as it was).
  bool same_files = now->files.size() == old.files.size();
  for (size_t i = 0; same_files && i < old.files.size(); ++i) {
    same_files = now->files[i].path == old.files[i].path && now->files[i].size == old.files[i].size &&
                 now->files[i].sha256 == old.files[i].sha256;
  }
  if (!same_files) {
    spdlog::warn("{}@{} was replaced in the bucket with other files; remount to see them", old.model, old.version);
    return Status::NotFound("replaced");
  }
  MutexLock lock(mu_);
  for (const std::unique_ptr<Node>& n : nodes_) {
    if (!n || n->manifest.get() != &old) continue;
    if (n->file) n->file = &now->files[static_cast<size_t>(n->file - old.files.data())];
    n->manifest = now;
  }
  spdlog::info("{}@{} was rewritten in the bucket (gc's rebase): its files now read with the new head", old.model,
               old.version);
  return now;
}

// ---- extended attributes ------------------------------------------------------------------

Expected<std::vector<std::string>> Namespace::ListXattr(uint64_t ino) {
  WFS_TRY(EnsureAttrInputs(ino));
  {
    const uint64_t one[] = {ino};
    WFS_TRY(EnsureSummaries(one));  // (a version's xattrs are its summary's)
  }
  std::vector<std::string> names;
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  if (n->kind == Kind::kVersionDir) {
    if (n->summary && n->summary->parent) names.push_back(kXattrParent);
    names.push_back(kXattrStoredBytes);
    names.push_back(kXattrChangedFraction);
  } else if (n->kind == Kind::kFile) {
    if (n->manifest->parent) names.push_back(kXattrParent);
    names.push_back(kXattrSha256);
    names.push_back(kXattrStoredBytes);
  }
  return names;
}

Expected<std::string> Namespace::GetXattr(uint64_t ino, std::string_view name) {
  WFS_TRY(EnsureAttrInputs(ino));
  {
    const uint64_t one[] = {ino};
    WFS_TRY(EnsureSummaries(one));  // (a version's xattrs are its summary's)
  }
  if (name == kXattrStoredBytes) {
    std::shared_ptr<const Manifest> manifest;
    const ManifestFile* head_file = nullptr;
    {
      MutexLock lock(mu_);
      const Node* n = NodeLocked(ino);
      if (n->kind == Kind::kFile) {
        manifest = n->manifest;
        head_file = n->file;
      }
    }
    if (head_file) {
      // Payload bytes this version wrote for the file (chunks it inherited cost nothing).
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const ManifestFile> rows, bucket_->File(manifest, *head_file));
      uint64_t stored = 0;
      for (const ManifestChunk& c : rows->chunks) {
        if (c.origin == 0 && !c.is_external()) stored += c.ref.length;
      }
      return std::to_string(stored);
    }
  }
  MutexLock lock(mu_);
  const Node* n = NodeLocked(ino);
  if (n->kind == Kind::kVersionDir && n->summary) {
    const VersionSummary& s = *n->summary;
    if (name == kXattrParent && s.parent) return n->model + "@" + *s.parent;
    if (name == kXattrStoredBytes) return std::to_string(s.stored_bytes);
    if (name == kXattrChangedFraction) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.6f", s.changed_fraction);
      return std::string(buf);
    }
  } else if (n->kind == Kind::kFile) {
    const Manifest& m = *n->manifest;
    if (name == kXattrParent && m.parent) return m.model + "@" + *m.parent;
    if (name == kXattrSha256 && !n->file->sha256.empty()) return n->file->sha256;
  }
  return Status::NotFound("no attribute " + std::string(name));
}

}  // namespace weightfs
