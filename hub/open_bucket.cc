#include "hub/open_bucket.h"

#include <algorithm>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "core/manifest.h"
#include "hub/engine/shared_tier.h"
#include "hub/hf/hf_api.h"
#include "hub/hf/hf_repo.h"

namespace weightfs {

std::string TrlModelNameFromUrl(std::string_view url) {
  if (size_t q = url.find_first_of("?#"); q != std::string_view::npos) url = url.substr(0, q);
  if (size_t scheme = url.find("://"); scheme != std::string_view::npos) url = url.substr(scheme + 3);
  while (!url.empty() && url.back() == '/') url.remove_suffix(1);
  std::string_view last = url.substr(url.rfind('/') == std::string_view::npos ? 0 : url.rfind('/') + 1);
  std::string out;
  for (char c : last.substr(0, 128)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '_' || c == '-';
    out += ok ? c : '-';
  }
  if (!ValidateModelName(out).ok()) return "trl";
  return out;
}

Expected<std::unique_ptr<Bucket>> OpenBucketAnyLayout(std::shared_ptr<Store> store, std::string_view url,
                                                      std::string_view trl_model,
                                                      const TrlOptions& trl_options) {
  Expected<std::unique_ptr<Bucket>> bucket = Bucket::Open(store);
  if (bucket.ok() || bucket.status().kind() != ErrorKind::kNotFound) return bucket;
  const std::string model = trl_model.empty() ? TrlModelNameFromUrl(url) : std::string(trl_model);
  Expected<std::shared_ptr<TrlVersions>> trl = OpenTrlVersions(store, model, trl_options);
  if (!trl.ok()) {
    if (trl.status().kind() == ErrorKind::kNotFound) {
      return Status::NotFound(bucket.status().message() + " to make it a weightfs bucket (it is not a TRL "
                              "delta-sync bucket either: no anchors/step_NNNNNN.safetensors or "
                              "deltas/step_NNNNNN.safetensors)");
    }
    return trl.status().WithContext("reading " + store->Describe() + " as a TRL delta-sync bucket");
  }
  return Bucket::FromDerived(std::move(store), std::move(trl).value());
}

namespace {

// The store under a bucket that is only a view of something else (a Hugging Face model repo):
// it holds nothing and refuses writes.
class ViewStore : public Store {
 public:
  explicit ViewStore(std::string url) : url_(std::move(url)) {}
  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange>) override {
    return Status::NotFound(std::string(key) + " (" + url_ + " is read-only and holds no weightfs objects)");
  }
  Status Put(std::string_view, std::span<const uint8_t>, PutMode) override { return ReadOnly(); }
  Expected<ObjectInfo> Head(std::string_view key) override { return Get(key, std::nullopt).status(); }
  Expected<ListPage> List(std::string_view, std::string_view, size_t) override { return ListPage{}; }
  Status Delete(std::string_view) override { return ReadOnly(); }
  std::string Describe() const override { return url_; }

 private:
  Status ReadOnly() const { return Status::Unsupported(url_ + " is a model repo, read-only"); }
  std::string url_;
};

bool IsHfRepoUrl(const std::string& url) { return url.starts_with("hf://") && !url.starts_with("hf://buckets/"); }

// The shared tier of --shared-cache in front of `opened`'s bucket. Its requests fail fast (a
// tier that is down or slow must cost little: the read then goes to the bucket).
Status OpenSharedTier(const std::string& url, const StoreOptions& options, OpenedStore* opened) {
  StoreOptions tier_options;
  tier_options.s3_endpoint = options.shared_cache_endpoint.empty() ? options.s3_endpoint : options.shared_cache_endpoint;
  tier_options.s3_region = options.s3_region;
  tier_options.s3_no_sign_request = options.s3_no_sign_request;
  tier_options.http = options.http;
  tier_options.http.connect_timeout = std::min(tier_options.http.connect_timeout, std::chrono::milliseconds(2'000));
  tier_options.http.stall_timeout = std::min(tier_options.http.stall_timeout, std::chrono::milliseconds(5'000));
  tier_options.http.total_timeout = std::min(tier_options.http.total_timeout, std::chrono::milliseconds(15'000));
  tier_options.http.max_attempts = 2;
  // A directory (on a shared file system) is made if it is not there yet: it is a cache, not a
  // bucket to `init`.
  const std::string& dir = options.shared_cache;
  if (dir.find("://") == std::string::npos || dir.starts_with("file://")) {
    std::error_code ec;
    std::filesystem::create_directories(dir.starts_with("file://") ? dir.substr(7) : dir, ec);
    if (ec) return Status::IOError("--shared-cache " + dir + ": cannot make the directory: " + ec.message());
  }
  Expected<OpenedStore> tier = OpenStore(options.shared_cache, tier_options);
  if (!tier.ok()) return tier.status().WithContext("--shared-cache " + options.shared_cache);
  SharedTierOptions shared;
  shared.max_bytes = options.shared_cache_size;
  opened->tier = tier->store;
  opened->shared = std::make_shared<SharedTierStore>(opened->store, tier->store, url, shared);
  spdlog::info("reading {} through the shared cache {}", opened->store->Describe(), tier->store->Describe());
  return Status::Ok();
}

}  // namespace

Expected<OpenedBucket> OpenBucketUrl(const std::string& url, const StoreOptions& options, bool any_layout,
                                     const std::string& trl_model) {
  OpenedBucket out;
  Expected<HfConfig> hf = LoadHfConfig();
  if (IsHfRepoUrl(url)) {
    if (!hf.ok()) return hf.status();
    WFS_ASSIGN_OR_RETURN(HfRepoRef ref, ParseHfRepoUrl(url));
    out.store.http = std::make_shared<HttpClient>(options.http);
    WFS_ASSIGN_OR_RETURN(std::shared_ptr<DerivedVersions> repo,
                         OpenHfRepoVersions(*hf, out.store.http, ref.repo, ref.revision));
    out.store.store = std::make_shared<CountingStore>(std::make_shared<ViewStore>(url));
    out.bucket = Bucket::FromDerived(out.store.store, std::move(repo));
  } else {
    WFS_ASSIGN_OR_RETURN(out.store, OpenStore(url, options));
    if (!options.shared_cache.empty()) WFS_TRY(OpenSharedTier(url, options, &out.store));
    if (any_layout) {
      WFS_ASSIGN_OR_RETURN(out.bucket, OpenBucketAnyLayout(out.store.reads(), url, trl_model));
    } else {
      WFS_ASSIGN_OR_RETURN(out.bucket, Bucket::Open(out.store.reads()));
    }
  }
  if (hf.ok()) {
    std::shared_ptr<HttpClient> http = out.store.http ? out.store.http : std::make_shared<HttpClient>(options.http);
    out.bucket->set_external_sources(std::make_shared<HfSources>(*hf, std::move(http)));
  } else {
    spdlog::warn("base models in Hugging Face repos cannot be read: {}", hf.status().ToString());
  }
  return out;
}

}  // namespace weightfs
