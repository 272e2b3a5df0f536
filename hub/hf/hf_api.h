// HfConfig and HfApi: how weightfs talks to the Hugging Face Hub over HTTP — the configuration
// the huggingface_hub client reads from the environment, and a thin layer on HttpClient that
// adds the Hub's authentication, redirect, error and pagination conventions. Used by
// HfBucketStore (hub/hf/hf_bucket_store.h) and HfRepo (hub/hf/hf_repo.h).
//
// Configuration (LoadHfConfig), as huggingface_hub does it:
//   HF_ENDPOINT        the Hub, default https://huggingface.co (a trailing '/' is dropped)
//   token              HF_TOKEN, else HUGGING_FACE_HUB_TOKEN, else the token file
//                      ($HF_TOKEN_PATH, else $HF_HOME/token; whitespace stripped). The file is
//                      re-read whenever it changes (`hf auth login` rewrites it, and OAuth login
//                      tokens expire and are refreshed), so a long-running mount follows it.
//                      HF_HUB_DISABLE_IMPLICIT_TOKEN true: no token at all — huggingface_hub
//                      then sends only a token passed in code, and weightfs has no such argument.
//   HF_HOME            default $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface
//   HF_HUB_CACHE       default $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub
//                      (HF_HOME, HF_HUB_CACHE and HF_TOKEN_PATH get `~` and `$VAR`/`${VAR}`
//                      expanded, as os.path.expanduser(os.path.expandvars(...)) does)
//   HF_HUB_OFFLINE     1/ON/YES/TRUE (any case; also TRANSFORMERS_OFFLINE): no network for repos
//
// Resolve URLs (`/resolve/`, the Hub's most used and most rate-limited endpoint: 3,000 /
// 5,000 / 12,000 calls per 5 minutes for anonymous / free / PRO users): ReadRange with
// `reuse_resolved` asks the Hub once per file and reuses the signed redirect target (the CDN
// URL) for later ranges until shortly before it expires (X-Amz-Date + X-Amz-Expires, or
// CloudFront's Expires=, in the URL); a target that answers 400/401/403/404/410 (expired,
// revoked) is resolved again, once. Concurrent first reads of one file share one resolve.
//
// Rate limits: a Hub 429 is waited out for as long as its RateLimit `t=` (or Retry-After)
// says, up to the window of RateLimit-Policy (at most kHubRateLimitWindow), with a log line
// saying that it waits; other requests of the same class (resolvers / API) hold back until
// then instead of spending more of the quota on 429s.
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
// sends: ParseRateLimitReset in hub/store/http_client.h).
//
// Thread-safe: every method may be called from any number of threads (the resolve cache, the
// token read from its file and the rate-limit hold are guarded by mutexes never held across
// I/O, or atomics); HttpClient is thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/mutex.h"
#include "core/status.h"
#include "hub/store/aws_credentials.h"
#include "hub/store/http_client.h"

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
  // The token file HfApi follows (re-read when it changes): set unless the token came from
  // the environment or implicit tokens are disabled.
  std::string token_file;
  // Test knob WEIGHTFS_TEST_TIME_SCALE: rate-limit waits last wait/scale (a fake Hub whose
  // clock runs that much faster). Never set it against the real Hub.
  double time_scale = 1.0;
};

// The Hub's documented rate-limit window: the longest a 429 makes a request wait.
inline constexpr std::chrono::seconds kHubRateLimitWindow{300};
// Entries per page of a tree listing: the Hub allows up to 10000; clients use 1000-5000.
inline constexpr size_t kHubTreePageLimit = 1000;

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
  std::atomic<uint64_t> resolves{0};          // requests to /resolve/ URLs on the Hub
  std::atomic<uint64_t> reused_targets{0};    // reads sent straight to a remembered CDN URL
  std::atomic<uint64_t> rate_limit_waits{0};  // 429s waited out
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
  // `reuse_resolved`: the file at `url` never changes (a pinned commit, an immutable object), so
  // its signed redirect target may be reused (see the header comment).
  Expected<std::vector<uint8_t>> ReadRange(const std::string& url, const HfTarget& target,
                                           uint64_t offset, std::optional<uint64_t> length,
                                           bool reuse_resolved = false) const;

  // Size of the file at a resolve URL: HEAD without following an absolute redirect; the size is
  // X-Linked-Size, else (only on a non-3xx answer) Content-Length; a 3xx without X-Linked-Size
  // is followed. NotFound when there is none.
  Expected<uint64_t> HeadSize(const std::string& url, const HfTarget& target) const;

  // `text` with every occurrence of any token used so far replaced by "<token>".
  std::string Scrub(std::string text) const WFS_EXCLUDES(token_mu_);

  // The token to send now: config().token, or the token file's current content when the token
  // comes from the file (re-read when its inode, size or mtime changed). "" when anonymous.
  std::string Token() const WFS_EXCLUDES(token_mu_);

 private:
  // A resolve URL's redirect target. pending: a resolve is in flight (wait on resolve_cv_).
  struct Resolved {
    bool pending = true;
    bool direct = false;  // the Hub serves the file itself: nothing to reuse
    std::string target;   // the absolute URL off the Hub's origin
    std::chrono::steady_clock::time_point reuse_until;
  };
  // Send() of `request` (a GET of a resolve URL) through the remembered target.
  Expected<HttpResponse> SendResolved(const HfRequest& request) const WFS_EXCLUDES(resolve_mu_);
  // Follows the Hub's own redirects of `url` until one leaves its origin: that target, or
  // the final non-redirect response (the Hub serving the file, or an error) in `*final`.
  Expected<std::string> ResolveTarget(const HfRequest& request, std::optional<HttpResponse>* final) const;
  void ForgetTarget(const std::string& url, const std::string& target) const WFS_EXCLUDES(resolve_mu_);
  // Holds a Hub request back while its class's rate-limit window is exhausted.
  void WaitIfRateLimited(std::string_view url) const;

  HfConfig config_;
  std::shared_ptr<HttpClient> http_;
  std::string origin_;  // "scheme://host:port" of the endpoint, lower-cased, port explicit
  mutable HfStats stats_;

  mutable Mutex resolve_mu_;                            // never held across I/O
  mutable CondVar resolve_cv_;                          // a pending resolve finished
  mutable std::map<std::string, Resolved> resolved_ WFS_GUARDED_BY(resolve_mu_);  // resolve URL -> target

  mutable Mutex token_mu_;                              // no I/O under it but a small file read
  mutable std::string token_ WFS_GUARDED_BY(token_mu_);
  mutable std::string token_file_id_ WFS_GUARDED_BY(token_mu_);  // "ino:size:mtime" of the file read
  mutable std::vector<std::string> past_tokens_ WFS_GUARDED_BY(token_mu_);  // for Scrub

  // steady_clock ms until which resolver / API requests hold back (a 429 said so).
  mutable std::atomic<int64_t> resolvers_blocked_until_ms_{0};
  mutable std::atomic<int64_t> api_blocked_until_ms_{0};
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
// When a signed URL expires, from its query: X-Amz-Date + X-Amz-Expires (S3 presigned) and/or
// Expires= (CloudFront, Unix seconds); the earliest. nullopt when it says nothing.
std::optional<std::chrono::system_clock::time_point> SignedUrlExpiry(std::string_view url);
// `path` with a leading `~` (HOME, or the user's home directory) and `$VAR` / `${VAR}` expanded
// as Python's os.path.expanduser(os.path.expandvars(path)): unknown variables stay as written.
std::string ExpandUserAndVars(std::string_view path, const std::function<std::optional<std::string>(std::string_view)>& env);
}  // namespace hf

// A Hub namespace, repo or bucket name (the Hub's own rules, slightly stricter than needed):
// 1-96 of [A-Za-z0-9._-], not starting or ending with '.' or '-', no "--" or "..".
// InvalidArgument naming `what` and the rule, or OK.
Status ValidateHubName(std::string_view name, std::string_view what);

}  // namespace weightfs
