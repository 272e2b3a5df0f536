#include "hub/hf/hf_bucket_store.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>

#include "core/mutex.h"

namespace weightfs {
namespace {

constexpr auto kSnapshotTtl = std::chrono::seconds(30);

class HfBucketStore final : public Store {
 public:
  HfBucketStore(HfBucketUrl url, std::shared_ptr<HfApi> api, std::unique_ptr<Store> s3)
      : url_(std::move(url)), api_(std::move(api)), s3_(std::move(s3)) {
    target_.kind = HfTarget::Kind::kBucket;
    target_.id = url_.id();
  }

  Expected<std::vector<uint8_t>> Get(std::string_view key, std::optional<ByteRange> range) override {
    WFS_TRY(ValidateKey(key));
    HfTarget t = target_;
    t.path = FullKey(key);
    const uint64_t offset = range ? range->offset : 0;
    const std::optional<uint64_t> length = range ? range->length : std::nullopt;
    // A ranged read is of a pack or a chunk table, which weightfs never rewrites: its signed
    // URL is reused. Whole-object reads (heads, leases, bucket metadata) resolve every time.
    return api_->ReadRange(ResolveUrl(key), t, offset, length, /*reuse_resolved=*/range.has_value());
  }

  Status Put(std::string_view key, std::span<const uint8_t> data, PutMode mode) override {
    WFS_TRY(ValidateKey(key));
    return s3_->Put(key, data, mode);
  }

  Expected<ObjectInfo> Head(std::string_view key) override {
    WFS_TRY(ValidateKey(key));
    HfTarget t = target_;
    t.path = FullKey(key);
    WFS_ASSIGN_OR_RETURN(uint64_t size, api_->HeadSize(ResolveUrl(key), t));
    return ObjectInfo{std::string(key), size};
  }

  Expected<ListPage> List(std::string_view prefix, std::string_view continuation, size_t max_keys) override;

  Status Delete(std::string_view key) override {
    WFS_TRY(ValidateKey(key));
    return s3_->Delete(key);
  }

  std::string Describe() const override {
    return "hf://buckets/" + url_.id() + (url_.prefix.empty() ? "" : "/" + url_.prefix) +
           (api_->config().endpoint == kHfDefaultEndpoint ? "" : " (Hub " + api_->config().endpoint + ")");
  }

 private:
  std::string FullKey(std::string_view key) const {
    return url_.prefix.empty() ? std::string(key) : url_.prefix + "/" + std::string(key);
  }
  std::string ResolveUrl(std::string_view key) const {
    return api_->Url("/buckets/" + url_.ns + "/" + url_.name + "/resolve/" + UrlEncode(FullKey(key), true));
  }
  // Every object under `full_prefix` (a bucket path), sorted by key relative to our prefix.
  Expected<std::vector<ObjectInfo>> ListAll(const std::string& full_prefix) const;

  const HfBucketUrl url_;
  const std::shared_ptr<HfApi> api_;
  const std::unique_ptr<Store> s3_;
  HfTarget target_;

  struct Snapshot {
    std::string full_prefix;
    std::shared_ptr<const std::vector<ObjectInfo>> objects;
    std::chrono::steady_clock::time_point expires;
  };
  Mutex mu_;  // never held across I/O
  Snapshot snapshot_ WFS_GUARDED_BY(mu_);
};

Expected<std::vector<ObjectInfo>> HfBucketStore::ListAll(const std::string& full_prefix) const {
  // The tree path is the directory part of the prefix; the rest is filtered here.
  const size_t slash = full_prefix.rfind('/');
  const std::string dir = slash == std::string::npos ? "" : full_prefix.substr(0, slash);
  std::string url = api_->Url("/api/buckets/" + url_.ns + "/" + url_.name + "/tree" +
                              (dir.empty() ? "" : "/" + UrlEncode(dir, true)) +
                              "?recursive=true&limit=" + std::to_string(kHubTreePageLimit));
  const std::string strip = url_.prefix.empty() ? "" : url_.prefix + "/";
  std::vector<ObjectInfo> out;
  size_t skipped = 0;
  auto on_page = [&](const nlohmann::json& page) -> Status {
    return AppendHfBucketTreePage(page, full_prefix, strip, &out, &skipped);
  };
  auto on_not_found = [&](const HttpResponse& r) -> Status {
    // A directory that does not exist lists as empty; a missing bucket is an error.
    const std::string_view code = r.Header("x-error-code");
    if (code == "RepoNotFound" || code == "BucketNotFound") {
      return api_->ErrorFrom(r, "GET " + url.substr(0, url.find('?')), target_);
    }
    return Status::Ok();
  };
  WFS_TRY(api_->GetJsonPages(url, target_, on_page, on_not_found));
  if (skipped > 0) spdlog::debug("{}: skipped {} keys weightfs cannot use", Describe(), skipped);
  std::sort(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key < b.key; });
  out.erase(std::unique(out.begin(), out.end(), [](const ObjectInfo& a, const ObjectInfo& b) { return a.key == b.key; }),
            out.end());
  return out;
}

Expected<ListPage> HfBucketStore::List(std::string_view prefix, std::string_view continuation, size_t max_keys) {
  if (!prefix.empty() && prefix.find("//") != std::string_view::npos) {
    return Status::InvalidArgument("list prefix '" + std::string(prefix.substr(0, 200)) + "' contains '//'");
  }
  if (max_keys == 0) max_keys = 1;
  const std::string full_prefix = FullKey(prefix);
  std::shared_ptr<const std::vector<ObjectInfo>> all;
  const auto now = std::chrono::steady_clock::now();
  if (!continuation.empty()) {
    MutexLock lock(mu_);
    if (snapshot_.objects && snapshot_.full_prefix == full_prefix && now < snapshot_.expires) all = snapshot_.objects;
  }
  if (!all) {
    WFS_ASSIGN_OR_RETURN(std::vector<ObjectInfo> fresh, ListAll(full_prefix));
    all = std::make_shared<const std::vector<ObjectInfo>>(std::move(fresh));
    MutexLock lock(mu_);
    snapshot_ = Snapshot{full_prefix, all, now + kSnapshotTtl};
  }
  auto it = all->begin();
  if (!continuation.empty()) {
    it = std::upper_bound(all->begin(), all->end(), continuation,
                          [](std::string_view c, const ObjectInfo& o) { return c < o.key; });
  }
  ListPage page;
  for (; it != all->end() && page.objects.size() < max_keys; ++it) page.objects.push_back(*it);
  if (it != all->end() && !page.objects.empty()) page.continuation = page.objects.back().key;
  return page;
}

}  // namespace

Status AppendHfBucketTreePage(const nlohmann::json& page, std::string_view full_prefix, std::string_view strip,
                              std::vector<ObjectInfo>* out, size_t* skipped) {
  if (!page.is_array()) return Status::Corruption("bucket tree page is not a JSON array");
  for (const auto& e : page) {
    if (!e.is_object()) return Status::Corruption("bucket tree entry is not an object");
    const auto type = e.find("type");
    const auto path = e.find("path");
    if (type == e.end() || !type->is_string() || path == e.end() || !path->is_string()) {
      return Status::Corruption("bucket tree entry without type or path");
    }
    if (type->get_ref<const std::string&>() != "file") continue;
    const std::string& p = path->get_ref<const std::string&>();
    if (!p.starts_with(full_prefix) || !p.starts_with(strip)) continue;
    const std::string key = p.substr(strip.size());
    if (!ValidateKey(key).ok()) {
      ++*skipped;
      continue;
    }
    const auto size = e.find("size");
    if (size == e.end() || !size->is_number_unsigned()) {
      return Status::Corruption("bucket tree entry '" + key.substr(0, 200) + "' has no valid size");
    }
    out->push_back(ObjectInfo{key, size->get<uint64_t>()});
  }
  return Status::Ok();
}

Expected<HfBucketUrl> ParseHfBucketUrl(std::string_view url) {
  constexpr std::string_view kScheme = "hf://buckets/";
  const std::string shown(url.substr(0, 200));
  if (!url.starts_with(kScheme)) {
    return Status::InvalidArgument("'" + shown + "' is not a Hugging Face bucket URL (expected "
                                   "hf://buckets/NAMESPACE/NAME[/PREFIX])");
  }
  std::string_view rest = url.substr(kScheme.size());
  if (rest.find_first_of("?#") != std::string_view::npos) {
    return Status::InvalidArgument("bucket URL '" + shown + "' must not have a query or fragment");
  }
  HfBucketUrl out;
  const size_t s1 = rest.find('/');
  out.ns = std::string(rest.substr(0, s1));
  if (s1 == std::string_view::npos) {
    return Status::InvalidArgument("bucket URL '" + shown + "' has no bucket name (hf://buckets/NAMESPACE/NAME)");
  }
  rest.remove_prefix(s1 + 1);
  const size_t s2 = rest.find('/');
  out.name = std::string(rest.substr(0, s2));
  if (s2 != std::string_view::npos) out.prefix = std::string(rest.substr(s2 + 1));
  while (!out.prefix.empty() && out.prefix.back() == '/') out.prefix.pop_back();
  Status s = ValidateHubName(out.ns, "namespace");
  if (s.ok()) s = ValidateHubName(out.name, "bucket name");
  if (!s.ok()) return Status::InvalidArgument("bucket URL '" + shown + "': " + s.message());
  if (!out.prefix.empty()) {
    s = ValidateKey(out.prefix);
    if (!s.ok()) return Status::InvalidArgument("prefix of bucket URL '" + shown + "': " + s.message());
  }
  return out;
}

Expected<std::optional<AwsCredentials>> LoadHfGatewayCredentials(const AwsEnvLookup& env) {
  auto get = [&](const char* name) -> std::optional<std::string> {
    auto v = env(name);
    if (!v || v->empty()) return std::nullopt;
    return v;
  };
  // 1. Variables of its own.
  const auto id = get("HF_S3_ACCESS_KEY_ID"), secret = get("HF_S3_SECRET_ACCESS_KEY");
  if (id.has_value() != secret.has_value()) {
    return Status::InvalidArgument(id ? "HF_S3_ACCESS_KEY_ID is set but HF_S3_SECRET_ACCESS_KEY is not; set both"
                                      : "HF_S3_SECRET_ACCESS_KEY is set but HF_S3_ACCESS_KEY_ID is not; set both");
  }
  if (id) return std::optional<AwsCredentials>(AwsCredentials{*id, *secret, "", "environment (HF_S3_ACCESS_KEY_ID)"});
  // 2. A profile of its own in the AWS files, read with the AWS variables hidden so that nothing
  //    else of the AWS chain can answer.
  const auto named = get("HF_S3_PROFILE");
  const std::string profile = named.value_or(kHfGatewayProfile);
  AwsEnvLookup profile_env = [&](std::string_view name) -> std::optional<std::string> {
    if (name == "AWS_PROFILE") return profile;
    if (name == "AWS_ACCESS_KEY_ID" || name == "AWS_SECRET_ACCESS_KEY" || name == "AWS_SESSION_TOKEN") {
      return std::nullopt;
    }
    return env(name);
  };
  auto settings = LoadAwsSettings(profile_env);
  if (settings.ok() && settings->credentials) return settings->credentials;
  if (!settings.ok() && named) return settings.status().WithContext("HF_S3_PROFILE");
  // 3. The AWS variables, only when they hold a gateway key (the Hub's keys start with HFAK).
  const auto aws_id = get("AWS_ACCESS_KEY_ID"), aws_secret = get("AWS_SECRET_ACCESS_KEY");
  if (aws_id && aws_secret && aws_id->starts_with("HFAK")) {
    return std::optional<AwsCredentials>(
        AwsCredentials{*aws_id, *aws_secret, get("AWS_SESSION_TOKEN").value_or(""), "environment (AWS_ACCESS_KEY_ID)"});
  }
  if (aws_id) {
    spdlog::debug("hf buckets: AWS_ACCESS_KEY_ID is not a Hub key (HFAK...): not sent to the Hub's S3 gateway");
  }
  return std::optional<AwsCredentials>();
}

Expected<std::unique_ptr<Store>> OpenHfBucketStore(std::string_view url, const HfConfig& config,
                                                   const HfBucketOptions& options,
                                                   std::shared_ptr<HttpClient> http) {
  WFS_ASSIGN_OR_RETURN(HfBucketUrl parsed, ParseHfBucketUrl(url));
  if (!http) http = std::make_shared<HttpClient>();
  S3Options s3 = options.s3;
  const AwsEnvLookup env = s3.env ? s3.env : ProcessAwsEnv();
  if (!s3.credentials) {
    WFS_ASSIGN_OR_RETURN(s3.credentials, LoadHfGatewayCredentials(env));
  }
  s3.credentials_from_aws_chain = false;  // a user's AWS keys never go to the Hub
  s3.credentials_hint =
      std::string(s3.credentials ? "check the Hub S3 key pair from " + s3.credentials->source + " (" :
                                   "no Hub S3 key pair was found (") +
      "the gateway takes the HFAK... access key and secret generated for a write token at "
      "https://huggingface.co/settings/tokens, \"Generate S3 credentials\": set HF_S3_ACCESS_KEY_ID and "
      "HF_S3_SECRET_ACCESS_KEY, or put them in profile [" + kHfGatewayProfile +
      "] of ~/.aws/credentials (HF_S3_PROFILE names another); AWS keys are never sent to it)";
  s3.missing_bucket_hint = "create it first with `hf buckets create " + parsed.id() + "`";
  s3.follow_get_redirects = true;      // downloads are redirected to the Hub's CDN
  s3.conditional_multipart = false;    // If-None-Match is documented for PutObject only
  std::string base = options.s3_endpoint;
  if (base.empty()) base = env("HF_S3_ENDPOINT").value_or("");
  if (base.empty()) base = kHfDefaultS3Endpoint;
  while (!base.empty() && base.back() == '/') base.pop_back();
  s3.endpoint = base + "/" + parsed.ns;
  s3.addressing = S3Options::Addressing::kPath;  // the gateway serves path-style only
  if (s3.region.empty()) s3.region = "us-east-1";  // "the gateway is currently single-region"
  WFS_ASSIGN_OR_RETURN(std::unique_ptr<Store> s3_store,
                       OpenS3Store("s3://" + parsed.name + (parsed.prefix.empty() ? "" : "/" + parsed.prefix), s3, http));
  auto api = std::make_shared<HfApi>(config, std::move(http));
  return std::unique_ptr<Store>(new HfBucketStore(std::move(parsed), std::move(api), std::move(s3_store)));
}

}  // namespace weightfs
