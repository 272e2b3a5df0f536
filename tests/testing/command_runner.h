// Runs a shell command for the tests that drive the real weightfs binary, capturing its stdout
// (redirect stderr in the command to capture it too), exit code and wall time; and reads files
// whole for those tests.
#pragma once

#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace weightfs::test {

struct CommandResult {
  int exit_code = -1;  // -1 if it could not run or did not exit normally
  std::string out;
  double seconds = 0;
};

inline CommandResult RunShell(const std::string& command) {
  CommandResult r;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen(command.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

#ifdef WEIGHTFS_BINARY
// The weightfs binary under test with `args`, through the shell, its stderr with its stdout.
inline CommandResult RunCli(const std::string& args) {
  return RunShell(std::string(WEIGHTFS_BINARY) + " " + args + " 2>&1");
}
#endif

inline std::vector<uint8_t> Slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

inline std::string SlurpText(const std::filesystem::path& path) {
  std::vector<uint8_t> b = Slurp(path);
  return std::string(b.begin(), b.end());
}

// Regular files under `dir` (recursively), by path relative to it.
inline std::set<std::string> FilesUnder(const std::filesystem::path& dir) {
  std::set<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file()) out.insert(std::filesystem::relative(it->path(), dir).string());
  }
  return out;
}

}  // namespace weightfs::test
