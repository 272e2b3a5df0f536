// weightfs gen: writes a simulated training run as a sequence of checkpoint directories.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <memory>
#include <string>

#include "tools/checkpoint_generator.h"
#include "tools/cli.h"
#include "tools/commands.h"

namespace weightfs::cli {
namespace {

constexpr const char* kGenHelp = R"(usage: weightfs gen OUT [options]

Writes a realistic checkpoint sequence of a Llama-like model, produced by simulated AdamW
training, so that tests and benchmarks need no downloaded weights:
  OUT/v000/ (the base), OUT/v001/ ... OUT/vNNN/, each with the Hugging Face layout
    model-00001-of-0000K.safetensors ... + model.safetensors.index.json   (several shards)
    model.safetensors                                                     (a single shard)
    config.json                                                           (LlamaConfig)
    optimizer.bin                                                         (--opaque-size)
  OUT/versions.json: the model shape and, per version, parent, files and the measured
    fraction of elements that changed versus the parent.
OUT must be new or empty. The output depends only on the options (not on --threads).

options:
  --params N             target parameter count; the model is within ~10% of it
                         (1M, 500M, 8B = 8 billion, 1.5T; 300K..2T)          [500M]
  --versions N           versions after the base (1..999)                    [10]
  --lr X                 AdamW learning rate (constant); per step it changes
                         ~1% of bf16 weights at 1e-6, ~7% at 1e-5, ~35% at 1e-4
                                                                             [1e-5]
  --dtype T              bf16, fp16 or fp32 (master weights are always fp32,
                         cast with round-to-nearest-even after every step)   [bf16]
  --shard-size BYTES     max tensor bytes per shard file, like
                         save_pretrained(max_shard_size=...)                 [2GB]
  --steps-per-version N  optimizer steps between two versions                [1]
  --seed N               seed of every random draw                           [1]
  --header-change-at K   from version K on, add tensor model.extra_head.weight
                         and a metadata entry, shifting the data offsets of
                         every file; 0 = never                               [0]
  --opaque-size BYTES    also write optimizer.bin of this size per version: a
                         32-byte header + fp32 Adam moments (dense changes);
                         0 = none                                            [0]
  --threads N            worker threads; 0 = all cores                       [0]
  -h, --help             show this help

--shard-size and --opaque-size take K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of
1024), optionally followed by B: 2GB, 512MiB.
)";

Expected<int64_t> ParseInt(const std::string& option, const std::string& text, int64_t lo,
                           int64_t hi) {
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || v < lo || v > hi) {
    return Status::InvalidArgument(option + " expects an integer in [" + std::to_string(lo) +
                                   ", " + std::to_string(hi) + "], got '" + text + "'");
  }
  return v;
}

// A parameter count: "500M", "1.5B" (billion, as in model names), "8G", "2T", "1000000".
// Unlike ParseSize, B means billion here, not bytes.
Expected<uint64_t> ParseParamCount(const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  const std::string suffix = end ? end : "";
  double mult = 0;
  if (suffix.empty()) mult = 1;
  else if (suffix == "K" || suffix == "k") mult = 1e3;
  else if (suffix == "M" || suffix == "m") mult = 1e6;
  else if (suffix == "B" || suffix == "b" || suffix == "G" || suffix == "g") mult = 1e9;
  else if (suffix == "T" || suffix == "t") mult = 1e12;
  if (text.empty() || end == text.c_str() || mult == 0 || !std::isfinite(v) || v < 0 ||
      v * mult > 9e18) {
    return Status::InvalidArgument("--params expects a count like 1M, 500M, 8B or 1.5T, got '" +
                                   text + "'");
  }
  return static_cast<uint64_t>(std::llround(v * mult));
}

Expected<GenOptions> ParseGenOptions(const ArgParser& args) {
  GenOptions o;
  if (args.positionals().size() != 1) {
    return Status::InvalidArgument(args.positionals().empty()
                                       ? "missing output directory (usage: weightfs gen OUT [options])"
                                       : "expected one output directory, got " +
                                             std::to_string(args.positionals().size()) +
                                             " arguments");
  }
  o.out_dir = args.positionals()[0];
  auto with_option = [](const std::string& option, Status s) {
    return Status::InvalidArgument(option + ": " + s.message());
  };
  if (auto v = args.Get("--params")) {
    WFS_ASSIGN_OR_RETURN(o.params, ParseParamCount(*v));
  }
  if (auto v = args.Get("--versions")) {
    WFS_ASSIGN_OR_RETURN(int64_t n, ParseInt("--versions", *v, 1, kGenMaxVersions));
    o.versions = static_cast<int>(n);
  }
  if (auto v = args.Get("--lr")) {
    auto lr = ParseDouble(*v);
    if (!lr.ok()) return with_option("--lr", lr.status());
    o.lr = *lr;
  }
  if (auto v = args.Get("--dtype")) {
    if (*v == "bf16" || *v == "bfloat16") o.dtype = DType::kBF16;
    else if (*v == "fp16" || *v == "f16" || *v == "float16") o.dtype = DType::kF16;
    else if (*v == "fp32" || *v == "f32" || *v == "float32") o.dtype = DType::kF32;
    else return Status::InvalidArgument("--dtype must be bf16, fp16 or fp32, got '" + *v + "'");
  }
  if (auto v = args.Get("--shard-size")) {
    auto s = ParseSize(*v);
    if (!s.ok()) return with_option("--shard-size", s.status());
    o.shard_size = *s;
  }
  if (auto v = args.Get("--steps-per-version")) {
    WFS_ASSIGN_OR_RETURN(int64_t n, ParseInt("--steps-per-version", *v, 1, 100000));
    o.steps_per_version = static_cast<int>(n);
  }
  if (auto v = args.Get("--seed")) {
    uint64_t seed = 0;
    auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), seed);
    if (ec != std::errc() || ptr != v->data() + v->size()) {
      return Status::InvalidArgument("--seed expects a non-negative integer, got '" + *v + "'");
    }
    o.seed = seed;
  }
  if (auto v = args.Get("--header-change-at")) {
    WFS_ASSIGN_OR_RETURN(int64_t k, ParseInt("--header-change-at", *v, 0, kGenMaxVersions));
    o.header_change_at = static_cast<int>(k);
  }
  if (auto v = args.Get("--opaque-size")) {
    auto s = ParseSize(*v);
    if (!s.ok()) return with_option("--opaque-size", s.status());
    o.opaque_size = *s;
  }
  if (auto v = args.Get("--threads")) {
    WFS_ASSIGN_OR_RETURN(int64_t n, ParseInt("--threads", *v, 0, 1024));
    o.threads = static_cast<int>(n);
  }
  WFS_TRY(ValidateGenOptions(o));
  return o;
}

std::string HumanCount(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.1fM", n / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0fK", n / 1e3);
  return buf;
}

}  // namespace

int GenMain(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    if (a == "-h" || a == "--help") {
      std::fputs(kGenHelp, stdout);
      return 0;
    }
  }
  ArgParser args({"--params", "--versions", "--lr", "--dtype", "--shard-size",
                  "--steps-per-version", "--seed", "--header-change-at", "--opaque-size",
                  "--threads"},
                 {});
  auto usage_error = [](const std::string& message) {
    Fail(message.find("--help") == std::string::npos ? message + " (see weightfs gen --help)"
                                                     : message);
    return 2;
  };
  if (Status s = args.Parse(argc, argv, 1); !s.ok()) return usage_error(s.message());
  auto options = ParseGenOptions(args);
  if (!options.ok()) return usage_error(options.status().message());

  uint64_t total_seen = 0;
  std::unique_ptr<Progress> bar;
  auto result = GenerateCheckpoints(*options, [&](uint64_t done, uint64_t total) {
    if (!bar || total != total_seen) {
      bar = std::make_unique<Progress>("weightfs gen: " + options->out_dir, total);
      total_seen = total;
    }
    bar->Update(done);
  });
  if (bar) bar->Finish();
  if (!result.ok()) return Fail(result.status().message());

  const GenResult& r = *result;
  double min_changed = 1, max_changed = 0, sum_changed = 0;
  for (size_t v = 1; v < r.versions.size(); ++v) {
    const double f = r.versions[v].changed_fraction();
    min_changed = std::min(min_changed, f);
    max_changed = std::max(max_changed, f);
    sum_changed += f;
  }
  const double mean_changed = sum_changed / static_cast<double>(r.versions.size() - 1);
  std::printf(
      "wrote %zu versions (v000..%s) of a %s-parameter model (d=%llu, %llu layers, vocab %llu, "
      "%d shard%s) to %s: %s in %.1f s; changed per version %.3f%% (min %.3f%%, max %.3f%%)\n",
      r.versions.size(), r.versions.back().name.c_str(),
      HumanCount(static_cast<double>(r.params)).c_str(),
      static_cast<unsigned long long>(r.shape.hidden_size),
      static_cast<unsigned long long>(r.shape.num_layers),
      static_cast<unsigned long long>(r.shape.vocab_size), r.shards, r.shards == 1 ? "" : "s",
      options->out_dir.c_str(), FormatBytes(static_cast<double>(r.bytes_written)).c_str(),
      r.seconds, 100 * mean_changed, 100 * min_changed, 100 * max_changed);
  return 0;
}

}  // namespace weightfs::cli
