// The AWS credential provider chain, as the AWS CLI and SDKs walk it, for nodes that hold no
// keys of their own: EC2 instance roles, EKS (IRSA, pod identity), ECS tasks, assume-role and
// credential_process profiles. Credentials that expire are fetched again before they do: a
// mount runs for weeks, and a session token lasts an hour.
//
// The chain, first match wins (botocore's order):
//   1. AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN);
//   2. the profile (AWS_PROFILE, else "default") when it names a role: `role_arn` with
//      `source_profile` (that profile's credentials, chained up to 5 deep) or
//      `credential_source` (Environment, Ec2InstanceMetadata, EcsContainer): STS AssumeRole;
//      `role_arn` with `web_identity_token_file`: STS AssumeRoleWithWebIdentity;
//   3. AWS_WEB_IDENTITY_TOKEN_FILE + AWS_ROLE_ARN (+ AWS_ROLE_SESSION_NAME): EKS IRSA; the token
//      file is read again at every refresh (the kubelet rotates it);
//   4. an SSO profile: refused with what to run instead (we do not hold SSO login caches);
//   5. keys of the profile in the credentials file; its `credential_process` (run through
//      /bin/sh, 60 s at most, the AWS "Version": 1 JSON on stdout); keys in the config file;
//   6. the container endpoint: AWS_CONTAINER_CREDENTIALS_RELATIVE_URI (ECS: on 169.254.170.2) or
//      AWS_CONTAINER_CREDENTIALS_FULL_URI (EKS pod identity; https, or http to a loopback or
//      the ECS/EKS link-local address), with AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE (read at
//      every refresh) or AWS_CONTAINER_AUTHORIZATION_TOKEN;
//   7. EC2 instance metadata, IMDSv2 (a session token first; IMDSv1 only if the token PUT is
//      refused with 403/404/405 and AWS_EC2_METADATA_V1_DISABLED is not true), unless
//      AWS_EC2_METADATA_DISABLED=true. AWS_EC2_METADATA_SERVICE_ENDPOINT moves it (default
//      http://169.254.169.254); one try with a 1 s connect bound, so a machine outside EC2 learns
//      "nothing found" in about a second.
// STS is https://sts.REGION.amazonaws.com, or AWS_ENDPOINT_URL_STS.
//
// No library does this for us on Debian 12: there is no AWS SDK for C++ package (only Go,
// Haskell and Perl ones), and the C runtime (aws-c-auth) is not packaged either. What the chain
// needs is small: three JSON endpoints, one XML one, SigV4 (hub/store/s3_signer.h, ours, checked
// against AWS's vectors) and a child process.
//
// Secrets never appear in messages or logs: errors name endpoints, files, profiles and roles.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/mutex.h"
#include "core/status.h"
#include "hub/store/aws_credentials.h"

namespace weightfs {

// The credentials an S3 store signs each request with: fixed ones, or ones a provider fetches
// and fetches again before they expire. Thread-safe; shared by every request of a store.
class AwsCredentialSource {
 public:
  using Fetch = std::function<Expected<AwsCredentials>()>;
  // Refreshed this long before expiry (AWS SDKs: 5-15 min), or at half their life if shorter;
  // used until kStaleBefore before expiry (a quarter of their life if shorter) while a refresh
  // is under way or has failed.
  static constexpr std::chrono::seconds kRefreshBefore{300};
  static constexpr std::chrono::seconds kStaleBefore{60};

  static std::shared_ptr<AwsCredentialSource> Fixed(AwsCredentials credentials);
  // `name` says where they come from ("EC2 instance metadata"); the first fetch happens in Get.
  static std::shared_ptr<AwsCredentialSource> Refreshing(std::string name, Fetch fetch);

  // The current credentials. A refresh is due: one caller fetches while the others go on with
  // the old ones until they are stale; a failed refresh keeps them (and says so) until then,
  // trying again every 10 s; after that the error is the caller's.
  Expected<AwsCredentials> Get() WFS_EXCLUDES(mu_);
  // The server said the token expired (a clock off, a revoked session): fetch on the next Get.
  void Invalidate() WFS_EXCLUDES(mu_);
  bool refreshable() const { return static_cast<bool>(fetch_); }
  const std::string& name() const { return name_; }
  uint64_t fetches() const WFS_EXCLUDES(mu_);

 private:
  AwsCredentialSource(std::string name, Fetch fetch) : name_(std::move(name)), fetch_(std::move(fetch)) {}

  const std::string name_;
  const Fetch fetch_;  // empty: fixed
  mutable Mutex mu_;
  CondVar cv_;
  std::optional<AwsCredentials> current_ WFS_GUARDED_BY(mu_);
  std::chrono::system_clock::time_point refresh_at_ WFS_GUARDED_BY(mu_);
  std::chrono::system_clock::time_point stale_at_ WFS_GUARDED_BY(mu_);
  std::chrono::system_clock::time_point retry_at_ WFS_GUARDED_BY(mu_);
  bool fetching_ WFS_GUARDED_BY(mu_) = false;
  uint64_t fetches_ WFS_GUARDED_BY(mu_) = 0;
};

struct AwsChainOptions {
  AwsEnvLookup env;  // empty: the process environment
  // The resolved region (for STS): the caller's --region, else LoadAwsSettings' region.
  std::string region;
  // The settings files, when the caller has read them already (else they are read here).
  const AwsConfigFiles* files = nullptr;
};

struct AwsChainResult {
  std::shared_ptr<AwsCredentialSource> source;  // null: nothing in the chain had credentials
  // What was looked at, for the "no credentials" message: "the environment (AWS_ACCESS_KEY_ID),
  // profile 'default' in ~/.aws/credentials and ~/.aws/config, ...".
  std::string looked_at;
};

// Walks the chain. The first provider found is fetched once here, so that a wrong role, an
// unreachable endpoint or a bad token file is said when the store opens, not at its first read.
// Errors (InvalidArgument, Auth, IOError) for a provider that is configured and fails; a
// provider that is absent (no variable, no file, no instance metadata answering) is skipped.
Expected<AwsChainResult> ResolveAwsCredentialChain(const AwsChainOptions& options);

// "2026-12-06T03:00:00Z", with or without fractional seconds, or with a "+00:00" offset.
// Exposed for tests.
std::optional<std::chrono::system_clock::time_point> ParseAwsTime(std::string_view text);

}  // namespace weightfs
