#include "hub/open_store.h"

#include <algorithm>

#include "hub/engine/shared_tier.h"
#include "hub/hf/hf_bucket_store.h"
#include "hub/hf/hf_api.h"
#include "hub/store/local_store.h"
#include "hub/store/s3_store.h"
#include "hub/store/webdav_store.h"

namespace weightfs {

std::shared_ptr<Store> OpenedStore::reads() const {
  if (shared) return shared;
  return store;
}

Expected<OpenedStore> OpenStore(std::string_view url, const StoreOptions& options) {
  OpenedStore out;
  std::shared_ptr<Store> inner;
  if (url.starts_with("http://") || url.starts_with("https://")) {
    out.http = std::make_shared<HttpClient>(options.http);
    WFS_ASSIGN_OR_RETURN(inner, OpenWebDavStore(url, out.http));
  } else if (url.starts_with("s3://")) {
    out.http = std::make_shared<HttpClient>(options.http);
    S3Options s3;
    s3.endpoint = options.s3_endpoint;
    s3.region = options.s3_region;
    s3.no_sign_request = options.s3_no_sign_request;
    WFS_ASSIGN_OR_RETURN(inner, OpenS3Store(url, s3, out.http));
  } else if (url.starts_with("hf://buckets/")) {
    out.http = std::make_shared<HttpClient>(options.http);
    WFS_ASSIGN_OR_RETURN(HfConfig config, LoadHfConfig());
    HfBucketOptions hf;
    hf.s3_endpoint = options.s3_endpoint;  // --endpoint: the S3 gateway's base
    hf.s3.region = options.s3_region;
    WFS_ASSIGN_OR_RETURN(inner, OpenHfBucketStore(url, config, hf, out.http));
  } else if (url.starts_with("hf://")) {
    return Status::InvalidArgument("'" + std::string(url.substr(0, 200)) +
                                   "' is a Hugging Face model repo, not a bucket; a bucket is "
                                   "hf://buckets/NAMESPACE/NAME[/PREFIX]");
  } else if (url.find("://") != std::string_view::npos && !url.starts_with("file://")) {
    return Status::InvalidArgument("unsupported bucket URL '" + std::string(url) +
                                   "' (use a path, file://, http(s)://, s3:// or hf://buckets/)");
  } else {
    std::string path(url.starts_with("file://") ? url.substr(7) : url);
    if (path.empty()) return Status::InvalidArgument("empty bucket path");
    // "s3:/bucket", "https:host/x": a URL with its "//" missing, not a directory named "s3:" (a
    // path that means one starts with ./).
    static constexpr std::string_view kSchemes[] = {"s3", "http", "https", "hf", "file", "gs", "az", "webdav"};
    if (const size_t colon = path.find(':'); colon != std::string::npos && colon < path.find('/')) {
      const std::string_view scheme = std::string_view(path).substr(0, colon);
      if (std::find(std::begin(kSchemes), std::end(kSchemes), scheme) != std::end(kSchemes)) {
        std::string rest = path.substr(colon + 1);
        while (rest.starts_with("/")) rest.erase(0, 1);
        return Status::InvalidArgument("'" + path.substr(0, 200) + "' looks like a URL with its '//' missing; did you mean " +
                                       std::string(scheme) + "://" + rest.substr(0, 200) +
                                       "? (for a local directory of that name, write ./" + path.substr(0, 200) + ")");
      }
    }
    WFS_ASSIGN_OR_RETURN(std::unique_ptr<LocalStore> local, LocalStore::Open(path));
    inner = std::move(local);
  }
  out.store = std::make_shared<CountingStore>(std::move(inner));
  return out;
}

}  // namespace weightfs
