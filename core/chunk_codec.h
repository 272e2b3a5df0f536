// ChunkCodec: lossless, self-describing compression of one chunk, on its own (FULL) or against
// the same chunk of the parent version (DELTA).
//
// Payload format 1 (all integers little-endian):
//   off size field
//     0    4 magic "WFSC"
//     4    1 format version (1)
//     5    1 encoding: 1 FULL, 2 SPARSE, 3 DENSE, 4 PATCH, 5 RAW
//     6    1 dtype (core/dtype.h numbering)
//     7    1 flags (must be 0)
//     8    8 raw_len: bytes of the decoded chunk
//    16    8 parent_len: bytes of the parent chunk (0 for FULL and RAW)
//    24    8 raw_hash: XXH3-64 of the decoded chunk (checked after every decode)
//    32    8 parent_hash: XXH3-64 of the parent chunk (checked before a delta is applied)
//    40  ... body
// Bodies:
//   RAW    the bytes as they are (used when nothing compresses).
//   FULL   "planes": floats rotated left by one bit (exponent bits land in the top byte), the
//          elements split into byte planes (byte k of every element), then each plane one zstd
//          frame: u64 frame size per plane, then the frames. Grouping exponents apart from
//          mantissas is what lets an entropy coder see their low entropy.
//   DENSE  for many changes: d = ord(new) - ord(parent) per element (ord = order-preserving
//          integer of a float, identity for integers), zigzag-coded, then planes + zstd as FULL.
//   SPARSE for few changes: the changed elements' gaps (per exponent class of the parent) and
//          differences d = ord(new) - ord(parent), entropy-coded; two body versions, told apart
//          by the body's 8th byte (core/codec/sparse/sparse_coder.h): 1, adaptive binary range
//          coding, and 2, static per-chunk tables with interleaved rANS (faster to decode). A
//          ±1-ulp step in bf16 costs ~2 bits; a position ~H(p)/p bits.
//   PATCH  one zstd frame compressed with the parent chunk as its prefix (for bytes of unknown
//          structure, and chunks whose length changed: headers, opaque files).
// Decoding validates everything before use and never allocates more than raw_len (bounded by
// DecodeLimits) plus zstd's own bounded window; any inconsistency is a Corruption status, and an
// allocation that fails all the same is ResourceExhausted.
//
// A ChunkCodec holds reusable zstd contexts: it is not thread-safe; use one per thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace weightfs {

enum class ChunkEncoding : uint8_t {
  kSame = 0,  // not a payload kind: the chunk equals its parent and stores nothing
  kFull = 1,
  kSparse = 2,
  kDense = 3,
  kPatch = 4,
  kRaw = 5,
  // Manifest-only, never in a payload header: the chunk is the raw bytes of a range of a file
  // outside the bucket (hub/engine/external_source.h), e.g. a base model in a Hugging Face repo.
  kExternal = 6,
};
std::string_view ChunkEncodingName(ChunkEncoding e);

inline constexpr size_t kPayloadHeaderBytes = 40;

struct PayloadInfo {
  ChunkEncoding encoding = ChunkEncoding::kRaw;
  DType dtype = DType::kOpaque;
  uint64_t raw_len = 0;
  uint64_t parent_len = 0;
  uint64_t raw_hash = 0;
  uint64_t parent_hash = 0;
  bool is_delta() const {
    return encoding == ChunkEncoding::kSparse || encoding == ChunkEncoding::kDense ||
           encoding == ChunkEncoding::kPatch;
  }
  // Element-wise deltas may be decoded in place: Decode's `out` may be its `parent`. A SPARSE
  // delta decoded in place writes only the changed elements, which is what makes a chain of
  // deltas cheap to apply (hub/engine/materializer.cc).
  bool decodes_in_place() const {
    return encoding == ChunkEncoding::kSparse || encoding == ChunkEncoding::kDense;
  }
};

struct EncodeOptions {
  // zstd level of FULL and DENSE planes. Measured on bf16 weights (bench codec): level 1 gives
  // the best ratio and speed (1.47x, ~550 MB/s per core); higher levels spend time on useless
  // matches in noise-like mantissas and come out slightly larger; negative levels drop Huffman.
  int full_level = 1;
  int patch_level = 9;  // zstd level of PATCH for chunks up to 256 KiB (headers); 1 above
  // Above this changed fraction the sparse coder is not tried (its decode cost grows with the
  // number of changes; byte planes decode at memory-like speed).
  double sparse_max_fraction = 0.30;
  // A sparse stream at or below this many bits per raw byte is kept without trying the dense
  // and FULL encodings; otherwise every applicable candidate is encoded and the smallest kept.
  double sparse_sufficient_bits_per_byte = 0.5;
  // Exponent classes (core/codec/sparse/sparse_coder.h) shrink sparse deltas by ~25% but cost
  // decode time per change; above this changed fraction the sparse coder codes positions
  // without them.
  double exponent_class_max_fraction = 1.0;
  // SPARSE body layout (core/codec/sparse/sparse_coder.h): 0 lets the encoder pick (version 2,
  // the fast table-driven one, unless version 1 is clearly smaller), 1 or 2 forces one (tests,
  // benches).
  int sparse_body_version = 0;
  // Tests: SPARSE bodies of floats use this many exponent classes (2..16; 0 lets the encoder
  // choose among 2-8). Decoders must take any K the format allows.
  int sparse_force_classes = 0;
};

struct DecodeLimits {
  uint64_t max_raw_len = 256ull << 20;  // hard cap on a decoded chunk (decompression bombs)
  // Check the output against the payload's raw_hash. A caller that verifies a stronger hash of
  // the output itself (the manifest's Hash128) may turn this off to save a pass over the bytes.
  bool verify_output = true;
  // Check a delta's parent against the payload's parent_hash before applying it. A caller that
  // verifies the final result of a chain of deltas against a stronger hash may turn it off:
  // a wrong parent anywhere in the chain makes that final check fail.
  bool verify_parent = true;
};

class ChunkCodec {
 public:
  explicit ChunkCodec(EncodeOptions options = {});
  ~ChunkCodec();
  ChunkCodec(const ChunkCodec&) = delete;
  ChunkCodec& operator=(const ChunkCodec&) = delete;

  // Encodes `data` on its own: FULL, or RAW when that is smaller. Appends to `*out` (cleared).
  // A `dtype` whose size does not divide data.size() is treated as kOpaque.
  void EncodeFull(DType dtype, std::span<const uint8_t> data, std::vector<uint8_t>* out);

  // Encodes `data` against `parent`, choosing the smallest of SPARSE, DENSE, PATCH and FULL that
  // applies. Returns kSame (and leaves *out empty) when data equals parent.
  // The encoders read their input in several passes: `data` and `parent` must not change during
  // the call (a caller reading a file others may write, a mapped staging file, copies the chunk
  // first, as VersionEncoder does). Input that does change anyway never crashes the encoder;
  // the payload it makes then fails its hash check when decoded.
  // `changed` (optional), when parent and data have the same length: how many elements differ
  // (elements of `dtype`, bytes when its size does not divide the length), from the changes
  // the encoder finds anyway; untouched otherwise.
  ChunkEncoding EncodeDelta(DType dtype, std::span<const uint8_t> parent,
                            std::span<const uint8_t> data, std::vector<uint8_t>* out,
                            uint64_t* changed = nullptr);

  // Decodes `payload` into `out`, which must be exactly raw_len bytes (see Inspect). `parent`
  // is required for delta encodings and ignored otherwise. The output is checked against
  // raw_hash; on any error the contents of `out` are unspecified. `out` may be `parent` itself
  // when PayloadInfo::decodes_in_place() (then an error leaves the parent unspecified too);
  // any other overlap is InvalidArgument.
  Status Decode(std::span<const uint8_t> payload, std::span<const uint8_t> parent,
                std::span<uint8_t> out, const DecodeLimits& limits = {});

  // Applies a chain of deltas to `data` in place, oldest first: the same result as
  // Decode(payload, data, data, limits) for each payload in turn, and faster: a run of SPARSE
  // deltas shares one sweep over the chunk (core/codec/sparse/sparse_coder.h DecodeChain), so a
  // training run's chain of ~1% steps costs about its changes rather than a pass per step.
  // Every payload must decode in place with raw_len == data.size() (else InvalidArgument). With
  // limits.verify_parent each payload is decoded on its own and checked; otherwise only the
  // final bytes are checked (against the last payload's raw_hash, when limits.verify_output).
  // On error *failed (if not null) is the index of the payload at fault (the last one for a
  // final checksum mismatch) and data is unspecified.
  Status DecodeChainInPlace(std::span<const std::span<const uint8_t>> payloads,
                            std::span<uint8_t> data, const DecodeLimits& limits = {},
                            size_t* failed = nullptr);

  // Applies one payload that decodes in place (SPARSE or DENSE with raw_len == data.size(),
  // else InvalidArgument) to `data`, and returns in *changed (replaced) the elements it changed,
  // ascending, as indices of elements of the payload's dtype (DTypeSize(Inspect(payload).dtype)
  // bytes each: a caller must check that it is the element it means). SPARSE: the positions the
  // body codes; DENSE: those with a non-zero difference. Either way each listed element's value
  // differs from what it was, and no other element changed. Checks the parent and the output as
  // Decode(payload, data, data, limits) does; on error `data` is unspecified. For tools that
  // need the positions (a sparse weight patch, hub/engine/weight_patcher.h); the read path uses Decode.
  Status ApplyInPlace(std::span<const uint8_t> payload, std::span<uint8_t> data,
                      std::vector<uint32_t>* changed, const DecodeLimits& limits = {});

  // Convenience: allocates the output (bounded by limits.max_raw_len).
  Expected<std::vector<uint8_t>> Decode(std::span<const uint8_t> payload,
                                        std::span<const uint8_t> parent,
                                        const DecodeLimits& limits = {});

  // Validates and returns the fixed header of a payload.
  static Expected<PayloadInfo> Inspect(std::span<const uint8_t> payload,
                                       const DecodeLimits& limits = {});

 private:
  // Decode and DecodeChainInPlace, which turn an exception from these into a Status.
  Status DecodeUnguarded(std::span<const uint8_t> payload, std::span<const uint8_t> parent,
                         std::span<uint8_t> out, const DecodeLimits& limits);
  Status DecodeChainUnguarded(std::span<const std::span<const uint8_t>> payloads,
                              std::span<uint8_t> data, const DecodeLimits& limits, size_t* failed);
  Status ApplyInPlaceUnguarded(std::span<const uint8_t> payload, std::span<uint8_t> data,
                               std::vector<uint32_t>* changed, const DecodeLimits& limits);
  // EncodeFull with the XXH3-64 of data already computed. REQUIRES: dtype tiles data.
  void EncodeFullHashed(DType dtype, std::span<const uint8_t> data, uint64_t hash,
                        std::vector<uint8_t>* out);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightfs
