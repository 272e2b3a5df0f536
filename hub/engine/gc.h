// CollectGarbage: removes packs that no manifest references and temporary objects of writes
// that never finished, and optionally retires old versions.
//
// Safety against concurrent pushes rests on the order of the listings: packs first, then
// leases, then manifests. A push writes its lease before any pack and publishes its manifest
// before removing its lease, so a pack that shows up in the pack listing belongs either to a
// push whose lease the lease listing sees (then no pack is deleted at all), or to a version
// the manifest listing sees (then the pack is referenced). Dead leases (expired, or of a
// process on this host that no longer exists) protect nothing and are removed.
//
// Temporaries (Store::ListTemporaries: `.weightfs-tmp/` objects of local and WebDAV buckets, a
// write's upload before its rename or create-if-absent MOVE) are listed with the packs, before
// the leases, and follow the same rule: none is deleted while any live lease exists (a push's
// temporaries appear only after its lease). Writes without a lease (a lease being written,
// `init`, gc's own rewrites) hold a temporary only for the length of one upload, so a
// temporary is deleted only once it has not changed for `temporary_min_age` (an hour: six
// lease lifetimes; it is measured against the store's modification time, so clock skew between
// this host and a WebDAV server eats into it). Deleting one a slow writer still held would make
// that write fail, never publish anything partial.
//
// Staged versions (written by several nodes, hub/engine/staged_version.h) are listed after the
// leases and before the versions: a part's packs are covered by its writer's lease until its
// record exists, and a record is deleted only after its version's head exists, so every pack
// is seen through a lease, a record or a version.
//
// Retiring (`keep_last`): per model, versions older than the newest N are removed. A kept
// version whose delta recipes have their base in an old version is first rebased: those chunks
// are materialized and stored again as keyframes, and its manifest is replaced under the same
// key (same files and bytes, new recipes). Without `rebase`, old versions that kept ones still
// build on are kept instead, and reported. A reader that loaded the old head before the rewrite
// and reads after the old versions are gone finds the rewrite when its chain read fails and
// reads with the new head (Bucket::Revalidate, Materializer::Build); a version written on the
// old head takes its inherited rows from the new one when it is published
// (Bucket::PublishManifest). The leases are listed again after the rewrites: a push that began
// meanwhile keeps every pack and table.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "hub/engine/bucket.h"

namespace weightfs {

struct GcOptions {
  bool dry_run = false;
  std::optional<size_t> keep_last;  // per model
  // With keep_last: rewrite kept versions whose deltas build on old ones so the old ones can
  // go (their chunks become keyframes). Without it such old versions are kept.
  bool rebase = true;
  // Temporaries younger than this are left alone (they may be uploads in progress).
  std::chrono::milliseconds temporary_min_age = std::chrono::hours(1);
  // Versions staged in parts (hub/engine/staged_version.h) keep their parts' packs until a part
  // record has not been renewed for this long; then the record goes (a node still waiting for
  // it stops), and its packs with it. Discarded ones have no records and keep nothing.
  std::chrono::milliseconds staged_grace = std::chrono::hours(24 * 7);
};

struct GcReport {
  size_t versions = 0;
  std::vector<std::string> retired;           // model@version removed (or to remove)
  std::vector<std::string> kept_as_base;      // old versions kept because newer ones need them
  std::vector<std::string> rebased;           // kept versions rewritten onto new keyframes
  uint64_t rebased_bytes = 0;                 // their new keyframes (a dry run: an estimate)
  size_t packs = 0;
  size_t live_packs = 0;
  size_t deleted_packs = 0;
  size_t live_tables = 0, deleted_tables = 0;  // format 2 chunk tables (tables/)
  uint64_t deleted_bytes = 0;
  size_t live_leases = 0;                     // > 0: no pack was deleted
  std::vector<std::string> live_lease_names;
  size_t dead_leases_removed = 0;
  size_t temporaries = 0;                     // temporary objects found
  size_t deleted_temporaries = 0;             // removed (or to remove): old, no live lease
  uint64_t deleted_temporary_bytes = 0;
  size_t staged_versions = 0;                 // versions staged in parts, not published
  size_t staged_parts = 0;                    // their part records, kept (their packs are live)
  std::vector<std::string> expired_parts;     // "model@version part ID": older than staged_grace
  size_t cleared_staging_objects = 0;         // staging objects of published versions removed
  size_t recent_temporaries = 0;              // kept: younger than temporary_min_age
};

Expected<GcReport> CollectGarbage(Bucket& bucket, const GcOptions& options);

}  // namespace weightfs
