// The read-only .patch view of a mount (fs/patch_view.h): MNT/m/x@NEW/.patch/OLD/FILE.
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "tests/fs/draft_mount.h"

namespace weightfs::test {
namespace {

std::vector<uint8_t> Bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

SafetensorsHeader Header(const std::vector<uint8_t>& b) {
  Expected<uint64_t> n = SafetensorsPrefixLength(b);
  EXPECT_TRUE(n.ok());
  Expected<SafetensorsHeader> h = ParseSafetensorsHeader(b, b.size());
  EXPECT_TRUE(h.ok()) << h.status().ToString();
  return *h;
}

uint64_t Elements(const TensorInfo& t) {
  uint64_t e = 1;
  for (uint64_t d : t.shape) e *= d;
  return e;
}

// Applies `patch` to `old` (flat[idx] = val; dense tensors replace); returns NEW's data section
// laid out as `layout` (NEW's header) has it.
std::vector<uint8_t> Apply(const std::vector<uint8_t>& old, const std::vector<uint8_t>& patch,
                           const SafetensorsHeader& layout) {
  SafetensorsHeader oh = Header(old), ph = Header(patch);
  std::map<std::string, const TensorInfo*> ot, pt;
  for (const TensorInfo& t : oh.tensors) ot[t.name] = &t;
  for (const TensorInfo& t : ph.tensors) pt[t.name] = &t;
  std::vector<uint8_t> out(layout.file_size - layout.data_offset);
  for (const TensorInfo& t : layout.tensors) {
    uint8_t* dst = out.data() + t.begin;
    if (auto d = pt.find(t.name); d != pt.end()) {
      EXPECT_EQ(d->second->size(), t.size()) << t.name;
      std::memcpy(dst, patch.data() + ph.data_offset + d->second->begin, t.size());
      continue;
    }
    auto o = ot.find(t.name);
    if (o == ot.end()) {
      ADD_FAILURE() << t.name << " neither in OLD nor dense in the patch";
      continue;
    }
    std::memcpy(dst, old.data() + oh.data_offset + o->second->begin, t.size());
    auto idx = pt.find(t.name + ".idx"), val = pt.find(t.name + ".val");
    if (idx == pt.end()) continue;
    EXPECT_NE(val, pt.end());
    const size_t es = t.size() / std::max<uint64_t>(Elements(t), 1);
    const size_t is = idx->second->dtype == DType::kI64 ? 8 : 4;
    const uint64_t k = idx->second->size() / is;
    for (uint64_t i = 0; i < k; ++i) {
      int64_t pos = 0;
      if (is == 8) {
        std::memcpy(&pos, patch.data() + ph.data_offset + idx->second->begin + i * 8, 8);
      } else {
        int32_t p32;
        std::memcpy(&p32, patch.data() + ph.data_offset + idx->second->begin + i * 4, 4);
        pos = p32;
      }
      std::memcpy(dst + pos * es, patch.data() + ph.data_offset + val->second->begin + i * es, es);
    }
  }
  return out;
}

std::set<std::string> Names(const fs::path& dir) {
  std::set<std::string> n;
  for (const auto& e : fs::directory_iterator(dir)) n.insert(e.path().filename().string());
  return n;
}

class PatchViewTest : public DraftMountTest {
 protected:
  static Json PatchStats(const Mount& m) {
    auto stats = GetXattr(m.mnt(), "user.weightfs.stats");
    Json j = stats ? Json::parse(*stats, nullptr, false) : Json();
    return j.is_object() && j.contains("patch_view") ? j["patch_view"] : Json::object();
  }
  // Objects read from the bucket (GETs). Not every request: the mount lists the bucket again
  // when its listing is older than --refresh (1 s here) and a lookup comes, which a test that
  // runs a few seconds cannot keep out of any window (CI saw 401 requests for 400).
  static uint64_t Gets(const Mount& m) {
    auto stats = GetXattr(m.mnt(), "user.weightfs.stats");
    if (!stats) return 0;
    Json j = Json::parse(*stats, nullptr, false);
    return j.is_object() && j.contains("bucket") ? j["bucket"].value("gets", uint64_t{0}) : 0;
  }
};

TEST_F(PatchViewTest, PatchesFromAncestorsApplyBitExact) {
  Generate("2M", 3);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  for (int k = 1; k <= 2; ++k) {
    Result p = Cli("push " + bucket_ + " m/x@v" + std::to_string(k) + " " + Source(k).string() + " --cache-dir " +
                   (root_ / "c0").string());
    ASSERT_EQ(p.exit_code, 0) << p.out;
  }
  Mount& m = NewMount("m");
  ASSERT_EQ(m.Start().exit_code, 0) << m.Describe();
  const fs::path v2 = m.Dir("m/x@v2");
  EXPECT_EQ(Names(v2).count(".patch"), 0u);  // hidden
  EXPECT_TRUE(fs::is_directory(v2 / ".patch"));
  EXPECT_EQ(Names(v2 / ".patch"), (std::set<std::string>{"v0", "v1"}));
  EXPECT_FALSE(fs::exists(v2 / ".patch/v3"));
  EXPECT_FALSE(fs::exists(m.Dir("m/x@v0") / ".patch/v2"));  // a descendant, not an ancestor
  std::set<std::string> weights;
  for (const std::string& f : FilesUnder(Source(2))) {
    if (f.size() > 12 && f.ends_with(".safetensors")) weights.insert(f);
  }
  ASSERT_FALSE(weights.empty());
  std::set<std::string> listed;
  for (const auto& e : fs::recursive_directory_iterator(v2 / ".patch/v0")) {
    if (e.is_regular_file()) listed.insert(e.path().lexically_relative(v2 / ".patch/v0").string());
  }
  EXPECT_EQ(listed, weights);
  EXPECT_EQ(PatchStats(m).value("generated", uint64_t{0}), 0u) << "a listing made a patch";
  // Concurrent first opens of one patch: generated once.
  {
    const fs::path pf = v2 / ".patch/v1" / *weights.begin();
    std::vector<std::future<std::vector<uint8_t>>> readers;
    for (int i = 0; i < 4; ++i) readers.push_back(std::async(std::launch::async, [pf] { return Bytes(pf); }));
    std::vector<uint8_t> first = readers[0].get();
    EXPECT_FALSE(first.empty());
    for (size_t i = 1; i < readers.size(); ++i) EXPECT_EQ(readers[i].get(), first);
    EXPECT_EQ(PatchStats(m).value("generated", uint64_t{0}), 1u) << PatchStats(m).dump();
  }
  for (int from = 0; from <= 1; ++from) {
    for (const std::string& f : weights) {
      const fs::path pf = v2 / ".patch" / ("v" + std::to_string(from)) / f;
      std::vector<uint8_t> patch = Bytes(pf);
      EXPECT_EQ(fs::file_size(pf), patch.size());
      std::vector<uint8_t> old = Bytes(Source(from) / f), want = Bytes(Source(2) / f);
      SafetensorsHeader wh = Header(want);
      std::vector<uint8_t> got = Apply(old, patch, wh);
      ASSERT_EQ(got.size(), want.size() - wh.data_offset);
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + wh.data_offset)) << pf;
    }
  }
  // Read again: from the cached patch files, nothing read from the bucket.
  const uint64_t before = Gets(m);
  for (const std::string& f : weights) {
    std::ifstream in(v2 / ".patch/v0" / f, std::ios::binary);
    EXPECT_TRUE(in.good());
  }
  EXPECT_EQ(Gets(m), before);
  size_t cached = 0;
  for (const auto& e : fs::recursive_directory_iterator(m.cache() / "patches")) cached += e.is_regular_file();
  EXPECT_EQ(cached, 2 * weights.size());
  EXPECT_EQ(PatchStats(m).value("generated", uint64_t{0}), 2 * weights.size()) << PatchStats(m).dump();
  EXPECT_EQ(PatchStats(m).value("failures", uint64_t{0}), 0u);
  // Read-only.
  std::error_code ec;
  EXPECT_FALSE(fs::create_directory(v2 / ".patch/v0/new", ec));
  EXPECT_EQ(ec.value(), EROFS);
  EXPECT_NE(::unlink((v2 / ".patch/v0" / *weights.begin()).c_str()), 0);
  EXPECT_EQ(errno, EROFS);
}

// A second mount on the same cache directory reuses the patch files; a patch that cannot be
// made (the bucket's data gone) is EIO, not a hang or a crash.
TEST_F(PatchViewTest, ReusedByANewMountAndEIOWhenTheBucketFails) {
  Generate("2M", 2);
  ASSERT_NO_FATAL_FAILURE(InitWithBase());
  Result p = Cli("push " + bucket_ + " m/x@v1 " + Source(1).string() + " --cache-dir " + (root_ / "c0").string());
  ASSERT_EQ(p.exit_code, 0) << p.out;
  std::string weight;
  for (const std::string& f : FilesUnder(Source(1))) {
    if (f.ends_with(".safetensors")) weight = f;
  }
  ASSERT_FALSE(weight.empty());
  std::vector<uint8_t> first;
  {
    Mount& a = NewMount("a");
    ASSERT_EQ(a.Start().exit_code, 0) << a.Describe();
    first = Bytes(a.Dir("m/x@v1") / ".patch/v0" / weight);
    ASSERT_FALSE(first.empty());
    ASSERT_EQ(a.Unmount().exit_code, 0);
  }
  Mount& b = NewMount("b", "", "", root_ / "a" / "cache");
  ASSERT_EQ(b.Start().exit_code, 0) << b.Describe();
  EXPECT_EQ(Bytes(b.Dir("m/x@v1") / ".patch/v0" / weight), first);
  std::ifstream log(root_ / "b" / "log.txt");
  std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.find("patch view: m/x@v1"), std::string::npos) << "generated again:\n" << text;
  // A fresh cache and no packs in the bucket: EIO.
  Mount& c = NewMount("c");
  ASSERT_EQ(c.Start().exit_code, 0) << c.Describe();
  ASSERT_TRUE(fs::is_directory(c.Dir("m/x@v1") / ".patch/v0"));
  fs::rename(root_ / "bucket" / "packs", root_ / "packs.away");
  struct stat st {};
  EXPECT_NE(::stat((c.Dir("m/x@v1") / ".patch/v0" / weight).c_str(), &st), 0);
  EXPECT_EQ(errno, EIO);
  fs::rename(root_ / "packs.away", root_ / "bucket" / "packs");
}

}  // namespace
}  // namespace weightfs::test
