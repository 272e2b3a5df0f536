#include "hub/store/s3_signer.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <algorithm>
#include <ctime>
#include <utility>
#include <vector>

#include "core/ascii.h"
#include "core/hash.h"

namespace weightfs {
namespace {

constexpr const char* kAlgorithm = "AWS4-HMAC-SHA256";

// Trimmed, with every run of spaces/tabs inside collapsed to one space.
std::string CanonicalHeaderValue(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  bool pending_space = false;
  for (char c : v) {
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(c);
  }
  return out;
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string PercentDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size()) {
      const int hi = HexValue(s[i + 1]), lo = HexValue(s[i + 2]);
      if (hi >= 0 && lo >= 0) {
        out.push_back(static_cast<char>(hi * 16 + lo));
        i += 2;
        continue;
      }
    }
    out.push_back(s[i]);
  }
  return out;
}

std::string Hex(const unsigned char* p, size_t n) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kHex[p[i] >> 4]);
    out.push_back(kHex[p[i] & 15]);
  }
  return out;
}

// Raw 32-byte HMAC-SHA256.
std::string HmacSha256(std::string_view key, std::string_view data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), md, &len);
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::string Sha256OfString(std::string_view s) {
  return Sha256Hex(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size()));
}

std::string CanonicalQuery(std::string_view query) {
  std::vector<std::pair<std::string, std::string>> params;
  size_t pos = 0;
  while (pos <= query.size() && !query.empty()) {
    size_t amp = query.find('&', pos);
    if (amp == std::string_view::npos) amp = query.size();
    const std::string_view item = query.substr(pos, amp - pos);
    if (!item.empty()) {
      const size_t eq = item.find('=');
      const std::string_view name = item.substr(0, eq);
      const std::string_view value = eq == std::string_view::npos ? "" : item.substr(eq + 1);
      params.emplace_back(AwsUriEncode(PercentDecode(name), false),
                          AwsUriEncode(PercentDecode(value), false));
    }
    pos = amp + 1;
  }
  std::sort(params.begin(), params.end());
  std::string out;
  for (const auto& [name, value] : params) {
    if (!out.empty()) out.push_back('&');
    out += name;
    out.push_back('=');
    out += value;
  }
  return out;
}

// Headers curl may add, drop or rewrite on the way, or that proxies touch: never signed.
bool IsUnsignedHeader(std::string_view lower_name) {
  static constexpr std::string_view kUnsigned[] = {
      "authorization", "user-agent", "expect", "connection", "transfer-encoding",
      "content-length", "accept-encoding", "x-amzn-trace-id"};
  return std::find(std::begin(kUnsigned), std::end(kUnsigned), lower_name) != std::end(kUnsigned);
}

}  // namespace

std::string AwsUriEncode(std::string_view s, bool keep_slash) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    const bool unreserved = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                            (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_' || c == '~';
    if (unreserved || (keep_slash && c == '/')) {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

std::string AmzDate(std::chrono::system_clock::time_point t) {
  const std::time_t tt = std::chrono::system_clock::to_time_t(t);
  std::tm tm{};
  gmtime_r(&tt, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

UrlParts SplitUrl(std::string_view url) {
  UrlParts parts;
  size_t pos = 0;
  const size_t scheme_end = url.find("://");
  if (scheme_end != std::string_view::npos) {
    parts.scheme = AsciiLower(url.substr(0, scheme_end));
    pos = scheme_end + 3;
  }
  size_t authority_end = url.find_first_of("/?#", pos);
  if (authority_end == std::string_view::npos) authority_end = url.size();
  std::string_view authority = url.substr(pos, authority_end - pos);
  if (const size_t at = authority.rfind('@'); at != std::string_view::npos) {
    authority = authority.substr(at + 1);
  }
  // Drop a default port the way libcurl does when it writes the Host header.
  const size_t colon = authority.rfind(':');
  const size_t bracket = authority.rfind(']');
  if (colon != std::string_view::npos && (bracket == std::string_view::npos || colon > bracket)) {
    const std::string_view port = authority.substr(colon + 1);
    if (port.empty() || (parts.scheme == "http" && port == "80") ||
        (parts.scheme == "https" && port == "443")) {
      authority = authority.substr(0, colon);
    }
  }
  parts.host = AsciiLower(authority);
  std::string_view rest = url.substr(authority_end);
  if (const size_t hash = rest.find('#'); hash != std::string_view::npos) rest = rest.substr(0, hash);
  const size_t q = rest.find('?');
  parts.path = std::string(rest.substr(0, q));
  if (q != std::string_view::npos) parts.query = std::string(rest.substr(q + 1));
  return parts;
}

SigV4Signature ComputeSigV4(const SigV4Params& p, const AwsCredentials& credentials) {
  SigV4Signature out;
  // Canonical headers: host plus the given ones, lower-cased names, sorted, repeated names
  // joined with ','.
  std::vector<std::pair<std::string, std::string>> headers;
  headers.emplace_back("host", CanonicalHeaderValue(p.host));
  for (const auto& [name, value] : p.headers) {
    std::string lname = AsciiLower(name);
    if (lname == "host") continue;
    headers.emplace_back(std::move(lname), CanonicalHeaderValue(value));
  }
  std::stable_sort(headers.begin(), headers.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string canonical_headers;
  for (size_t i = 0; i < headers.size(); ++i) {
    if (i > 0 && headers[i].first == headers[i - 1].first) {
      canonical_headers.pop_back();  // the '\n' of the previous line
      canonical_headers += "," + headers[i].second + "\n";
      continue;
    }
    if (!out.signed_headers.empty()) out.signed_headers.push_back(';');
    out.signed_headers += headers[i].first;
    canonical_headers += headers[i].first + ":" + headers[i].second + "\n";
  }

  out.canonical_request = p.method + "\n" + (p.path.empty() ? "/" : p.path) + "\n" +
                          CanonicalQuery(p.query) + "\n" + canonical_headers + "\n" +
                          out.signed_headers + "\n" + p.payload_sha256;

  const std::string date = p.amz_date.substr(0, 8);
  const std::string scope = date + "/" + p.region + "/" + p.service + "/aws4_request";
  out.string_to_sign = std::string(kAlgorithm) + "\n" + p.amz_date + "\n" + scope + "\n" +
                       Sha256OfString(out.canonical_request);

  const std::string k_date = HmacSha256("AWS4" + credentials.secret_access_key, date);
  const std::string k_region = HmacSha256(k_date, p.region);
  const std::string k_service = HmacSha256(k_region, p.service);
  const std::string k_signing = HmacSha256(k_service, "aws4_request");
  const std::string sig = HmacSha256(k_signing, out.string_to_sign);
  out.signature = Hex(reinterpret_cast<const unsigned char*>(sig.data()), sig.size());
  out.authorization = std::string(kAlgorithm) + " Credential=" + credentials.access_key_id + "/" +
                      scope + ", SignedHeaders=" + out.signed_headers +
                      ", Signature=" + out.signature;
  return out;
}

SigV4Signer::SigV4Signer(AwsCredentials credentials, std::string region, std::string service)
    : credentials_(std::move(credentials)), region_(std::move(region)), service_(std::move(service)) {}

void SigV4Signer::Sign(HttpRequest& request, std::string_view payload_sha256,
                       std::chrono::system_clock::time_point now) const {
  auto& h = request.headers;
  h.erase(std::remove_if(h.begin(), h.end(),
                         [](const auto& kv) {
                           return AsciiEqualsIgnoreCase(kv.first, "x-amz-date") ||
                                  AsciiEqualsIgnoreCase(kv.first, "x-amz-content-sha256") ||
                                  AsciiEqualsIgnoreCase(kv.first, "x-amz-security-token") ||
                                  AsciiEqualsIgnoreCase(kv.first, "authorization");
                         }),
          h.end());
  const std::string amz_date = AmzDate(now);
  h.emplace_back("x-amz-date", amz_date);
  h.emplace_back("x-amz-content-sha256", std::string(payload_sha256));
  if (!credentials_.session_token.empty()) {
    h.emplace_back("x-amz-security-token", credentials_.session_token);
    const bool listed = std::any_of(
        request.sensitive_headers.begin(), request.sensitive_headers.end(),
        [](const std::string& n) { return AsciiEqualsIgnoreCase(n, "x-amz-security-token"); });
    if (!listed) request.sensitive_headers.emplace_back("x-amz-security-token");
  }

  UrlParts url = SplitUrl(request.url);
  SigV4Params p;
  p.method = request.method;
  p.host = std::move(url.host);
  p.path = std::move(url.path);
  p.query = std::move(url.query);
  for (const auto& [name, value] : h) {
    const std::string lname = AsciiLower(name);
    if (IsUnsignedHeader(lname)) continue;
    if (lname == "host") p.host = AsciiLower(CanonicalHeaderValue(value));
    else p.headers.emplace_back(name, value);
  }
  p.payload_sha256 = std::string(payload_sha256);
  p.amz_date = amz_date;
  p.region = region_;
  p.service = service_;
  h.emplace_back("Authorization", ComputeSigV4(p, credentials_).authorization);
}

}  // namespace weightfs
