// A model repo revision on the Hugging Face Hub as a model's base version (issue 6): resolves
// the revision to its commit, and publishes (once) a manifest whose chunks read their bytes from
// the repo at that commit (hub/engine/external_base.h). Versions pushed on top store only deltas.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/bucket.h"
#include "hub/store/http_client.h"

namespace weightfs {

struct HfBaseResult {
  std::shared_ptr<const Manifest> manifest;
  std::string repo, revision, commit;
  bool created = false;  // false: the bucket already had it
};

// MODEL@VERSION for `repo_url` ("hf://ORG/REPO[@REVISION]"); VERSION defaults to
// "hf-<first 12 hex of the commit>". If that version exists it must name the same commit's
// files (else Conflict); otherwise every file of the commit is read once (the local Hugging Face
// cache first) to hash its chunks, and the manifest is published.
Expected<HfBaseResult> EnsureHfBase(Bucket& bucket, ThreadPool& pool, std::shared_ptr<HttpClient> http,
                                    std::string_view model, std::string_view repo_url,
                                    std::string version, uint64_t chunk_bytes,
                                    const std::function<void(uint64_t, uint64_t)>& progress);

}  // namespace weightfs
