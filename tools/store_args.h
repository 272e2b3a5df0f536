// Options every command that opens a bucket shares (--endpoint, --region, --timeout) and the
// default cache directory; the URL itself is opened by OpenBucketUrl (hub/open_bucket.h).
// Pure functions of their inputs and the environment; thread-safe.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "hub/open_bucket.h"
#include "hub/open_store.h"
#include "tools/cli.h"

namespace weightfs::cli {

// $WEIGHTFS_CACHE_DIR, else $XDG_CACHE_HOME/weightfs, else ~/.cache/weightfs.
std::string DefaultCacheDir();

// StoreOptions from --endpoint, --region, --timeout SECONDS and, for the commands that read
// (mount, pull, cat, patch), --shared-cache URL, --shared-cache-size, --shared-cache-endpoint.
Expected<StoreOptions> StoreOptionsFromArgs(const ArgParser& args);

// The options of the shared cache tier, for the commands that take them: their names and help.
extern const std::vector<std::string> kSharedCacheValues;
extern const char* const kSharedCacheHelp;

}  // namespace weightfs::cli
