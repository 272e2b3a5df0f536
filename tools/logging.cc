#include "tools/logging.h"

#include <sys/stat.h>
#include <syslog.h>
#include <unistd.h>

#include <cerrno>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/rotating_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/sinks/syslog_sink.h>
#include <spdlog/spdlog.h>

#include "tools/cli.h"

namespace weightfs::cli {
namespace {

// The default log file is bounded: it lives in the cache directory, which has a size budget
// of its own (these 64 MiB are not counted in it).
constexpr size_t kRotateBytes = 16 << 20;
constexpr size_t kRotateFiles = 3;

// Lines for the journal on stderr: "<N>message", N the syslog priority, which journald reads
// as the line's priority (sd-daemon(3)) so that `journalctl -p err` finds the errors. The
// journal adds its own time stamp, pid and unit.
class JournalStderrSink : public spdlog::sinks::base_sink<std::mutex> {
 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::fprintf(stderr, "<%d>%.*s", Priority(msg.level), static_cast<int>(formatted.size()), formatted.data());
  }
  void flush_() override { std::fflush(stderr); }

 private:
  static int Priority(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::critical: return LOG_CRIT;
      case spdlog::level::err: return LOG_ERR;
      case spdlog::level::warn: return LOG_WARNING;
      case spdlog::level::info: return LOG_INFO;
      default: return LOG_DEBUG;
    }
  }
};

// "/mnt/w" -> "mnt-w": the mount point as one file name (as systemd names mount units, with
// anything unusual as '_').
std::string FileNameOf(const std::string& mountpoint) {
  std::string name;
  for (char c : mountpoint) {
    if (c == '/') {
      if (!name.empty() && name.back() != '-') name += '-';
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-') {
      name += c;
    } else {
      name += '_';
    }
  }
  while (!name.empty() && name.back() == '-') name.pop_back();
  if (name.empty() || name[0] == '.') name = "root" + name;
  if (name.size() > 200) name.resize(200);
  return name;
}

bool SyslogListens() {
  struct stat st;
  return ::stat("/dev/log", &st) == 0 && S_ISSOCK(st.st_mode);
}

}  // namespace

Expected<spdlog::level::level_enum> ParseLogLevel(std::string_view text) {
  const std::string s(text);
  const spdlog::level::level_enum l = spdlog::level::from_str(s);
  if (l == spdlog::level::off && s != "off") {
    return Status::InvalidArgument("--log-level expects error, warn, info or debug, not '" + s + "'");
  }
  return l;
}

Status SetUpCommandLog(const ArgParser& args, spdlog::level::level_enum fallback) {
  spdlog::level::level_enum level = fallback;
  if (auto v = args.Get("--log-level")) {
    WFS_ASSIGN_OR_RETURN(level, ParseLogLevel(*v));
  }
  spdlog::set_level(level);
  spdlog::set_pattern("weightfs %L: %v");
  return Status::Ok();
}

bool StderrIsJournal() {
  const char* stream = std::getenv("JOURNAL_STREAM");
  if (stream == nullptr) return false;
  unsigned long long dev = 0, ino = 0;
  if (std::sscanf(stream, "%llu:%llu", &dev, &ino) != 2) return false;
  struct stat st;
  return ::fstat(STDERR_FILENO, &st) == 0 && st.st_dev == dev && st.st_ino == ino;
}

std::string LogDestination::Describe() const {
  switch (kind) {
    case Kind::kStderr: return "stderr";
    case Kind::kJournal: return "the journal (journalctl -u UNIT, or journalctl _COMM=weightfs)";
    case Kind::kFile: return path;
    case Kind::kSyslog: return "syslog";
  }
  return "stderr";
}

LogDestination ChooseMountLog(const std::string& log_file, bool foreground, const std::string& cache_dir,
                              const std::string& mountpoint, spdlog::level::level_enum level) {
  LogDestination d;
  d.level = level;
  if (log_file == "syslog") {
    d.kind = LogDestination::Kind::kSyslog;
  } else if (!log_file.empty()) {
    d.kind = LogDestination::Kind::kFile;
    d.path = log_file;
  } else if (StderrIsJournal()) {
    d.kind = LogDestination::Kind::kJournal;
  } else if (foreground) {
    d.kind = LogDestination::Kind::kStderr;
  } else {
    d.kind = LogDestination::Kind::kFile;
    d.path = cache_dir + "/logs/" + FileNameOf(mountpoint) + ".log";
    d.rotate = true;
  }
  return d;
}

Status CheckLogDestination(const LogDestination& d) {
  if (d.kind == LogDestination::Kind::kSyslog && !SyslogListens()) {
    return Status::InvalidArgument(
        "--log-file syslog: no syslog daemon listens here (/dev/log does not exist); leave --log-file out to log "
        "to a file under the cache directory, or name a file");
  }
  if (d.kind != LogDestination::Kind::kFile) return Status::Ok();
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(d.path).parent_path(), ec);
  std::ofstream probe(d.path, std::ios::app);
  if (!probe) {
    return Status::IOError("cannot write the log file " + d.path + ": " + std::strerror(errno) +
                           " (name another with --log-file FILE)");
  }
  return Status::Ok();
}

namespace {

// %* in a pattern: the message as the inside of a JSON string (quotes, backslashes and control
// characters escaped; bytes that are not UTF-8 become U+FFFD).
class JsonMessageFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const auto* p = reinterpret_cast<const unsigned char*>(msg.payload.data());
    const size_t n = msg.payload.size();
    auto put = [&](std::string_view s) { dest.append(s.data(), s.data() + s.size()); };
    for (size_t i = 0; i < n;) {
      const unsigned char c = p[i];
      if (c == '"') {
        put("\\\"");
      } else if (c == '\\') {
        put("\\\\");
      } else if (c == '\n') {
        put("\\n");
      } else if (c == '\t') {
        put("\\t");
      } else if (c < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        put(buf);
      } else if (c < 0x80) {
        dest.push_back(static_cast<char>(c));
      } else {
        // A UTF-8 sequence: its length from the lead byte, each continuation 10xxxxxx.
        const size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        bool ok = len != 0 && c >= 0xC2 && i + len <= n;
        for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] & 0xC0) == 0x80;
        if (!ok) {
          put("\\ufffd");
          ++i;
          continue;
        }
        dest.append(reinterpret_cast<const char*>(p + i), reinterpret_cast<const char*>(p + i + len));
        i += len;
        continue;
      }
      ++i;
    }
  }
  std::unique_ptr<spdlog::custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

}  // namespace

Status InstallLog(const LogDestination& d) {
  std::shared_ptr<spdlog::sinks::sink> sink;
  // Files get the pid: a file outlives a daemon, and the next mount appends to it.
  std::string pattern = "[%Y-%m-%d %H:%M:%S.%e] [%P] [%l] %v";
  try {
    switch (d.kind) {
      case LogDestination::Kind::kFile:
        if (d.rotate) {
          sink = std::make_shared<spdlog::sinks::rotating_file_sink_mt>(d.path, kRotateBytes, kRotateFiles);
        } else {
          sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(d.path);
        }
        break;
      case LogDestination::Kind::kSyslog:
        sink = std::make_shared<spdlog::sinks::syslog_sink_mt>("weightfs", LOG_PID, LOG_DAEMON, true);
        pattern = "%v";
        break;
      case LogDestination::Kind::kJournal:
        sink = std::make_shared<JournalStderrSink>();
        pattern = "%v";
        break;
      case LogDestination::Kind::kStderr:
        sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
        pattern = "[%H:%M:%S.%e] weightfs %l: %v";
        break;
    }
  } catch (const std::exception& e) {
    return Status::IOError("cannot log to " + d.Describe() + ": " + e.what());
  }
  auto logger = std::make_shared<spdlog::logger>("weightfs", sink);
  logger->set_level(d.level);
  if (d.json) {
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%e%z","level":"%l","pid":%P,"msg":"%*"})");
    logger->set_formatter(std::move(formatter));
  } else {
    logger->set_pattern(pattern);
  }
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
  return Status::Ok();
}

}  // namespace weightfs::cli
