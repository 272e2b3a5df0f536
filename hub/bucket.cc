#include "hub/bucket.h"

#include <algorithm>
#include <atomic>
#include <system_error>
#include <thread>

#include <nlohmann/json.hpp>

namespace weightfs {

Expected<std::vector<ObjectInfo>> ListAll(Store& store, std::string_view prefix) {
  std::vector<ObjectInfo> all;
  std::string continuation;
  while (true) {
    WFS_ASSIGN_OR_RETURN(ListPage page, store.List(prefix, continuation));
    for (ObjectInfo& o : page.objects) all.push_back(std::move(o));
    if (page.continuation.empty()) break;
    if (page.continuation == continuation) return Status::IOError("listing does not advance");
    continuation = std::move(page.continuation);
  }
  return all;
}

Status Bucket::Init(Store& store) {
  std::string marker = nlohmann::json{{"format", kManifestFormat}}.dump() + "\n";
  Status s = store.Put(kMarkerKey, {reinterpret_cast<const uint8_t*>(marker.data()), marker.size()},
                       PutMode::kCreateIfAbsent);
  if (s.kind() != ErrorKind::kConflict) return s;
  // Already a bucket: fine if it is ours.
  std::shared_ptr<Store> unowned(&store, [](Store*) {});
  return Open(unowned).status();
}

Expected<std::unique_ptr<Bucket>> Bucket::Open(std::shared_ptr<Store> store) {
  Expected<std::vector<uint8_t>> marker = store->Get(kMarkerKey);
  if (!marker.ok()) {
    if (marker.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound("bucket " + store->Describe() +
                              " has no weightfs.json; run `weightfs init " + store->Describe() + "`");
    }
    return marker.status().WithContext("opening bucket " + store->Describe());
  }
  nlohmann::json j = nlohmann::json::parse(marker->begin(), marker->end(), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("format") ||
      !j["format"].is_number_integer()) {
    return Status::Corruption("bucket " + store->Describe() + ": weightfs.json is not valid");
  }
  if (j["format"].get<int64_t>() != kManifestFormat) {
    return Status::Unsupported("bucket " + store->Describe() + " has format " +
                               j["format"].dump() + "; this weightfs reads format 1");
  }
  return std::unique_ptr<Bucket>(new Bucket(std::move(store)));
}

std::unique_ptr<Bucket> Bucket::FromDerived(std::shared_ptr<Store> store,
                                           std::shared_ptr<DerivedVersions> derived) {
  std::unique_ptr<Bucket> b(new Bucket(std::move(store)));
  b->derived_ = std::move(derived);
  return b;
}

std::string Bucket::ManifestKey(std::string_view model, std::string_view version) {
  return "models/" + std::string(model) + "/versions/" + std::string(version) + ".json";
}

Expected<std::vector<VersionInfo>> Bucket::ListVersions(std::string_view model) {
  if (derived_) return derived_->ListVersions(model);
  std::string prefix = "models/";
  if (!model.empty()) {
    WFS_TRY(ValidateModelName(model));
    prefix += std::string(model) + "/";
  }
  WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> objects, ListAll(*store_, prefix));
  std::vector<VersionInfo> out;
  for (const ObjectInfo& o : objects) {
    // models/<model>/versions/<version>.json; anything else under models/ is ignored.
    std::string_view key = o.key;
    constexpr std::string_view kMid = "/versions/";
    size_t mid = key.rfind(kMid);
    if (mid == std::string_view::npos || mid < 7 || !key.ends_with(".json")) continue;
    std::string_view m = key.substr(7, mid - 7);
    std::string_view v = key.substr(mid + kMid.size(), key.size() - mid - kMid.size() - 5);
    if (!ValidateModelName(m).ok() || !ValidateVersionName(v).ok()) continue;
    if (!model.empty() && m != model) continue;  // a sub-organisation's models, not this one
    out.push_back({std::string(m), std::string(v)});
  }
  std::sort(out.begin(), out.end(), [](const VersionInfo& a, const VersionInfo& b) {
    return std::tie(a.model, a.version) < std::tie(b.model, b.version);
  });
  return out;
}

Expected<std::shared_ptr<const Manifest>> Bucket::ReadManifest(std::string_view model,
                                                               std::string_view version) {
  WFS_TRY(ValidateModelName(model));
  WFS_TRY(ValidateVersionName(version));
  if (derived_) return derived_->ReadManifest(model, version);
  const std::string key = ManifestKey(model, version);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = manifests_.find(key);
    if (it != manifests_.end()) return it->second;
  }
  // A stored manifest is its JSON or a zstd frame of it (at worst slightly larger): an object
  // beyond that is refused without being read whole.
  const uint64_t max_json = std::min<uint64_t>(max_manifest_json_bytes_, 1ull << 50);
  const uint64_t max_object = max_json + (max_json >> 7) + (1 << 20);
  Expected<std::vector<uint8_t>> bytes = store_->Get(key, ByteRange{0, max_object + 1});
  if (!bytes.ok()) {
    if (bytes.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound("version " + std::string(model) + "@" + std::string(version) +
                              " does not exist in " + store_->Describe());
    }
    return bytes.status();
  }
  if (bytes->size() > max_object) {
    return Status::ResourceExhausted("manifest " + std::string(model) + "@" + std::string(version) + ": " +
                                     store_->Describe() + "/" + key + " holds more than " +
                                     std::to_string(max_object) + " bytes, more than a manifest of at most " +
                                     std::to_string(max_manifest_json_bytes_) + " bytes of JSON can");
  }
  Expected<Manifest> parsed = ParseManifest(*bytes, model, version, max_manifest_json_bytes_);
  if (!parsed.ok()) return parsed.status().WithContext(store_->Describe() + "/" + key);
  auto shared = std::make_shared<const Manifest>(std::move(parsed).value());
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = manifests_.emplace(key, shared);
  if (inserted) {
    manifest_order_.push_back(key);
    while (manifest_order_.size() > kMaxCachedManifests) {
      manifests_.erase(manifest_order_.front());
      manifest_order_.pop_front();
    }
  }
  return it->second;
}

void Bucket::PrefetchManifests(std::string_view model, std::span<const std::string> versions) {
  if (derived_) return;
  std::vector<std::string_view> missing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& v : versions) {
      if (!manifests_.count(ManifestKey(model, v))) missing.push_back(v);
    }
  }
  if (missing.size() < 2) return;  // the walk reads one as fast
  missing.resize(std::min(missing.size(), kMaxCachedManifests / 2));
  std::atomic<size_t> next{0};
  // Runs on threads of its own: nothing may escape. An error (an allocation failing included)
  // is left to the ReadManifest that needs the manifest.
  auto work = [&]() noexcept {
    for (size_t i; (i = next.fetch_add(1)) < missing.size();) {
      try {
        (void)ReadManifest(model, missing[i]);
      } catch (...) {
      }
    }
  };
  std::vector<std::thread> threads;
  try {
    threads.reserve(8);
    for (size_t t = 1; t < std::min<size_t>(missing.size(), 8); ++t) threads.emplace_back(work);
  } catch (const std::exception&) {
    // Fewer threads: this one does the rest.
  }
  work();
  for (std::thread& t : threads) t.join();
}

void Bucket::Forget(std::string_view model, std::string_view version) {
  const std::string key = ManifestKey(model, version);
  std::lock_guard<std::mutex> lock(mu_);
  if (manifests_.erase(key)) manifest_order_.remove(key);
}

Status Bucket::PublishManifest(const Manifest& manifest) {
  if (derived_) {
    return Status::Unsupported("bucket " + store_->Describe() +
                               " is not a weightfs bucket (its versions are derived from another "
                               "layout) and is read-only; `weightfs import` it into one");
  }
  std::vector<uint8_t> bytes = SerializeManifest(manifest);
  Status s = store_->Put(ManifestKey(manifest.model, manifest.version), bytes,
                         PutMode::kCreateIfAbsent);
  if (s.kind() == ErrorKind::kConflict) {
    return Status::Conflict("version " + manifest.model + "@" + manifest.version +
                            " was already published in " + store_->Describe() +
                            " (another writer won); push under another version name");
  }
  return s;
}

Expected<std::shared_ptr<const Manifest>> Bucket::Latest(std::string_view model) {
  WFS_ASSIGN_OR_RETURN(std::vector<VersionInfo> versions, ListVersions(model));
  std::shared_ptr<const Manifest> best;
  for (const VersionInfo& v : versions) {
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<const Manifest> m, ReadManifest(v.model, v.version));
    if (!best || std::tie(m->created_ms, m->version) > std::tie(best->created_ms, best->version)) {
      best = m;
    }
  }
  if (!best) return Status::NotFound("model " + std::string(model) + " has no versions in " + store_->Describe());
  return best;
}

}  // namespace weightfs
