#include "fs/patch_view.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>

#include <spdlog/spdlog.h>

#include "core/hash.h"
#include "core/safetensors.h"
#include "hub/engine/weight_patcher.h"

namespace weightfs {
namespace {

constexpr const char* kSuffix = ".safetensors";

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Walks a model's parents from a version; ancestors exist only as far as the manifests do.
constexpr size_t kMaxWalk = 1u << 20;

std::atomic<uint64_t> g_tmp_counter{0};

}  // namespace

PatchView::PatchView(Bucket* bucket, Materializer* materializer, ChunkCache* cache, PatchViewOptions options)
    : bucket_(bucket), materializer_(materializer), cache_(cache), options_(std::move(options)),
      pool_(std::make_unique<ThreadPool>(2)) {
  std::error_code ec;
  std::filesystem::create_directories(options_.dir, ec);
  if (ec) spdlog::warn("patch view: cannot make {}: {}", options_.dir, ec.message());
  // Temporaries of generations killed midway (an hour old: not another mount's in progress).
  const auto old = std::filesystem::file_time_type::clock::now() - std::chrono::hours(1);
  for (const auto& e : std::filesystem::directory_iterator(options_.dir, ec)) {
    std::error_code e2;
    if (e.path().filename().string().find(".tmp.") != std::string::npos && e.last_write_time(e2) < old && !e2) {
      std::filesystem::remove(e.path(), e2);
    }
  }
}

PatchView::~PatchView() = default;

PatchView::Stats PatchView::stats() const {
  MutexLock lock(mu_);
  return stats_;
}

const PatchView::Node* PatchView::NodeOf(uint64_t ino) const {
  if (!Owns(ino) || ino - kFirstIno >= nodes_.size()) return nullptr;
  return &nodes_[ino - kFirstIno];
}

std::optional<PatchView::Node> PatchView::CopyOf(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeOf(ino);
  return n ? std::optional<Node>(*n) : std::nullopt;
}

bool PatchView::IsFile(uint64_t ino) const {
  MutexLock lock(mu_);
  const Node* n = NodeOf(ino);
  return n && n->kind == Kind::kFile;
}

uint64_t PatchView::NodeFor(Kind kind, uint64_t parent, const std::string& model, const std::string& to,
                            const std::string& from, const std::string& path, int64_t mtime_ms) {
  std::string key = std::to_string(static_cast<int>(kind)) + '\0' + std::to_string(parent) + '\0' + model + '\0' +
                    to + '\0' + from + '\0' + path;
  MutexLock lock(mu_);
  auto it = by_key_.find(key);
  if (it != by_key_.end()) return it->second;
  Node n;
  n.ino = kFirstIno + nodes_.size();
  n.kind = kind;
  n.parent = parent;
  n.model = model;
  n.to = to;
  n.from = from;
  n.path = path;
  n.mtime_ms = mtime_ms;
  nodes_.push_back(std::move(n));
  by_key_.emplace(std::move(key), nodes_.back().ino);
  return nodes_.back().ino;
}

void PatchView::Fill(const Node& n, uint64_t size, NodeAttr* out) const {
  struct stat& st = out->st;
  st = {};
  out->ino = n.ino;
  out->timeout_s = options_.timeout_s;
  st.st_ino = n.ino;
  st.st_uid = options_.uid;
  st.st_gid = options_.gid;
  if (n.kind == Kind::kFile) {
    st.st_mode = S_IFREG | options_.file_mode;
    st.st_nlink = 1;
    st.st_size = static_cast<off_t>(size);
    st.st_blocks = static_cast<blkcnt_t>((size + 511) / 512);
    st.st_blksize = 1 << 20;
  } else {
    st.st_mode = S_IFDIR | options_.dir_mode;
    st.st_nlink = 2;
    st.st_size = 4096;
  }
  st.st_mtim.tv_sec = n.mtime_ms / 1000;
  st.st_mtim.tv_nsec = (n.mtime_ms % 1000) * 1000000;
  st.st_atim = st.st_ctim = st.st_mtim;
}

Status PatchView::Manifest(const std::string& model, const std::string& version,
                        std::shared_ptr<const weightfs::Manifest>* out) {
  Expected<std::shared_ptr<const weightfs::Manifest>> m = bucket_->ReadManifest(model, version);
  if (!m.ok()) return m.status().WithContext("patch view: manifest " + model + "@" + version);
  *out = std::move(m).value();
  return Status::Ok();
}

Status PatchView::Ancestors(const Node& root, std::vector<std::string>* listed) {
  {
    MutexLock lock(mu_);
    auto it = ancestors_.find(root.ino);
    if (it != ancestors_.end()) {
      *listed = it->second;
      return Status::Ok();
    }
  }
  std::vector<std::string> names;
  std::shared_ptr<const weightfs::Manifest> m;
  WFS_TRY(Manifest(root.model, root.to, &m));
  std::set<std::string> seen{root.to};
  while (m->parent && names.size() < options_.list_ancestors && seen.insert(*m->parent).second) {
    names.push_back(*m->parent);
    std::shared_ptr<const weightfs::Manifest> p;
    if (!Manifest(root.model, *m->parent, &p).ok()) break;  // the chain ends where manifests do
    m = std::move(p);
  }
  MutexLock lock(mu_);
  ancestors_[root.ino] = names;
  *listed = std::move(names);
  return Status::Ok();
}

Status PatchView::IsAncestor(const Node& root, const std::string& from, bool* yes) {
  *yes = false;
  std::vector<std::string> near;
  WFS_TRY(Ancestors(root, &near));
  if (std::find(near.begin(), near.end(), from) != near.end()) {
    *yes = true;
    return Status::Ok();
  }
  if (near.size() < options_.list_ancestors) return Status::Ok();  // the whole chain is listed
  // Beyond the listed ones: walk on from the last.
  std::set<std::string> seen(near.begin(), near.end());
  std::shared_ptr<const weightfs::Manifest> m;
  WFS_TRY(Manifest(root.model, near.back(), &m));
  for (size_t i = 0; i < kMaxWalk && m->parent && seen.insert(*m->parent).second; ++i) {
    if (*m->parent == from) {
      *yes = true;
      return Status::Ok();
    }
    std::shared_ptr<const weightfs::Manifest> p;
    if (!Manifest(root.model, *m->parent, &p).ok()) return Status::Ok();
    m = std::move(p);
  }
  return Status::Ok();
}

Status PatchView::LookupRoot(uint64_t version_ino, const std::string& model, const std::string& version,
                          NodeAttr* out) {
  std::shared_ptr<const weightfs::Manifest> m;
  WFS_TRY(Manifest(model, version, &m));
  uint64_t ino = NodeFor(Kind::kRoot, version_ino, model, version, "", "", m->created_ms);
  MutexLock lock(mu_);
  Fill(*NodeOf(ino), 0, out);
  return Status::Ok();
}

Status PatchView::Lookup(uint64_t parent, std::string_view name_view, NodeAttr* out) {
  const std::string name(name_view);
  const std::optional<Node> copy = CopyOf(parent);
  if (!copy) return Status::NotFound("no such patch view node");
  const Node& p = *copy;
  if (p.kind == Kind::kFile) return Status::NotDirectory(p.path + " is a patch file");
  if (name == "." || name == ".." || name.empty()) return Status::NotFound("no entry '" + name + "'");
  if (p.kind == Kind::kRoot) {
    bool yes = false;
    WFS_TRY(IsAncestor(p, name, &yes));
    if (!yes) return Status::NotFound(name + " is not an ancestor of " + p.model + "@" + p.to);
    uint64_t ino = NodeFor(Kind::kFrom, p.ino, p.model, p.to, name, "", p.mtime_ms);
    MutexLock lock(mu_);
    Fill(*NodeOf(ino), 0, out);
    return Status::Ok();
  }
  // kFrom / kDir: NEW's safetensors files under p.path.
  std::shared_ptr<const weightfs::Manifest> m;
  WFS_TRY(Manifest(p.model, p.to, &m));
  const std::string full = p.path.empty() ? name : p.path + "/" + name;
  bool is_dir = false, is_file = false;
  for (const ManifestFile& f : m->files) {
    if (!EndsWith(f.path, kSuffix)) continue;
    if (f.path == full) is_file = true;
    if (f.path.size() > full.size() + 1 && f.path.compare(0, full.size(), full) == 0 && f.path[full.size()] == '/') {
      is_dir = true;
    }
  }
  if (is_file) {
    uint64_t ino = NodeFor(Kind::kFile, p.ino, p.model, p.to, p.from, full, p.mtime_ms);
    const Node n = *CopyOf(ino);
    std::string file;
    uint64_t size = 0;
    WFS_TRY(Ensure(n, &file, &size));
    Fill(n, size, out);
    return Status::Ok();
  }
  if (is_dir) {
    uint64_t ino = NodeFor(Kind::kDir, p.ino, p.model, p.to, p.from, full, p.mtime_ms);
    MutexLock lock(mu_);
    Fill(*NodeOf(ino), 0, out);
    return Status::Ok();
  }
  return Status::NotFound(full + ": no such safetensors file or directory in " + p.model + "@" + p.to);
}

Status PatchView::GetAttr(uint64_t ino, NodeAttr* out) {
  const std::optional<Node> copy = CopyOf(ino);
  if (!copy) return Status::NotFound("no such patch view node");
  const Node& n = *copy;
  uint64_t size = 0;
  if (n.kind == Kind::kFile) {
    std::string file;
    WFS_TRY(Ensure(n, &file, &size));
  }
  Fill(n, size, out);
  return Status::Ok();
}

Status PatchView::ReadDir(uint64_t ino, std::vector<DirEntry>* out) {
  const std::optional<Node> copy = CopyOf(ino);
  if (!copy) return Status::NotFound("no such patch view node");
  const Node& p = *copy;
  if (p.kind == Kind::kFile) return Status::NotDirectory(p.path + " is a patch file");
  out->clear();
  out->push_back({".", p.ino, S_IFDIR});
  out->push_back({"..", p.parent, S_IFDIR});
  if (p.kind == Kind::kRoot) {
    std::vector<std::string> names;
    WFS_TRY(Ancestors(p, &names));
    std::sort(names.begin(), names.end());
    for (const std::string& a : names) {
      out->push_back({a, NodeFor(Kind::kFrom, p.ino, p.model, p.to, a, "", p.mtime_ms), S_IFDIR});
    }
    return Status::Ok();
  }
  std::shared_ptr<const weightfs::Manifest> m;
  WFS_TRY(Manifest(p.model, p.to, &m));
  const std::string prefix = p.path.empty() ? "" : p.path + "/";
  std::map<std::string, bool> entries;  // name -> is a directory
  for (const ManifestFile& f : m->files) {
    if (!EndsWith(f.path, kSuffix) || f.path.compare(0, prefix.size(), prefix) != 0) continue;
    std::string rest = f.path.substr(prefix.size());
    size_t slash = rest.find('/');
    if (slash == std::string::npos) {
      entries.emplace(rest, false);
    } else {
      entries[rest.substr(0, slash)] = true;
    }
  }
  for (const auto& [name, dir] : entries) {
    Kind k = dir ? Kind::kDir : Kind::kFile;
    out->push_back({name, NodeFor(k, p.ino, p.model, p.to, p.from, prefix + name, p.mtime_ms),
                    static_cast<mode_t>(dir ? S_IFDIR : S_IFREG)});
  }
  return Status::Ok();
}

Status PatchView::Open(uint64_t ino, int* fd) {
  const std::optional<Node> copy = CopyOf(ino);
  if (!copy) return Status::NotFound("no such patch view node");
  const Node& n = *copy;
  if (n.kind != Kind::kFile) return Status::IsDirectory(n.path + " is a directory");
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::string file;
    uint64_t size = 0;
    WFS_TRY(Ensure(n, &file, &size));
    *fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
    if (*fd >= 0) return Status::Ok();
    if (errno != ENOENT) break;  // evicted in between: once more
  }
  // (IOError even for ENOENT: the patch exists, it was evicted under us twice.)
  return Status::IOError("patch view: cannot open the patch of " + n.model + "@" + n.to + "/" + n.path + " from " +
                         n.from + ": " + std::strerror(errno));
}

bool PatchView::Valid(const Node& n, const std::string& file, uint64_t* size) const {
  int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st {};
  bool ok = false;
  if (::fstat(fd, &st) == 0 && st.st_size >= 8) {
    std::vector<uint8_t> prefix(8);
    if (::pread(fd, prefix.data(), 8, 0) == 8) {
      Expected<uint64_t> len = SafetensorsPrefixLength(prefix);
      if (len.ok() && *len <= static_cast<uint64_t>(st.st_size)) {
        prefix.resize(*len);
        if (::pread(fd, prefix.data(), *len, 0) == static_cast<ssize_t>(*len)) {
          Expected<SafetensorsHeader> h = ParseSafetensorsHeader(prefix, static_cast<uint64_t>(st.st_size));
          if (h.ok()) {
            auto is = [&](const char* k, const std::string& v) {
              auto it = h->metadata.find(k);
              return it != h->metadata.end() && it->second == v;
            };
            ok = is("sparse_weight_patch", kPatchFormatVersion) && is("model", n.model) && is("from", n.from) &&
                 is("to", n.to) && is("file", n.path);
          }
        }
      }
    }
  }
  ::close(fd);
  if (ok) *size = static_cast<uint64_t>(st.st_size);
  return ok;
}

Status PatchView::Ensure(const Node& n, std::string* file, uint64_t* size) {
  const std::string key = n.model + '\0' + n.from + '\0' + n.to + '\0' + n.path;
  *file = options_.dir + "/" +
          HashChunk(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(key.data()), key.size())).ToHex() +
          kSuffix;
  bool generated = false;
  for (;;) {
    if (Valid(n, *file, size)) {
      ::utimensat(AT_FDCWD, file->c_str(), nullptr, 0);  // recently used (LRU by mtime)
      if (!generated) {
        MutexLock lock(mu_);
        ++stats_.reused;
      }
      return Status::Ok();
    }
    if (generated) {
      return Status::IOError("patch view: the patch of " + n.model + "@" + n.to + "/" + n.path + " from " + n.from +
                             " just written to " + *file + " does not check");
    }
    std::shared_ptr<Flight> flight;
    bool mine = false;
    {
      MutexLock lock(mu_);
      auto it = flights_.find(*file);
      if (it != flights_.end()) {
        flight = it->second;
        flight_done_.Wait(mu_, [&]() WFS_REQUIRES(mu_) { return flight->done; });
        if (!flight->status.ok()) return flight->status;
        generated = true;  // someone else's: check it, but do not loop
        continue;
      }
      flight = std::make_shared<Flight>();
      flights_.emplace(*file, flight);
      mine = true;
    }
    (void)mine;
    Status st = Generate(n, *file);
    {
      MutexLock lock(mu_);
      flight->done = true;
      flight->status = st;
      flights_.erase(*file);
      if (st.ok()) {
        ++stats_.generated;
      } else {
        ++stats_.failures;
      }
    }
    flight_done_.NotifyAll();
    WFS_TRY(st);
    generated = true;
  }
}

Status PatchView::Generate(const Node& n, const std::string& file) {
  MutexLock g(gen_mu_);
  const std::string what = n.model + "@" + n.to + "/.patch/" + n.from + "/" + n.path;
  auto fail = [&](const std::string& why) { return Status::IOError("patch view: cannot generate " + what + ": " + why); };
  PatchOptions po;
  po.cache = cache_;
  po.spill_dir = options_.dir;
  Expected<std::unique_ptr<WeightPatcher>> patcher =
      WeightPatcher::Open(materializer_, pool_.get(), n.model, n.from, n.to, po);
  if (!patcher.ok()) return fail(patcher.status().ToString());
  const std::string tmp = file + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(g_tmp_counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fail("cannot create " + tmp + ": " + std::strerror(errno));
  PatchSink sink = [&](std::span<const uint8_t> bytes) -> Status {
    size_t done = 0;
    while (done < bytes.size()) {
      ssize_t w = ::write(fd, bytes.data() + done, bytes.size() - done);
      if (w < 0) {
        if (errno == EINTR) continue;
        return StatusOfErrno(errno, "write " + tmp);
      }
      done += static_cast<size_t>(w);
    }
    return Status::Ok();
  };
  PatchStats stats;
  Status st = (*patcher)->Write(n.path, sink, &stats);
  if (::close(fd) != 0 && st.ok()) st = StatusOfErrno(errno, "close " + tmp);
  if (st.ok() && ::rename(tmp.c_str(), file.c_str()) != 0) {
    st = StatusOfErrno(errno, "rename to " + file);
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    return fail(st.ToString());
  }
  spdlog::info("patch view: {} ({} bytes, {} of {} elements changed)", what, stats.patch_bytes,
               stats.elements_changed, stats.elements);
  Evict(file);
  return Status::Ok();
}

void PatchView::Evict(const std::string& keep) {
  struct Entry {
    std::string path;
    uint64_t size;
    int64_t mtime_ns;
  };
  std::vector<Entry> entries;
  uint64_t total = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(options_.dir, ec)) {
    const std::string p = e.path().string();
    if (!EndsWith(p, kSuffix)) continue;  // temporaries are their writers'
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) continue;
    entries.push_back({p, static_cast<uint64_t>(st.st_size),
                       int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec});
    total += static_cast<uint64_t>(st.st_size);
  }
  if (total <= options_.max_bytes) return;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.mtime_ns < b.mtime_ns; });
  for (const Entry& e : entries) {
    if (total <= options_.max_bytes) break;
    if (e.path == keep) continue;
    if (::unlink(e.path.c_str()) == 0) {
      total -= e.size;
      MutexLock lock(mu_);
      ++stats_.evicted;
    }
  }
}

}  // namespace weightfs
