// TRL delta-sync buckets (hub/trl/trl_bucket.h) through real mounts and `weightfs import`.
//
// Each test generates a small model with 10 training steps (`weightfs gen`), writes it in TRL's
// on-bucket layout with tests/tools/trl_writer.py (anchors/step_NNNNNN.safetensors plus
// deltas/step_NNNNNN.safetensors, as TRL's writer does), and mounts that directory as a bucket:
// step N must be version N-1 of the source, tensor for tensor, bit for bit. Then it breaks
// delta files (indices out of range, truncation, a wrong value dtype): reads of the steps that
// need them fail with EIO and a log line naming the file, the mount stays up. `weightfs import`
// must give weightfs versions whose files equal the mount's, and report the size per step.
//
// Every test has its own temporary directory and unmounts what it mounted, even when it fails.
// A missing /dev/fuse fails every test (with a message): CI runs as root with /dev/fuse.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/hash.h"
#include "core/safetensors.h"
#include "fs/mount_point.h"
#include "tests/testing/command_runner.h"
#include "tests/testing/mount_fixture.h"
#include "tests/testing/test_servers.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using Result = weightfs::test::CommandResult;
using weightfs::test::Cli;
using weightfs::test::CliJson;
using weightfs::test::GetXattr;
using weightfs::test::Mount;
using weightfs::test::Shell;
using weightfs::test::Slurp;
using weightfs::test::SlurpText;
using weightfs::test::TempDir;
using weightfs::test::WaitFor;
using namespace std::chrono_literals;

constexpr int kVersions = 10;  // after the base: TRL steps 1..11

// The whole file, or nullopt with errno in *err.
std::optional<std::vector<uint8_t>> ReadAll(const fs::path& p, int* err) {
  *err = 0;
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    *err = errno;
    return std::nullopt;
  }
  std::vector<uint8_t> out;
  std::vector<uint8_t> buf(1 << 20);
  while (true) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *err = errno;
      ::close(fd);
      return std::nullopt;
    }
    if (n == 0) break;
    out.insert(out.end(), buf.begin(), buf.begin() + n);
  }
  ::close(fd);
  return out;
}

// name -> bytes of every tensor of a safetensors file (empty map if it is not one).
std::map<std::string, std::vector<uint8_t>> TensorsOf(const std::vector<uint8_t>& file) {
  std::map<std::string, std::vector<uint8_t>> out;
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(file, file.size());
  if (!h.ok()) return out;
  for (const TensorInfo& t : h->tensors) {
    out[t.name].assign(file.begin() + static_cast<std::ptrdiff_t>(h->data_offset + t.begin),
                       file.begin() + static_cast<std::ptrdiff_t>(h->data_offset + t.end));
  }
  return out;
}

// The tensors of every *.safetensors file of a source version directory (shards flattened).
std::map<std::string, std::vector<uint8_t>> SourceTensors(const fs::path& dir) {
  std::map<std::string, std::vector<uint8_t>> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    for (auto& [name, bytes] : TensorsOf(Slurp(e.path()))) out[name] = std::move(bytes);
  }
  return out;
}

class TrlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = CheckFuseDevice(); !s.ok()) FAIL() << "these tests need FUSE: " << s.message();
    ASSERT_TRUE(tmp_.ok());
    root_ = tmp_.path();
    const fs::path gen = root_ / "gen";
    Result g = Cli("gen " + gen.string() + " --params 2M --versions " + std::to_string(kVersions) +
                   " --lr 1e-6 --shard-size 2MB");
    ASSERT_EQ(g.exit_code, 0) << g.out;
    gen_ = gen;
  }

  // Writes the TRL layout of the generated run into ROOT/<name> (its name is the model's).
  std::string WriteTrl(const std::string& name, const std::string& flags) {
    const fs::path out = root_ / name;
    Result w = Shell("timeout -k 5 300 /usr/bin/python3 " + std::string(WEIGHTFS_TRL_WRITER) + " " + gen_.string() +
                     " " + out.string() + " " + flags);
    EXPECT_EQ(w.exit_code, 0) << w.out;
    return out.string();
  }

  fs::path Source(int k) const {
    char buf[16];
    std::snprintf(buf, sizeof buf, "v%03d", k);
    return gen_ / buf;
  }

  // What step `step` must hold: source version step-1, with `frozen` tensors from v000.
  std::map<std::string, std::vector<uint8_t>> Want(int step, const std::string& frozen = "") {
    std::map<std::string, std::vector<uint8_t>> want = SourceTensors(Source(step - 1));
    if (!frozen.empty()) {
      const std::regex re(frozen);
      for (auto& [name, bytes] : SourceTensors(Source(0))) {
        if (std::regex_search(name, re)) want[name] = bytes;
      }
    }
    return want;
  }

  Mount& NewMount(const std::string& bucket, const std::string& name) {
    mounts_.push_back(std::make_unique<Mount>(bucket, root_ / name));  // ROOT/NAME/{mnt,cache,log.txt}
    return *mounts_.back();
  }

  // Every step's model.safetensors on `m` holds exactly the expected tensors, bit for bit.
  void ExpectEveryStep(const Mount& m, const std::string& model, const std::string& frozen = "") {
    for (int step = 1; step <= kVersions + 1; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      int err = 0;
      std::optional<std::vector<uint8_t>> file =
          ReadAll(m.mnt() / (model + "@step-" + std::to_string(step)) / "model.safetensors", &err);
      ASSERT_TRUE(file.has_value()) << std::strerror(err) << "\n" << m.LogText();
      std::map<std::string, std::vector<uint8_t>> got = TensorsOf(*file);
      std::map<std::string, std::vector<uint8_t>> want = Want(step, frozen);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, bytes] : want) {
        ASSERT_TRUE(got.count(name)) << name;
        EXPECT_TRUE(got[name] == bytes) << name << " differs";
      }
    }
  }

  TempDir tmp_{"trl"};
  fs::path root_, gen_;
  std::vector<std::unique_ptr<Mount>> mounts_;
};

TEST_F(TrlTest, MountShowsEveryStepBitExactAndReadOnly) {
  // Anchors at 1, 4 and 8; the periodic ones leave out the frozen layer 1 (it overlays).
  const std::string frozen = "layers\\.1\\.";
  const std::string bucket =
      WriteTrl("grpo-run", "--anchor-every 4 --anchor-omit-unchanged --freeze '" + frozen + "'");
  Mount& m = NewMount(bucket, "m");
  Result r = m.Start();
  ASSERT_EQ(r.exit_code, 0) << r.out << m.LogText();

  // The model directory: one version per step, @latest the last step.
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(m.mnt())) names.insert(e.path().filename().string());
  for (int step = 1; step <= kVersions + 1; ++step) EXPECT_TRUE(names.count("grpo-run@step-" + std::to_string(step)));
  EXPECT_EQ(fs::read_symlink(m.mnt() / "grpo-run@latest").string(), "grpo-run@step-11");

  // Reading one tensor of step 11 (anchor 8 + deltas 9, 10, 11) fetches its bytes in anchor 8
  // and at most the three delta files, not the rest of the file.
  const fs::path f11 = m.mnt() / "grpo-run@step-11" / "model.safetensors";
  {
    const uint64_t before = m.BytesReceived();
    int fd = ::open(f11.c_str(), O_RDONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    // No kernel readahead: the reads below are what reaches the mount.
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
    std::vector<uint8_t> prefix(8);
    ASSERT_EQ(::pread(fd, prefix.data(), 8, 0), 8);
    Expected<uint64_t> need = SafetensorsPrefixLength(prefix);
    ASSERT_TRUE(need.ok());
    prefix.resize(*need);
    ASSERT_EQ(::pread(fd, prefix.data() + 8, *need - 8, 8), static_cast<ssize_t>(*need - 8));
    const uint64_t file_size = fs::file_size(f11);
    Expected<SafetensorsHeader> h = ParseSafetensorsHeader(prefix, file_size);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    const TensorInfo* t = nullptr;
    for (const TensorInfo& x : h->tensors) {
      if (x.name == "model.embed_tokens.weight") t = &x;
    }
    ASSERT_NE(t, nullptr);
    const uint64_t after_header = m.BytesReceived();
    // The pages wholly inside the tensor (the kernel reads whole pages; the ones at its ends are
    // shared with the neighbours).
    const uint64_t page = 4096;
    const uint64_t begin = (h->data_offset + t->begin + page - 1) / page * page;
    const uint64_t end = (h->data_offset + t->end) / page * page;
    ASSERT_LT(begin, end);
    std::vector<uint8_t> tensor(end - begin);
    ASSERT_EQ(::pread(fd, tensor.data(), tensor.size(), static_cast<off_t>(begin)), static_cast<ssize_t>(tensor.size()));
    ::close(fd);
    const std::vector<uint8_t> want = Want(11, frozen).at(t->name);
    const uint64_t skip = begin - (h->data_offset + t->begin);
    EXPECT_TRUE(std::equal(tensor.begin(), tensor.end(), want.begin() + static_cast<std::ptrdiff_t>(skip)));
    uint64_t deltas = 0;
    for (int s : {9, 10, 11}) {
      char key[64];
      std::snprintf(key, sizeof key, "deltas/step_%06d.safetensors", s);
      deltas += fs::file_size(fs::path(bucket) / key);
    }
    const uint64_t got = m.BytesReceived() - after_header;
    std::printf("one tensor of %llu bytes at step 11: %llu bytes from the bucket (header %llu; deltas 9-11 %llu; "
                "file %llu)\n",
                (unsigned long long)t->size(), (unsigned long long)got,
                (unsigned long long)(after_header - before), (unsigned long long)deltas,
                (unsigned long long)file_size);
    EXPECT_GE(got, t->size());
    EXPECT_LE(got, t->size() + deltas);
    EXPECT_LT(got + (after_header - before), file_size / 4);
  }

  ExpectEveryStep(m, "grpo-run", frozen);

  // Attributes: no SHA-256 is known (ENODATA, not an error), the parent is the previous step.
  int err = 0;
  EXPECT_FALSE(GetXattr(f11, "user.weightfs.sha256", &err).has_value());
  EXPECT_EQ(err, ENODATA);
  EXPECT_EQ(GetXattr(m.mnt() / "grpo-run@step-11", "user.weightfs.parent").value_or(""), "grpo-run@step-10");

  // Read-only: no drafts, with a log line saying why.
  EXPECT_NE(::mkdir((m.mnt() / "grpo-run@step-12").c_str(), 0755), 0);
  EXPECT_EQ(errno, EROFS);
  EXPECT_TRUE(WaitFor([&] { return m.LogText().find("TRL delta-sync") != std::string::npos; }, 5s)) << m.LogText();

  // `weightfs log` lists the steps, stored bytes = the step's TRL file.
  Json log = CliJson("log " + bucket + " --json");
  ASSERT_TRUE(log.is_array()) << log.dump();
  ASSERT_EQ(log.size(), static_cast<size_t>(kVersions + 1));
  EXPECT_EQ(log[0].value("version", ""), "step-1");
  EXPECT_EQ(log[10].value("version", ""), "step-11");
  EXPECT_EQ(log[10].value("stored_bytes", uint64_t{0}), fs::file_size(fs::path(bucket) / "deltas/step_000011.safetensors"));
  // cat and pull read it too (pull has no SHA-256 to check; it still writes the bytes).
  Result pull = Cli("pull " + bucket + " grpo-run@step-6 " + (root_ / "pulled").string() + " --no-cache");
  ASSERT_EQ(pull.exit_code, 0) << pull.out;
  EXPECT_TRUE(TensorsOf(Slurp(root_ / "pulled" / "model.safetensors")) == Want(6, frozen));
}

TEST_F(TrlTest, CorruptDeltasGiveEioAndALogLineNotACrash) {
  const std::string bucket = WriteTrl("bad-run", "--anchor-every 5");
  auto key = [&](int step) {
    char k[64];
    std::snprintf(k, sizeof k, "deltas/step_%06d.safetensors", step);
    return fs::path(bucket) / k;
  };
  // Step 3: a small tensor's gap-encoded indices become 0xFFFF gaps: out of range.
  {
    std::vector<uint8_t> b = Slurp(key(3));
    Expected<SafetensorsHeader> h = ParseSafetensorsHeader(b, b.size());
    ASSERT_TRUE(h.ok());
    bool done = false;
    for (const TensorInfo& t : h->tensors) {
      if (done || !t.name.ends_with(".idx") || t.dtype != DType::kU16 || t.shape[0] == 0) continue;
      std::memset(b.data() + h->data_offset + t.begin, 0xFF, t.size());
      done = true;
    }
    ASSERT_TRUE(done);
    std::ofstream(key(3), std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(b.data()),
                                                                     static_cast<std::streamsize>(b.size()));
  }
  // Step 7: truncated.
  fs::resize_file(key(7), fs::file_size(key(7)) - 100);
  // Step 11: a value tensor claims F16 (same length in the JSON: "BF16" -> "F16" + a space).
  {
    std::vector<uint8_t> b = Slurp(key(11));
    std::string s(b.begin(), b.end());
    const size_t at = s.find("\"BF16\"");
    ASSERT_NE(at, std::string::npos);
    s.replace(at, 6, "\"F16\" ");
    std::ofstream(key(11), std::ios::binary | std::ios::trunc) << s;
  }
  Mount& m = NewMount(bucket, "m");
  Result r = m.Start();
  ASSERT_EQ(r.exit_code, 0) << r.out << m.LogText();
  const std::map<int, bool> readable = {{1, true},  {2, true},  {3, false}, {4, false}, {5, true},  {6, true},
                                        {7, false}, {8, false}, {9, false}, {10, true}, {11, false}};
  for (const auto& [step, ok] : readable) {
    SCOPED_TRACE("step " + std::to_string(step));
    int err = 0;
    std::optional<std::vector<uint8_t>> f =
        ReadAll(m.mnt() / ("bad-run@step-" + std::to_string(step)) / "model.safetensors", &err);
    if (ok) {
      ASSERT_TRUE(f.has_value()) << std::strerror(err);
      EXPECT_TRUE(TensorsOf(*f) == Want(step));
    } else {
      EXPECT_FALSE(f.has_value());
      EXPECT_EQ(err, EIO);
    }
  }
  const std::string log = m.LogText();
  for (int step : {3, 7, 11}) {
    char name[64];
    std::snprintf(name, sizeof name, "deltas/step_%06d.safetensors", step);
    EXPECT_NE(log.find(name), std::string::npos) << name << " not in the log:\n" << log;
  }
  EXPECT_NE(log.find("out of range"), std::string::npos) << log;
  EXPECT_NE(log.find("values are F16 but the tensor is BF16"), std::string::npos) << log;
  // Still serving.
  int err = 0;
  EXPECT_TRUE(ReadAll(m.mnt() / "bad-run@step-2" / "model.safetensors", &err).has_value());
}

TEST_F(TrlTest, ImportGivesTheSameFilesAndReportsTheSizePerStep) {
  const std::string bucket = WriteTrl("run", "--anchor-every 5");
  const std::string dest = (root_ / "dest").string();
  ASSERT_EQ(Cli("init " + dest).exit_code, 0);
  const std::string cache = (root_ / "import-cache").string();
  // In two parts: the second resumes after the first's last step.
  Result part = Cli("import " + bucket + " " + dest + " --to-step 4 --cache-dir " + cache);
  ASSERT_EQ(part.exit_code, 0) << part.out;
  Result r = Cli("import " + bucket + " " + dest + " --cache-dir " + cache);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::printf("%s%s", part.out.c_str(), r.out.c_str());
  const std::regex line(R"(run@step-(\d+) \((anchor|delta)\): TRL .* \((\d+) bytes\), weightfs .* \((\d+) bytes\), TRL/weightfs ([0-9.]+)x)");
  std::set<int> reported;
  for (const std::string* out : {&part.out, &r.out}) {
    for (auto it = std::sregex_iterator(out->begin(), out->end(), line); it != std::sregex_iterator(); ++it) {
      const int step = std::stoi((*it)[1]);
      reported.insert(step);
      char key[64];
      std::snprintf(key, sizeof key, "%s/step_%06d.safetensors", (*it)[2] == "anchor" ? "anchors" : "deltas", step);
      EXPECT_EQ(std::stoull((*it)[3]), fs::file_size(fs::path(bucket) / key)) << step;
      // A delta step stored by weightfs is smaller than TRL's delta file.
      if ((*it)[2] == "delta") {
        EXPECT_GT(std::stod((*it)[5]), 1.0) << it->str();
      }
    }
  }
  EXPECT_EQ(reported.size(), static_cast<size_t>(kVersions + 1)) << part.out << r.out;
  EXPECT_NE(r.out.find("already in"), std::string::npos) << r.out;  // step 4, before resuming
  EXPECT_NE(r.out.find("total: 7 steps imported, 4 already there"), std::string::npos) << r.out;
  Result again = Cli("import " + bucket + " " + dest + " --cache-dir " + cache);
  EXPECT_EQ(again.exit_code, 0) << again.out;
  EXPECT_NE(again.out.find("nothing to import"), std::string::npos) << again.out;

  // Parents chain step to step across the two runs.
  Json log = CliJson("log " + dest + " run --json");
  ASSERT_TRUE(log.is_array());
  ASSERT_EQ(log.size(), static_cast<size_t>(kVersions + 1));
  for (const Json& v : log) {
    const int step = std::stoi(v.value("version", "step-0").substr(5));
    if (step == 1) {
      EXPECT_TRUE(v["parent"].is_null());
    } else {
      EXPECT_EQ(v.value("parent", ""), "step-" + std::to_string(step - 1));
    }
  }

  // Every imported version's file equals the TRL mount's, byte for byte.
  Mount& trl = NewMount(bucket, "trl");
  Mount& wfs = NewMount(dest, "wfs");
  ASSERT_EQ(trl.Start().exit_code, 0) << trl.LogText();
  ASSERT_EQ(wfs.Start().exit_code, 0) << wfs.LogText();
  for (int step = 1; step <= kVersions + 1; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::string v = "run@step-" + std::to_string(step);
    int e1 = 0, e2 = 0;
    std::optional<std::vector<uint8_t>> a = ReadAll(trl.mnt() / v / "model.safetensors", &e1);
    std::optional<std::vector<uint8_t>> b = ReadAll(wfs.mnt() / v / "model.safetensors", &e2);
    ASSERT_TRUE(a && b) << e1 << " " << e2;
    EXPECT_TRUE(*a == *b);
    EXPECT_EQ(GetXattr(wfs.mnt() / v / "model.safetensors", "user.weightfs.sha256").value_or(""), Sha256Hex(*a));
  }
  Result verify = Cli("verify " + dest + " run@step-11");
  EXPECT_EQ(verify.exit_code, 0) << verify.out;
}

TEST_F(TrlTest, OlderKeyNamesAndRawIndicesRead) {
  const std::string v1 = WriteTrl("v1-run", "--anchor-every 6 --v1");
  const std::string raw = WriteTrl("raw-run", "--anchor-every 3 --encoding raw");
  Mount& a = NewMount(v1, "a");
  Mount& b = NewMount(raw, "b");
  ASSERT_EQ(a.Start().exit_code, 0) << a.LogText();
  ASSERT_EQ(b.Start().exit_code, 0) << b.LogText();
  ExpectEveryStep(a, "v1-run");
  ExpectEveryStep(b, "raw-run");
}

}  // namespace
}  // namespace weightfs
