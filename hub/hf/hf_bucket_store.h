// HfBucketStore: a Hugging Face Storage Bucket as a weightfs Store —
// `hf://buckets/NAMESPACE/NAME[/PREFIX]`.
//
// Reads go to the Hub's HTTP API (hub/hf/hf_api.h: token only to the Hub's own origin, redirects
// followed by us without it, clear 401/403/404 messages):
//   Get     GET {endpoint}/buckets/NS/NAME/resolve/PREFIX/KEY with `Range: bytes=a-b`, following
//           the redirect to the CDN; a 206 is checked against Content-Range, a 200 to a ranged
//           request is sliced here (HfApi::ReadRange).
//   Head    HEAD of the same URL: X-Linked-Size, else Content-Length of a non-redirect answer.
//   List    GET {endpoint}/api/buckets/NS/NAME/tree/DIR?recursive=true&limit=1000, following
//           `Link: <...>; rel="next"`, where DIR is the directory part of PREFIX/prefix; entries
//           are filtered to the prefix (the Hub matches a tree path by directory), sorted, and
//           paged by our own contract: the continuation is the last key returned (see
//           tests/testing/store_conformance.h). The Hub has no "start after", so one listing of the
//           whole directory is fetched and kept for up to 30 s to serve the following pages of
//           the same prefix (a continuation request may see objects up to 30 s old; a listing
//           that starts without a continuation is always fresh). Keys that ValidateKey refuses
//           (written by other tools) are skipped. A missing directory lists as empty.
// Writes go through the Hub's S3-compatible gateway with our S3Store (SigV4), which the Hub
// documents for buckets:
//   endpoint  HfBucketOptions::s3_endpoint (the CLI's --endpoint), else $HF_S3_ENDPOINT (a
//             weightfs variable), else https://s3.hf.co — the gateway's base; "/NAMESPACE" is
//             appended and requests are path-style (…/NAMESPACE/NAME/PREFIX/KEY), region
//             us-east-1, as the Hub's S3 documentation says.
//   credentials  the "HFAK..." access key pair generated for a token on the Hub's token settings
//             page ("Generate S3 credentials"), never the AWS chain (LoadHfGatewayCredentials):
//             a user's AWS keys must not be signed and sent to the Hub.
//   Put       S3 PUT. Create-if-absent is one PUT with If-None-Match: *, which the gateway
//             documents for PutObject only: such an object above S3Options::max_single_put is
//             refused rather than uploaded in parts without the check (manifests and heads are
//             far smaller). Other objects above the threshold go up in parts.
//   Delete    S3 HEAD + DELETE.
//   GET       only the read-back after a 412 (S3Store::CheckOwnWrite) GETs through the gateway,
//             which answers clients that are not AWS SDKs with a 302 to its CDN: followed
//             without credentials.
//
// Thread-safe: any number of threads may call any method concurrently (the listing snapshot is
// guarded by a mutex that is never held across I/O).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "hub/hf/hf_api.h"
#include "hub/store/aws_credentials.h"
#include "hub/store/http_client.h"
#include "hub/store/s3_store.h"
#include "hub/store/store.h"

namespace weightfs {

inline constexpr const char* kHfDefaultS3Endpoint = "https://s3.hf.co";

struct HfBucketUrl {
  std::string ns;      // namespace: a user or organization
  std::string name;    // the bucket
  std::string prefix;  // "" or a valid key (no leading/trailing '/')
  std::string id() const { return ns + "/" + name; }
};

// Parses `hf://buckets/NAMESPACE/NAME[/PREFIX]`. Namespace and name: 1-96 characters of
// [A-Za-z0-9._-], not starting or ending with '.' or '-', without "--" or ".."; PREFIX obeys
// ValidateKey. InvalidArgument naming the rule otherwise.
Expected<HfBucketUrl> ParseHfBucketUrl(std::string_view url);

// One page of the Hub's bucket tree listing (GET /api/buckets/NS/NAME/tree/DIR: a JSON array
// of {"type": "file"|"directory", "path": "...", "size": N, ...}). Appends to `out` each file
// whose path starts with `full_prefix` (the listed prefix, bucket-relative) and with `strip`
// (the URL's prefix + "/", or ""), keyed by its path without `strip`; keys ValidateKey refuses
// are counted in `*skipped` and left out; directories are ignored. Corruption when the page is
// not an array, an entry is not an object or lacks a string type or path, or a file has no
// unsigned size. Pure: exposed for tests and the hf_json fuzzer.
Status AppendHfBucketTreePage(const nlohmann::json& page, std::string_view full_prefix, std::string_view strip,
                              std::vector<ObjectInfo>* out, size_t* skipped);

struct HfBucketOptions {
  std::string s3_endpoint;  // gateway base; empty: $HF_S3_ENDPOINT, else kHfDefaultS3Endpoint
  // For the S3 side: credentials (nullopt: the AWS chain from `env`), part sizes.
  S3Options s3;
};

// The profile LoadHfGatewayCredentials reads when HF_S3_PROFILE is not set.
inline constexpr const char* kHfGatewayProfile = "hf";

// The gateway's key pair, first match wins:
//   1. HF_S3_ACCESS_KEY_ID + HF_S3_SECRET_ACCESS_KEY;
//   2. profile HF_S3_PROFILE (default "hf") in the AWS credentials/config files
//      (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE honoured), read with AWS_* keys hidden;
//   3. AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY only when the key id starts with "HFAK" (a Hub
//      key put in the usual variables);
//   4. none (nullopt): writes fail with Auth saying how to set them.
// Never the AWS default profile nor AWS keys. InvalidArgument for half a pair or a named
// profile that does not exist.
Expected<std::optional<AwsCredentials>> LoadHfGatewayCredentials(const AwsEnvLookup& env);

// Opens the bucket. No request is made: a missing bucket or a bad token shows up in the first
// operation's error. `http` may be shared (nullptr: a new client); `config.endpoint` is the Hub.
Expected<std::unique_ptr<Store>> OpenHfBucketStore(std::string_view url, const HfConfig& config,
                                                   const HfBucketOptions& options,
                                                   std::shared_ptr<HttpClient> http);

}  // namespace weightfs
