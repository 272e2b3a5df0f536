#include "hub/hf/hf_base.h"

#include <spdlog/spdlog.h>

#include "hub/engine/external_base.h"
#include "hub/hf/hf_api.h"
#include "hub/hf/hf_repo.h"

namespace weightfs {

Expected<HfBaseResult> EnsureHfBase(Bucket& bucket, ThreadPool& pool, std::shared_ptr<HttpClient> http,
                                    std::string_view model, std::string_view repo_url,
                                    std::string version, uint64_t chunk_bytes,
                                    const std::function<void(uint64_t, uint64_t)>& progress) {
  WFS_ASSIGN_OR_RETURN(HfRepoRef ref, ParseHfRepoUrl(repo_url));
  WFS_ASSIGN_OR_RETURN(HfConfig config, LoadHfConfig());
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<HfRepo> repo, HfRepo::Open(config, http, ref.repo, ref.revision));
  HfBaseResult out;
  out.repo = ref.repo;
  out.revision = ref.revision;
  out.commit = repo->commit();
  if (version.empty()) version = "hf-" + out.commit.substr(0, 12);
  WFS_TRY(ValidateVersionName(version));
  const std::string prefix = "hf://" + ref.repo + "@" + out.commit + "/";

  auto matches = [&](const Manifest& m) {
    if (m.parent || m.files.empty()) return false;
    for (const ManifestFile& f : m.files) {
      for (const ManifestChunk& c : f.chunks) {
        if (!c.is_external() || m.sources[c.ref.pack] != prefix + f.path) return false;
      }
    }
    return true;
  };
  Expected<std::shared_ptr<const Manifest>> existing = bucket.ReadFullManifest(model, version);
  if (existing.ok()) {
    if (!matches(**existing)) {
      return Status::Conflict(std::string(model) + "@" + version + " already exists and is not " +
                              ref.repo + " at commit " + out.commit + "; name the base with --base-name");
    }
    out.manifest = *existing;
    return out;
  }
  if (existing.status().kind() != ErrorKind::kNotFound) return existing.status();

  WFS_ASSIGN_OR_RETURN(std::vector<HfRepoFile> listed, repo->ListFiles());
  std::vector<ExternalBaseFile> files;
  for (const HfRepoFile& f : listed) {
    if (!ValidateFilePath(f.path).ok()) {
      spdlog::warn("{}: skipping '{}', a path weightfs cannot name", ref.repo, f.path);
      continue;
    }
    ExternalBaseFile e;
    e.path = f.path;
    e.source = prefix + f.path;
    e.size = f.size;
    e.sha256 = f.sha256;
    const std::string path = f.path;
    e.read = [repo, path](uint64_t offset, uint64_t length) { return repo->Read(path, offset, length); };
    files.push_back(std::move(e));
  }
  if (files.empty()) return Status::NotFound(ref.repo + " at " + out.commit + " has no files");
  WFS_ASSIGN_OR_RETURN(Manifest m, BuildExternalBase({std::string(model), version}, std::move(files), pool,
                                                     chunk_bytes, progress));
  Status published = bucket.PublishManifest(m);
  if (published.kind() == ErrorKind::kConflict) {
    // Someone registered it meanwhile: theirs is as good if it names the same commit.
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> theirs, bucket.ReadFullManifest(model, version));
    if (!matches(*theirs)) return published;
    out.manifest = theirs;
    return out;
  }
  WFS_TRY(published);
  WFS_ASSIGN_OR_RETURN(out.manifest, bucket.ReadManifest(model, version));
  out.created = true;
  spdlog::info("registered {}@{}: {} at commit {} ({} files), read {} bytes from {}", model, version,
               ref.repo, out.commit, m.files.size(), m.stats.logical_bytes,
               repo->stats().cache_reads.load() > 0 ? "the local Hugging Face cache" : "the Hub");
  return out;
}

}  // namespace weightfs
