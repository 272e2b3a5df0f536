// HttpClient: the one libcurl layer under every HTTP-speaking store (WebDAV, S3, Hugging Face).
//
// What it owns: connection reuse (a pool of curl easy handles sharing DNS/TLS-session caches),
// connect and transfer timeouts (a stalled transfer is cut by a low-speed limit, so nothing
// hangs), and retries with exponential backoff and full jitter on 5xx, 429 (honouring
// Retry-After), connection resets and timeouts — for requests the caller marks idempotent only.
// TLS verification is always on.
//
// Credentials: request headers named in `sensitive_headers` (Authorization, x-amz-security-token,
// ...) and URL query strings are never logged nor put into error messages; errors name the
// method, the URL without its query, the HTTP status and the first bytes of the server's body.
//
// Thread-safe: any number of threads may call Send concurrently; up to
// `max_connections` requests are in flight at once (callers beyond that wait for a handle).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace weightfs {

struct HttpOptions {
  std::chrono::milliseconds connect_timeout{10'000};
  // A transfer slower than `low_speed_bytes_per_s` for `stall_timeout` is aborted (and retried
  // if idempotent). This bounds a stalled server without capping large transfers.
  std::chrono::milliseconds stall_timeout{30'000};
  uint64_t low_speed_bytes_per_s = 1024;
  // Upper bound on one attempt, whatever its speed (0: none).
  std::chrono::milliseconds request_timeout{0};
  // Total tries of an idempotent request (1 = no retry). At a 20% error rate 10 tries fail
  // one request in 10^7; 6 would fail one in 15000, i.e. dozens in a 1T-parameter pull.
  int max_attempts = 10;
  std::chrono::milliseconds backoff_base{100};  // delay before retry k: rand(0, base * 2^k)
  std::chrono::milliseconds backoff_max{10'000};
  // Overall budget for one Send including retries and backoff; when exceeded the last error
  // is returned (kind Timeout if it was a timeout).
  std::chrono::milliseconds total_timeout{120'000};
  size_t max_connections = 16;
  std::string user_agent = "weightfs/0.1";
  // PEM bundle of CAs to trust instead of the system's (e.g. an on-premise S3 with a private
  // CA). Empty: the system store. Verification itself cannot be turned off.
  std::string ca_file;
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

struct HttpRequest {
  std::string method = "GET";  // GET HEAD PUT POST DELETE PROPFIND MOVE ...
  std::string url;             // absolute, already percent-encoded
  HttpHeaders headers;
  std::span<const uint8_t> body;  // must stay valid during Send
  bool idempotent = true;         // false: never retried after the request may have reached the server
  // Headers whose values must never appear in logs or errors (case-insensitive names).
  // "authorization" is always treated as sensitive.
  std::vector<std::string> sensitive_headers;
  // Optional: called before each attempt (including retries) to (re)compute headers that
  // depend on the time, e.g. request signatures. May add to `headers`.
  std::function<void(HttpRequest&)> sign;
  // Follow 3xx redirects (http/https only, at most 5; curl drops Authorization when the host
  // changes). Off by default: a store that gets a redirect it did not expect reports it.
  bool follow_redirects = false;
  // A response body larger than this fails the request with ResourceExhausted (not retried);
  // 0: no limit. Guards memory against a hostile or broken server.
  uint64_t max_response_bytes = 0;
  // Servers with documented rate-limit windows (the Hugging Face Hub: 5 minutes): a 429 whose
  // Retry-After, or else RateLimit `t=`, asks for a wait up to this long (and up to the window
  // `w=` of RateLimit-Policy when given) is waited out exactly, with a log line saying so. Such
  // waits are neither capped by backoff_max, nor counted as attempts (at most
  // kMaxRateLimitWaits of them), nor charged to total_timeout: they are the server's schedule,
  // not a failure. 0: a 429 is retried like a 5xx.
  std::chrono::milliseconds rate_limit_max_wait{0};
  // Test knob (WEIGHTFS_TEST_TIME_SCALE): such waits last wait/scale (a fake Hub whose clock
  // runs `scale` times faster). Logs still name the server's seconds.
  double rate_limit_time_scale = 1.0;
  // Called with the wait before a rate-limit wait starts (e.g. to hold back other requests to
  // the same server until the window resets).
  std::function<void(std::chrono::milliseconds wait)> on_rate_limited;
};

// How many rate-limit waits one Send takes before the 429 counts as a failure.
inline constexpr int kMaxRateLimitWaits = 6;

struct HttpResponse {
  long status = 0;
  HttpHeaders headers;  // names lower-cased
  std::vector<uint8_t> body;
  // Value of the first header named `name` (lower-case), or "".
  std::string_view Header(std::string_view name) const;
};

// Transport counters (for `--stats`): every attempt counts, retries included.
struct HttpStats {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> bytes_sent{0};      // request bodies
  std::atomic<uint64_t> bytes_received{0};  // response bodies
};

// A bound on every request the current thread sends while it lives, retries, backoff and the
// Hub's rate-limit waits included, on top of HttpOptions::total_timeout: the time an
// interactive operation (a FUSE lookup, an `ls`) gives the bucket in all. Nested ones keep the
// earliest; `what` names the bound in the error ("--metadata-timeout 10 s"). Work a thread
// hands to others carries it along (RequestsInParallel).
class OperationDeadline {
 public:
  using Clock = std::chrono::steady_clock;
  OperationDeadline(Clock::time_point at, std::string what);
  ~OperationDeadline();
  OperationDeadline(const OperationDeadline&) = delete;
  OperationDeadline& operator=(const OperationDeadline&) = delete;
  // The innermost bound of this thread, or null.
  static const OperationDeadline* Current();
  Clock::time_point at() const { return at_; }
  const std::string& what() const { return what_; }

 private:
  Clock::time_point at_;
  std::string what_;
  const OperationDeadline* previous_;
};

// Runs fn(i) for every i in [0, n) on up to `threads` threads, this one included (fewer if the
// system refuses to start more), each under this thread's OperationDeadline: requests to a
// store fanned out (manifests of many versions at once). fn must not throw; an exception it
// throws is dropped, leaving that index undone. For CPU work, core/thread_pool.h.
void RequestsInParallel(size_t n, size_t threads, const std::function<void(size_t)>& fn);

class HttpClient {
 public:
  explicit HttpClient(HttpOptions options = {});
  ~HttpClient();
  HttpClient(const HttpClient&) = delete;
  HttpClient& operator=(const HttpClient&) = delete;

  // Performs the request, retrying as described above. Any HTTP status is a successful Send
  // (the caller interprets 404, 412...), except statuses that are retried and still failing
  // after the last attempt (5xx, 429), which come back as IOError (or Timeout).
  // Transport failures: Timeout for timeouts, IOError otherwise, message without credentials.
  //
  // Precisely: an idempotent request is retried on 5xx, 429 and transport errors (timeouts,
  // resets, connect failures) until `max_attempts` or `total_timeout` runs out, and then fails
  // with the kind HttpStatusError gives the last status (IOError; Timeout for 504). A
  // non-idempotent request is retried only when the connection could not be made (nothing was
  // sent); a 5xx or 429 answer to it comes back as a response like any other status. Each
  // attempt's own timeout is cut to what is left of `total_timeout`, so Send returns within
  // about total_timeout whatever the server does (waiting for a free connection counts too),
  // or by the thread's OperationDeadline if that comes first.
  //
  // A server that cannot be reached (connection refused, no name, no connection or no answer at
  // all within the timeouts) after a request's last attempt is marked unreachable: from then on
  // each request makes one attempt only, without backoff, until one gets an answer. A bucket
  // that is down then costs each operation one connection attempt (milliseconds when refused),
  // not the retry budget again and again; one log line says it went and one that it is back.
  Expected<HttpResponse> Send(HttpRequest request);
  // Whether the server is marked unreachable (see Send).
  bool unreachable() const { return unreachable_.load(); }

  const HttpStats& stats() const { return stats_; }
  const HttpOptions& options() const { return options_; }

 private:
  struct Pool;
  HttpOptions options_;
  HttpStats stats_;
  std::unique_ptr<Pool> pool_;
  std::atomic<bool> unreachable_{false};
};

// Maps a final HTTP status to a Status kind: 404 -> NotFound, 401/403 -> Auth, 409/412 ->
// Conflict, 408/504 -> Timeout, other >= 400 -> IOError. `what` names the operation and key.
Status HttpStatusError(long status, std::string_view what, std::string_view server_message);

// Seconds until a rate-limit window resets, from the IETF RateLimit header (draft v9, which the
// Hugging Face Hub sends: `"api";r=0;t=55`): the first `t=` parameter. nullopt if there is none.
// Send uses it as the delay before retrying a 429 that has no Retry-After.
std::optional<uint64_t> ParseRateLimitReset(std::string_view header);

// The window `w=` (seconds) of a RateLimit-Policy header (`"fixed window";"api";q=500;w=300`),
// or nullopt.
std::optional<uint64_t> ParseRateLimitWindow(std::string_view policy_header);

// The URL as it may appear in logs, errors and the mount table: no query string (signed URLs
// carry credentials there), no fragment, no user:password@.
std::string RedactUrl(std::string_view url);

// A printable one-line excerpt of a server-supplied string (a header, an error body) for a
// message: at most `max` bytes, control and non-ASCII bytes as '?', "..." when cut.
std::string Printable(std::string_view s, size_t max = 300);

// A decimal number filling all of `s` (a header value), or nullopt.
std::optional<uint64_t> ParseU64(std::string_view s);

// A Content-Range value: "bytes FIRST-LAST/TOTAL" or "bytes FIRST-LAST/*"; nullopt when
// malformed or LAST < FIRST.
struct ContentRange {
  uint64_t first = 0, last = 0;
  std::optional<uint64_t> total;
};
std::optional<ContentRange> ParseContentRange(std::string_view v);

// A ranged GET as every HTTP backend (S3, WebDAV, the Hugging Face Hub) answers Store::Get's
// contract (store.h): which Range header to send, and what a reply means. An offset at the end
// reads as empty, past the end is InvalidArgument; a 206 must be the range asked for (else
// Corruption); a 200 to a ranged request (a server that ignores Range) is sliced; a 416 is
// decided by the object's size (the caller asks for it: Content-Range "bytes */N" or a HEAD).
class RangedGet {
 public:
  // `name` names the object in messages ("s3://b/k", a redacted URL).
  RangedGet(uint64_t offset, std::optional<uint64_t> length, std::string name)
      : offset_(offset), bounded_(length.has_value()), length_(length.value_or(UINT64_MAX)), name_(std::move(name)) {}

  // Zero bytes asked for, which HTTP cannot say: the caller checks the offset against the
  // object's size (AtSize) instead of sending the GET.
  bool Empty() const { return bounded_ && length_ == 0; }
  // Whether the GET carries a Range header (RangeHeader()).
  bool Ranged() const { return offset_ > 0 || bounded_; }
  std::string RangeHeader() const;
  // A bound on the reply for a server that ignores the end of the range (0: none).
  uint64_t MaxResponseBytes() const;
  // The bytes of a 200 or 206 reply that were asked for (the body is moved out).
  Expected<std::vector<uint8_t>> Take(HttpResponse& r, std::string_view what) const;
  // The answer for an object of `size` bytes when no body says more: an empty request, or a
  // 416 (`refused`), which is an error when the range starts inside the object.
  Expected<std::vector<uint8_t>> AtSize(uint64_t size, bool refused, std::string_view what) const;
  // The size a 416's Content-Range ("bytes */N") gives, if any.
  static std::optional<uint64_t> SizeOf416(const HttpResponse& r);

 private:
  Status PastEnd(uint64_t size) const;
  uint64_t offset_;
  bool bounded_;
  uint64_t length_;
  std::string name_;
};

// Percent-encodes everything outside RFC 3986's unreserved set; '/' is kept when keep_slash.
std::string UrlEncode(std::string_view s, bool keep_slash);

}  // namespace weightfs
