#include "hub/engine/gc.h"

#include <algorithm>
#include <map>
#include <set>

#include <spdlog/spdlog.h>

#include "core/chunk_codec.h"
#include "hub/engine/lease.h"
#include "hub/engine/staged_version.h"
#include "hub/engine/materializer.h"
#include "hub/engine/pack_writer.h"

namespace weightfs {

namespace {

// Rewrites `m` so that none of its delta recipes has its base in `old_versions`: each such
// chunk is materialized and stored as a keyframe in new packs. The manifest is replaced under
// the same key (same files, same bytes, different recipes). Returns the chunks rewritten and
// the bytes of keyframes written (a dry run: the bytes of the keyframes their chains start
// from, an estimate: the new ones hold the same tensors a few steps on).
struct Rebased {
  size_t chunks = 0;
  uint64_t bytes = 0;
};
Expected<Rebased> RebaseVersion(Bucket& bucket, const Manifest& m,
                                const std::set<std::string>& old_versions, bool dry_run) {
  std::vector<std::pair<size_t, size_t>> todo;  // (file, chunk)
  for (size_t fi = 0; fi < m.files.size(); ++fi) {
    for (size_t ci = 0; ci < m.files[fi].chunks.size(); ++ci) {
      const ManifestChunk& c = m.files[fi].chunks[ci];
      if (c.is_delta() && old_versions.count(m.model + "@" + m.versions[c.base])) {
        todo.emplace_back(fi, ci);
      }
    }
  }
  if (todo.empty() || dry_run) {
    Rebased estimate{todo.size(), 0};
    for (const auto& [fi, ci] : todo) estimate.bytes += m.files[fi].chunks[ci].keyframe_bytes;
    return estimate;
  }
  Rebased done{todo.size(), 0};
  Manifest out = m;
  Materializer materializer(&bucket, nullptr);
  PackWriter packs(&bucket.store(), 32ull << 20, 2, 2);
  ChunkCodec codec;
  std::vector<uint8_t> payload;
  std::vector<PackSlot> slots;
  for (const auto& [fi, ci] : todo) {
    WFS_ASSIGN_OR_RETURN(ByteBuffer bytes, materializer.Chunk(m, m.files[fi], ci));
    const ManifestChunk& c = m.files[fi].chunks[ci];
    // Element type: a tensor chunk's payload header names it.
    DType dtype = DType::kOpaque;
    PayloadRef ref = c.ref;
    Expected<std::vector<uint8_t>> head =
        bucket.store().Get(Bucket::PackKey(m.packs[ref.pack]), ByteRange{ref.offset, kPayloadHeaderBytes});
    if (head.ok()) {
      if (Expected<PayloadInfo> info = ChunkCodec::Inspect(*head); info.ok()) dtype = info->dtype;
    }
    codec.EncodeFull(dtype, bytes, &payload);
    done.bytes += payload.size();
    WFS_ASSIGN_OR_RETURN(PackSlot slot, packs.Add(payload));
    slots.push_back(slot);
    ManifestChunk& e = out.files[fi].chunks[ci];
    e.encoding = static_cast<ChunkEncoding>(payload[5]);
    e.ref.offset = slot.offset;
    e.ref.length = payload.size();
    e.origin = 0;
    e.base = 0;
    e.depth = 0;
    e.chain_bytes = 0;
    e.keyframe_bytes = payload.size();
  }
  WFS_TRY(packs.Finish());
  // `log`'s STORED: the keyframes are this version's payloads now, in place of the deltas it
  // wrote itself (those it inherited were counted by the versions that wrote them).
  uint64_t replaced = 0;
  for (const auto& [fi, ci] : todo) {
    if (m.files[fi].chunks[ci].origin == 0) replaced += m.files[fi].chunks[ci].ref.length;
  }
  out.stats.stored_bytes = out.stats.stored_bytes - std::min(out.stats.stored_bytes, replaced) + done.bytes;
  for (size_t i = 0; i < todo.size(); ++i) {
    const auto& [fi, ci] = todo[i];
    out.files[fi].chunks[ci].ref.pack = out.PackIndex(packs.PackHash(slots[i].pack));
  }
  WFS_TRY(bucket.ReplaceManifest(out));
  spdlog::info("gc: rebased {} chunks of {}@{} onto new keyframes ({} bytes)", todo.size(), m.model, m.version,
               done.bytes);
  return done;
}

// Staged versions: the packs of their live part records are live; expired records go, and
// the staging objects of versions published since (their packs are the version's now).
Status CollectStaged(Bucket& bucket, const GcOptions& options, const std::vector<ObjectInfo>& objects,
                     const std::map<std::string, std::shared_ptr<const Manifest>>& manifests,
                     std::set<std::string>* live, GcReport* report) {
  Store& store = bucket.store();
  std::map<std::string, std::vector<const ObjectInfo*>> by_name;  // "model@version"
  for (const ObjectInfo& o : objects) {
    const std::string_view rest = std::string_view(o.key).substr(8);  // after "staging/"
    const size_t at = rest.find('@');
    const size_t slash = at == std::string_view::npos ? at : rest.find('/', at);
    if (slash == std::string_view::npos) continue;
    by_name[std::string(rest.substr(0, slash))].push_back(&o);
  }
  const int64_t now_ms = NowMs();
  for (const auto& [name, keys] : by_name) {
    const size_t at = name.rfind('@');
    const std::string model = name.substr(0, at), version = name.substr(at + 1);
    if (!ValidateModelName(model).ok() || !ValidateVersionName(version).ok()) continue;
    if (manifests.count(name)) {
      // Published: what is left of its staging is history (the publisher clears it too).
      for (const ObjectInfo* o : keys) {
        if (!options.dry_run && !store.Delete(o->key).ok()) continue;
        report->cleared_staging_objects++;
      }
      continue;
    }
    size_t kept = 0;
    std::vector<const ObjectInfo*> rest;
    for (const ObjectInfo* o : keys) {
      const std::string prefix = StagedVersion::Prefix(model, version) + "parts/";
      if (!o->key.starts_with(prefix)) {
        rest.push_back(o);
        continue;
      }
      Expected<std::vector<uint8_t>> bytes = store.Get(o->key);
      if (!bytes.ok()) {
        if (bytes.status().kind() == ErrorKind::kNotFound) continue;
        return bytes.status().WithContext("gc: reading a part record");
      }
      Expected<PartRecord> record = StagedVersion::ParseRecord(*bytes, model, version);
      if (!record.ok()) {
        // Unreadable: keep it (and nothing it may name is known); say so.
        spdlog::warn("gc: {}: {} (left alone)", o->key, record.status().ToString());
        kept++;
        continue;
      }
      if (now_ms - record->meta.created_ms >= options.staged_grace.count()) {
        report->expired_parts.push_back(name + " part " + record->meta.id);
        if (!options.dry_run) {
          Status d = store.Delete(o->key);
          if (!d.ok() && d.kind() != ErrorKind::kNotFound) return d.WithContext("gc");
          spdlog::info("gc: part {} of {} expired (in since {}): its record and packs go", record->meta.id, name,
                       FormatUtc(record->meta.created_ms));
        }
        continue;
      }
      kept++;
      for (const Hash128& p : record->manifest.packs) live->insert(Bucket::PackKey(p));
    }
    report->staged_parts += kept;
    if (kept > 0) {
      report->staged_versions++;
    } else if (!options.dry_run) {
      // The intent and a conflict note, once the intent is as old as the grace (a first part
      // may be between its intent and its record right now).
      StagedVersion staged(bucket, model, version);
      Expected<int64_t> since = staged.IntentCreatedMs();
      if (since.ok() && now_ms - *since < options.staged_grace.count()) continue;
      for (const ObjectInfo* o : rest) (void)store.Delete(o->key);
    }
  }
  return Status::Ok();
}

}  // namespace

Expected<GcReport> CollectGarbage(Bucket& bucket, const GcOptions& options) {
  GcReport report;
  Store& store = bucket.store();
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> pack_objects, ListAll(store, "packs/"));
  // Format 2 tables are collected like packs: unreferenced ones (a losing writer's, a rebased
  // version's old one) go once no push is live.
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> table_objects, ListAll(store, "tables/"));
  const size_t data_packs = pack_objects.size();
  pack_objects.insert(pack_objects.end(), table_objects.begin(), table_objects.end());
  WFS_ASSIGN_OR_RETURN(std::vector<TemporaryObject> temporaries, store.ListTemporaries());
  WFS_ASSIGN_OR_RETURN(std::vector<LeaseInfo> leases, ListLeases(store));
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> staging_objects, ListAll(store, "staging/"));
  WFS_ASSIGN_OR_RETURN(std::vector<VersionInfo> versions, bucket.ListVersions());
  report.versions = versions.size();
  report.packs = data_packs;

  std::map<std::string, std::shared_ptr<const Manifest>> manifests;  // "model@version"
  std::map<std::string, std::vector<std::shared_ptr<const Manifest>>> by_model;
  for (const VersionInfo& v : versions) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m, bucket.ReadManifest(v.model, v.version));
    manifests[v.model + "@" + v.version] = m;
    by_model[v.model].push_back(m);
  }

  // Retire old versions. A kept version needs another version's manifest only where one of
  // its delta recipes has its base there (inherited keyframe payloads need only their packs).
  std::set<std::string> retire;
  if (options.keep_last) {
    // (Format 2 keeps the rows in the version's table: read one version's at a time.)
    auto bases_of = [&](const Manifest& head) -> Expected<std::set<std::string>> {
      WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m, bucket.ReadFullManifest(head.model, head.version));
      std::set<std::string> out;
      for (const ManifestFile& f : m->files) {
        for (const ManifestChunk& c : f.chunks) {
          if (c.is_delta()) out.insert(m->model + "@" + m->versions[c.base]);
        }
      }
      return out;
    };
    std::set<std::string> old_versions;
    std::vector<std::shared_ptr<const Manifest>> kept;  // oldest first within each model
    for (auto& [model, list] : by_model) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) {
        return std::tie(a->created_ms, a->version) > std::tie(b->created_ms, b->version);
      });
      const size_t n = std::min(list.size(), *options.keep_last);
      for (size_t i = n; i-- > 0;) kept.push_back(list[i]);
      for (size_t i = n; i < list.size(); ++i) old_versions.insert(model + "@" + list[i]->version);
    }
    if (options.rebase) {
      // Rebase: every delta of a kept version whose base is an old version becomes a keyframe,
      // so no kept version needs an old one any more. Oldest kept first; a kept version's
      // deltas on another kept version stay (that base stays).
      for (const auto& m : kept) {
        WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> full, bucket.ReadFullManifest(m->model, m->version));
        WFS_ASSIGN_OR_RETURN(Rebased rebased, RebaseVersion(bucket, *full, old_versions, options.dry_run));
        if (rebased.chunks) {
          report.rebased.push_back(m->model + "@" + m->version + " (" + std::to_string(rebased.chunks) +
                                   " chunks now keyframes)");
          report.rebased_bytes += rebased.bytes;
          if (!options.dry_run) {
            WFS_ASSIGN_OR_RETURN(manifests[m->model + "@" + m->version],
                                 bucket.ReadManifest(m->model, m->version));
          }
        }
      }
    }
    if (!report.rebased.empty() && !options.dry_run) {
      // The leases again, after the rewrites: a push that started since may be encoding on a
      // kept version's old rows. Its lease keeps every pack and table (below); when it
      // publishes it takes its inherited rows from the new head (Bucket::PublishManifest). A
      // push whose lease comes after this listing read the new head already.
      WFS_ASSIGN_OR_RETURN(std::vector<LeaseInfo> again, ListLeases(store));
      for (LeaseInfo& l : again) {
        if (std::none_of(leases.begin(), leases.end(), [&](const LeaseInfo& o) { return o.key == l.key; })) {
          leases.push_back(std::move(l));
        }
      }
    }
    std::set<std::string> needed;
    std::vector<std::string> stack;
    for (const auto& m : kept) stack.push_back(m->model + "@" + m->version);
    while (!stack.empty()) {
      std::string name = stack.back();
      stack.pop_back();
      if (!needed.insert(name).second) continue;
      auto it = manifests.find(name);
      if (it == manifests.end()) continue;
      if (options.rebase && options.dry_run && old_versions.count(name) == 0) continue;
      WFS_ASSIGN_OR_RETURN(std::set<std::string> bases, bases_of(*it->second));
      for (const std::string& b : bases) stack.push_back(b);
    }
    for (const std::string& name : old_versions) {
      if (needed.count(name)) {
        report.kept_as_base.push_back(name);
      } else {
        retire.insert(name);
        report.retired.push_back(name);
      }
    }
  }
  if (!options.dry_run) {
    for (const std::string& name : retire) {
      const Manifest& m = *manifests[name];
      Status s = store.Delete(Bucket::ManifestKey(m.model, m.version));
      if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("retiring " + name);
      // Its time marker after it (a marker without its version is ignored; not the reverse).
      (void)store.Delete(Bucket::TimeKey(m.model, m.version, m.created_ms));
      bucket.Forget(m.model, m.version);
      spdlog::info("gc: retired {}", name);
    }
  }

  std::set<std::string> live;
  WFS_TRY(CollectStaged(bucket, options, staging_objects, manifests, &live, &report));
  for (const auto& [name, m] : manifests) {
    if (retire.count(name)) continue;
    for (const Hash128& p : m->packs) live.insert(Bucket::PackKey(p));
    if (m->format == kManifestFormat2) live.insert(Bucket::TableKey(m->table));
  }
  for (const LeaseInfo& l : leases) {
    if (l.alive) {
      report.live_leases++;
      report.live_lease_names.push_back(l.what + " (" + l.host + " pid " + std::to_string(l.pid) + ")");
    } else if (!options.dry_run) {
      if (store.Delete(l.key).ok()) report.dead_leases_removed++;
    }
  }
  for (const ObjectInfo& o : pack_objects) {
    const bool table = o.key.starts_with("tables/");
    if (live.count(o.key)) {
      (table ? report.live_tables : report.live_packs)++;
      continue;
    }
    if (report.live_leases > 0) continue;  // a push in progress may still reference it
    (table ? report.deleted_tables : report.deleted_packs)++;
    report.deleted_bytes += o.size;
    if (!options.dry_run) {
      Status s = store.Delete(o.key);
      if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("gc");
    }
  }
  report.temporaries = temporaries.size();
  const int64_t now_ms = NowMs();
  for (const TemporaryObject& t : temporaries) {
    if (report.live_leases > 0) continue;  // a push in progress may be writing it
    if (t.modified_ms <= 0 || now_ms - t.modified_ms < options.temporary_min_age.count()) {
      report.recent_temporaries++;  // (an unknown age counts as recent)
      continue;
    }
    report.deleted_temporaries++;
    report.deleted_temporary_bytes += t.size;
    if (!options.dry_run) {
      Status s = store.Delete(t.key);
      if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("gc");
    }
  }
  if (report.deleted_temporaries) {
    spdlog::info("gc: {} {} temporary objects ({} bytes) left by interrupted writes",
                 options.dry_run ? "would remove" : "removed", report.deleted_temporaries,
                 report.deleted_temporary_bytes);
  }
  return report;
}

}  // namespace weightfs
