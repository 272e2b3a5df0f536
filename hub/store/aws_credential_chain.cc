#include "hub/store/aws_credential_chain.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/hash.h"
#include "core/manifest.h"
#include "hub/store/http_client.h"
#include "hub/store/s3_signer.h"
#include "hub/store/s3_store.h"

namespace weightfs {

using SysClock = std::chrono::system_clock;

std::optional<SysClock::time_point> ParseAwsTime(std::string_view text) {
  const Expected<int64_t> ms = ParseUtc(text, UtcForm::kAnyOffset);
  if (!ms.ok()) return std::nullopt;
  return SysClock::time_point(std::chrono::seconds(*ms / 1000));  // (whole seconds, as AWS sends)
}

// ---- the source ---------------------------------------------------------------------------------

std::shared_ptr<AwsCredentialSource> AwsCredentialSource::Fixed(AwsCredentials credentials) {
  std::shared_ptr<AwsCredentialSource> s(new AwsCredentialSource(credentials.source, nullptr));
  MutexLock lock(s->mu_);
  s->current_ = std::move(credentials);
  return s;
}

std::shared_ptr<AwsCredentialSource> AwsCredentialSource::Refreshing(std::string name, Fetch fetch) {
  return std::shared_ptr<AwsCredentialSource>(new AwsCredentialSource(std::move(name), std::move(fetch)));
}

uint64_t AwsCredentialSource::fetches() const {
  MutexLock lock(mu_);
  return fetches_;
}

void AwsCredentialSource::Invalidate() {
  if (!fetch_) return;
  MutexLock lock(mu_);
  refresh_at_ = stale_at_ = retry_at_ = {};
}

Expected<AwsCredentials> AwsCredentialSource::Get() {
  MutexLock lock(mu_);
  for (;;) {
    const auto now = SysClock::now();
    if (current_ && (!fetch_ || now < refresh_at_)) return *current_;
    const bool usable = current_ && now < stale_at_;
    if (usable && (fetching_ || now < retry_at_)) return *current_;  // being refreshed, or failed a moment ago
    if (!fetching_) break;
    cv_.Wait(mu_);  // nothing usable: wait for the fetch under way
  }
  fetching_ = true;
  lock.Unlock();
  Expected<AwsCredentials> got = fetch_();
  lock.Lock();
  fetching_ = false;
  ++fetches_;
  cv_.NotifyAll();
  const auto now = SysClock::now();
  if (got.ok()) {
    AwsCredentials c = std::move(got).value();
    if (c.expiration) {
      const auto life = *c.expiration - now;
      refresh_at_ = *c.expiration - std::min<SysClock::duration>(kRefreshBefore, life / 2);
      stale_at_ = *c.expiration - std::min<SysClock::duration>(kStaleBefore, life / 4);
      spdlog::debug("AWS credentials from {}: valid for {} s; refreshed in {} s", name_,
                    std::chrono::duration_cast<std::chrono::seconds>(life).count(),
                    std::chrono::duration_cast<std::chrono::seconds>(refresh_at_ - now).count());
    } else {
      refresh_at_ = stale_at_ = SysClock::time_point::max();
    }
    current_ = std::move(c);
    return *current_;
  }
  if (current_ && now < stale_at_) {
    retry_at_ = now + std::chrono::seconds(10);
    spdlog::warn("refreshing the AWS credentials from {} failed ({}); the current ones are used for {} s more, "
                 "trying again in 10 s", name_, got.status().ToString(),
                 std::chrono::duration_cast<std::chrono::seconds>(stale_at_ - now).count());
    return *current_;
  }
  return got.status().WithContext("getting AWS credentials from " + name_);
}

namespace {

constexpr size_t kMaxCredentialDocument = 64 << 10;

std::string Text(const std::vector<uint8_t>& body) { return std::string(body.begin(), body.end()); }

// A short, secret-free description of a failed answer: its status and, for errors, the server's
// code and message (never a credential document).
std::string Answer(const HttpResponse& r) {
  std::string out = "HTTP " + std::to_string(r.status);
  if (r.status >= 200 && r.status < 300) return out;
  const std::string body = Text(r.body).substr(0, 2000);
  if (Expected<s3::XmlElement> x = s3::ParseXml(body); x.ok()) {
    const s3::XmlElement* e = x->name == "Error" ? &*x : x->Child("Error");
    if (e) return out + " " + e->ChildText("Code") + ": " + e->ChildText("Message").substr(0, 300);
  }
  return out;
}

// Credentials a provider handed out: both keys, header-safe (Corruption: the provider's fault).
Status CheckToken(const AwsCredentials& c) {
  if (c.access_key_id.empty() || c.secret_access_key.empty()) {
    return Status::Corruption("the credentials from " + c.source + " lack an access key id or a secret");
  }
  if (Status st = CheckAwsCredentialsHeaderSafe(c); !st.ok()) return Status::Corruption(st.message());
  return Status::Ok();
}

// The JSON document instance metadata, container endpoints and credential_process give.
Expected<AwsCredentials> CredentialsFromJson(std::string_view text, const std::string& source, const char* token_key) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return Status::Corruption(source + " answered with something that is not a JSON object");
  auto str = [&](const char* k) { return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string(); };
  if (j.contains("Code") && str("Code") != "Success") {
    return Status::Auth(source + " answered Code " + str("Code").substr(0, 100) + ": " + str("Message").substr(0, 300));
  }
  AwsCredentials c;
  c.access_key_id = str("AccessKeyId");
  c.secret_access_key = str("SecretAccessKey");
  c.session_token = str(token_key);
  c.source = source;
  if (const std::string e = str("Expiration"); !e.empty()) {
    c.expiration = ParseAwsTime(e);
    if (!c.expiration) return Status::Corruption(source + " gave an Expiration that is not a time: " + e.substr(0, 40));
  }
  WFS_TRY(CheckToken(c));
  return c;
}

Expected<std::string> ReadSmallFile(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::InvalidArgument("cannot read " + what + " " + path + ": " + std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  if (s.empty()) return Status::InvalidArgument(what + " " + path + " is empty");
  return s;
}

// ---- EC2 instance metadata (IMDSv2) -------------------------------------------------------------

struct Imds {
  std::string endpoint;  // "http://169.254.169.254"
  bool v1_allowed = true;
  std::shared_ptr<HttpClient> http;
};

// NotFound: nothing answers there, or the instance has no role (the chain goes on).
Expected<AwsCredentials> FetchImds(const Imds& imds) {
  const std::string where = "EC2 instance metadata at " + imds.endpoint;
  HttpRequest put;
  put.method = "PUT";
  put.url = imds.endpoint + "/latest/api/token";
  put.headers = {{"X-aws-ec2-metadata-token-ttl-seconds", "21600"}};
  put.max_response_bytes = 4096;
  Expected<HttpResponse> token = imds.http->Send(put);
  if (!token.ok()) return Status::NotFound("no answer from " + where + " (" + token.status().message() + ")");
  HttpHeaders auth;
  if (token->status == 200) {
    auth = {{"X-aws-ec2-metadata-token", Text(token->body)}};
  } else if ((token->status == 403 || token->status == 404 || token->status == 405) && imds.v1_allowed) {
    spdlog::debug("{}: no IMDSv2 session token ({}); IMDSv1", where, Answer(*token));
  } else {
    return Status::Auth(where + " refused a session token: " + Answer(*token) +
                        (imds.v1_allowed ? "" : " (AWS_EC2_METADATA_V1_DISABLED is set)"));
  }
  auto get = [&](const std::string& path) -> Expected<HttpResponse> {
    HttpRequest r;
    r.url = imds.endpoint + path;
    r.headers = auth;
    r.sensitive_headers = {"X-aws-ec2-metadata-token"};
    r.max_response_bytes = kMaxCredentialDocument;
    return imds.http->Send(r);
  };
  const std::string base = "/latest/meta-data/iam/security-credentials/";
  WFS_ASSIGN_OR_RETURN(HttpResponse roles, get(base));
  if (roles.status == 404) return Status::NotFound(where + " answers, but the instance has no IAM role attached");
  if (roles.status != 200) return Status::Auth(where + ": listing the instance's role: " + Answer(roles));
  std::string role = Text(roles.body);
  role = role.substr(0, role.find('\n'));
  if (role.empty() || role.find_first_of("/?# ") != std::string::npos) {
    return Status::Corruption(where + " named no usable role ('" + role.substr(0, 64) + "')");
  }
  WFS_ASSIGN_OR_RETURN(HttpResponse doc, get(base + role));
  if (doc.status != 200) return Status::Auth(where + ": the credentials of role " + role + ": " + Answer(doc));
  return CredentialsFromJson(Text(doc.body), "EC2 instance metadata (role " + role + ")", "Token");
}

// ---- container endpoints (ECS, EKS pod identity) ------------------------------------------------

struct Container {
  std::string url;
  std::string token;       // AWS_CONTAINER_AUTHORIZATION_TOKEN
  std::string token_file;  // AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE (read at every fetch)
  std::shared_ptr<HttpClient> http;
};

bool AllowedContainerUrl(const std::string& url) {
  if (url.starts_with("https://")) return true;
  if (!url.starts_with("http://")) return false;
  std::string host = url.substr(7, url.find('/', 7) == std::string::npos ? std::string::npos : url.find('/', 7) - 7);
  if (host.starts_with("[")) host = host.substr(1, host.find(']') - 1);
  else host = host.substr(0, host.rfind(':') == std::string::npos ? host.size() : host.rfind(':'));
  return host == "localhost" || host.starts_with("127.") || host == "::1" || host == "169.254.170.2" ||
         host == "169.254.170.23" || host == "fd00:ec2::23";
}

Expected<AwsCredentials> FetchContainer(const Container& c) {
  const std::string where = "the container credentials endpoint " + c.url.substr(0, c.url.find('?'));
  HttpRequest r;
  r.url = c.url;
  r.max_response_bytes = kMaxCredentialDocument;
  std::string token = c.token;
  if (!c.token_file.empty()) {
    WFS_ASSIGN_OR_RETURN(token, ReadSmallFile(c.token_file, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"));
  }
  if (!token.empty()) r.headers = {{"Authorization", token}};
  WFS_ASSIGN_OR_RETURN(HttpResponse doc, c.http->Send(r));
  if (doc.status != 200) return Status::Auth(where + ": " + Answer(doc));
  return CredentialsFromJson(Text(doc.body), "the container credentials endpoint", "Token");
}

// ---- STS ----------------------------------------------------------------------------------------

struct Sts {
  std::string endpoint;  // "https://sts.us-east-1.amazonaws.com"
  std::string region;
  std::shared_ptr<HttpClient> http;
};

std::string FormValue(std::string_view v) { return AwsUriEncode(v, false); }

Expected<AwsCredentials> StsCall(const Sts& sts, const std::string& action, const std::string& form,
                                 const std::shared_ptr<AwsCredentialSource>& signer, const std::string& source) {
  const std::string body = "Action=" + action + "&Version=2011-06-15&" + form;
  HttpRequest r;
  r.method = "POST";
  r.url = sts.endpoint + "/";
  r.headers = {{"Content-Type", "application/x-www-form-urlencoded; charset=utf-8"}};
  r.body = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(body.data()), body.size());
  r.max_response_bytes = kMaxCredentialDocument;
  r.idempotent = true;  // asking for a session twice makes two sessions: harmless
  if (signer) {
    WFS_ASSIGN_OR_RETURN(AwsCredentials base, signer->Get());
    r.sign = [s = std::make_shared<SigV4Signer>(base, sts.region, "sts"),
              sha = Sha256Hex(r.body)](HttpRequest& req) { s->Sign(req, sha, SysClock::now()); };
  }
  const std::string what = "STS " + action + " at " + sts.endpoint;
  WFS_ASSIGN_OR_RETURN(HttpResponse resp, sts.http->Send(std::move(r)));
  if (resp.status != 200) return Status::Auth(what + ": " + Answer(resp));
  Expected<s3::XmlElement> x = s3::ParseXml(Text(resp.body));
  if (!x.ok()) return Status::Corruption(what + " answered XML that does not parse: " + x.status().message());
  const s3::XmlElement* result = x->Child(action + "Result");
  const s3::XmlElement* cred = result ? result->Child("Credentials") : nullptr;
  if (!cred) return Status::Corruption(what + " answered without <Credentials>");
  AwsCredentials c;
  c.access_key_id = cred->ChildText("AccessKeyId");
  c.secret_access_key = cred->ChildText("SecretAccessKey");
  c.session_token = cred->ChildText("SessionToken");
  c.source = source;
  c.expiration = ParseAwsTime(cred->ChildText("Expiration"));
  if (!c.expiration) return Status::Corruption(what + " answered without a valid <Expiration>");
  WFS_TRY(CheckToken(c));
  return c;
}

struct Role {
  std::string arn;
  std::string session_name;
  std::string external_id;
  int duration_s = 3600;
};

std::string RoleForm(const Role& role) {
  std::string form = "RoleArn=" + FormValue(role.arn) + "&RoleSessionName=" + FormValue(role.session_name) +
                     "&DurationSeconds=" + std::to_string(role.duration_s);
  if (!role.external_id.empty()) form += "&ExternalId=" + FormValue(role.external_id);
  return form;
}

Expected<AwsCredentials> FetchWebIdentity(const Sts& sts, const Role& role, const std::string& token_file) {
  WFS_ASSIGN_OR_RETURN(std::string token, ReadSmallFile(token_file, "the web identity token file"));
  return StsCall(sts, "AssumeRoleWithWebIdentity", RoleForm(role) + "&WebIdentityToken=" + FormValue(token), nullptr,
                 "STS web identity (role " + role.arn + ")");
}

// ---- credential_process -------------------------------------------------------------------------

Expected<AwsCredentials> FetchProcess(const std::string& command, const std::string& profile) {
  const std::string source = "credential_process of profile '" + profile + "'";
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0) return StatusOfErrno(errno, "pipe");
  if (::pipe2(err, O_CLOEXEC) != 0) {
    ::close(out[0]);
    ::close(out[1]);
    return StatusOfErrno(errno, "pipe");
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
    return StatusOfErrno(errno, "fork");
  }
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(out[1]);
  ::close(err[1]);
  std::string stdout_text, stderr_text;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool timed_out = false;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open_fds = 2;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      timed_out = true;
      break;
    }
    const int n = ::poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t r = ::read(fds[i].fd, buf, sizeof buf);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      std::string& dst = i == 0 ? stdout_text : stderr_text;
      if (dst.size() < kMaxCredentialDocument) dst.append(buf, static_cast<size_t>(r));
    }
  }
  for (const pollfd& p : fds) {
    if (p.fd >= 0) ::close(p.fd);
  }
  if (timed_out) ::kill(pid, SIGKILL);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (timed_out) return Status::Timeout(source + " did not finish in 60 s");
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (!stderr_text.empty() && (stderr_text.back() == '\n' || stderr_text.back() == ' ')) stderr_text.pop_back();
    return Status::Auth(source + " failed (exit " + std::to_string(WIFEXITED(status) ? WEXITSTATUS(status) : -1) +
                        ")" + (stderr_text.empty() ? "" : ": " + stderr_text.substr(0, 300)));
  }
  const nlohmann::json j = nlohmann::json::parse(stdout_text, nullptr, false);
  if (!j.is_object() || j.value("Version", 0) != 1) {
    return Status::Corruption(source + " printed no JSON object with \"Version\": 1");
  }
  return CredentialsFromJson(stdout_text, source, "SessionToken");
}

// ---- the chain ----------------------------------------------------------------------------------

struct Chain {
  AwsEnvLookup env;
  AwsConfigFiles files;
  std::string region;
  std::shared_ptr<HttpClient> http;        // STS and container endpoints
  std::shared_ptr<HttpClient> imds_probe;  // one try, 1 s to connect: a machine outside EC2
  std::shared_ptr<HttpClient> imds_http;   // refreshes of credentials already found there

  std::optional<std::string> Env(std::string_view name) const { return AwsEnvValue(env, name); }
  const std::string* Setting(const std::string& profile, std::string_view key) const {
    const std::string* v = files.Setting(profile, key);
    return v && !v->empty() ? v : nullptr;
  }
  std::string Where(const std::string& profile) const {
    return "profile '" + profile + "' in " + (files.config_path.empty() ? "the config file" : files.config_path);
  }

  Imds ImdsConfig(bool probe) const {
    Imds i;
    i.endpoint = Env("AWS_EC2_METADATA_SERVICE_ENDPOINT").value_or("http://169.254.169.254");
    while (i.endpoint.ends_with("/")) i.endpoint.pop_back();
    i.v1_allowed = Env("AWS_EC2_METADATA_V1_DISABLED").value_or("false") != "true";
    i.http = probe ? imds_probe : imds_http;
    return i;
  }
  bool ImdsDisabled() const { return Env("AWS_EC2_METADATA_DISABLED").value_or("false") == "true"; }

  Sts StsConfig() const {
    Sts s;
    s.region = region;
    s.endpoint = Env("AWS_ENDPOINT_URL_STS")
                     .value_or("https://sts." + region + ".amazonaws.com" + (region.starts_with("cn-") ? ".cn" : ""));
    while (s.endpoint.ends_with("/")) s.endpoint.pop_back();
    s.http = http;
    return s;
  }

  std::string SessionName(const std::string* profile) const {
    if (profile) {
      if (const std::string* n = Setting(*profile, "role_session_name")) return *n;
    }
    if (auto n = Env("AWS_ROLE_SESSION_NAME")) return *n;
    return "weightfs-" + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            SysClock::now().time_since_epoch()).count());
  }

  std::shared_ptr<AwsCredentialSource> ImdsSource() const {
    const Imds imds = ImdsConfig(/*probe=*/false);
    return AwsCredentialSource::Refreshing("EC2 instance metadata", [imds] { return FetchImds(imds); });
  }

  Expected<std::shared_ptr<AwsCredentialSource>> ContainerSource() const {
    Container c;
    c.http = http;
    if (auto rel = Env("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")) {
      c.url = "http://169.254.170.2" + *rel;
    } else if (auto full = Env("AWS_CONTAINER_CREDENTIALS_FULL_URI")) {
      if (!AllowedContainerUrl(*full)) {
        return Status::InvalidArgument("AWS_CONTAINER_CREDENTIALS_FULL_URI must be https, or http to a loopback "
                                       "address or the ECS/EKS link-local one; it is " + full->substr(0, 100));
      }
      c.url = *full;
    } else {
      return std::shared_ptr<AwsCredentialSource>();
    }
    if (auto f = Env("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")) c.token_file = *f;
    else c.token = Env("AWS_CONTAINER_AUTHORIZATION_TOKEN").value_or("");
    return AwsCredentialSource::Refreshing("the container credentials endpoint", [c] { return FetchContainer(c); });
  }

  std::shared_ptr<AwsCredentialSource> WebIdentitySource(const Role& role, const std::string& token_file) const {
    const Sts sts = StsConfig();
    return AwsCredentialSource::Refreshing("STS web identity (role " + role.arn + ", token " + token_file + ")",
                                           [sts, role, token_file] { return FetchWebIdentity(sts, role, token_file); });
  }

  // Keys or credential_process of `profile` (no role): null when it has neither.
  Expected<std::shared_ptr<AwsCredentialSource>> ProfileKeysSource(const std::string& profile) const {
    for (const auto& [section, path] : {std::pair{files.CredentialsProfile(profile), files.credentials_path},
                                        std::pair{files.ConfigProfile(profile), files.config_path}}) {
      if (!section) continue;
      WFS_ASSIGN_OR_RETURN(std::optional<AwsCredentials> keys,
                           AwsKeysOf(*section, "profile '" + profile + "' in " + path));
      if (keys) return AwsCredentialSource::Fixed(std::move(*keys));
      if (section == files.CredentialsProfile(profile)) {
        if (const std::string* cmd = section->Find("credential_process"); cmd && !cmd->empty()) {
          return ProcessSource(*cmd, profile);
        }
      }
    }
    if (const std::string* cmd = Setting(profile, "credential_process")) return ProcessSource(*cmd, profile);
    return std::shared_ptr<AwsCredentialSource>();
  }

  std::shared_ptr<AwsCredentialSource> ProcessSource(const std::string& cmd, const std::string& profile) const {
    return AwsCredentialSource::Refreshing("credential_process of profile '" + profile + "'",
                                           [cmd, profile] { return FetchProcess(cmd, profile); });
  }

  Expected<std::shared_ptr<AwsCredentialSource>> EnvKeysSource() const {
    WFS_ASSIGN_OR_RETURN(std::optional<AwsCredentials> keys, AwsKeysFromEnvironment(env));
    if (!keys) return std::shared_ptr<AwsCredentialSource>();
    return AwsCredentialSource::Fixed(std::move(*keys));
  }

  // A profile with role_arn: AssumeRole (source_profile, credential_source) or web identity.
  Expected<std::shared_ptr<AwsCredentialSource>> RoleSource(const std::string& profile, int depth) const {
    if (depth > 5) return Status::InvalidArgument(Where(profile) + ": source_profile chains more than 5 roles (a loop?)");
    Role role;
    role.arn = *Setting(profile, "role_arn");
    role.session_name = SessionName(&profile);
    if (const std::string* e = Setting(profile, "external_id")) role.external_id = *e;
    if (const std::string* d = Setting(profile, "duration_seconds")) role.duration_s = std::max(900, std::atoi(d->c_str()));
    if (const std::string* f = Setting(profile, "web_identity_token_file")) return WebIdentitySource(role, *f);
    std::shared_ptr<AwsCredentialSource> base;
    if (const std::string* sp = Setting(profile, "source_profile")) {
      if (*sp != profile && Setting(*sp, "role_arn")) {
        WFS_ASSIGN_OR_RETURN(base, RoleSource(*sp, depth + 1));
      } else {
        if (!files.CredentialsProfile(*sp) && !files.ConfigProfile(*sp)) {
          return Status::InvalidArgument(Where(profile) + ": source_profile '" + *sp + "' is in neither AWS file");
        }
        WFS_ASSIGN_OR_RETURN(base, ProfileKeysSource(*sp));
        if (!base) return Status::InvalidArgument(Where(profile) + ": source_profile '" + *sp + "' has no keys");
      }
    } else if (const std::string* cs = Setting(profile, "credential_source")) {
      if (*cs == "Environment") {
        WFS_ASSIGN_OR_RETURN(base, EnvKeysSource());
      } else if (*cs == "Ec2InstanceMetadata") {
        base = ImdsSource();
      } else if (*cs == "EcsContainer") {
        WFS_ASSIGN_OR_RETURN(base, ContainerSource());
      } else {
        return Status::InvalidArgument(Where(profile) + ": credential_source " + *cs +
                                       " is none of Environment, Ec2InstanceMetadata, EcsContainer");
      }
      if (!base) return Status::InvalidArgument(Where(profile) + ": credential_source " + *cs + " has no credentials");
    } else {
      return Status::InvalidArgument(Where(profile) + " sets role_arn but none of source_profile, credential_source, "
                                     "web_identity_token_file");
    }
    const Sts sts = StsConfig();
    return AwsCredentialSource::Refreshing(
        "STS AssumeRole (role " + role.arn + ", from " + base->name() + ")",
        [sts, role, base] { return StsCall(sts, "AssumeRole", RoleForm(role), base, "STS AssumeRole (role " + role.arn + ")"); });
  }
};

// The first fetch, so that a configured provider that fails says so at open.
Expected<AwsChainResult> Found(std::shared_ptr<AwsCredentialSource> source, std::string looked_at) {
  WFS_TRY(source->Get().status());
  spdlog::debug("AWS credentials: {}", source->name());
  return AwsChainResult{std::move(source), std::move(looked_at)};
}

}  // namespace

Expected<AwsChainResult> ResolveAwsCredentialChain(const AwsChainOptions& options) {
  Chain chain;
  chain.env = options.env ? options.env : ProcessAwsEnv();
  chain.region = options.region.empty() ? "us-east-1" : options.region;
  if (options.files) {
    chain.files = *options.files;
  } else {
    WFS_ASSIGN_OR_RETURN(chain.files, LoadAwsConfigFiles(chain.env));
  }
  HttpOptions h;
  h.connect_timeout = std::chrono::seconds(3);
  h.stall_timeout = std::chrono::seconds(5);
  h.max_attempts = 3;
  h.total_timeout = std::chrono::seconds(20);
  h.max_connections = 2;
  chain.http = std::make_shared<HttpClient>(h);
  h.connect_timeout = std::chrono::seconds(1);
  h.request_timeout = std::chrono::seconds(2);
  h.total_timeout = std::chrono::seconds(6);
  chain.imds_http = std::make_shared<HttpClient>(h);
  h.max_attempts = 1;
  h.total_timeout = std::chrono::seconds(2);
  chain.imds_probe = std::make_shared<HttpClient>(h);

  const std::optional<std::string> named_profile = chain.Env("AWS_PROFILE");
  const std::string profile = named_profile.value_or("default");
  std::vector<std::string> looked;
  auto joined = [&] {
    std::string s;
    for (size_t i = 0; i < looked.size(); ++i) s += (i ? (i + 1 == looked.size() ? " and " : ", ") : "") + looked[i];
    return s;
  };

  // 1. The environment's keys.
  WFS_ASSIGN_OR_RETURN(std::shared_ptr<AwsCredentialSource> src, chain.EnvKeysSource());
  if (src) return AwsChainResult{src, ""};
  looked.push_back("the environment (AWS_ACCESS_KEY_ID)");
  // 2. A role profile.
  if (chain.Setting(profile, "role_arn")) {
    WFS_ASSIGN_OR_RETURN(src, chain.RoleSource(profile, 0));
    return Found(src, "");
  }
  // 3. EKS IRSA.
  if (auto token_file = chain.Env("AWS_WEB_IDENTITY_TOKEN_FILE")) {
    auto arn = chain.Env("AWS_ROLE_ARN");
    if (!arn) return Status::InvalidArgument("AWS_WEB_IDENTITY_TOKEN_FILE is set but AWS_ROLE_ARN is not; set both");
    Role role;
    role.arn = *arn;
    role.session_name = chain.SessionName(nullptr);
    return Found(chain.WebIdentitySource(role, *token_file), "");
  }
  looked.push_back("a web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)");
  // 4. SSO: not ours to log in.
  if (chain.Setting(profile, "sso_start_url") || chain.Setting(profile, "sso_session")) {
    return Status::InvalidArgument(
        chain.Where(profile) + " uses AWS SSO (IAM Identity Center), which weightfs does not log in to. Give it the "
        "SSO session's credentials instead: add `credential_process = aws configure export-credentials --profile " +
        profile + " --format process` to a profile and use that one (refreshed as they expire), or run "
        "`eval \"$(aws configure export-credentials --profile " + profile + " --format env)\"` before weightfs");
  }
  // 5. The profile's keys or process.
  WFS_ASSIGN_OR_RETURN(src, chain.ProfileKeysSource(profile));
  if (src) return src->refreshable() ? Found(src, "") : AwsChainResult{src, ""};
  looked.push_back("profile '" + profile + "' in " +
                   (chain.files.credentials_path.empty() ? "~/.aws/credentials (HOME is not set)" : chain.files.credentials_path) +
                   " and " + (chain.files.config_path.empty() ? "~/.aws/config" : chain.files.config_path));
  if (named_profile && !chain.files.CredentialsProfile(profile) && !chain.files.ConfigProfile(profile)) {
    return Status::InvalidArgument("AWS_PROFILE=" + profile + " names a profile found neither as [" + profile + "] in " +
                                   (chain.files.credentials_path.empty() ? "the credentials file (HOME is not set)"
                                                                         : chain.files.credentials_path) +
                                   " nor as [profile " + profile + "] in " +
                                   (chain.files.config_path.empty() ? "the config file" : chain.files.config_path));
  }
  // 6. The container endpoint.
  WFS_ASSIGN_OR_RETURN(src, chain.ContainerSource());
  if (src) return Found(src, "");
  looked.push_back("the container endpoint (AWS_CONTAINER_CREDENTIALS_RELATIVE_URI / _FULL_URI)");
  // 7. Instance metadata: absent is normal off EC2.
  if (chain.ImdsDisabled()) {
    looked.push_back("not EC2 instance metadata (AWS_EC2_METADATA_DISABLED=true)");
    return AwsChainResult{nullptr, joined()};
  }
  const Imds probe = chain.ImdsConfig(/*probe=*/true);
  Expected<AwsCredentials> first = FetchImds(probe);
  if (!first.ok() && first.status().kind() == ErrorKind::kNotFound) {
    looked.push_back(first.status().message());
    return AwsChainResult{nullptr, joined()};
  }
  if (!first.ok()) return first.status();
  // Found: the probe's answer is the source's first credentials.
  auto fetched = std::make_shared<std::optional<AwsCredentials>>(std::move(first).value());
  const Imds imds = chain.ImdsConfig(/*probe=*/false);
  src = AwsCredentialSource::Refreshing("EC2 instance metadata", [imds, fetched]() -> Expected<AwsCredentials> {
    if (*fetched) {  // (the first call only)
      AwsCredentials c = std::move(**fetched);
      fetched->reset();
      return c;
    }
    return FetchImds(imds);
  });
  return Found(src, "");
}

}  // namespace weightfs
