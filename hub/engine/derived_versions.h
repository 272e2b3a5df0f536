// DerivedVersions: versions a bucket does not hold as weightfs manifests but that weightfs derives
// from another layout it understands (TRL's delta-sync bucket: full "anchor" safetensors plus
// sparse per-step patches, hub/trl/trl_bucket.h). A Bucket opened over such a layout
// (Bucket::FromDerived) lists and reads its versions through this interface, and the
// Materializer asks it for the bytes of their chunks; the read path above (namespace, chunk
// reader, FUSE) is the same as for a weightfs bucket.
//
// The manifests it makes have `derived` set: their chunk hashes are identifiers unique to
// (version, file, chunk), not hashes of the bytes (those are not known until the chunk is
// materialized), so the Materializer neither verifies them nor puts them in the
// content-addressed disk cache; a file's sha256 may be empty (unknown). Such buckets are
// read-only.
//
// Implementations are thread-safe.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/manifest.h"
#include "core/status.h"

namespace weightfs {

struct VersionInfo;

class DerivedVersions {
 public:
  virtual ~DerivedVersions() = default;
  // Every version, optionally of one model, sorted by model then version.
  virtual Expected<std::vector<VersionInfo>> ListVersions(std::string_view model) = 0;
  // NotFound naming model@version when there is no such version.
  virtual Expected<std::shared_ptr<const Manifest>> ReadManifest(std::string_view model,
                                                                 std::string_view version) = 0;
  // Writes the bytes of chunk `index` of `file` (of a manifest this object made) into `out`,
  // which has exactly file.chunks[index].length bytes. Errors name the version, file and chunk.
  virtual Status Materialize(const Manifest& manifest, const ManifestFile& file, size_t index,
                             std::span<uint8_t> out) = 0;
};

}  // namespace weightfs
