#include <sys/stat.h>

#include <filesystem>
#include "tools/cli.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <algorithm>

namespace weightfs::cli {

Expected<uint64_t> ParseSize(std::string_view text) {
  std::string s(text);
  if (s.empty()) return Status::InvalidArgument("empty size");
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(v) || v < 0) {
    return Status::InvalidArgument("not a size: '" + s + "' (try 500M, 4MiB or 1G)");
  }
  std::string suffix(end);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b') && suffix != "B" &&
      suffix != "b") {
    suffix.pop_back();
  }
  double mult = 1;
  if (suffix.empty() || suffix == "B" || suffix == "b") mult = 1;
  else if (suffix == "K" || suffix == "k") mult = 1e3;
  else if (suffix == "M" || suffix == "m") mult = 1e6;
  else if (suffix == "G" || suffix == "g") mult = 1e9;
  else if (suffix == "T" || suffix == "t") mult = 1e12;
  else if (suffix == "Ki" || suffix == "KI") mult = 1024.0;
  else if (suffix == "Mi" || suffix == "MI") mult = 1024.0 * 1024;
  else if (suffix == "Gi" || suffix == "GI") mult = 1024.0 * 1024 * 1024;
  else if (suffix == "Ti" || suffix == "TI") mult = 1024.0 * 1024 * 1024 * 1024;
  else return Status::InvalidArgument("unknown size suffix in '" + s + "' (use K, M, G, Ki, Mi, Gi)");
  double r = v * mult;
  if (r > 9.0e18) return Status::InvalidArgument("size too large: '" + s + "'");
  return static_cast<uint64_t>(std::llround(r));
}

Expected<double> ParseDouble(std::string_view text) {
  std::string s(text);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || *end != '\0' || !std::isfinite(v)) {
    return Status::InvalidArgument("not a number: '" + s + "'");
  }
  return v;
}

std::string FormatBytes(double bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, kUnits[u]);
  return buf;
}

namespace {

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string_view LastComponent(std::string_view s) {
  const size_t slash = s.rfind('/');
  return slash == std::string_view::npos ? s : s.substr(slash + 1);
}

}  // namespace

std::vector<std::string> LookAlike(std::string_view name, const std::vector<std::string>& candidates) {
  std::vector<std::pair<size_t, std::string>> ranked;
  const size_t bound = std::max<size_t>(2, name.size() / 4);
  for (const std::string& c : candidates) {
    if (c == name) continue;
    const size_t d = EditDistance(name, c);
    const bool same_leaf = LastComponent(c) == LastComponent(name) ||
                           (c.size() > name.size() && c.ends_with(name) && c[c.size() - name.size() - 1] == '/');
    if (d <= bound || same_leaf) ranked.emplace_back(same_leaf ? 0 : d, c);
  }
  std::sort(ranked.begin(), ranked.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < ranked.size() && out.size() < 5; ++i) {
    if (out.empty() || out.back() != ranked[i].second) out.push_back(ranked[i].second);
  }
  return out;
}

std::string OrList(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += i + 1 == names.size() ? " or " : ", ";
    out += names[i];
  }
  return out;
}

ArgParser::ArgParser(std::vector<std::string> value_options, std::vector<std::string> flag_options)
    : value_options_(std::move(value_options)), flag_options_(std::move(flag_options)) {}

Status ArgParser::Parse(int argc, char** argv, int first) {
  auto contains = [](const std::vector<std::string>& v, const std::string& x) {
    return std::find(v.begin(), v.end(), x) != v.end();
  };
  bool only_positionals = false;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (only_positionals || arg.size() < 2 || arg[0] != '-' || arg == "-") {
      positionals_.push_back(arg);
      continue;
    }
    if (arg == "--") {
      only_positionals = true;
      continue;
    }
    std::string name = arg;
    std::optional<std::string> inline_value;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      inline_value = arg.substr(eq + 1);
    }
    if (contains(flag_options_, name)) {
      if (inline_value) return Status::InvalidArgument(name + " takes no value");
      values_[name] = "1";
    } else if (contains(value_options_, name)) {
      if (inline_value) {
        values_[name] = *inline_value;
      } else if (i + 1 < argc) {
        values_[name] = argv[++i];
      } else {
        return Status::InvalidArgument(name + " needs a value");
      }
    } else {
      return Status::InvalidArgument("unknown option " + name + " (see --help)");
    }
  }
  return Status::Ok();
}

bool ArgParser::Has(const std::string& name) const { return values_.count(name) != 0; }

std::optional<std::string> ArgParser::Get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string ArgParser::GetOr(const std::string& name, const std::string& fallback) const {
  auto v = Get(name);
  return v ? *v : fallback;
}

Progress::Output Progress::DefaultOutput() {
  Output o;
  o.out = stderr;
  o.tty = ::isatty(STDERR_FILENO) != 0;
  o.now = [] { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); };
  if (const char* v = std::getenv("WEIGHTFS_PROGRESS_INTERVAL")) {
    Expected<double> seconds = ParseDouble(v);
    if (seconds.ok()) o.interval = *seconds;
  }
  return o;
}

Progress::Progress(std::string label, uint64_t total, Output output, std::string noun)
    : label_(std::move(label)),
      noun_(std::move(noun)),
      output_(std::move(output)),
      start_(output_.now()),
      total_(total),
      last_print_(start_) {}

std::string FormatDuration(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%ld s", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%ld min %ld s", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%ld h %02ld min", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

std::string Progress::Amount(double n) const {
  if (noun_.empty()) return FormatBytes(n);
  char buf[48];
  std::snprintf(buf, sizeof buf, n < 10 && n != std::floor(n) ? "%.1f " : "%.0f ", n);
  return buf + noun_;
}

std::string Progress::LineLocked(double now) const {
  const double elapsed = now - start_;
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0;
  std::string line = label_ + ": " + Amount(static_cast<double>(done_));
  if (total_ > 0) {
    char pct[16];
    std::snprintf(pct, sizeof pct, "%.0f%%", 100.0 * static_cast<double>(std::min(done_, total_)) / static_cast<double>(total_));
    line += " of " + Amount(static_cast<double>(total_)) + " (" + pct + ")";
  }
  // No rate or ETA from the first moments: a rate over a fraction of a second (the setup
  // before the first byte included) made first lines say "ETA 5 h".
  constexpr double kRateAfterSeconds = 2;
  if (elapsed < kRateAfterSeconds) return line;
  if (rate > 0) line += ", " + Amount(rate) + "/s";
  if (total_ > 0 && rate > 0 && done_ < total_) {
    line += ", ETA " + FormatDuration(static_cast<double>(total_ - done_) / rate);
  }
  return line;
}

void Progress::Update(uint64_t done, uint64_t total) {
  std::lock_guard<std::mutex> lock(mu_);
  total_ = total;
  done_ = done;
  const double now = output_.now();
  if (finished_) return;
  if (output_.tty) {
    if (printed_ && now - last_print_ < 0.1 && (total_ == 0 || done_ < total_)) return;
    std::fprintf(output_.out, "\r%s\033[K", LineLocked(now).c_str());
  } else {
    if (now - last_print_ < output_.interval) return;
    std::fprintf(output_.out, "%s\n", LineLocked(now).c_str());
  }
  std::fflush(output_.out);
  last_print_ = now;
  printed_ = true;
}

void Progress::Update(uint64_t done) {
  uint64_t total;
  {
    std::lock_guard<std::mutex> lock(mu_);
    total = total_;
  }
  Update(done, total);
}

void Progress::Finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || !printed_) {
    finished_ = true;
    return;
  }
  finished_ = true;
  const double elapsed = output_.now() - start_;
  std::string line = label_ + ": " + Amount(static_cast<double>(done_)) + " in " + FormatDuration(elapsed);
  if (elapsed > 0) line += " (" + Amount(static_cast<double>(done_) / elapsed) + "/s)";
  std::fprintf(output_.out, output_.tty ? "\r%s\033[K\n" : "%s\n", line.c_str());
  std::fflush(output_.out);
}

int Fail(const std::string& message) {
  std::fprintf(stderr, "weightfs: %s\n", message.c_str());
  return 1;
}

std::optional<int> ParseArgs(ArgParser& args, int argc, char** argv, const char* help, size_t positionals) {
  Status s = args.Parse(argc, argv, 1);
  if (args.Has("--help") || args.Has("-h")) {
    std::fputs(help, stdout);
    return 0;
  }
  if (!s.ok()) {
    std::fprintf(stderr, "weightfs %s: %s\n", argv[0], s.message().c_str());
    return 2;
  }
  if (args.positionals().size() != positionals) {
    std::fprintf(stderr, "weightfs %s: wrong number of arguments (see --help)\n", argv[0]);
    return 2;
  }
  return std::nullopt;
}

// The root of the file system holding `path`: the highest ancestor on the same device.
std::string MountRootOf(const std::string& path) {
  namespace fs = std::filesystem;
  fs::path p = fs::path(path).lexically_normal();
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return path;
  const dev_t dev = st.st_dev;
  while (p.has_parent_path() && p.parent_path() != p) {
    struct stat up {};
    if (::stat(p.parent_path().c_str(), &up) != 0 || up.st_dev != dev) break;
    p = p.parent_path();
  }
  return p.string();
}

}  // namespace weightfs::cli
