// The control and stats requests of the test kit's scripted servers (s3_precondition_proxy.py,
// fake_aws_credentials.py): a control query answered 200, and a stats document of counters.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "hub/store/http_client.h"

namespace weightfs::test {

// Sends `method` `url` (a control query such as ".../control?fail=403"); success on HTTP 200.
inline ::testing::AssertionResult SendServerControl(HttpClient& http, const std::string& method,
                                                    const std::string& url) {
  HttpRequest r;
  r.method = method;
  r.url = url;
  auto resp = http.Send(std::move(r));
  if (!resp.ok()) return ::testing::AssertionFailure() << resp.status().ToString();
  if (resp->status != 200) return ::testing::AssertionFailure() << "control answered HTTP " << resp->status;
  return ::testing::AssertionSuccess();
}

// The JSON document at `url`; a discarded value when the request or the parse fails.
inline nlohmann::json FetchServerJson(HttpClient& http, const std::string& url) {
  HttpRequest r;
  r.url = url;
  auto resp = http.Send(std::move(r));
  if (!resp.ok() || resp->status != 200) return nlohmann::json(nlohmann::json::value_t::discarded);
  return nlohmann::json::parse(resp->body.begin(), resp->body.end(), nullptr, false);
}

// The unsigned counters of a stats document (empty when it is not an object).
inline std::map<std::string, uint64_t> ServerCounters(const nlohmann::json& stats) {
  std::map<std::string, uint64_t> out;
  if (!stats.is_object()) return out;
  for (const auto& [k, v] : stats.items()) {
    if (v.is_number_unsigned()) out[k] = v.get<uint64_t>();
  }
  return out;
}

}  // namespace weightfs::test
