// The 64 class bytes of a block of elements, per instruction set (internal to
// core/codec/sparse): BlockSse2 (any x86-64, and plain C++ elsewhere), BlockAvx2 and
// BlockAvx512, each with which of its bytes equal a class (Mask) and the position of a mask's
// r-th set bit (Select). The class sweep (apply_by_class.cc) spends most of a delta's decoding
// time here when the chunk is large and the changes few (k masks per 64 elements whatever the
// number of changes), so it is built for AVX-512BW (one compare per mask) and AVX2 when the CPU
// has them, chosen at run time; the chain sweep (chain.cc) reuses the AVX2 and AVX-512 blocks.
// The AVX2 and AVX-512 members carry their own target attributes (the files are compiled for
// the baseline ISA); the sweeps reach them through wrappers of the same target.
#pragma once

#include <bit>
#include <cstdint>

#include "core/codec/sparse/classes.h"

namespace weightfs::sparse::detail {

struct BlockSse2 {
  static constexpr bool kFusable = false;
  const uint8_t* p;
  [[gnu::always_inline]] explicit BlockSse2(const uint8_t* bytes) : p(bytes) {}
  [[gnu::always_inline]] uint64_t Mask(uint8_t c) const { return ClassMask(p, c); }
  [[gnu::always_inline]] static int Select(uint64_t mask, uint32_t r) { return SelectBit(mask, r); }
};
#if defined(__x86_64__)
struct BlockAvx2 {
  static constexpr bool kFusable = true;
  __m256i lo, hi;
  BlockAvx2() = default;
  [[gnu::target("avx2")]] explicit BlockAvx2(const uint8_t* bytes)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32))) {}
  [[gnu::target("avx2")]] uint64_t Mask(uint8_t c) const {
    const __m256i v = _mm256_set1_epi8(static_cast<char>(c));
    const auto a = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, v)));
    const auto b = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, v)));
    return uint64_t{a} | (uint64_t{b} << 32);
  }
  // The classes of 64 two-byte elements, computed in registers (as ComputeClasses).
  [[gnu::target("avx2")]] BlockAvx2(const uint8_t* elems, const ClassParams& cp) {
    const __m128i shift = _mm_cvtsi32_si128(cp.shift);
    const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(cp.mask));
    const __m256i e_lo = _mm256_set1_epi16(static_cast<int16_t>(cp.e_lo));
    const __m256i top = _mm256_set1_epi16(static_cast<int16_t>(cp.top));
    __m256i c[4];
    for (int q = 0; q < 4; ++q) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(elems + 32 * q));
      const __m256i e = _mm256_and_si256(_mm256_srl_epi16(v, shift), mask);
      c[q] = _mm256_min_epi16(_mm256_subs_epu16(e, e_lo), top);
    }
    // packus interleaves the 128-bit lanes; the permute puts them back in order.
    lo = _mm256_permute4x64_epi64(_mm256_packus_epi16(c[0], c[1]), 0xD8);
    hi = _mm256_permute4x64_epi64(_mm256_packus_epi16(c[2], c[3]), 0xD8);
  }
  // Broadword: AVX2 CPUs include Zen 1-2, whose PDEP is microcoded (hundreds of cycles).
  [[gnu::always_inline]] static int Select(uint64_t mask, uint32_t r) { return SelectBit(mask, r); }
};
struct BlockAvx512 {
  static constexpr bool kFusable = true;
  __m512i v;
  [[gnu::target("avx512f,avx512bw")]] explicit BlockAvx512(const uint8_t* bytes)
      : v(_mm512_loadu_si512(bytes)) {}
  [[gnu::target("avx512f,avx512bw")]] BlockAvx512(const uint8_t* elems, const ClassParams& cp) {
    const __m128i shift = _mm_cvtsi32_si128(cp.shift);
    const __m512i mask = _mm512_set1_epi16(static_cast<int16_t>(cp.mask));
    const __m512i e_lo = _mm512_set1_epi16(static_cast<int16_t>(cp.e_lo));
    const __m512i top = _mm512_set1_epi16(static_cast<int16_t>(cp.top));
    __m256i c[2];
    for (int q = 0; q < 2; ++q) {
      const __m512i x = _mm512_loadu_si512(elems + 64 * q);
      const __m512i e = _mm512_and_si512(_mm512_srl_epi16(x, shift), mask);
      c[q] = _mm512_cvtepi16_epi8(_mm512_min_epi16(_mm512_subs_epu16(e, e_lo), top));
    }
    v = _mm512_inserti64x4(_mm512_castsi256_si512(c[0]), c[1], 1);
  }
  [[gnu::target("avx512f,avx512bw")]] uint64_t Mask(uint8_t c) const {
    return _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(static_cast<char>(c)));
  }
  // PDEP deposits a lone bit at the r-th set bit of mask (fast on every AVX-512 CPU).
  [[gnu::target("avx512f,avx512bw,bmi2")]] static int Select(uint64_t mask, uint32_t r) {
    return std::countr_zero(_pdep_u64(uint64_t{1} << r, mask));
  }
};
#endif

}  // namespace weightfs::sparse::detail
