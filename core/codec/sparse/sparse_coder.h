// The SPARSE body of the chunk codec (internal to core/): which elements changed and by how
// much, coded close to their entropy given what the decoder already has, the parent chunk.
// The implementation is split by concept across this folder (internal.h lists the files).
//
// Body format, version 1 (adaptive; still decoded, written when clearly smaller):
//   u64 count       total changed elements (< 2^32, so its top byte, the version, is 0)
//   u16 e_lo        exponent classes: class(x) = clamp(exponent(parent x) - e_lo, 0, K - 1)
//   u8  K           number of classes, 1..16 (1 for integers and bytes)
//   range-coded stream (core/range_coder.h), class by class: the class's change count, then per
//   change the gap to it in the class's own index space and its difference d = ord(new) -
//   ord(parent) (sign + magnitude).
// Version 2 (static tables + rANS; the same classes, gaps and differences, ~3x faster to decode):
//   u64 count | 2 << 56
//   u16 e_lo, u8 K  as in version 1
//   u32 table_bytes, u32 bit_bytes
//   [table_bytes]  range-coded class table: per class its change count, and for a class with
//                  changes its gap shift s_c, then a "new table" decision (not for the first such
//                  class) and the table, once for gaps and once for values (a run of
//                  neighbouring classes shares one table); a table is its symbol count, its
//                  precision P (4..11) and its frequencies, which sum to 2^P
//   [bit_bytes]    bit stream, LSB first: per change, in class order, escapes and the low s_c
//                  bits of the gap
//   4 x u32        final rANS encoder states, which start the decoder
//   u16 words      to the end of the body: the interleaved rANS stream; the o-th change's gap
//                  symbol is on state 2 (o & 1), its value symbol on state 2 (o & 1) + 1
//   The decoder checks that every state ends at 2^16 and every byte is consumed.
//   Symbols and why: see body_v2.cc beside this file and docs/codec.md.
//
// Why classes: an optimizer step moves every weight by about the same absolute amount (Adam
// normalizes the gradient), while a float's last-place unit grows with its magnitude, so a
// stored bf16 element changes with probability ~ step / ulp: small weights change far more
// often than large ones. The parent's exponent is known to the decoder for free; coding each
// exponent class's positions with their own statistics removes a third of the position bits on
// trained-looking weights. The encoder picks e_lo and K from the chunk's histograms (K = 1 when
// classes do not pay), so data without this structure costs nothing extra.
//
// Not thread-safe per Scratch; the functions are otherwise pure.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"

namespace weightfs::sparse {

// The decoded changes of one delta of a run (DecodeChain).
struct RunBuffers {
  std::vector<uint32_t> local;
  std::vector<uint8_t> diffs;
};

struct Scratch {
  std::vector<uint8_t> classes;     // one class byte per element, padded to 64
  std::vector<uint32_t> local;      // class-local index of each change
  std::vector<uint32_t> order;      // changes sorted by class
  std::vector<uint8_t> diffs;       // decoded differences (elements of the chunk's width)
  std::vector<uint8_t> candidate;   // the version 1 body, when both are tried
  std::vector<uint32_t> rans_slots; // version 2 decoding tables
  std::vector<uint8_t> bits;        // version 2 bit stream, padded
  std::vector<uint8_t> words;       // version 2 rANS words, padded
  std::vector<RunBuffers> run;      // DecodeChain: per delta of a run
};

// The instruction set of the decoder's hot loop (mapping exponent-class indices to positions):
// the best the CPU has, chosen at run time. SetSimd forces one (tests run each); false if the
// CPU lacks it. kSse2 is the portable path (any x86-64, and the plain C++ one elsewhere).
enum class Simd { kBest = -1, kSse2 = 0, kAvx2 = 1, kAvx512 = 2 };
bool SetSimd(Simd simd);

// Positions (element indices) where a and b differ, up to `cap` of them. Returns false when
// more than `cap` differ; it stops at the change past the cap, so *positions then holds every
// change up to its last entry (and cap + 1 entries). REQUIRES: n < 2^32; width in {1, 2, 4, 8}.
bool FindChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                 std::vector<uint32_t>* positions);

// How many elements of a and b differ (n elements of `width` bytes in {1, 2, 4, 8}): one pass,
// 32 bytes a step, no positions kept. For the statistics of a chunk past FindChanges' cap.
uint64_t CountChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n);

// Appends the body for the changes at `positions` (sorted, from FindChanges).
// `dtype` decides float handling and exponent classes; width = DTypeSize(dtype) (1 for bytes).
// Exponent classes are considered only when at most `max_class_fraction` of the elements
// changed (they cost decode time per change; see EncodeOptions).
// `version`: 0 picks (version 2 unless version 1 is clearly smaller), 1 or 2 forces one.
// `force_classes` (tests; 2..16): K exponent classes from the lowest changed exponent, instead
// of the encoder's choice (2, 3, 4, 6 or 8) - the format allows 16, and decoders must take them.
void Encode(DType dtype, size_t width, const uint8_t* parent, const uint8_t* data, size_t n,
            const std::vector<uint32_t>& positions, double max_class_fraction, int version,
            Scratch* scratch, std::vector<uint8_t>* out, int force_classes = 0);

// Writes parent with the body's changes applied into out (n elements of `width` bytes).
// out may be parent itself (decoding in place touches only the changed elements).
// Corruption on any inconsistency; never reads or writes out of bounds.
Status Decode(DType dtype, size_t width, std::span<const uint8_t> body, const uint8_t* parent,
              uint8_t* out, size_t n, Scratch* scratch);

// Decode in place (out == parent == data) that also returns the positions the body changed,
// ascending, in *positions (replaced). Every position it lists holds a different value after
// decoding than before: a body codes only non-zero differences. Slower than Decode by the
// recording and a sort of the positions; meant for tools that need the positions themselves
// (hub/engine/weight_patcher.h), not for the read path.
Status DecodeRecording(DType dtype, size_t width, std::span<const uint8_t> body, uint8_t* data,
                       size_t n, Scratch* scratch, std::vector<uint32_t>* positions);

// Applies bodies[0], bodies[1], ... to data in place, oldest first: the same result as Decode
// of each in turn with out == parent, faster. Consecutive version 2 bodies of a two-byte float
// with the same exponent classes share one sweep over the chunk (see chain.cc beside this file;
// AVX-512 with GFNI and BITALG, else one by one). On error, *failed (if not
// null) is the index of the body at fault and data is unspecified.
Status DecodeChain(DType dtype, size_t width, std::span<const std::span<const uint8_t>> bodies,
                   uint8_t* data, size_t n, Scratch* scratch, size_t* failed);

}  // namespace weightfs::sparse
