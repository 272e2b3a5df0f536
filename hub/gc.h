// CollectGarbage: removes packs that no manifest references, and optionally retires old
// versions.
//
// Safety against concurrent pushes rests on the order of the listings: packs first, then
// leases, then manifests. A push writes its lease before any pack and publishes its manifest
// before removing its lease, so a pack that shows up in the pack listing belongs either to a
// push whose lease the lease listing sees (then no pack is deleted at all), or to a version
// the manifest listing sees (then the pack is referenced). Dead leases (expired, or of a
// process on this host that no longer exists) protect nothing and are removed.
//
// Retiring (`keep_last`): per model, versions older than the newest N are removed unless a kept
// version's delta chains still pass through them (a manifest's `versions` table names every
// version its recipes need, and those versions' tables name theirs). Such versions are kept
// and reported.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hub/bucket.h"

namespace weightfs {

struct GcOptions {
  bool dry_run = false;
  std::optional<size_t> keep_last;  // per model
};

struct GcReport {
  size_t versions = 0;
  std::vector<std::string> retired;           // model@version removed (or to remove)
  std::vector<std::string> kept_as_base;      // old versions kept because newer ones need them
  size_t packs = 0;
  size_t live_packs = 0;
  size_t deleted_packs = 0;
  uint64_t deleted_bytes = 0;
  size_t live_leases = 0;                     // > 0: no pack was deleted
  std::vector<std::string> live_lease_names;
  size_t dead_leases_removed = 0;
};

Expected<GcReport> CollectGarbage(Bucket& bucket, const GcOptions& options);

}  // namespace weightfs
