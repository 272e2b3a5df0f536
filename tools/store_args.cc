#include "tools/store_args.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>


namespace weightfs::cli {

const std::vector<std::string> kSharedCacheValues = {"--shared-cache", "--shared-cache-size",
                                                      "--shared-cache-endpoint"};

const char* const kSharedCacheHelp = R"(  --shared-cache URL   read the bucket's packs, tables and heads through a store every
                       node of the cluster reaches (s3://, http(s):// WebDAV, or a
                       directory on NFS/Lustre): the first node to need an object
                       fetches it from the bucket and puts it there, the others read
                       it from there. Everything read from it is checked; a tier that
                       is down or damaged costs speed, never a wrong byte or an error
                       (docs/shared-cache.md)
  --shared-cache-size BYTES  keep the tier under this (objects filled longest ago
                       are removed); default: unbounded, for the store's own
                       lifecycle rules to bound
  --shared-cache-endpoint URL  S3 endpoint of an s3:// tier          [--endpoint]
)";

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
  so.s3_no_sign_request = args.Has("--no-sign-request");
  if (auto t = args.Get("--timeout")) {
    WFS_ASSIGN_OR_RETURN(double seconds, ParseDouble(*t));
    so.http.total_timeout = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
    so.http.stall_timeout = std::min(so.http.stall_timeout, so.http.total_timeout);
    so.http.connect_timeout = std::min(so.http.connect_timeout, so.http.total_timeout);
  }
  so.shared_cache = args.GetOr("--shared-cache", "");
  so.shared_cache_endpoint = args.GetOr("--shared-cache-endpoint", "");
  if (auto s = args.Get("--shared-cache-size")) {
    WFS_ASSIGN_OR_RETURN(so.shared_cache_size, ParseSize(*s));
    if (so.shared_cache.empty()) return Status::InvalidArgument("--shared-cache-size needs --shared-cache URL");
  }
  return so;
}

}  // namespace weightfs::cli
