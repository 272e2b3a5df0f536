#include "hub/store/aws_credentials.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/ascii.h"

namespace weightfs {
namespace {

constexpr const char* kDefaultRegion = "us-east-1";
constexpr size_t kMaxIniBytes = 1 << 20;  // a credentials file is a few hundred bytes

// Values go into HTTP headers (key id, session token): no control characters, no spaces.
bool IsHeaderSafeToken(std::string_view v) {
  for (char c : v) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return false;
  }
  return true;
}

std::optional<std::string> NonEmpty(const AwsEnvLookup& env, std::string_view name) {
  auto v = env(name);
  if (!v || v->empty()) return std::nullopt;
  return v;
}

std::string ExpandHome(const std::string& path, const std::optional<std::string>& home) {
  if (home && (path == "~" || path.rfind("~/", 0) == 0)) return *home + path.substr(1);
  return path;
}

// The file's text; nullopt when it does not exist; an error when it exists but cannot be read.
Expected<std::optional<std::string>> ReadIfExists(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) return std::optional<std::string>();
    return Status::InvalidArgument("cannot read AWS settings file " + path + ": " +
                                   std::strerror(errno));
  }
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      const int err = errno;
      ::close(fd);
      return Status::InvalidArgument("cannot read AWS settings file " + path + ": " +
                                     std::strerror(err));
    }
    if (r == 0) break;
    text.append(buf, static_cast<size_t>(r));
    if (text.size() > kMaxIniBytes) {
      ::close(fd);
      return Status::InvalidArgument("AWS settings file " + path + " is larger than 1 MiB");
    }
  }
  ::close(fd);
  return std::optional<std::string>(std::move(text));
}

const AwsIniSection* FindSection(const std::vector<AwsIniSection>& sections, std::string_view name) {
  const AwsIniSection* found = nullptr;
  for (const auto& s : sections) {
    if (s.name == name) found = &s;  // the last one wins, as later settings override earlier
  }
  return found;
}

// "[profile x]" in the config file; "[default]" (or "[profile default]") for the default.
const AwsIniSection* FindConfigProfile(const std::vector<AwsIniSection>& sections,
                                       const std::string& profile) {
  const AwsIniSection* found = nullptr;
  for (const auto& s : sections) {
    std::string_view n = s.name;
    if (n.rfind("profile", 0) == 0 && n.size() > 7 && (n[7] == ' ' || n[7] == '\t')) {
      if (TrimAsciiSpace(n.substr(8)) == profile) found = &s;
    } else if (profile == "default" && n == "default") {
      found = &s;
    }
  }
  return found;
}

}  // namespace

const std::string* AwsIniSection::Find(std::string_view key) const {
  const std::string* found = nullptr;
  for (const auto& [k, v] : values) {
    if (k == key) found = &v;
  }
  return found;
}

std::vector<AwsIniSection> ParseAwsIni(std::string_view text) {
  std::vector<AwsIniSection> sections;
  bool in_nested = false;  // inside an indented block under a key with an empty value
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    const std::string_view raw = text.substr(pos, eol - pos);
    pos = eol + 1;
    const std::string_view line = TrimAsciiSpace(raw);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    const bool indented = raw[0] == ' ' || raw[0] == '\t';
    if (line[0] == '[') {
      in_nested = false;
      const size_t close = line.find(']');
      if (close == std::string_view::npos) continue;  // malformed header: ignore the line
      sections.push_back(AwsIniSection{std::string(TrimAsciiSpace(line.substr(1, close - 1))), {}});
      continue;
    }
    if (sections.empty()) continue;  // settings before any section belong to nothing
    if (indented && in_nested) continue;
    const size_t eq = line.find('=');
    if (eq == std::string_view::npos) continue;
    const std::string key = AsciiLower(TrimAsciiSpace(line.substr(0, eq)));
    std::string_view value = TrimAsciiSpace(line.substr(eq + 1));
    // An inline comment starts at '#' or ';' preceded by whitespace (secrets never contain
    // whitespace, so this cannot cut one).
    for (size_t i = 1; i < value.size(); ++i) {
      if ((value[i] == '#' || value[i] == ';') && (value[i - 1] == ' ' || value[i - 1] == '\t')) {
        value = TrimAsciiSpace(value.substr(0, i));
        break;
      }
    }
    if (key.empty()) continue;
    in_nested = value.empty();
    if (in_nested) continue;  // "s3 =" opens a block of sub-settings we do not use
    sections.back().values.emplace_back(key, std::string(value));
  }
  return sections;
}

AwsEnvLookup ProcessAwsEnv() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

const AwsIniSection* AwsConfigFiles::CredentialsProfile(const std::string& profile) const {
  return FindSection(credentials, profile);
}

const AwsIniSection* AwsConfigFiles::ConfigProfile(const std::string& profile) const {
  return FindConfigProfile(config, profile);
}

const std::string* AwsConfigFiles::Setting(const std::string& profile, std::string_view key) const {
  if (const AwsIniSection* s = ConfigProfile(profile); s && s->Find(key)) return s->Find(key);
  if (const AwsIniSection* s = CredentialsProfile(profile); s && s->Find(key)) return s->Find(key);
  return nullptr;
}

std::optional<std::string> AwsEnvValue(const AwsEnvLookup& env, std::string_view name) { return NonEmpty(env, name); }

Expected<std::optional<AwsCredentials>> AwsKeysOf(const AwsIniSection& section, const std::string& where) {
  const std::string* id = section.Find("aws_access_key_id");
  const std::string* secret = section.Find("aws_secret_access_key");
  const std::string* token = section.Find("aws_session_token");
  if (!token) token = section.Find("aws_security_token");  // the boto2-era name, still accepted
  const bool has_id = id && !id->empty();
  const bool has_secret = secret && !secret->empty();
  if (!has_id && !has_secret) return std::optional<AwsCredentials>();
  if (has_id != has_secret) {
    return Status::InvalidArgument(where + " sets " +
                                   (has_id ? "aws_access_key_id but not aws_secret_access_key"
                                           : "aws_secret_access_key but not aws_access_key_id"));
  }
  AwsCredentials c;
  c.access_key_id = *id;
  c.secret_access_key = *secret;
  if (token) c.session_token = *token;
  c.source = where;
  WFS_TRY(CheckAwsCredentialsHeaderSafe(c));
  return std::optional<AwsCredentials>(std::move(c));
}

Expected<std::optional<AwsCredentials>> AwsKeysFromEnvironment(const AwsEnvLookup& env) {
  const auto id = NonEmpty(env, "AWS_ACCESS_KEY_ID");
  const auto secret = NonEmpty(env, "AWS_SECRET_ACCESS_KEY");
  if (id.has_value() != secret.has_value()) {
    return Status::InvalidArgument(
        id ? "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not; set both or neither"
           : "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not; set both or neither");
  }
  if (!id) return std::optional<AwsCredentials>();
  AwsCredentials c;
  c.access_key_id = *id;
  c.secret_access_key = *secret;
  c.session_token = NonEmpty(env, "AWS_SESSION_TOKEN").value_or("");
  c.source = "environment (AWS_ACCESS_KEY_ID)";
  WFS_TRY(CheckAwsCredentialsHeaderSafe(c));
  return std::optional<AwsCredentials>(std::move(c));
}

Status CheckAwsCredentialsHeaderSafe(const AwsCredentials& c) {
  if (!IsHeaderSafeToken(c.access_key_id)) {
    return Status::InvalidArgument("the AWS access key id from " + c.source +
                                   " contains spaces or control characters");
  }
  if (!IsHeaderSafeToken(c.session_token)) {
    return Status::InvalidArgument("the AWS session token from " + c.source +
                                   " contains spaces or control characters");
  }
  return Status::Ok();
}

Expected<AwsConfigFiles> LoadAwsConfigFiles(const AwsEnvLookup& env) {
  AwsConfigFiles out;
  const std::optional<std::string> home = NonEmpty(env, "HOME");
  if (auto p = NonEmpty(env, "AWS_SHARED_CREDENTIALS_FILE")) out.credentials_path = ExpandHome(*p, home);
  else if (home) out.credentials_path = *home + "/.aws/credentials";
  if (auto p = NonEmpty(env, "AWS_CONFIG_FILE")) out.config_path = ExpandHome(*p, home);
  else if (home) out.config_path = *home + "/.aws/config";
  if (!out.credentials_path.empty()) {
    WFS_ASSIGN_OR_RETURN(auto text, ReadIfExists(out.credentials_path));
    if (text) out.credentials = ParseAwsIni(*text);
  }
  if (!out.config_path.empty()) {
    WFS_ASSIGN_OR_RETURN(auto text, ReadIfExists(out.config_path));
    if (text) out.config = ParseAwsIni(*text);
  }
  return out;
}

Expected<AwsSettings> LoadAwsSettings(const AwsEnvLookup& env) {
  WFS_ASSIGN_OR_RETURN(AwsConfigFiles files, LoadAwsConfigFiles(env));
  return LoadAwsSettings(env, files);
}

Expected<AwsSettings> LoadAwsSettings(const AwsEnvLookup& env, const AwsConfigFiles& files) {
  AwsSettings out;
  const std::optional<std::string> env_profile = NonEmpty(env, "AWS_PROFILE");
  out.profile = env_profile.value_or("default");
  const std::string& cred_path = files.credentials_path;
  const std::string& config_path = files.config_path;
  const AwsIniSection* cred_section = files.CredentialsProfile(out.profile);
  const AwsIniSection* config_section = files.ConfigProfile(out.profile);

  // 1. The environment.
  WFS_ASSIGN_OR_RETURN(out.credentials, AwsKeysFromEnvironment(env));
  // 2. and 3. The profile in the credentials file, then in the config file.
  if (!out.credentials && cred_section) {
    WFS_ASSIGN_OR_RETURN(out.credentials,
                         AwsKeysOf(*cred_section, "profile '" + out.profile + "' in " + cred_path));
  }
  if (!out.credentials && config_section) {
    WFS_ASSIGN_OR_RETURN(out.credentials,
                         AwsKeysOf(*config_section, "profile '" + out.profile + "' in " + config_path));
  }
  if (!out.credentials && env_profile && !cred_section && !config_section) {
    return Status::InvalidArgument(
        "AWS_PROFILE=" + out.profile + " names a profile found neither as [" + out.profile +
        "] in " + (cred_path.empty() ? "the credentials file (HOME is not set)" : cred_path) +
        " nor as [profile " + out.profile + "] in " +
        (config_path.empty() ? "the config file" : config_path));
  }
  if (!out.credentials) {
    spdlog::debug(
        "no AWS keys in the environment or in profile '{}' of {} and {}",
        out.profile, cred_path.empty() ? "<no HOME>" : cred_path,
        config_path.empty() ? "<no HOME>" : config_path);
  }

  // Region.
  if (auto r = NonEmpty(env, "AWS_REGION")) out.region = *r;
  else if (auto d = NonEmpty(env, "AWS_DEFAULT_REGION")) out.region = *d;
  else if (config_section && config_section->Find("region") && !config_section->Find("region")->empty()) {
    out.region = *config_section->Find("region");
  } else {
    out.region = kDefaultRegion;
  }
  return out;
}

}  // namespace weightfs
