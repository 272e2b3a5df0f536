// OpenBucketUrl: a bucket from a URL (any source). OpenBucketAnyLayout: the Bucket for a store in any layout weightfs reads — a weightfs bucket
// (weightfs.json), or else a TRL delta-sync bucket (hub/trl/trl_bucket.h) shown read-only as the
// versions MODEL@step-N of one model.
//
// The TRL model's name is `trl_model` when given, else the last path component of `url`
// ("s3://b/runs/qwen-grpo" -> "qwen-grpo", "hf://buckets/org/name" -> "name") made a valid
// model name (TrlModelNameFromUrl). A store in neither layout gets NotFound saying both what
// `weightfs init` does and what a TRL layout looks like. Thread-safe (no shared state).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "hub/engine/bucket.h"
#include "hub/open_store.h"
#include "hub/trl/trl_bucket.h"
#include "hub/store/store.h"

namespace weightfs {

struct OpenedBucket {
  OpenedStore store;
  std::unique_ptr<Bucket> bucket;
};

// The one entry point from a URL: the bucket at `url` for reading and, when it is a weightfs
// bucket, writing:
//   - hf://ORG/REPO[@REVISION]: the model repo revision as one read-only version REPO@REVISION
//     (Hugging Face conventions: HF_ENDPOINT, HF_TOKEN / token file, HF_HUB_CACHE);
//   - any other URL (hub/open_store.h): a weightfs bucket, or with `any_layout` also a TRL
//     delta-sync bucket shown read-only (OpenBucketAnyLayout), its model named `trl_model` or
//     after the URL.
// Recipes that read a base model from a Hugging Face repo (hub/engine/external_source.h) read it
// through the same client, from the local Hugging Face cache when the file is there.
Expected<OpenedBucket> OpenBucketUrl(const std::string& url, const StoreOptions& options, bool any_layout,
                                     const std::string& trl_model = "");

Expected<std::unique_ptr<Bucket>> OpenBucketAnyLayout(std::shared_ptr<Store> store, std::string_view url,
                                                      std::string_view trl_model = {},
                                                      const TrlOptions& trl_options = {});

// The last non-empty path component of `url` with every byte outside [A-Za-z0-9._-] replaced by
// '-', at most 128 bytes; "trl" when nothing usable is left.
std::string TrlModelNameFromUrl(std::string_view url);

}  // namespace weightfs
