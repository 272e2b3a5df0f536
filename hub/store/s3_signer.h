// AWS Signature Version 4 (header-based) for S3 requests: our own implementation over OpenSSL
// (SHA-256, HMAC-SHA256), checked against the vectors AWS publishes (tests/hub/store/s3_signer_test.cc).
//
//   CanonicalRequest = Method \n CanonicalURI \n CanonicalQuery \n CanonicalHeaders \n
//                      SignedHeaders \n HexSHA256(payload)
//   StringToSign     = "AWS4-HMAC-SHA256" \n AmzDate \n Date/Region/Service/aws4_request \n
//                      HexSHA256(CanonicalRequest)
//   SigningKey       = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, Date), Region), Service), "aws4_request")
//   Signature        = Hex(HMAC(SigningKey, StringToSign))
//
// S3 specifics: the canonical URI is the path exactly as sent, each segment percent-encoded
// once (no normalisation, no double encoding, unlike other services); query parameters are
// decoded, re-encoded with the strict RFC 3986 rule and sorted by name then value; header names
// are lower-cased, values trimmed with inner runs of spaces collapsed, repeated headers joined
// with ','.
//
// Stateless functions and an immutable signer: thread-safe. Secrets go into HMAC keys only,
// never into a returned string other than the signature itself.
#pragma once

#include <chrono>
#include <string>
#include <string_view>

#include "hub/store/aws_credentials.h"
#include "hub/store/http_client.h"

namespace weightfs {

// What a signature covers.
struct SigV4Params {
  std::string method;          // "GET"
  std::string host;            // the Host header's value ("bucket.s3.amazonaws.com", "127.0.0.1:9000")
  std::string path;            // as sent, already percent-encoded; "" means "/"
  std::string query;           // as sent, without '?'; may be ""
  HttpHeaders headers;         // every other header to sign (any case); Host is added from `host`
  std::string payload_sha256;  // 64 hex digits, or "UNSIGNED-PAYLOAD"
  std::string amz_date;        // "20150830T123600Z" (also sent as x-amz-date by callers)
  std::string region;          // "us-east-1"
  std::string service;         // "s3"
};

struct SigV4Signature {
  std::string canonical_request;
  std::string string_to_sign;
  std::string signed_headers;  // "host;range;x-amz-content-sha256;x-amz-date"
  std::string signature;       // 64 lowercase hex digits
  std::string authorization;   // the Authorization header's value
};

SigV4Signature ComputeSigV4(const SigV4Params& params, const AwsCredentials& credentials);

// "20150830T123600Z" for `t` (UTC).
std::string AmzDate(std::chrono::system_clock::time_point t);

// Percent-encodes every byte outside RFC 3986's unreserved set (A-Z a-z 0-9 - . _ ~) as %XX
// with upper-case hex, the encoding SigV4 requires; '/' is kept when keep_slash.
std::string AwsUriEncode(std::string_view s, bool keep_slash);

// Signs HttpRequests for one service and region. Install it as HttpRequest::sign so that every
// attempt, retries included, is signed afresh with the current time.
class SigV4Signer {
 public:
  SigV4Signer(AwsCredentials credentials, std::string region, std::string service = "s3");

  // Replaces any earlier x-amz-date, x-amz-content-sha256, x-amz-security-token and
  // Authorization headers of `request` with new ones for `now`, signing every header the
  // request carries plus Host (derived from the URL the way libcurl sends it: the port only
  // when it is not the scheme's default). `payload_sha256`: hex SHA-256 of the body.
  void Sign(HttpRequest& request, std::string_view payload_sha256,
            std::chrono::system_clock::time_point now) const;

  const std::string& region() const { return region_; }

 private:
  const AwsCredentials credentials_;
  const std::string region_;
  const std::string service_;
};

// The Host header value libcurl sends for `url` ("host" or "host:port"), lower-cased, and the
// path and query as they appear in the URL. Exposed for tests.
struct UrlParts {
  std::string scheme;
  std::string host;  // with ":port" when the URL names a non-default port
  std::string path;  // "" when the URL has none
  std::string query;
};
UrlParts SplitUrl(std::string_view url);

}  // namespace weightfs
