#include "tools/store_args.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>


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

}  // namespace weightfs::cli
