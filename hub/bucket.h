// Bucket: the weightfs layout (format 1, ../shared/DESIGN.md "Bucket layout") on top of a Store.
//
//   weightfs.json                            {"format": 1}
//   models/<model>/versions/<version>.json   one manifest per published version, created once
//   packs/<32 hex>                           immutable packs of chunk payloads (named by XXH3-128)
//   leases/<id>.json                         pushes in progress (gc leaves their packs alone)
//
// Manifests are immutable once published, so the Bucket keeps the ones it has read in memory
// (bounded by count) and hands out shared pointers to them.
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "hub/derived_versions.h"
#include "hub/external_source.h"
#include "hub/store.h"

namespace weightfs {

struct VersionInfo {
  std::string model;
  std::string version;
};

class Bucket {
 public:
  // Writes weightfs.json unless the bucket already has one (then checks its format).
  static Status Init(Store& store);
  // Checks weightfs.json; a bucket without one gets an error that says to run `weightfs init`.
  static Expected<std::unique_ptr<Bucket>> Open(std::shared_ptr<Store> store);
  // A read-only bucket whose versions `derived` makes from another layout (a TRL delta-sync
  // bucket): listing and manifests come from it, publishing is Unsupported.
  static std::unique_ptr<Bucket> FromDerived(std::shared_ptr<Store> store,
                                             std::shared_ptr<DerivedVersions> derived);
  // Non-null for a bucket made by FromDerived.
  DerivedVersions* derived() const { return derived_.get(); }
  // Where kExternal recipes read from (a base model in a Hugging Face repo). Set once, before
  // the bucket is shared between threads; null: such recipes fail with a clear error.
  void set_external_sources(std::shared_ptr<ExternalSources> sources) { external_ = std::move(sources); }
  ExternalSources* external_sources() const { return external_.get(); }
  // The most JSON one manifest may hold (inflated, if stored compressed); a larger one is
  // ResourceExhausted for that version. ParseManifest's peak memory is about twice what the
  // manifest holds, so a process with a memory budget sets a fraction of it. Set once, before
  // the bucket is shared between threads.
  void set_max_manifest_json_bytes(uint64_t bytes) { max_manifest_json_bytes_ = bytes; }

  Store& store() { return *store_; }
  std::string Describe() const { return store_->Describe(); }

  // Every published version, optionally of one model (and its sub-organisation), sorted by
  // model then version name.
  Expected<std::vector<VersionInfo>> ListVersions(std::string_view model = {});
  // Reads the manifests of `versions` of `model` that are not cached yet, several at a time
  // (errors are left to the ReadManifest that needs them). A materializer walking a chunk's
  // chain back otherwise reads and parses them one after another.
  void PrefetchManifests(std::string_view model, std::span<const std::string> versions);
  // Parsed, validated manifest (NotFound naming model@version if absent).
  Expected<std::shared_ptr<const Manifest>> ReadManifest(std::string_view model,
                                                         std::string_view version);
  // Drops a manifest from the in-memory cache (after gc removed it).
  void Forget(std::string_view model, std::string_view version);
  // Publishes a manifest with create-if-absent: Conflict if the version exists.
  Status PublishManifest(const Manifest& manifest);
  // The newest version (by creation time, then name) of `model`, or NotFound.
  Expected<std::shared_ptr<const Manifest>> Latest(std::string_view model);

  static std::string ManifestKey(std::string_view model, std::string_view version);
  static std::string PackKey(const Hash128& pack) { return "packs/" + pack.ToHex(); }
  static constexpr const char* kMarkerKey = "weightfs.json";
  static constexpr const char* kLeasePrefix = "leases/";

 private:
  explicit Bucket(std::shared_ptr<Store> store) : store_(std::move(store)) {}

  std::shared_ptr<Store> store_;
  std::shared_ptr<DerivedVersions> derived_;
  std::shared_ptr<ExternalSources> external_;
  uint64_t max_manifest_json_bytes_ = kDefaultMaxManifestJsonBytes;
  std::mutex mu_;  // guards the manifest cache; never held across store calls
  std::map<std::string, std::shared_ptr<const Manifest>> manifests_;
  std::list<std::string> manifest_order_;  // insertion order, for bounding the cache
  static constexpr size_t kMaxCachedManifests = 256;
};

// Lists every key under `prefix`, following continuations.
Expected<std::vector<ObjectInfo>> ListAll(Store& store, std::string_view prefix);

}  // namespace weightfs
