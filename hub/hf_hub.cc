#include "hub/hf_hub.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace weightfs {
namespace {

constexpr int kMaxRedirects = 5;
constexpr uint64_t kMaxJsonResponse = 64ull << 20;

std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view TrimWs(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

bool IsTrue(const std::optional<std::string>& v) {
  if (!v) return false;
  const std::string l = Lower(TrimWs(*v));
  return l == "1" || l == "on" || l == "yes" || l == "true";
}

// A printable one-line excerpt of a server-supplied string.
std::string Printable(std::string_view s, size_t max = 300) {
  std::string out;
  for (char c : s.substr(0, max)) {
    const auto u = static_cast<unsigned char>(c);
    out.push_back(u < 0x20 || u > 0x7e ? '?' : c);
  }
  if (s.size() > max) out += "...";
  return out;
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
    std::string params = Lower(header.substr(close + 1, end - close - 1));
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
  const std::string scheme = Lower(url.substr(0, sep));
  if (scheme != "http" && scheme != "https") return "";
  std::string_view rest = url.substr(sep + 3);
  std::string_view authority = rest.substr(0, rest.find_first_of("/?#"));
  if (authority.find('@') != std::string_view::npos) return "";  // userinfo: never trusted
  if (authority.empty()) return "";
  std::string host, port;
  if (authority.front() == '[') {  // IPv6 literal
    const size_t rb = authority.find(']');
    if (rb == std::string_view::npos) return "";
    host = Lower(authority.substr(0, rb + 1));
    if (rb + 1 < authority.size()) {
      if (authority[rb + 1] != ':') return "";
      port = std::string(authority.substr(rb + 2));
    }
  } else {
    const size_t colon = authority.rfind(':');
    host = Lower(authority.substr(0, colon));
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
    const std::string scheme = Lower(location.substr(0, sep));
    if (scheme != "http" && scheme != "https") return "";
    return std::string(location);
  }
  const size_t bsep = base.find("://");
  if (bsep == std::string_view::npos) return "";
  const std::string scheme(base.substr(0, bsep));
  // The result takes the base's scheme, so the base must be http(s) too.
  if (Lower(scheme) != "http" && Lower(scheme) != "https") return "";
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

  if (auto h = get("HF_HOME")) {
    c.home = *h;
  } else if (auto x = get("XDG_CACHE_HOME")) {
    c.home = *x + "/huggingface";
  } else if (auto home = get("HOME")) {
    c.home = *home + "/.cache/huggingface";
  } else {
    c.home = "/tmp/.cache/huggingface";
  }
  if (auto hc = get("HF_HUB_CACHE")) c.hub_cache = *hc;
  else if (auto legacy = get("HUGGINGFACE_HUB_CACHE")) c.hub_cache = *legacy;
  else c.hub_cache = c.home + "/hub";
  c.offline = IsTrue(env("HF_HUB_OFFLINE")) || IsTrue(env("TRANSFORMERS_OFFLINE"));

  for (const char* name : {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}) {
    if (auto t = get(name)) {
      c.token = std::string(TrimWs(*t));
      if (!c.token.empty()) {
        c.token_source = name;
        break;
      }
    }
  }
  if (c.token.empty() && !IsTrue(env("HF_HUB_DISABLE_IMPLICIT_TOKEN"))) {
    const std::string path = get("HF_TOKEN_PATH").value_or(c.home + "/token");
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

HfApi::HfApi(HfConfig config, std::shared_ptr<HttpClient> http)
    : config_(std::move(config)), http_(std::move(http)) {
  if (!http_) http_ = std::make_shared<HttpClient>();
  origin_ = hf::UrlOrigin(config_.endpoint);
}

bool HfApi::IsHubOrigin(std::string_view url) const {
  const std::string o = hf::UrlOrigin(url);
  return !o.empty() && o == origin_;
}

std::string HfApi::Scrub(std::string text) const {
  if (config_.token.empty()) return text;
  for (size_t at = text.find(config_.token); at != std::string::npos; at = text.find(config_.token, at)) {
    text.replace(at, config_.token.size(), "<token>");
  }
  return text;
}

Expected<HttpResponse> HfApi::Send(HfRequest request) const {
  std::string url = request.url;
  bool may_send_token = !config_.token.empty();
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
    if (hub && may_send_token) r.headers.emplace_back("Authorization", "Bearer " + config_.token);
    r.idempotent = request.method == "GET" || request.method == "HEAD";
    r.max_response_bytes = request.max_response_bytes;
    r.follow_redirects = false;
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
  const bool have_token = !config_.token.empty();
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
                                       : " (or it is private: " + login + ")"));
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
                                                std::optional<uint64_t> length_opt) const {
  const std::string what = "GET " + RedactQuery(url);
  const bool bounded = length_opt.has_value();
  const uint64_t length = bounded ? *length_opt : UINT64_MAX;
  auto past_end = [&](uint64_t size) {
    return Status::InvalidArgument("range offset " + std::to_string(offset) + " past the end of " +
                                   RedactQuery(url) + " (" + std::to_string(size) + " bytes)");
  };
  if (bounded && length == 0) {  // HTTP cannot ask for zero bytes
    WFS_ASSIGN_OR_RETURN(uint64_t size, HeadSize(url, target));
    if (offset > size) return past_end(size);
    return std::vector<uint8_t>();
  }
  HfRequest req;
  req.url = url;
  const bool ranged = offset > 0 || bounded;
  if (ranged) {
    std::string spec = "bytes=" + std::to_string(offset) + "-";
    if (bounded) {
      spec += std::to_string(length > UINT64_MAX - offset ? UINT64_MAX - 1 : offset + length - 1);
      // A server that ignores the range must not make us buffer a huge file.
      req.max_response_bytes = length <= (1ull << 40) ? length + (1u << 20) : 0;
    }
    req.headers.emplace_back("Range", spec);
  }
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(std::move(req)));
  if (r.status == 200) {
    if (!ranged) return std::move(r.body);
    if (offset > r.body.size()) return past_end(r.body.size());
    const uint64_t n = std::min<uint64_t>(r.body.size() - offset, length);
    return std::vector<uint8_t>(r.body.begin() + static_cast<ptrdiff_t>(offset),
                                r.body.begin() + static_cast<ptrdiff_t>(offset + n));
  }
  if (r.status == 206) {
    const auto cr = ParseContentRange(r.Header("content-range"));
    if (!cr || cr->first != offset || r.body.size() != cr->last - cr->first + 1) {
      return Status::Corruption(what + ": 206 response does not match the requested range (Content-Range '" +
                                Printable(r.Header("content-range"), 80) + "', " + std::to_string(r.body.size()) +
                                " bytes)");
    }
    if (r.body.size() > length) r.body.resize(length);
    return std::move(r.body);
  }
  if (r.status == 416) {
    WFS_ASSIGN_OR_RETURN(uint64_t size, HeadSize(url, target));
    if (offset == size) return std::vector<uint8_t>();
    if (offset > size) return past_end(size);
    return Status::IOError(what + ": server refused range " + std::to_string(offset) + "- of a file of " +
                           std::to_string(size) + " bytes (HTTP 416)");
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
