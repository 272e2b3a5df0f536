// mount.fuse.weightfs and umount.fuse.weightfs: the helpers mount(8) and umount(8) run for file
// systems of type fuse.weightfs, so that /etc/fstab lines and systemd .mount units work:
//
//   s3://ckpt/runs  /mnt/weights  fuse.weightfs  _netdev,nofail,cache_dir=/var/cache/weightfs  0 0
//
// mount(8) runs `mount.fuse.weightfs SOURCE TARGET [-sfnv] [-o OPTIONS] [-t TYPE]`, umount(8)
// runs `umount.fuse.weightfs TARGET [-flnrv] [-t TYPE]`. Both are the weightfs binary under
// another name (symbolic links made by `cmake --install`; weightfs.cc dispatches on argv[0]).
// The mount helper turns the options into `weightfs mount` options and mounts the same way
// (a daemon; it returns once the mount answers). The unmount helper is `weightfs unmount`: it
// publishes the drafts first, so stopping a systemd .mount unit publishes them too.
#include <pwd.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "tools/commands.h"

namespace weightfs::cli {
namespace {

// fstab option -> `weightfs mount` option taking its value. '-' may be written for '_'.
const std::map<std::string, std::string>& ValueOptions() {
  static const std::map<std::string, std::string> options = {
      {"cache_dir", "--cache-dir"},   {"cache_size", "--cache-size"}, {"memory_limit", "--memory-limit"},
      {"refresh", "--refresh"},       {"probe_rate", "--probe-rate"}, {"chunk_size", "--chunk-size"},
      {"threads", "--threads"},       {"log_file", "--log-file"},     {"log_level", "--log-level"},
      {"endpoint", "--endpoint"},     {"region", "--region"},         {"timeout", "--timeout"},
      {"metrics", "--metrics"},       {"metrics_interval", "--metrics-interval"},
      {"uid", "--uid"},               {"gid", "--gid"},               {"file_mode", "--file-mode"},
      {"dir_mode", "--dir-mode"},     {"log_format", "--log-format"}, {"metrics_port", "--metrics-port"},
      {"shared_cache", "--shared-cache"}, {"shared_cache_size", "--shared-cache-size"},
      {"shared_cache_endpoint", "--shared-cache-endpoint"}, {"prefix", "--prefix"},
  };
  return options;
}

// Options that are for mount(8), systemd or fstab readers, not for the file system. mount(8)
// passes some of them on (_netdev, nofail); libfuse would refuse them.
bool IsMountToolOption(const std::string& name) {
  static const char* const kNames[] = {"defaults", "rw", "auto", "noauto", "user", "nouser", "users",
                                       "owner", "group", "nofail", "_netdev", "comment", "loop"};
  for (const char* n : kNames) {
    if (name == n) return true;
  }
  return name.starts_with("x-");
}

// "a,b=c,\"d,e\"" -> {"a", "b=c", "d,e"}: commas split, double quotes protect (as libmount's).
std::vector<std::string> SplitOptions(const std::string& text) {
  std::vector<std::string> out;
  std::string cur;
  bool quoted = false;
  for (char ch : text) {
    if (ch == '"') {
      quoted = !quoted;
    } else if (ch == ',' && !quoted) {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += ch;
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

// mount(8) runs helpers with the environment it has, which at boot (systemd's mount units) has
// no HOME: the defaults that hang off it (the cache directory, ~/.aws/credentials, the Hugging
// Face token) would then differ from the same user's shell.
void SetHomeIfUnset() {
  const char* home = std::getenv("HOME");
  if (home != nullptr && *home != '\0') return;
  if (const passwd* pw = ::getpwuid(::getuid()); pw != nullptr && pw->pw_dir != nullptr && *pw->pw_dir != '\0') {
    ::setenv("HOME", pw->pw_dir, 1);
  }
}

int Usage(const char* name, const std::string& why) {
  std::fprintf(stderr, "%s: %s\nusage: %s BUCKET MOUNTPOINT [-o OPTIONS]   (run by mount(8) for fuse.weightfs; see "
               "weightfs mount --help: each --name VALUE option is name=VALUE here, --read-only is ro, "
               "--allow-other is allow_other; other options go to FUSE)\n",
               name, why.c_str(), name);
  return 2;
}

int Run(std::vector<std::string> args, bool quiet, int (*main)(int, char**, bool)) {
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return main(static_cast<int>(args.size()), argv.data(), quiet);
}

}  // namespace

int MountHelperMain(int argc, char** argv) {
  const char* name = "mount.fuse.weightfs";
  std::vector<std::string> positionals;
  std::vector<std::string> option_lists;
  bool verbose = false, fake = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-o" || a == "-t" || a == "-N") {
      if (i + 1 >= argc) return Usage(name, a + " needs a value");
      if (a == "-o") option_lists.push_back(argv[i + 1]);
      ++i;  // -t fuse.weightfs and -N (a namespace mount(8) already entered) need nothing
    } else if (a.starts_with("-o") && a.size() > 2) {
      option_lists.push_back(a.substr(2));
    } else if (a == "-v") {
      verbose = true;
    } else if (a == "-f") {
      fake = true;  // mount -f: pretend
    } else if (a == "-n" || a == "-s") {
      // -n: no mtab (there is none to write); -s: sloppy (unknown options are errors anyway)
    } else if (a == "-h" || a == "--help") {
      Usage(name, "mounts a weightfs bucket");
      return 0;
    } else if (a.starts_with("-") && a.size() > 1) {
      return Usage(name, "unknown option " + a);
    } else {
      positionals.push_back(a);
    }
  }
  if (positionals.size() != 2) return Usage(name, "expected BUCKET MOUNTPOINT");
  std::vector<std::string> args = {"mount", positionals[0], positionals[1]};
  std::vector<std::string> fuse;
  for (const std::string& list : option_lists) {
    for (const std::string& opt : SplitOptions(list)) {
      const size_t eq = opt.find('=');
      if (IsMountToolOption(opt.substr(0, eq))) continue;
      std::string key = opt.substr(0, eq);
      for (char& c : key) {
        if (c == '-') c = '_';
      }
      if (auto it = ValueOptions().find(key); it != ValueOptions().end()) {
        if (eq == std::string::npos) return Usage(name, "option " + key + " needs a value (" + key + "=...)");
        args.push_back(it->second);
        args.push_back(opt.substr(eq + 1));
      } else if (key == "ro" && eq == std::string::npos) {
        args.push_back("--read-only");
      } else if (key == "allow_other" && eq == std::string::npos) {
        args.push_back("--allow-other");
      } else if (key == "allow_invalid" && eq == std::string::npos) {
        args.push_back("--allow-invalid");
      } else if (key == "no_sign_request" && eq == std::string::npos) {
        args.push_back("--no-sign-request");
      } else {
        fuse.push_back(opt);
      }
    }
  }
  if (!fuse.empty()) {
    std::string joined;
    for (const std::string& f : fuse) joined += (joined.empty() ? "" : ",") + f;
    args.push_back("-o");
    args.push_back(joined);
  }
  if (verbose) {
    std::string line = "weightfs";
    for (const std::string& a : args) line += " " + a;
    std::fprintf(stderr, "%s: %s\n", name, line.c_str());
  }
  if (fake) return 0;
  SetHomeIfUnset();
  return Run(std::move(args), /*quiet=*/!verbose, &MountMain);
}

int UmountHelperMain(int argc, char** argv) {
  const char* name = "umount.fuse.weightfs";
  std::vector<std::string> positionals;
  bool lazy = false, verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-t" || a == "-N") {
      ++i;
    } else if (a.starts_with("-") && a.size() > 1 && !a.starts_with("--")) {
      // Flags may come combined (-lv). -l: lazy; -v: verbose; -f (force), -n (no mtab) and
      // -r (remount read-only on failure) have no meaning for a FUSE daemon.
      for (char f : a.substr(1)) {
        if (f == 'l') lazy = true;
        if (f == 'v') verbose = true;
      }
    } else {
      positionals.push_back(a);
    }
  }
  if (positionals.size() != 1) {
    std::fprintf(stderr, "%s: expected MOUNTPOINT (run by umount(8) for fuse.weightfs)\n", name);
    return 2;
  }
  std::vector<std::string> args = {"unmount", positionals[0]};
  if (lazy) args.push_back("--lazy");
  return Run(std::move(args), /*quiet=*/!verbose, &UnmountMain);
}

}  // namespace weightfs::cli
