// Where a weightfs process logs and how much: the one place that sets up spdlog, for the CLI
// commands and for the mount daemon.
//
// CLI commands log to stderr ("weightfs W: ...") at --log-level (warn unless the command says
// otherwise). The mount daemon logs to one destination (LogDestination), chosen so that a user
// can find it:
//   --foreground                 stderr
//   stderr is systemd's journal  the journal (JOURNAL_STREAM names stderr: a service or a mount
//                                unit ran us), with the journal's priority prefixes, daemonized
//                                or not
//   daemonized, otherwise        a file under the cache directory, CACHE_DIR/logs/<mountpoint>.log
//                                (rotated at 16 MiB, 3 files kept)
//   --log-file FILE              FILE (appended to, never rotated: logrotate's copytruncate works)
//   --log-file syslog            syslog, refused where no syslog daemon listens (no /dev/log)
// Not thread-safe: set up logging before starting threads.
#pragma once

#include <string>
#include <string_view>

#include <spdlog/common.h>

#include "core/status.h"

namespace weightfs::cli {

class ArgParser;

// "error", "warn", "info", "debug" (also "trace", "critical", "off"); InvalidArgument otherwise.
Expected<spdlog::level::level_enum> ParseLogLevel(std::string_view text);

// CLI commands: stderr at --log-level, `fallback` if the option is absent.
Status SetUpCommandLog(const ArgParser& args, spdlog::level::level_enum fallback = spdlog::level::warn);

// True if stderr is the stream systemd connected to its journal (JOURNAL_STREAM holds its
// device and inode), so that lines written there reach `journalctl`.
bool StderrIsJournal();

struct LogDestination {
  enum class Kind { kStderr, kJournal, kFile, kSyslog };
  Kind kind = Kind::kStderr;
  std::string path;   // kFile: absolute
  bool rotate = false;  // kFile: the default file under the cache directory is rotated
  spdlog::level::level_enum level = spdlog::level::info;
  // One JSON object a line ({"time", "level", "pid", "msg"}) for log collectors, not text.
  bool json = false;

  // For messages: "/root/.cache/weightfs/logs/mnt-w.log", "the journal (journalctl ...)".
  std::string Describe() const;
};

// The mount daemon's destination. `log_file`: --log-file ("" if absent); `foreground`:
// --foreground; the default file is named after `mountpoint` under `cache_dir`.
LogDestination ChooseMountLog(const std::string& log_file, bool foreground, const std::string& cache_dir,
                              const std::string& mountpoint, spdlog::level::level_enum level);

// Checks, before the daemon forks, that the destination can be written (creating the default
// file's directory), so that the error reaches the user: a file that cannot be opened, or
// syslog where nothing listens.
Status CheckLogDestination(const LogDestination& d);

// Makes `d` the default logger of this process.
Status InstallLog(const LogDestination& d);

}  // namespace weightfs::cli
