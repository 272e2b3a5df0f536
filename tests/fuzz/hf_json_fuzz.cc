// libFuzzer target for what weightfs parses from the Hugging Face Hub and from hf:// URLs: the
// tree-listing pages of buckets and model repos, the revision API's answer, Link headers and
// redirect Locations, error answers (ErrorFrom), HF_ENDPOINT, and the hf:// URL and source-string
// parsers, signed-URL expiries, RateLimit headers and path expansion. Beyond "never crash": whatever a parser accepts must be what its contract promises
// (keys that are valid store keys under the listed prefix, valid repo paths, 40-hex commits,
// http(s) URLs, source strings that rebuild to the input, no token in any error).
//
// Input: byte 0 picks the parser; the rest is its input (for two-string parsers, split at the
// first 0x00 byte).
//
//   ./hf_json_fuzz -max_len=4096 -rss_limit_mb=2048 corpus/
#include <spdlog/spdlog.h>

#include <cctype>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/manifest.h"
#include "hub/hf/hf_bucket_store.h"
#include "hub/hf/hf_api.h"
#include "hub/hf/hf_repo.h"
#include "hub/store/store.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

using weightfs::ErrorKind;
using weightfs::fuzz::Check;

constexpr std::string_view kToken = "hf_FuzzSecretToken0123456789";

bool IsLowerHex(std::string_view s, size_t n) {
  if (s.size() != n) return false;
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool IsHttpUrl(std::string_view u) {
  std::string lower(u.substr(0, 8));
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower.starts_with("http://") || lower.starts_with("https://");
}

// As GetJsonPages and GetJson parse a body: no exceptions, "discarded" on error.
nlohmann::json Parse(std::string_view s) { return nlohmann::json::parse(s.begin(), s.end(), nullptr, false); }

void BucketTree(std::string_view body) {
  const nlohmann::json page = Parse(body);
  // (full prefix, strip): the whole bucket, a directory, a directory under a URL prefix.
  static const std::pair<std::string_view, std::string_view> kCases[] = {
      {"", ""}, {"anchors/", ""}, {"p/q/deltas/step_", "p/q/"}};
  for (const auto& [full_prefix, strip] : kCases) {
    std::vector<weightfs::ObjectInfo> out;
    size_t skipped = 0;
    weightfs::Status s = weightfs::AppendHfBucketTreePage(page, full_prefix, strip, &out, &skipped);
    if (!s.ok()) Check(s.kind() == ErrorKind::kCorruption);
    for (const weightfs::ObjectInfo& o : out) {
      Check(weightfs::ValidateKey(o.key).ok());
      Check((std::string(strip) + o.key).starts_with(full_prefix));
    }
  }
}

void RepoTree(std::string_view body) {
  const nlohmann::json page = Parse(body);
  std::vector<weightfs::HfRepoFile> out;
  weightfs::Status s = weightfs::AppendHfRepoTreePage(page, "hf://fuzz/repo@main", &out);
  if (!s.ok()) Check(s.kind() == ErrorKind::kCorruption);
  for (const weightfs::HfRepoFile& f : out) {
    Check(weightfs::ValidateFilePath(f.path).ok());
    Check(f.sha256.empty() || IsLowerHex(f.sha256, 64));
  }
  // What OpenHfRepoVersions shows for the listing: a tree a filesystem can show, planned within
  // bounds whatever sizes the server claims (a total bound of 1 GiB here, to stay fast).
  constexpr uint64_t kMaxBytes = 1ull << 30;
  auto m = weightfs::BuildHfRepoManifest("fuzz/repo", "main", "0123456789abcdef0123456789abcdef01234567", 1,
                                         std::move(out), kMaxBytes);
  if (!m.ok()) {
    Check(m.status().kind() == ErrorKind::kCorruption || m.status().kind() == ErrorKind::kResourceExhausted);
    return;
  }
  uint64_t total = 0;
  std::set<std::string> paths;
  for (const weightfs::ManifestFile& f : (*m)->files) paths.insert(f.path);
  for (size_t i = 0; i < (*m)->files.size(); ++i) {
    const weightfs::ManifestFile& f = (*m)->files[i];
    if (i > 0) Check((*m)->files[i - 1].path < f.path);
    for (size_t slash = f.path.find('/'); slash != std::string::npos; slash = f.path.find('/', slash + 1)) {
      Check(paths.count(f.path.substr(0, slash)) == 0);
    }
    Check(f.size <= weightfs::kMaxHfRepoFileBytes);
    total += f.size;
    uint64_t cursor = 0;
    for (const weightfs::ManifestChunk& c : f.chunks) {
      Check(c.offset == cursor && c.length > 0 && c.length <= weightfs::kMaxChunkBytes);
      cursor += c.length;
    }
    Check(cursor == f.size);
  }
  Check(total <= kMaxBytes);
}

void Revision(std::string_view body) {
  auto info = weightfs::ParseHfRevisionInfo(Parse(body), "hf://fuzz/repo@main");
  if (!info.ok()) {
    Check(info.status().kind() == ErrorKind::kCorruption);
    return;
  }
  Check(weightfs::hf::IsCommitSha(info->commit));
}

void Link(std::string_view header) {
  const std::string next = weightfs::hf::ParseLinkNext(header);
  Check(next.size() <= header.size());
  const std::string url = weightfs::hf::ResolveUrl("https://huggingface.co/api/models/a/b/tree/main?limit=2", next);
  if (!url.empty()) Check(IsHttpUrl(url));
  (void)weightfs::hf::UrlOrigin(url);
}

void Resolve(std::string_view base, std::string_view location) {
  const std::string url = weightfs::hf::ResolveUrl(base, location);
  if (!url.empty()) Check(IsHttpUrl(url));
  const std::string origin = weightfs::hf::UrlOrigin(url);
  if (!origin.empty()) Check(IsHttpUrl(origin));
  (void)weightfs::hf::UrlOrigin(base);
  // A Location's signed-URL expiry, and the rate-limit headers of the same answer, are the
  // server's word too: bounded, never past 2^40 s after the epoch.
  if (auto expiry = weightfs::hf::SignedUrlExpiry(location)) {
    Check(expiry->time_since_epoch() <= std::chrono::seconds(int64_t{1} << 41));
  }
  (void)weightfs::ParseRateLimitReset(location);
  (void)weightfs::ParseRateLimitWindow(base);
  // Path expansion (HF_HOME and friends): without '$' or a leading '~' nothing changes.
  const std::string expanded = weightfs::hf::ExpandUserAndVars(
      location, [](std::string_view name) -> std::optional<std::string> {
        return name == "HOME" ? std::optional<std::string>("/home/u") : std::nullopt;
      });
  if (location.find('$') == std::string_view::npos && !location.starts_with("~")) Check(expanded == location);
}

void Source(std::string_view source) {
  auto p = weightfs::HfSources::ParseSource(source);
  if (!p.ok()) {
    Check(p.status().kind() == ErrorKind::kInvalidArgument);
    return;
  }
  Check(weightfs::hf::IsCommitSha(p->commit));
  Check(weightfs::ValidateFilePath(p->path).ok());
  Check("hf://" + p->repo + "@" + p->commit + "/" + p->path == source);
}

void RepoUrl(std::string_view url) {
  auto r = weightfs::ParseHfRepoUrl(url);
  if (!r.ok()) {
    Check(r.status().kind() == ErrorKind::kInvalidArgument || r.status().kind() == ErrorKind::kUnsupported);
    return;
  }
  Check(!r->repo.empty() && !r->revision.empty());
  Check(r->repo.find_first_of("@?#") == std::string::npos);
  const std::string again = "hf://" + r->repo + "@" + r->revision;
  auto r2 = weightfs::ParseHfRepoUrl(again);
  Check(r2.ok() && r2->repo == r->repo && r2->revision == r->revision);
}

void BucketUrl(std::string_view url) {
  auto b = weightfs::ParseHfBucketUrl(url);
  if (!b.ok()) {
    Check(b.status().kind() == ErrorKind::kInvalidArgument);
    return;
  }
  Check(!b->ns.empty() && !b->name.empty());
  if (!b->prefix.empty()) Check(weightfs::ValidateKey(b->prefix).ok());
  const std::string again = "hf://buckets/" + b->id() + (b->prefix.empty() ? "" : "/" + b->prefix);
  auto b2 = weightfs::ParseHfBucketUrl(again);
  Check(b2.ok() && b2->ns == b->ns && b2->name == b->name && b2->prefix == b->prefix);
}

const weightfs::HfApi& Api() {
  static const weightfs::HfApi* api = [] {
    weightfs::HfConfig c;
    c.token = std::string(kToken);
    c.token_source = "HF_TOKEN";
    return new weightfs::HfApi(c, std::make_shared<weightfs::HttpClient>());
  }();
  return *api;
}

// An error answer: [u16 status][u8 target kind][code \0 message \0 body].
void Error(weightfs::fuzz::Reader& in) {
  weightfs::HttpResponse r;
  r.status = in.U16();
  const uint8_t kind = in.U8();
  const std::span<const uint8_t> rest = in.Rest();
  std::string_view text(reinterpret_cast<const char*>(rest.data()), rest.size());
  const size_t a = text.find('\0');
  const size_t b = a == std::string_view::npos ? a : text.find('\0', a + 1);
  if (a != std::string_view::npos) r.headers.emplace_back("x-error-code", std::string(text.substr(0, a)));
  if (b != std::string_view::npos) r.headers.emplace_back("x-error-message", std::string(text.substr(a + 1, b - a - 1)));
  const std::string_view body = b == std::string_view::npos ? text : text.substr(b + 1);
  r.body.assign(body.begin(), body.end());
  weightfs::HfTarget t;
  t.kind = kind & 1 ? weightfs::HfTarget::Kind::kBucket : weightfs::HfTarget::Kind::kRepo;
  t.id = "org/x";
  t.revision = "main";
  t.path = kind & 2 ? "model.safetensors" : "";
  const weightfs::Status s = Api().ErrorFrom(r, "GET https://huggingface.co/org/x", t);
  Check(!s.ok() || r.status < 400);
  Check(s.message().find(kToken) == std::string::npos);
}

void Endpoint(std::string_view endpoint) {
  const std::map<std::string, std::string> vars = {
      {"HF_ENDPOINT", std::string(endpoint)}, {"HF_HUB_DISABLE_IMPLICIT_TOKEN", "1"}, {"HOME", "/nonexistent"}};
  auto c = weightfs::LoadHfConfig([&](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
  if (!c.ok()) {
    Check(c.status().kind() == ErrorKind::kInvalidArgument);
    return;
  }
  Check(IsHttpUrl(c->endpoint) && !c->endpoint.ends_with("/"));
  Check(!weightfs::hf::UrlOrigin(c->endpoint).empty());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // skipped-entry warnings are expected
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  weightfs::fuzz::Reader in(data, size);
  const uint8_t mode = in.U8();
  const std::span<const uint8_t> rest_span(data + (size > 0 ? 1 : 0), size > 0 ? size - 1 : 0);
  const std::string_view rest(reinterpret_cast<const char*>(rest_span.data()), rest_span.size());
  const size_t nul = rest.find('\0');
  const std::string_view first = rest.substr(0, nul);
  const std::string_view second = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  switch (mode % 10) {
    case 0: BucketTree(rest); break;
    case 1: RepoTree(rest); break;
    case 2: Revision(rest); break;
    case 3: Link(rest); break;
    case 4: Resolve(first, second); break;
    case 5: Source(rest); break;
    case 6: RepoUrl(rest); break;
    case 7: BucketUrl(rest); break;
    case 8: Error(in); break;
    case 9: Endpoint(rest); break;
  }
  return 0;
}
