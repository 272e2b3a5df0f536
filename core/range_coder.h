// RangeEncoder / RangeDecoder: an adaptive binary range coder (the LZMA construction) used by
// the sparse delta codec to code change positions and values close to their entropy.
//
// Why not zstd for this: the sparse stream is a few symbols per *changed* element, and its
// distributions (gap lengths, ±1/±2 ulp steps) are skewed and drift along a tensor. An adaptive
// binary coder learns them on the fly with no table overhead and reaches within a few percent of
// the empirical entropy, where byte-oriented Huffman over varints loses 10-30%. It costs
// ~20 binary decisions per changed element, which is negligible at the 0.1-5% change rates
// where the sparse codec is chosen.
//
// Probabilities are 12-bit, adapted with shift 5. Bytes: the encoder emits a leading 0 byte and
// flushes 4 more at the end, so a stream is >= 5 bytes. The decoder never reads past its input:
// reading beyond the end yields zeros and is recorded, and the caller rejects such a stream as
// corrupt (overrun()). Neither class is thread-safe; use one per stream.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace weightfs::rc {

inline constexpr int kProbBits = 12;
inline constexpr uint16_t kProbInit = 1u << (kProbBits - 1);
inline constexpr int kMoveBits = 5;
inline constexpr uint32_t kTop = 1u << 24;

using Prob = uint16_t;

class RangeEncoder {
 public:
  explicit RangeEncoder(std::vector<uint8_t>* out) : out_(out) {}

  void EncodeBit(Prob& p, uint32_t bit) {
    const uint32_t bound = (range_ >> kProbBits) * p;
    if (bit == 0) {
      range_ = bound;
      p = static_cast<Prob>(p + (((1u << kProbBits) - p) >> kMoveBits));
    } else {
      low_ += bound;
      range_ -= bound;
      p = static_cast<Prob>(p - (p >> kMoveBits));
    }
    while (range_ < kTop) {
      range_ <<= 8;
      ShiftLow();
    }
  }

  // Equiprobable bits, most significant first. REQUIRES: nbits <= 32.
  void EncodeDirect(uint32_t value, int nbits) {
    for (int i = nbits - 1; i >= 0; --i) {
      range_ >>= 1;
      if ((value >> i) & 1) low_ += range_;
      while (range_ < kTop) {
        range_ <<= 8;
        ShiftLow();
      }
    }
  }

  // Equiprobable `nbits` (1..16) in one step: the range is split into 2^nbits equal parts.
  // Cheaper than bit-by-bit for the uniform low bits of gaps and magnitudes.
  void EncodeBits(uint32_t value, int nbits) {
    range_ >>= nbits;
    low_ += static_cast<uint64_t>(value) * range_;
    while (range_ < kTop) {
      range_ <<= 8;
      ShiftLow();
    }
  }

  // Codes the low `nbits` of `symbol` through a binary tree of adaptive probabilities.
  // REQUIRES: probs has 1 << nbits entries.
  void EncodeTree(Prob* probs, int nbits, uint32_t symbol) {
    uint32_t node = 1;
    for (int i = nbits - 1; i >= 0; --i) {
      const uint32_t bit = (symbol >> i) & 1;
      EncodeBit(probs[node], bit);
      node = (node << 1) | bit;
    }
  }

  void Finish() {
    for (int i = 0; i < 5; ++i) ShiftLow();
  }

 private:
  void ShiftLow() {
    if (static_cast<uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
      const uint8_t carry = static_cast<uint8_t>(low_ >> 32);
      uint8_t temp = cache_;
      do {
        out_->push_back(static_cast<uint8_t>(temp + carry));
        temp = 0xFF;
      } while (--cache_size_ != 0);
      cache_ = static_cast<uint8_t>(low_ >> 24);
    }
    ++cache_size_;
    low_ = (low_ & 0x00FFFFFFu) << 8;
  }

  std::vector<uint8_t>* out_;
  uint64_t low_ = 0;
  uint32_t range_ = 0xFFFFFFFFu;
  uint8_t cache_ = 0;
  uint64_t cache_size_ = 1;
};

class RangeDecoder {
 public:
  explicit RangeDecoder(std::span<const uint8_t> in) : p_(in.data()), end_(in.data() + in.size()) {
    for (int i = 0; i < 5; ++i) code_ = (code_ << 8) | NextByte();
  }

  // Branch-free update: the bits of a well-compressed stream are close to unpredictable, and
  // a mispredicted branch per bit costs more than computing both outcomes.
  [[gnu::always_inline]] uint32_t DecodeBit(Prob& p) {
    const uint32_t pv = p;
    const uint32_t bound = (range_ >> kProbBits) * pv;
    const uint32_t bit = code_ >= bound;
    const uint32_t mask = 0u - bit;  // all ones when the bit is 1
    code_ -= bound & mask;
    range_ = bit ? range_ - bound : bound;
    // bit 0: p += (4096 - p) >> 5;  bit 1: p -= p >> 5.
    const uint32_t up = ((1u << kProbBits) - pv) >> kMoveBits;
    const uint32_t down = pv >> kMoveBits;
    p = static_cast<Prob>(pv + (up & ~mask) - (down & mask));
    if (range_ < kTop) {
      range_ <<= 8;
      code_ = (code_ << 8) | NextByte();
    }
    return bit;
  }

  // REQUIRES: 0 <= nbits <= 32.
  uint32_t DecodeDirect(int nbits) {
    uint32_t v = 0;
    for (unsigned i = 0; i < static_cast<unsigned>(nbits) && i < 32; ++i) {
      range_ >>= 1;
      uint32_t bit = 0;
      if (code_ >= range_) {
        code_ -= range_;
        bit = 1;
      }
      v = (v << 1) | bit;
      if (range_ < kTop) {
        range_ <<= 8;
        code_ = (code_ << 8) | NextByte();
      }
    }
    return v;
  }

  // Inverse of EncodeBits. A value outside [0, 2^nbits) can only come from a corrupt stream:
  // it is clamped and recorded (overrun()).
  [[gnu::always_inline]] uint32_t DecodeBits(int nbits) {
    range_ >>= nbits;
    uint32_t v = code_ / range_;
    if (v >> nbits) {
      overrun_ = true;
      v = (1u << nbits) - 1;
    }
    code_ -= v * range_;
    while (range_ < kTop) {
      range_ <<= 8;
      code_ = (code_ << 8) | NextByte();
    }
    return v;
  }

  uint32_t DecodeTree(Prob* probs, int nbits) {
    uint32_t node = 1;
    for (int i = 0; i < nbits; ++i) node = (node << 1) | DecodeBit(probs[node]);
    return node - (1u << nbits);
  }

  // True when the decoder had to read past the end of its input, or decoded an impossible
  // value: the stream is corrupt.
  bool overrun() const { return overrun_; }
  // Bytes not consumed; a well-formed stream is consumed exactly.
  size_t remaining() const { return static_cast<size_t>(end_ - p_); }

 private:
  uint8_t NextByte() {
    if (p_ < end_) return *p_++;
    overrun_ = true;
    return 0;
  }

  const uint8_t* p_;
  const uint8_t* end_;
  uint32_t range_ = 0xFFFFFFFFu;
  uint32_t code_ = 0;
  bool overrun_ = false;
};

}  // namespace weightfs::rc
