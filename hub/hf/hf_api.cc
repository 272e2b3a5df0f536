#include "hub/hf/hf_api.h"

#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <ctime>
#include <set>
#include <sstream>
#include <thread>

#include "core/ascii.h"

namespace weightfs {
namespace {

constexpr int kMaxRedirects = 5;
constexpr uint64_t kMaxJsonResponse = 64ull << 20;

std::string_view TrimWs(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool IsTrue(const std::optional<std::string>& v) {
  if (!v) return false;
  const std::string l = AsciiLower(TrimWs(*v));
  return l == "1" || l == "on" || l == "yes" || l == "true";
}

// The `error` of a JSON error body ({"error": "..."} or {"errors":[{"message":...}]}), or "".
std::string JsonErrorMessage(const std::vector<uint8_t>& body) {
  if (body.empty() || body.size() > (1u << 20)) return "";
  const auto j = nlohmann::json::parse(body.begin(), body.end(), nullptr, false);
  if (!j.is_object()) return "";
  if (auto it = j.find("error"); it != j.end() && it->is_string()) return it->get<std::string>();
  if (auto it = j.find("errors"); it != j.end() && it->is_array() && !it->empty() && (*it)[0].is_object()) {
    const auto& m = (*it)[0].find("message");
    if (m != (*it)[0].end() && m->is_string()) return m->get<std::string>();
  }
  return "";
}

std::string RedactQuery(std::string_view url) { return std::string(url.substr(0, url.find_first_of("?#"))); }

}  // namespace

// ---- helpers ------------------------------------------------------------------------------------

namespace hf {

std::string ParseLinkNext(std::string_view header) {
  // Link: <url1>; rel="next", <url2>; rel="last"
  size_t pos = 0;
  while (pos < header.size()) {
    const size_t open = header.find('<', pos);
    if (open == std::string_view::npos) return "";
    const size_t close = header.find('>', open + 1);
    if (close == std::string_view::npos) return "";
    const std::string_view url = header.substr(open + 1, close - open - 1);
    size_t end = header.find('<', close + 1);  // the next link starts with '<'
    if (end == std::string_view::npos) end = header.size();
    std::string params = AsciiLower(header.substr(close + 1, end - close - 1));
    params.erase(std::remove_if(params.begin(), params.end(), [](char c) { return c == ' ' || c == '\t'; }),
                 params.end());
    if (params.find("rel=\"next\"") != std::string::npos || params.find("rel=next") != std::string::npos) {
      return std::string(url);
    }
    pos = end;
  }
  return "";
}

std::string UrlOrigin(std::string_view url) {
  const size_t sep = url.find("://");
  if (sep == std::string_view::npos) return "";
  const std::string scheme = AsciiLower(url.substr(0, sep));
  if (scheme != "http" && scheme != "https") return "";
  std::string_view rest = url.substr(sep + 3);
  std::string_view authority = rest.substr(0, rest.find_first_of("/?#"));
  if (authority.find('@') != std::string_view::npos) return "";  // userinfo: never trusted
  if (authority.empty()) return "";
  std::string host, port;
  if (authority.front() == '[') {  // IPv6 literal
    const size_t rb = authority.find(']');
    if (rb == std::string_view::npos) return "";
    host = AsciiLower(authority.substr(0, rb + 1));
    if (rb + 1 < authority.size()) {
      if (authority[rb + 1] != ':') return "";
      port = std::string(authority.substr(rb + 2));
    }
  } else {
    const size_t colon = authority.rfind(':');
    host = AsciiLower(authority.substr(0, colon));
    if (colon != std::string_view::npos) port = std::string(authority.substr(colon + 1));
  }
  if (host.empty()) return "";
  if (port.empty()) port = scheme == "https" ? "443" : "80";
  if (!ParseU64(port)) return "";
  return scheme + "://" + host + ":" + std::to_string(*ParseU64(port));
}

std::string ResolveUrl(std::string_view base, std::string_view location) {
  location = TrimWs(location);
  if (location.empty()) return "";
  const size_t sep = location.find("://");
  const size_t first_special = location.find_first_of("/?#");
  if (sep != std::string_view::npos && (first_special == std::string_view::npos || sep < first_special)) {
    const std::string scheme = AsciiLower(location.substr(0, sep));
    if (scheme != "http" && scheme != "https") return "";
    return std::string(location);
  }
  const size_t bsep = base.find("://");
  if (bsep == std::string_view::npos) return "";
  const std::string scheme(base.substr(0, bsep));
  // The result takes the base's scheme, so the base must be http(s) too.
  if (AsciiLower(scheme) != "http" && AsciiLower(scheme) != "https") return "";
  if (location.starts_with("//")) return scheme + ":" + std::string(location);
  // The base's authority ends at its path, query or fragment.
  const size_t path_start = base.find_first_of("/?#", bsep + 3);
  const std::string origin(base.substr(0, path_start));
  if (location.front() == '/') return origin + std::string(location);
  // Relative path: replace the last segment of the base path (query dropped).
  std::string path = path_start == std::string_view::npos || base[path_start] != '/'
                         ? "/"
                         : RedactQuery(base.substr(path_start));
  path = path.substr(0, path.rfind('/') + 1);
  return origin + path + std::string(location);
}

bool IsCommitSha(std::string_view s) {
  return s.size() == 40 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

std::optional<std::chrono::system_clock::time_point> SignedUrlExpiry(std::string_view url) {
  const size_t q = url.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  std::string_view query = url.substr(q + 1);
  query = query.substr(0, query.find('#'));
  std::optional<uint64_t> amz_expires, expires;
  std::optional<time_t> amz_date;
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view item = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string_view name = item.substr(0, eq), value = item.substr(eq + 1);
    if (name == "X-Amz-Expires") amz_expires = ParseU64(value);
    if (name == "Expires") expires = ParseU64(value);
    if (name == "X-Amz-Date" && value.size() == 16 && value[8] == 'T' && value[15] == 'Z') {
      std::tm tm{};
      const std::string v(value);
      if (::strptime(v.c_str(), "%Y%m%dT%H%M%SZ", &tm) != nullptr) amz_date = ::timegm(&tm);
    }
  }
  std::optional<std::chrono::system_clock::time_point> out;
  auto take = [&](int64_t unix_seconds) {
    const auto t = std::chrono::system_clock::time_point(std::chrono::seconds(unix_seconds));
    if (!out || t < *out) out = t;
  };
  // Bounded so that a hostile URL cannot overflow the arithmetic.
  constexpr uint64_t kMaxSeconds = 1ull << 40;
  if (amz_date && amz_expires && *amz_expires < kMaxSeconds) take(static_cast<int64_t>(*amz_date + static_cast<time_t>(*amz_expires)));
  if (expires && *expires < kMaxSeconds) take(static_cast<int64_t>(*expires));
  return out;
}

std::string ExpandUserAndVars(std::string_view path,
                              const std::function<std::optional<std::string>(std::string_view)>& env) {
  // expandvars: $NAME and ${NAME}, NAME of [A-Za-z0-9_]; unknown ones are kept as written.
  std::string vars;
  for (size_t i = 0; i < path.size();) {
    if (path[i] != '$') {
      vars.push_back(path[i++]);
      continue;
    }
    size_t name_start = i + 1, name_end, next;
    if (name_start < path.size() && path[name_start] == '{') {
      const size_t close = path.find('}', name_start);
      if (close == std::string_view::npos) {
        vars.push_back(path[i++]);
        continue;
      }
      name_end = close;
      ++name_start;
      next = close + 1;
    } else {
      name_end = name_start;
      while (name_end < path.size() && (std::isalnum(static_cast<unsigned char>(path[name_end])) || path[name_end] == '_')) {
        ++name_end;
      }
      next = name_end;
    }
    const std::string_view name = path.substr(name_start, name_end - name_start);
    std::optional<std::string> value = name.empty() ? std::nullopt : env(name);
    vars += value ? *value : std::string(path.substr(i, next - i));
    i = next;
  }
  // expanduser: "~" or "~/..." is HOME (else the passwd entry); "~user/..." that user's home.
  if (vars.empty() || vars[0] != '~') return vars;
  const size_t slash = vars.find('/');
  const std::string user = vars.substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
  std::optional<std::string> home;
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (user.empty()) {
    home = env("HOME");
    if (!home && ::getpwuid_r(::getuid(), &pw, buf.data(), buf.size(), &found) == 0 && found) home = found->pw_dir;
  } else if (::getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found) == 0 && found) {
    home = found->pw_dir;
  }
  if (!home) return vars;
  std::string h = *home;
  while (h.size() > 1 && h.back() == '/') h.pop_back();
  return h + (slash == std::string::npos ? "" : vars.substr(slash));
}

}  // namespace hf

// ---- configuration ------------------------------------------------------------------------------

Expected<HfConfig> LoadHfConfig(const HfEnvLookup& env_in) {
  const HfEnvLookup env = env_in ? env_in : ProcessAwsEnv();
  auto get = [&](const char* name) -> std::optional<std::string> {
    auto v = env(name);
    if (!v || v->empty()) return std::nullopt;
    return v;
  };
  HfConfig c;
  if (auto e = get("HF_ENDPOINT")) c.endpoint = std::string(TrimWs(*e));
  while (!c.endpoint.empty() && c.endpoint.back() == '/') c.endpoint.pop_back();
  {
    const std::string origin = hf::UrlOrigin(c.endpoint);
    const size_t sep = c.endpoint.find("://");
    const std::string_view authority =
        sep == std::string::npos ? std::string_view() : std::string_view(c.endpoint).substr(sep + 3);
    if (authority.substr(0, authority.find('/')).find('@') != std::string_view::npos) {
      return Status::InvalidArgument("HF_ENDPOINT must not contain credentials; use HF_TOKEN");
    }
    if (origin.empty() || c.endpoint.find_first_of("?# ") != std::string::npos) {
      return Status::InvalidArgument("HF_ENDPOINT '" + Printable(c.endpoint, 200) +
                                     "' is not an http(s)://host[:port][/path] URL");
    }
  }

  // As huggingface_hub's constants: each path is expanduser(expandvars(...)).
  auto expand = [&](std::string_view p) { return hf::ExpandUserAndVars(p, env); };
  if (auto h = get("HF_HOME")) {
    c.home = expand(*h);
  } else if (auto x = get("XDG_CACHE_HOME")) {
    c.home = expand(*x + "/huggingface");
  } else {
    c.home = expand("~/.cache/huggingface");
    if (c.home.starts_with("~")) c.home = "/tmp/.cache/huggingface";  // no home directory at all
  }
  if (auto hc = get("HF_HUB_CACHE")) c.hub_cache = expand(*hc);
  else if (auto legacy = get("HUGGINGFACE_HUB_CACHE")) c.hub_cache = expand(*legacy);
  else c.hub_cache = c.home + "/hub";
  c.offline = IsTrue(env("HF_HUB_OFFLINE")) || IsTrue(env("TRANSFORMERS_OFFLINE"));
  if (auto scale = get("WEIGHTFS_TEST_TIME_SCALE")) {
    char* end = nullptr;
    const double v = std::strtod(scale->c_str(), &end);
    if (end == scale->c_str() || *end != '\0' || !(v >= 1.0 && v <= 1e6)) {
      return Status::InvalidArgument("WEIGHTFS_TEST_TIME_SCALE must be a number from 1 to 1e6");
    }
    c.time_scale = v;
  }

  // huggingface_hub sends no implicit token at all (neither HF_TOKEN nor the file) then.
  if (IsTrue(env("HF_HUB_DISABLE_IMPLICIT_TOKEN"))) return c;
  for (const char* name : {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}) {
    if (auto t = get(name)) {
      c.token = std::string(TrimWs(*t));
      if (!c.token.empty()) {
        c.token_source = name;
        break;
      }
    }
  }
  if (c.token.empty()) {
    const std::string path = get("HF_TOKEN_PATH") ? expand(*get("HF_TOKEN_PATH")) : c.home + "/token";
    c.token_file = path;  // followed by HfApi even when it does not exist yet (a later login)
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      std::string text = ss.str();
      if (text.size() <= 64 * 1024) {
        c.token = std::string(TrimWs(text));
        if (!c.token.empty()) c.token_source = "token file " + path;
      }
    }
  }
  // A token is one header value: refuse anything that could break the header.
  if (c.token.find_first_of("\r\n\t ") != std::string::npos ||
      std::any_of(c.token.begin(), c.token.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20; })) {
    return Status::InvalidArgument("the Hugging Face token from " + c.token_source +
                                   " contains whitespace or control characters");
  }
  return c;
}

// ---- HfApi --------------------------------------------------------------------------------------

namespace {

using SteadyClock = std::chrono::steady_clock;

int64_t SteadyNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(SteadyClock::now().time_since_epoch()).count();
}

// "ino:size:mtime" of a file, or "" when it cannot be stat'ed.
std::string FileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  return std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) +
         "." + std::to_string(st.st_mtim.tv_nsec);
}

bool IsResolveUrl(std::string_view url) { return RedactQuery(url).find("/resolve/") != std::string::npos; }

// A CDN answer that means "this signed URL no longer works" (expired, revoked, moved away).
bool TargetGone(long status) { return status == 400 || status == 401 || status == 403 || status == 404 || status == 410; }

// Until when a signed target may be reused: up to a minute (or a tenth of its lifetime) before
// it expires; ten minutes when the URL does not say (an expired one answers 403: resolved anew).
SteadyClock::time_point ReuseUntil(std::string_view target) {
  const auto now = SteadyClock::now();
  const auto expiry = hf::SignedUrlExpiry(target);
  if (!expiry) return now + std::chrono::minutes(10);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*expiry - std::chrono::system_clock::now());
  if (left.count() <= 0) return now;
  const auto margin = std::min<std::chrono::milliseconds>(std::chrono::minutes(1), left / 10);
  return now + (left - margin);
}

constexpr size_t kMaxResolvedTargets = 10'000;

}  // namespace

HfApi::HfApi(HfConfig config, std::shared_ptr<HttpClient> http)
    : config_(std::move(config)), http_(std::move(http)) {
  if (!http_) http_ = std::make_shared<HttpClient>();
  origin_ = hf::UrlOrigin(config_.endpoint);
  token_ = config_.token;
  if (!token_.empty()) past_tokens_.push_back(token_);
  if (!config_.token_file.empty()) token_file_id_ = FileIdentity(config_.token_file);
}

std::string HfApi::Token() const {
  if (config_.token_file.empty()) return config_.token;
  const std::string id = FileIdentity(config_.token_file);
  MutexLock lock(token_mu_);
  if (id == token_file_id_) return token_;
  token_file_id_ = id;
  std::string text;
  if (!id.empty()) {
    std::ifstream in(config_.token_file, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str().substr(0, 64 * 1024);
  }
  std::string fresh(TrimWs(text));
  if (fresh.find_first_of("\r\n\t ") != std::string::npos ||
      std::any_of(fresh.begin(), fresh.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x20; })) {
    spdlog::warn("hf: the token file {} holds whitespace or control characters; sending no token",
                 config_.token_file);
    fresh.clear();
  }
  if (fresh != token_) {
    spdlog::info("hf: the token file {} changed; {}", config_.token_file,
                 fresh.empty() ? "no token from now on" : "using its new token");
    if (!fresh.empty() && past_tokens_.size() < 64) past_tokens_.push_back(fresh);
    token_ = fresh;
  }
  return token_;
}

void HfApi::WaitIfRateLimited(std::string_view url) const {
  const auto& blocked = IsResolveUrl(url) ? resolvers_blocked_until_ms_ : api_blocked_until_ms_;
  const int64_t until = blocked.load(std::memory_order_relaxed);
  const int64_t now = SteadyNowMs();
  if (until <= now) return;
  spdlog::info("hf: {}: holding back {} ms until the Hub's {} rate-limit window resets", RedactQuery(url),
               until - now, IsResolveUrl(url) ? "resolvers" : "API");
  std::this_thread::sleep_for(std::chrono::milliseconds(until - now));
}

bool HfApi::IsHubOrigin(std::string_view url) const {
  const std::string o = hf::UrlOrigin(url);
  return !o.empty() && o == origin_;
}

std::string HfApi::Scrub(std::string text) const {
  std::vector<std::string> tokens;
  {
    MutexLock lock(token_mu_);
    tokens = past_tokens_;
  }
  for (const std::string& token : tokens) {
    for (size_t at = text.find(token); at != std::string::npos; at = text.find(token, at)) {
      text.replace(at, token.size(), "<token>");
    }
  }
  return text;
}

Expected<HttpResponse> HfApi::Send(HfRequest request) const {
  std::string url = request.url;
  const std::string token = Token();
  bool may_send_token = !token.empty();
  std::set<std::string> seen;
  for (int hop = 0;; ++hop) {
    HttpRequest r;
    r.method = request.method;
    r.url = url;
    r.headers = request.headers;
    // Sizes and ranges must be of the file itself, not of a compressed transfer.
    r.headers.emplace_back("Accept-Encoding", "identity");
    const bool hub = IsHubOrigin(url);
    if (!hub) may_send_token = false;  // once we left the Hub, never again in this chain
    if (hub && may_send_token) r.headers.emplace_back("Authorization", "Bearer " + token);
    r.idempotent = request.method == "GET" || request.method == "HEAD";
    r.max_response_bytes = request.max_response_bytes;
    r.follow_redirects = false;
    if (hub) {
      WaitIfRateLimited(url);
      r.rate_limit_max_wait = kHubRateLimitWindow;
      r.rate_limit_time_scale = config_.time_scale;
      auto* blocked = IsResolveUrl(url) ? &resolvers_blocked_until_ms_ : &api_blocked_until_ms_;
      r.on_rate_limited = [this, blocked](std::chrono::milliseconds wait) {
        stats_.rate_limit_waits.fetch_add(1, std::memory_order_relaxed);
        const int64_t until = SteadyNowMs() + static_cast<int64_t>(static_cast<double>(wait.count()) / config_.time_scale);
        int64_t seen_until = blocked->load(std::memory_order_relaxed);
        while (seen_until < until && !blocked->compare_exchange_weak(seen_until, until)) {
        }
      };
      if (IsResolveUrl(url)) stats_.resolves.fetch_add(1, std::memory_order_relaxed);
    }
    (hub ? stats_.hub_requests : stats_.other_requests).fetch_add(1, std::memory_order_relaxed);
    auto sent = http_->Send(std::move(r));
    if (!sent.ok()) return Status(sent.status().kind(), Scrub(sent.status().message()));
    HttpResponse resp = std::move(sent).value();
    stats_.bytes_received.fetch_add(resp.body.size(), std::memory_order_relaxed);
    const bool redirect = resp.status == 301 || resp.status == 302 || resp.status == 303 || resp.status == 307 ||
                          resp.status == 308;
    if (!redirect || !request.follow_redirects) return resp;
    const std::string next = hf::ResolveUrl(url, resp.Header("location"));
    const std::string what = request.method + " " + RedactQuery(request.url);
    if (next.empty()) {
      return Status::IOError(what + ": HTTP " + std::to_string(resp.status) +
                             " redirect without a usable http(s) Location");
    }
    if (hop + 1 > kMaxRedirects) return Status::IOError(what + ": more than 5 redirects");
    if (!seen.insert(next).second) return Status::IOError(what + ": redirect loop");
    if (resp.status == 303 && request.method != "HEAD") request.method = "GET";
    spdlog::debug("hf: {} redirected ({}) to {}{}", RedactQuery(url), resp.status, RedactQuery(next),
                  IsHubOrigin(next) ? "" : " (another host: no token)");
    url = next;
  }
}

Expected<std::string> HfApi::ResolveTarget(const HfRequest& request, std::optional<HttpResponse>* final) const {
  const std::string what = request.method + " " + RedactQuery(request.url);
  std::string url = request.url;
  for (int hop = 0; hop <= kMaxRedirects; ++hop) {
    HfRequest r = request;
    r.url = url;
    r.follow_redirects = false;
    WFS_ASSIGN_OR_RETURN(HttpResponse resp, Send(std::move(r)));
    const bool redirect = resp.status == 301 || resp.status == 302 || resp.status == 303 || resp.status == 307 ||
                          resp.status == 308;
    if (!redirect) {
      *final = std::move(resp);
      return std::string();
    }
    const std::string next = hf::ResolveUrl(url, resp.Header("location"));
    if (next.empty()) {
      return Status::IOError(what + ": HTTP " + std::to_string(resp.status) + " redirect without a usable http(s) Location");
    }
    if (!IsHubOrigin(next)) return next;  // the signed CDN URL
    url = next;  // the Hub's own redirect (a renamed repo, a relative resolve-cache URL)
  }
  return Status::IOError(what + ": more than 5 redirects");
}

void HfApi::ForgetTarget(const std::string& url, const std::string& target) const {
  MutexLock lock(resolve_mu_);
  auto it = resolved_.find(url);
  if (it != resolved_.end() && !it->second.pending && it->second.target == target) resolved_.erase(it);
}

Expected<HttpResponse> HfApi::SendResolved(const HfRequest& request) const {
  const std::string& key = request.url;
  for (int round = 0;; ++round) {
    std::string target;
    bool lead = false;
    {
      MutexLock lock(resolve_mu_);
      for (;;) {
        auto it = resolved_.find(key);
        if (it == resolved_.end()) {
          if (resolved_.size() >= kMaxResolvedTargets) {
            const auto now = SteadyClock::now();
            std::erase_if(resolved_, [&](const auto& e) { return !e.second.pending && e.second.reuse_until <= now; });
            if (resolved_.size() >= kMaxResolvedTargets) {
              std::erase_if(resolved_, [](const auto& e) { return !e.second.pending; });
            }
          }
          resolved_.emplace(key, Resolved{});
          lead = true;
          break;
        }
        Resolved& r = it->second;
        // Waits for the one resolve in flight: its Send is bounded, and it always finishes it.
        if (r.pending) {
          resolve_cv_.Wait(resolve_mu_);
          continue;
        }
        if (r.direct) break;
        if (SteadyClock::now() < r.reuse_until) {
          target = r.target;
          break;
        }
        r = Resolved{};  // expired: this caller resolves again
        lead = true;
        break;
      }
    }
    if (lead) {
      std::optional<HttpResponse> final;
      Expected<std::string> resolved = ResolveTarget(request, &final);
      {
        MutexLock lock(resolve_mu_);
        auto it = resolved_.find(key);
        if (!resolved.ok() || (final && final->status / 100 != 2)) {
          resolved_.erase(it);  // errors are not remembered: the next read asks again
        } else if (final) {
          it->second.pending = false;
          it->second.direct = true;
        } else {
          it->second.pending = false;
          it->second.target = *resolved;
          it->second.reuse_until = ReuseUntil(*resolved);
        }
      }
      resolve_cv_.NotifyAll();
      if (!resolved.ok()) return resolved.status();
      if (final) return std::move(*final);
      target = std::move(resolved).value();
    } else if (target.empty()) {
      return Send(request);  // the Hub serves this file itself
    } else {
      stats_.reused_targets.fetch_add(1, std::memory_order_relaxed);
    }
    HfRequest at_target = request;
    at_target.url = target;
    WFS_ASSIGN_OR_RETURN(HttpResponse resp, Send(std::move(at_target)));
    if (!TargetGone(resp.status) || round > 0) return resp;
    spdlog::info("hf: {}: the signed URL answered HTTP {} (expired or revoked); resolving it again",
                 RedactQuery(key), resp.status);
    ForgetTarget(key, target);
  }
}

Status HfApi::ErrorFrom(const HttpResponse& r, std::string_view what, const HfTarget& t) const {
  const std::string code(r.Header("x-error-code"));
  std::string server_message(r.Header("x-error-message"));
  if (server_message.empty()) server_message = JsonErrorMessage(r.body);
  const std::string kind_word = t.kind == HfTarget::Kind::kBucket ? "bucket" : "repo";
  const std::string thing = kind_word + " '" + t.id + "'";
  std::string m = std::string(what) + ": HTTP " + std::to_string(r.status);
  if (!code.empty()) m += " " + Printable(code, 64);
  if (!server_message.empty()) m += " (" + Printable(server_message) + ")";
  m += ": ";
  const bool have_token = !Token().empty();
  const std::string login = "set HF_TOKEN or run `hf auth login`";
  Status s;
  if (r.status == 401) {
    if (server_message.find("Invalid credentials") != std::string::npos) {
      s = Status::Auth(m + "the token from " + config_.token_source +
                       " is invalid or expired: create a new one at " + config_.endpoint +
                       "/settings/tokens and " + login);
    } else if (!have_token) {
      s = Status::Auth(m + thing + " does not exist, or it is private or gated and no token was sent: check the " +
                       kind_word + " name, or " + login);
    } else {
      s = Status::Auth(m + thing + " does not exist or your token (from " + config_.token_source +
                       ") cannot see it: check the " + kind_word + " name and that the token's account has access");
    }
  } else if (r.status == 403) {
    if (code == "GatedRepo") {
      s = Status::Auth(m + thing + " is gated: accept its conditions at " + config_.endpoint + "/" + t.id +
                       (have_token ? " with the account of your token (from " + config_.token_source + ")"
                                   : " and " + login));
    } else if (!have_token) {
      s = Status::Auth(m + thing + " needs a token: " + login);
    } else {
      s = Status::Auth(m + "your token (from " + config_.token_source + ") does not have permission for " + thing +
                       ": reading needs a token with read access to it, writing a write token (or a "
                       "fine-grained token with write access to the " + kind_word + ")");
    }
  } else if (r.status == 404) {
    if (code == "RevisionNotFound") {
      s = Status::NotFound(m + "revision '" + t.revision + "' does not exist in " + thing +
                           ": check the branch, tag or commit");
    } else if (code == "EntryNotFound") {
      s = Status::NotFound(m + "'" + t.path + "' does not exist in " + thing +
                           (t.revision.empty() ? std::string() : " at revision '" + t.revision + "'"));
    } else if (code == "RepoNotFound" || code == "BucketNotFound") {
      s = Status::NotFound(m + thing + " does not exist" +
                           (have_token ? " or your token cannot see it: check the name"
                                       : " (or it is private: " + login + ")") +
                           (t.kind == HfTarget::Kind::kBucket ? "; a new bucket is created with `hf buckets create " +
                                                                    t.id + "`"
                                                              : std::string()));
    } else {
      s = Status::NotFound(m + (t.path.empty() ? thing : "'" + t.path + "' in " + thing) + " not found");
    }
  } else {
    const std::string_view body(reinterpret_cast<const char*>(r.body.data()), std::min<size_t>(r.body.size(), 4096));
    s = HttpStatusError(r.status, what, server_message.empty() ? body : std::string_view(server_message));
  }
  return Status(s.kind(), Scrub(s.message()));
}

Expected<nlohmann::json> HfApi::GetJson(const std::string& url, const HfTarget& target) const {
  HfRequest req;
  req.url = url;
  req.headers.emplace_back("Accept", "application/json");
  req.max_response_bytes = kMaxJsonResponse;
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(std::move(req)));
  const std::string what = "GET " + RedactQuery(url);
  if (r.status != 200) return ErrorFrom(r, what, target);
  auto j = nlohmann::json::parse(r.body.begin(), r.body.end(), nullptr, false);
  if (j.is_discarded()) return Status::Corruption(what + ": response is not JSON");
  return j;
}

Status HfApi::GetJsonPages(std::string url, const HfTarget& target,
                           const std::function<Status(const nlohmann::json&)>& on_page,
                           const std::function<Status(const HttpResponse&)>& on_not_found,
                           size_t max_pages) const {
  std::set<std::string> seen;
  for (size_t page = 0; !url.empty(); ++page) {
    const std::string what = "GET " + RedactQuery(url);
    if (page >= max_pages) return Status::ResourceExhausted(what + ": more than " + std::to_string(max_pages) + " pages");
    if (!seen.insert(url).second) return Status::Corruption(what + ": the Hub's pagination repeats a page");
    HfRequest req;
    req.url = url;
    req.headers.emplace_back("Accept", "application/json");
    req.max_response_bytes = kMaxJsonResponse;
    WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(std::move(req)));
    if (r.status == 404 && on_not_found) return on_not_found(r);
    if (r.status != 200) return ErrorFrom(r, what, target);
    const auto j = nlohmann::json::parse(r.body.begin(), r.body.end(), nullptr, false);
    if (!j.is_array()) return Status::Corruption(what + ": expected a JSON array");
    WFS_TRY(on_page(j));
    const std::string next = hf::ParseLinkNext(r.Header("link"));
    if (next.empty()) break;
    url = hf::ResolveUrl(url, next);
    // A next page elsewhere would be a server sending us (and our token) to another host.
    if (!IsHubOrigin(url)) {
      return Status::Corruption(what + ": the next page's link points away from " + config_.endpoint);
    }
  }
  return Status::Ok();
}

Expected<uint64_t> HfApi::HeadSize(const std::string& url, const HfTarget& target) const {
  const std::string what = "HEAD " + RedactQuery(url);
  std::string current = url;
  for (int hop = 0; hop <= kMaxRedirects; ++hop) {
    HfRequest req;
    req.method = "HEAD";
    req.url = current;
    req.follow_redirects = false;
    // Only the first hop is the Hub; Send drops the token for any other origin.
    WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(std::move(req)));
    const bool redirect = r.status >= 300 && r.status < 400;
    if (auto linked = ParseU64(r.Header("x-linked-size")); linked && (redirect || r.status == 200)) return *linked;
    if (r.status == 200) {
      auto size = ParseU64(r.Header("content-length"));
      if (!size) return Status::Corruption(what + ": response has no valid Content-Length");
      return *size;
    }
    if (!redirect) return ErrorFrom(r, what, target);
    const std::string next = hf::ResolveUrl(current, r.Header("location"));
    if (next.empty()) return Status::IOError(what + ": redirect without a usable Location");
    if (!IsHubOrigin(next)) {
      // Leaving the Hub: from here on HfApi::Send follows by itself, without the token.
      HfRequest follow;
      follow.method = "HEAD";
      follow.url = next;
      WFS_ASSIGN_OR_RETURN(HttpResponse f, Send(std::move(follow)));
      if (f.status != 200) return ErrorFrom(f, what, target);
      auto size = ParseU64(f.Header("content-length"));
      if (!size) return Status::Corruption(what + ": redirect target sent no valid Content-Length");
      return *size;
    }
    current = next;
  }
  return Status::IOError(what + ": more than 5 redirects");
}

Expected<std::vector<uint8_t>> HfApi::ReadRange(const std::string& url, const HfTarget& target, uint64_t offset,
                                                std::optional<uint64_t> length_opt, bool reuse_resolved) const {
  const std::string what = "GET " + RedactQuery(url);
  const RangedGet get(offset, length_opt, RedactQuery(url));
  if (get.Empty()) {  // HTTP cannot ask for zero bytes
    WFS_ASSIGN_OR_RETURN(uint64_t size, HeadSize(url, target));
    return get.AtSize(size, /*refused=*/false, what);
  }
  HfRequest req;
  req.url = url;
  if (get.Ranged()) {
    req.headers.emplace_back("Range", get.RangeHeader());
    // A server that ignores the range must not make us buffer a huge file.
    req.max_response_bytes = get.MaxResponseBytes();
  }
  WFS_ASSIGN_OR_RETURN(HttpResponse r, reuse_resolved ? SendResolved(req) : Send(std::move(req)));
  if (r.status == 200 || r.status == 206) return get.Take(r, what);
  if (r.status == 416) {
    WFS_ASSIGN_OR_RETURN(uint64_t size, HeadSize(url, target));
    return get.AtSize(size, /*refused=*/true, what);
  }
  return ErrorFrom(r, what, target);
}

Status ValidateHubName(std::string_view name, std::string_view what) {
  auto bad = [&](std::string_view rule) {
    return Status::InvalidArgument(std::string(what) + " '" + std::string(name.substr(0, 100)) + "' " +
                                   std::string(rule));
  };
  if (name.empty() || name.size() > 96) return bad("must be 1 to 96 characters");
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                    c == '-' || c == '_';
    if (!ok) return bad("has a character outside [A-Za-z0-9._-]");
  }
  if (name.front() == '.' || name.front() == '-' || name.back() == '.' || name.back() == '-') {
    return bad("must not start or end with '.' or '-'");
  }
  if (name.find("--") != std::string_view::npos || name.find("..") != std::string_view::npos) {
    return bad("must not contain '--' or '..'");
  }
  return Status::Ok();
}

}  // namespace weightfs
