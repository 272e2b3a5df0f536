// Real servers for the remote-store tests, header-only so that any test binary can use them:
//
//   TempDir            a fresh directory under $TMPDIR (or /tmp), removed with its contents
//   FreeLoopbackPort   a TCP port on 127.0.0.1 that was free a moment ago
//   ChildProcess       a fork/exec'd helper that dies with the test (PR_SET_PDEATHSIG) and is
//                      stopped with SIGTERM, then SIGKILL, within a bounded wait
//   NginxServer        nginx with WebDAV (dav + dav-ext) on a loopback port, rooted in a TempDir
//   FaultProxy         tests/testing/fault_proxy.py in front of any HTTP server: injected 503s,
//                      stalls and resets, and a mode ("normal", "down", "stall", "reset", ...)
//                      a test can switch while it runs
//
// Start() methods return an AssertionResult naming what went wrong and how to fix it (a
// missing nginx means scripts/setup.sh was not run: the tests fail, they do not skip).
// Every wait is bounded; readiness is polled (a connect() or the proxy's "PORT n" line), never
// slept for. Not thread-safe: start and stop servers from the test's main thread (the
// death signal is tied to the thread that forked).
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace weightfs::test {

using namespace std::chrono_literals;

inline std::string ReadFileOrEmpty(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The last `max_lines` lines of a file, for failure messages.
inline std::string TailOfFile(const std::string& path, size_t max_lines = 15) {
  const std::string text = ReadFileOrEmpty(path);
  size_t pos = text.size();
  for (size_t lines = 0; pos > 0 && lines <= max_lines;) {
    --pos;
    if (text[pos] == '\n') ++lines;
  }
  return text.substr(pos);
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test") {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base != nullptr && *base != '\0' ? base : "/tmp") + "/wfs-" + tag + "-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    if (!path_.empty()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  bool ok() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  std::string Join(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// 0 if no port could be had. Another process may take the port before it is used: starters
// retry on EADDRINUSE.
inline int FreeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

// Whether 127.0.0.1:port accepts a TCP connection right now.
inline bool PortAccepts(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

// The first executable among `candidates` (absolute paths) and `name` in $PATH, or "".
inline std::string FindExecutable(const std::string& name, const std::vector<std::string>& candidates = {}) {
  for (const std::string& c : candidates) {
    if (!c.empty() && ::access(c.c_str(), X_OK) == 0) return c;
  }
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string full = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

class ChildProcess {
 public:
  ChildProcess() = default;
  ~ChildProcess() { Stop(); }
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  // Starts argv[0] (an absolute path) with stdout to a pipe (read with ReadLine) when
  // `pipe_stdout`, else to `output_file`; stderr to `output_file` or inherited when it is "".
  ::testing::AssertionResult Start(const std::vector<std::string>& argv, bool pipe_stdout,
                                   const std::string& output_file = "") {
    Stop();
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int out_fd = -1;
    if (!output_file.empty()) {
      out_fd = ::open(output_file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (out_fd < 0) return ::testing::AssertionFailure() << "open " << output_file << ": " << std::strerror(errno);
    }
    int pipe_fds[2] = {-1, -1};
    if (pipe_stdout && ::pipe2(pipe_fds, O_CLOEXEC) != 0) {
      if (out_fd >= 0) ::close(out_fd);
      return ::testing::AssertionFailure() << "pipe: " << std::strerror(errno);
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      if (out_fd >= 0) ::close(out_fd);
      if (pipe_stdout) {
        ::close(pipe_fds[0]);
        ::close(pipe_fds[1]);
      }
      return ::testing::AssertionFailure() << "fork: " << std::strerror(err);
    }
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(126);
      const int devnull = ::open("/dev/null", O_RDONLY);
      if (devnull >= 0) ::dup2(devnull, 0);
      if (pipe_stdout) ::dup2(pipe_fds[1], 1);
      else if (out_fd >= 0) ::dup2(out_fd, 1);
      if (out_fd >= 0) ::dup2(out_fd, 2);
      ::close_range(3, ~0U, 0);  // no test sockets or files leak into the server
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    pid_ = pid;
    if (out_fd >= 0) ::close(out_fd);
    if (pipe_stdout) {
      ::close(pipe_fds[1]);
      stdout_fd_ = pipe_fds[0];
    }
    return ::testing::AssertionSuccess();
  }

  // One line of the child's stdout (without '\n'), or nullopt at EOF or after `timeout`.
  std::optional<std::string> ReadLine(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (stdout_fd_ >= 0) {
      const size_t nl = buffer_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{stdout_fd_, POLLIN, 0};
      const int rc = ::poll(&p, 1, static_cast<int>(left.count()));
      if (rc < 0 && errno == EINTR) continue;
      if (rc <= 0) return std::nullopt;
      char chunk[512];
      const ssize_t n = ::read(stdout_fd_, chunk, sizeof(chunk));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<size_t>(n));
    }
    return std::nullopt;
  }

  // True (and reaps it) if the child has exited.
  bool Exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      pid_ = -1;
      return true;
    }
    return false;
  }

  // SIGTERM, then SIGKILL after `grace`; always reaps.
  void Stop(std::chrono::milliseconds grace = 5000ms) {
    if (stdout_fd_ >= 0) {
      ::close(stdout_fd_);
      stdout_fd_ = -1;
    }
    if (pid_ <= 0) return;
    ::kill(pid_, SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (!Exited()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        int status = 0;
        ::waitpid(pid_, &status, 0);
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(2ms);
    }
  }

  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  std::string buffer_;
};

// nginx serving a temporary directory over WebDAV on 127.0.0.1:<port()>. One worker process
// (master_process off), so MOVE with "Overwrite: F" is atomic (see hub/store/webdav_store.h).
class NginxServer {
 public:
  struct Options {
    bool create_full_put_path = true;
  };

  NginxServer() : NginxServer(Options{}) {}
  explicit NginxServer(Options options) : options_(options), dir_("nginx") {}
  ~NginxServer() { Stop(); }

  static std::string Binary() {
    const char* env = std::getenv("WEIGHTFS_NGINX");
    return FindExecutable("nginx", {env != nullptr ? env : "", "/usr/sbin/nginx"});
  }

  ::testing::AssertionResult Start() {
    const std::string binary = Binary();
    if (binary.empty()) {
      return ::testing::AssertionFailure()
             << "nginx is not installed (looked for $WEIGHTFS_NGINX, /usr/sbin/nginx and nginx in PATH); the WebDAV "
                "tests need it with the dav-ext module: run scripts/setup.sh (installs nginx-extras)";
    }
    if (!dir_.ok()) return ::testing::AssertionFailure() << "mkdtemp failed: " << std::strerror(errno);
    std::error_code ec;
    std::filesystem::create_directories(root(), ec);
    for (const char* d : {"client_body", "proxy", "fastcgi", "uwsgi", "scgi"}) {
      std::filesystem::create_directories(dir_.Join("tmp/") + d, ec);
    }
    std::string last_error;
    for (int tries = 0; tries < 5; ++tries) {
      port_ = FreeLoopbackPort();
      if (port_ == 0) return ::testing::AssertionFailure() << "no free loopback port";
      WriteConfig();
      bool port_taken = false;
      ::testing::AssertionResult r = Launch(binary, &port_taken, &last_error);
      if (r || !port_taken) return r;  // else the port was taken meanwhile: try another
    }
    return ::testing::AssertionFailure() << "nginx could not get a free port:\n" << last_error;
  }

  void Stop() { process_.Stop(); }

  // After Stop(): serves the same directory again on the same port (clients see the server
  // come back where it was). Retries for a few seconds if the port is still held.
  ::testing::AssertionResult Restart() {
    if (port_ == 0) return Start();
    process_.Stop();
    const std::string binary = Binary();
    const auto give_up = std::chrono::steady_clock::now() + 10s;
    std::string log;
    while (std::chrono::steady_clock::now() < give_up) {
      bool port_taken = false;
      ::testing::AssertionResult r = Launch(binary, &port_taken, &log);
      if (r || !port_taken) return r;
      std::this_thread::sleep_for(100ms);
    }
    return ::testing::AssertionFailure() << "nginx did not restart on 127.0.0.1:" << port_ << "; its log:\n" << log;
  }

  int port() const { return port_; }

 private:
  // Runs nginx on port_ (configured) and waits up to 10 s until it accepts. On failure it is
  // stopped, *log holds the tail of its logs and *port_taken says whether the port was in use.
  ::testing::AssertionResult Launch(const std::string& binary, bool* port_taken, std::string* log) {
    ::testing::AssertionResult started =
        process_.Start({binary, "-p", dir_.path(), "-c", dir_.Join("nginx.conf"), "-e", dir_.Join("error.log")},
                       /*pipe_stdout=*/false, dir_.Join("console.log"));
    if (!started) return started;
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (std::chrono::steady_clock::now() < deadline) {
      // Accepting, and still running a moment later: another process's listener that is
      // going away accepts too, while nginx fails to bind (it exits within milliseconds).
      if (PortAccepts(port_)) {
        std::this_thread::sleep_for(100ms);
        if (!process_.Exited() && PortAccepts(port_)) return ::testing::AssertionSuccess();
      }
      if (process_.Exited()) break;
      std::this_thread::sleep_for(5ms);
    }
    *log = TailOfFile(dir_.Join("error.log")) + TailOfFile(dir_.Join("console.log"));
    process_.Stop();
    *port_taken = log->find("Address already in use") != std::string::npos;
    return ::testing::AssertionFailure() << "nginx (" << binary << ") did not start on 127.0.0.1:" << port_
                                         << " within 10 s; its log:\n" << *log;
  }

 public:
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // The directory nginx serves: URL path /x is file root()/x.
  std::string root() const { return dir_.Join("root"); }
  // One line per request: "<connection> <request-on-connection> <method> <uri> <status>".
  std::string AccessLog() const { return ReadFileOrEmpty(dir_.Join("access.log")); }
  std::string ErrorLogTail() const { return TailOfFile(dir_.Join("error.log")); }

 private:
  static std::string DavExtModule() {
    for (const char* p : {"/usr/lib/nginx/modules/ngx_http_dav_ext_module.so",
                          "/usr/share/nginx/modules/ngx_http_dav_ext_module.so",
                          "/usr/lib64/nginx/modules/ngx_http_dav_ext_module.so"}) {
      if (::access(p, R_OK) == 0) return p;
    }
    return "";  // perhaps built in; nginx says so at start if not
  }

  void WriteConfig() const {
    const std::string d = dir_.path();
    std::ofstream c(dir_.Join("nginx.conf"), std::ios::trunc);
    const std::string module = DavExtModule();
    if (!module.empty()) c << "load_module " << module << ";\n";
    if (::geteuid() == 0) c << "user root;\n";
    c << "daemon off;\n"
         "master_process off;\n"
         "worker_processes 1;\n"
      << "pid " << d << "/nginx.pid;\n"
      << "error_log " << d << "/error.log info;\n"
      << "events { worker_connections 512; }\n"
         "http {\n"
         "  log_format wfs '$connection $connection_requests $request_method $uri $status';\n"
      << "  access_log " << d << "/access.log wfs;\n"
      << "  client_body_temp_path " << d << "/tmp/client_body;\n"
      << "  proxy_temp_path " << d << "/tmp/proxy;\n"
      << "  fastcgi_temp_path " << d << "/tmp/fastcgi;\n"
      << "  uwsgi_temp_path " << d << "/tmp/uwsgi;\n"
      << "  scgi_temp_path " << d << "/tmp/scgi;\n"
         "  keepalive_requests 100000;\n"
         "  server {\n"
      << "    listen 127.0.0.1:" << port_ << ";\n"
      << "    root " << root() << ";\n"
      << "    client_max_body_size 0;\n"
         "    location / {\n"
         "      dav_methods PUT DELETE MKCOL COPY MOVE;\n"
         "      dav_ext_methods PROPFIND OPTIONS;\n"
      << "      create_full_put_path " << (options_.create_full_put_path ? "on" : "off") << ";\n"
      << "      dav_access user:rw group:r all:r;\n"
         "    }\n"
         "  }\n"
         "}\n";
  }

  Options options_;
  TempDir dir_;
  ChildProcess process_;
  int port_ = 0;
};

// tests/testing/fault_proxy.py in front of `target` (see its --help). Python 3 comes from PATH.
class FaultProxy {
 public:
  struct Options {
    double error_rate = 0;
    double stall_rate = 0;
    double stall_seconds = 5;
    bool stall_in_body = false;  // send half the body, then stall (else stall before answering)
    double reset_rate = 0;
    std::optional<int> seed;
    std::optional<int> retry_after_s;
    std::vector<std::string> extra_args;
  };

  FaultProxy() : dir_("proxy") {}
  ~FaultProxy() { Stop(); }

  // The script: $WEIGHTFS_FAULT_PROXY, else fault_proxy.py next to this header.
  static std::string Script() {
    const char* env = std::getenv("WEIGHTFS_FAULT_PROXY");
    if (env != nullptr && *env != '\0') return env;
    return (std::filesystem::path(__FILE__).parent_path() / "fault_proxy.py").string();
  }

  ::testing::AssertionResult Start(const std::string& target) { return Start(target, Options()); }
  ::testing::AssertionResult Start(const std::string& target, const Options& o) {
    const std::string python = FindExecutable("python3");
    if (python.empty()) return ::testing::AssertionFailure() << "python3 not found; run scripts/setup.sh";
    const std::string script = Script();
    if (::access(script.c_str(), R_OK) != 0) {
      return ::testing::AssertionFailure() << "fault proxy script " << script
                                           << " not found (set WEIGHTFS_FAULT_PROXY to its path)";
    }
    if (!dir_.ok()) return ::testing::AssertionFailure() << "mkdtemp failed: " << std::strerror(errno);
    std::vector<std::string> argv = {python, "-u", script, "--listen-port", "0", "--target", target,
                                     "--error-rate", std::to_string(o.error_rate),
                                     "--stall-rate", std::to_string(o.stall_rate),
                                     "--stall-seconds", std::to_string(o.stall_seconds),
                                     "--stall-where", o.stall_in_body ? "body" : "before",
                                     "--reset-rate", std::to_string(o.reset_rate),
                                     "--mode-file", ModeFile()};
    if (o.seed) argv.insert(argv.end(), {"--seed", std::to_string(*o.seed)});
    if (o.retry_after_s) argv.insert(argv.end(), {"--retry-after", std::to_string(*o.retry_after_s)});
    argv.insert(argv.end(), o.extra_args.begin(), o.extra_args.end());
    ::testing::AssertionResult started = process_.Start(argv, /*pipe_stdout=*/true);
    if (!started) return started;
    const std::optional<std::string> line = process_.ReadLine(10s);
    if (!line || line->rfind("PORT ", 0) != 0) {
      process_.Stop();
      return ::testing::AssertionFailure() << "fault proxy did not report its port within 10 s (got '"
                                           << line.value_or("<nothing>") << "')";
    }
    port_ = std::atoi(line->c_str() + 5);
    return ::testing::AssertionSuccess();
  }

  void Stop() { process_.Stop(); }

  // "normal" | "down" | "stall" | "stall-before" | "stall-body" | "reset"; takes effect from
  // the next request.
  void SetMode(const std::string& mode) {
    const std::string tmp = ModeFile() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << mode << "\n";
    }
    std::filesystem::rename(tmp, ModeFile());
  }

  // The proxy's counters: requests, forwarded, errors, stalls, resets (empty if unreachable).
  std::map<std::string, uint64_t> Stats() const {
    std::map<std::string, uint64_t> out;
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return out;
    timeval tv{5, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    std::string response;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET /.fault-proxy/stats HTTP/1.0\r\nHost: proxy\r\n\r\n";
      if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
        char buf[4096];
        ssize_t n;
        while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, static_cast<size_t>(n));
      }
    }
    ::close(fd);
    const size_t body = response.find("\r\n\r\n");
    if (body == std::string::npos) return out;
    const auto json = nlohmann::json::parse(response.substr(body + 4), nullptr, /*allow_exceptions=*/false);
    if (!json.is_object()) return out;
    for (const auto& [k, v] : json.items()) {
      if (v.is_number_unsigned()) out[k] = v.get<uint64_t>();
    }
    return out;
  }

  int port() const { return port_; }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }

 private:
  std::string ModeFile() const { return dir_.Join("mode"); }

  TempDir dir_;
  ChildProcess process_;
  int port_ = 0;
};

// tests/testing/fake_hub.py: a local fake of the Hugging Face Hub (model repos from `repos_dir`,
// buckets backed by an S3 server, a second "CDN" listener on another host that records any
// Authorization header it gets). See the script's docstring for what it serves and simplifies.
//   FakeHub hub;
//   ASSERT_TRUE(hub.Start({.repos_dir = dir, .s3 = s3rver.endpoint(), .token = "hf_x"}));
//   HF_ENDPOINT = hub.endpoint(); ... hub.Stats()["bytes"]["org/repo/model.safetensors"]
class FakeHub {
 public:
  struct Options {
    std::string repos_dir;          // ORG/REPO/<files>; "" for none
    std::string s3;                 // S3 server for buckets (http://127.0.0.1:port); "" for none
    std::string token;              // required token; "" for public
    std::vector<std::string> gated;  // ORG/REPO answering 403 GatedRepo
    int page_size = 1000;           // tree entries per page
    int lfs_threshold = 10 * 1024;  // larger files redirect to the CDN listener
    std::vector<std::string> buckets;  // NS/NAME buckets that exist ("hf buckets create")
    std::string gateway_target;        // S3 server behind the S3 gateway listener; "": s3
    int resolver_quota = 0;            // resolver requests per window; 0: unlimited
    int api_quota = 0;                 // API requests per window; 0: unlimited
    double window = 300;               // quota window, hub seconds
    double time_scale = 1;             // hub seconds per real second
    double url_ttl = 3600;             // lifetime of signed CDN URLs, seconds
  };

  FakeHub() = default;
  ~FakeHub() { Stop(); }
  FakeHub(const FakeHub&) = delete;
  FakeHub& operator=(const FakeHub&) = delete;

  static std::string Script() { return (std::filesystem::path(__FILE__).parent_path() / "fake_hub.py").string(); }

  ::testing::AssertionResult Start(const Options& o) {
    const std::string python = FindExecutable("python3");
    if (python.empty()) return ::testing::AssertionFailure() << "python3 not found; run scripts/setup.sh";
    if (::access(Script().c_str(), R_OK) != 0) return ::testing::AssertionFailure() << Script() << " not found";
    std::vector<std::string> argv = {python, "-u", Script(), "--listen-port", "0",
                                     "--page-size", std::to_string(o.page_size),
                                     "--lfs-threshold", std::to_string(o.lfs_threshold)};
    if (!o.repos_dir.empty()) argv.insert(argv.end(), {"--repos", o.repos_dir});
    if (!o.s3.empty()) argv.insert(argv.end(), {"--s3", o.s3});
    if (!o.token.empty()) argv.insert(argv.end(), {"--token", o.token});
    for (const auto& g : o.gated) argv.insert(argv.end(), {"--gated", g});
    for (const auto& b : o.buckets) argv.insert(argv.end(), {"--bucket", b});
    if (!o.gateway_target.empty()) argv.insert(argv.end(), {"--gateway-target", o.gateway_target});
    argv.insert(argv.end(), {"--resolver-quota", std::to_string(o.resolver_quota), "--api-quota",
                             std::to_string(o.api_quota), "--window", std::to_string(o.window), "--time-scale",
                             std::to_string(o.time_scale), "--url-ttl", std::to_string(o.url_ttl)});
    ::testing::AssertionResult started = process_.Start(argv, /*pipe_stdout=*/true);
    if (!started) return started;
    const std::optional<std::string> line = process_.ReadLine(10s);
    if (!line || line->rfind("PORT ", 0) != 0) {
      process_.Stop();
      return ::testing::AssertionFailure() << "fake_hub.py did not report its port within 10 s (got '"
                                           << line.value_or("<nothing>") << "')";
    }
    std::istringstream in(line->substr(5));
    in >> port_ >> cdn_url_ >> gateway_url_;
    if (port_ <= 0 || cdn_url_.empty() || gateway_url_.empty()) {
      return ::testing::AssertionFailure() << "bad fake_hub line: " << *line;
    }
    return ::testing::AssertionSuccess();
  }

  void Stop() { process_.Stop(); }

  // HF_ENDPOINT for clients.
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Base URL of the CDN listener (another host than endpoint()).
  const std::string& cdn_url() const { return cdn_url_; }
  // Base URL of the S3 gateway listener (HF_S3_ENDPOINT / --endpoint for bucket writes).
  const std::string& gateway_url() const { return gateway_url_; }
  int port() const { return port_; }

  // The fake's counters (see fake_hub.py: requests, cdn_requests, rate_limited, bytes{...},
  // cdn_authorization[...], hub_authorized, log[...]); a null json when unreachable.
  nlohmann::json Stats() const {
    const std::string body = Request("GET", "/.fake-hub/stats");
    return nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  }
  // Body bytes the fake served for `file` ("ORG/REPO/PATH" or "buckets/NS/NAME/KEY").
  uint64_t BytesServed(const std::string& file) const {
    const nlohmann::json s = Stats();
    if (!s.is_object() || !s["bytes"].contains(file)) return 0;
    return s["bytes"][file].get<uint64_t>();
  }
  // "rate_limit_every=3&retry_after=0"
  bool Control(const std::string& query) const {
    return Request("POST", "/.fake-hub/control?" + query).find("\"ok\"") != std::string::npos;
  }
  bool Reset() const { return Request("POST", "/.fake-hub/reset").find("\"ok\"") != std::string::npos; }

 private:
  // One HTTP/1.0 request to the hub listener; the body of the answer ("" on failure).
  std::string Request(const std::string& method, const std::string& path) const {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return "";
    timeval tv{10, 0};
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port_));
    std::string response;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n";
      if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(req.size())) {
        char buf[8192];
        ssize_t n;
        while ((n = ::recv(fd, buf, sizeof(buf), 0)) > 0) response.append(buf, static_cast<size_t>(n));
      }
    }
    ::close(fd);
    const size_t body = response.find("\r\n\r\n");
    return body == std::string::npos ? "" : response.substr(body + 4);
  }

  ChildProcess process_;
  int port_ = 0;
  std::string cdn_url_;
  std::string gateway_url_;
};

}  // namespace weightfs::test
