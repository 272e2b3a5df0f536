#include "tools/checkpoint_generator.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "tools/commands.h"

namespace weightfs {
namespace {

namespace fs = std::filesystem;

std::vector<uint8_t> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

nlohmann::json ReadJson(const fs::path& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

SafetensorsHeader ParseFile(const std::vector<uint8_t>& bytes) {
  auto prefix = SafetensorsPrefixLength(bytes);
  EXPECT_TRUE(prefix.ok()) << prefix.status().ToString();
  auto header = ParseSafetensorsHeader(bytes, bytes.size());
  EXPECT_TRUE(header.ok()) << header.status().ToString();
  return header.ok() ? *header : SafetensorsHeader{};
}

const TensorInfo* FindTensor(const SafetensorsHeader& h, const std::string& name) {
  for (const TensorInfo& t : h.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

// A fresh directory under the test temp dir, removed at the end of the test.
class GenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::path(::testing::TempDir()) /
            ("wfs_gen_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  GenOptions Tiny(const std::string& name) const {
    GenOptions o;
    o.out_dir = (root_ / name).string();
    o.params = 1'000'000;
    o.versions = 2;
    o.lr = 1e-6;
    o.threads = 2;
    return o;
  }

  GenResult Generate(const GenOptions& o) {
    auto r = GenerateCheckpoints(o);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : GenResult{};
  }

  fs::path root_;
};

TEST(ModelShapeTest, ShapesAreLlamaLikeAndWithinTenPercent) {
  for (uint64_t p : {300'000ull, 1'000'000ull, 2'500'000ull, 7'000'000ull, 30'000'000ull,
                     124'000'000ull, 500'000'000ull, 1'100'000'000ull, 3'000'000'000ull,
                     8'000'000'000ull, 70'000'000'000ull}) {
    SCOPED_TRACE(p);
    auto shape = ChooseModelShape(p);
    ASSERT_TRUE(shape.ok()) << shape.status().ToString();
    const ModelShape& s = *shape;
    const double err = std::fabs(static_cast<double>(s.ParamCount()) - static_cast<double>(p)) /
                       static_cast<double>(p);
    EXPECT_LE(err, 0.10);
    EXPECT_EQ(s.hidden_size % 128, 0u);
    EXPECT_EQ(s.num_heads * s.head_dim, s.hidden_size);
    EXPECT_EQ(s.num_heads % s.num_kv_heads, 0u);
    EXPECT_GE(s.intermediate_size, 2.69 * static_cast<double>(s.hidden_size));
    EXPECT_LE(s.intermediate_size, 3.5 * static_cast<double>(s.hidden_size));
    EXPECT_EQ(s.intermediate_size % (s.hidden_size >= 1024 ? 256 : 128), 0u);
    EXPECT_GE(s.num_layers, 1u);
    uint64_t total = 0;
    for (const TensorInfo& t : ModelTensors(s, DType::kBF16)) {
      uint64_t n = 1;
      for (uint64_t d : t.shape) n *= d;
      total += n;
    }
    EXPECT_EQ(total, s.ParamCount());
  }
  // Small models get a small vocabulary, 8B looks like Llama-3-8B.
  EXPECT_LE(ChooseModelShape(1'000'000)->vocab_size, 2048u);
  const ModelShape big = *ChooseModelShape(8'000'000'000ull);
  EXPECT_EQ(big.vocab_size, 128256u);
  EXPECT_EQ(big.hidden_size, 4096u);
  EXPECT_EQ(big.num_layers, 32u);
  EXPECT_EQ(big.num_kv_heads * 4, big.num_heads);
  EXPECT_FALSE(ChooseModelShape(1000).ok());
}

TEST(ModelShapeTest, TensorNamesFollowTransformers) {
  const ModelShape s = *ChooseModelShape(1'000'000);
  std::vector<TensorInfo> t = ModelTensors(s, DType::kBF16);
  ASSERT_EQ(t.size(), 3 + 9 * s.num_layers);
  EXPECT_EQ(t.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(t.back().name, "lm_head.weight");
  EXPECT_EQ(t[t.size() - 2].name, "model.norm.weight");
  std::set<std::string> names;
  for (const auto& x : t) names.insert(x.name);
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                        "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight",
                        "model.layers.0.post_attention_layernorm.weight"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
}

TEST(FloatConversionTest, RoundsToNearestEven) {
  EXPECT_EQ(Fp32ToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Fp32ToBf16(-2.0f), 0xC000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(Fp32ToBf16(1.00390625f), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  EXPECT_EQ(Fp32ToBf16(1.01171875f), 0x3F82);
  EXPECT_EQ(Fp32ToBf16(std::nextafter(1.00390625f, 2.0f)), 0x3F81);
  EXPECT_EQ(Fp32ToBf16(INFINITY), 0x7F80);
  EXPECT_EQ(Fp32ToBf16(NAN) & 0x7FC0, 0x7FC0);

  EXPECT_EQ(Fp32ToFp16(1.0f), 0x3C00);
  EXPECT_EQ(Fp32ToFp16(-2.0f), 0xC000);
  EXPECT_EQ(Fp32ToFp16(65504.0f), 0x7BFF);
  EXPECT_EQ(Fp32ToFp16(65519.0f), 0x7BFF);
  EXPECT_EQ(Fp32ToFp16(65520.0f), 0x7C00);  // rounds up to infinity
  EXPECT_EQ(Fp32ToFp16(1.0f + 0x1p-11f), 0x3C00);          // tie -> even
  EXPECT_EQ(Fp32ToFp16(1.0f + 3 * 0x1p-11f), 0x3C02);      // tie -> even
  EXPECT_EQ(Fp32ToFp16(0x1p-24f), 0x0001);                 // smallest subnormal
  EXPECT_EQ(Fp32ToFp16(0x1p-25f), 0x0000);                 // tie -> even (zero)
  EXPECT_EQ(Fp32ToFp16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(Fp32ToFp16(0x1p-14f), 0x0400);                 // smallest normal
  EXPECT_EQ(Fp32ToFp16(0x1.ff8p-15f), 0x03FF);             // largest subnormal
  EXPECT_EQ(Fp32ToFp16(0x1.ffcp-15f), 0x0400);             // tie rounding up to the smallest normal
  EXPECT_EQ(Fp32ToFp16(-0.0f), 0x8000);
}

TEST_F(GenTest, ShardsAreNamedLikeTheHubAndIndexed) {
  GenOptions o = Tiny("sharded");
  o.shard_size = 600'000;  // ~2 MB of bf16 tensors -> several shards
  GenResult r = Generate(o);
  ASSERT_GT(r.shards, 1);
  ASSERT_EQ(r.versions.size(), 3u);
  for (int v = 0; v <= 2; ++v) {
    const fs::path dir = fs::path(o.out_dir) / ("v00" + std::to_string(v));
    const nlohmann::json index = ReadJson(dir / "model.safetensors.index.json");
    std::map<std::string, std::string> expected_map;
    uint64_t total = 0;
    std::set<std::string> tensors_seen;
    for (int s = 0; s < r.shards; ++s) {
      char name[64];
      std::snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, r.shards);
      EXPECT_EQ(ShardFileName(s, r.shards), name);
      const std::vector<uint8_t> bytes = ReadFile(dir / name);
      ASSERT_FALSE(bytes.empty()) << name;
      const SafetensorsHeader h = ParseFile(bytes);
      EXPECT_EQ(h.metadata.at("format"), "pt");
      EXPECT_EQ(h.file_size, bytes.size());
      EXPECT_EQ(h.data_offset % 8, 0u);
      for (const TensorInfo& t : h.tensors) {
        EXPECT_EQ(t.dtype, DType::kBF16);
        expected_map[t.name] = name;
        total += t.size();
        EXPECT_TRUE(tensors_seen.insert(t.name).second) << t.name << " in two shards";
      }
    }
    EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
    using WeightMap = std::map<std::string, std::string>;
    EXPECT_EQ(index["weight_map"].get<WeightMap>(), expected_map);
    EXPECT_EQ(tensors_seen.size(), 3 + 9 * r.shape.num_layers);
    EXPECT_TRUE(fs::exists(dir / "config.json"));
  }
  const nlohmann::json versions = ReadJson(fs::path(o.out_dir) / "versions.json");
  ASSERT_EQ(versions["versions"].size(), 3u);
  EXPECT_TRUE(versions["versions"][0]["parent"].is_null());
  EXPECT_EQ(versions["versions"][2]["parent"], "v001");
  EXPECT_EQ(versions["versions"][1]["files"].size(), static_cast<size_t>(r.shards) + 2);
}

TEST_F(GenTest, SingleShardIsModelSafetensorsWithoutIndex) {
  GenOptions o = Tiny("single");
  GenResult r = Generate(o);
  EXPECT_EQ(r.shards, 1);
  const fs::path dir = fs::path(o.out_dir) / "v001";
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  const SafetensorsHeader h = ParseFile(ReadFile(dir / "model.safetensors"));
  EXPECT_EQ(h.tensors.size(), 3 + 9 * r.shape.num_layers);
  // Inside a file tensors are laid out in name order, like the safetensors writer does.
  std::vector<std::string> by_offset;
  for (const TensorInfo& t : h.tensors) by_offset.push_back(t.name);
  EXPECT_TRUE(std::is_sorted(by_offset.begin(), by_offset.end()));
}

TEST_F(GenTest, OutputIsIdenticalWhateverTheThreadCount) {
  GenOptions a = Tiny("t1");
  a.threads = 1;
  a.opaque_size = 100'000;
  a.header_change_at = 2;
  a.shard_size = 1'000'000;
  GenOptions b = a;
  b.out_dir = (root_ / "t2").string();
  b.threads = 2;
  Generate(a);
  Generate(b);
  size_t files = 0;
  for (const auto& entry : fs::recursive_directory_iterator(a.out_dir)) {
    if (!entry.is_regular_file()) continue;
    const fs::path rel = fs::relative(entry.path(), a.out_dir);
    EXPECT_EQ(ReadFile(entry.path()), ReadFile(fs::path(b.out_dir) / rel)) << rel;
    ++files;
  }
  EXPECT_GE(files, 3u * 4 + 1);
}

TEST_F(GenTest, SeedChangesTheValues) {
  GenOptions a = Tiny("s1");
  a.versions = 1;
  GenOptions b = a;
  b.out_dir = (root_ / "s2").string();
  b.seed = 2;
  Generate(a);
  Generate(b);
  EXPECT_NE(ReadFile(fs::path(a.out_dir) / "v000/model.safetensors"),
            ReadFile(fs::path(b.out_dir) / "v000/model.safetensors"));
}

// Counts differing bf16 elements between two versions directly from the files.
uint64_t CountChanged(const fs::path& a, const fs::path& b, uint64_t* ulp1) {
  const std::vector<uint8_t> x = ReadFile(a), y = ReadFile(b);
  const SafetensorsHeader hx = ParseFile(x), hy = ParseFile(y);
  uint64_t changed = 0;
  *ulp1 = 0;
  for (const TensorInfo& t : hx.tensors) {
    const TensorInfo* u = FindTensor(hy, t.name);
    if (u == nullptr) continue;
    for (uint64_t i = 0; i < t.size(); i += 2) {
      uint16_t p, q;
      std::memcpy(&p, &x[hx.data_offset + t.begin + i], 2);
      std::memcpy(&q, &y[hy.data_offset + u->begin + i], 2);
      if (p == q) continue;
      ++changed;
      auto key = [](uint16_t v) { return (v & 0x8000) ? -int(v & 0x7FFF) : int(v); };
      if (std::abs(key(p) - key(q)) == 1) ++*ulp1;
    }
  }
  return changed;
}

TEST_F(GenTest, ChangedFractionEmergesFromTheLearningRate) {
  GenOptions small = Tiny("lr6");
  GenOptions large = Tiny("lr4");
  large.lr = 1e-4;
  GenResult rs = Generate(small);
  GenResult rl = Generate(large);
  for (int v = 1; v <= 2; ++v) {
    const GenVersionSummary& s = rs.versions[v];
    EXPECT_EQ(s.compared, rs.params);
    // An Adam step of ~1e-6 crosses a bf16 rounding boundary for about 1% of the weights,
    // almost always by one unit in the last place.
    EXPECT_GT(s.changed_fraction(), 0.002);
    EXPECT_LT(s.changed_fraction(), 0.03);
    EXPECT_GT(static_cast<double>(s.ulp1), 0.7 * static_cast<double>(s.changed));
    EXPECT_GT(rl.versions[v].changed_fraction(), 5 * s.changed_fraction());
    // The summary agrees with the files.
    uint64_t ulp1 = 0;
    const fs::path dir(small.out_dir);
    EXPECT_EQ(CountChanged(dir / ("v00" + std::to_string(v - 1)) / "model.safetensors",
                           dir / ("v00" + std::to_string(v)) / "model.safetensors", &ulp1),
              s.changed);
    EXPECT_EQ(ulp1, s.ulp1);
  }
  const nlohmann::json versions = ReadJson(fs::path(small.out_dir) / "versions.json");
  EXPECT_NEAR(versions["versions"][1]["changed_fraction"].get<double>(),
              rs.versions[1].changed_fraction(), 1e-12);

  // More steps per version change more elements.
  GenOptions multi = Tiny("spv");
  multi.steps_per_version = 10;
  multi.versions = 1;
  GenResult rm = Generate(multi);
  EXPECT_GT(rm.versions[1].changed_fraction(), 3 * rs.versions[1].changed_fraction());
}

TEST_F(GenTest, OtherDtypes) {
  for (DType dt : {DType::kF16, DType::kF32}) {
    GenOptions o = Tiny(std::string(DTypeName(dt)));
    o.dtype = dt;
    o.versions = 1;
    GenResult r = Generate(o);
    const SafetensorsHeader h = ParseFile(ReadFile(fs::path(o.out_dir) / "v001/model.safetensors"));
    ASSERT_FALSE(h.tensors.empty());
    EXPECT_EQ(h.tensors[0].dtype, dt);
    EXPECT_EQ(h.file_size - h.data_offset, r.params * DTypeSize(dt));
    if (dt == DType::kF32) {
      EXPECT_GT(r.versions[1].changed_fraction(), 0.9);
    }
  }
}

TEST_F(GenTest, HeaderChangeShiftsOffsetsAndKeepsTheTrajectory) {
  GenOptions o = Tiny("hdr");
  o.versions = 3;
  o.header_change_at = 2;
  o.shard_size = 1'000'000;
  GenResult r = Generate(o);
  ASSERT_GT(r.shards, 1);
  const fs::path out(o.out_dir);
  const std::string first = ShardFileName(0, r.shards);
  const std::vector<uint8_t> f1 = ReadFile(out / "v001" / first);
  const std::vector<uint8_t> f2 = ReadFile(out / "v002" / first);
  const SafetensorsHeader h1 = ParseFile(f1), h2 = ParseFile(f2);
  EXPECT_EQ(FindTensor(h1, kGenExtraTensorName), nullptr);
  ASSERT_NE(FindTensor(h2, kGenExtraTensorName), nullptr);
  EXPECT_EQ(h1.metadata.count(kGenExtraMetadataKey), 0u);
  EXPECT_EQ(h2.metadata.count(kGenExtraMetadataKey), 1u);
  EXPECT_NE(h1.data_offset, h2.data_offset);
  // Every tensor of the shard moved in the file...
  int moved = 0;
  for (const TensorInfo& t : h1.tensors) {
    const TensorInfo* u = FindTensor(h2, t.name);
    ASSERT_NE(u, nullptr) << t.name;
    if (h1.data_offset + t.begin != h2.data_offset + u->begin) ++moved;
  }
  EXPECT_EQ(moved, static_cast<int>(h1.tensors.size()));
  // ...and the other shards' headers changed too (the metadata entry).
  if (r.shards > 1) {
    const std::string second = ShardFileName(1, r.shards);
    EXPECT_NE(ParseFile(ReadFile(out / "v001" / second)).data_offset,
              ParseFile(ReadFile(out / "v002" / second)).data_offset);
  }
  // Values continue their trajectory: the version with the new header differs from its parent
  // by a normal training step, not by a reshuffle.
  EXPECT_GT(r.versions[2].changed_fraction(), 0.002);
  EXPECT_LT(r.versions[2].changed_fraction(), 0.03);
  EXPECT_EQ(r.versions[2].compared, r.params);  // the new tensor has no parent to compare with
  EXPECT_GT(r.versions[3].compared, r.params);  // from then on it is compared too
  const nlohmann::json index = ReadJson(out / "v003" / "model.safetensors.index.json");
  EXPECT_EQ(index["weight_map"][kGenExtraTensorName], first);
}

TEST_F(GenTest, OpaqueOptimizerFileIsWrittenAndChangesDensely) {
  GenOptions o = Tiny("opaque");
  o.opaque_size = 200'003;  // not a multiple of 4 on purpose
  GenResult r = Generate(o);
  std::vector<std::vector<uint8_t>> blobs;
  for (int v = 0; v <= 2; ++v) {
    const fs::path p = fs::path(o.out_dir) / ("v00" + std::to_string(v)) / "optimizer.bin";
    ASSERT_TRUE(fs::exists(p));
    blobs.push_back(ReadFile(p));
    ASSERT_EQ(blobs.back().size(), o.opaque_size);
    EXPECT_EQ(std::memcmp(blobs.back().data(), "WFSOPT01", 8), 0);
    uint64_t fields[3];
    std::memcpy(fields, blobs.back().data() + 8, sizeof fields);
    EXPECT_EQ(fields[1], r.params);
    EXPECT_EQ(fields[2], (o.opaque_size - kGenOpaqueHeaderBytes) / 4);
  }
  for (int v = 1; v <= 2; ++v) {
    uint64_t differ = 0, n = (o.opaque_size - kGenOpaqueHeaderBytes) / 4;
    for (uint64_t i = 0; i < n; ++i) {
      differ += std::memcmp(&blobs[v][kGenOpaqueHeaderBytes + 4 * i],
                            &blobs[v - 1][kGenOpaqueHeaderBytes + 4 * i], 4) != 0;
    }
    EXPECT_GT(differ, n * 9 / 10);
  }
}

int RunGen(std::vector<std::string> args) {
  args.insert(args.begin(), "gen");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return cli::GenMain(static_cast<int>(argv.size()), argv.data());
}

TEST_F(GenTest, CommandLine) {
  const std::string out = (root_ / "cli").string();
  EXPECT_EQ(RunGen({"--help"}), 0);
  EXPECT_EQ(RunGen({out, "--params", "1M", "--versions", "1", "--lr", "1e-6", "--dtype", "bf16",
                    "--shard-size", "1MB", "--steps-per-version", "2", "--seed", "7",
                    "--header-change-at", "1", "--opaque-size", "4KiB", "--threads", "2"}),
            0);
  EXPECT_TRUE(fs::exists(fs::path(out) / "v001" / "optimizer.bin"));
  const nlohmann::json versions = ReadJson(fs::path(out) / "versions.json");
  EXPECT_EQ(versions["options"]["seed"], 7);
  EXPECT_EQ(versions["versions"][1]["step"], 2);
}

TEST_F(GenTest, ParamsSuffixBMeansBillion) {
  const std::string out = (root_ / "billion").string();
  ASSERT_EQ(RunGen({out, "--params", "0.0012B", "--versions", "1"}), 0);
  const nlohmann::json versions = ReadJson(fs::path(out) / "versions.json");
  EXPECT_EQ(versions["options"]["params"], 1'200'000);
}

TEST_F(GenTest, BadOptionsAreRejected) {
  const std::string out = (root_ / "bad").string();
  const std::vector<std::vector<std::string>> bad = {
      {},                                       // no OUT
      {out, out + "2"},                         // two OUTs
      {out, "--bogus"},                         // unknown option
      {out, "--params"},                        // missing value
      {out, "--params", "lots"},
      {out, "--params", "10"},                  // too small
      {out, "--params", "8X"},
      {out, "--versions", "0"},
      {out, "--versions", "1.5"},
      {out, "--lr", "-1"},
      {out, "--lr", "fast"},
      {out, "--dtype", "int8"},
      {out, "--steps-per-version", "0"},
      {out, "--header-change-at", "11"},        // beyond --versions 10
      {out, "--opaque-size", "7"},              // smaller than the header
      {out, "--threads", "-1"},
      {out, "--seed", "x"},
  };
  for (const auto& args : bad) {
    SCOPED_TRACE(args.empty() ? "(none)" : args.back());
    EXPECT_NE(RunGen(args), 0);
  }
  EXPECT_FALSE(fs::exists(out));

  // A non-empty output directory is refused and left alone.
  fs::create_directories(out);
  std::ofstream(fs::path(out) / "keep.txt") << "x";
  EXPECT_EQ(RunGen({out, "--params", "1M", "--versions", "1"}), 1);
  EXPECT_EQ(ReadFile(fs::path(out) / "keep.txt").size(), 1u);
  EXPECT_FALSE(fs::exists(fs::path(out) / "v000"));

  GenOptions o = Tiny("x");
  o.header_change_at = 3;
  EXPECT_EQ(ValidateGenOptions(o).kind(), ErrorKind::kInvalidArgument);
}

}  // namespace
}  // namespace weightfs
