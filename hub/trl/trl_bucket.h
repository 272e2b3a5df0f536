// TrlVersions: a TRL "delta weight sync" bucket (huggingface/trl, experimental async GRPO) read
// as weightfs versions (hub/engine/derived_versions.h). TRL writes, per weight sync N (its
// `model_version`), exactly one of
//
//   anchors/step_NNNNNN.safetensors   full tensors, one per parameter, keyed by parameter name
//                                     (a periodic anchor may omit parameters that did not change:
//                                     it overlays the state before it)
//   deltas/step_NNNNNN.safetensors    per changed parameter P, relative to the state of the
//                                     previous step (chained, not cumulative):
//                                       V2: P.idx  (flat row-major indices, encoded per
//                                                   __metadata__ "encoding": "gap_delta" = U16 or
//                                                   U32 gaps g[k] = i[k] - i[k-1] - 1 with
//                                                   i[-1] = -1; "raw" = I32 absolute)
//                                           P.val  (absolute new values, the parameter's dtype)
//                                       V1/V0: P.indices (I32 absolute) / P.values
//                                     applied as flat[i[k]] = val[k]; "__empty_delta__" (V0's
//                                     placeholder) is ignored
//
// NNNNNN is the step zero-padded to six digits (wider past 999999); a step without a file had
// no change. Every file's `__metadata__` holds flat string keys with format=sparse_weight_patch
// (V0 anchors: anchor_checkpoint) and sparse=True|False. No manifest or "latest" file exists.
//
// Versions: `MODEL@step-N` for every step N present at or after the first anchor, where MODEL is
// the caller's name. Each has one file, `model.safetensors`, synthesized deterministically: the
// union of the tensors of the anchors at or below N (the newest anchor's definition of a name
// wins), sorted by name, with the newest anchor's `__metadata__`. Its bytes for tensor T are
// T's bytes in the newest anchor <= N containing T, patched by every delta after that anchor up
// to N, in step order. Manifests are derived (chunk hashes are identifiers of (step, tensor,
// chunk), sha256 is empty); `created` encodes the step (Unix milliseconds = N), so versions
// order by step; `stats.stored_bytes` is the size of the step's TRL file.
//
// I/O: listing reads the store listing of anchors/ and deltas/ and the anchors' safetensors
// headers (ranged reads), never tensor data. Materialize reads the chunk's range of the anchor
// tensor, and for each delta its header (once, cached) and the idx/val tensors of T (ranged
// reads), decoded into patches kept in an LRU bounded in bytes, so the many chunks of a large
// tensor fetch each patch once; concurrent requests for one patch share one fetch.
//
// Everything read is untrusted: headers, metadata, index encodings, counts, dtypes. A bad file
// gives Corruption naming the step file and tensor (Unsupported for nvcomp_cascaded indices).
//
// Thread-safe; no lock is held across store I/O.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/chunk_plan.h"
#include "core/dtype.h"
#include "hub/engine/derived_versions.h"
#include "hub/store/store.h"

namespace weightfs {

struct TrlOptions {
  uint64_t chunk_bytes = kDefaultChunkBytes;  // chunk size of the synthesized files
  uint64_t patch_cache_bytes = 256ull << 20;  // decoded patches kept in memory (LRU)
  uint64_t max_header_bytes = 100ull << 20;   // bound on a step file's safetensors header
  size_t max_cached_delta_headers = 1024;     // parsed delta headers kept (LRU)
};

// One step file of the bucket.
struct TrlStep {
  uint64_t step = 0;
  bool anchor = false;
  std::string key;  // "anchors/step_000010.safetensors"
  uint64_t size = 0;
};

// Counters for tests and --stats; monotonic.
struct TrlStats {
  std::atomic<uint64_t> header_reads{0};   // safetensors headers fetched (anchors and deltas)
  std::atomic<uint64_t> patch_fetches{0};  // (delta, tensor) patches fetched and decoded
  std::atomic<uint64_t> patch_hits{0};     // patches served from the LRU or a shared fetch
  std::atomic<uint64_t> anchor_bytes{0};   // anchor tensor bytes read
};

class TrlVersions : public DerivedVersions {
 public:
  ~TrlVersions() override = default;
  // The step files now in the store, by step (re-lists the store).
  virtual Expected<std::vector<TrlStep>> Steps() = 0;
  virtual const std::string& model() const = 0;
  virtual const TrlStats& stats() const = 0;
};

// "step-N" for step N.
std::string TrlVersionName(uint64_t step);

// NotFound (saying what a TRL layout looks like) when the store holds no
// {anchors,deltas}/step_N.safetensors file; InvalidArgument for an invalid model name.
Expected<std::shared_ptr<TrlVersions>> OpenTrlVersions(std::shared_ptr<Store> store,
                                                       std::string model,
                                                       const TrlOptions& options = {});

// The decoded flat indices of a patch (exposed for tests). `dtype` is the idx tensor's dtype,
// `encoding` the metadata's ("gap_delta", "raw"; "" = by dtype: I32 raw, U16/U32 gaps).
// Checks that the indices are strictly increasing and below `numel`. `what` names the file and
// tensor in errors.
Expected<std::vector<uint64_t>> DecodeTrlIndices(std::span<const uint8_t> bytes, DType dtype,
                                                 std::string_view encoding, uint64_t numel,
                                                 std::string_view what);

}  // namespace weightfs
