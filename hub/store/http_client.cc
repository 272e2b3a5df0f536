#include "hub/store/http_client.h"

#include <curl/curl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <array>
#include <cctype>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "core/ascii.h"
#include "core/mutex.h"

namespace weightfs {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// libcurl's process-wide state: initialised on first use, cleaned up at exit (after every
// HttpClient, since a client constructed later is destroyed earlier), so leak checkers see
// nothing of it.
void EnsureCurlGlobal() {
  struct Global {
    Global() : rc(curl_global_init(CURL_GLOBAL_DEFAULT)) {}
    ~Global() {
      if (rc == CURLE_OK) curl_global_cleanup();
    }
    CURLcode rc;
  };
  static Global global;
  if (global.rc != CURLE_OK) {
    spdlog::error("curl_global_init failed: {}", curl_easy_strerror(global.rc));
  }
}

// A short, printable, single-line summary of a server's error body: S3's <Code>/<Message>, an
// HTML page's <title>, or else the text with tags removed; at most 200 characters.
std::string SummarizeBody(std::string_view body) {
  auto between = [&](std::string_view open, std::string_view close) -> std::string_view {
    const size_t a = body.find(open);
    if (a == std::string_view::npos) return {};
    const size_t b = body.find(close, a + open.size());
    if (b == std::string_view::npos) return {};
    return body.substr(a + open.size(), b - a - open.size());
  };
  std::string raw;
  const std::string_view code = between("<Code>", "</Code>");
  const std::string_view message = between("<Message>", "</Message>");
  const std::string_view title = between("<title>", "</title>");
  if (!code.empty()) {
    raw = std::string(code) + (message.empty() ? "" : ": " + std::string(message));
  } else if (!title.empty()) {
    raw = std::string(title);
  } else {
    bool in_tag = false;
    for (char c : body.substr(0, 4096)) {
      if (c == '<') in_tag = true;
      else if (c == '>') in_tag = false;
      else if (!in_tag) raw.push_back(c);
    }
  }
  std::string out;
  bool space = false;
  for (char c : raw) {
    const auto u = static_cast<unsigned char>(c);
    if (std::isspace(u)) {
      space = !out.empty();
      continue;
    }
    if (space) out.push_back(' ');
    space = false;
    out.push_back(u < 0x20 || u > 0x7e ? '?' : c);
    if (out.size() >= 200) {
      out += "...";
      break;
    }
  }
  return out;
}

bool IsRetryableStatus(long status) { return status == 429 || (status >= 500 && status <= 599); }

// Transport errors worth another attempt: the server or the path to it may recover.
bool IsRetryableCurlCode(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_HTTP3:
    case CURLE_QUIC_CONNECT_ERROR:
      return true;
    default:
      return false;
  }
}

// Failures where the request certainly never reached the server.
bool NothingWasSent(CURLcode rc) {
  return rc == CURLE_COULDNT_CONNECT || rc == CURLE_COULDNT_RESOLVE_HOST ||
         rc == CURLE_COULDNT_RESOLVE_PROXY;
}

// Retry-After as a delay: delta-seconds or an HTTP date.
std::optional<milliseconds> ParseRetryAfter(std::string_view value) {
  value = TrimAsciiSpace(value);
  if (value.empty()) return std::nullopt;
  if (std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    if (value.size() > 9) return milliseconds(std::numeric_limits<int32_t>::max());
    return milliseconds(std::stoll(std::string(value)) * 1000);
  }
  const std::string date(value);
  const time_t when = curl_getdate(date.c_str(), nullptr);
  if (when < 0) return std::nullopt;
  const time_t now = std::time(nullptr);
  return milliseconds(when > now ? static_cast<int64_t>(when - now) * 1000 : 0);
}

uint64_t RandomBelow(uint64_t bound) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  if (bound == 0) return 0;
  return std::uniform_int_distribution<uint64_t>(0, bound)(rng);
}

// State of one attempt, shared with curl's callbacks.
struct Transfer {
  std::span<const uint8_t> body;
  size_t sent = 0;
  HttpResponse* response = nullptr;
  uint64_t max_response_bytes = 0;
  bool too_large = false;
  bool out_of_memory = false;  // a callback could not grow the response: the transfer was cut
  HttpStats* stats = nullptr;
  // No-progress watchdog: curl's low-speed check averages over a window of several seconds, so
  // a transfer that stops dead after a burst would run on for that long; this cuts it after
  // `stall` without a single byte moving.
  milliseconds stall{0};
  curl_off_t progress_bytes = -1;
  Clock::time_point progress_time;
  bool stalled = false;
};

int XferInfoCallback(void* userdata, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal, curl_off_t ulnow) {
  (void)dltotal;
  (void)ultotal;
  auto* t = static_cast<Transfer*>(userdata);
  const Clock::time_point now = Clock::now();
  const curl_off_t moved = dlnow + ulnow;
  if (moved != t->progress_bytes) {
    t->progress_bytes = moved;
    t->progress_time = now;
    return 0;
  }
  if (t->stall.count() > 0 && now - t->progress_time >= t->stall) {
    t->stalled = true;
    return 1;  // aborts with CURLE_ABORTED_BY_CALLBACK
  }
  return 0;
}

size_t ReadCallback(char* buffer, size_t size, size_t nitems, void* userdata) {
  auto* t = static_cast<Transfer*>(userdata);
  const size_t n = std::min(size * nitems, t->body.size() - t->sent);
  if (n > 0) std::memcpy(buffer, t->body.data() + t->sent, n);
  t->sent += n;
  t->stats->bytes_sent.fetch_add(n, std::memory_order_relaxed);
  return n;
}

int SeekCallback(void* userdata, curl_off_t offset, int origin) {
  auto* t = static_cast<Transfer*>(userdata);
  if (origin != SEEK_SET || offset < 0 || static_cast<uint64_t>(offset) > t->body.size()) {
    return CURL_SEEKFUNC_CANTSEEK;
  }
  t->sent = static_cast<size_t>(offset);
  return CURL_SEEKFUNC_OK;
}

// Called from C (curl): nothing may escape. An allocation failing cuts the transfer, and the
// request fails with ResourceExhausted.
size_t WriteCallback(char* data, size_t size, size_t nmemb, void* userdata) noexcept {
  auto* t = static_cast<Transfer*>(userdata);
  const size_t n = size * nmemb;
  std::vector<uint8_t>& body = t->response->body;
  if (t->max_response_bytes != 0 && body.size() + n > t->max_response_bytes) {
    t->too_large = true;
    return 0;  // aborts the transfer with CURLE_WRITE_ERROR
  }
  try {
    if (body.empty() && body.capacity() == 0) {
      // Size the buffer once from Content-Length. The header is untrusted: beyond the caller's
      // own bound (or 64 MiB without one) the body grows as it arrives instead.
      const std::string_view cl = t->response->Header("content-length");
      uint64_t expected = 0;
      for (char c : cl) {
        if (c < '0' || c > '9' || expected > (uint64_t{1} << 40)) {
          expected = 0;
          break;
        }
        expected = expected * 10 + static_cast<uint64_t>(c - '0');
      }
      const uint64_t cap = t->max_response_bytes != 0 ? t->max_response_bytes : uint64_t{64} << 20;
      if (expected > 0) body.reserve(static_cast<size_t>(std::min(expected, cap)));
    }
    body.insert(body.end(), reinterpret_cast<const uint8_t*>(data), reinterpret_cast<const uint8_t*>(data) + n);
  } catch (...) {
    t->out_of_memory = true;
    return 0;
  }
  t->stats->bytes_received.fetch_add(n, std::memory_order_relaxed);
  return n;
}

// Called from C (curl): nothing may escape (see WriteCallback).
size_t HeaderCallback(char* data, size_t size, size_t nitems, void* userdata) noexcept {
  auto* t = static_cast<Transfer*>(userdata);
  const size_t n = size * nitems;
  const std::string_view line(data, n);
  if (line.rfind("HTTP/", 0) == 0) {
    // A new response begins (after a 100 Continue or a followed redirect): keep only its headers.
    t->response->headers.clear();
    return n;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos || colon == 0) return n;  // blank line or garbage
  try {
    t->response->headers.emplace_back(AsciiLower(TrimAsciiSpace(line.substr(0, colon))),
                                      std::string(TrimAsciiSpace(line.substr(colon + 1))));
  } catch (...) {
    t->out_of_memory = true;
    return 0;  // aborts the transfer
  }
  return n;
}

struct CurlSlist {
  curl_slist* list = nullptr;
  ~CurlSlist() { curl_slist_free_all(list); }
  bool Append(const std::string& s) {
    curl_slist* next = curl_slist_append(list, s.c_str());
    if (next == nullptr) return false;
    list = next;
    return true;
  }
};

// Sleeps `wait` (scaled by the request's test knob), saying so in the log: once at the start and
// every minute after, so that a command or mount that seems stuck says why.
void WaitForRateLimit(const HttpRequest& request, const std::string& what, milliseconds wait, int nth) {
  if (request.on_rate_limited) request.on_rate_limited(wait);
  const int64_t seconds = (wait.count() + 999) / 1000;
  spdlog::warn("http {}: rate-limited (HTTP 429); waiting {} s for the server's rate-limit window to reset "
               "(wait {} of at most {})",
               what, seconds, nth, kMaxRateLimitWaits);
  const double scale = request.rate_limit_time_scale > 0 ? request.rate_limit_time_scale : 1.0;
  const auto real = milliseconds(static_cast<int64_t>(static_cast<double>(wait.count()) / scale));
  const Clock::time_point end = Clock::now() + real;
  const auto report_every = std::chrono::duration_cast<milliseconds>(std::chrono::duration<double>(60.0 / scale));
  for (Clock::time_point now = Clock::now(); now < end; now = Clock::now()) {
    const auto step = std::min<Clock::duration>(end - now, report_every);
    std::this_thread::sleep_for(step);
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(end - Clock::now()).count();
    if (left > 0) spdlog::warn("http {}: still waiting for the rate-limit window, {} s left", what,
                               static_cast<int64_t>(static_cast<double>(left) * scale));
  }
}

}  // namespace

std::string RedactUrl(std::string_view url) {
  url = url.substr(0, url.find_first_of("?#"));
  std::string out(url);
  const size_t scheme = out.find("://");
  if (scheme != std::string::npos) {
    const size_t host_start = scheme + 3;
    const size_t path_start = out.find('/', host_start);
    const size_t at = out.rfind('@', path_start == std::string::npos ? out.size() : path_start);
    if (at != std::string::npos && at >= host_start) out.erase(host_start, at + 1 - host_start);
  }
  return out;
}

std::string_view HttpResponse::Header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (AsciiEqualsIgnoreCase(k, name)) return v;
  }
  return {};
}

// The handle pool and the DNS/TLS-session share. Lock order: `mu` only; the share's own
// mutexes are taken by curl inside a transfer and never while `mu` is held.
struct HttpClient::Pool {
  explicit Pool(size_t max) : max_in_use(std::max<size_t>(max, 1)) {
    share = curl_share_init();
    if (share != nullptr) {
      curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
      curl_share_setopt(share, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
      curl_share_setopt(share, CURLSHOPT_LOCKFUNC, &Pool::Lock);
      curl_share_setopt(share, CURLSHOPT_UNLOCKFUNC, &Pool::Unlock);
      curl_share_setopt(share, CURLSHOPT_USERDATA, this);
    }
  }
  ~Pool() {
    // REQUIRES: no Send in flight (the client outlives its callers).
    for (CURL* h : idle) curl_easy_cleanup(h);
    if (share != nullptr) curl_share_cleanup(share);
  }

  static void Lock(CURL*, curl_lock_data data, curl_lock_access, void* userptr) {
    static_cast<Pool*>(userptr)->share_mu[static_cast<size_t>(data) % CURL_LOCK_DATA_LAST].lock();
  }
  static void Unlock(CURL*, curl_lock_data data, void* userptr) {
    static_cast<Pool*>(userptr)->share_mu[static_cast<size_t>(data) % CURL_LOCK_DATA_LAST].unlock();
  }

  // A handle (reset to defaults, its live connections kept), or nullptr when none is free
  // before `deadline` or curl cannot allocate one.
  CURL* Acquire(Clock::time_point deadline) WFS_EXCLUDES(mu) {
    CURL* h = nullptr;
    {
      MutexLock lock(mu);
      if (!cv.WaitUntil(mu, deadline, [&]() WFS_REQUIRES(mu) { return in_use < max_in_use; })) return nullptr;
      ++in_use;
      if (!idle.empty()) {
        h = idle.back();  // LIFO: the most recently used connection is the likeliest alive
        idle.pop_back();
      }
    }
    if (h == nullptr) {
      h = curl_easy_init();
      if (h == nullptr) Release(nullptr);
    } else {
      curl_easy_reset(h);
    }
    return h;
  }

  void Release(CURL* h) WFS_EXCLUDES(mu) {
    {
      MutexLock lock(mu);
      --in_use;
      if (h != nullptr) idle.push_back(h);
    }
    cv.NotifyOne();
  }

  CURLSH* share = nullptr;
  // Plain std::mutex: curl locks and unlocks them in separate callbacks, which the analysis
  // cannot pair.
  std::array<std::mutex, CURL_LOCK_DATA_LAST> share_mu;
  const size_t max_in_use;
  Mutex mu;
  CondVar cv;
  std::vector<CURL*> idle WFS_GUARDED_BY(mu);
  size_t in_use WFS_GUARDED_BY(mu) = 0;  // handles lent out, at most max_in_use
};

HttpClient::HttpClient(HttpOptions options) : options_(std::move(options)) {
  EnsureCurlGlobal();
  pool_ = std::make_unique<Pool>(options_.max_connections);
}

HttpClient::~HttpClient() = default;

namespace {
thread_local const OperationDeadline* current_deadline = nullptr;
}  // namespace

OperationDeadline::OperationDeadline(Clock::time_point at, std::string what)
    : at_(at), what_(std::move(what)), previous_(current_deadline) {
  if (previous_ && previous_->at() < at_) {  // the earliest bound stands
    at_ = previous_->at();
    what_ = previous_->what();
  }
  current_deadline = this;
}

OperationDeadline::~OperationDeadline() { current_deadline = previous_; }

const OperationDeadline* OperationDeadline::Current() { return current_deadline; }

Expected<HttpResponse> HttpClient::Send(HttpRequest request) {
  Clock::time_point deadline = Clock::now() + options_.total_timeout;
  const OperationDeadline* op = OperationDeadline::Current();
  if (op && op->at() < deadline) deadline = op->at();
  int rate_limit_waits = 0;
  const std::string what = request.method + " " + RedactUrl(request.url);
  // A server marked unreachable gets one attempt per request until it answers again.
  const int max_attempts = unreachable_.load() ? 1 : std::max(options_.max_attempts, 1);
  // The bound that ends this Send when it runs out.
  auto bound = [&] {
    return op && op->at() <= deadline ? op->what() : "total timeout " + std::to_string(options_.total_timeout.count()) + " ms";
  };
  bool answered = false;  // the last attempt reached a server that answered (see below)
  // The request's end as a failure: a server that gave no answer at all is marked unreachable.
  auto unanswered = [&]() {
    if (!answered && !unreachable_.exchange(true)) {
      spdlog::warn("http {}: the server does not answer; until it does, requests to it fail after one attempt",
                   RedactUrl(request.url));
    }
  };
  std::string method_upper = request.method;
  for (char& c : method_upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  auto give_up = [&](const Status& error, int attempts) {
    unanswered();
    if (attempts <= 1) return error;
    return Status(error.kind(), error.message() + " (after " + std::to_string(attempts) + " attempts)");
  };

  Status last_error;
  for (int attempt = 1;; ++attempt) {
    std::optional<milliseconds> rate_limit_wait;  // set when the server scheduled the retry
    const auto remaining = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (remaining.count() <= 0) {
      if (!last_error.ok()) return give_up(last_error, attempt - 1);
      return Status::Timeout(what + ": " + bound() + " exhausted");
    }
    std::optional<milliseconds> retry_after;
    {
      CURL* h = pool_->Acquire(deadline);
      if (h == nullptr) {
        if (!last_error.ok()) return give_up(last_error, attempt - 1);
        return Status::Timeout(what + ": no free HTTP connection (max_connections " +
                               std::to_string(options_.max_connections) + ") within the total timeout");
      }
      struct Lease {
        Pool* pool;
        CURL* h;
        ~Lease() { pool->Release(h); }
      } lease{pool_.get(), h};

      HttpRequest attempt_request = request;
      if (attempt_request.sign) attempt_request.sign(attempt_request);

      HttpResponse response;
      Transfer transfer;
      transfer.body = attempt_request.body;
      transfer.response = &response;
      transfer.max_response_bytes = attempt_request.max_response_bytes;
      transfer.stats = &stats_;
      if (options_.low_speed_bytes_per_s > 0) transfer.stall = options_.stall_timeout;
      std::array<char, CURL_ERROR_SIZE> errbuf{};

      CurlSlist headers;
      bool has_expect = false;
      bool alloc_failed = false;
      for (const auto& [name, value] : attempt_request.headers) {
        if (AsciiEqualsIgnoreCase(name, "expect")) has_expect = true;
        // "Name;" is curl's spelling of a header with an empty value ("Name:" would remove it).
        alloc_failed |= !headers.Append(value.empty() ? name + ";" : name + ": " + value);
      }
      if (!has_expect) alloc_failed |= !headers.Append("Expect:");  // no 100-continue round trip
      if (alloc_failed) return Status::ResourceExhausted(what + ": out of memory building headers");

      milliseconds attempt_budget = remaining;
      if (options_.request_timeout.count() > 0) attempt_budget = std::min(attempt_budget, options_.request_timeout);
      const long timeout_ms = static_cast<long>(std::max<int64_t>(1, attempt_budget.count()));
      const long connect_ms =
          static_cast<long>(std::max<int64_t>(1, std::min(options_.connect_timeout, attempt_budget).count()));

      curl_easy_setopt(h, CURLOPT_URL, attempt_request.url.c_str());
      curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
      curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
      if (pool_->share != nullptr) curl_easy_setopt(h, CURLOPT_SHARE, pool_->share);
      curl_easy_setopt(h, CURLOPT_ERRORBUFFER, errbuf.data());
      curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, connect_ms);
      curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
      if (options_.stall_timeout.count() > 0 && options_.low_speed_bytes_per_s > 0) {
        // curl measures the low-speed window in whole seconds.
        const long stall_s = static_cast<long>(std::max<int64_t>(1, (options_.stall_timeout.count() + 999) / 1000));
        const long limit = static_cast<long>(
            std::min<uint64_t>(options_.low_speed_bytes_per_s, std::numeric_limits<long>::max()));
        curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, limit);
        curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, stall_s);
      }
      curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
      curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, &XferInfoCallback);
      curl_easy_setopt(h, CURLOPT_XFERINFODATA, &transfer);
      curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 1L);
      curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 2L);
      if (!options_.ca_file.empty()) curl_easy_setopt(h, CURLOPT_CAINFO, options_.ca_file.c_str());
      curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
      curl_easy_setopt(h, CURLOPT_BUFFERSIZE, 512L * 1024);
      curl_easy_setopt(h, CURLOPT_UPLOAD_BUFFERSIZE, 1024L * 1024);
      curl_easy_setopt(h, CURLOPT_USERAGENT, options_.user_agent.c_str());
      if (attempt_request.follow_redirects) {
        curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 1L);
        curl_easy_setopt(h, CURLOPT_MAXREDIRS, 5L);
        curl_easy_setopt(h, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
      } else {
        curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
      }
      curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, &HeaderCallback);
      curl_easy_setopt(h, CURLOPT_HEADERDATA, &transfer);
      curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, &WriteCallback);
      curl_easy_setopt(h, CURLOPT_WRITEDATA, &transfer);

      if (method_upper == "HEAD") {
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
      } else if (method_upper == "GET" && transfer.body.empty()) {
        curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
      } else if (!transfer.body.empty() || method_upper == "PUT" || method_upper == "POST") {
        // The body goes through the read callback (no copy, no form Content-Type, rewindable
        // for curl's own resends) with an exact Content-Length.
        curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
        curl_easy_setopt(h, CURLOPT_READFUNCTION, &ReadCallback);
        curl_easy_setopt(h, CURLOPT_READDATA, &transfer);
        curl_easy_setopt(h, CURLOPT_SEEKFUNCTION, &SeekCallback);
        curl_easy_setopt(h, CURLOPT_SEEKDATA, &transfer);
        curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(transfer.body.size()));
        if (method_upper != "PUT") curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, attempt_request.method.c_str());
      } else {
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, attempt_request.method.c_str());
      }
      curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers.list);
      // curl silently resends a request whose reused connection turns out dead before any answer;
      // a request that must not run twice therefore gets a connection of its own.
      if (!request.idempotent) curl_easy_setopt(h, CURLOPT_FRESH_CONNECT, 1L);

      const Clock::time_point attempt_start = Clock::now();
      stats_.requests.fetch_add(1, std::memory_order_relaxed);
      const CURLcode rc = curl_easy_perform(h);
      const auto elapsed_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - attempt_start).count();
      long status = 0;
      curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
      response.status = status;
      answered = status != 0;
      if (answered && unreachable_.exchange(false)) {
        spdlog::warn("http {}: the server answers again", RedactUrl(request.url));
      }

      bool retryable = false;
      if (rc == CURLE_OK) {
        spdlog::debug("http {} -> {} ({} bytes, {} ms, attempt {}/{})", what, status, response.body.size(),
                      elapsed_ms, attempt, max_attempts);
        if (!IsRetryableStatus(status) || !request.idempotent) return response;
        const std::string_view body(reinterpret_cast<const char*>(response.body.data()), response.body.size());
        last_error = HttpStatusError(status, what, body);
        retryable = true;
        if (status == 429 || status == 503) retry_after = ParseRetryAfter(response.Header("retry-after"));
        if (status == 429 && !retry_after) {
          if (auto reset = ParseRateLimitReset(response.Header("ratelimit"))) {
            retry_after = milliseconds(static_cast<int64_t>(std::min<uint64_t>(*reset, 3600)) * 1000);
          }
        }
        if (status == 429 && retry_after && request.rate_limit_max_wait.count() > 0 &&
            rate_limit_waits < kMaxRateLimitWaits) {
          milliseconds cap = request.rate_limit_max_wait;
          if (auto w = ParseRateLimitWindow(response.Header("ratelimit-policy"))) {
            cap = std::min(cap, milliseconds(static_cast<int64_t>(std::min<uint64_t>(*w, 86400)) * 1000));
          }
          // The window has reset by then: one second more so the retry lands in the next one.
          if (*retry_after <= cap) rate_limit_wait = *retry_after + milliseconds(1000);
        }
      } else {
        std::string detail = errbuf[0] != '\0' ? std::string(errbuf.data()) : curl_easy_strerror(rc);
        while (!detail.empty() && (detail.back() == '\n' || detail.back() == '\r')) detail.pop_back();
        spdlog::debug("http {} failed after {} ms (attempt {}/{}): {}", what, elapsed_ms, attempt, max_attempts,
                      detail);
        if (transfer.too_large) {
          return Status::ResourceExhausted(what + ": response body larger than " +
                                           std::to_string(attempt_request.max_response_bytes) + " bytes");
        }
        if (transfer.out_of_memory) {
          return Status::ResourceExhausted(what + ": out of memory receiving the response (" +
                                           std::to_string(response.body.size()) + " bytes so far)");
        }
        if (transfer.stalled) {
          detail = "no data moved for " + std::to_string(options_.stall_timeout.count()) + " ms (stall timeout)";
        }
        const bool timed_out = rc == CURLE_OPERATION_TIMEDOUT || transfer.stalled;
        // Refused, no name, or nothing back at all: the server does not answer (a reset or a
        // broken reply is an answer of a kind, from a server that is there).
        answered = !(NothingWasSent(rc) || (timed_out && status == 0));
        last_error = Status(timed_out ? ErrorKind::kTimeout : ErrorKind::kIOError, what + ": " + detail);
        retryable = (IsRetryableCurlCode(rc) || transfer.stalled) && (request.idempotent || NothingWasSent(rc));
      }
      if (!retryable || (attempt >= max_attempts && !rate_limit_wait)) return give_up(last_error, attempt);
    }  // the handle goes back to the pool before the backoff, for others to use

    if (rate_limit_wait) {
      if (op && Clock::now() + *rate_limit_wait > op->at()) {
        return Status(last_error.kind(), last_error.message() + " (the server asks to wait " +
                                             std::to_string(rate_limit_wait->count() / 1000) + " s, beyond " +
                                             op->what() + ")");
      }
      WaitForRateLimit(request, what, *rate_limit_wait, ++rate_limit_waits);
      deadline += *rate_limit_wait;  // the server's schedule, not time spent failing
      --attempt;                      // nor an attempt
      continue;
    }

    // Full jitter: uniform in [0, min(max, base * 2^(attempt-1))]; Retry-After overrides it.
    const int64_t base = std::max<int64_t>(0, options_.backoff_base.count());
    const int64_t cap = std::max<int64_t>(0, options_.backoff_max.count());
    int64_t ceiling = base;
    for (int i = 1; i < attempt && ceiling < cap; ++i) ceiling *= 2;
    ceiling = std::min(ceiling, cap);
    milliseconds delay(static_cast<int64_t>(RandomBelow(static_cast<uint64_t>(ceiling))));
    if (retry_after) delay = std::min(*retry_after, milliseconds(cap));
    if (Clock::now() + delay >= deadline) {
      spdlog::warn("http {}; giving up after {} attempts ({})", last_error.message(), attempt, bound());
      unanswered();
      return Status(last_error.kind(), last_error.message() + " (after " + std::to_string(attempt) + " attempts; " +
                                           bound() + ")");
    }
    spdlog::warn("http {}; retry {}/{} in {} ms", last_error.message(), attempt, max_attempts - 1, delay.count());
    stats_.retries.fetch_add(1, std::memory_order_relaxed);
    std::this_thread::sleep_for(delay);
  }
}

Status HttpStatusError(long status, std::string_view what, std::string_view server_message) {
  std::string m = std::string(what) + ": HTTP " + std::to_string(status);
  const std::string summary = SummarizeBody(server_message);
  if (!summary.empty()) m += ": " + summary;
  if (status == 404) return Status::NotFound(std::move(m));
  if (status == 401 || status == 403) return Status::Auth(std::move(m));
  if (status == 409 || status == 412) return Status::Conflict(std::move(m));
  if (status == 408 || status == 504) return Status::Timeout(std::move(m));
  return Status::IOError(std::move(m));
}

namespace {

// The first `name=N` parameter of a structured RateLimit / RateLimit-Policy header.
std::optional<uint64_t> RateLimitParam(std::string_view header, char name) {
  // Parameters are ';'-separated after the policy name; values are non-negative integers.
  size_t pos = 0;
  while (pos < header.size()) {
    size_t end = header.find_first_of(";,", pos);
    if (end == std::string_view::npos) end = header.size();
    std::string_view item = TrimAsciiSpace(header.substr(pos, end - pos));
    if (item.size() > 2 && std::tolower(static_cast<unsigned char>(item[0])) == name && item[1] == '=') {
      item.remove_prefix(2);
      uint64_t v = 0;
      bool ok = !item.empty() && item.size() <= 12;
      for (char c : item) {
        if (c < '0' || c > '9') ok = false;
        else v = v * 10 + static_cast<uint64_t>(c - '0');
      }
      if (ok) return v;
    }
    pos = end + 1;
  }
  return std::nullopt;
}

}  // namespace

std::optional<uint64_t> ParseRateLimitReset(std::string_view header) { return RateLimitParam(header, 't'); }

std::optional<uint64_t> ParseRateLimitWindow(std::string_view policy_header) {
  return RateLimitParam(policy_header, 'w');
}

std::optional<uint64_t> ParseU64(std::string_view s) {
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

std::optional<ContentRange> ParseContentRange(std::string_view v) {
  if (v.rfind("bytes ", 0) != 0) return std::nullopt;
  v.remove_prefix(6);
  const size_t dash = v.find('-'), slash = v.find('/');
  if (dash == std::string_view::npos || slash == std::string_view::npos || slash < dash) return std::nullopt;
  auto first = ParseU64(v.substr(0, dash));
  auto last = ParseU64(v.substr(dash + 1, slash - dash - 1));
  if (!first || !last || *last < *first) return std::nullopt;
  ContentRange r{*first, *last, std::nullopt};
  const std::string_view total = v.substr(slash + 1);
  if (total != "*") {
    r.total = ParseU64(total);
    if (!r.total) return std::nullopt;
  }
  return r;
}

std::string UrlEncode(std::string_view s, bool keep_slash) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size() * 3);
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    const bool unreserved = (u >= 'A' && u <= 'Z') || (u >= 'a' && u <= 'z') || (u >= '0' && u <= '9') ||
                            u == '-' || u == '.' || u == '_' || u == '~';
    if (unreserved || (keep_slash && u == '/')) {
      out.push_back(c);
    } else {
      out.push_back('%');
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 0xF]);
    }
  }
  return out;
}

std::string Printable(std::string_view s, size_t max) {
  std::string out;
  for (char c : s.substr(0, max)) {
    const auto u = static_cast<unsigned char>(c);
    out.push_back(u < 0x20 || u > 0x7e ? '?' : c);
  }
  if (s.size() > max) out += "...";
  return out;
}

std::string RangedGet::RangeHeader() const {
  std::string spec = "bytes=" + std::to_string(offset_) + "-";
  // An end past what a signed 64-bit offset holds is left out ("to the end", the same bytes):
  // nginx answers 416 to one.
  constexpr uint64_t kMaxEnd = static_cast<uint64_t>(INT64_MAX);
  if (bounded_ && offset_ <= kMaxEnd && length_ - 1 <= kMaxEnd - offset_) spec += std::to_string(offset_ + length_ - 1);
  return spec;
}

uint64_t RangedGet::MaxResponseBytes() const {
  return bounded_ && length_ <= (1ull << 40) ? length_ + (1u << 20) : 0;
}

Status RangedGet::PastEnd(uint64_t size) const {
  return Status::InvalidArgument("range offset " + std::to_string(offset_) + " past the end of " + name_ + " (" +
                                 std::to_string(size) + " bytes)");
}

Expected<std::vector<uint8_t>> RangedGet::Take(HttpResponse& r, std::string_view what) const {
  if (r.status == 200) {
    if (!Ranged()) return std::move(r.body);
    // The server ignored Range and sent everything: slice it here.
    if (offset_ > r.body.size()) return PastEnd(r.body.size());
    const uint64_t n = std::min<uint64_t>(r.body.size() - offset_, length_);
    return std::vector<uint8_t>(r.body.begin() + static_cast<ptrdiff_t>(offset_),
                                r.body.begin() + static_cast<ptrdiff_t>(offset_ + n));
  }
  const std::string_view header = r.Header("content-range");
  const std::optional<ContentRange> cr = ParseContentRange(header);
  if (r.status != 206 || !cr || cr->first != offset_ || r.body.size() != cr->last - cr->first + 1) {
    return Status::Corruption(std::string(what) + ": " + std::to_string(r.status) +
                              " response does not match the requested range (Content-Range '" + Printable(header, 80) + "', " +
                              std::to_string(r.body.size()) + " bytes)");
  }
  // More than asked for (a server that ignored the end of the range): keep what was asked.
  if (r.body.size() > length_) r.body.resize(length_);
  return std::move(r.body);
}

Expected<std::vector<uint8_t>> RangedGet::AtSize(uint64_t size, bool refused, std::string_view what) const {
  if (offset_ > size) return PastEnd(size);
  if (offset_ == size || !refused) return std::vector<uint8_t>();
  return Status::IOError(std::string(what) + ": server refused range " + std::to_string(offset_) + "- of an object of " +
                         std::to_string(size) + " bytes (HTTP 416)");
}

std::optional<uint64_t> RangedGet::SizeOf416(const HttpResponse& r) {
  const std::string_view cr = r.Header("content-range");
  if (cr.rfind("bytes */", 0) != 0) return std::nullopt;
  return ParseU64(cr.substr(8));
}

void RequestsInParallel(size_t n, size_t threads, const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  const OperationDeadline* op = OperationDeadline::Current();
  std::optional<std::pair<OperationDeadline::Clock::time_point, std::string>> bound;
  if (op) bound.emplace(op->at(), op->what());
  auto work = [&]() noexcept {
    std::optional<OperationDeadline> deadline;
    if (bound) deadline.emplace(bound->first, bound->second);
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
      }
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(threads);
    for (size_t t = 1; t < std::min(n, threads); ++t) pool.emplace_back(work);
  } catch (const std::exception&) {
    // Fewer threads: the others (this one at least) do the rest.
  }
  work();
  for (std::thread& t : pool) t.join();
}

}  // namespace weightfs
