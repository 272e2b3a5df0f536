// CheckpointGenerator: writes a realistic sequence of model checkpoints (`weightfs gen`), so that
// tests and benchmarks never need downloaded weights.
//
// What it simulates (docs/generator.md has the details and measured numbers):
//   - a Llama/Qwen-like decoder (embeddings, GQA attention, SwiGLU MLP, RMSNorms, untied lm_head)
//     sized to a parameter budget, with trained-looking values (per-tensor std, per-row and
//     per-column scales, heavy tails, norms near 1);
//   - training: fp32 master weights updated by AdamW with synthetic gradients (a persistent
//     per-element direction plus per-step noise, zero rows for embedding tokens absent from the
//     batch), cast to the output dtype with round-to-nearest-even after every step. Which
//     elements change between two versions emerges from these dynamics; nothing picks positions.
//
// Output layout, for versions v000 (the base) .. vNNN:
//   OUT/vNNN/model-0000i-of-0000K.safetensors + model.safetensors.index.json   (K > 1 shards)
//   OUT/vNNN/model.safetensors                                                  (one shard)
//   OUT/vNNN/config.json       a transformers LlamaConfig for the shape (same in every version)
//   OUT/vNNN/optimizer.bin     only with opaque_size > 0 (format in checkpoint_generator.cc)
//   OUT/versions.json          options, model shape and, per version, parent, files and the
//                              measured changed fraction versus the parent
//
// Memory is bounded by threads x one slice of 1 Mi elements (~30 MB per thread) whatever the
// model size. The output is a pure function of the options except `threads`: any thread count
// writes bit-identical files.
//
// GenerateCheckpoints is thread-safe (it shares nothing between calls); the progress callback is
// called from the calling thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "core/status.h"

namespace weightfs {

struct GenOptions {
  std::string out_dir;                     // created if missing; must be empty if it exists
  uint64_t params = 500'000'000;           // target parameter count (the result is within ~10%)
  int versions = 10;                       // versions after the base: v001 .. vNNN
  double lr = 1e-5;                        // AdamW learning rate (constant)
  DType dtype = DType::kBF16;              // kBF16, kF16 or kF32
  uint64_t shard_size = 2'000'000'000;     // max tensor bytes per shard, like HF max_shard_size
  int steps_per_version = 1;               // optimizer steps between two versions
  uint64_t seed = 1;
  int header_change_at = 0;                // from this version on the headers change; 0 = never
  uint64_t opaque_size = 0;                // bytes of optimizer.bin per version; 0 = none
  int threads = 0;                         // 0 = std::thread::hardware_concurrency()
};

// Limits enforced by ValidateGenOptions.
inline constexpr uint64_t kGenMinParams = 300'000;
inline constexpr uint64_t kGenMaxParams = 2'000'000'000'000;
inline constexpr int kGenMaxVersions = 999;
inline constexpr uint64_t kGenOpaqueHeaderBytes = 32;

// Returns InvalidArgument naming the offending option, or OK.
Status ValidateGenOptions(const GenOptions& options);

// A Llama-style decoder configuration.
struct ModelShape {
  uint64_t vocab_size = 0;
  uint64_t hidden_size = 0;        // d, a multiple of 128
  uint64_t num_layers = 0;
  uint64_t num_heads = 0;
  uint64_t num_kv_heads = 0;       // GQA: k_proj/v_proj have num_kv_heads * head_dim rows
  uint64_t head_dim = 0;
  uint64_t intermediate_size = 0;  // 2.7..3.5 d, a multiple of 256 (of 128 when d < 1024)

  uint64_t ParamCount() const;
};

// Picks the shape whose parameter count is close to `target_params` (within 10%) with a
// realistic width/depth ratio and vocabulary for that size (about 1024 tokens for ~1M params,
// 32000 for 150M-3B, 128256 for 3B-50B, 151936 above). InvalidArgument when no shape fits.
Expected<ModelShape> ChooseModelShape(uint64_t target_params);

// The tensors of the model in module order (embed_tokens, layer 0 .. L-1, norm, lm_head), with
// dtype and shape set; offsets are left zero.
std::vector<TensorInfo> ModelTensors(const ModelShape& shape, DType dtype);

// The tensor added by header_change_at, and the metadata entry that comes with it.
inline constexpr const char* kGenExtraTensorName = "model.extra_head.weight";
inline constexpr const char* kGenExtraMetadataKey = "weightfs_gen_extra_head";

struct GenVersionSummary {
  std::string name;                // "v003"
  std::string parent;              // "" for the base
  uint64_t step = 0;               // optimizer steps since the base
  std::vector<std::string> files;  // relative to the version directory, sorted
  uint64_t bytes = 0;              // total bytes of those files
  // Versus the parent, over the tensor elements present in both (in the output dtype):
  uint64_t compared = 0;           // elements compared
  uint64_t changed = 0;            // elements whose bits differ
  uint64_t ulp1 = 0;               // ... that moved by exactly 1 unit in the last place
  uint64_t ulp2 = 0;               // ... by exactly 2
  double changed_fraction() const {
    return compared ? static_cast<double>(changed) / static_cast<double>(compared) : 0.0;
  }
};

struct GenResult {
  ModelShape shape;
  uint64_t params = 0;  // parameters of the base model
  int shards = 0;
  uint64_t bytes_written = 0;
  double seconds = 0;
  std::vector<GenVersionSummary> versions;  // v000 first
};

// Called with (elements processed, total elements) while generating, from the calling thread.
using GenProgressCallback = std::function<void(uint64_t done, uint64_t total)>;

// Writes the whole sequence to options.out_dir. On error returns the first failure (with the
// file it concerns); files already written are left in place.
Expected<GenResult> GenerateCheckpoints(const GenOptions& options,
                                        const GenProgressCallback& progress = {});

// Name of shard `index` (0-based) of `count`: "model-00001-of-00004.safetensors", or
// "model.safetensors" when count == 1.
std::string ShardFileName(int index, int count);

// Bit-exact float conversions used for the outputs (round to nearest, ties to even).
uint16_t Fp32ToBf16(float f);
uint16_t Fp32ToFp16(float f);

}  // namespace weightfs
