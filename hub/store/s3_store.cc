#include "hub/store/s3_store.h"

#include <openssl/evp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <charconv>
#include <cstdio>
#include <ctime>
#include <chrono>
#include <thread>
#include <utility>

#include "core/ascii.h"
#include "core/hash.h"
#include "core/mutex.h"
#include "hub/store/s3_signer.h"
#include "hub/store/xml_text.h"

namespace weightfs {
namespace s3 {
namespace {

constexpr int kMaxXmlDepth = 64;
constexpr size_t kMaxXmlElements = 1'000'000;

class XmlParser {
 public:
  explicit XmlParser(std::string_view in) : in_(in) {}

  Expected<XmlElement> Document() {
    WFS_TRY(SkipMisc());
    if (pos_ >= in_.size() || in_[pos_] != '<') return Bad("no root element");
    XmlElement root;
    WFS_TRY(Element(root, 0));
    return root;
  }

 private:
  Status Bad(std::string_view what) const {
    return Status::Corruption("malformed XML at byte " + std::to_string(pos_) + ": " + std::string(what));
  }
  bool StartsWith(std::string_view s) const { return in_.substr(pos_, s.size()) == s; }
  void SkipSpace() {
    while (pos_ < in_.size() &&
           (in_[pos_] == ' ' || in_[pos_] == '\t' || in_[pos_] == '\r' || in_[pos_] == '\n')) {
      ++pos_;
    }
  }
  Status SkipPast(std::string_view end) {
    const size_t at = in_.find(end, pos_);
    if (at == std::string_view::npos) return Bad("unterminated construct");
    pos_ = at + end.size();
    return Status::Ok();
  }
  // Whitespace, processing instructions and comments before the root element.
  Status SkipMisc() {
    if (StartsWith("\xEF\xBB\xBF")) pos_ += 3;  // UTF-8 byte order mark
    for (;;) {
      SkipSpace();
      if (StartsWith("<?")) {
        WFS_TRY(SkipPast("?>"));
      } else if (StartsWith("<!--")) {
        WFS_TRY(SkipPast("-->"));
      } else if (StartsWith("<!")) {
        return Bad("DOCTYPE and declarations are not accepted");
      } else {
        return Status::Ok();
      }
    }
  }
  static bool IsNameEnd(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '/' || c == '>' || c == '=';
  }
  std::string_view Name() {
    const size_t start = pos_;
    while (pos_ < in_.size() && !IsNameEnd(in_[pos_]) && in_[pos_] != '<') ++pos_;
    return in_.substr(start, pos_ - start);
  }
  static std::string LocalName(std::string_view qname) {
    const size_t colon = qname.rfind(':');
    return std::string(colon == std::string_view::npos ? qname : qname.substr(colon + 1));
  }

  // REQUIRES: in_[pos_] == '<' starting an element.
  Status Element(XmlElement& out, int depth) {
    if (depth > kMaxXmlDepth) return Bad("nested too deeply");
    if (++elements_ > kMaxXmlElements) return Bad("too many elements");
    ++pos_;
    const std::string_view qname = Name();
    if (qname.empty()) return Bad("element without a name");
    out.name = LocalName(qname);
    // Attributes are skipped (S3 only uses xmlns).
    for (;;) {
      SkipSpace();
      if (pos_ >= in_.size()) return Bad("unterminated start tag");
      if (StartsWith("/>")) {
        pos_ += 2;
        return Status::Ok();
      }
      if (in_[pos_] == '>') {
        ++pos_;
        break;
      }
      if (Name().empty()) return Bad("bad attribute");
      SkipSpace();
      if (pos_ >= in_.size() || in_[pos_] != '=') return Bad("attribute without a value");
      ++pos_;
      SkipSpace();
      if (pos_ >= in_.size() || (in_[pos_] != '"' && in_[pos_] != '\'')) return Bad("unquoted attribute");
      const char quote = in_[pos_++];
      const size_t close = in_.find(quote, pos_);
      if (close == std::string_view::npos) return Bad("unterminated attribute");
      pos_ = close + 1;
    }
    // Content.
    for (;;) {
      if (pos_ >= in_.size()) return Bad("element <" + out.name + "> is not closed");
      if (StartsWith("</")) {
        pos_ += 2;
        const std::string_view end_name = Name();
        if (end_name != qname) return Bad("</" + std::string(end_name) + "> closes <" + std::string(qname) + ">");
        SkipSpace();
        if (pos_ >= in_.size() || in_[pos_] != '>') return Bad("bad end tag");
        ++pos_;
        return Status::Ok();
      }
      if (StartsWith("<!--")) {
        WFS_TRY(SkipPast("-->"));
      } else if (StartsWith("<![CDATA[")) {
        pos_ += 9;
        const size_t end = in_.find("]]>", pos_);
        if (end == std::string_view::npos) return Bad("unterminated CDATA");
        out.text.append(in_.substr(pos_, end - pos_));
        pos_ = end + 3;
      } else if (StartsWith("<?")) {
        WFS_TRY(SkipPast("?>"));
      } else if (StartsWith("<!")) {
        return Bad("declaration inside an element");
      } else if (in_[pos_] == '<') {
        out.children.emplace_back();
        WFS_TRY(Element(out.children.back(), depth + 1));
      } else {
        size_t end = in_.find('<', pos_);
        if (end == std::string_view::npos) end = in_.size();
        AppendXmlText(out.text, in_.substr(pos_, end - pos_));
        pos_ = end;
      }
    }
  }

  std::string_view in_;
  size_t pos_ = 0;
  size_t elements_ = 0;
};

std::string TrimSpace(std::string s) {
  size_t b = 0, e = s.size();
  while (b < e && (s[b] == ' ' || s[b] == '\t' || s[b] == '\r' || s[b] == '\n')) ++b;
  while (e > b && (s[e - 1] == ' ' || s[e - 1] == '\t' || s[e - 1] == '\r' || s[e - 1] == '\n')) --e;
  return s.substr(b, e - b);
}

}  // namespace

const XmlElement* XmlElement::Child(std::string_view child_name) const {
  for (const auto& c : children) {
    if (c.name == child_name) return &c;
  }
  return nullptr;
}

std::string XmlElement::ChildText(std::string_view child_name) const {
  const XmlElement* c = Child(child_name);
  return c ? c->text : std::string();
}

Expected<XmlElement> ParseXml(std::string_view xml) { return XmlParser(xml).Document(); }

std::optional<ErrorInfo> ParseError(std::string_view body) {
  if (body.find("<Error") == std::string_view::npos) return std::nullopt;
  auto doc = ParseXml(body);
  if (!doc.ok() || doc->name != "Error") return std::nullopt;
  ErrorInfo e;
  e.code = TrimSpace(doc->ChildText("Code"));
  e.message = TrimSpace(doc->ChildText("Message"));
  e.region = TrimSpace(doc->ChildText("Region"));
  if (e.code.empty()) return std::nullopt;
  return e;
}

Expected<ListResult> ParseListObjectsV2(std::string_view body) {
  WFS_ASSIGN_OR_RETURN(XmlElement doc, ParseXml(body));
  if (doc.name != "ListBucketResult") {
    return Status::Corruption("expected <ListBucketResult>, got <" + doc.name.substr(0, 64) + ">");
  }
  ListResult out;
  for (const auto& c : doc.children) {
    if (c.name != "Contents") continue;
    const XmlElement* key = c.Child("Key");
    const std::string size_text = TrimSpace(c.ChildText("Size"));
    if (!key || key->text.empty()) return Status::Corruption("listing entry without a <Key>");
    uint64_t size = 0;
    auto [p, ec] = std::from_chars(size_text.data(), size_text.data() + size_text.size(), size);
    if (size_text.empty() || ec != std::errc() || p != size_text.data() + size_text.size()) {
      return Status::Corruption("listing entry has a bad <Size> '" + size_text.substr(0, 32) + "'");
    }
    // LastModified: ISO 8601 UTC ("2026-12-05T22:17:35.000Z"); 0 when missing or unreadable.
    int64_t modified_ms = 0;
    std::tm tm{};
    const std::string modified = TrimSpace(c.ChildText("LastModified"));
    if (sscanf(modified.c_str(), "%d-%d-%dT%d:%d:%d", &tm.tm_year, &tm.tm_mon, &tm.tm_mday, &tm.tm_hour, &tm.tm_min,
               &tm.tm_sec) == 6) {
      tm.tm_year -= 1900;
      tm.tm_mon -= 1;
      modified_ms = static_cast<int64_t>(timegm(&tm)) * 1000;
    }
    out.contents.push_back(ObjectInfo{key->text, size, modified_ms});
  }
  const std::string truncated = TrimSpace(doc.ChildText("IsTruncated"));
  if (truncated == "true") out.truncated = true;
  else if (!truncated.empty() && truncated != "false") {
    return Status::Corruption("listing has a bad <IsTruncated> '" + truncated.substr(0, 16) + "'");
  }
  out.next_continuation_token = doc.ChildText("NextContinuationToken");
  return out;
}

}  // namespace s3

namespace {

constexpr uint64_t kMinPartSize = 5ull << 20;  // S3's minimum for every part but the last
constexpr uint64_t kMaxParts = 10'000;
constexpr uint64_t kMaxXmlResponse = 64ull << 20;
constexpr int kConditionalConflictTries = 4;
// Sends of one body whose bytes arrived changed (BadDigest, or an ETag that is not its MD5).
constexpr int kUploadTries = 3;
constexpr int kMaxForeignPages = 100;  // pages of skipped keys List reads before returning

using Query = std::vector<std::pair<std::string, std::string>>;

std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}
std::string_view AsText(const std::vector<uint8_t>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size()};
}

std::string Md5Raw(std::span<const uint8_t> data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_Digest(data.data(), data.size(), md, &len, EVP_md5(), nullptr);
  return std::string(reinterpret_cast<const char*>(md), len);
}

std::string ToHex(std::string_view raw) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned char c : raw) {
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 15]);
  }
  return out;
}

std::optional<std::string> FromHex(std::string_view hex) {
  if (hex.size() % 2 != 0) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int v = 0;
    for (size_t j = i; j < i + 2; ++j) {
      const char c = hex[j];
      int d;
      if (c >= '0' && c <= '9') d = c - '0';
      else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
      else return std::nullopt;
      v = v * 16 + d;
    }
    out.push_back(static_cast<char>(v));
  }
  return out;
}

std::string Base64(std::string_view raw) {
  std::string out(4 * ((raw.size() + 2) / 3) + 1, '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(raw.data()),
                                static_cast<int>(raw.size()));
  out.resize(static_cast<size_t>(std::max(n, 0)));
  return out;
}

// An ETag without its quotes, lower-cased ("\"9B2CF...\"" -> "9b2cf...").
std::string NormalizeEtag(std::string_view etag) {
  std::string e = AsciiLower(etag);
  if (e.rfind("w/", 0) == 0) e = e.substr(2);
  e.erase(std::remove(e.begin(), e.end(), '"'), e.end());
  return e;
}

std::string XmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '&') out += "&amp;";
    else if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else out.push_back(c);
  }
  return out;
}

bool IsDnsSafeBucket(std::string_view b) {
  if (b.size() < 3 || b.size() > 63) return false;
  for (char c : b) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return b.front() != '-' && b.back() != '-';
}

struct Endpoint {
  std::string scheme;     // "http" / "https"
  std::string authority;  // "host[:port]"
  std::string base_path;  // "" or "/some/base" (no trailing slash)
  std::string ToString() const { return scheme + "://" + authority + base_path; }
};

Expected<Endpoint> ParseEndpoint(std::string_view url) {
  Endpoint e;
  const size_t sep = url.find("://");
  const size_t authority_start = sep == std::string_view::npos ? 0 : sep + 3;
  const size_t authority_end = url.find('/', authority_start);
  if (url.substr(authority_start, authority_end == std::string_view::npos ? std::string_view::npos
                                                                           : authority_end - authority_start)
          .find('@') != std::string_view::npos) {
    // Never echo it: it would contain a password.
    return Status::InvalidArgument("S3 endpoint must not contain user credentials; use "
                                   "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile");
  }
  if (sep == std::string_view::npos) {
    return Status::InvalidArgument("S3 endpoint '" + std::string(url.substr(0, 200)) +
                                   "' must start with http:// or https://");
  }
  e.scheme = AsciiLower(url.substr(0, sep));
  if (e.scheme != "http" && e.scheme != "https") {
    return Status::InvalidArgument("S3 endpoint scheme must be http or https, not '" + e.scheme + "'");
  }
  std::string_view rest = url.substr(sep + 3);
  if (rest.find_first_of("?#") != std::string_view::npos) {
    return Status::InvalidArgument("S3 endpoint must not have a query or fragment");
  }
  const size_t slash = rest.find('/');
  const std::string_view authority = rest.substr(0, slash);
  if (authority.empty()) return Status::InvalidArgument("S3 endpoint has no host");
  e.authority = AsciiLower(authority);
  std::string base = slash == std::string_view::npos ? "" : std::string(rest.substr(slash));
  while (!base.empty() && base.back() == '/') base.pop_back();
  e.base_path = base;
  return e;
}

bool IsAwsHost(std::string_view authority) {
  std::string_view host = authority.substr(0, authority.rfind(':') == std::string_view::npos
                                                  ? authority.size()
                                                  : authority.rfind(':'));
  auto ends_with = [&](std::string_view s) {
    return host.size() >= s.size() && host.substr(host.size() - s.size()) == s;
  };
  return ends_with(".amazonaws.com") || ends_with(".amazonaws.com.cn");
}

struct S3Config {
  std::string bucket;
  std::string prefix;  // without leading/trailing '/', may be empty
  Endpoint endpoint;
  bool virtual_hosted = false;
  std::string region;
  std::shared_ptr<AwsCredentialSource> credentials;  // null: unsigned (--no-sign-request)
  uint64_t multipart_threshold = 0;
  uint64_t part_size = 0;
  size_t parallelism = 1;
  std::string credentials_hint;
  std::string missing_bucket_hint;
  bool follow_get_redirects = false;
  bool conditional_multipart = true;
  uint64_t max_single_put = 0;
};

class S3Store final : public Store {
 public:
  S3Store(S3Config config, std::shared_ptr<HttpClient> http)
      : cfg_(std::move(config)), http_(std::move(http)) {}

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range) override;
  Status Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) override;
  Expected<ObjectInfo> Head(std::string_view key) override;
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation,
                          size_t max_keys) override;
  Status Delete(std::string_view key) override;
  std::string Describe() const override {
    return "s3://" + cfg_.bucket + (cfg_.prefix.empty() ? "" : "/" + cfg_.prefix) + " (endpoint " +
           cfg_.endpoint.ToString() + ")";
  }

 private:
  struct Call {
    std::string method = "GET";
    std::string object;  // full S3 key; empty: the bucket itself
    Query query;
    HttpHeaders headers;
    std::span<const uint8_t> body;
    uint64_t max_response_bytes = 0;
  };

  std::string FullKey(std::string_view key) const {
    return cfg_.prefix.empty() ? std::string(key) : cfg_.prefix + "/" + std::string(key);
  }
  // "s3://bucket/prefix/key": how errors name an object.
  std::string Where(std::string_view full_key) const {
    return "s3://" + cfg_.bucket + "/" + std::string(full_key);
  }
  std::string UrlFor(const Call& c) const;
  // Sends `c`, signed afresh for every attempt (HttpClient retries idempotent requests). A GET
  // redirected elsewhere is followed unsigned when follow_get_redirects is set.
  Expected<HttpResponse> Send(const Call& c) const;
  Expected<HttpResponse> FollowUnsigned(const Call& c, const HttpResponse& redirect) const;
  // The Status for a non-success response to `what` ("GET s3://b/k").
  Status ErrorFrom(const HttpResponse& r, const std::string& what) const;
  std::string CredentialsHint() const;

  Status PutSingle(const std::string& key, std::span<const uint8_t> data, PutMode mode);
  Status PutMultipart(const std::string& key, std::span<const uint8_t> data, PutMode mode);
  void AbortUpload(const std::string& key, const std::string& upload_id) const;
  // After a 412 to a create-if-absent (or NoSuchUpload to a completion): is the object at
  // `key` the one we wrote, by a resend whose first answer was lost? OK if so, Conflict if
  // not, another error if we cannot tell.
  // Whether a 2xx answer's ETag is an MD5 other than `md5_hex` (the server stored other bytes).
  static bool EtagShowsOtherBytes(const HttpResponse& r, const std::string& md5_hex);
  Status CheckOwnWrite(const std::string& key, std::span<const uint8_t> data,
                       const std::string& expected_etag);
  Expected<ObjectInfo> HeadFull(const std::string& full_key, std::string* etag = nullptr) const;

  const S3Config cfg_;
  std::shared_ptr<HttpClient> http_;
};

std::string S3Store::UrlFor(const Call& c) const {
  std::string url = cfg_.endpoint.scheme + "://";
  if (cfg_.virtual_hosted) {
    url += cfg_.bucket + "." + cfg_.endpoint.authority + cfg_.endpoint.base_path + "/";
  } else {
    url += cfg_.endpoint.authority + cfg_.endpoint.base_path + "/" + AwsUriEncode(cfg_.bucket, false);
    if (!c.object.empty()) url += "/";
  }
  url += AwsUriEncode(c.object, true);
  for (size_t i = 0; i < c.query.size(); ++i) {
    url += i == 0 ? "?" : "&";
    url += AwsUriEncode(c.query[i].first, false);
    if (!c.query[i].second.empty() || c.query[i].first != "uploads") {
      url += "=" + AwsUriEncode(c.query[i].second, false);
    }
  }
  return url;
}

Expected<HttpResponse> S3Store::Send(const Call& c) const {
  HttpRequest req;
  req.method = c.method;
  req.url = UrlFor(c);
  req.headers = c.headers;
  req.body = c.body;
  req.idempotent = true;  // every S3 call we make may be repeated; see the header for PUT
  req.max_response_bytes = c.max_response_bytes;
  req.sensitive_headers = {"x-amz-security-token"};
  std::string payload_sha;
  if (cfg_.credentials) payload_sha = Sha256Hex(c.body);
  // Signed with the credentials current now (a refreshing source fetches new ones before the
  // old expire); a server that says they expired all the same (a clock off, a revoked session)
  // gets one more try with fresh ones.
  auto sign_with_current = [&](HttpRequest& r) -> Status {
    if (!cfg_.credentials) return Status::Ok();
    Expected<AwsCredentials> now = cfg_.credentials->Get();
    if (!now.ok()) return Status::Auth(now.status().message());
    r.sign = [signer = std::make_shared<SigV4Signer>(std::move(now).value(), cfg_.region, "s3"), payload_sha](HttpRequest& x) {
      signer->Sign(x, payload_sha, std::chrono::system_clock::now());
    };
    return Status::Ok();
  };
  WFS_TRY(sign_with_current(req));
  const HttpRequest retry_template = req;
  WFS_ASSIGN_OR_RETURN(HttpResponse r, http_->Send(std::move(req)));
  if (cfg_.credentials && cfg_.credentials->refreshable() && (r.status == 400 || r.status == 403)) {
    std::optional<s3::ErrorInfo> err = s3::ParseError(AsText(r.body));
    if (err && (err->code == "ExpiredToken" || err->code == "TokenRefreshRequired")) {
      spdlog::info("s3 {} {}: the server says the credentials from {} expired; fetching new ones", c.method,
                   Where(c.object), cfg_.credentials->name());
      cfg_.credentials->Invalidate();
      HttpRequest again = retry_template;
      WFS_TRY(sign_with_current(again));
      WFS_ASSIGN_OR_RETURN(r, http_->Send(std::move(again)));
    }
  }
  const bool redirect = r.status == 301 || r.status == 302 || r.status == 303 || r.status == 307 || r.status == 308;
  if (redirect && cfg_.follow_get_redirects && c.method == "GET" && !r.Header("location").empty()) {
    return FollowUnsigned(c, r);
  }
  return r;
}

Expected<HttpResponse> S3Store::FollowUnsigned(const Call& c, const HttpResponse& redirect) const {
  const std::string location(redirect.Header("location"));
  const std::string what = "GET " + Where(c.object);
  if (!location.starts_with("https://") && !location.starts_with("http://")) {
    return Status::IOError(what + ": HTTP " + std::to_string(redirect.status) +
                           " redirect to a Location that is not an absolute http(s) URL");
  }
  HttpRequest req;
  req.url = location;
  req.idempotent = true;
  req.max_response_bytes = c.max_response_bytes;
  // Only what describes the bytes wanted: the signature and its x-amz-* headers (and any
  // session token) stay with the gateway.
  for (const auto& [name, value] : c.headers) {
    if (name == "Range") req.headers.emplace_back(name, value);
  }
  req.follow_redirects = true;  // curl: http(s) only, at most 5, never re-adds credentials
  spdlog::debug("s3 {}: redirected ({}) to {}, followed without credentials", what, redirect.status,
                location.substr(0, location.find('?')));
  return http_->Send(std::move(req));
}

std::string S3Store::CredentialsHint() const {
  if (!cfg_.credentials_hint.empty()) return cfg_.credentials_hint;
  if (!cfg_.credentials) {
    return "the request was unsigned (--no-sign-request, or no credentials for this endpoint): give the "
           "bucket's credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in ~/.aws, an "
           "instance or pod role)";
  }
  return "check the AWS credentials from " + cfg_.credentials->name() +
         " (key id, secret, session token) and that they may access bucket '" + cfg_.bucket + "'";
}

Status S3Store::ErrorFrom(const HttpResponse& r, const std::string& what) const {
  const std::string_view body = AsText(r.body);
  std::optional<s3::ErrorInfo> err = s3::ParseError(body);
  if (!err && !r.Header("x-amz-error-code").empty()) {
    err = s3::ErrorInfo{std::string(r.Header("x-amz-error-code")),
                        std::string(r.Header("x-amz-error-message")), ""};
  }
  const std::string code = err ? err->code : "";
  std::string detail = "HTTP " + std::to_string(r.status);
  if (err) {
    detail += " " + err->code;
    if (!err->message.empty()) detail += ": " + err->message.substr(0, 300);
  }
  const std::string m = what + ": " + detail;

  if (code == "NoSuchBucket") {
    return Status::NotFound("bucket '" + cfg_.bucket + "' does not exist at " + cfg_.endpoint.ToString() +
                            (cfg_.missing_bucket_hint.empty() ? "" : ": " + cfg_.missing_bucket_hint) + " (" + m + ")");
  }
  if (code == "NoSuchKey" || code == "NoSuchUpload" || (code.empty() && r.status == 404)) {
    return Status::NotFound(m);
  }
  if (code == "ExpiredToken" || code == "TokenRefreshRequired") {
    return Status::Auth(m + "; the session token has expired: refresh the credentials (" +
                        (cfg_.credentials ? cfg_.credentials->name() : std::string("none")) + ")");
  }
  if (code == "RequestTimeTooSkewed") {
    return Status::Auth(m + "; this machine's clock differs from the server's by more than 15 "
                            "minutes: fix the clock (NTP)");
  }
  if (code == "SignatureDoesNotMatch") {
    return Status::Auth(m + "; the secret access key does not match the key id, or the region (" +
                        cfg_.region + ") is wrong: " + CredentialsHint());
  }
  if (code == "AccessDenied" || code == "InvalidAccessKeyId" || code == "InvalidToken" ||
      code == "AllAccessDisabled" || code == "AccountProblem" || code == "InvalidSecurity" ||
      (code.empty() && (r.status == 401 || r.status == 403))) {
    return Status::Auth(m + "; " + CredentialsHint());
  }
  if (code == "InvalidObjectState") {
    return Status::Unsupported(m + "; the object is in an archive storage class (Glacier): restore it first");
  }
  const std::string bucket_region(r.Header("x-amz-bucket-region"));
  const std::string region = !bucket_region.empty() ? bucket_region : (err ? err->region : "");
  if (code == "AuthorizationHeaderMalformed" || code == "PermanentRedirect" ||
      code == "IllegalLocationConstraintException" || r.status == 301 || r.status == 307) {
    return Status::InvalidArgument(
        m + "; bucket '" + cfg_.bucket + "' is not in region " + cfg_.region +
        (region.empty() ? std::string(": set AWS_REGION to the bucket's region")
                        : ": it is in " + region + ", set AWS_REGION=" + region));
  }
  if (code == "PreconditionFailed" || code == "ConditionalRequestConflict") return Status::Conflict(m);
  if (code == "InvalidRange") return Status::InvalidArgument(m);
  if (code == "RequestTimeout") return Status::Timeout(m);
  if (err) return HttpStatusError(r.status, what, err->code + ": " + err->message.substr(0, 300));
  return HttpStatusError(r.status, what, body);
}

Expected<ObjectInfo> S3Store::HeadFull(const std::string& full_key, std::string* etag) const {
  Call c;
  c.method = "HEAD";
  c.object = full_key;
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
  const std::string what = "HEAD " + Where(full_key);
  if (r.status != 200) {
    if (r.status == 404) return Status::NotFound(what + ": no such object");
    return ErrorFrom(r, what);
  }
  const auto size = ParseU64(r.Header("content-length"));
  if (!size) return Status::Corruption(what + ": response has no valid Content-Length");
  if (etag) *etag = std::string(r.Header("etag"));
  return ObjectInfo{full_key, *size};
}

Expected<ObjectInfo> S3Store::Head(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  WFS_ASSIGN_OR_RETURN(ObjectInfo info, HeadFull(FullKey(key)));
  info.key = std::string(key);
  return info;
}

Expected<std::vector<uint8_t>> S3Store::Get(std::string_view key, std::optional<ByteRange> range) {
  WFS_TRY(ValidateKey(key));
  const std::string full = FullKey(key);
  const std::string what = "GET " + Where(full);
  const RangedGet get(range ? range->offset : 0, range ? range->length : std::nullopt, Where(full));
  // HTTP cannot ask for zero bytes: check the offset with a HEAD instead.
  if (get.Empty()) {
    WFS_ASSIGN_OR_RETURN(ObjectInfo info, HeadFull(full));
    return get.AtSize(info.size, /*refused=*/false, what);
  }
  Call c;
  c.object = full;
  if (get.Ranged()) {
    c.headers.emplace_back("Range", get.RangeHeader());
    // A server that ignores the range end must not make us buffer a huge object.
    c.max_response_bytes = get.MaxResponseBytes();
  }
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
  if (r.status == 200 || r.status == 206) return get.Take(r, what);
  if (r.status == 416) {
    // S3 refuses a range that starts at the end too, which the contract answers with nothing.
    WFS_ASSIGN_OR_RETURN(ObjectInfo info, HeadFull(full));
    return get.AtSize(info.size, /*refused=*/true, what);
  }
  return ErrorFrom(r, what);
}

Status S3Store::Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) {
  WFS_TRY(ValidateKey(key));
  const std::string full = FullKey(key);
  if (mode == PutMode::kCreateIfAbsent) {
    // Cheap early answer, and the only protection on servers that ignore If-None-Match.
    auto head = HeadFull(full);
    if (head.ok()) return Status::Conflict(Where(full) + " already exists");
    if (head.status().kind() != ErrorKind::kNotFound) return head.status();
  }
  if (mode == PutMode::kCreateIfAbsent && !cfg_.conditional_multipart) {
    // The server checks If-None-Match on PutObject only: one PUT, or nothing at all.
    if (data.size() > cfg_.max_single_put) {
      return Status::Unsupported("create-if-absent of " + Where(full) + " (" + std::to_string(data.size()) +
                                 " bytes): this server checks If-None-Match on single PUTs only, and one PUT "
                                 "takes at most " + std::to_string(cfg_.max_single_put) +
                                 " bytes; refusing to write it without that check (nothing was written)");
    }
    return PutSingle(full, data, mode);
  }
  if (data.size() > cfg_.multipart_threshold) return PutMultipart(full, data, mode);
  return PutSingle(full, data, mode);
}

Status S3Store::PutSingle(const std::string& key, std::span<const uint8_t> data, PutMode mode) {
  const std::string what = "PUT " + Where(key);
  Call c;
  c.method = "PUT";
  c.object = key;
  c.body = data;
  c.max_response_bytes = kMaxXmlResponse;
  c.headers.emplace_back("Content-Type", "application/octet-stream");
  // Every PUT carries the body's MD5: S3, MinIO, Ceph and R2 refuse a body that does not match
  // it (400 BadDigest). A server that does not check it (s3rver) still answers with the MD5 of
  // what it stored as the ETag: compared below. Either way a bit flipped on the way up is found;
  // the PUT is sent again (a flip in transit is transient), at most kUploadTries times.
  const std::string md5 = Md5Raw(data);
  const std::string md5_hex = ToHex(md5);
  c.headers.emplace_back("Content-MD5", Base64(md5));
  if (mode == PutMode::kCreateIfAbsent) c.headers.emplace_back("If-None-Match", "*");
  int upload_try = 1;
  for (int conflict_try = 1;; ++conflict_try) {
    WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
    if (r.status == 200 || r.status == 201 || r.status == 204) {
      if (EtagShowsOtherBytes(r, md5_hex)) {
        spdlog::warn("PUT {}: the server stored other bytes than were sent (ETag {}, MD5 sent {}){}", Where(key),
                     r.Header("etag"), md5_hex, upload_try < kUploadTries ? "; sending it again" : "");
        // Ours (it answered 2xx to our write): gone before anyone may read it as intact.
        Call del;
        del.method = "DELETE";
        del.object = key;  // (the full key already)
        del.max_response_bytes = kMaxXmlResponse;
        if (Expected<HttpResponse> d = Send(del); !d.ok() || (d->status != 204 && d->status != 200)) {
          return Status::Corruption(what + ": the server stored other bytes than were sent (ETag " +
                                    std::string(r.Header("etag")) + ", MD5 sent " + md5_hex +
                                    ") and deleting them failed: remove " + Where(key) + " before anything reads it");
        }
        if (++upload_try > kUploadTries) {
          return Status::Corruption(what + ": the server stored other bytes than were sent, " +
                                    std::to_string(kUploadTries) + " times (ETag " + std::string(r.Header("etag")) +
                                    ", MD5 sent " + md5_hex + "); nothing is kept under that key");
        }
        continue;
      }
      return Status::Ok();
    }
    if (r.status == 400 && (AsText(r.body).find("BadDigest") != std::string_view::npos ||
                            AsText(r.body).find("InvalidDigest") != std::string_view::npos)) {
      spdlog::warn("PUT {}: the server refused the body: its MD5 is not the one sent{}", Where(key),
                   upload_try < kUploadTries ? "; sending it again" : "");
      if (++upload_try > kUploadTries) {
        return Status::Corruption(what + ": the body arrived with another MD5 than was sent, " +
                                  std::to_string(kUploadTries) + " times (BadDigest)");
      }
      continue;
    }
    // The key appeared after our HEAD: another writer, or our own write resent after its answer
    // was lost (by HttpClient, or by libcurl itself on a reused connection that died).
    if (mode == PutMode::kCreateIfAbsent && r.status == 412) return CheckOwnWrite(key, data, md5_hex);
    const Status s = ErrorFrom(r, what);
    // A concurrent conditional write to the same key was in flight: S3 asks us to try again.
    if (mode == PutMode::kCreateIfAbsent && r.status == 409 &&
        conflict_try < kConditionalConflictTries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50 * conflict_try));
      continue;
    }
    return s;
  }
}

bool S3Store::EtagShowsOtherBytes(const HttpResponse& r, const std::string& md5_hex) {
  // With SSE-KMS or SSE-C the ETag is not the MD5 (and the server checked Content-MD5 itself).
  const std::string_view sse = r.Header("x-amz-server-side-encryption");
  if (sse.find("kms") != std::string_view::npos || !r.Header("x-amz-server-side-encryption-customer-algorithm").empty()) {
    return false;
  }
  const std::string etag = NormalizeEtag(r.Header("etag"));
  return etag.size() == 32 && std::all_of(etag.begin(), etag.end(), [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)); }) &&
         etag != md5_hex;
}

Status S3Store::CheckOwnWrite(const std::string& key, std::span<const uint8_t> data,
                              const std::string& expected_etag) {
  std::string etag;
  auto info = HeadFull(key, &etag);
  const std::string conflict = Where(key) + " already exists (created by another writer)";
  if (info.status().kind() == ErrorKind::kNotFound) return Status::Conflict(conflict + " and was removed since");
  if (!info.ok()) {
    return Status::IOError("create-if-absent of " + Where(key) +
                           ": the write may or may not have happened (a retry got 412, then: " +
                           info.status().message() + ")");
  }
  if (info->size != data.size()) return Status::Conflict(conflict);
  if (!expected_etag.empty() && NormalizeEtag(etag) == expected_etag) {
    spdlog::info("create-if-absent of {}: the object there is the one we wrote (a resent request)", Where(key));
    return Status::Ok();
  }
  // The ETag proves nothing either way (e.g. SSE-KMS): compare the bytes, one part at a time.
  const uint64_t step = cfg_.part_size;
  for (uint64_t off = 0; off < data.size(); off += step) {
    const uint64_t n = std::min<uint64_t>(step, data.size() - off);
    Call c;
    c.object = key;
    c.headers.emplace_back("Range", "bytes=" + std::to_string(off) + "-" + std::to_string(off + n - 1));
    c.max_response_bytes = n + (1u << 20);
    WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
    // Gone, or cut shorter, since the HEAD: it was another writer's (a fill marker of the shared
    // tier comes and goes within milliseconds). A failure here would read as the store failing.
    if (r.status == 404) return Status::Conflict(conflict + " and was removed since");
    if (r.status == 416) return Status::Conflict(conflict + " and changed since");
    if (r.status != 206 && r.status != 200) return ErrorFrom(r, "GET " + Where(key));
    std::span<const uint8_t> got(r.body);
    if (r.status == 200) got = got.subspan(std::min<size_t>(off, got.size()));
    if (got.size() < n || !std::equal(data.begin() + static_cast<ptrdiff_t>(off),
                                      data.begin() + static_cast<ptrdiff_t>(off + n), got.begin())) {
      return Status::Conflict(conflict);
    }
  }
  spdlog::info("create-if-absent of {}: the object there has our bytes (a resent request)", Where(key));
  return Status::Ok();
}

void S3Store::AbortUpload(const std::string& key, const std::string& upload_id) const {
  Call c;
  c.method = "DELETE";
  c.object = key;
  c.query = {{"uploadId", upload_id}};
  c.max_response_bytes = kMaxXmlResponse;
  auto r = Send(c);
  if (!r.ok()) {
    spdlog::warn("abort of multipart upload to {} failed: {}", Where(key), r.status().message());
  } else if (r->status != 204 && r->status != 200 && r->status != 404) {
    spdlog::warn("abort of multipart upload to {} failed: {} (its parts stay until a lifecycle rule "
                 "removes incomplete uploads)",
                 Where(key), ErrorFrom(*r, "DELETE " + Where(key)).message());
  }
}

Status S3Store::PutMultipart(const std::string& key, std::span<const uint8_t> data, PutMode mode) {
  const uint64_t size = data.size();
  const uint64_t part_size = std::max(cfg_.part_size, (size + kMaxParts - 1) / kMaxParts);
  const size_t parts = static_cast<size_t>((size + part_size - 1) / part_size);

  // 1. CreateMultipartUpload.
  Call create;
  create.method = "POST";
  create.object = key;
  create.query = {{"uploads", ""}};
  create.headers.emplace_back("Content-Type", "application/octet-stream");
  create.max_response_bytes = kMaxXmlResponse;
  WFS_ASSIGN_OR_RETURN(HttpResponse cr, Send(create));
  const std::string what_create = "POST " + Where(key) + "?uploads";
  if (cr.status != 200) return ErrorFrom(cr, what_create);
  WFS_ASSIGN_OR_RETURN(s3::XmlElement created, s3::ParseXml(AsText(cr.body)));
  const std::string upload_id = created.ChildText("UploadId");
  if (created.name != "InitiateMultipartUploadResult" || upload_id.empty()) {
    return Status::Corruption(what_create + ": response has no UploadId");
  }

  // 2. UploadPart, `parallelism` at a time.
  std::vector<std::string> etags(parts);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  Mutex mu;
  Status first_error;  // guarded by mu (a local: the analysis cannot check it); read once the threads joined
  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= parts || failed.load()) return;
      const uint64_t off = i * part_size;
      Status s;
      try {  // on a thread of its own: nothing may escape (an allocation failing fails the upload)
        Call c;
        c.method = "PUT";
        c.object = key;
        c.query = {{"partNumber", std::to_string(i + 1)}, {"uploadId", upload_id}};
        c.body = data.subspan(off, std::min<uint64_t>(part_size, size - off));
        c.max_response_bytes = kMaxXmlResponse;
        const std::string part_md5 = Md5Raw(c.body);
        c.headers.emplace_back("Content-MD5", Base64(part_md5));  // checked as in PutSingle
        const std::string what_part = "PUT " + Where(key) + " part " + std::to_string(i + 1);
        for (int upload_try = 1;; ++upload_try) {
          auto r = Send(c);
          const bool bad_digest = r.ok() && r->status == 400 && AsText(r->body).find("BadDigest") != std::string_view::npos;
          if (r.ok() && ((r->status == 200 && EtagShowsOtherBytes(*r, ToHex(part_md5))) || bad_digest)) {
            if (upload_try < kUploadTries) {
              spdlog::warn("{}: the server got other bytes than were sent; sending it again", what_part);
              continue;
            }
            s = Status::Corruption(what_part + ": the server got other bytes than were sent, " +
                                   std::to_string(kUploadTries) + " times");
          } else if (!r.ok()) {
            s = r.status();
          } else if (r->status != 200) {
            s = ErrorFrom(*r, what_part);
          } else if (r->Header("etag").empty()) {
            s = Status::Corruption(what_part + ": response has no ETag");
          } else {
            etags[i] = std::string(r->Header("etag"));
          }
          break;
        }
      } catch (...) {
        s = StatusOfCurrentException("uploading a part");
      }
      if (!s.ok()) {
        MutexLock lock(mu);
        if (first_error.ok()) first_error = std::move(s);
        failed.store(true);
        return;
      }
    }
  };
  std::vector<std::thread> threads;
  const size_t extra = std::min(cfg_.parallelism, parts) - 1;
  for (size_t t = 0; t < extra; ++t) {
    try {
      threads.emplace_back(worker);
    } catch (const std::exception&) {
      break;  // fewer threads: the remaining ones pick up the parts
    }
  }
  worker();
  for (auto& t : threads) t.join();
  if (failed.load()) {
    AbortUpload(key, upload_id);
    return first_error;
  }

  // 3. CompleteMultipartUpload (conditional for create-if-absent).
  std::string xml = "<CompleteMultipartUpload xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">";
  std::string etag_md5s;  // for the multipart ETag: MD5 of the parts' binary MD5s
  bool etags_are_md5 = true;
  for (size_t i = 0; i < parts; ++i) {
    xml += "<Part><PartNumber>" + std::to_string(i + 1) + "</PartNumber><ETag>" +
           XmlEscape(etags[i]) + "</ETag></Part>";
    const std::string norm = NormalizeEtag(etags[i]);
    auto raw = norm.size() == 32 ? FromHex(norm) : std::nullopt;
    if (raw) etag_md5s += *raw;
    else etags_are_md5 = false;
  }
  xml += "</CompleteMultipartUpload>";
  const std::string expected_etag =
      etags_are_md5 ? ToHex(Md5Raw(AsBytes(etag_md5s))) + "-" + std::to_string(parts) : "";

  Call complete;
  complete.method = "POST";
  complete.object = key;
  complete.query = {{"uploadId", upload_id}};
  complete.body = AsBytes(xml);
  complete.headers.emplace_back("Content-Type", "application/xml");
  if (mode == PutMode::kCreateIfAbsent) complete.headers.emplace_back("If-None-Match", "*");
  complete.max_response_bytes = kMaxXmlResponse;
  const std::string what = "POST " + Where(key) + "?uploadId (complete multipart upload)";
  for (int conflict_try = 1;; ++conflict_try) {
    auto r = Send(complete);
    if (!r.ok()) {
      AbortUpload(key, upload_id);
      return r.status();
    }
    // S3 may answer 200 and still report an error in the body (it keeps the connection alive
    // while assembling the parts).
    const std::optional<s3::ErrorInfo> error = s3::ParseError(AsText(r->body));
    if (r->status == 200 && !error) return Status::Ok();
    const bool precondition_failed = mode == PutMode::kCreateIfAbsent && r->status == 412;
    const bool upload_gone = r->status == 404 && error && error->code == "NoSuchUpload";
    if (precondition_failed || upload_gone) {
      // Either someone else's object, or our completion went through and this is a resend of
      // it whose first answer was lost.
      Status own = CheckOwnWrite(key, data, expected_etag);
      if (own.ok()) return own;
      if (upload_gone && mode == PutMode::kOverwrite) {
        own = Status::IOError(what + ": the upload disappeared and " + Where(key) +
                              " does not hold our bytes (aborted by someone else?)");
      }
      AbortUpload(key, upload_id);
      return own;
    }
    if (mode == PutMode::kCreateIfAbsent && r->status == 409 &&
        conflict_try < kConditionalConflictTries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50 * conflict_try));
      continue;
    }
    Status s;
    if (r->status == 200) {
      HttpResponse as_error = std::move(*r);
      as_error.status = error->code == "InternalError" || error->code == "SlowDown" ? 503 : 400;
      s = ErrorFrom(as_error, what);
    } else {
      s = ErrorFrom(*r, what);
    }
    AbortUpload(key, upload_id);
    return s;
  }
}

Expected<ListPage> S3Store::List(std::string_view prefix, std::string_view continuation,
                                 size_t max_keys) {
  const std::string root = cfg_.prefix.empty() ? "" : cfg_.prefix + "/";
  const std::string what = "LIST " + Where(root + std::string(prefix));
  // Our continuation is the last key of the previous page (relative to the store prefix) and
  // goes to S3 as start-after; see the header.
  std::string start_after = continuation.empty() ? "" : root + std::string(continuation);
  ListPage page;
  for (int round = 0; round < kMaxForeignPages; ++round) {
    Call c;
    c.query = {{"list-type", "2"},
               {"max-keys", std::to_string(std::clamp<size_t>(max_keys, 1, 1000))},
               {"prefix", root + std::string(prefix)}};
    if (!start_after.empty()) c.query.emplace_back("start-after", start_after);
    c.max_response_bytes = kMaxXmlResponse;
    WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
    if (r.status != 200) return ErrorFrom(r, what);
    auto parsed = s3::ParseListObjectsV2(AsText(r.body));
    if (!parsed.ok()) return parsed.status().WithContext(what);
    std::string last_seen;
    for (auto& obj : parsed->contents) {
      if (obj.key <= start_after && !start_after.empty()) {
        return Status::Corruption(what + ": server listed '" + obj.key.substr(0, 200) +
                                  "', not after start-after '" + start_after.substr(0, 200) + "'");
      }
      last_seen = obj.key;
      if (obj.key.compare(0, root.size(), root) != 0) {
        spdlog::warn("{}: server listed '{}' outside the prefix; skipped", what, obj.key.substr(0, 200));
        continue;
      }
      std::string rel = obj.key.substr(root.size());
      if (!ValidateKey(rel).ok()) {
        spdlog::debug("{}: skipping key '{}' that weightfs would not write", what, rel.substr(0, 200));
        continue;
      }
      page.objects.push_back(ObjectInfo{std::move(rel), obj.size, obj.modified_ms});
    }
    if (!parsed->truncated) {
      page.continuation.clear();
      break;
    }
    if (last_seen.empty() || last_seen.compare(0, root.size(), root) != 0) {
      return Status::Corruption(what + ": truncated listing that ends outside the prefix");
    }
    page.continuation = last_seen.substr(root.size());
    if (!page.objects.empty()) break;
    start_after = last_seen;  // a page of keys weightfs does not use: look further
  }
  std::sort(page.objects.begin(), page.objects.end(),
            [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  return page;
}

Status S3Store::Delete(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  const std::string full = FullKey(key);
  // S3 deletes silently whether or not the key exists; the contract wants NotFound.
  WFS_TRY(HeadFull(full).status());
  Call c;
  c.method = "DELETE";
  c.object = full;
  c.max_response_bytes = kMaxXmlResponse;
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send(c));
  if (r.status == 204 || r.status == 200) return Status::Ok();
  return ErrorFrom(r, "DELETE " + Where(full));
}

Expected<std::pair<std::string, std::string>> ParseS3Url(std::string_view url) {
  constexpr std::string_view kScheme = "s3://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return Status::InvalidArgument("'" + std::string(url.substr(0, 200)) +
                                   "' is not an S3 URL (expected s3://bucket/prefix)");
  }
  std::string_view rest = url.substr(kScheme.size());
  if (rest.find_first_of("?#") != std::string_view::npos) {
    return Status::InvalidArgument("S3 URL '" + std::string(url.substr(0, 200)) +
                                   "' must not have a query or fragment");
  }
  const size_t slash = rest.find('/');
  const std::string bucket(rest.substr(0, slash));
  std::string prefix = slash == std::string_view::npos ? "" : std::string(rest.substr(slash + 1));
  while (!prefix.empty() && prefix.back() == '/') prefix.pop_back();
  if (bucket.empty() || bucket.size() > 255) {
    return Status::InvalidArgument("S3 URL '" + std::string(url.substr(0, 200)) + "' has no valid bucket name");
  }
  for (char ch : bucket) {
    const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                    ch == '.' || ch == '-' || ch == '_';
    if (!ok) {
      return Status::InvalidArgument("bucket name '" + bucket.substr(0, 100) +
                                     "' has a character outside [A-Za-z0-9._-]");
    }
  }
  if (!prefix.empty()) {
    Status s = ValidateKey(prefix);
    if (!s.ok()) return Status::InvalidArgument("prefix of " + std::string(url.substr(0, 200)) + ": " + s.message());
  }
  return std::make_pair(bucket, prefix);
}

}  // namespace

Expected<std::unique_ptr<Store>> OpenS3Store(std::string_view url, const S3Options& options,
                                             std::shared_ptr<HttpClient> http) {
  WFS_ASSIGN_OR_RETURN(auto bucket_prefix, ParseS3Url(url));
  S3Config cfg;
  cfg.bucket = std::move(bucket_prefix.first);
  cfg.prefix = std::move(bucket_prefix.second);

  if (options.part_size < kMinPartSize) {
    return Status::InvalidArgument("S3 part_size " + std::to_string(options.part_size) +
                                   " is below the S3 minimum of 5 MiB");
  }
  cfg.part_size = options.part_size;
  cfg.multipart_threshold = options.multipart_threshold;
  cfg.parallelism = std::max<size_t>(options.multipart_parallelism, 1);
  cfg.credentials_hint = options.credentials_hint;
  cfg.missing_bucket_hint = options.missing_bucket_hint;
  cfg.follow_get_redirects = options.follow_get_redirects;
  cfg.conditional_multipart = options.conditional_multipart;
  cfg.max_single_put = options.max_single_put;

  const AwsEnvLookup env = options.env ? options.env : ProcessAwsEnv();
  cfg.region = options.region;
  if (options.credentials) cfg.credentials = AwsCredentialSource::Fixed(*options.credentials);
  if (options.credential_source) cfg.credentials = options.credential_source;
  const bool need_credentials = !cfg.credentials && options.credentials_from_aws_chain && !options.no_sign_request;
  std::optional<AwsConfigFiles> files;  // ~/.aws/{credentials,config}, read once for both
  if (cfg.region.empty() || need_credentials) {
    WFS_ASSIGN_OR_RETURN(files, LoadAwsConfigFiles(env));
  }
  if (cfg.region.empty()) {
    WFS_ASSIGN_OR_RETURN(AwsSettings settings, LoadAwsSettings(env, *files));
    cfg.region = settings.region;
  }
  if (need_credentials) {
    WFS_ASSIGN_OR_RETURN(AwsChainResult chain,
                         ResolveAwsCredentialChain({.env = env, .region = cfg.region, .files = &*files}));
    if (!chain.source) {
      // Never unsigned without being asked: a node whose role is missing would otherwise read a
      // public copy, or fail later with AccessDenied and no word of why.
      return Status::Auth("no AWS credentials found for " + std::string(url.substr(0, 200)) + ": looked at " +
                          chain.looked_at + ". Give the bucket's credentials (AWS_ACCESS_KEY_ID and "
                          "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance or pod role), or pass --no-sign-request "
                          "for a bucket that allows anonymous access");
    }
    cfg.credentials = std::move(chain.source);
  }

  std::string endpoint = options.endpoint;
  if (endpoint.empty()) {
    for (const char* name : {"AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"}) {
      auto v = env(name);
      if (v && !v->empty()) {
        endpoint = *v;
        break;
      }
    }
  }
  const bool custom_endpoint = !endpoint.empty();
  if (!custom_endpoint) endpoint = "https://s3." + cfg.region + ".amazonaws.com";
  WFS_ASSIGN_OR_RETURN(cfg.endpoint, ParseEndpoint(endpoint));

  switch (options.addressing) {
    case S3Options::Addressing::kPath: cfg.virtual_hosted = false; break;
    case S3Options::Addressing::kVirtualHosted:
      if (cfg.bucket.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789.-") != std::string::npos) {
        return Status::InvalidArgument("bucket name '" + cfg.bucket +
                                       "' cannot be used in a host name (virtual-hosted addressing)");
      }
      cfg.virtual_hosted = true;
      break;
    case S3Options::Addressing::kAuto:
      cfg.virtual_hosted = (!custom_endpoint || IsAwsHost(cfg.endpoint.authority)) &&
                           IsDnsSafeBucket(cfg.bucket);
      break;
  }
  if (!http) http = std::make_shared<HttpClient>();
  spdlog::debug("s3 store s3://{}/{}: endpoint {}, region {}, {} addressing, {}", cfg.bucket,
                cfg.prefix, cfg.endpoint.ToString(), cfg.region,
                cfg.virtual_hosted ? "virtual-hosted" : "path-style",
                cfg.credentials ? "credentials from " + cfg.credentials->name()
                                : std::string("anonymous (unsigned) requests"));
  return std::unique_ptr<Store>(new S3Store(std::move(cfg), std::move(http)));
}

}  // namespace weightfs
