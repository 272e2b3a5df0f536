// What `cmake --install` ships, used the way an administrator uses it:
//   - the files: weightfs, the mount(8)/umount(8) helpers (links to it), the systemd unit, all
//     in the install manifest (uninstall), under --prefix and under DESTDIR;
//   - an /etc/fstab line mounted by `mount -a` through the installed mount.fuse.weightfs, and
//     `umount` through umount.fuse.weightfs publishing the drafts (or failing, mount kept, when
//     they cannot be published). mount(8) only looks for helpers in /sbin, so these run in a
//     private mount namespace (unshare -m) with a tmpfs on /usr/sbin holding the installed
//     helpers: the host's /sbin is never touched;
//   - the systemd service template, run the way systemd runs it (this container's PID 1 is not
//     systemd): its Exec lines with systemd's specifier and variable expansion, no HOME, a
//     NOTIFY_SOCKET waiting for READY=1, stderr as the journal stream; started, killed (a
//     crash), restarted (the draft resumes), stopped (the draft is published);
//   - the units pass `systemd-analyze verify`.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using test::CommandResult;
using test::ProcessGone;
using test::Shell;
using test::SlurpText;
using test::TempDir;

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string Sha256Of(const std::string& path) {
  CommandResult r = Shell("sha256sum " + Quote(path));
  return r.exit_code == 0 ? r.out.substr(0, 64) : "sha256sum failed: " + r.out;
}

// A work directory with a generated model (data/v000, data/v001), a bucket holding acme/m@v0
// and @v1, and weightfs installed under prefix/ by `cmake --install`.
class InstallTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(work_.ok());
    prefix_ = work_.Join("prefix");
    data_ = work_.Join("data");
    bucket_ = work_.Join("bucket");
    CommandResult install = Install(prefix_, "", work_.Join("manifest"));
    ASSERT_EQ(install.exit_code, 0) << install.out;
    wfs_ = prefix_ + "/bin/weightfs";
    CommandResult gen = Shell(wfs_ + " gen " + data_ + " --params 1M --versions 1 --seed 3");
    ASSERT_EQ(gen.exit_code, 0) << gen.out;
    CommandResult init = Shell(wfs_ + " init " + bucket_);
    ASSERT_EQ(init.exit_code, 0) << init.out;
    for (int v = 0; v <= 1; ++v) {
      CommandResult push = Shell(wfs_ + " push " + bucket_ + " acme/m@v" + std::to_string(v) + " " + data_ + "/v00" +
                                 std::to_string(v) + " --no-cache");
      ASSERT_EQ(push.exit_code, 0) << push.out;
    }
  }

  // `cmake --install` of this build tree under `prefix` (with DESTDIR=`destdir` unless empty);
  // its manifest copied to `manifest`. ctest runs these tests in parallel and every install
  // writes the build tree's manifest: each install and its copy hold a lock.
  static CommandResult Install(const std::string& prefix, const std::string& destdir, const std::string& manifest) {
    const std::string build = WEIGHTFS_BUILD_DIR;
    return Shell("flock " + build + "/install_manifest_weightfs.lock sh -c '" +
                 (destdir.empty() ? "" : "DESTDIR=" + destdir + " ") + WEIGHTFS_CMAKE + " --install " + build +
                 " --prefix " + prefix + " --component weightfs && cp " + build + "/install_manifest_weightfs.txt " +
                 manifest + "'");
  }

  void TearDown() override {
    // A daemon a failed test left behind (in a namespace nobody can see) is stopped here.
    for (pid_t pid : daemons_) {
      if (pid > 0 && !ProcessGone(pid)) ::kill(pid, SIGKILL);
    }
  }

  // Runs `script` (bash) as root in a private mount namespace whose /usr/sbin (= /sbin) holds
  // only the installed mount helpers, bounded in time.
  CommandResult InNamespace(const std::string& script) {
    const std::string path = work_.Join("ns.sh");
    std::ofstream(path) << "set -eu\n"
                        << "mount --make-rprivate /\n"
                        << "mount -t tmpfs tmpfs /usr/sbin\n"
                        << "ln -s " << prefix_ << "/sbin/mount.fuse.weightfs /usr/sbin/mount.fuse.weightfs\n"
                        << "ln -s " << prefix_ << "/sbin/umount.fuse.weightfs /usr/sbin/umount.fuse.weightfs\n"
                        << script;
    return Shell("timeout 120 unshare -m bash " + path);
  }

  // The draft's version as `weightfs pull` gets it from the bucket: SHA-256 of model.safetensors.
  std::string PulledSha(const std::string& version) {
    const std::string out = work_.Join("pulled-" + version);
    CommandResult pull = Shell(wfs_ + " pull " + bucket_ + " acme/m@" + version + " " + out + " --no-cache");
    if (pull.exit_code != 0) return "pull failed: " + pull.out;
    return Sha256Of(out + "/model.safetensors");
  }

  TempDir work_{"install"};
  std::string prefix_, data_, bucket_, wfs_;
  std::vector<pid_t> daemons_;
};

TEST_F(InstallTest, PutsTheBinaryTheMountHelpersAndTheUnitUnderThePrefixAndListsThemForUninstall) {
  struct stat st;
  ASSERT_EQ(::stat(wfs_.c_str(), &st), 0);
  EXPECT_TRUE(st.st_mode & S_IXUSR);
  for (const char* helper : {"mount.fuse.weightfs", "umount.fuse.weightfs"}) {
    const fs::path link = fs::path(prefix_) / "sbin" / helper;
    ASSERT_TRUE(fs::is_symlink(link)) << link;
    EXPECT_EQ(fs::read_symlink(link), fs::path(wfs_));
  }
  CommandResult help = Shell(prefix_ + "/sbin/mount.fuse.weightfs --help");
  EXPECT_EQ(help.exit_code, 0) << help.out;
  EXPECT_NE(help.out.find("fuse.weightfs"), std::string::npos) << help.out;
  // fstab's uid, gid, file_mode and dir_mode are the mount's options (-f: pretend, -v: say).
  CommandResult fstab = Shell(prefix_ + "/sbin/mount.fuse.weightfs -f -v /b /m -o _netdev,uid=5,gid=6,file-mode=0440,dir_mode=0550 2>&1");
  EXPECT_EQ(fstab.exit_code, 0) << fstab.out;
  EXPECT_NE(fstab.out.find("mount /b /m --uid 5 --gid 6 --file-mode 0440 --dir-mode 0550"), std::string::npos) << fstab.out;
  EXPECT_EQ(fstab.out.find(" -o "), std::string::npos) << fstab.out;
  const std::string unit = SlurpText(prefix_ + "/lib/systemd/system/weightfs@.service");
  EXPECT_NE(unit.find("ExecStart=" + wfs_ + " mount --foreground"), std::string::npos) << unit;
  EXPECT_NE(unit.find("ExecStop=" + wfs_ + " unmount %f"), std::string::npos) << unit;
  EXPECT_TRUE(fs::exists(prefix_ + "/share/doc/weightfs/examples/fstab.example"));
  EXPECT_TRUE(fs::exists(prefix_ + "/share/doc/weightfs/operations.md"));

  // Uninstall as the README says: every installed file is in the manifest.
  CommandResult rm = Shell("xargs rm < " + work_.Join("manifest"));
  ASSERT_EQ(rm.exit_code, 0) << rm.out;
  std::vector<std::string> left;
  for (const auto& e : fs::recursive_directory_iterator(prefix_)) {
    if (!e.is_directory() || e.is_symlink()) left.push_back(e.path().string());
  }
  EXPECT_TRUE(left.empty()) << "left after uninstalling: " << left.front();
}

TEST_F(InstallTest, DestdirInstallOfTheSystemPrefixPutsTheHelpersWhereMountLooks) {
  const std::string dest = work_.Join("dest");
  CommandResult install = Install("/usr/local", dest, work_.Join("manifest-destdir"));
  ASSERT_EQ(install.exit_code, 0) << install.out;
  EXPECT_TRUE(fs::exists(dest + "/usr/local/bin/weightfs"));
  // libmount searches /sbin; on a merged /usr (/sbin -> usr/sbin) that is /usr/sbin.
  const std::string sbin = fs::is_symlink("/sbin") ? "/usr/sbin" : "/sbin";
  for (const char* helper : {"mount.fuse.weightfs", "umount.fuse.weightfs"}) {
    const fs::path link = fs::path(dest + sbin) / helper;
    ASSERT_TRUE(fs::is_symlink(link)) << install.out;
    EXPECT_EQ(fs::read_symlink(link), fs::path("/usr/local/bin/weightfs"));
  }
  const std::string unit = SlurpText(dest + "/usr/local/lib/systemd/system/weightfs@.service");
  EXPECT_NE(unit.find("ExecStart=/usr/local/bin/weightfs mount"), std::string::npos) << unit;
}

TEST_F(InstallTest, MountHelperTurnsFstabOptionsIntoMountOptions) {
  // -f (fake) -v: mount(8)'s flags; the helper prints the command it would run and stops.
  CommandResult r = Shell(prefix_ + "/sbin/mount.fuse.weightfs /b /m -v -f -o '"
                          "rw,_netdev,nofail,cache_dir=/c,cache-size=1G,log_level=debug,ro,allow_other,"
                          "x-systemd.requires=x.service,no_sign_request,default_permissions,comment=\"a,b\"'");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("weightfs mount /b /m --cache-dir /c --cache-size 1G --log-level debug --read-only "
                       "--allow-other --no-sign-request -o default_permissions\n"),
            std::string::npos)
      << r.out;
  CommandResult bad = Shell(prefix_ + "/sbin/mount.fuse.weightfs /b /m -o cache_dir");
  EXPECT_EQ(bad.exit_code, 2) << bad.out;
  EXPECT_NE(bad.out.find("option cache_dir needs a value (cache_dir=...)"), std::string::npos) << bad.out;
}

TEST_F(InstallTest, FstabLineMountsAtMountAAndUmountPublishesTheDrafts) {
  const std::string mnt = work_.Join("mnt"), cache = work_.Join("cache"), log = work_.Join("mount.log");
  fs::create_directories(mnt);
  std::ofstream(work_.Join("fstab")) << bucket_ << " " << mnt << " fuse.weightfs _netdev,nofail,cache_dir=" << cache
                                     << ",log_file=" << log << ",log_level=debug,x-systemd.mount-timeout=5min 0 0\n";
  const std::string out = work_.Join("out");
  CommandResult r = InNamespace(
      "mount -a -T " + work_.Join("fstab") + "\n" +
      "python3 -c 'import os,sys; print(os.getxattr(sys.argv[1], \"user.weightfs.pid\").decode())' " + mnt + " > " +
      out + ".pid\n" + "grep ' " + mnt + " ' /proc/self/mounts > " + out + ".mounts\n" +
      "sha256sum " + mnt + "/acme/m@v1/model.safetensors > " + out + ".sha\n" +
      "mkdir " + mnt + "/acme/m@v2\n" +
      "cp " + data_ + "/v001/config.json " + data_ + "/v000/model.safetensors " + mnt + "/acme/m@v2/\n" +
      "umount " + mnt + " > " + out + ".umount 2>&1\n" +
      // What umount returned to: the daemon gone (it published first; a zombie nobody reaped
      // yet counts as gone), the mount gone.
      "pid=$(cat " + out + ".pid)\n" +
      "if [ -e /proc/$pid ] && [ \"$(cut -d' ' -f3 /proc/$pid/stat)\" != Z ]; then echo daemon-running; "
      "else echo daemon-gone; fi\n" +
      "grep -c ' " + mnt + " ' /proc/self/mounts || true\n");
  const pid_t pid = std::atoi(SlurpText(out + ".pid").c_str());
  daemons_.push_back(pid);
  ASSERT_EQ(r.exit_code, 0) << r.out << "\nthe daemon's log:\n" << test::TailOfFile(log);
  EXPECT_NE(SlurpText(out + ".mounts").find("weightfs:" + bucket_ + " " + mnt + " fuse.weightfs"), std::string::npos)
      << SlurpText(out + ".mounts");
  EXPECT_EQ(SlurpText(out + ".sha").substr(0, 64), Sha256Of(data_ + "/v001/model.safetensors"));
  EXPECT_NE(r.out.find("daemon-gone\n0\n"), std::string::npos) << r.out;
  // The options reached the daemon: its log file, at debug level, and its cache directory.
  EXPECT_NE(SlurpText(log).find("[debug]"), std::string::npos);
  EXPECT_TRUE(fs::exists(cache + "/drafts"));
  EXPECT_EQ(PulledSha("v2"), Sha256Of(data_ + "/v000/model.safetensors"));
}

TEST_F(InstallTest, UmountKeepsTheMountWhenItsDraftsCannotBePublished) {
  const std::string mnt = work_.Join("mnt"), log = work_.Join("mount.log");
  fs::create_directories(mnt);
  std::ofstream(work_.Join("fstab")) << bucket_ << " " << mnt << " fuse.weightfs cache_dir=" << work_.Join("cache")
                                     << ",log_file=" << log << " 0 0\n";
  const std::string out = work_.Join("out");
  CommandResult r = InNamespace(
      "mount " + mnt + " -T " + work_.Join("fstab") + "\n" +
      "python3 -c 'import os,sys; print(os.getxattr(sys.argv[1], \"user.weightfs.pid\").decode())' " + mnt + " > " +
      out + ".pid\n" + "mkdir " + mnt + "/acme/m@v2\n" + "cp " + data_ + "/v000/model.safetensors " + mnt +
      "/acme/m@v2/\n" +
      // The bucket becomes read-only (for this namespace, where the daemon runs): nothing can
      // be published, so umount must fail and leave the mount.
      "mount --bind -o ro " + bucket_ + " " + bucket_ + "\n" +
      // -c (no canonicalization) as systemd runs it: umount(8) then reads the type from the
      // mount table (fuse.weightfs) and runs umount.fuse.weightfs. (A bare umount of a mount
      // without mount(8) options takes the type from statfs, "fuse", and runs no helper.)
      "if umount -c " + mnt + " > " + out + ".umount1 2>&1; then echo umount-succeeded; fi\n" +
      "grep -c ' " + mnt + " ' /proc/self/mounts > " + out + ".count1\n" +
      "umount " + bucket_ + "\n" +
      "umount -c " + mnt + "\n" +
      "grep -c ' " + mnt + " ' /proc/self/mounts > " + out + ".count2 || true\n");
  daemons_.push_back(std::atoi(SlurpText(out + ".pid").c_str()));
  ASSERT_EQ(r.exit_code, 0) << r.out << "\nthe daemon's log:\n" << test::TailOfFile(log);
  EXPECT_EQ(r.out.find("umount-succeeded"), std::string::npos) << r.out;
  EXPECT_EQ(SlurpText(out + ".count1"), "1\n") << "mounted after the failed umount";
  EXPECT_EQ(SlurpText(out + ".count2"), "0\n") << "gone after the second";
  const std::string refused = SlurpText(out + ".umount1");
  EXPECT_NE(refused.find("could not be published"), std::string::npos) << refused;
  EXPECT_NE(refused.find("--keep-drafts"), std::string::npos) << refused;
  EXPECT_EQ(PulledSha("v2"), Sha256Of(data_ + "/v000/model.safetensors"));
}

// ---- the systemd service template, run as systemd runs it ----

// The [Service] settings of a unit file, in order (keys repeat).
std::vector<std::pair<std::string, std::string>> ServiceSettings(const std::string& unit_text) {
  std::vector<std::pair<std::string, std::string>> out;
  std::istringstream in(unit_text);
  std::string line, section;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line[0] == '[') {
      section = line;
      continue;
    }
    const size_t eq = line.find('=');
    if (section == "[Service]" && eq != std::string::npos) out.emplace_back(line.substr(0, eq), line.substr(eq + 1));
  }
  return out;
}

// systemd's expansion of an Exec line (systemd.service(5), "Command lines"): specifiers %i, %f
// and %%; "${VAR}" one argument, "$VAR" split at whitespace; a leading '-' lets it fail.
// Anything else this runner does not know fails the test instead of being guessed.
struct ExecLine {
  std::vector<std::string> argv;
  bool may_fail = false;
};

::testing::AssertionResult ExpandExec(std::string line, const std::map<std::string, std::string>& specifiers,
                                      const std::map<std::string, std::string>& env, ExecLine* out) {
  out->may_fail = !line.empty() && line[0] == '-';
  if (out->may_fail) line.erase(0, 1);
  if (line.empty() || line[0] != '/') return ::testing::AssertionFailure() << "unsupported Exec line: " << line;
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    if (word.find('"') != std::string::npos || word.find('\\') != std::string::npos) {
      return ::testing::AssertionFailure() << "quotes or escapes are not supported here: " << line;
    }
    std::string spec;
    for (size_t i = 0; i < word.size(); ++i) {
      if (word[i] != '%') {
        spec += word[i];
        continue;
      }
      const std::string key = word.substr(i + 1, 1);
      auto it = specifiers.find(key);
      if (it == specifiers.end()) return ::testing::AssertionFailure() << "unknown specifier %" << key << " in " << line;
      spec += it->second;
      ++i;
    }
    auto value = [&](const std::string& name) {
      auto it = env.find(name);
      return it == env.end() ? std::string() : it->second;
    };
    static const std::regex braced(R"(^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$)"), bare(R"(^\$([A-Za-z_][A-Za-z0-9_]*)$)");
    std::smatch m;
    if (std::regex_match(spec, m, braced)) {
      out->argv.push_back(value(m[1]));
    } else if (std::regex_match(spec, m, bare)) {
      std::istringstream split(value(m[1]));
      for (std::string w; split >> w;) out->argv.push_back(w);
    } else if (spec.find('$') != std::string::npos) {
      return ::testing::AssertionFailure() << "unsupported variable use '" << spec << "' in " << line;
    } else {
      out->argv.push_back(spec);
    }
  }
  return ::testing::AssertionSuccess();
}

// KEY=VALUE lines of an EnvironmentFile (no quoting used in these tests).
std::map<std::string, std::string> ReadEnvironmentFile(const std::string& path) {
  std::map<std::string, std::string> env;
  std::istringstream in(SlurpText(path));
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t eq = line.find('=');
    if (eq != std::string::npos) env[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return env;
}

// Starts `argv` with exactly `env`, stdout and stderr appended to `output`; dies with the test.
pid_t Spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& output) {
  std::vector<std::string> env_lines;
  for (const auto& [k, v] : env) env_lines.push_back(k + "=" + v);
  std::vector<char*> args, envp;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  for (const std::string& e : env_lines) envp.push_back(const_cast<char*>(e.c_str()));
  args.push_back(nullptr);
  envp.push_back(nullptr);
  const int out = ::open(output.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(126);
    const int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    ::dup2(out, 1);
    ::dup2(out, 2);
    ::close_range(3, ~0U, 0);
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(out);
  return pid;
}

// The exit status of `pid` (waitpid's), or -1 if it has not exited within `bound`.
int WaitExit(pid_t pid, std::chrono::seconds bound) {
  const auto deadline = Clock::now() + bound;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// The socket systemd passes as NOTIFY_SOCKET to a Type=notify service.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    bound_ = ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  ~NotifySocket() { ::close(fd_); }
  bool ok() const { return bound_; }
  const std::string& path() const { return path_; }
  // The next message, or "" if none came within `bound`.
  std::string Next(std::chrono::milliseconds bound) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(bound.count())) != 1) return "";
    char buf[4096];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

 private:
  std::string path_;
  int fd_ = -1;
  bool bound_ = false;
};

// weightfs@INSTANCE.service as systemd would run it: the same environment rules, the same
// command lines, the same order (ExecStartPre, ExecStart until READY=1; ExecStop, then the
// main process must exit). /etc/weightfs/ is read from `etc_dir` instead (the test does not
// write to /etc); CacheDirectory= is not made (the .conf names the cache directory).
class ServiceRunner {
 public:
  ServiceRunner(const std::string& unit_path, const std::string& instance, const std::string& path,
                const std::string& etc_dir, const std::string& journal)
      : settings_(ServiceSettings(SlurpText(unit_path))), journal_(journal) {
    specifiers_ = {{"i", instance}, {"f", path}, {"%", "%"}};
    env_ = {{"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, {"LANG", "C.UTF-8"}};
    for (const auto& [key, value] : settings_) {
      if (key == "Environment") {
        const size_t eq = value.find('=');
        env_[value.substr(0, eq)] = value.substr(eq + 1);
      } else if (key == "EnvironmentFile") {
        std::string file = value;
        for (auto [from, to] : std::map<std::string, std::string>{{"%i", instance}}) {
          for (size_t p; (p = file.find(from)) != std::string::npos;) file.replace(p, from.size(), to);
        }
        if (file.starts_with("/etc/weightfs/")) file = etc_dir + file.substr(13);
        for (const auto& [k, v] : ReadEnvironmentFile(file)) env_[k] = v;
      }
    }
  }

  // Runs ExecStartPre, starts ExecStart and waits for READY=1 on `notify`.
  ::testing::AssertionResult Start(NotifySocket& notify) {
    env_["NOTIFY_SOCKET"] = notify.path();
    for (const auto& [key, value] : settings_) {
      if (key != "ExecStartPre") continue;
      if (auto r = RunToEnd(value); !r) return r;
    }
    ExecLine start;
    if (auto r = ExpandExec(Setting("ExecStart"), specifiers_, env_, &start); !r) return r;
    // stderr is the journal's stream: JOURNAL_STREAM names it (device:inode), as systemd sets it.
    std::ofstream(journal_, std::ios::app).flush();
    struct stat st;
    ::stat(journal_.c_str(), &st);
    std::map<std::string, std::string> env = env_;
    env["JOURNAL_STREAM"] = std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
    main_ = Spawn(start.argv, env, journal_);
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < deadline) {
      const std::string msg = notify.Next(std::chrono::milliseconds(100));
      if (msg.find("READY=1") != std::string::npos) return ::testing::AssertionSuccess();
      int status = 0;
      if (::waitpid(main_, &status, WNOHANG) == main_) {
        main_ = -1;
        return ::testing::AssertionFailure() << "ExecStart exited before READY=1 (status " << status << "):\n"
                                             << SlurpText(journal_);
      }
    }
    return ::testing::AssertionFailure() << "no READY=1 within 60 s:\n" << SlurpText(journal_);
  }

  // Runs ExecStop and waits for the main process; its exit status.
  ::testing::AssertionResult Stop(int* main_status) {
    if (auto r = RunToEnd(Setting("ExecStop")); !r) return r;
    *main_status = main_ > 0 ? WaitExit(main_, std::chrono::seconds(30)) : 0;
    main_ = -1;
    return ::testing::AssertionSuccess();
  }

  // A crash: SIGKILL to the main process.
  void Kill() {
    ::kill(main_, SIGKILL);
    WaitExit(main_, std::chrono::seconds(10));
    main_ = -1;
  }

  pid_t main() const { return main_; }
  ~ServiceRunner() {
    if (main_ > 0) {
      ::kill(main_, SIGKILL);
      WaitExit(main_, std::chrono::seconds(10));
    }
  }

 private:
  std::string Setting(const std::string& key) const {
    for (const auto& [k, v] : settings_) {
      if (k == key) return v;
    }
    return "";
  }
  ::testing::AssertionResult RunToEnd(const std::string& line) {
    ExecLine exec;
    if (auto r = ExpandExec(line, specifiers_, env_, &exec); !r) return r;
    const pid_t pid = Spawn(exec.argv, env_, journal_);
    const int status = WaitExit(pid, std::chrono::seconds(60));
    if (status == -1) {
      ::kill(pid, SIGKILL);
      WaitExit(pid, std::chrono::seconds(10));
      return ::testing::AssertionFailure() << line << ": did not finish in 60 s";
    }
    if (!exec.may_fail && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      return ::testing::AssertionFailure() << line << ": status " << status << ":\n" << SlurpText(journal_);
    }
    return ::testing::AssertionSuccess();
  }

  std::vector<std::pair<std::string, std::string>> settings_;
  std::map<std::string, std::string> specifiers_, env_;
  std::string journal_;
  pid_t main_ = -1;
};

std::string SystemdEscapePath(const std::string& path) {
  CommandResult r = test::RunShell("systemd-escape --path " + Quote(path));
  while (!r.out.empty() && r.out.back() == '\n') r.out.pop_back();
  return r.exit_code == 0 ? r.out : "";
}

TEST_F(InstallTest, ServiceUnitStartsStopsPublishingDraftsAndRestartsResumingThem) {
  const std::string mnt = work_.Join("svc/mnt");  // ExecStartPre makes it
  const std::string instance = SystemdEscapePath(mnt);
  ASSERT_FALSE(instance.empty()) << "systemd-escape is missing: run scripts/setup.sh (installs systemd)";
  const std::string etc = work_.Join("etc-weightfs");
  fs::create_directories(etc);
  std::ofstream(etc + "/" + instance + ".conf") << "# as weightfs.conf.example\nBUCKET=" << bucket_
                                                << "\nWEIGHTFS_OPTIONS=--log-level info --refresh 1\n"
                                                << "WEIGHTFS_CACHE_DIR=" << work_.Join("svc-cache") << "\n";
  const std::string journal = work_.Join("journal.txt");
  // A failure that leaves the service's mount (a killed daemon's) detaches it; declared before
  // the runner, so that this runs after the runner has killed its main process.
  struct DetachAtExit {
    std::string mnt;
    ~DetachAtExit() {
      if (test::MountedAt(mnt)) Shell("umount -l " + mnt);
    }
  } detach{mnt};
  NotifySocket notify(work_.Join("notify.sock"));
  ASSERT_TRUE(notify.ok());
  ServiceRunner service(prefix_ + "/lib/systemd/system/weightfs@.service", instance, mnt, etc, journal);

  ASSERT_TRUE(service.Start(notify));
  EXPECT_EQ(Sha256Of(mnt + "/acme/m@v1/model.safetensors"), Sha256Of(data_ + "/v001/model.safetensors"));
  // The log went to the journal stream, with the journal's priority prefix.
  EXPECT_NE(SlurpText(journal).find("<6>mounted file://" + bucket_ + " at " + mnt), std::string::npos)
      << SlurpText(journal);

  // A draft, then a crash before it is published.
  ASSERT_TRUE(fs::create_directory(mnt + "/acme/m@v2"));
  // (The draft shows its parent's files until they are replaced.)
  fs::copy_file(data_ + "/v000/model.safetensors", mnt + "/acme/m@v2/model.safetensors",
                fs::copy_options::overwrite_existing);
  // The kernel sends a file's release after close() returns: wait until the daemon has it.
  bool staged = false;
  for (const auto deadline = Clock::now() + std::chrono::seconds(30); !staged && Clock::now() < deadline;) {
    CommandResult st = test::RunShell(wfs_ + " status " + mnt + " --json");
    const nlohmann::json j = nlohmann::json::parse(st.out, nullptr, false);
    if (!j.is_discarded() && j.contains("drafts") && j["drafts"].size() == 1) {
      const auto& d = j["drafts"][0];
      staged = d.value("staged_files", 0) == 1 && d.value("open_for_writing", 1) == 0;
    }
    if (!staged) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(staged);
  service.Kill();

  // Restart=on-failure: systemd runs ExecStop (the mount is dead: it is detached), then starts
  // again; the new mount resumes the draft.
  int status = 0;
  ASSERT_TRUE(service.Stop(&status));
  ASSERT_TRUE(service.Start(notify));
  EXPECT_EQ(Sha256Of(mnt + "/acme/m@v2/model.safetensors"), Sha256Of(data_ + "/v000/model.safetensors"));
  EXPECT_EQ(PulledSha("v2").substr(0, 5), "pull ") << "published before the stop";

  // Stop: the draft is published, the daemon exits 0, the mount is gone.
  ASSERT_TRUE(service.Stop(&status));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status << "\n" << SlurpText(journal);
  EXPECT_EQ(PulledSha("v2"), Sha256Of(data_ + "/v000/model.safetensors"));
  EXPECT_EQ(notify.Next(std::chrono::milliseconds(1000)).find("STOPPING=1"), 0u);
  EXPECT_FALSE(test::MountedAt(mnt));
}

TEST_F(InstallTest, UnitsPassSystemdAnalyzeVerify) {
  const std::string dir = work_.Join("units");
  fs::create_directories(dir);
  fs::copy_file(prefix_ + "/lib/systemd/system/weightfs@.service", dir + "/weightfs@.service");
  fs::copy_file(prefix_ + "/share/doc/weightfs/examples/mnt-weights.mount", dir + "/mnt-weights.mount");
  CommandResult r = Shell("cd " + dir + " && timeout 60 systemd-analyze verify " + dir + "/weightfs@mnt-weights.service " +
                          dir + "/mnt-weights.mount");
  EXPECT_EQ(r.exit_code, 0) << "systemd-analyze (scripts/setup.sh installs systemd): " << r.out;
  EXPECT_EQ(r.out, "");
}

}  // namespace
}  // namespace weightfs
