// HfRepo: read-only access to one Hugging Face model repo at one commit — its file list and
// byte ranges of its files, from the local Hugging Face cache when the file is there, else with
// HTTP Range requests on the Hub's resolve URLs. On top of it:
//   HfSources           the ExternalSources (hub/engine/external_source.h) for manifest source strings
//                       "hf://ORG/REPO@COMMIT/PATH": a version pushed on a Hub base model reads
//                       only the byte ranges its chunks need.
//   OpenHfRepoVersions  a DerivedVersions (hub/engine/derived_versions.h) showing a repo revision as
//                       one read-only version, so `weightfs mount hf://ORG/REPO@REV` works.
//
// Network (hub/hf/hf_api.h for the token, redirect and error rules):
//   commit   GET {endpoint}/api/models/REPO/revision/REV -> "sha" (and "lastModified");
//            a 40-hex revision is the commit itself (no request). With HF_HUB_OFFLINE, or when
//            the Hub cannot be reached (IOError/Timeout; not 401/403/404), the local cache's
//            models--ORG--REPO/refs/REV decides.
//   files    GET {endpoint}/api/models/REPO/tree/COMMIT?recursive=true&expand=false&limit=1000,
//            following Link rel="next"; size = lfs.size when present (for LFS files the
//            top-level size may be the pointer's), sha256 = lfs.oid (empty for non-LFS files).
//            Offline: the cache's snapshots/COMMIT directory.
//   bytes    HF_HUB_CACHE/models--ORG--REPO/snapshots/COMMIT/PATH (a symlink into blobs/) read
//            with pread when it exists and is long enough; else GET
//            {endpoint}/REPO/resolve/COMMIT/PATH with Range, following the redirect to the CDN
//            without the token. The cache is only read, never written.
//
// Thread-safe: every method may be called from any number of threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/mutex.h"
#include "core/status.h"
#include "hub/engine/derived_versions.h"
#include "hub/engine/external_source.h"
#include "hub/hf/hf_api.h"

namespace weightfs {

// `hf://ORG/REPO[@REVISION]` (or `hf://REPO[@REVISION]`). REVISION: a branch, a tag, a 40-hex
// commit or refs/pr/N; default "main". Not `hf://buckets/...` (that is a bucket). Names follow
// the Hub's rules (see ParseHfBucketUrl); a revision is 1-255 characters of [A-Za-z0-9._/-]
// without "..", "//", or a leading/trailing '/'.
struct HfRepoRef {
  std::string repo;      // "ORG/REPO"
  std::string revision;  // "main" when none was given
};
Expected<HfRepoRef> ParseHfRepoUrl(std::string_view url);

struct HfRepoFile {
  std::string path;    // in the repo, '/'-separated
  uint64_t size = 0;
  std::string sha256;  // the LFS oid (64 hex), "" for files kept in git
};

// The Hub's JSON answers, parsed without I/O (exposed for tests and the hf_json fuzzer):
//
// One page of a model repo's tree listing (GET /api/models/REPO/tree/COMMIT: a JSON array of
// {"type": "file"|"directory", "path", "size", "lfs": {"oid", "size"}}): appends every file to
// `out`, size = lfs.size when present, sha256 = lfs.oid when it is 64 lowercase hex. Paths
// ValidateFilePath refuses are skipped with a warning naming `where`; directories are ignored.
// Corruption when the page is not an array, an entry is not an object or lacks a string type or
// path, or a file without "lfs" has no unsigned size.
Status AppendHfRepoTreePage(const nlohmann::json& page, std::string_view where, std::vector<HfRepoFile>* out);

// The revision API's answer (GET /api/models/REPO/revision/REV): "sha" (40 lowercase hex) and
// "lastModified" (Unix ms; 0 when absent or unparsable). Corruption naming `where` without a sha.
struct HfRevisionInfo {
  std::string commit;
  int64_t time_ms = 0;
};
Expected<HfRevisionInfo> ParseHfRevisionInfo(const nlohmann::json& info, std::string_view where);

struct HfRepoStats {
  std::atomic<uint64_t> requests{0};       // HTTP requests made (redirect hops included)
  std::atomic<uint64_t> bytes_fetched{0};  // bytes of file ranges fetched over HTTP
  std::atomic<uint64_t> cache_reads{0};    // reads served from the local HF cache
  std::atomic<uint64_t> cache_bytes{0};
};

class HfRepo {
 public:
  // Resolves `revision` to a commit as described above. `http` may be shared (nullptr: new).
  static Expected<std::shared_ptr<HfRepo>> Open(const HfConfig& config, std::shared_ptr<HttpClient> http,
                                                std::string_view repo, std::string_view revision);

  const std::string& repo() const { return repo_; }
  const std::string& revision() const { return revision_; }
  const std::string& commit() const { return commit_; }
  // The commit's date (Unix ms) when the revision API gave it, else 0.
  int64_t commit_time_ms() const { return commit_time_ms_; }

  // Every file at the commit, sorted by path (fetched once, then remembered).
  Expected<std::vector<HfRepoFile>> ListFiles();

  // Exactly `length` bytes at `offset` of `path` (a short file is an error).
  Expected<std::vector<uint8_t>> Read(std::string_view path, uint64_t offset, uint64_t length);

  const HfRepoStats& stats() const { return stats_; }
  // The snapshot directory of this commit in the local cache (it may not exist).
  std::string SnapshotDir() const;

 private:
  HfRepo(std::shared_ptr<HfApi> api, std::string repo, std::string revision, std::string commit, int64_t time_ms);
  std::optional<std::vector<uint8_t>> ReadFromCache(std::string_view path, uint64_t offset, uint64_t length);
  Expected<std::vector<HfRepoFile>> ListFromCache() const;

  const std::shared_ptr<HfApi> api_;
  const std::string repo_, revision_, commit_;
  const int64_t commit_time_ms_;
  HfRepoStats stats_;
  Mutex mu_;  // not held across I/O
  std::shared_ptr<const std::vector<HfRepoFile>> files_ WFS_GUARDED_BY(mu_);
};

// Source strings "hf://ORG/REPO@COMMIT/PATH" (core/manifest.h ValidateSourceName; checked
// strictly: they come from manifests, which may be hostile). One HfRepo per repo and commit,
// opened on first use (no request: the commit is given).
class HfSources final : public ExternalSources {
 public:
  HfSources(HfConfig config, std::shared_ptr<HttpClient> http);
  // REQUIRES: length <= kMaxChunkBytes (InvalidArgument otherwise).
  Expected<std::vector<uint8_t>> Read(std::string_view source, uint64_t offset, uint64_t length) override;

  struct Parsed {
    std::string repo, commit, path;
  };
  static Expected<Parsed> ParseSource(std::string_view source);

  // Totals over every repo opened so far.
  uint64_t requests() const;
  uint64_t bytes_fetched() const;
  uint64_t cache_bytes() const;

 private:
  const HfConfig config_;
  const std::shared_ptr<HttpClient> http_;
  mutable Mutex mu_;
  std::map<std::string, std::shared_ptr<HfRepo>> repos_ WFS_GUARDED_BY(mu_);  // "repo@commit" -> repo
};

// One read-only version of `repo` at `revision`: model = the repo id (characters a weightfs
// model name refuses become '_'), version = `revision` when it is a valid version name, else the
// commit. Every repo file is one manifest file cut into fixed kDefaultChunkBytes chunks whose
// hashes are identifiers of (repo, commit, path, index) (manifest.derived), read with
// HfRepo::Read. Opens the repo and lists its files now (errors surface here).
Expected<std::shared_ptr<DerivedVersions>> OpenHfRepoVersions(const HfConfig& config,
                                                               std::shared_ptr<HttpClient> http,
                                                               std::string_view repo, std::string_view revision);

// Bounds on what a tree listing may claim (the Hub stores at most 50 GB per LFS file): a
// derived manifest plans one chunk per kDefaultChunkBytes, so a claimed size is memory.
inline constexpr uint64_t kMaxHfRepoFileBytes = 1ull << 40;  // 1 TiB
inline constexpr uint64_t kMaxHfRepoBytes = 4ull << 40;      // 4 TiB in all: 1M chunks

// The manifest OpenHfRepoVersions shows for `files` (a tree listing) of `repo_id` at `commit`,
// as described above, files sorted by path. Pure (exposed for tests and the hf_json fuzzer).
// Corruption naming the repo when a path is listed twice, a file is also a directory of another,
// or a file is larger than kMaxHfRepoFileBytes; ResourceExhausted past `max_bytes` in all.
Expected<std::shared_ptr<const Manifest>> BuildHfRepoManifest(std::string_view repo_id, std::string_view revision,
                                                              std::string_view commit, int64_t created_ms,
                                                              std::vector<HfRepoFile> files,
                                                              uint64_t max_bytes = kMaxHfRepoBytes);

// The model name OpenHfRepoVersions uses for `repo`.
std::string HfRepoModelName(std::string_view repo);

}  // namespace weightfs
