#include "hub/hf/hf_repo.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/chunk_plan.h"
#include "core/hash.h"
#include "core/manifest.h"
#include "hub/engine/bucket.h"
#include "hub/store/local_file.h"

namespace weightfs {
namespace {

Status ValidateRepoId(std::string_view repo) {
  const size_t slash = repo.find('/');
  if (slash == std::string_view::npos) return ValidateHubName(repo, "repo name");
  if (repo.find('/', slash + 1) != std::string_view::npos) {
    return Status::InvalidArgument("repo id '" + std::string(repo.substr(0, 200)) + "' has more than one '/'");
  }
  WFS_TRY(ValidateHubName(repo.substr(0, slash), "organization"));
  return ValidateHubName(repo.substr(slash + 1), "repo name");
}

Status ValidateRevision(std::string_view rev) {
  auto bad = [&](std::string_view rule) {
    return Status::InvalidArgument("revision '" + std::string(rev.substr(0, 100)) + "' " + std::string(rule));
  };
  if (rev.empty() || rev.size() > 255) return bad("must be 1 to 255 characters");
  for (char c : rev) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '-' || c == '_' || c == '/';
    if (!ok) return bad("has a character outside [A-Za-z0-9._/-]");
  }
  if (rev.front() == '/' || rev.back() == '/' || rev.find("//") != std::string_view::npos ||
      rev.find("..") != std::string_view::npos || rev.front() == '.') {
    return bad("must not start with '.' or '/', end with '/', or contain '//' or '..'");
  }
  return Status::Ok();
}

// A repo file path safe to join to a directory and to put in a URL: ValidateFilePath's rules.
Status ValidateRepoPath(std::string_view path) {
  Status s = ValidateFilePath(path);
  if (!s.ok()) return Status::InvalidArgument("repo file path: " + s.message());
  return Status::Ok();
}

std::string CacheRepoDir(const HfConfig& config, std::string_view repo) {
  std::string folder = "models";
  size_t start = 0;
  for (;;) {
    const size_t slash = repo.find('/', start);
    folder += "--" + std::string(repo.substr(start, slash - start));
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return config.hub_cache + "/" + folder;
}

std::optional<std::string> ReadSmallFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  if (s.size() > 4096) return std::nullopt;
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

std::optional<std::string> CachedCommit(const HfConfig& config, std::string_view repo, std::string_view revision) {
  auto c = ReadSmallFile(CacheRepoDir(config, repo) + "/refs/" + std::string(revision));
  if (!c || !hf::IsCommitSha(*c)) return std::nullopt;
  return c;
}

bool IsSha256Hex(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

}  // namespace

// ---- parsing ------------------------------------------------------------------------------------

Expected<HfRepoRef> ParseHfRepoUrl(std::string_view url) {
  constexpr std::string_view kScheme = "hf://";
  const std::string shown(url.substr(0, 200));
  if (!url.starts_with(kScheme)) {
    return Status::InvalidArgument("'" + shown + "' is not a Hugging Face repo URL (expected hf://ORG/REPO[@REVISION])");
  }
  std::string_view rest = url.substr(kScheme.size());
  if (rest.starts_with("buckets/")) {
    return Status::InvalidArgument("'" + shown + "' is a bucket, not a model repo (hf://ORG/REPO[@REVISION])");
  }
  if (rest.starts_with("datasets/") || rest.starts_with("spaces/")) {
    return Status::Unsupported("'" + shown + "': only model repos are supported");
  }
  if (rest.find_first_of("?#") != std::string_view::npos) {
    return Status::InvalidArgument("repo URL '" + shown + "' must not have a query or fragment");
  }
  HfRepoRef out;
  const size_t at = rest.find('@');
  out.repo = std::string(rest.substr(0, at));
  out.revision = at == std::string_view::npos ? "main" : std::string(rest.substr(at + 1));
  Status s = ValidateRepoId(out.repo);
  if (s.ok()) s = ValidateRevision(out.revision);
  if (!s.ok()) return Status::InvalidArgument("repo URL '" + shown + "': " + s.message());
  return out;
}

Expected<HfRevisionInfo> ParseHfRevisionInfo(const nlohmann::json& info, std::string_view where) {
  const auto sha = info.is_object() ? info.find("sha") : info.end();
  if (sha == info.end() || !sha->is_string() || !hf::IsCommitSha(sha->get_ref<const std::string&>())) {
    return Status::Corruption(std::string(where) + ": the revision API answered without a 40-hex \"sha\"");
  }
  HfRevisionInfo out;
  out.commit = sha->get<std::string>();
  if (auto lm = info.find("lastModified"); lm != info.end() && lm->is_string()) {
    if (auto parsed = ParseUtc(lm->get_ref<const std::string&>()); parsed.ok()) out.time_ms = *parsed;
  }
  return out;
}

Status AppendHfRepoTreePage(const nlohmann::json& page, std::string_view where, std::vector<HfRepoFile>* out) {
  if (!page.is_array()) return Status::Corruption("repo tree page is not a JSON array");
  for (const auto& e : page) {
    if (!e.is_object()) return Status::Corruption("repo tree entry is not an object");
    const auto type = e.find("type"), path = e.find("path");
    if (type == e.end() || !type->is_string() || path == e.end() || !path->is_string()) {
      return Status::Corruption("repo tree entry without type or path");
    }
    if (type->get_ref<const std::string&>() != "file") continue;
    HfRepoFile f;
    f.path = path->get<std::string>();
    if (!ValidateRepoPath(f.path).ok()) {
      spdlog::warn("{}: skipping file '{}' (not a path weightfs can show)", where, f.path.substr(0, 200));
      continue;
    }
    const auto size = e.find("size");
    if (size != e.end() && size->is_number_unsigned()) f.size = size->get<uint64_t>();
    if (auto lfs = e.find("lfs"); lfs != e.end() && lfs->is_object()) {
      if (auto ls = lfs->find("size"); ls != lfs->end() && ls->is_number_unsigned()) f.size = ls->get<uint64_t>();
      if (auto oid = lfs->find("oid"); oid != lfs->end() && oid->is_string() && IsSha256Hex(oid->get<std::string>())) {
        f.sha256 = oid->get<std::string>();
      }
    } else if (size == e.end() || !size->is_number_unsigned()) {
      return Status::Corruption("repo tree entry '" + f.path.substr(0, 200) + "' has no valid size");
    }
    out->push_back(std::move(f));
  }
  return Status::Ok();
}

// ---- HfRepo -------------------------------------------------------------------------------------

HfRepo::HfRepo(std::shared_ptr<HfApi> api, std::string repo, std::string revision, std::string commit,
               int64_t time_ms)
    : api_(std::move(api)),
      repo_(std::move(repo)),
      revision_(std::move(revision)),
      commit_(std::move(commit)),
      commit_time_ms_(time_ms) {}

Expected<std::shared_ptr<HfRepo>> HfRepo::Open(const HfConfig& config, std::shared_ptr<HttpClient> http,
                                               std::string_view repo, std::string_view revision) {
  WFS_TRY(ValidateRepoId(repo));
  WFS_TRY(ValidateRevision(revision));
  auto api = std::make_shared<HfApi>(config, std::move(http));
  auto make = [&](std::string commit, int64_t ms) {
    return std::shared_ptr<HfRepo>(new HfRepo(api, std::string(repo), std::string(revision), std::move(commit), ms));
  };
  if (hf::IsCommitSha(revision)) return make(std::string(revision), 0);
  const std::string where = "hf://" + std::string(repo) + "@" + std::string(revision);
  if (config.offline) {
    if (auto c = CachedCommit(config, repo, revision)) return make(*c, 0);
    return Status::NotFound(where + ": HF_HUB_OFFLINE is set and the local cache (" + CacheRepoDir(config, repo) +
                            "/refs/" + std::string(revision) + ") does not know this revision");
  }
  HfTarget target{HfTarget::Kind::kRepo, std::string(repo), std::string(revision), ""};
  const std::string url = api->Url("/api/models/" + std::string(repo) + "/revision/" + UrlEncode(revision, false));
  auto info = api->GetJson(url, target);
  if (!info.ok()) {
    const ErrorKind k = info.status().kind();
    if (k == ErrorKind::kIOError || k == ErrorKind::kTimeout) {
      if (auto c = CachedCommit(config, repo, revision)) {
        spdlog::warn("{}: the Hub cannot be reached ({}); using commit {} from the local cache", where,
                     info.status().message(), *c);
        return make(*c, 0);
      }
    }
    return info.status().WithContext(where);
  }
  WFS_ASSIGN_OR_RETURN(HfRevisionInfo rev, ParseHfRevisionInfo(*info, where));
  return make(std::move(rev.commit), rev.time_ms);
}

std::string HfRepo::SnapshotDir() const { return CacheRepoDir(api_->config(), repo_) + "/snapshots/" + commit_; }

Expected<std::vector<HfRepoFile>> HfRepo::ListFromCache() const {
  const std::string dir = SnapshotDir();
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return Status::NotFound("hf://" + repo_ + "@" + revision_ + ": no snapshot of commit " + commit_ +
                            " in the local cache (" + dir + ")");
  }
  std::vector<HfRepoFile> out;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;  // follows the symlink into blobs/
    // Lexically: relative() would resolve the symlink into blobs/.
    const std::string rel = it->path().lexically_relative(dir).generic_string();
    if (!ValidateRepoPath(rel).ok()) continue;
    HfRepoFile f;
    f.path = rel;
    f.size = it->file_size(ec);
    if (ec) continue;
    // A blob named by a sha256 is an LFS file's content hash.
    const std::string blob = std::filesystem::read_symlink(it->path(), ec).filename().string();
    if (!ec && IsSha256Hex(blob)) f.sha256 = blob;
    ec.clear();
    out.push_back(std::move(f));
  }
  if (ec) return Status::IOError("listing " + dir + ": " + ec.message());
  std::sort(out.begin(), out.end(), [](const HfRepoFile& a, const HfRepoFile& b) { return a.path < b.path; });
  return out;
}

Expected<std::vector<HfRepoFile>> HfRepo::ListFiles() {
  {
    MutexLock lock(mu_);
    if (files_) return *files_;
  }
  const HfConfig& config = api_->config();
  std::vector<HfRepoFile> out;
  if (config.offline) {
    WFS_ASSIGN_OR_RETURN(out, ListFromCache());
  } else {
    HfTarget target{HfTarget::Kind::kRepo, repo_, revision_, ""};
    const std::string url = api_->Url("/api/models/" + repo_ + "/tree/" + commit_ +
                                      "?recursive=true&expand=false&limit=" + std::to_string(kHubTreePageLimit));
    const std::string where = "hf://" + repo_ + "@" + revision_;
    auto on_page = [&](const nlohmann::json& page) -> Status { return AppendHfRepoTreePage(page, where, &out); };
    Status s = api_->GetJsonPages(url, target, on_page);
    stats_.requests.store(api_->stats().hub_requests + api_->stats().other_requests);
    if (!s.ok()) {
      if (s.kind() == ErrorKind::kIOError || s.kind() == ErrorKind::kTimeout) {
        auto cached = ListFromCache();
        if (cached.ok()) {
          spdlog::warn("hf://{}@{}: listing from the Hub failed ({}); using the local cache's snapshot", repo_,
                       revision_, s.message());
          out = std::move(cached).value();
          s = Status::Ok();
        }
      }
      if (!s.ok()) return s.WithContext("hf://" + repo_ + "@" + revision_);
    }
    std::sort(out.begin(), out.end(), [](const HfRepoFile& a, const HfRepoFile& b) { return a.path < b.path; });
  }
  auto shared = std::make_shared<const std::vector<HfRepoFile>>(std::move(out));
  MutexLock lock(mu_);
  if (!files_) files_ = shared;
  return *files_;
}

std::optional<std::vector<uint8_t>> HfRepo::ReadFromCache(std::string_view path, uint64_t offset, uint64_t length) {
  const std::string file = SnapshotDir() + "/" + std::string(path);
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  // A partial or odd file: the network has the truth.
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  const auto size = static_cast<uint64_t>(st.st_size);
  if (size < offset || size - offset < length) return std::nullopt;
  std::vector<uint8_t> out(length);
  if (PreadUpTo(fd, out.data(), length, offset) != length) return std::nullopt;
  stats_.cache_reads.fetch_add(1, std::memory_order_relaxed);
  stats_.cache_bytes.fetch_add(length, std::memory_order_relaxed);
  return out;
}

Expected<std::vector<uint8_t>> HfRepo::Read(std::string_view path, uint64_t offset, uint64_t length) {
  WFS_TRY(ValidateRepoPath(path));
  const std::string where = "hf://" + repo_ + "@" + commit_ + "/" + std::string(path);
  if (length > UINT64_MAX - offset) return Status::InvalidArgument(where + ": range overflows");
  if (auto cached = ReadFromCache(path, offset, length)) return std::move(*cached);
  if (length == 0) return std::vector<uint8_t>();
  if (api_->config().offline) {
    return Status::NotFound(where + ": HF_HUB_OFFLINE is set and the file is not in the local cache (" +
                            SnapshotDir() + ")");
  }
  HfTarget target{HfTarget::Kind::kRepo, repo_, revision_, std::string(path)};
  const std::string url = api_->Url("/" + repo_ + "/resolve/" + commit_ + "/" + UrlEncode(path, true));
  // A pinned commit's file never changes: its signed CDN URL is resolved once and reused.
  auto got = api_->ReadRange(url, target, offset, length, /*reuse_resolved=*/true);
  stats_.requests.store(api_->stats().hub_requests + api_->stats().other_requests);
  if (!got.ok()) return got.status();
  stats_.bytes_fetched.fetch_add(got->size(), std::memory_order_relaxed);
  if (got->size() != length) {
    return Status::Corruption(where + ": short read of " + std::to_string(length) + " bytes at " +
                              std::to_string(offset) + " (got " + std::to_string(got->size()) + ")");
  }
  return got;
}

// ---- HfSources ----------------------------------------------------------------------------------

HfSources::HfSources(HfConfig config, std::shared_ptr<HttpClient> http)
    : config_(std::move(config)), http_(http ? std::move(http) : std::make_shared<HttpClient>()) {}

Expected<HfSources::Parsed> HfSources::ParseSource(std::string_view source) {
  WFS_TRY(ValidateSourceName(source));
  // ValidateSourceName guarantees "hf://" + repo + "@" + 40 hex + "/" + path.
  std::string_view rest = source.substr(5);
  const size_t at = rest.find('@');
  if (at == std::string_view::npos || rest.size() < at + 42 || rest[at + 41] != '/') {
    return Status::InvalidArgument("source '" + std::string(source.substr(0, 200)) + "' is not hf://REPO@COMMIT/PATH");
  }
  Parsed p{std::string(rest.substr(0, at)), std::string(rest.substr(at + 1, 40)), std::string(rest.substr(at + 42))};
  Status s = ValidateRepoId(p.repo);
  if (s.ok() && !hf::IsCommitSha(p.commit)) s = Status::InvalidArgument("commit is not 40 lowercase hex digits");
  if (s.ok()) s = ValidateRepoPath(p.path);
  if (!s.ok()) return Status::InvalidArgument("source '" + std::string(source.substr(0, 200)) + "': " + s.message());
  return p;
}

Expected<std::vector<uint8_t>> HfSources::Read(std::string_view source, uint64_t offset, uint64_t length) {
  WFS_ASSIGN_OR_RETURN(Parsed p, ParseSource(source));
  if (length > kMaxChunkBytes) {
    return Status::InvalidArgument("source " + std::string(source) + ": a read of " + std::to_string(length) +
                                   " bytes is larger than any chunk");
  }
  std::shared_ptr<HfRepo> repo;
  const std::string key = p.repo + "@" + p.commit;
  {
    MutexLock lock(mu_);
    if (auto it = repos_.find(key); it != repos_.end()) repo = it->second;
  }
  if (!repo) {
    // A commit revision makes no request.
    WFS_ASSIGN_OR_RETURN(repo, HfRepo::Open(config_, http_, p.repo, p.commit));
    MutexLock lock(mu_);
    repo = repos_.emplace(key, repo).first->second;
  }
  auto got = repo->Read(p.path, offset, length);
  if (!got.ok()) return got.status().WithContext("source " + std::string(source));
  return got;
}

uint64_t HfSources::requests() const {
  MutexLock lock(mu_);
  uint64_t n = 0;
  for (const auto& [k, r] : repos_) n += r->stats().requests;
  return n;
}
uint64_t HfSources::bytes_fetched() const {
  MutexLock lock(mu_);
  uint64_t n = 0;
  for (const auto& [k, r] : repos_) n += r->stats().bytes_fetched;
  return n;
}
uint64_t HfSources::cache_bytes() const {
  MutexLock lock(mu_);
  uint64_t n = 0;
  for (const auto& [k, r] : repos_) n += r->stats().cache_bytes;
  return n;
}

// ---- OpenHfRepoVersions -------------------------------------------------------------------------

std::string HfRepoModelName(std::string_view repo) {
  std::string out(repo);
  for (char& c : out) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '-' || c == '_' || c == '/';
    if (!ok) c = '_';
  }
  return out;
}

namespace {

class HfRepoVersions final : public DerivedVersions {
 public:
  HfRepoVersions(std::shared_ptr<HfRepo> repo, std::shared_ptr<const Manifest> manifest)
      : repo_(std::move(repo)), manifest_(std::move(manifest)) {}

  Expected<std::vector<VersionInfo>> ListVersions(std::string_view model) override {
    std::vector<VersionInfo> out;
    if (model.empty() || model == manifest_->model) out.push_back(VersionInfo{manifest_->model, manifest_->version});
    return out;
  }

  Expected<std::shared_ptr<const Manifest>> ReadManifest(std::string_view model, std::string_view version) override {
    if (model != manifest_->model || version != manifest_->version) {
      return Status::NotFound(std::string(model) + "@" + std::string(version) + " does not exist (hf://" +
                              repo_->repo() + " shows " + manifest_->model + "@" + manifest_->version + ")");
    }
    return manifest_;
  }

  Status Materialize(const Manifest& manifest, const ManifestFile& file, size_t index,
                     std::span<uint8_t> out) override {
    const std::string where = manifest.model + "@" + manifest.version + "/" + file.path + " chunk " +
                              std::to_string(index);
    if (index >= file.chunks.size()) return Status::InvalidArgument(where + ": no such chunk");
    const ManifestChunk& c = file.chunks[index];
    if (out.size() != c.length) return Status::InvalidArgument(where + ": output buffer has the wrong size");
    auto got = repo_->Read(file.path, c.offset, c.length);
    if (!got.ok()) return got.status().WithContext(where);
    std::copy(got->begin(), got->end(), out.begin());
    return Status::Ok();
  }

 private:
  const std::shared_ptr<HfRepo> repo_;
  const std::shared_ptr<const Manifest> manifest_;
};

}  // namespace

Expected<std::shared_ptr<const Manifest>> BuildHfRepoManifest(std::string_view repo_id, std::string_view revision,
                                                              std::string_view commit, int64_t created_ms,
                                                              std::vector<HfRepoFile> files, uint64_t max_bytes) {
  const std::string where = "hf://" + std::string(repo_id) + "@" + std::string(revision);
  auto m = std::make_shared<Manifest>();
  m->model = HfRepoModelName(repo_id);
  WFS_TRY(ValidateModelName(m->model));
  m->version = ValidateVersionName(revision).ok() ? std::string(revision) : std::string(commit);
  m->created_ms = created_ms;
  m->created = FormatUtc(m->created_ms);
  m->chunk_bytes = kDefaultChunkBytes;
  m->versions = {m->version};
  m->derived = true;
  std::sort(files.begin(), files.end(), [](const HfRepoFile& a, const HfRepoFile& b) { return a.path < b.path; });
  // The listing is the server's word: a path twice, or a file that is also a directory, would
  // make a tree no filesystem can show; sizes are bounded before any chunk is planned.
  uint64_t total = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const HfRepoFile& f = files[i];
    if (i > 0 && files[i - 1].path == f.path) {
      return Status::Corruption(where + ": the Hub lists '" + f.path.substr(0, 200) + "' twice");
    }
    for (size_t slash = f.path.find('/'); slash != std::string::npos; slash = f.path.find('/', slash + 1)) {
      const auto dir = std::lower_bound(files.begin(), files.end(), f.path.substr(0, slash),
                                        [](const HfRepoFile& a, const std::string& p) { return a.path < p; });
      if (dir != files.end() && dir->path == f.path.substr(0, slash)) {
        return Status::Corruption(where + ": the Hub lists '" + dir->path.substr(0, 200) +
                                  "' as a file and as a directory");
      }
    }
    if (f.size > kMaxHfRepoFileBytes) {
      return Status::Corruption(where + ": the Hub says '" + f.path.substr(0, 200) + "' has " +
                                std::to_string(f.size) + " bytes, more than " + std::to_string(kMaxHfRepoFileBytes) +
                                " (no Hub file is that large)");
    }
    total += f.size;
    if (total > max_bytes) {
      return Status::ResourceExhausted(where + ": the repo's files add up to more than " + std::to_string(max_bytes) +
                                       " bytes");
    }
  }
  const std::string source_prefix = "hf://" + std::string(repo_id) + "@" + std::string(commit) + "/";
  for (const HfRepoFile& f : files) {
    ManifestFile mf;
    mf.path = f.path;
    mf.size = f.size;
    mf.sha256 = f.sha256;
    const std::string source = source_prefix + f.path;
    const uint32_t source_index = m->SourceIndex(source);
    for (uint64_t off = 0, i = 0; off < f.size; off += kDefaultChunkBytes, ++i) {
      ManifestChunk c;
      c.key = ChunkKey{"", i};
      c.offset = off;
      c.length = std::min<uint64_t>(kDefaultChunkBytes, f.size - off);
      const std::string id = source + "#" + std::to_string(i);
      c.hash = HashChunk({reinterpret_cast<const uint8_t*>(id.data()), id.size()});
      c.encoding = ChunkEncoding::kExternal;  // informative: the manifest is derived
      c.ref = PayloadRef{source_index, off, c.length};
      mf.chunks.push_back(c);
    }
    m->stats.logical_bytes += f.size;
    m->stats.elements += f.size;
    m->files.push_back(std::move(mf));
  }
  return std::shared_ptr<const Manifest>(std::move(m));
}

Expected<std::shared_ptr<DerivedVersions>> OpenHfRepoVersions(const HfConfig& config, std::shared_ptr<HttpClient> http,
                                                               std::string_view repo_id, std::string_view revision) {
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<HfRepo> repo, HfRepo::Open(config, std::move(http), repo_id, revision));
  WFS_ASSIGN_OR_RETURN(std::vector<HfRepoFile> files, repo->ListFiles());
  const int64_t now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m,
                       BuildHfRepoManifest(repo->repo(), revision, repo->commit(),
                                           repo->commit_time_ms() > 0 ? repo->commit_time_ms() : now_ms,
                                           std::move(files)));
  return std::shared_ptr<DerivedVersions>(std::make_shared<HfRepoVersions>(std::move(repo), std::move(m)));
}

}  // namespace weightfs
