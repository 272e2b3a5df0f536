// Small helpers shared by the subcommands: argument parsing, size/count parsing, progress.
// Not thread-safe unless stated.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace weightfs::cli {

// Parses "500M", "1.5G", "64Ki", "4MiB", "123" into a number. Decimal suffixes K/M/G/T are
// powers of 1000, binary suffixes Ki/Mi/Gi/Ti (optionally followed by B) powers of 1024.
// A bare "B" suffix is allowed ("512B"). Returns InvalidArgument with the text on failure.
Expected<uint64_t> ParseSize(std::string_view text);
// Parses a plain non-negative double ("1e-6", "0.5").
Expected<double> ParseDouble(std::string_view text);
// Human form: 1536 -> "1.5 KiB".
std::string FormatBytes(double bytes);

// The names of `candidates` a typo of `name` may have meant, closest first (at most 5): a
// small edit distance, the same last path component ("rl" for "acme/rl": the organisation
// forgotten), or one ending in "/" + name. Never `name` itself.
std::vector<std::string> LookAlike(std::string_view name, const std::vector<std::string>& candidates);
// "a", "a or b", "a, b or c".
std::string OrList(const std::vector<std::string>& names);

// A minimal GNU-style parser: "--name value", "--name=value", boolean "--flag", positionals.
// Unknown options are errors, so a typo is reported instead of silently ignored.
class ArgParser {
 public:
  // `value_options`: options that take a value; `flag_options`: booleans.
  ArgParser(std::vector<std::string> value_options, std::vector<std::string> flag_options);

  // Parses argv[first..argc). Returns InvalidArgument naming the offending token.
  Status Parse(int argc, char** argv, int first);

  bool Has(const std::string& name) const;
  std::optional<std::string> Get(const std::string& name) const;
  std::string GetOr(const std::string& name, const std::string& fallback) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

 private:
  std::vector<std::string> value_options_;
  std::vector<std::string> flag_options_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positionals_;
};

// Shows how far a long operation is: bytes done of the total, the rate and the time left.
// On a TTY (stderr) one line rewritten in place, at most ten times a second:
//   push acme/m@v2: 1.2 GiB of 4.0 GiB (30%), 120.5 MiB/s, ETA 24 s
// Elsewhere (a log file, CI, a pipe) the same as a plain line every `interval` seconds
// (WEIGHTFS_PROGRESS_INTERVAL, default 5; the first one after `interval`, so short operations
// print nothing) and, if any was printed, a last line when it finishes. Thread-safe.
class Progress {
 public:
  // Where it prints and how it tells time; the defaults are stderr, isatty(stderr), the steady
  // clock and WEIGHTFS_PROGRESS_INTERVAL. Tests give their own.
  struct Output {
    FILE* out = nullptr;
    bool tty = false;
    std::function<double()> now;  // seconds
    double interval = 5;          // between plain lines
  };
  static Output DefaultOutput();

  Progress(std::string label, uint64_t total) : Progress(std::move(label), total, DefaultOutput()) {}
  // `noun` ("versions"): counts those instead of bytes.
  Progress(std::string label, uint64_t total, Output output, std::string noun = "");
  Progress(std::string label, uint64_t total, std::string noun)
      : Progress(std::move(label), total, DefaultOutput(), std::move(noun)) {}
  void Update(uint64_t done);
  // For work whose total is only known once it runs.
  void Update(uint64_t done, uint64_t total);
  // Ends the line (TTY) or prints the summary (if lines were printed). Idempotent.
  void Finish();

 private:
  // "1.2 GiB of 4.0 GiB (30%), 120.5 MiB/s, ETA 24 s". REQUIRES: mu_ held.
  std::string LineLocked(double now) const;
  std::string Amount(double n) const;  // "1.2 GiB", or "12 versions" with a noun

  std::mutex mu_;
  const std::string label_;
  const std::string noun_;  // empty: bytes
  const Output output_;
  const double start_;
  uint64_t total_;         // GUARDED_BY(mu_)
  uint64_t done_ = 0;      // GUARDED_BY(mu_)
  double last_print_;      // GUARDED_BY(mu_)
  bool printed_ = false;   // GUARDED_BY(mu_)
  bool finished_ = false;  // GUARDED_BY(mu_)
};

// "24 s", "4 min 10 s", "1 h 02 min".
std::string FormatDuration(double seconds);

// Parses a subcommand's arguments (argv[0] is its name): prints `help` for --help/-h and
// returns 0, or an error for bad options or a positional count other than `positionals` and
// returns 2; nullopt when the command should run.
std::optional<int> ParseArgs(ArgParser& args, int argc, char** argv, const char* help, size_t positionals);

// The root of the file system holding `path`: the highest ancestor on the same device.
std::string MountRootOf(const std::string& path);

// Prints "weightfs: <message>" on stderr and returns exit code 1 (for `return Fail(...)`).
int Fail(const std::string& message);
inline int Fail(const Status& s) { return Fail(s.ToString()); }

}  // namespace weightfs::cli
