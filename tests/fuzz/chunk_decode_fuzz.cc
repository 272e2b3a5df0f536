// libFuzzer target for ChunkCodec::Decode: payloads from a hostile bucket, against a parent chunk.
// Beyond "never crash, never read or write out of bounds", every outcome must be one the codec
// promises: Inspect and Decode agree on header errors, the only later errors are Corruption (or
// InvalidArgument for a parent of the wrong size), and an OK decode has raw_len bytes that hash
// to the payload's raw_hash.
//
// Input layout (all little-endian):
//   u8 ctrl    bit 0: payload is synthesized (else taken verbatim)
//              bit 1: set the payload's parent_hash to Hash64(parent)
//              bit 2: set the payload's parent_len to parent.size()
//              bit 3: decode with verify_output off (bytes may differ, must not crash)
//              bit 4: (synthesized) EncodeFull instead of EncodeDelta
//              bits 5-6: (synthesized) SPARSE body version the encoder writes: 0 its choice, 1, 2
//              bit 7: also apply the payload twice as a chain in place (DecodeChainInPlace)
//   u16 n      parent length, then n parent bytes
//   verbatim:    the rest is the payload
//   synthesized: u8 dtype, u8 k, k records (u16 pos, u8 xor) turning the parent into the data,
//                then records (u16 pos, u8 xor) damaging the payload the codec wrote for it
// Random payloads almost never carry the right parent_hash (XXH3-64), which every delta checks
// before its body is read; the fix-up bits and the synthesized mode reach the body decoders.
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   UBSAN_OPTIONS=halt_on_error=1 ./chunk_decode_fuzz -max_total_time=60 corpus/
// (The fuzz build does not make UBSan fatal by itself: without halt_on_error a report scrolls
// by and the run goes on.)
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "core/chunk_codec.h"
#include "core/hash.h"
#include "tests/fuzz/fuzz_input.h"

namespace {

using weightfs::ChunkCodec;
using weightfs::ErrorKind;
using weightfs::PayloadInfo;

using weightfs::fuzz::Check;
using weightfs::fuzz::Reader;

void Set64(std::vector<uint8_t>& p, size_t at, uint64_t v) { std::memcpy(p.data() + at, &v, 8); }

// Applies (u16 pos, u8 xor) records until the input runs out or `max` records were read.
void ApplyEdits(Reader& in, std::vector<uint8_t>& bytes, size_t max) {
  for (size_t k = 0; k < max && !in.empty(); ++k) {
    const uint16_t pos = in.U16();
    const uint8_t x = in.U8();
    if (!bytes.empty()) bytes[pos % bytes.size()] ^= x;
  }
}

void DecodeAndCheck(ChunkCodec& codec, std::span<const uint8_t> payload,
                    std::span<const uint8_t> parent, bool verify) {
  weightfs::DecodeLimits limits;
  limits.max_raw_len = 1 << 20;
  limits.verify_output = verify;
  const weightfs::Expected<PayloadInfo> info = ChunkCodec::Inspect(payload, limits);
  weightfs::Expected<std::vector<uint8_t>> out = codec.Decode(payload, parent, limits);
  if (!info.ok()) {
    Check(!out.ok() && out.status().kind() == info.status().kind());
    return;
  }
  if (!out.ok()) {
    const ErrorKind kind = out.status().kind();
    Check(kind == ErrorKind::kCorruption || kind == ErrorKind::kInvalidArgument);
    Check(kind != ErrorKind::kInvalidArgument ||
          (info->is_delta() && parent.size() != info->parent_len));
    return;
  }
  Check(out->size() == info->raw_len);
  if (verify) Check(weightfs::Hash64(*out) == info->raw_hash);
  if (info->is_delta()) {
    Check(parent.size() == info->parent_len && weightfs::Hash64(parent) == info->parent_hash);
  }
  // The span overload decodes the same bytes (decoding is deterministic, verified or not).
  std::vector<uint8_t> again(info->raw_len, 0x5A);
  Check(codec.Decode(payload, parent, again, limits).ok());
  Check(again == *out);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Reused across inputs, as a reader thread would; one per SPARSE body version to write.
  static ChunkCodec codecs[3] = {ChunkCodec(), ChunkCodec({.sparse_body_version = 1}),
                                 ChunkCodec({.sparse_body_version = 2})};
  Reader in(data, size);
  const uint8_t ctrl = in.U8();
  ChunkCodec& codec = codecs[((ctrl >> 5) & 3) % 3];
  const std::span<const uint8_t> parent = in.Take(in.U16());

  std::vector<uint8_t> payload;
  std::vector<uint8_t> chunk;  // what a synthesized payload encodes
  const bool synthesized = ctrl & 1;
  if (synthesized) {
    const auto dtype = static_cast<weightfs::DType>(in.U8() % weightfs::kDTypeCount);
    chunk.assign(parent.begin(), parent.end());
    ApplyEdits(in, chunk, in.U8());
    if (ctrl & 16) {
      codec.EncodeFull(dtype, chunk, &payload);
    } else if (codec.EncodeDelta(dtype, parent, chunk, &payload) == weightfs::ChunkEncoding::kSame) {
      Check(payload.empty() && std::equal(chunk.begin(), chunk.end(), parent.begin(), parent.end()));
      return 0;
    }
    if (in.empty()) {  // undamaged: the round trip must be exact
      weightfs::Expected<std::vector<uint8_t>> out = codec.Decode(payload, parent);
      Check(out.ok() && *out == chunk);
    }
    ApplyEdits(in, payload, SIZE_MAX);
  } else {
    const std::span<const uint8_t> rest = in.Rest();
    payload.assign(rest.begin(), rest.end());
  }
  if (payload.size() >= weightfs::kPayloadHeaderBytes) {
    if (ctrl & 2) Set64(payload, 32, weightfs::Hash64(parent));
    if (ctrl & 4) Set64(payload, 16, parent.size());
  }
  DecodeAndCheck(codec, payload, parent, !(ctrl & 8));

  // The same (possibly damaged) payload applied twice as a chain in place, without parent checks
  // (how the materializer applies runs): any outcome but a crash or an unpromised error kind.
  if (payload.size() >= weightfs::kPayloadHeaderBytes && (ctrl & 128)) {
    std::vector<uint8_t> data(parent.begin(), parent.end());
    const std::span<const uint8_t> one(payload);
    const std::span<const uint8_t> chain[] = {one, one};
    weightfs::DecodeLimits limits;
    limits.verify_parent = false;
    limits.verify_output = !(ctrl & 8);
    size_t failed = 99;
    const weightfs::Status st = codec.DecodeChainInPlace(chain, data, limits, &failed);
    // Inspect's own kinds (Unsupported: a newer format; ResourceExhausted: above the size
    // limit), Corruption, or InvalidArgument (wrong length for in place).
    Check(st.ok() || st.kind() == ErrorKind::kCorruption || st.kind() == ErrorKind::kInvalidArgument ||
          st.kind() == ErrorKind::kResourceExhausted || st.kind() == ErrorKind::kUnsupported);
    Check(st.ok() || failed < 2);
    Check(data.size() == parent.size());
  }
  return 0;
}
