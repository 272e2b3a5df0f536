// A randomized reference-model test of draft semantics, in the spirit of xfstests' fsx and
// mountpoint-s3's property tests: a long random sequence of file operations on a draft of a
// real mount — create, open (with and without O_TRUNC), pwrite (holes, appends, writes across
// the parent's chunks of an inherited file), writes through a shared mmap, ftruncate and
// truncate, fsync, close (which starts the file's background encode), rename (over files too),
// unlink (of open files too), mkdir/rmdir, reads — with every result compared with a model kept
// in memory (POSIX semantics: a descriptor keeps its file across rename and unlink). At random
// points the test commits (and checks the published version), or kills the daemon with
// SIGKILL — also while a commit runs — and mounts again: every acknowledged change must be
// there after the remount. At the end a fresh mount with an empty cache reads every published
// version back and compares it with the model's snapshot.
//
// WEIGHTFS_MODEL_OPS (default 100000) operations, WEIGHTFS_MODEL_SEED (default: random,
// printed) for a replay; a failure prints the seed, the operation number and the last
// operations.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/fs/draft_mount.h"

namespace weightfs {
namespace {

using namespace weightfs::test;

struct FileObj {
  std::vector<uint8_t> bytes;
};

struct Handle {
  int fd = -1;
  std::shared_ptr<FileObj> file;
};

class DraftModelTest : public DraftMountTest {
 protected:
  std::mt19937_64 rng_;
  Mount* m_ = nullptr;
  int draft_no_ = 0;
  std::string draft_;  // "m/x@dN"
  std::map<std::string, std::shared_ptr<FileObj>> files_;
  std::set<std::string> dirs_;
  std::vector<Handle> open_;
  // Published versions and what they must hold.
  std::map<std::string, std::map<std::string, std::vector<uint8_t>>> published_;
  std::deque<std::string> log_;  // the last operations, for a failure's message
  uint64_t op_ = 0;
  std::map<std::string, uint64_t> counts_;

  uint64_t Uniform(uint64_t lo, uint64_t hi) { return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_); }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  fs::path DraftDir() const { return m_->Dir(draft_); }
  fs::path PathOf(const std::string& p) const { return DraftDir() / p; }

  void Note(const std::string& what) {
    log_.push_back(std::to_string(op_) + ": " + what);
    if (log_.size() > 40) log_.pop_front();
  }
  std::string Trail() const {
    std::string out = "last operations:\n";
    for (const std::string& l : log_) out += "  " + l + "\n";
    return out;
  }

  std::vector<uint8_t> Bytes(size_t n) {
    std::vector<uint8_t> v(n);
    // Runs of one value and random bytes both: bf16-ish data and zeros look like this.
    for (size_t i = 0; i < n;) {
      const size_t run = std::min<size_t>(n - i, Uniform(1, 4096));
      if (Chance(0.3)) {
        std::fill(v.begin() + static_cast<std::ptrdiff_t>(i), v.begin() + static_cast<std::ptrdiff_t>(i + run),
                  static_cast<uint8_t>(rng_()));
      } else {
        for (size_t k = 0; k < run; ++k) v[i + k] = static_cast<uint8_t>(rng_());
      }
      i += run;
    }
    return v;
  }

  std::string RandomDir() {
    std::vector<std::string> all = {""};
    all.insert(all.end(), dirs_.begin(), dirs_.end());
    return all[Uniform(0, all.size() - 1)];
  }
  std::string NewName() {
    static const char* names[] = {"a", "b", "c", "d", "e", "f.bin", "g.safetensors", "h"};
    const std::string dir = RandomDir();
    return (dir.empty() ? "" : dir + "/") + names[Uniform(0, 7)];
  }
  std::string RandomFile() {
    if (files_.empty()) return "";
    auto it = files_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(Uniform(0, files_.size() - 1)));
    return it->first;
  }
  // The directory of path `p` exists in the model (or is the draft itself).
  bool DirExists(const std::string& p) const {
    const size_t slash = p.rfind('/');
    return slash == std::string::npos || dirs_.count(p.substr(0, slash));
  }
  bool HasEntriesUnder(const std::string& dir) const {
    for (const auto& [p, f] : files_) {
      if (p.starts_with(dir + "/")) return true;
    }
    for (const std::string& d : dirs_) {
      if (d.starts_with(dir + "/")) return true;
    }
    return false;
  }

  static void Resize(FileObj& f, uint64_t size) { f.bytes.resize(size, 0); }
  static void Put(FileObj& f, uint64_t off, const std::vector<uint8_t>& data) {
    if (f.bytes.size() < off + data.size()) f.bytes.resize(off + data.size(), 0);
    std::memcpy(f.bytes.data() + off, data.data(), data.size());
  }

  // Every file and directory of the draft (or of `dir`, a published version) as the model says.
  void CheckTree(const fs::path& dir, const std::map<std::string, std::vector<uint8_t>>& want,
                 const std::string& what) {
    ASSERT_EQ(FilesUnder(dir), [&] {
      std::set<std::string> s;
      for (const auto& [p, b] : want) s.insert(p);
      return s;
    }()) << what << "\n" << Trail();
    for (const auto& [p, bytes] : want) {
      const std::vector<uint8_t> got = Slurp(dir / p);
      ASSERT_EQ(got.size(), bytes.size()) << what << ": " << p << "\n" << Trail();
      ASSERT_TRUE(got == bytes) << what << ": " << p << " differs\n" << Trail();
    }
  }
  std::map<std::string, std::vector<uint8_t>> Snapshot() const {
    std::map<std::string, std::vector<uint8_t>> out;
    for (const auto& [p, f] : files_) out[p] = f->bytes;
    return out;
  }

  void CloseAll() {
    for (Handle& h : open_) ::close(h.fd);
    open_.clear();
  }

  void NewDraft() {
    draft_ = "m/x@d" + std::to_string(++draft_no_);
    ASSERT_EQ(Errno(::mkdir(DraftDir().c_str(), 0755)), 0) << draft_ << ": " << std::strerror(errno) << m_->Describe();
  }

  // The draft published as itself: checked through the mount, remembered for the fresh mount.
  void Published() {
    const std::string version = draft_.substr(draft_.rfind('@') + 1);
    published_[draft_] = Snapshot();
    ASSERT_NO_FATAL_FAILURE(CheckTree(DraftDir(), published_[draft_], "published " + draft_));
    counts_["published"]++;
    // A version is its files: the next draft has the directories that hold them, no others.
    dirs_.clear();
    for (const auto& [p, f] : files_) {
      for (size_t slash = p.find('/'); slash != std::string::npos; slash = p.find('/', slash + 1)) {
        dirs_.insert(p.substr(0, slash));
      }
    }
    NewDraft();
  }

  void Commit() {
    CloseAll();
    Note("commit " + draft_);
    Result c = m_->Commit(draft_);
    ASSERT_EQ(c.exit_code, 0) << c.out << m_->Describe() << Trail();
    ASSERT_NO_FATAL_FAILURE(Published());
  }

  // SIGKILL (during a commit if `committing`), mount again, and check that nothing
  // acknowledged is lost.
  void KillAndRemount(bool committing) {
    if (committing) CloseAll();  // (a commit waits for writers; without one, files stay open)
    Note(std::string("kill -9") + (committing ? " during a commit" : ""));
    std::thread commit;
    Result commit_result;
    if (committing) {
      commit = std::thread([&] { commit_result = m_->Commit(draft_); });
      std::this_thread::sleep_for(std::chrono::milliseconds(Uniform(0, 300)));
    }
    ASSERT_TRUE(m_->Kill());
    if (commit.joinable()) commit.join();
    CloseAll();  // descriptors of the dead mount
    ASSERT_EQ(m_->Start().exit_code, 0) << m_->Describe();
    counts_["kills"]++;
    if (committing) {
      // The resumed commit finishes in the background, or the commit had not been asked yet.
      bool gone = WaitFor([&] {
        Json st = m_->DraftStatus(draft_);
        return st.is_null() || st.value("state", "") == "draft";
      }, 120s);
      ASSERT_TRUE(gone) << m_->Status().dump() << m_->Describe();
      if (m_->DraftStatus(draft_).is_null()) {
        ASSERT_NO_FATAL_FAILURE(Published());
        return;
      }
    }
    ASSERT_NO_FATAL_FAILURE(CheckTree(DraftDir(), Snapshot(), "after kill -9 and a remount"));
  }

  void Step() {
    const uint64_t kind = Uniform(0, 99);
    if (kind < 8) {  // create
      const std::string p = NewName();
      if (!DirExists(p) || dirs_.count(p)) return;
      const bool exists = files_.count(p) > 0;
      const bool excl = Chance(0.5);
      Note("create " + p + (excl ? " O_EXCL" : ""));
      int fd = ::open(PathOf(p).c_str(), O_RDWR | O_CREAT | (excl ? O_EXCL : 0), 0644);
      if (exists && excl) {
        ASSERT_EQ(fd, -1) << p << Trail();
        ASSERT_EQ(errno, EEXIST) << Trail();
        return;
      }
      ASSERT_GE(fd, 0) << p << ": " << std::strerror(errno) << Trail();
      if (!exists) files_[p] = std::make_shared<FileObj>();
      open_.push_back({fd, files_[p]});
    } else if (kind < 16) {  // open
      const std::string p = RandomFile();
      if (p.empty() || open_.size() >= 6) return;
      const bool trunc = Chance(0.2);
      Note("open " + p + (trunc ? " O_TRUNC" : ""));
      int fd = ::open(PathOf(p).c_str(), O_RDWR | (trunc ? O_TRUNC : 0));
      ASSERT_GE(fd, 0) << p << ": " << std::strerror(errno) << Trail();
      if (trunc) files_[p]->bytes.clear();
      open_.push_back({fd, files_[p]});
    } else if (kind < 40) {  // pwrite
      if (open_.empty()) return;
      Handle& h = open_[Uniform(0, open_.size() - 1)];
      const uint64_t size = h.file->bytes.size();
      const uint64_t off = Chance(0.1) ? size : Uniform(0, size + 65536);
      const uint64_t len = Chance(0.05) ? Uniform(1, 1 << 20) : Uniform(1, 32768);
      const std::vector<uint8_t> data = Bytes(len);
      Note("pwrite fd " + std::to_string(h.fd) + " " + std::to_string(off) + "+" + std::to_string(len));
      ASSERT_EQ(::pwrite(h.fd, data.data(), data.size(), static_cast<off_t>(off)), static_cast<ssize_t>(len))
          << std::strerror(errno) << Trail();
      Put(*h.file, off, data);
    } else if (kind < 48) {  // pread
      if (open_.empty()) return;
      Handle& h = open_[Uniform(0, open_.size() - 1)];
      const uint64_t size = h.file->bytes.size();
      const uint64_t off = Uniform(0, size + 100);
      const uint64_t len = Uniform(1, 200000);
      std::vector<uint8_t> got(len);
      Note("pread fd " + std::to_string(h.fd) + " " + std::to_string(off) + "+" + std::to_string(len));
      size_t done = 0;
      for (;;) {
        ssize_t n = ::pread(h.fd, got.data() + done, len - done, static_cast<off_t>(off + done));
        ASSERT_GE(n, 0) << std::strerror(errno) << Trail();
        if (n == 0) break;
        done += static_cast<size_t>(n);
        if (done == len) break;
      }
      const uint64_t want = off >= size ? 0 : std::min(len, size - off);
      ASSERT_EQ(done, want) << Trail();
      ASSERT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(done),
                             h.file->bytes.begin() + static_cast<std::ptrdiff_t>(std::min(off, size))))
          << "pread differs from the model\n" << Trail();
    } else if (kind < 53) {  // ftruncate
      if (open_.empty()) return;
      Handle& h = open_[Uniform(0, open_.size() - 1)];
      const uint64_t size = Uniform(0, h.file->bytes.size() + h.file->bytes.size() / 2 + 65536);
      Note("ftruncate fd " + std::to_string(h.fd) + " " + std::to_string(size));
      ASSERT_EQ(::ftruncate(h.fd, static_cast<off_t>(size)), 0) << std::strerror(errno) << Trail();
      Resize(*h.file, size);
    } else if (kind < 56) {  // truncate by path
      const std::string p = RandomFile();
      if (p.empty()) return;
      const uint64_t size = Uniform(0, files_[p]->bytes.size() + 65536);
      Note("truncate " + p + " " + std::to_string(size));
      ASSERT_EQ(::truncate(PathOf(p).c_str(), static_cast<off_t>(size)), 0) << std::strerror(errno) << Trail();
      Resize(*files_[p], size);
    } else if (kind < 60) {  // write through a shared map
      if (open_.empty()) return;
      Handle& h = open_[Uniform(0, open_.size() - 1)];
      const uint64_t size = h.file->bytes.size();
      if (size == 0) return;
      const uint64_t off = Uniform(0, size - 1);
      const uint64_t len = Uniform(1, std::min<uint64_t>(size - off, 65536));
      const std::vector<uint8_t> data = Bytes(len);
      Note("mmap-write fd " + std::to_string(h.fd) + " " + std::to_string(off) + "+" + std::to_string(len));
      void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, h.fd, 0);
      ASSERT_NE(p, MAP_FAILED) << std::strerror(errno) << Trail();
      std::memcpy(static_cast<uint8_t*>(p) + off, data.data(), len);
      ASSERT_EQ(::msync(p, size, MS_SYNC), 0) << std::strerror(errno) << Trail();
      ::munmap(p, size);
      Put(*h.file, off, data);
    } else if (kind < 63) {  // fsync
      if (open_.empty()) return;
      Handle& h = open_[Uniform(0, open_.size() - 1)];
      Note("fsync fd " + std::to_string(h.fd));
      ASSERT_EQ(::fsync(h.fd), 0) << std::strerror(errno) << Trail();
    } else if (kind < 73) {  // close: the file's encode starts
      if (open_.empty()) return;
      const size_t i = Uniform(0, open_.size() - 1);
      Note("close fd " + std::to_string(open_[i].fd));
      ASSERT_EQ(::close(open_[i].fd), 0) << std::strerror(errno) << Trail();
      open_.erase(open_.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (kind < 78) {  // rename a file
      const std::string from = RandomFile();
      const std::string to = NewName();
      if (from.empty() || !DirExists(to) || dirs_.count(to)) return;
      Note("rename " + from + " -> " + to);
      ASSERT_EQ(Errno(::rename(PathOf(from).c_str(), PathOf(to).c_str())), 0) << Trail();
      if (from != to) {
        files_[to] = files_[from];
        files_.erase(from);
      }
    } else if (kind < 82) {  // unlink
      const std::string p = RandomFile();
      if (p.empty()) return;
      Note("unlink " + p);
      ASSERT_EQ(Errno(::unlink(PathOf(p).c_str())), 0) << Trail();
      files_.erase(p);
    } else if (kind < 85) {  // mkdir / rmdir / rename a directory
      static const char* names[] = {"sub", "sub/deep", "other", "other/x"};
      const std::string d = names[Uniform(0, 3)];
      if (dirs_.count(d)) {
        if (Chance(0.5)) {
          const bool empty = !HasEntriesUnder(d);
          Note("rmdir " + d);
          ASSERT_EQ(Errno(::rmdir(PathOf(d).c_str())), empty ? 0 : ENOTEMPTY) << Trail();
          if (empty) dirs_.erase(d);
        } else {
          const std::string to = d + "-moved";
          if (!DirExists(to) || dirs_.count(to) || files_.count(to) || to.find("-moved-moved") != std::string::npos) return;
          Note("rename dir " + d + " -> " + to);
          ASSERT_EQ(Errno(::rename(PathOf(d).c_str(), PathOf(to).c_str())), 0) << Trail();
          auto move = [&](const std::string& p) { return p == d ? to : p.starts_with(d + "/") ? to + p.substr(d.size()) : p; };
          std::map<std::string, std::shared_ptr<FileObj>> files;
          for (auto& [p, f] : files_) files[move(p)] = f;
          std::set<std::string> dirs;
          for (const std::string& p : dirs_) dirs.insert(move(p));
          files_ = std::move(files);
          dirs_ = std::move(dirs);
        }
      } else if (DirExists(d) && !files_.count(d)) {
        Note("mkdir " + d);
        ASSERT_EQ(Errno(::mkdir(PathOf(d).c_str(), 0755)), 0) << Trail();
        dirs_.insert(d);
      }
    } else if (kind < 93) {  // read a whole file by path
      const std::string p = RandomFile();
      if (p.empty()) return;
      Note("read " + p);
      ASSERT_TRUE(Slurp(PathOf(p)) == files_[p]->bytes) << p << " differs from the model\n" << Trail();
    } else if (kind < 99) {  // stat
      const std::string p = RandomFile();
      if (p.empty()) return;
      struct stat st {};
      Note("stat " + p);
      ASSERT_EQ(::stat(PathOf(p).c_str(), &st), 0) << Trail();
      ASSERT_EQ(static_cast<uint64_t>(st.st_size), files_[p]->bytes.size()) << p << Trail();
    } else {  // the whole tree
      Note("check the tree");
      ASSERT_NO_FATAL_FAILURE(CheckTree(DraftDir(), Snapshot(), "the draft"));
    }
  }
};

TEST_F(DraftModelTest, RandomOperationsKillsAndCommitsMatchTheModel) {
  uint64_t ops = 100000;
  if (const char* n = std::getenv("WEIGHTFS_MODEL_OPS")) ops = std::strtoull(n, nullptr, 10);
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("WEIGHTFS_MODEL_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::printf("[ seed     ] WEIGHTFS_MODEL_SEED=%llu WEIGHTFS_MODEL_OPS=%llu\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(ops));
  rng_.seed(seed);
  // The base has small chunks so that edits of its files cross many of them (lazy copy-up).
  Generate("1M", 1);
  Result init = Cli("init " + bucket_);
  ASSERT_EQ(init.exit_code, 0) << init.out;
  Result push = Cli("push " + bucket_ + " m/x@v0 " + Source(0).string() + " --chunk-size 64KiB");
  ASSERT_EQ(push.exit_code, 0) << push.out;
  // (--allow-invalid: g.safetensors gets random bytes, stored as such.)
  Mount& m = NewMount("a", "--chunk-size 64KiB --allow-invalid");
  m_ = &m;
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  for (const std::string& f : FilesUnder(Source(0))) files_[f] = std::make_shared<FileObj>(FileObj{Slurp(Source(0) / f)});
  ASSERT_NO_FATAL_FAILURE(NewDraft());
  // Commits and kills at random points, about every 10,000 and 20,000 operations.
  const double commit_p = 1.0 / 10000, kill_p = 1.0 / 20000;
  for (op_ = 0; op_ < ops; ++op_) {
    SCOPED_TRACE("seed " + std::to_string(seed) + ", operation " + std::to_string(op_));
    if (Chance(commit_p)) {
      ASSERT_NO_FATAL_FAILURE(Commit());
    } else if (Chance(kill_p)) {
      ASSERT_NO_FATAL_FAILURE(KillAndRemount(Chance(0.5)));
    } else {
      counts_["ops"]++;
      ASSERT_NO_FATAL_FAILURE(Step());
    }
  }
  ASSERT_NO_FATAL_FAILURE(KillAndRemount(false));
  ASSERT_NO_FATAL_FAILURE(Commit());
  Result u = m.Unmount();
  ASSERT_EQ(u.exit_code, 0) << u.out << m.Describe();
  // Every published version, read through a fresh mount with an empty cache.
  Mount& fresh = NewMount("fresh");
  ASSERT_EQ(fresh.Start().exit_code, 0) << fresh.Describe();
  for (const auto& [name, want] : published_) {
    ASSERT_NO_FATAL_FAILURE(CheckTree(fresh.Dir(name), want, "fresh mount, " + name));
  }
  std::printf("[ model    ] %llu operations, %llu commits, %llu kills (seed %llu)\n",
              static_cast<unsigned long long>(counts_["ops"]), static_cast<unsigned long long>(counts_["published"]),
              static_cast<unsigned long long>(counts_["kills"]), static_cast<unsigned long long>(seed));
}

}  // namespace
}  // namespace weightfs
