// HfConfig and HfApi: how weightfs talks to the Hugging Face Hub over HTTP — the configuration
// the huggingface_hub client reads from the environment, and a thin layer on HttpClient that
// adds the Hub's authentication, redirect, error and pagination conventions. Used by
// HfBucketStore (hub/hf_bucket_store.h) and HfRepo (hub/hf_repo.h).
//
// Configuration (LoadHfConfig), as huggingface_hub does it:
//   HF_ENDPOINT        the Hub, default https://huggingface.co (a trailing '/' is dropped)
//   token              HF_TOKEN, else HUGGING_FACE_HUB_TOKEN, else the token file
//                      ($HF_TOKEN_PATH, else $HF_HOME/token; whitespace stripped). The file is
//                      skipped when HF_HUB_DISABLE_IMPLICIT_TOKEN is true.
//   HF_HOME            default $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface
//   HF_HUB_CACHE       default $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub
//   HF_HUB_OFFLINE     1/ON/YES/TRUE (any case; also TRANSFORMERS_OFFLINE): no network for repos
//
// Where the token goes: `Authorization: Bearer <token>` is added only to requests whose
// scheme, host and port equal the endpoint's. HfApi follows redirects itself (at most 5,
// http/https only) and drops the token as soon as a redirect leaves the endpoint's origin —
// never re-adding it later in the chain — so a signed CDN URL never sees it. The token never
// appears in logs (HttpClient treats Authorization as sensitive), in a Status (every message
// HfApi builds is scrubbed of it), nor in any file weightfs writes.
//
// Errors: a non-2xx answer becomes a Status that says what is wrong and the fix, from the
// status and the Hub's X-Error-Code / X-Error-Message headers (see ErrorFrom). 429 and 5xx are
// retried by HttpClient (Retry-After, or else the `t=` of the IETF RateLimit header the Hub
// sends: ParseRateLimitReset in hub/http_client.h).
//
// Thread-safe: an HfApi is immutable after construction; HttpClient is thread-safe.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "hub/aws_credentials.h"
#include "hub/http_client.h"

namespace weightfs {

// Reads one environment variable (nullopt when unset). Tests pass a map-backed lookup.
using HfEnvLookup = AwsEnvLookup;

inline constexpr const char* kHfDefaultEndpoint = "https://huggingface.co";

struct HfConfig {
  std::string endpoint = kHfDefaultEndpoint;  // scheme://host[:port][/path], no trailing '/'
  std::string token;                          // empty: anonymous. Never print it.
  std::string token_source;                   // "HF_TOKEN", "token file /x/token", or ""
  std::string home;                           // HF_HOME
  std::string hub_cache;                      // HF_HUB_CACHE
  bool offline = false;                       // HF_HUB_OFFLINE
};

// The configuration from `env` (empty: the process environment). InvalidArgument for an
// HF_ENDPOINT that is not http(s)://host[:port][/path] or that holds credentials or a query.
Expected<HfConfig> LoadHfConfig(const HfEnvLookup& env = {});

// What a request was about, for error messages: "repo 'org/x'", "bucket 'ns/b'".
struct HfTarget {
  enum class Kind { kRepo, kBucket };
  Kind kind = Kind::kRepo;
  std::string id;        // "org/x" or "ns/b"
  std::string revision;  // repos: the revision asked for ("" for buckets)
  std::string path;      // the file, when the request was about one
};

struct HfRequest {
  std::string method = "GET";
  std::string url;  // absolute, percent-encoded
  HttpHeaders headers;
  uint64_t max_response_bytes = 0;
  // Follow 3xx answers (see the header comment). Off: the 3xx comes back as the response.
  bool follow_redirects = true;
};

// Counters for tests and `--stats`: requests HfApi made (redirect hops included) and response
// body bytes, split by whether they went to the Hub's origin or elsewhere (CDN).
struct HfStats {
  std::atomic<uint64_t> hub_requests{0};
  std::atomic<uint64_t> other_requests{0};
  std::atomic<uint64_t> bytes_received{0};
};

class HfApi {
 public:
  HfApi(HfConfig config, std::shared_ptr<HttpClient> http);

  const HfConfig& config() const { return config_; }
  HttpClient& http() const { return *http_; }
  const HfStats& stats() const { return stats_; }

  // endpoint + path (REQUIRES: path starts with '/', already percent-encoded).
  std::string Url(std::string_view path) const { return config_.endpoint + std::string(path); }
  // Whether `url` has the endpoint's scheme, host and port (the only origin that gets the token).
  bool IsHubOrigin(std::string_view url) const;

  // Sends the request (idempotent: GET and HEAD are retried by HttpClient), adding the token
  // where allowed and following redirects as described above. Any final HTTP status is a
  // successful Send; the caller maps errors with ErrorFrom.
  Expected<HttpResponse> Send(HfRequest request) const;

  // The Status for a non-2xx response to `what` ("GET https://.../resolve/x") about `target`:
  //   401 with "Invalid credentials" -> Auth: the token is invalid or expired;
  //   401 otherwise -> Auth: no token: "does not exist, or is private/gated: set HF_TOKEN or run
  //       `hf auth login`"; with a token: "does not exist or your token cannot see it";
  //   403 GatedRepo -> Auth: accept the conditions on the Hub; 403 -> Auth: the token lacks
  //       permission (a write needs a write token);
  //   404 RepoNotFound / RevisionNotFound / EntryNotFound (or none) -> NotFound naming which;
  //   others as HttpStatusError. Never contains the token.
  Status ErrorFrom(const HttpResponse& response, std::string_view what, const HfTarget& target) const;

  // GETs `url` and every page its `Link: <...>; rel="next"` chain names (the next URL must be
  // on the Hub's origin; at most `max_pages`; a repeated URL is Corruption), calling `on_page`
  // with each page's JSON array. A 404 is passed to `on_not_found` when given (return OK to end
  // the listing quietly), else mapped by ErrorFrom.
  Status GetJsonPages(std::string url, const HfTarget& target,
                      const std::function<Status(const nlohmann::json& page)>& on_page,
                      const std::function<Status(const HttpResponse&)>& on_not_found = {},
                      size_t max_pages = 1'000'000) const;

  // GET of `url` as a JSON document (at most 64 MiB).
  Expected<nlohmann::json> GetJson(const std::string& url, const HfTarget& target) const;

  // The Store contract's ranged read of a resolve URL: `length` nullopt reads to the end; a
  // range past the end is clipped; an offset at the end gives nothing; past the end
  // InvalidArgument (HEAD tells those apart when the server answers 416, and serves zero-length
  // requests). A 206 is checked against Content-Range; a 200 to a ranged request is sliced.
  Expected<std::vector<uint8_t>> ReadRange(const std::string& url, const HfTarget& target,
                                           uint64_t offset, std::optional<uint64_t> length) const;

  // Size of the file at a resolve URL: HEAD without following an absolute redirect; the size is
  // X-Linked-Size, else (only on a non-3xx answer) Content-Length; a 3xx without X-Linked-Size
  // is followed. NotFound when there is none.
  Expected<uint64_t> HeadSize(const std::string& url, const HfTarget& target) const;

  // `text` with every occurrence of the token replaced by "<token>".
  std::string Scrub(std::string text) const;

 private:
  HfConfig config_;
  std::shared_ptr<HttpClient> http_;
  std::string origin_;  // "scheme://host:port" of the endpoint, lower-cased, port explicit
  mutable HfStats stats_;
};

// Helpers exposed for tests.
namespace hf {
// The URL of the rel="next" link of a Link header, or "".
std::string ParseLinkNext(std::string_view link_header);
// `location` resolved against `base` (absolute, scheme-relative "//host/x", absolute-path "/x",
// or relative "x"); "" when it is not http(s).
std::string ResolveUrl(std::string_view base, std::string_view location);
// "scheme://host:port" lower-cased with the default port made explicit, or "" if unparsable.
std::string UrlOrigin(std::string_view url);
// Whether s is 40 lowercase hex digits (a git commit id).
bool IsCommitSha(std::string_view s);
}  // namespace hf

// A Hub namespace, repo or bucket name (the Hub's own rules, slightly stricter than needed):
// 1-96 of [A-Za-z0-9._-], not starting or ending with '.' or '-', no "--" or "..".
// InvalidArgument naming `what` and the rule, or OK.
Status ValidateHubName(std::string_view name, std::string_view what);

}  // namespace weightfs
