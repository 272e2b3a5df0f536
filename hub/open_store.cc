#include "hub/open_store.h"

#include "hub/local_store.h"
#include "hub/s3_store.h"
#include "hub/webdav_store.h"

namespace weightfs {

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
    WFS_ASSIGN_OR_RETURN(inner, OpenS3Store(url, s3, out.http));
  } else if (url.find("://") != std::string_view::npos && !url.starts_with("file://")) {
    return Status::InvalidArgument("unsupported bucket URL '" + std::string(url) +
                                   "' (use a path, file://, http(s):// or s3://)");
  } else {
    std::string path(url.starts_with("file://") ? url.substr(7) : url);
    if (path.empty()) return Status::InvalidArgument("empty bucket path");
    WFS_ASSIGN_OR_RETURN(std::unique_ptr<LocalStore> local, LocalStore::Open(path));
    inner = std::move(local);
  }
  out.store = std::make_shared<CountingStore>(std::move(inner));
  return out;
}

}  // namespace weightfs
