#include "tools/store_args.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>

#include <spdlog/spdlog.h>

#include "sources/hf/hf_hub.h"
#include "sources/hf/hf_repo.h"
#include "sources/open_bucket.h"

namespace weightfs::cli {

std::string DefaultCacheDir() {
  if (const char* d = std::getenv("WEIGHTFS_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/weightfs";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/weightfs";
  return "/tmp/weightfs-cache";
}

Expected<StoreOptions> StoreOptionsFromArgs(const ArgParser& args) {
  StoreOptions so;
  so.s3_endpoint = args.GetOr("--endpoint", "");
  so.s3_region = args.GetOr("--region", "");
  if (auto t = args.Get("--timeout")) {
    WFS_ASSIGN_OR_RETURN(double seconds, ParseDouble(*t));
    so.http.total_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    so.http.stall_timeout = std::min(so.http.stall_timeout, so.http.total_timeout);
    so.http.connect_timeout = std::min(so.http.connect_timeout, so.http.total_timeout);
  }
  return so;
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
    if (any_layout) {
      WFS_ASSIGN_OR_RETURN(out.bucket, OpenBucketAnyLayout(out.store.store, url, trl_model));
    } else {
      WFS_ASSIGN_OR_RETURN(out.bucket, Bucket::Open(out.store.store));
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

}  // namespace weightfs::cli
