// Options every command that opens a bucket shares (--endpoint, --region, --timeout) and the
// default cache directory; the URL itself is opened by OpenBucketUrl (sources/open_bucket.h).
// Pure functions of their inputs and the environment; thread-safe.
#pragma once

#include <string>

#include "core/status.h"
#include "sources/open_bucket.h"
#include "sources/open_store.h"
#include "tools/cli.h"

namespace weightfs::cli {

// $WEIGHTFS_CACHE_DIR, else $XDG_CACHE_HOME/weightfs, else ~/.cache/weightfs.
std::string DefaultCacheDir();

// StoreOptions from --endpoint, --region and --timeout SECONDS.
Expected<StoreOptions> StoreOptionsFromArgs(const ArgParser& args);

}  // namespace weightfs::cli
