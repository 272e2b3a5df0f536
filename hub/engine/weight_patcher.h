// WeightPatcher: a sparse weight patch between two versions of a model, for an inference engine
// that holds version OLD in memory and wants NEW (an RL rollout engine following a trainer).
// It follows the convention of vLLM's SparseWeightPatch and TRL's delta weight sync
// (hub/trl/trl_bucket.h describes TRL's files): a safetensors file per weight file of NEW.
//
// Patch file, format 1 (a valid safetensors file: u64 N | N bytes of JSON | data):
//   __metadata__ (every value a string)
//     "sparse_weight_patch": "1"        this format and its version
//     "format": "sparse_weight_patch"   TRL's PatchMetadata key, "encoding": "raw" likewise:
//     "encoding": "raw"                 the indices are absolute, not gap-coded
//     "model", "from", "to", "file"     MODEL, OLD, NEW and the weight file's path in NEW
//     "removed"                         JSON array of the tensors of OLD's file that NEW's
//                                       file lacks ("[]" when none)
//     "dense"                           JSON array of the tensors given whole (below)
//     "changed_elements"                sum of the sparse tensors' entries
//     "total_elements"                  elements of every tensor of NEW's file
//   tensors, in NEW's file order; for each tensor NAME of NEW's file, one of
//     nothing                 NAME is bit-identical in OLD and NEW
//     NAME.idx, NAME.val      sparse: idx is I32 (I64 when NAME has more than 2^31 elements),
//                             shape [k], the flat row-major element positions whose bits differ,
//                             strictly ascending; val has NAME's dtype, shape [k], the new
//                             values. Applying: flat = old[NAME].reshape(-1); flat[idx] = val.
//     NAME                    dense: the whole new tensor, NEW's dtype and shape. When NAME is
//                             new in NEW, its dtype or shape changed, or a sparse form would
//                             take at least as many bytes: k * (idx size + element size) >=
//                             elements * element size (for bf16 with I32 indices: a third of
//                             the elements changed; for f32: half).
//   A NAME.idx / NAME.val / NAME collision between tensors (a model with tensors "w" and
//   "w.idx") is an InvalidArgument error, never an ambiguous file.
//   Tensors are packed back to back without alignment padding, as TRL writes them.
//   The patch lists exactly the elements whose bits differ: a position a chain of deltas
//   changed and changed back is not in it. NEW's header metadata is not carried.
//
// How it is computed, per chunk of NEW's file (chunks are per tensor, core/chunk_plan.h):
//   - the row's hash equals OLD's chunk of the same key: nothing (no byte read);
//   - NEW's chunk is a chain of element-wise deltas (SPARSE, DENSE, PATCH) that reaches OLD's
//     bytes (walking the rows' bases back to a row whose hash is OLD's chunk's): OLD's chunk is
//     materialized (cache, else bucket), the chain's payloads after it are fetched and applied
//     in place, and the changed positions are the union of those the payloads code
//     (ChunkCodec::ApplyInPlace; PATCH steps are compared instead), less those whose final bits
//     equal OLD's. The result is checked against NEW's chunk hash. OLD's bytes are needed
//     whatever the encoding: a SPARSE body codes positions per exponent class of its parent's
//     elements and values as differences to them (core/codec/sparse/sparse_coder.h), so
//     neither positions nor values can be read from a payload without its parent;
//   - otherwise (a keyframe in between, chunking that differs, a derived version): OLD's and
//     NEW's chunks are materialized and compared.
// With OLD's chunks in the local cache (a node that followed training: NEW's chunks built here
// are added to it, so the next patch from NEW finds them), the bucket serves only the deltas.
//
// Memory: the output of one tensor (its idx and val) plus, per worker of the pool, about two
// chunks (OLD's and NEW's) and their changes; the data section is staged in an unlinked
// temporary file and streamed to the sink behind the header, whatever the file's size.
//
// A WeightPatcher is thread-compatible: one Write at a time (each runs its chunks on the pool).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/manifest.h"
#include "core/thread_pool.h"
#include "hub/engine/chunk_cache.h"
#include "hub/engine/materializer.h"

namespace weightfs {

inline constexpr const char* kPatchFormatVersion = "1";

struct PatchOptions {
  // NEW's chunks built from OLD's plus deltas are added here (may be null). The materializer's
  // own cache serves and keeps OLD's chunks.
  ChunkCache* cache = nullptr;
  // Where the data section is staged before the header is known (empty: the system's
  // temporary directory). Needs room for the patch.
  std::string spill_dir;
};

// What one Write did. Counts are of the file's tensors and chunks.
struct PatchStats {
  uint64_t tensors = 0;            // of NEW's file
  uint64_t tensors_sparse = 0;     // given as NAME.idx / NAME.val
  uint64_t tensors_dense = 0;      // given whole
  uint64_t tensors_unchanged = 0;
  uint64_t tensors_removed = 0;    // in OLD's file, not in NEW's
  uint64_t elements = 0;           // of NEW's tensors
  uint64_t elements_changed = 0;   // entries of the sparse tensors
  uint64_t chunks_same = 0;        // identical rows: nothing read
  uint64_t chunks_from_deltas = 0; // positions from NEW's stored deltas applied to OLD's chunk
  uint64_t chunks_compared = 0;    // OLD's and NEW's chunks materialized and compared
  uint64_t chunks_whole = 0;       // dense tensors' chunks written as they are
  uint64_t delta_payloads = 0;     // payloads the delta path fetched
  uint64_t delta_payload_bytes = 0;
  // Payload bytes the versions after OLD up to NEW wrote for this file (rows with origin 0):
  // what "NEW's stored delta" costs in the bucket.
  uint64_t stored_delta_bytes = 0;
  uint64_t patch_bytes = 0;        // bytes given to the sink
};

// Receives the patch file's bytes in order.
using PatchSink = std::function<Status(std::span<const uint8_t>)>;

class WeightPatcher {
 public:
  // Resolves OLD and NEW of `model` and the chain of versions between them, walking NEW's
  // parents back to OLD. NotFound when either version (or an ancestor on the way) is missing;
  // InvalidArgument when OLD is not an ancestor of NEW (nor NEW itself: that patch is empty).
  // `materializer` (and its bucket) and `pool` must outlive the patcher.
  static Expected<std::unique_ptr<WeightPatcher>> Open(Materializer* materializer, ThreadPool* pool,
                                                       const std::string& model,
                                                       const std::string& from_version,
                                                       const std::string& to_version,
                                                       PatchOptions options = {});

  const Manifest& from() const { return *chain_.back(); }
  const Manifest& to() const { return *chain_.front(); }
  // NEW, its parent, ..., OLD.
  const std::vector<std::shared_ptr<const Manifest>>& chain() const { return chain_; }
  // NEW's safetensors files (by name: paths ending in ".safetensors").
  std::vector<std::string> WeightFiles() const;

  // Writes the patch of NEW's file `path` to `sink`. NotFound if NEW has no such file;
  // InvalidArgument if it is not a safetensors file. On error the sink may have received part
  // of a file (write to a temporary name and rename on success).
  Status Write(const std::string& path, const PatchSink& sink, PatchStats* stats);

 private:
  WeightPatcher(Materializer* materializer, ThreadPool* pool, PatchOptions options,
                std::vector<std::shared_ptr<const Manifest>> chain)
      : materializer_(materializer), pool_(pool), options_(std::move(options)), chain_(std::move(chain)) {}

  Materializer* materializer_;
  ThreadPool* pool_;
  PatchOptions options_;
  std::vector<std::shared_ptr<const Manifest>> chain_;
};

// The dtype of NAME.idx for a tensor of `elements` elements: I32 up to 2^31, else I64.
DType PatchIndexDType(uint64_t elements);

}  // namespace weightfs
