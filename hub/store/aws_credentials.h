// AwsCredentials and the lookup of credentials and region the way the AWS CLI and SDKs do it,
// for the S3 store.
//
// Credentials, first match wins:
//   1. AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (+ AWS_SESSION_TOKEN) in the environment;
//   2. profile AWS_PROFILE (default "default") of the shared credentials file
//      (AWS_SHARED_CREDENTIALS_FILE, default ~/.aws/credentials): section "[name]";
//   3. the same profile in the config file (AWS_CONFIG_FILE, default ~/.aws/config):
//      section "[profile name]" ("[default]" for the default profile);
//   4. none: requests go unsigned (anonymous), which public buckets and test servers accept.
// Region: AWS_REGION, AWS_DEFAULT_REGION, the profile's `region` in the config file, else
// us-east-1.
//
// These are the steps that need no network and no process. The whole chain (instance metadata,
// container endpoints, STS web identity and assume-role, credential_process), with refresh
// before expiry, is hub/store/aws_credential_chain.h; S3 stores use that. A profile that only has
// such settings counts as absent here.
//
// The INI reader follows the CLI's tolerance: blank lines, full-line `#`/`;` comments, inline
// comments after whitespace, spaces around `=` and inside brackets, case-insensitive keys,
// indented sub-settings (e.g. `s3 =` blocks) skipped.
//
// Secrets never leave these structs through messages: errors name files, profiles and
// settings, never values. All functions are thread-safe (they read the environment through the
// given lookup and files they open themselves).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace weightfs {

struct AwsCredentials {
  std::string access_key_id;
  std::string secret_access_key;
  std::string session_token;  // empty: long-term credentials
  // Where they came from, for messages: "environment", "profile 'x' in /home/u/.aws/credentials".
  std::string source;
  // When temporary credentials stop working; nullopt: long-term keys.
  std::optional<std::chrono::system_clock::time_point> expiration;
};

// Reads one environment variable; nullopt when unset. Tests pass a map-backed lookup.
using AwsEnvLookup = std::function<std::optional<std::string>(std::string_view name)>;

// The process environment (getenv).
AwsEnvLookup ProcessAwsEnv();

struct AwsSettings {
  std::optional<AwsCredentials> credentials;  // nullopt: anonymous
  std::string region;                         // never empty
  std::string profile;                        // the profile consulted
};

// Resolves credentials and region as described above. Errors (InvalidArgument) only for a
// configuration the user must fix: AWS_ACCESS_KEY_ID without AWS_SECRET_ACCESS_KEY (or the
// reverse), a profile with a key id but no secret, an explicitly named AWS_PROFILE found in
// neither file, an unreadable file that exists.
Expected<AwsSettings> LoadAwsSettings(const AwsEnvLookup& env = ProcessAwsEnv());
struct AwsConfigFiles;
// The same from settings files read already (LoadAwsConfigFiles).
Expected<AwsSettings> LoadAwsSettings(const AwsEnvLookup& env, const AwsConfigFiles& files);

// One INI file as the AWS tools read it: section -> key (lower-cased) -> value.
// Exposed for tests.
struct AwsIniSection {
  std::string name;  // as written between the brackets, trimmed ("profile x", "default")
  std::vector<std::pair<std::string, std::string>> values;
  const std::string* Find(std::string_view key) const;
};
std::vector<AwsIniSection> ParseAwsIni(std::string_view text);

// The two settings files, read once (a missing file is empty; an unreadable one an error).
struct AwsConfigFiles {
  std::string credentials_path;  // AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials ("": no HOME)
  std::string config_path;       // AWS_CONFIG_FILE, else ~/.aws/config
  std::vector<AwsIniSection> credentials, config;
  const AwsIniSection* CredentialsProfile(const std::string& profile) const;  // [profile]
  const AwsIniSection* ConfigProfile(const std::string& profile) const;       // [profile p] / [default]
  // A setting of the profile: the config file's section, else the credentials file's.
  const std::string* Setting(const std::string& profile, std::string_view key) const;
};
Expected<AwsConfigFiles> LoadAwsConfigFiles(const AwsEnvLookup& env);

// The first of `names` set to a non-empty value.
std::optional<std::string> AwsEnvValue(const AwsEnvLookup& env, std::string_view name);

// Static keys, as every reader of them takes them (LoadAwsSettings and the credential chain):
// nullopt when none are set; InvalidArgument for a key id without its secret (or the reverse)
// or a value that cannot go into a request header.
// - of a profile's INI section (aws_access_key_id, aws_secret_access_key, aws_session_token or
//   its boto2-era name aws_security_token); `where` names it and becomes the source;
Expected<std::optional<AwsCredentials>> AwsKeysOf(const AwsIniSection& section, const std::string& where);
// - of the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN).
Expected<std::optional<AwsCredentials>> AwsKeysFromEnvironment(const AwsEnvLookup& env);
// InvalidArgument when the key id or the session token holds a space or a control character
// (they go into the Authorization and X-Amz-Security-Token headers as they are).
Status CheckAwsCredentialsHeaderSafe(const AwsCredentials& c);

}  // namespace weightfs
