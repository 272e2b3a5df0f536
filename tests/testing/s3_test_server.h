// A real S3-compatible server for the S3 store tests, header-only:
//
//   S3rverServer          s3rver (npm s3rver@3.7.1, installed by scripts/setup.sh) on a loopback
//                         port found at run time, with one bucket, data in a TempDir
//   S3PreconditionProxy   tests/testing/s3_precondition_proxy.py in front of it: atomic
//                         If-None-Match: * (s3rver ignores it), S3 error documents on demand
//                         (s3rver never checks signatures), responses lost after the write
//
// s3rver serves path-style requests on 127.0.0.1 and virtual-hosted ones on
// <bucket>.s3.localhost (started with --service-endpoint localhost; libcurl resolves
// *.localhost to the loopback address itself). It accepts unsigned requests and any SigV4
// request whose access key id is "S3RVER", without checking the signature. It runs with
// NODE_OPTIONS=--openssl-legacy-provider: its ListObjectsV2 continuation tokens use DES, which
// Node 20's OpenSSL 3 otherwise lacks (every truncated listing would be a 500). Its listing
// order is its directory walk, not S3's byte order: see s3_precondition_proxy.py.
//
// Start() returns an AssertionResult that says what went wrong and how to fix it: a missing
// s3rver fails the test with "run scripts/setup.sh", it does not skip. Every wait is bounded;
// readiness is polled. Start and stop from the test's main thread (see ChildProcess).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "hub/store/aws_credentials.h"
#include "hub/store/http_client.h"
#include "tests/testing/server_control.h"
#include "tests/testing/test_servers.h"

namespace weightfs::test {

class S3rverServer {
 public:
  explicit S3rverServer(std::string bucket = "wfs-test") : bucket_(std::move(bucket)), dir_("s3rver") {}
  ~S3rverServer() { Stop(); }
  S3rverServer(const S3rverServer&) = delete;
  S3rverServer& operator=(const S3rverServer&) = delete;

  // $WEIGHTFS_S3RVER, /usr/bin/s3rver, /usr/local/bin/s3rver, or s3rver in PATH.
  static std::string Binary() {
    const char* env = std::getenv("WEIGHTFS_S3RVER");
    return FindExecutable("s3rver", {env != nullptr ? env : "", "/usr/bin/s3rver", "/usr/local/bin/s3rver"});
  }

  // The credentials s3rver knows (its only account).
  static AwsCredentials Credentials() { return AwsCredentials{"S3RVER", "S3RVER", "", "s3rver test account"}; }

  ::testing::AssertionResult Start() {
    const std::string binary = Binary();
    if (binary.empty()) {
      return ::testing::AssertionFailure()
             << "s3rver is not installed (looked for $WEIGHTFS_S3RVER, /usr/bin/s3rver, /usr/local/bin/s3rver and "
                "PATH); the S3 store tests need it: run scripts/setup.sh (installs Node.js and s3rver@3.7.1)";
    }
    if (!dir_.ok()) return ::testing::AssertionFailure() << "mkdtemp failed";
    std::error_code ec;
    std::filesystem::create_directories(dir_.Join("data"), ec);
    std::string last_log;
    for (int tries = 0; tries < 5; ++tries) {
      port_ = FreeLoopbackPort();
      if (port_ == 0) return ::testing::AssertionFailure() << "no free loopback port";
      const std::string log = dir_.Join("s3rver-" + std::to_string(tries) + ".log");
      // s3rver makes ListObjectsV2 continuation tokens with DES, which Node 20's OpenSSL 3
      // only offers through its legacy provider: without it every truncated listing is a 500.
      const std::string env = FindExecutable("env", {"/usr/bin/env", "/bin/env"});
      ::testing::AssertionResult started = process_.Start(
          {env, "NODE_OPTIONS=--openssl-legacy-provider", binary, "--directory", dir_.Join("data"), "--port", std::to_string(port_), "--address", "127.0.0.1",
           "--silent", "--service-endpoint", "localhost", "--configure-bucket", bucket_},
          /*pipe_stdout=*/false, log);
      if (!started) return started;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (std::chrono::steady_clock::now() < deadline) {
        if (PortAccepts(port_)) return ::testing::AssertionSuccess();
        if (process_.Exited()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      process_.Stop();
      last_log = TailOfFile(log);
      if (last_log.find("EADDRINUSE") == std::string::npos) {
        return ::testing::AssertionFailure() << "s3rver (" << binary << ") did not accept connections on 127.0.0.1:"
                                             << port_ << " within 20 s; its output:\n" << last_log;
      }
    }
    return ::testing::AssertionFailure() << "s3rver could not get a free port:\n" << last_log;
  }

  void Stop() { process_.Stop(); }

  int port() const { return port_; }
  const std::string& bucket() const { return bucket_; }
  // Path-style endpoint.
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // Endpoint for virtual-hosted addressing: requests go to <bucket>.s3.localhost:<port>.
  std::string virtual_host_endpoint() const { return "http://s3.localhost:" + std::to_string(port_); }
  // Where s3rver keeps its files (<bucket>/... and in-progress multipart uploads).
  std::string data_dir() const { return dir_.Join("data"); }

 private:
  std::string bucket_;
  TempDir dir_;
  ChildProcess process_;
  int port_ = 0;
};

class S3PreconditionProxy {
 public:
  S3PreconditionProxy() = default;
  ~S3PreconditionProxy() { Stop(); }
  S3PreconditionProxy(const S3PreconditionProxy&) = delete;
  S3PreconditionProxy& operator=(const S3PreconditionProxy&) = delete;

  static std::string Script() {
    return (std::filesystem::path(__FILE__).parent_path() / "s3_precondition_proxy.py").string();
  }

  // `tokens_file`: accept only the temporary credentials fake_aws_credentials.py wrote there.
  ::testing::AssertionResult Start(const std::string& target, const std::string& tokens_file = "") {
    const std::string python = FindExecutable("python3");
    if (python.empty()) return ::testing::AssertionFailure() << "python3 not found; run scripts/setup.sh";
    if (::access(Script().c_str(), R_OK) != 0) {
      return ::testing::AssertionFailure() << "proxy script " << Script() << " not found";
    }
    std::vector<std::string> argv = {python, "-u", Script(), "--listen-port", "0", "--target", target};
    if (!tokens_file.empty()) argv.insert(argv.end(), {"--tokens-file", tokens_file});
    ::testing::AssertionResult started = process_.Start(argv, /*pipe_stdout=*/true);
    if (!started) return started;
    const std::optional<std::string> line = process_.ReadLine(std::chrono::seconds(10));
    if (!line || line->rfind("PORT ", 0) != 0) {
      process_.Stop();
      return ::testing::AssertionFailure() << "s3_precondition_proxy.py did not report its port within 10 s (got '"
                                           << line.value_or("<nothing>") << "')";
    }
    port_ = std::atoi(line->c_str() + 5);
    http_ = std::make_unique<HttpClient>();
    return ::testing::AssertionSuccess();
  }

  void Stop() { process_.Stop(); }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // Sends a control request (see the script: "fail=403:AccessDenied&count=1", "drop=1", "fail=").
  ::testing::AssertionResult Control(const std::string& query) {
    return SendServerControl(*http_, "POST", endpoint() + "/.s3-proxy/control?" + query);
  }

  // The proxy's counters (empty on failure).
  std::map<std::string, uint64_t> Stats() { return ServerCounters(FetchServerJson(*http_, endpoint() + "/.s3-proxy/stats")); }

  // With a tokens file: the session tokens requests were accepted with, in order of first use.
  std::vector<std::string> TokensUsed() {
    std::vector<std::string> out;
    const nlohmann::json json = FetchServerJson(*http_, endpoint() + "/.s3-proxy/stats");
    if (!json.is_object() || !json.contains("tokens_used")) return out;
    for (const auto& t : json["tokens_used"]) out.push_back(t.get<std::string>());
    return out;
  }

 private:
  ChildProcess process_;
  int port_ = 0;
  std::unique_ptr<HttpClient> http_;
};

}  // namespace weightfs::test
