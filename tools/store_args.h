// Options every command that opens a bucket shares (--endpoint, --region, --timeout) and the
// default cache directory. Pure functions of their inputs and the environment; thread-safe.
#pragma once

#include <memory>
#include <string>

#include "core/status.h"
#include "engine/bucket.h"
#include "sources/open_store.h"
#include "tools/cli.h"

namespace weightfs::cli {

// $WEIGHTFS_CACHE_DIR, else $XDG_CACHE_HOME/weightfs, else ~/.cache/weightfs.
std::string DefaultCacheDir();

// StoreOptions from --endpoint, --region and --timeout SECONDS.
Expected<StoreOptions> StoreOptionsFromArgs(const ArgParser& args);

struct OpenedBucket {
  OpenedStore store;
  std::unique_ptr<Bucket> bucket;
};

// The bucket at `url` for reading and, when it is a weightfs bucket, writing:
//   - hf://ORG/REPO[@REVISION]: the model repo revision as one read-only version REPO@REVISION
//     (Hugging Face conventions: HF_ENDPOINT, HF_TOKEN / token file, HF_HUB_CACHE);
//   - any other URL (sources/open_store.h): a weightfs bucket, or with `any_layout` also a TRL
//     delta-sync bucket shown read-only (sources/open_bucket.h), its model named `trl_model` or
//     after the URL.
// Recipes that read a base model from a Hugging Face repo (engine/external_source.h) read it
// through the same client, from the local Hugging Face cache when the file is there.
Expected<OpenedBucket> OpenBucketUrl(const std::string& url, const StoreOptions& options, bool any_layout,
                                     const std::string& trl_model = "");

}  // namespace weightfs::cli
