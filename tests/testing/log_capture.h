// LogCapture: while it lives, the default spdlog logger writes "<level> <message>" lines into a
// string the test reads (instead of stderr). Not thread-safe to construct or destroy while
// other threads log; the capturing itself is (ostream_sink_mt).
#pragma once

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

namespace weightfs::test {

class LogCapture {
 public:
  LogCapture() : previous_(spdlog::default_logger()), previous_level_(spdlog::get_level()) {
    auto logger = std::make_shared<spdlog::logger>("capture", std::make_shared<spdlog::sinks::ostream_sink_mt>(out_));
    logger->set_pattern("%l %v");
    spdlog::set_default_logger(logger);
    spdlog::set_level(spdlog::level::info);
  }
  ~LogCapture() {
    spdlog::set_default_logger(previous_);
    spdlog::set_level(previous_level_);
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  std::vector<std::string> Lines() const {
    std::vector<std::string> lines;
    std::istringstream in(out_.str());
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    return lines;
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::logger> previous_;
  spdlog::level::level_enum previous_level_;
};

}  // namespace weightfs::test
