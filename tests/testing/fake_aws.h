// FakeAwsCredentials: tests/testing/fake_aws_credentials.py on a loopback port (EC2 instance
// metadata, a container endpoint, STS, a credential_process helper), header-only. Start it with
// a tokens file and give the same file to S3PreconditionProxy::Start: the proxy then accepts
// exactly the credentials the fake issued, checking expiry and signatures.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hub/store/http_client.h"
#include "tests/testing/server_control.h"
#include "tests/testing/test_servers.h"

namespace weightfs::test {

class FakeAwsCredentials {
 public:
  FakeAwsCredentials() = default;
  ~FakeAwsCredentials() { Stop(); }
  FakeAwsCredentials(const FakeAwsCredentials&) = delete;
  FakeAwsCredentials& operator=(const FakeAwsCredentials&) = delete;

  static std::string Script() {
    return (std::filesystem::path(__FILE__).parent_path() / "fake_aws_credentials.py").string();
  }

  ::testing::AssertionResult Start(const std::string& tokens_file, const std::vector<std::string>& extra = {}) {
    const std::string python = FindExecutable("python3");
    if (python.empty()) return ::testing::AssertionFailure() << "python3 not found; run scripts/setup.sh";
    std::vector<std::string> argv = {python, "-u", Script(), "--tokens-file", tokens_file};
    argv.insert(argv.end(), extra.begin(), extra.end());
    ::testing::AssertionResult started = process_.Start(argv, /*pipe_stdout=*/true);
    if (!started) return started;
    const std::optional<std::string> line = process_.ReadLine(std::chrono::seconds(10));
    if (!line || line->rfind("PORT ", 0) != 0) {
      process_.Stop();
      return ::testing::AssertionFailure() << "fake_aws_credentials.py did not report its port within 10 s (got '"
                                           << line.value_or("<nothing>") << "')";
    }
    port_ = std::atoi(line->c_str() + 5);
    http_ = std::make_unique<HttpClient>();
    return ::testing::AssertionSuccess();
  }
  void Stop() { process_.Stop(); }

  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(port_); }

  // "lifetime=303", "expire_all=1", "fail=imds:500", "fail=".
  ::testing::AssertionResult Control(const std::string& query) {
    return SendServerControl(*http_, "GET", endpoint() + "/control?" + query);
  }

  // Counters: requests, issued_<provider>, rejected_<provider>, failed_<provider>, imds_tokens.
  std::map<std::string, uint64_t> Stats() { return ServerCounters(FetchServerJson(*http_, endpoint() + "/stats")); }

 private:
  ChildProcess process_;
  int port_ = 0;
  std::unique_ptr<HttpClient> http_;
};

}  // namespace weightfs::test
