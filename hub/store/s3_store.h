// S3Store: a bucket in Amazon S3 or an S3-compatible server (`s3://bucket/prefix`), spoken to
// over the S3 REST API with our own SigV4 signing (hub/store/s3_signer.h) on top of HttpClient.
//
// Every key lives under `prefix/`. Mapping of the Store contract onto S3:
//   Get     GET with `Range: bytes=a-b`; 206 is checked against Content-Range; an offset at the
//           end returns empty, past the end InvalidArgument (S3 answers 416 for both, so a HEAD
//           tells them apart). A server that ignores Range (200) is sliced locally.
//   Put     one PUT up to `multipart_threshold`, else a multipart upload (parts uploaded in
//           parallel, AbortMultipartUpload on failure). Every request is idempotent for
//           retries; a resent CreateMultipartUpload or a failed abort can leave an incomplete
//           upload behind, which a bucket lifecycle rule ("abort incomplete multipart uploads
//           after N days") removes.
//   Head    HEAD (Content-Length).
//   List    ListObjectsV2 with start-after: our continuation is the last key of the previous
//           page, as in every backend (tests/testing/store_conformance.h), not S3's opaque
//           NextContinuationToken, so any key resumes a listing and nothing expires. Keys that
//           ValidateKey refuses (written by other tools) are skipped.
//   Delete  HEAD then DELETE, because S3 answers 204 for a missing key and the contract says
//           NotFound. Two concurrent deleters of one key may both succeed.
//
// Create-if-absent: a HEAD first (so a key that already exists is a Conflict even on servers
// that ignore conditional writes, such as s3rver, and a large upload is not wasted), then the PUT
// (or CompleteMultipartUpload) carries `If-None-Match: *`, which S3 (since 2024), MinIO and Ceph
// evaluate atomically: exactly one of several racing writers gets 200, the others 412 ->
// Conflict. A 409 ConditionalRequestConflict (a concurrent conditional write in flight) is
// retried a few times. Servers that ignore If-None-Match leave a race window between the HEAD
// and the PUT.
//   Resends: HttpClient retries the conditional PUT like any idempotent request, and libcurl
// itself silently resends a request whose reused connection died before any answer. If the
// first send reached the server but its answer was lost, the resend sees our own object and
// gets 412. So every 412 (and a NoSuchUpload answer to CompleteMultipartUpload) is checked:
// the object must have our size and either an ETag equal to the MD5 of our bytes (single PUT;
// the PUT also sends Content-MD5) or to the multipart ETag derived from our parts' ETags, or
// else, when the ETag says nothing (SSE-KMS, servers with other ETags), the same bytes read
// back in part-sized ranges. Equal -> success; otherwise Conflict. A writer that raced us with
// identical bytes is indistinguishable from our own write and both succeed; for immutable,
// content-defined objects (manifests, packs) that is harmless.
//
// Errors: S3's XML error Code decides the kind: NoSuchKey -> NotFound; NoSuchBucket -> NotFound
// saying the bucket does not exist; AccessDenied, InvalidAccessKeyId, SignatureDoesNotMatch,
// ExpiredToken, ... -> Auth with a hint naming where the credentials came from (never their
// values); PreconditionFailed -> Conflict; wrong-region answers -> InvalidArgument naming the
// bucket's region. SlowDown/5xx are retried by HttpClient. HEAD has no body, so a HEAD on a
// missing bucket reads as a missing key.
//
// Thread-safe: the store is immutable after OpenS3Store; HttpClient is thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hub/store/aws_credential_chain.h"
#include "hub/store/aws_credentials.h"
#include "hub/store/http_client.h"
#include "hub/store/store.h"

namespace weightfs {

struct S3Options {
  // "http://127.0.0.1:4568", "https://minio.internal:9000". Empty: AWS_ENDPOINT_URL_S3, then
  // AWS_ENDPOINT_URL, then https://s3.<region>.amazonaws.com.
  std::string endpoint;
  std::string region;  // empty: from the environment / ~/.aws/config, else us-east-1
  // kAuto: virtual-hosted (bucket.s3.region.amazonaws.com) for AWS endpoints and DNS-safe bucket
  // names; path-style (endpoint/bucket/key) for custom endpoints and bucket names with dots.
  enum class Addressing { kAuto, kPath, kVirtualHosted };
  Addressing addressing = Addressing::kAuto;
  uint64_t multipart_threshold = 64ull << 20;  // larger objects go up in parts
  uint64_t part_size = 16ull << 20;            // >= 5 MiB (the S3 minimum); grown to stay <= 10000 parts
  size_t multipart_parallelism = 4;            // parts in flight per upload
  // Explicit credentials (tests, embedding programs), fixed or refreshing. Neither: the AWS
  // provider chain (hub/store/aws_credential_chain.h); finding nothing there is an error unless
  // no_sign_request.
  std::optional<AwsCredentials> credentials;
  std::shared_ptr<AwsCredentialSource> credential_source;
  // Anonymous, unsigned requests (the AWS CLI's --no-sign-request), for public buckets.
  bool no_sign_request = false;
  // Environment lookup for credentials, region and endpoint; empty: the process environment.
  AwsEnvLookup env;
  // false: never look credentials up in the AWS chain (environment, ~/.aws, roles): only
  // `credentials`, else anonymous. For S3-compatible services with keys of their own (the Hub's
  // gateway), so that a user's real AWS keys are never signed and sent to them.
  bool credentials_from_aws_chain = true;
  // What an Auth error tells the user to fix (empty: the AWS variables and profiles).
  std::string credentials_hint;
  // Appended to the error for a bucket that does not exist (how to create one).
  std::string missing_bucket_hint;
  // Follow a 3xx answer to a GET (the Hub's gateway redirects downloads to its CDN) to another
  // URL, unsigned: no Authorization, no x-amz-* header goes there; Range is kept.
  bool follow_get_redirects = false;
  // false: the server honours If-None-Match on PutObject only (not on
  // CompleteMultipartUpload), so a create-if-absent object goes up in one PUT up to
  // max_single_put bytes, and a larger one is refused (Unsupported) rather than written
  // without the atomic check.
  bool conditional_multipart = true;
  uint64_t max_single_put = 5ull << 30;  // S3's limit for one PUT
};

// Opens `s3://bucket[/prefix]`. Makes no request: a missing bucket or bad credentials show up
// in the first operation's error. `http` may be shared with other stores; nullptr: a new client
// with default options.
Expected<std::unique_ptr<Store>> OpenS3Store(std::string_view url, const S3Options& options,
                                             std::shared_ptr<HttpClient> http);

// The XML pieces of the S3 protocol, exposed for tests and fuzzing. Parsers never trust the
// input: malformed XML is Corruption, sizes are checked, entities are decoded (the five XML
// ones and numeric references; no DOCTYPE, no custom entities).
namespace s3 {

struct XmlElement {
  std::string name;  // local name: a namespace prefix ("s3:Key") is dropped
  std::string text;  // decoded character data directly inside this element
  std::vector<XmlElement> children;
  const XmlElement* Child(std::string_view child_name) const;  // the first, or nullptr
  std::string ChildText(std::string_view child_name) const;    // "" when absent
};
Expected<XmlElement> ParseXml(std::string_view xml);

struct ErrorInfo {
  std::string code;     // "NoSuchKey"
  std::string message;  // "The specified key does not exist."
  std::string region;   // <Region>, sent with wrong-region errors
};
// The <Error> document of an S3 error response; nullopt when `body` is not one.
std::optional<ErrorInfo> ParseError(std::string_view body);

struct ListResult {
  std::vector<ObjectInfo> contents;  // keys as S3 returns them (with the store prefix)
  bool truncated = false;
  std::string next_continuation_token;
};
Expected<ListResult> ParseListObjectsV2(std::string_view body);

}  // namespace s3
}  // namespace weightfs
