// The SPARSE body of the chunk codec (internal to core/): which elements changed and by how
// much, coded close to their entropy given what the decoder already has, the parent chunk.
//
// Body format:
//   u64 count       total changed elements
//   u16 e_lo        exponent classes: class(x) = clamp(exponent(parent x) - e_lo, 0, K - 1)
//   u8  K           number of classes, 1..16 (1 for integers and bytes)
//   range-coded stream (core/range_coder.h), class by class: the class's change count, then per
//   change the gap to it in the class's own index space and its difference d = ord(new) -
//   ord(parent) (sign + magnitude).
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

struct Scratch {
  std::vector<uint8_t> classes;     // one class byte per element, padded to 64
  std::vector<uint32_t> local;      // class-local index of each change
  std::vector<uint32_t> order;      // changes sorted by class
  std::vector<uint64_t> bitmap;     // changed positions, one bit per element
  std::vector<uint64_t> diffs;      // decoded differences, class by class
  std::vector<uint8_t> candidate;   // the version 1 body, when both are tried
  std::vector<uint32_t> rans_slots; // version 2 decoding tables
  std::vector<uint8_t> bits;        // version 2 bit stream, padded
  std::vector<uint8_t> words;       // version 2 rANS words, padded
};

// The instruction set of the decoder's hot loop (mapping exponent-class indices to positions):
// the best the CPU has, chosen at run time. SetSimd forces one (tests run each); false if the
// CPU lacks it. kSse2 is the portable path (any x86-64, and the plain C++ one elsewhere).
enum class Simd { kBest = -1, kSse2 = 0, kAvx2 = 1, kAvx512 = 2 };
bool SetSimd(Simd simd);

// Positions (element indices) where a and b differ, up to `cap` of them. Returns false when
// more than `cap` differ. REQUIRES: n < 2^32; width in {1, 2, 4, 8}.
bool FindChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                 std::vector<uint32_t>* positions);

// Appends the body for the changes at `positions` (sorted, from FindChanges).
// `dtype` decides float handling and exponent classes; width = DTypeSize(dtype) (1 for bytes).
// Exponent classes are considered only when at most `max_class_fraction` of the elements
// changed (they cost decode time per change; see EncodeOptions).
void Encode(DType dtype, size_t width, const uint8_t* parent, const uint8_t* data, size_t n,
            const std::vector<uint32_t>& positions, double max_class_fraction, Scratch* scratch,
            std::vector<uint8_t>* out);

// Writes parent with the body's changes applied into out (n elements of `width` bytes).
// out may be parent itself (decoding in place touches only the changed elements).
// Corruption on any inconsistency; never reads or writes out of bounds.
Status Decode(DType dtype, size_t width, std::span<const uint8_t> body, const uint8_t* parent,
              uint8_t* out, size_t n, Scratch* scratch);

}  // namespace weightfs::sparse
