// OpenStore: the Store for a bucket URL.
//   /path, ./path, file:///path     LocalStore (a local or shared-filesystem directory)
//   http://host[:port]/prefix       WebDavStore (any WebDAV server: nginx dav, Apache mod_dav...)
//   https://...                     the same over TLS
//   s3://bucket[/prefix]            S3Store (AWS S3 or any S3-compatible endpoint)
//   hf://buckets/NS/NAME[/prefix]   HfBucketStore (a Hugging Face Storage Bucket; Hub settings
//                                   from HF_ENDPOINT/HF_TOKEN..., writes through the S3 gateway:
//                                   --endpoint or HF_S3_ENDPOINT, with the gateway's own keys:
//                                   HF_S3_ACCESS_KEY_ID/HF_S3_SECRET_ACCESS_KEY or the profile
//                                   HF_S3_PROFILE, never the AWS chain)
// The returned store counts requests and bytes (CountingStore) for `--stats`.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "hub/store/http_client.h"
#include "hub/store/store_wrapper.h"

namespace weightfs {

struct StoreOptions {
  std::string s3_endpoint;  // --endpoint; else AWS_ENDPOINT_URL; else AWS (hf://: HF_S3_ENDPOINT, s3.hf.co)
  std::string s3_region;    // --region; else AWS_REGION / AWS_DEFAULT_REGION / ~/.aws/config
  // --no-sign-request: anonymous S3 requests (a public bucket). Else the AWS provider chain
  // (hub/store/aws_credential_chain.h), and finding no credentials is an error.
  bool s3_no_sign_request = false;
  HttpOptions http;
  // --shared-cache URL: a store every node of the cluster reaches, read through for the
  // bucket's packs, tables and heads (hub/engine/shared_tier.h); empty: none. OpenBucketUrl opens it.
  std::string shared_cache;
  std::string shared_cache_endpoint;  // --shared-cache-endpoint, for an s3:// tier (default: --endpoint)
  uint64_t shared_cache_size = 0;     // --shared-cache-size; 0: the tier's lifecycle rules bound it
};

class SharedTierStore;

struct OpenedStore {
  std::shared_ptr<CountingStore> store;  // the bucket: counts what is asked of it (the origin)
  std::shared_ptr<HttpClient> http;      // null for local stores
  // With --shared-cache: what the bucket is read through (it wraps `store`), and the tier's own
  // counts; null without one.
  std::shared_ptr<SharedTierStore> shared;
  std::shared_ptr<CountingStore> tier;
  // What a Bucket reads and writes through: `shared` when there is one, else `store`.
  std::shared_ptr<Store> reads() const;
};

Expected<OpenedStore> OpenStore(std::string_view url, const StoreOptions& options = {});

}  // namespace weightfs
