// libFuzzer target for the chunk codec's lossless promise: for any dtype, parent and data,
// EncodeFull and EncodeDelta produce payloads that Decode turns back into exactly the data,
// whose headers say what they hold, and that never exceed RAW (header + the bytes).
//
// Input layout:
//   u8 dtype   (mod 16)
//   u8 ctrl    bits 0-1: how the data is made from the rest of the input
//                0: the rest is the data, verbatim
//                1: the parent with (u16 pos, u8 xor) records applied
//                2: the parent with elements stepped by +-1 in order space (one input bit per
//                   element: set = changed, the next bit = direction), concentrated on small
//                   magnitudes when bit 4 is set (what exponent classes are for); then two
//                   more such steps, and the three deltas decoded as one chain in place
//                3: the parent, cut or extended by the rest (lengths differ)
//              bits 2-3: EncodeOptions preset; bit 5: encode with a reused codec
//              bits 6-7: (fresh codec) SPARSE body version to write: 0 the encoder's choice, 1, 2
//   u16 n      parent length, then n parent bytes
//
//   cmake -DWEIGHTFS_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang ...
//   UBSAN_OPTIONS=halt_on_error=1 ./chunk_roundtrip_fuzz -max_total_time=60 -max_len=65536 corpus/
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
using weightfs::ChunkEncoding;
using weightfs::DType;
using weightfs::PayloadInfo;

using weightfs::fuzz::Check;
using weightfs::fuzz::Reader;

weightfs::EncodeOptions Preset(int k) {
  weightfs::EncodeOptions o;
  switch (k) {
    case 1: o.sparse_sufficient_bits_per_byte = 0; break;  // every candidate tried
    case 2: o.sparse_max_fraction = 1.0; o.full_level = 3; break;  // sparse even when dense
    case 3: o.sparse_max_fraction = 0; o.full_level = -5; o.patch_level = 1; break;
    default: break;
  }
  return o;
}

// Steps element i by +-1 of its order (ulps for floats, across zero too), as a training update.
void Step(std::vector<uint8_t>& d, size_t i, size_t w, bool is_float, bool up) {
  uint64_t u = 0;
  std::memcpy(&u, d.data() + i * w, w);
  const uint64_t mask = w == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * w)) - 1;
  const uint64_t sign = uint64_t{1} << (8 * w - 1);
  uint64_t o = is_float ? ((u & sign) ? (~u & mask) : (u | sign)) : u;
  o = (up ? o + 1 : o - 1) & mask;
  u = is_float ? ((o & sign) ? (o & ~sign) : (~o & mask)) : o;
  std::memcpy(d.data() + i * w, &u, w);
}

void CheckPayload(ChunkCodec& codec, const std::vector<uint8_t>& payload,
                  std::span<const uint8_t> parent, std::span<const uint8_t> data) {
  Check(payload.size() <= weightfs::kPayloadHeaderBytes + data.size());
  const weightfs::Expected<PayloadInfo> info = ChunkCodec::Inspect(payload);
  Check(info.ok());
  Check(info->raw_len == data.size() && info->raw_hash == weightfs::Hash64(data));
  if (info->is_delta()) {
    Check(info->parent_len == parent.size() && info->parent_hash == weightfs::Hash64(parent));
  }
  weightfs::Expected<std::vector<uint8_t>> out = codec.Decode(payload, parent);
  Check(out.ok());
  Check(std::equal(out->begin(), out->end(), data.begin(), data.end()));
  // Unverified decoding (what FileDecoder does) yields the same bytes.
  weightfs::DecodeLimits unverified;
  unverified.verify_output = false;
  std::vector<uint8_t> again(data.size());
  Check(codec.Decode(payload, parent, again, unverified).ok());
  Check(std::equal(again.begin(), again.end(), data.begin(), data.end()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t size) {
  static ChunkCodec reused[4] = {ChunkCodec(Preset(0)), ChunkCodec(Preset(1)),
                                 ChunkCodec(Preset(2)), ChunkCodec(Preset(3))};
  Reader in(input, size);
  const auto dtype = static_cast<DType>(in.U8() % weightfs::kDTypeCount);
  const uint8_t ctrl = in.U8();
  const std::span<const uint8_t> parent = in.Take(in.U16());

  std::vector<uint8_t> data;
  switch (ctrl & 3) {
    case 0: {
      const std::span<const uint8_t> rest = in.Rest();
      data.assign(rest.begin(), rest.end());
      break;
    }
    case 1:
      data.assign(parent.begin(), parent.end());
      while (!in.empty() && !data.empty()) {
        const uint16_t pos = in.U16();
        data[pos % data.size()] ^= in.U8();
      }
      break;
    case 2: {
      data.assign(parent.begin(), parent.end());
      const size_t w = data.size() % weightfs::DTypeSize(dtype) == 0 ? weightfs::DTypeSize(dtype) : 1;
      const bool is_float = weightfs::DTypeIsFloat(dtype) && w == weightfs::DTypeSize(dtype);
      const std::span<const uint8_t> bits = in.Rest();
      if (bits.empty()) break;
      for (size_t i = 0, b = 0; i < data.size() / w; ++i, b += 2) {
        const uint8_t byte = bits[(b / 8) % bits.size()];
        if (!((byte >> (b % 8)) & 1)) continue;
        // Bit 4: leave large magnitudes alone (their top byte holds a high exponent).
        if ((ctrl & 16) && (data[i * w + w - 1] & 0x7F) >= 0x3C) continue;
        Step(data, i, w, is_float, (byte >> (b % 8 + 1)) & 1);
      }
      break;
    }
    default: {
      const std::span<const uint8_t> rest = in.Rest();
      data.assign(parent.begin(), parent.end());
      if (!rest.empty() && (rest[0] & 1)) {
        data.resize(data.size() - std::min<size_t>(data.size(), rest.size()));
      } else {
        data.insert(data.end(), rest.begin(), rest.end());
      }
      break;
    }
  }

  const int preset = (ctrl >> 2) & 3;
  weightfs::EncodeOptions options = Preset(preset);
  options.sparse_body_version = ((ctrl >> 6) & 3) % 3;
  ChunkCodec fresh(options);
  ChunkCodec& codec = (ctrl & 32) ? reused[preset] : fresh;

  std::vector<uint8_t> full = {0xFF};
  codec.EncodeFull(dtype, data, &full);
  Check(ChunkCodec::Inspect(full).ok() && !ChunkCodec::Inspect(full)->is_delta());
  CheckPayload(codec, full, {}, data);

  std::vector<uint8_t> delta = {0xFF};
  const ChunkEncoding enc = codec.EncodeDelta(dtype, parent, data, &delta);
  const bool same = std::equal(data.begin(), data.end(), parent.begin(), parent.end());
  Check((enc == ChunkEncoding::kSame) == same);
  if (same) {
    Check(delta.empty());
    return 0;
  }
  Check(ChunkCodec::Inspect(delta).ok() && ChunkCodec::Inspect(delta)->encoding == enc);
  CheckPayload(codec, delta, parent, data);

  // Training-like data: two more steps (the same bits, rotated), and the three deltas decoded
  // as one chain in place (a SPARSE run shares one sweep) give the last version exactly.
  if ((ctrl & 3) == 2 && !data.empty()) {
    const size_t w = data.size() % weightfs::DTypeSize(dtype) == 0 ? weightfs::DTypeSize(dtype) : 1;
    const bool is_float = weightfs::DTypeIsFloat(dtype) && w == weightfs::DTypeSize(dtype);
    std::vector<std::vector<uint8_t>> versions = {std::vector<uint8_t>(parent.begin(), parent.end()), data};
    std::vector<std::vector<uint8_t>> payloads = {delta};
    const size_t n = data.size() / w;
    for (size_t step = 1; step <= 2; ++step) {
      std::vector<uint8_t> next = versions.back();
      for (size_t i = 0; i < n; ++i) {
        const uint8_t byte = input[(i * 7 + step * 13) % size];
        if (((byte >> step) & 3) == 1) Step(next, i, w, is_float, (byte >> 5) & 1);
      }
      std::vector<uint8_t> p;
      if (codec.EncodeDelta(dtype, versions.back(), next, &p) == ChunkEncoding::kSame) break;
      payloads.push_back(std::move(p));
      versions.push_back(std::move(next));
    }
    bool in_place = true;
    for (const auto& p : payloads) in_place = in_place && ChunkCodec::Inspect(p)->decodes_in_place();
    if (in_place) {
      std::vector<std::span<const uint8_t>> spans(payloads.begin(), payloads.end());
      for (bool verify_parent : {false, true}) {
        std::vector<uint8_t> out = versions.front();
        weightfs::DecodeLimits limits;
        limits.verify_parent = verify_parent;
        Check(codec.DecodeChainInPlace(spans, out, limits).ok());
        Check(out == versions.back());
      }
    }
  }
  return 0;
}
