#include "hub/store/webdav_store.h"

#include "hub/store/xml_text.h"

#include <curl/curl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace weightfs {
namespace {

constexpr std::string_view kTmpDir = ".weightfs-tmp";
// Sends of one body that read back changed (a bit flipped on the way up).
constexpr int kUploadTries = 3;
// A PROPFIND answer larger than this is refused (about a million entries of one collection).
constexpr uint64_t kMaxPropfindBytes = uint64_t{256} << 20;

// Listings ask for modification times too (ObjectInfo::modified_ms; the temporaries' ages).
constexpr std::string_view kPropfindWithTimesBody =
    "<?xml version=\"1.0\" encoding=\"utf-8\"?>\n"
    "<D:propfind xmlns:D=\"DAV:\"><D:prop><D:resourcetype/><D:getcontentlength/><D:getlastmodified/>"
    "</D:prop></D:propfind>\n";

std::string_view AsText(const std::vector<uint8_t>& body) {
  return {reinterpret_cast<const char*>(body.data()), body.size()};
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Percent-decoding; nullopt for a malformed escape or a NUL.
std::optional<std::string> PercentDecode(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c == '%') {
      if (i + 2 >= s.size()) return std::nullopt;
      const int hi = HexValue(s[i + 1]), lo = HexValue(s[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      c = static_cast<char>(hi * 16 + lo);
      i += 2;
    }
    if (c == '\0') return std::nullopt;
    out.push_back(c);
  }
  return out;
}

std::optional<uint64_t> ParseUint(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r' || s.front() == '\n')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) {
    s.remove_suffix(1);
  }
  if (s.empty() || s.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

std::string Base64(std::string_view in) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(in[i])} << 16) | (uint32_t{static_cast<uint8_t>(in[i + 1])} << 8) |
                       uint32_t{static_cast<uint8_t>(in[i + 2])};
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], kAlphabet[v & 63]};
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint32_t{static_cast<uint8_t>(in[i])} << 16;
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint32_t{static_cast<uint8_t>(in[i])} << 16) | (uint32_t{static_cast<uint8_t>(in[i + 1])} << 8);
    out += {kAlphabet[v >> 18], kAlphabet[(v >> 12) & 63], kAlphabet[(v >> 6) & 63], '='};
  }
  return out;
}

std::string RandomName() {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (int w = 0; w < 2; ++w) {
    uint64_t v = rng();
    for (int i = 0; i < 16; ++i, v >>= 4) out.push_back(kHex[v & 15]);
  }
  return out;
}

// ---- PROPFIND multistatus (RFC 4918 section 14.16), read minimally ----------------------------
//
// <multistatus xmlns="DAV:">
//   <response>
//     <href>/prefix/packs/ab%40c</href>                  percent-encoded path or absolute URL
//     <propstat>
//       <prop><resourcetype><collection/></resourcetype><getcontentlength>12</getcontentlength></prop>
//       <status>HTTP/1.1 200 OK</status>                  props of a non-2xx propstat are ignored
//     </propstat>
//   </response> ...
// Namespace prefixes vary between servers (D:, d:, lp1:, a default namespace), so elements are
// matched by local name. Entities and CDATA in text are decoded; DTDs are skipped, never
// expanded.

// The status code of "HTTP/1.1 200 OK", or 0.
long StatusLineCode(std::string_view line) {
  const size_t sp = line.find(' ');
  if (sp == std::string_view::npos) return 0;
  line.remove_prefix(sp + 1);
  const auto code = ParseUint(line.substr(0, std::min<size_t>(line.find(' '), line.size())));
  return code && *code < 1000 ? static_cast<long>(*code) : 0;
}

}  // namespace

Expected<std::vector<DavEntry>> ParseDavMultistatus(std::string_view xml) {
  constexpr size_t kMaxDepth = 64;
  std::vector<DavEntry> entries;
  std::vector<std::string> stack;  // local names of the open elements
  std::string text;
  DavEntry entry;
  long response_status = 0;
  bool ps_collection = false;
  std::optional<uint64_t> ps_length;
  std::optional<int64_t> ps_modified;
  long ps_status = 0;
  auto corrupt = [&](const std::string& why) {
    return Status::Corruption("PROPFIND answer is not a valid multistatus document: " + why);
  };
  auto parent = [&]() -> std::string_view { return stack.empty() ? std::string_view() : stack.back(); };
  auto start_element = [&](const std::string& name) {
    if (name == "response") {
      entry = DavEntry{};
      response_status = 0;
    } else if (name == "propstat") {
      ps_collection = false;
      ps_length.reset();
      ps_modified.reset();
      ps_status = 0;
    } else if (name == "collection" && parent() == "resourcetype") {
      ps_collection = true;
    }
  };
  // Called with the element already popped, so parent() is its parent.
  auto end_element = [&](const std::string& name) {
    if (name == "href" && parent() == "response") {
      entry.href = DecodeXmlText(text);
    } else if (name == "getcontentlength" && parent() == "prop") {
      ps_length = ParseUint(DecodeXmlText(text));
    } else if (name == "getlastmodified" && parent() == "prop") {
      // An HTTP date (RFC 1123: "Sun, 06 Nov 1994 08:49:37 GMT"); curl parses every form.
      const std::string date = DecodeXmlText(text).substr(0, 100);
      const time_t t = curl_getdate(date.c_str(), nullptr);
      if (t > 0) ps_modified = static_cast<int64_t>(t) * 1000;
    } else if (name == "status" && parent() == "propstat") {
      ps_status = StatusLineCode(text);
    } else if (name == "status" && parent() == "response") {
      response_status = StatusLineCode(text);
    } else if (name == "propstat") {
      if (ps_status == 0 || (ps_status >= 200 && ps_status < 300)) {
        entry.collection = entry.collection || ps_collection;
        if (ps_length) entry.length = ps_length;
        if (ps_modified) entry.modified_ms = ps_modified;
      }
    } else if (name == "response") {
      if (!entry.href.empty() && (response_status == 0 || (response_status >= 200 && response_status < 300))) {
        entries.push_back(std::move(entry));
      }
      entry = DavEntry{};
    }
  };

  size_t i = 0;
  const size_t n = xml.size();
  while (i < n) {
    if (xml[i] != '<') {
      const size_t next = xml.find('<', i);
      const size_t end = next == std::string_view::npos ? n : next;
      if (text.size() < 64 * 1024) text.append(xml.substr(i, end - i));
      i = end;
      continue;
    }
    const std::string_view rest = xml.substr(i);
    if (rest.rfind("<!--", 0) == 0) {
      const size_t end = xml.find("-->", i + 4);
      if (end == std::string_view::npos) return corrupt("unterminated comment");
      i = end + 3;
    } else if (rest.rfind("<![CDATA[", 0) == 0) {
      const size_t end = xml.find("]]>", i + 9);
      if (end == std::string_view::npos) return corrupt("unterminated CDATA");
      // Entities are not decoded inside CDATA; escape '&' so DecodeEntities leaves it alone.
      for (char c : xml.substr(i + 9, end - i - 9)) {
        if (c == '&') text += "&amp;";
        else text.push_back(c);
      }
      i = end + 3;
    } else if (rest.rfind("<?", 0) == 0) {
      const size_t end = xml.find("?>", i + 2);
      if (end == std::string_view::npos) return corrupt("unterminated processing instruction");
      i = end + 2;
    } else if (rest.rfind("<!", 0) == 0) {
      const size_t end = xml.find('>', i + 2);
      if (end == std::string_view::npos) return corrupt("unterminated declaration");
      i = end + 1;
    } else {
      // A start or end tag; '>' inside a quoted attribute value does not end it.
      size_t j = i + 1;
      char quote = 0;
      while (j < n && (quote != 0 || xml[j] != '>')) {
        if (quote != 0) {
          if (xml[j] == quote) quote = 0;
        } else if (xml[j] == '"' || xml[j] == '\'') {
          quote = xml[j];
        }
        ++j;
      }
      if (j >= n) return corrupt("unterminated tag");
      std::string_view tag = xml.substr(i + 1, j - i - 1);
      i = j + 1;
      const bool closing = !tag.empty() && tag.front() == '/';
      if (closing) tag.remove_prefix(1);
      const bool self_closing = !closing && !tag.empty() && tag.back() == '/';
      if (self_closing) tag.remove_suffix(1);
      const size_t name_end = std::min(tag.find_first_of(" \t\r\n/"), tag.size());
      std::string_view qname = tag.substr(0, name_end);
      if (qname.empty()) return corrupt("empty tag name");
      const size_t colon = qname.rfind(':');
      const std::string name(colon == std::string_view::npos ? qname : qname.substr(colon + 1));
      if (closing) {
        if (stack.empty() || stack.back() != name) return corrupt("mismatched end tag </" + std::string(qname) + ">");
        stack.pop_back();
        end_element(name);
        text.clear();
      } else {
        if (stack.size() >= kMaxDepth) return corrupt("nested deeper than 64 elements");
        start_element(name);
        text.clear();
        if (self_closing) {
          end_element(name);
        } else {
          stack.push_back(name);
        }
      }
    }
  }
  if (!stack.empty()) return corrupt("document ends inside <" + stack.back() + ">");
  return entries;
}

// ---- the store ---------------------------------------------------------------------------------
namespace {

class WebDavStore final : public Store {
 public:
  WebDavStore(std::string base, std::string prefix, std::string prefix_decoded, std::string authorization,
              std::shared_ptr<HttpClient> http)
      : base_(std::move(base)),
        prefix_(std::move(prefix)),
        root_path_(std::move(prefix_decoded) + "/"),
        authorization_(std::move(authorization)),
        http_(std::move(http)) {}

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range) override;
  Status Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) override;
  Expected<ObjectInfo> Head(std::string_view key) override;
  Expected<ListPage> List(std::string_view prefix, std::string_view continuation, size_t max_keys) override;
  Status Delete(std::string_view key) override;
  Expected<std::vector<TemporaryObject>> ListTemporaries() override;
  std::string Describe() const override { return base_ + prefix_; }

 private:
  // Absolute path (percent-encoded) of a key, and its URL.
  std::string PathOf(std::string_view key) const { return prefix_ + "/" + UrlEncode(key, /*keep_slash=*/true); }
  std::string UrlOf(std::string_view key) const { return base_ + PathOf(key); }
  // "GET http://host/prefix/key" for messages.
  std::string What(std::string_view op, std::string_view key) const {
    return std::string(op) + " " + Describe() + "/" + std::string(key);
  }

  Expected<HttpResponse> Send(std::string method, std::string url, HttpHeaders headers = {},
                              std::span<const uint8_t> body = {}, uint64_t max_response_bytes = 0) const {
    HttpRequest req;
    req.method = std::move(method);
    req.url = std::move(url);
    req.headers = std::move(headers);
    req.body = body;
    req.idempotent = true;  // every request here is safe to repeat; see Put for MOVE
    req.max_response_bytes = max_response_bytes;
    if (!authorization_.empty()) req.headers.emplace_back("Authorization", authorization_);
    return http_->Send(std::move(req));
  }
  Status ErrorFrom(const HttpResponse& r, std::string_view op, std::string_view key) const {
    return HttpStatusError(r.status, What(op, key), AsText(r.body));
  }
  // A 3xx to the key with a trailing slash: the key names a collection, not an object.
  static bool IsCollectionRedirect(const HttpResponse& r) {
    if (r.status < 300 || r.status > 399) return false;
    const std::string_view location = r.Header("location");
    return !location.empty() && location.back() == '/';
  }

  // The object's size from a HEAD.
  Expected<uint64_t> SizeOf(std::string_view key);
  // MKCOL every collection above `key` (the prefix's own first), ignoring the answers: the
  // caller retries the operation that needed them and reports its error if it still fails.
  // Not OK only when the server cannot be reached.
  Status MakeParentCollections(std::string_view key);
  // Whether the temporary object still exists: true, false, or nullopt when that cannot be told.
  std::optional<bool> TempExists(const std::string& tmp);
  void DeleteTemp(const std::string& tmp);
  Status Move(const std::string& tmp, std::string_view key, PutMode mode);
  // Whether temporary `tmp` holds exactly `data` (a GET).
  Expected<bool> SameBytes(const std::string& tmp, std::span<const uint8_t> data);
  // Appends to `out`, in key order, the objects under collection `dir` ("" = the root) that
  // match, stopping once `out` holds `limit` entries.
  Status Walk(const std::string& dir, std::string_view prefix, std::string_view continuation, size_t limit,
              std::vector<ObjectInfo>& out);
  // The relative name (no trailing '/') of an href under the root, or nullopt if it is not under it.
  std::optional<std::string> RelativeName(std::string_view href) const;

  const std::string base_;           // "http://host:port", no userinfo
  const std::string prefix_;         // "/bucket/path" as given (percent-encoded), or ""
  const std::string root_path_;      // decoded prefix with a trailing '/': "/bucket/path/"
  const std::string authorization_;  // "Basic ..." or "": sensitive
  const std::shared_ptr<HttpClient> http_;
  // Whether <prefix>/.weightfs-tmp/ is believed to exist. Only a hint: a stale value costs one
  // round of MKCOLs or one failed PUT.
  std::atomic<bool> tmp_dir_ready_{false};
};

Expected<uint64_t> WebDavStore::SizeOf(std::string_view key) {
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("HEAD", UrlOf(key)));
  if (r.status == 404 || IsCollectionRedirect(r)) return Status::NotFound(What("HEAD", key) + ": no such object");
  if (r.status < 200 || r.status > 299) return ErrorFrom(r, "HEAD", key);
  const auto size = ParseUint(r.Header("content-length"));
  if (!size) return Status::Corruption(What("HEAD", key) + ": answer without a valid Content-Length");
  return *size;
}

Expected<std::vector<uint8_t>> WebDavStore::Get(std::string_view key, std::optional<ByteRange> range) {
  WFS_TRY(ValidateKey(key));
  const std::string what = What("GET", key);
  const RangedGet get(range ? range->offset : 0, range ? range->length : std::nullopt,
                      Describe() + "/" + std::string(key));
  if (get.Empty()) {  // HTTP cannot ask for zero bytes
    WFS_ASSIGN_OR_RETURN(const uint64_t size, SizeOf(key));
    return get.AtSize(size, /*refused=*/false, what);
  }
  HttpHeaders headers;
  if (get.Ranged()) headers.emplace_back("Range", get.RangeHeader());
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("GET", UrlOf(key), std::move(headers)));
  if (r.status == 404 || IsCollectionRedirect(r)) return Status::NotFound(what + ": no such object");
  if (r.status == 200 || r.status == 206) return get.Take(r, what);
  if (r.status == 416) {
    // "Content-Range: bytes */<size>" says where the object ends; ask when it is missing.
    std::optional<uint64_t> size = RangedGet::SizeOf416(r);
    if (!size) {
      WFS_ASSIGN_OR_RETURN(size, SizeOf(key));
    }
    return get.AtSize(*size, /*refused=*/true, what);
  }
  return ErrorFrom(r, "GET", key);
}

Expected<ObjectInfo> WebDavStore::Head(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  WFS_ASSIGN_OR_RETURN(const uint64_t size, SizeOf(key));
  return ObjectInfo{std::string(key), size};
}

Status WebDavStore::MakeParentCollections(std::string_view key) {
  std::vector<std::string> paths;
  std::string path;
  std::string_view rest = prefix_;
  while (!rest.empty()) {  // the prefix's own collections
    rest.remove_prefix(1);  // '/'
    const size_t slash = std::min(rest.find('/'), rest.size());
    path += "/" + std::string(rest.substr(0, slash));
    rest.remove_prefix(slash);
    paths.push_back(path);
  }
  size_t start = 0;
  for (size_t slash = key.find('/'); slash != std::string_view::npos; slash = key.find('/', start)) {
    path += "/" + UrlEncode(key.substr(start, slash - start), false);
    start = slash + 1;
    paths.push_back(path);
  }
  for (const std::string& p : paths) {
    // 201 created, 405 exists, anything else: the operation that needed it will tell.
    auto r = Send("MKCOL", base_ + p + "/");
    if (!r.ok()) return r.status();
    spdlog::debug("webdav MKCOL {}{}/ -> {}", base_, p, r->status);
  }
  return Status::Ok();
}

std::optional<bool> WebDavStore::TempExists(const std::string& tmp) {
  auto r = Send("HEAD", UrlOf(tmp));
  if (!r.ok()) return std::nullopt;
  if (r->status == 404) return false;
  if (r->status >= 200 && r->status <= 299) return true;
  return std::nullopt;
}

void WebDavStore::DeleteTemp(const std::string& tmp) {
  auto r = Send("DELETE", UrlOf(tmp), {{"Depth", "0"}});
  if (!r.ok() || (r->status != 404 && (r->status < 200 || r->status > 299))) {
    spdlog::warn("webdav {}: could not delete temporary {} ({}); it is harmless and never listed", Describe(), tmp,
                 r.ok() ? "HTTP " + std::to_string(r->status) : r.status().ToString());
  }
}

Status WebDavStore::Move(const std::string& tmp, std::string_view key, PutMode mode) {
  const bool create = mode == PutMode::kCreateIfAbsent;
  // Destination as an absolute path (RFC 4918 Simple-ref): valid whatever Host the server or a
  // proxy in front of it believes it has.
  const HttpHeaders headers = {{"Destination", PathOf(key)}, {"Overwrite", create ? "F" : "T"}};
  Expected<HttpResponse> r = Send("MOVE", UrlOf(tmp), headers);
  if (r.ok() && r->status == 409) {  // a collection on the way is missing
    WFS_TRY(MakeParentCollections(key).WithContext(What("PUT", key)));
    r = Send("MOVE", UrlOf(tmp), headers);
  }
  // The server could not be reached within the budget: the outcome is unknown and the
  // temporary may remain (it is never listed). Cleaning up would only wait as long again.
  if (!r.ok()) return r.status().WithContext(What("PUT", key));
  if (r->status >= 200 && r->status <= 299) return Status::Ok();
  if (r->status == 404 || r->status == 412) {
    // Possibly a retry after an attempt that did move the temporary but whose answer was lost.
    // Nobody else knows the temporary's name, so its absence means this Put took effect.
    if (TempExists(tmp) == false) {
      spdlog::debug("webdav MOVE {} -> {}: temporary gone, an earlier attempt moved it", tmp, key);
      return Status::Ok();
    }
  }
  DeleteTemp(tmp);
  if (r->status == 412 && create) return Status::Conflict(Describe() + "/" + std::string(key) + " already exists");
  return ErrorFrom(*r, "MOVE to", key);
}

Status WebDavStore::Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) {
  WFS_TRY(ValidateKey(key));
  const std::string tmp = std::string(kTmpDir) + "/" + RandomName();
  if (!tmp_dir_ready_.load(std::memory_order_acquire)) {
    // PUT does not create collections on every server (nginx without create_full_put_path
    // answers 500, others 409), so make sure the temporary directory exists, once.
    WFS_TRY(MakeParentCollections(tmp).WithContext(What("PUT", key)));
    tmp_dir_ready_.store(true, std::memory_order_release);
  }
  for (int upload_try = 1;; ++upload_try) {
    Expected<HttpResponse> r = Send("PUT", UrlOf(tmp), {}, data);
    if (r.ok() && r->status == 409) {  // the temporary directory went away: make it again
      WFS_TRY(MakeParentCollections(tmp).WithContext(What("PUT", key)));
      r = Send("PUT", UrlOf(tmp), {}, data);
    }
    if (!r.ok()) {
      tmp_dir_ready_.store(false, std::memory_order_release);  // check again next time
      return r.status().WithContext(What("PUT", key));          // unreachable: nothing to clean
    }
    if (r->status < 200 || r->status > 299) {
      DeleteTemp(tmp);  // the server answered, so this is cheap; normally there is nothing to delete
      return ErrorFrom(*r, "PUT", key);
    }
    // WebDAV servers check no digest of what they receive (nginx ignores Content-MD5 and
    // Digest): the temporary is read back and compared before it is moved under its name, so
    // a bit flipped on the way up never reaches a key a reader uses. It costs a download of
    // every upload (tests/hub/store/webdav_store_test.cc, BitsFlippedOnTheWayUpAreNeverStoredSilently,
    // flips bits through a proxy); a flip is transient, so the body is sent again, at most
    // kUploadTries times.
    WFS_ASSIGN_OR_RETURN(bool same, SameBytes(tmp, data));
    if (same) break;
    DeleteTemp(tmp);
    if (upload_try >= kUploadTries) {
      return Status::Corruption(What("PUT", key) + ": the server stored other bytes than were sent, " +
                                std::to_string(kUploadTries) + " times (read back and compared); nothing is kept "
                                "under that key");
    }
    spdlog::warn("webdav {}: {} read back other bytes than were sent; sending it again", Describe(), What("PUT", key));
  }
  return Move(tmp, key, mode);
}

Expected<bool> WebDavStore::SameBytes(const std::string& tmp, std::span<const uint8_t> data) {
  // Room for an error answer's body too (a 503 page), which is retried like any GET.
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("GET", UrlOf(tmp), {}, {}, std::max<uint64_t>(data.size() + 1, 64 << 10)));
  if (r.status != 200) return ErrorFrom(r, "GET (reading back)", tmp);
  return r.body.size() == data.size() && std::equal(data.begin(), data.end(), r.body.begin());
}

Status WebDavStore::Delete(std::string_view key) {
  WFS_TRY(ValidateKey(key));
  // Depth: 0 makes a server refuse to delete a collection (a tree) named by mistake.
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("DELETE", UrlOf(key), {{"Depth", "0"}}));
  if (r.status == 404) return Status::NotFound(What("DELETE", key) + ": no such object");
  if (r.status >= 200 && r.status <= 299) return Status::Ok();
  return ErrorFrom(r, "DELETE", key);
}

std::optional<std::string> WebDavStore::RelativeName(std::string_view href) const {
  for (std::string_view scheme : {"http://", "https://"}) {
    if (href.size() >= scheme.size() && std::equal(scheme.begin(), scheme.end(), href.begin(), [](char a, char b) {
          return a == std::tolower(static_cast<unsigned char>(b));
        })) {
      const size_t slash = href.find('/', scheme.size());
      href = slash == std::string_view::npos ? std::string_view("/") : href.substr(slash);
      break;
    }
  }
  href = href.substr(0, std::min(href.find_first_of("?#"), href.size()));
  std::optional<std::string> path = PercentDecode(href);
  if (!path) return std::nullopt;
  if (*path + "/" == root_path_) return std::string();
  if (path->rfind(root_path_, 0) != 0) return std::nullopt;
  std::string rel = path->substr(root_path_.size());
  while (!rel.empty() && rel.back() == '/') rel.pop_back();
  return rel;
}

Status WebDavStore::Walk(const std::string& dir, std::string_view prefix, std::string_view continuation, size_t limit,
                         std::vector<ObjectInfo>& out) {
  const std::string url = base_ + prefix_ + "/" + (dir.empty() ? "" : UrlEncode(dir, true) + "/");
  const std::string_view body_text = kPropfindWithTimesBody;
  const std::span<const uint8_t> body(reinterpret_cast<const uint8_t*>(body_text.data()), body_text.size());
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("PROPFIND", url,
                                            {{"Depth", "1"}, {"Content-Type", "application/xml; charset=utf-8"}},
                                            body, kMaxPropfindBytes));
  if (r.status == 404) return Status::Ok();  // no such collection: nothing under it
  if (r.status != 207) return ErrorFrom(r, "PROPFIND", dir.empty() ? "" : dir + "/");
  auto parsed = ParseDavMultistatus(AsText(r.body));
  if (!parsed.ok()) return parsed.status().WithContext(What("PROPFIND", dir + "/"));

  struct Child {
    std::string sort_key;  // the name, with a trailing '/' for a collection: sorts like its keys
    std::string name;
    bool collection;
    std::optional<uint64_t> length;
    std::optional<int64_t> modified_ms;
  };
  std::vector<Child> children;
  for (DavEntry& e : *parsed) {
    std::optional<std::string> rel = RelativeName(e.href);
    if (!rel) {
      spdlog::debug("webdav PROPFIND {}: ignoring href outside the bucket", url);
      continue;
    }
    if (*rel == dir) continue;  // the collection itself
    if (!dir.empty() && rel->rfind(dir + "/", 0) != 0) continue;
    if (dir.empty() && rel->empty()) continue;
    if (dir.empty() && *rel == kTmpDir) continue;
    if (!ValidateKey(*rel).ok()) {
      spdlog::debug("webdav PROPFIND {}: ignoring an entry whose name is not a valid key", url);
      continue;
    }
    children.push_back({e.collection ? *rel + "/" : *rel, std::move(*rel), e.collection, e.length, e.modified_ms});
  }
  std::sort(children.begin(), children.end(), [](const Child& a, const Child& b) { return a.sort_key < b.sort_key; });

  for (Child& c : children) {
    if (out.size() >= limit) break;
    if (c.collection) {
      const std::string& sub = c.sort_key;  // every key below starts with it
      const bool relevant = sub.rfind(prefix, 0) == 0 || prefix.rfind(sub, 0) == 0;
      // Every key below is <= continuation when `sub` sorts before it and is not its prefix.
      const bool all_seen = !continuation.empty() && sub < continuation && continuation.rfind(sub, 0) != 0;
      if (relevant && !all_seen) WFS_TRY(Walk(c.name, prefix, continuation, limit, out));
      continue;
    }
    if (c.name.rfind(prefix, 0) != 0) continue;
    if (!continuation.empty() && c.name <= continuation) continue;
    uint64_t size = 0;
    if (c.length) {
      size = *c.length;
    } else {
      auto s = SizeOf(c.name);
      if (s.status().kind() == ErrorKind::kNotFound) continue;  // deleted meanwhile
      if (!s.ok()) return s.status();
      size = *s;
    }
    out.push_back(ObjectInfo{std::move(c.name), size, c.modified_ms.value_or(0)});
  }
  return Status::Ok();
}

Expected<std::vector<TemporaryObject>> WebDavStore::ListTemporaries() {
  const std::string dir(kTmpDir);
  const std::string_view body_text = kPropfindWithTimesBody;
  const std::span<const uint8_t> body(reinterpret_cast<const uint8_t*>(body_text.data()), body_text.size());
  WFS_ASSIGN_OR_RETURN(HttpResponse r, Send("PROPFIND", base_ + prefix_ + "/" + dir + "/",
                                            {{"Depth", "1"}, {"Content-Type", "application/xml; charset=utf-8"}},
                                            body, kMaxPropfindBytes));
  std::vector<TemporaryObject> out;
  if (r.status == 404) return out;  // no write ever made the collection
  if (r.status != 207) return ErrorFrom(r, "PROPFIND", dir + "/");
  auto parsed = ParseDavMultistatus(AsText(r.body));
  if (!parsed.ok()) return parsed.status().WithContext(What("PROPFIND", dir + "/"));
  for (const DavEntry& e : *parsed) {
    std::optional<std::string> rel = RelativeName(e.href);
    if (!rel || e.collection || rel->rfind(dir + "/", 0) != 0 || !ValidateKey(*rel).ok()) continue;
    if (rel->find('/', dir.size() + 1) != std::string::npos) continue;  // not directly in it
    out.push_back({std::move(*rel), e.length.value_or(0), e.modified_ms.value_or(0)});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.key < b.key; });
  return out;
}

Expected<ListPage> WebDavStore::List(std::string_view prefix, std::string_view continuation, size_t max_keys) {
  max_keys = std::max<size_t>(max_keys, 1);
  // Start at the deepest collection the prefix names; everything under it is filtered.
  const size_t slash = prefix.rfind('/');
  const std::string dir = slash == std::string_view::npos ? "" : std::string(prefix.substr(0, slash));
  if (!dir.empty() && !ValidateKey(dir).ok()) return ListPage{};  // no key can have this prefix
  if (dir == kTmpDir || dir.rfind(std::string(kTmpDir) + "/", 0) == 0) return ListPage{};
  std::vector<ObjectInfo> found;
  WFS_TRY(Walk(dir, prefix, continuation, max_keys + 1, found));
  ListPage page;
  if (found.size() > max_keys) {
    found.resize(max_keys);
    page.continuation = found.back().key;
  }
  page.objects = std::move(found);
  return page;
}

}  // namespace

Expected<std::unique_ptr<Store>> OpenWebDavStore(std::string_view url, std::shared_ptr<HttpClient> http) {
  auto bad = [&](const std::string& why) {
    // Never echo user:password@ back.
    std::string shown(url);
    const size_t scheme_end = shown.find("://");
    const size_t host_start = scheme_end == std::string::npos ? 0 : scheme_end + 3;
    const size_t at = shown.find('@', host_start);
    if (at != std::string::npos && at < std::min(shown.find('/', host_start), shown.size())) {
      shown.replace(host_start, at - host_start, "***");
    }
    return Status::InvalidArgument("invalid WebDAV URL " + shown + ": " + why +
                                   " (expected http[s]://host[:port][/prefix])");
  };
  std::string scheme;
  if (url.rfind("http://", 0) == 0) scheme = "http://";
  else if (url.rfind("https://", 0) == 0) scheme = "https://";
  else return bad("scheme must be http:// or https://");
  std::string_view rest = url.substr(scheme.size());
  if (rest.find_first_of("?#") != std::string_view::npos) return bad("a query string or fragment is not allowed");
  const size_t path_start = std::min(rest.find('/'), rest.size());
  std::string_view authority = rest.substr(0, path_start);
  std::string_view path = rest.substr(path_start);
  std::string authorization;
  const size_t at = authority.rfind('@');
  if (at != std::string_view::npos) {
    auto userinfo = PercentDecode(authority.substr(0, at));
    if (!userinfo) return bad("malformed credentials");
    authorization = "Basic " + Base64(*userinfo);
    authority.remove_prefix(at + 1);
  }
  if (authority.empty()) return bad("no host");
  for (char c : authority) {
    const bool ok = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == ':' || c == '[' ||
                    c == ']' || c == '_';
    if (!ok) return bad("invalid character in host");
  }
  // Normalise the prefix: no empty components, no trailing slash; "." and ".." are refused.
  std::string prefix;
  size_t start = 0;
  while (start < path.size()) {
    size_t end = std::min(path.find('/', start), path.size());
    const std::string_view part = path.substr(start, end - start);
    start = end + 1;
    if (part.empty()) continue;
    if (part == "." || part == "..") return bad("'.' or '..' in the path");
    for (char c : part) {
      if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f) {
        return bad("the path must be percent-encoded");
      }
    }
    prefix += "/" + std::string(part);
  }
  auto decoded = PercentDecode(prefix);
  if (!decoded) return bad("malformed percent-encoding in the path");
  if (!http) http = std::make_shared<HttpClient>();
  return std::unique_ptr<Store>(new WebDavStore(scheme + std::string(authority), prefix, *decoded,
                                                std::move(authorization), std::move(http)));
}

}  // namespace weightfs
