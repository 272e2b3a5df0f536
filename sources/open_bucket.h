// OpenBucketAnyLayout: the Bucket for a store in any layout weightfs reads — a weightfs bucket
// (weightfs.json), or else a TRL delta-sync bucket (sources/trl/trl_bucket.h) shown read-only as the
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

#include "engine/bucket.h"
#include "sources/trl/trl_bucket.h"
#include "store/store.h"

namespace weightfs {

Expected<std::unique_ptr<Bucket>> OpenBucketAnyLayout(std::shared_ptr<Store> store, std::string_view url,
                                                      std::string_view trl_model = {},
                                                      const TrlOptions& trl_options = {});

// The last non-empty path component of `url` with every byte outside [A-Za-z0-9._-] replaced by
// '-', at most 128 bytes; "trl" when nothing usable is left.
std::string TrlModelNameFromUrl(std::string_view url);

}  // namespace weightfs
