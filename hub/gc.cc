#include "hub/gc.h"

#include <algorithm>
#include <map>
#include <set>

#include <spdlog/spdlog.h>

#include "hub/lease.h"

namespace weightfs {

Expected<GcReport> CollectGarbage(Bucket& bucket, const GcOptions& options) {
  GcReport report;
  Store& store = bucket.store();
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> pack_objects, ListAll(store, "packs/"));
  WFS_ASSIGN_OR_RETURN(std::vector<LeaseInfo> leases, ListLeases(store));
  WFS_ASSIGN_OR_RETURN(std::vector<VersionInfo> versions, bucket.ListVersions());
  report.versions = versions.size();
  report.packs = pack_objects.size();

  std::map<std::string, std::shared_ptr<const Manifest>> manifests;  // "model@version"
  std::map<std::string, std::vector<std::shared_ptr<const Manifest>>> by_model;
  for (const VersionInfo& v : versions) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m, bucket.ReadManifest(v.model, v.version));
    manifests[v.model + "@" + v.version] = m;
    by_model[v.model].push_back(m);
  }

  // Retire old versions that nothing kept depends on.
  std::set<std::string> retire;
  if (options.keep_last) {
    std::set<std::string> needed;
    std::vector<std::string> stack;
    for (auto& [model, list] : by_model) {
      std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) {
        return std::tie(a->created_ms, a->version) > std::tie(b->created_ms, b->version);
      });
      for (size_t i = 0; i < list.size() && i < *options.keep_last; ++i) {
        stack.push_back(model + "@" + list[i]->version);
      }
    }
    while (!stack.empty()) {
      std::string name = stack.back();
      stack.pop_back();
      if (!needed.insert(name).second) continue;
      auto it = manifests.find(name);
      if (it == manifests.end()) continue;
      for (const std::string& v : it->second->versions) stack.push_back(it->second->model + "@" + v);
    }
    for (auto& [model, list] : by_model) {
      for (size_t i = *options.keep_last; i < list.size(); ++i) {
        std::string name = model + "@" + list[i]->version;
        if (needed.count(name)) {
          report.kept_as_base.push_back(name);
        } else {
          retire.insert(name);
          report.retired.push_back(name);
        }
      }
    }
  }
  if (!options.dry_run) {
    for (const std::string& name : retire) {
      const Manifest& m = *manifests[name];
      Status s = store.Delete(Bucket::ManifestKey(m.model, m.version));
      if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("retiring " + name);
      bucket.Forget(m.model, m.version);
      spdlog::info("gc: retired {}", name);
    }
  }

  std::set<std::string> live;
  for (const auto& [name, m] : manifests) {
    if (retire.count(name)) continue;
    for (const Hash128& p : m->packs) live.insert(Bucket::PackKey(p));
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
    if (live.count(o.key)) {
      report.live_packs++;
      continue;
    }
    if (report.live_leases > 0) continue;  // a push in progress may still reference it
    report.deleted_packs++;
    report.deleted_bytes += o.size;
    if (!options.dry_run) {
      Status s = store.Delete(o.key);
      if (!s.ok() && s.kind() != ErrorKind::kNotFound) return s.WithContext("gc");
    }
  }
  return report;
}

}  // namespace weightfs
