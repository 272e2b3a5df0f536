#include "core/sparse_coder.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/element_ops.h"
#include "core/range_coder.h"

namespace weightfs::sparse {
namespace {

using elem::BitLength;
using elem::Load;
using elem::Store;

constexpr int kMaxClasses = 16;
constexpr uint8_t kNoClass = 0xFF;  // padding after the last element

// ---- exponent classes ----------------------------------------------------------------------

struct ExponentField {
  int shift = 0;
  uint32_t mask = 0;  // 0: no classes for this dtype
};

ExponentField ExponentOf(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return {7, 0xFF};
    case DType::kF16: return {10, 0x1F};
    case DType::kF32: return {23, 0xFF};
    case DType::kF64: return {52, 0x7FF};
    case DType::kF8E4M3: return {3, 0xF};
    case DType::kF8E5M2: return {2, 0x1F};
    default: return {0, 0};
  }
}

template <typename T>
void ComputeClasses(const uint8_t* parent, size_t n, ExponentField f, int e_lo, int k,
                    uint8_t* classes) {
  const int top = k - 1;
  size_t i = 0;
#if defined(__SSE2__)
  if constexpr (sizeof(T) == 2) {
    // bf16 and f16, 16 elements per step: exponent field, saturating subtract of e_lo (clamps
    // below at 0), min with the top class (the field is at most 0xFF, so signed min is exact),
    // packed to bytes. The decoder runs this over every element of every delta of a chain.
    const __m128i mask = _mm_set1_epi16(static_cast<int16_t>(f.mask));
    const __m128i lo = _mm_set1_epi16(static_cast<int16_t>(e_lo));
    const __m128i hi = _mm_set1_epi16(static_cast<int16_t>(top));
    const __m128i shift = _mm_cvtsi32_si128(f.shift);
    auto classes8 = [&](const uint8_t* p) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      const __m128i e = _mm_and_si128(_mm_srl_epi16(v, shift), mask);
      return _mm_min_epi16(_mm_subs_epu16(e, lo), hi);
    };
    for (; i + 16 <= n; i += 16) {
      const __m128i a = classes8(parent + i * 2);
      const __m128i b = classes8(parent + i * 2 + 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(classes + i), _mm_packus_epi16(a, b));
    }
  }
#endif
  for (; i < n; ++i) {
    const int e = static_cast<int>((Load<T>(parent + i * sizeof(T)) >> f.shift) & f.mask);
    const int c = std::clamp(e - e_lo, 0, top);
    classes[i] = static_cast<uint8_t>(c);
  }
}

// Bit j set when classes[j] == c, for the 64 bytes at p.
inline uint64_t ClassMask(const uint8_t* p, uint8_t c) {
#if defined(__SSE2__)
  const __m128i v = _mm_set1_epi8(static_cast<char>(c));
  uint64_t m = 0;
  for (int q = 0; q < 4; ++q) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * q));
    m |= static_cast<uint64_t>(static_cast<uint16_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, v))))
         << (16 * q);
  }
  return m;
#else
  uint64_t m = 0;
  for (int j = 0; j < 64; ++j) m |= static_cast<uint64_t>(p[j] == c) << j;
  return m;
#endif
}

// kSelectInByte[k][b]: index of the k-th set bit of byte b (0 when b has fewer bits).
constexpr auto kSelectInByte = [] {
  std::array<std::array<uint8_t, 256>, 8> t{};
  for (int b = 0; b < 256; ++b) {
    int k = 0;
    for (int i = 0; i < 8; ++i) {
      if (b & (1 << i)) t[k++][b] = static_cast<uint8_t>(i);
    }
  }
  return t;
}();

// Index of the k-th (0-based) set bit, branch-free (broadword select: byte popcounts, their
// prefix sums by one multiply, the target byte by a SIMD-within-a-register compare, then a
// table). REQUIRES: k < popcount(x).
[[gnu::always_inline]] inline int SelectBit(uint64_t x, uint32_t k) {
  constexpr uint64_t kOnes = 0x0101010101010101ull;
  constexpr uint64_t kMsbs = 0x8080808080808080ull;
  uint64_t s = x - ((x >> 1) & 0x5555555555555555ull);
  s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
  s = ((s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full) * kOnes;  // byte i: bits set in bytes 0..i
  const uint64_t le = ((uint64_t{k} * kOnes) | kMsbs) - s;  // msb set where prefix <= k
  const int byte = std::popcount(le & kMsbs);
  const auto before = static_cast<uint32_t>(((s << 8) >> (8 * byte)) & 0xFF);
  const auto bits = static_cast<uint32_t>((x >> (8 * byte)) & 0xFF);
  return 8 * byte + kSelectInByte[k - before][bits];
}

double BernoulliBits(double n, double k) {
  if (n <= 0 || k <= 0 || k >= n) return 0;
  const double p = k / n;
  return n * (-p * std::log2(p) - (1 - p) * std::log2(1 - p));
}

// Picks e_lo and K minimizing the estimated position bits plus a per-class learning cost.
template <typename T>
void ChooseClasses(ExponentField f, const uint8_t* parent, size_t n,
                   const std::vector<uint32_t>& positions, int* e_lo_out, int* k_out) {
  *e_lo_out = 0;
  *k_out = 1;
  if (f.mask == 0 || positions.size() < 64) return;
  const size_t range = f.mask + 1;
  std::vector<double> all(range, 0), chg(range, 0);
  const size_t stride = n >= (1u << 16) ? 8 : 1;
  for (size_t i = 0; i < n; i += stride) {
    all[(Load<T>(parent + i * sizeof(T)) >> f.shift) & f.mask] += static_cast<double>(stride);
  }
  for (uint32_t p : positions) chg[(Load<T>(parent + size_t{p} * sizeof(T)) >> f.shift) & f.mask] += 1;
  // Exponents present, to bound the search.
  size_t lo = range, hi = 0;
  for (size_t e = 0; e < range; ++e) {
    if (chg[e] > 0) {
      lo = std::min(lo, e);
      hi = std::max(hi, e);
    }
  }
  if (lo > hi) return;
  std::vector<double> pa(range + 1, 0), pc(range + 1, 0);  // prefix sums
  for (size_t e = 0; e < range; ++e) {
    pa[e + 1] = pa[e] + all[e];
    pc[e + 1] = pc[e] + chg[e];
  }
  auto sum = [&](const std::vector<double>& p, long a, long b) {  // [a, b) clamped
    a = std::clamp<long>(a, 0, static_cast<long>(range));
    b = std::clamp<long>(b, 0, static_cast<long>(range));
    return b > a ? p[b] - p[a] : 0.0;
  };
  constexpr double kClassCostBits = 256;  // adaptive models start from scratch per class
  double best = BernoulliBits(static_cast<double>(n), static_cast<double>(positions.size()));
  for (int k : {2, 3, 4, 6, 8}) {
    for (long e_lo = static_cast<long>(lo) - k + 1; e_lo <= static_cast<long>(hi); ++e_lo) {
      double bits = kClassCostBits * (k - 1);
      for (int c = 0; c < k; ++c) {
        const long a = c == 0 ? 0 : e_lo + c;
        const long b = c == k - 1 ? static_cast<long>(range) : e_lo + c + 1;
        bits += BernoulliBits(sum(pa, a, b), sum(pc, a, b));
      }
      if (bits < best * 0.98 && e_lo >= 0) {
        best = bits;
        *e_lo_out = static_cast<int>(e_lo);
        *k_out = k;
      }
    }
  }
}

// ---- adaptive models ------------------------------------------------------------------------
//
// Binarization, chosen for few binary decisions per change (each costs a few ns to decode):
// - a gap (>= 1, in class-local index space) is Rice-coded with a parameter that tracks the
//   class's running mean gap: the quotient in adaptive unary (usually 0-2 decisions, context =
//   the previous quotient, which captures clustering), the remainder's top bit adaptive and
//   its other bits in one equiprobable step. Close to optimal for the geometric-like gaps of a
//   class with a steady change rate, and it adapts when the rate drifts along a tensor.
// - a difference is a sign (context: previous sign) and a magnitude whose bit length is coded
//   in adaptive unary (a ±1 ulp step, the common case, is one decision), two adaptive mantissa
//   bits, the rest equiprobable.

constexpr int kUnaryLen = 12;  // unary steps for a bit length before escaping to a tree
constexpr int kUnaryQ = 16;    // unary steps for a Rice quotient before escaping
constexpr int kMagCtx = 4;

struct Model {
  rc::Prob count_len[64];
  rc::Prob count_mant[65][8];
  rc::Prob gap_q[kMaxClasses][3][kUnaryQ];
  rc::Prob gap_top[kMaxClasses][34];
  rc::Prob esc_len[64];  // escapes: first gaps, long quotients
  rc::Prob esc_mant[65][8];
  rc::Prob sign[2];
  rc::Prob mag_unary[kMagCtx][kUnaryLen];
  rc::Prob mag_tree[64];
  rc::Prob mag_mant[65][4];
  Model() {
    Fill(count_len);
    Fill(count_mant);
    Fill(gap_q);
    Fill(gap_top);
    Fill(esc_len);
    Fill(esc_mant);
    Fill(sign);
    Fill(mag_unary);
    Fill(mag_tree);
    Fill(mag_mant);
  }
  template <typename A>
  static void Fill(A& array) {
    rc::Prob* p = reinterpret_cast<rc::Prob*>(&array);
    std::fill(p, p + sizeof(A) / sizeof(rc::Prob), rc::kProbInit);
  }
};

// Equiprobable bits of any width, in steps of at most 16.
void EncodeWide(rc::RangeEncoder& enc, uint64_t v, int nbits) {
  while (nbits > 16) {
    nbits -= 16;
    enc.EncodeBits(static_cast<uint32_t>(v >> nbits) & 0xFFFF, 16);
  }
  if (nbits > 0) enc.EncodeBits(static_cast<uint32_t>(v & ((uint64_t{1} << nbits) - 1)), nbits);
}
[[gnu::always_inline]] inline uint64_t DecodeWide(rc::RangeDecoder& dec, int nbits) {
  uint64_t v = 0;
  while (nbits > 16) {
    nbits -= 16;
    v = (v << 16) | dec.DecodeBits(16);
  }
  if (nbits > 0) v = (v << nbits) | dec.DecodeBits(nbits);
  return v;
}

// Elias-gamma binarization of v >= 1 for rare symbols (counts, escapes): bit length through an
// adaptive 6-bit tree, kTreeBits adaptive mantissa bits, the rest equiprobable.
template <int kTreeBits>
void EncodeGamma(rc::RangeEncoder& enc, rc::Prob* len_probs, rc::Prob (*mant_probs)[1 << kTreeBits],
                 uint64_t v) {
  const int len = BitLength(v);
  enc.EncodeTree(len_probs, 6, static_cast<uint32_t>(len - 1));
  const int m = len - 1;
  const uint64_t rest = v - (uint64_t{1} << m);
  const int top = std::min(m, kTreeBits);
  enc.EncodeTree(mant_probs[len], top, static_cast<uint32_t>(rest >> (m - top)));
  EncodeWide(enc, rest, m - top);
}

// Returns 0 when the decoded bit length exceeds max_len (a corrupt stream).
template <int kTreeBits>
uint64_t DecodeGamma(rc::RangeDecoder& dec, rc::Prob* len_probs,
                     rc::Prob (*mant_probs)[1 << kTreeBits], int max_len) {
  const int len = static_cast<int>(dec.DecodeTree(len_probs, 6)) + 1;
  if (len > max_len) return 0;
  const int m = len - 1;
  const int top = std::min(m, kTreeBits);
  uint64_t rest = dec.DecodeTree(mant_probs[len], top);
  rest = (rest << (m - top)) | DecodeWide(dec, m - top);
  return (uint64_t{1} << m) + rest;
}

// Per-class coding state.
struct ClassState {
  uint64_t mean16 = 0;  // running mean gap x 16 (0 before the first gap)
  int prev_q = 0;       // previous Rice quotient, capped at 2
  int prev_mag_len = 0;
  uint32_t prev_sign = 0;
};

// Rice parameter for a geometric source of the given mean: ~log2(mean * ln 2).
inline int RiceK(uint64_t mean16) {
  const uint64_t m = (mean16 * 11) >> 8;  // mean * 0.69
  return std::min(m == 0 ? 0 : BitLength(m) - 1, 32);
}

inline void UpdateMean(ClassState& s, uint64_t gap) {
  const uint64_t g16 = std::min<uint64_t>(gap, uint64_t{1} << 40) << 4;
  s.mean16 = s.mean16 == 0 ? g16 : s.mean16 - (s.mean16 >> 4) + (g16 >> 4);
}

void EncodeGap(rc::RangeEncoder& enc, Model& m, ClassState& s, int cls, uint64_t gap) {
  if (s.mean16 == 0) {
    EncodeGamma<3>(enc, m.esc_len, m.esc_mant, gap);
  } else {
    const int k = RiceK(s.mean16);
    const uint64_t v = gap - 1;
    const uint64_t q = v >> k;
    rc::Prob* probs = m.gap_q[cls][s.prev_q];
    const int ones = static_cast<int>(std::min<uint64_t>(q, kUnaryQ));
    for (int i = 0; i < ones; ++i) enc.EncodeBit(probs[i], 1);
    if (q < kUnaryQ) {
      enc.EncodeBit(probs[q], 0);
    } else {
      EncodeGamma<3>(enc, m.esc_len, m.esc_mant, q - kUnaryQ + 1);
    }
    if (k > 0) {
      const uint64_t r = v & ((uint64_t{1} << k) - 1);
      enc.EncodeBit(m.gap_top[cls][k], static_cast<uint32_t>(r >> (k - 1)));
      EncodeWide(enc, r, k - 1);
    }
    s.prev_q = static_cast<int>(std::min<uint64_t>(q, 2));
  }
  UpdateMean(s, gap);
}

// Returns 0 for a corrupt stream.
[[gnu::always_inline]] inline uint64_t DecodeGap(rc::RangeDecoder& dec, Model& m, ClassState& s, int cls) {
  uint64_t gap;
  if (s.mean16 == 0) {
    gap = DecodeGamma<3>(dec, m.esc_len, m.esc_mant, 33);
  } else {
    const int k = RiceK(s.mean16);
    rc::Prob* probs = m.gap_q[cls][s.prev_q];
    uint64_t q = 0;
    while (q < kUnaryQ && dec.DecodeBit(probs[q])) ++q;
    if (q == kUnaryQ) {
      const uint64_t extra = DecodeGamma<3>(dec, m.esc_len, m.esc_mant, 33);
      if (extra == 0) return 0;
      q += extra - 1;
    }
    if (q > (uint64_t{1} << 33)) return 0;
    uint64_t r = 0;
    if (k > 0) {
      r = uint64_t{dec.DecodeBit(m.gap_top[cls][k])} << (k - 1);
      r |= DecodeWide(dec, k - 1);
    }
    gap = (q << k) + r + 1;
    s.prev_q = static_cast<int>(std::min<uint64_t>(q, 2));
  }
  if (gap == 0 || gap > (uint64_t{1} << 33)) return 0;
  UpdateMean(s, gap);
  return gap;
}

void EncodeMagnitude(rc::RangeEncoder& enc, Model& m, ClassState& s, uint64_t mag) {
  const int len = BitLength(mag);
  rc::Prob* unary = m.mag_unary[std::min(s.prev_mag_len, kMagCtx) - (s.prev_mag_len > 0)];
  for (int i = 1; i < std::min(len, kUnaryLen + 1); ++i) enc.EncodeBit(unary[i - 1], 1);
  if (len <= kUnaryLen) {
    enc.EncodeBit(unary[len - 1], 0);
  } else {
    enc.EncodeTree(m.mag_tree, 6, static_cast<uint32_t>(len - 1));
  }
  const int bits = len - 1;
  const uint64_t rest = mag - (uint64_t{1} << bits);
  const int top = std::min(bits, 2);
  enc.EncodeTree(m.mag_mant[len], top, static_cast<uint32_t>(rest >> (bits - top)));
  EncodeWide(enc, rest, bits - top);
  s.prev_mag_len = len;
}

// Returns 0 for a corrupt stream (length above max_len).
[[gnu::always_inline]] inline uint64_t DecodeMagnitude(rc::RangeDecoder& dec, Model& m, ClassState& s,
                                                     int max_len) {
  rc::Prob* unary = m.mag_unary[std::min(s.prev_mag_len, kMagCtx) - (s.prev_mag_len > 0)];
  int len = 1;
  while (len <= kUnaryLen && dec.DecodeBit(unary[len - 1])) ++len;
  if (len > kUnaryLen) len = static_cast<int>(dec.DecodeTree(m.mag_tree, 6)) + 1;
  if (len > max_len) return 0;
  const int bits = len - 1;
  const int top = std::min(bits, 2);
  uint64_t rest = dec.DecodeTree(m.mag_mant[len], top);
  rest = (rest << (bits - top)) | DecodeWide(dec, bits - top);
  s.prev_mag_len = len;
  return (uint64_t{1} << bits) + rest;
}

template <typename T>
void EncodeChange(rc::RangeEncoder& enc, Model& m, ClassState& s, int cls, uint64_t gap, T old_v,
                  T new_v, bool is_float) {
  EncodeGap(enc, m, s, cls, gap);
  const T d = T(elem::ToOrd(new_v, is_float) - elem::ToOrd(old_v, is_float));
  const uint32_t sign = static_cast<uint32_t>(d >> (sizeof(T) * 8 - 1));
  const uint64_t mag = sign ? uint64_t(T(T(0) - d)) : uint64_t(d);
  enc.EncodeBit(m.sign[s.prev_sign], sign);
  EncodeMagnitude(enc, m, s, mag);
  s.prev_sign = sign;
}

template <typename T>
void EncodeT(DType dtype, const uint8_t* parent, const uint8_t* data, size_t n,
             const std::vector<uint32_t>& positions, double max_class_fraction, Scratch* scratch,
             std::vector<uint8_t>* out) {
  const bool is_float = DTypeIsFloat(dtype) && DTypeSize(dtype) == sizeof(T);
  const ExponentField f = is_float ? ExponentOf(dtype) : ExponentField{};
  int e_lo = 0, k = 1;
  if (static_cast<double>(positions.size()) <= max_class_fraction * static_cast<double>(n)) {
    ChooseClasses<T>(f, parent, n, positions, &e_lo, &k);
  }

  const size_t at = out->size();
  out->resize(at + 11);
  uint8_t* h = out->data() + at;
  const uint64_t count = positions.size();
  std::memcpy(h, &count, 8);
  const uint16_t e_lo16 = static_cast<uint16_t>(e_lo);
  std::memcpy(h + 8, &e_lo16, 2);
  h[10] = static_cast<uint8_t>(k);

  auto model = std::make_unique<Model>();
  rc::RangeEncoder enc(out);
  if (k == 1) {
    EncodeGamma<3>(enc, model->count_len, model->count_mant, count + 1);
    ClassState s;
    int64_t prev = -1;
    for (uint32_t pos : positions) {
      EncodeChange<T>(enc, *model, s, 0, static_cast<uint64_t>(int64_t{pos} - prev),
                      Load<T>(parent + size_t{pos} * sizeof(T)),
                      Load<T>(data + size_t{pos} * sizeof(T)), is_float);
      prev = pos;
    }
    enc.Finish();
    return;
  }
  // Class of every element, then the class-local index of every change.
  std::vector<uint8_t>& classes = scratch->classes;
  classes.resize((n + 63) / 64 * 64);
  std::fill(classes.begin() + static_cast<ptrdiff_t>(n), classes.end(), kNoClass);
  ComputeClasses<T>(parent, n, f, e_lo, k, classes.data());
  std::vector<uint32_t>& local = scratch->local;
  local.resize(positions.size());
  uint32_t seen[kMaxClasses] = {};
  size_t next = 0;
  for (size_t block = 0; block * 64 < n && next < positions.size(); ++block) {
    const uint8_t* p = classes.data() + block * 64;
    const size_t end = block * 64 + 64;
    uint64_t masks[kMaxClasses];
    for (int c = 0; c < k; ++c) masks[c] = ClassMask(p, static_cast<uint8_t>(c));
    for (; next < positions.size() && positions[next] < end; ++next) {
      const uint32_t j = positions[next] - static_cast<uint32_t>(block * 64);
      const uint8_t c = p[j];
      local[next] = seen[c] + static_cast<uint32_t>(std::popcount(masks[c] & ((uint64_t{1} << j) - 1)));
    }
    for (int c = 0; c < k; ++c) seen[c] += static_cast<uint32_t>(std::popcount(masks[c]));
  }
  // Changes grouped by class, positions ascending inside each (stable).
  std::vector<uint32_t>& order = scratch->order;
  order.resize(positions.size());
  uint32_t start[kMaxClasses + 1] = {};
  for (uint32_t pos : positions) ++start[classes[pos] + 1];
  for (int c = 0; c < k; ++c) start[c + 1] += start[c];
  {
    uint32_t fill[kMaxClasses];
    std::copy(start, start + k, fill);
    for (uint32_t i = 0; i < positions.size(); ++i) order[fill[classes[positions[i]]]++] = i;
  }
  for (int c = 0; c < k; ++c) {
    EncodeGamma<3>(enc, model->count_len, model->count_mant, uint64_t{start[c + 1] - start[c]} + 1);
    ClassState s;
    int64_t prev = -1;
    for (uint32_t o = start[c]; o < start[c + 1]; ++o) {
      const uint32_t i = order[o];
      const uint32_t pos = positions[i];
      EncodeChange<T>(enc, *model, s, c, static_cast<uint64_t>(int64_t{local[i]} - prev),
                      Load<T>(parent + size_t{pos} * sizeof(T)),
                      Load<T>(data + size_t{pos} * sizeof(T)), is_float);
      prev = local[i];
    }
  }
  enc.Finish();
}

// Decodes one change's difference (sign and magnitude). False when out of range (corrupt).
// The sign's context is the previous sign only: the parent's own sign was measured to add
// nothing, and leaving it out lets values be decoded without touching the parent (see DecodeT).
template <typename T>
[[gnu::always_inline]] inline bool DecodeValue(rc::RangeDecoder& dec, Model& m, ClassState& s, T* d) {
  const uint32_t sign = dec.DecodeBit(m.sign[s.prev_sign]);
  const uint64_t mag = DecodeMagnitude(dec, m, s, static_cast<int>(sizeof(T) * 8));
  if (mag == 0) return false;
  s.prev_sign = sign;
  *d = sign ? T(T(0) - T(mag)) : T(mag);
  return true;
}

// Builds the output front to back: copies the parent's elements up to `pos`, then writes the
// changed element. Copying in step with the changes keeps every touched line in cache; a bulk
// copy first (large memcpy uses non-temporal stores) and scattered updates after it measured
// a cache miss per change.
template <typename T>
struct OutputWriter {
  const uint8_t* parent;
  uint8_t* out;
  size_t n;
  size_t done = 0;  // elements [0, done) are written
  bool is_float;

  // Copies the parent's elements [done, end) (nothing to copy when decoding in place).
  void CopyTo(size_t end) {
    if (end > done && out != parent) std::memcpy(out + done * sizeof(T), parent + done * sizeof(T), (end - done) * sizeof(T));
    done = end;
  }
  // Adds d to the already copied element at pos (REQUIRES: pos < done).
  void Patch(size_t pos, T d) {
    uint8_t* slot = out + pos * sizeof(T);
    Store<T>(slot, elem::FromOrd(T(elem::ToOrd(Load<T>(slot), is_float) + d), is_float));
  }
  void Change(size_t pos, T d) {
    CopyTo(pos + 1);
    Patch(pos, d);
  }
  void Finish() { CopyTo(n); }
};

// The 64 class bytes of a block, and which of them equal a class. The sweep below spends most
// of a delta's decoding time here when the chunk is large and the changes few (k masks per
// 64 elements whatever the number of changes), so it is built for AVX-512BW (one compare per
// mask) and AVX2 when the CPU has them, chosen at run time.
struct BlockSse2 {
  const uint8_t* p;
  [[gnu::always_inline]] explicit BlockSse2(const uint8_t* bytes) : p(bytes) {}
  [[gnu::always_inline]] uint64_t Mask(uint8_t c) const { return ClassMask(p, c); }
  [[gnu::always_inline]] static int Select(uint64_t mask, uint32_t r) { return SelectBit(mask, r); }
};
#if defined(__x86_64__)
struct BlockAvx2 {
  __m256i lo, hi;
  [[gnu::target("avx2")]] explicit BlockAvx2(const uint8_t* bytes)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32))) {}
  [[gnu::target("avx2")]] uint64_t Mask(uint8_t c) const {
    const __m256i v = _mm256_set1_epi8(static_cast<char>(c));
    const auto a = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(lo, v)));
    const auto b = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(hi, v)));
    return uint64_t{a} | (uint64_t{b} << 32);
  }
  // Broadword: AVX2 CPUs include Zen 1-2, whose PDEP is microcoded (hundreds of cycles).
  [[gnu::always_inline]] static int Select(uint64_t mask, uint32_t r) { return SelectBit(mask, r); }
};
struct BlockAvx512 {
  __m512i v;
  [[gnu::target("avx512f,avx512bw")]] explicit BlockAvx512(const uint8_t* bytes)
      : v(_mm512_loadu_si512(bytes)) {}
  [[gnu::target("avx512f,avx512bw")]] uint64_t Mask(uint8_t c) const {
    return _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(static_cast<char>(c)));
  }
  // PDEP deposits a lone bit at the r-th set bit of mask (fast on every AVX-512 CPU).
  [[gnu::target("avx512f,avx512bw,bmi2")]] static int Select(uint64_t mask, uint32_t r) {
    return std::countr_zero(_pdep_u64(uint64_t{1} << r, mask));
  }
};
#endif

// Applies changes given per class as class-local indices (local[class_start[c]..
// class_start[c + 1]) ascending, with their differences) in one sweep over the blocks: per
// block, each class that still has changes counts its members there and patches the ones
// whose index falls in the block (the block is copied from the parent first, so the order of
// patches within it does not matter). Returns false if an index lies beyond the class's
// members. Block::Select(mask, r) is the position of the r-th set bit of mask.
// (Not always_inline: the ISA wrappers below flatten it, with their own target.)
template <typename Block, typename T>
bool ApplyByClassT(const uint8_t* classes, size_t n, int k, const uint32_t* class_start,
                   const uint32_t* local, const uint64_t* diffs, OutputWriter<T>& writer) {
  uint64_t seen[kMaxClasses] = {};
  uint32_t next[kMaxClasses];
  uint32_t active = 0;
  for (int c = 0; c < k; ++c) {
    next[c] = class_start[c];
    if (class_start[c] < class_start[c + 1]) active |= 1u << c;
  }
  const size_t blocks = (n + 63) / 64;
  for (size_t b = 0; b < blocks && active != 0; ++b) {
    const Block block(classes + b * 64);
    const size_t first = b * 64;
    bool copied = false;
    for (uint32_t a = active; a != 0; a &= a - 1) {
      const int c = std::countr_zero(a);
      const uint64_t mask = block.Mask(static_cast<uint8_t>(c));
      const uint64_t before = seen[c];
      const uint64_t members = before + static_cast<uint64_t>(std::popcount(mask));
      seen[c] = members;
      uint32_t j = next[c];
      if (local[j] >= members) continue;
      if (!copied) {
        writer.CopyTo(std::min(first + 64, n));
        copied = true;
      }
      const uint32_t end = class_start[c + 1];
      do {
        const size_t pos = first + static_cast<size_t>(
                                       Block::Select(mask, static_cast<uint32_t>(local[j] - before)));
        writer.Patch(pos, static_cast<T>(diffs[j]));
      } while (++j < end && local[j] < members);
      next[c] = j;
      if (j == end) active &= ~(1u << c);
    }
  }
  return active == 0;
}

#if defined(__x86_64__)
template <typename T>
[[gnu::target("avx2"), gnu::flatten]] bool ApplyByClassAvx2(const uint8_t* classes, size_t n, int k,
                                              const uint32_t* class_start, const uint32_t* local,
                                              const uint64_t* diffs, OutputWriter<T>& writer) {
  return ApplyByClassT<BlockAvx2>(classes, n, k, class_start, local, diffs, writer);
}
template <typename T>
[[gnu::target("avx512f,avx512bw,bmi2"), gnu::flatten]] bool ApplyByClassAvx512(const uint8_t* classes, size_t n, int k,
                                                            const uint32_t* class_start,
                                                            const uint32_t* local,
                                                            const uint64_t* diffs,
                                                            OutputWriter<T>& writer) {
  return ApplyByClassT<BlockAvx512>(classes, n, k, class_start, local, diffs, writer);
}
#endif

Simd BestSimd() {
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("bmi2")) return Simd::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Simd::kAvx2;
#endif
  return Simd::kSse2;
}

std::atomic<Simd> g_simd{BestSimd()};

template <typename T>
bool ApplyByClass(const uint8_t* classes, size_t n, int k, const uint32_t* class_start,
                  const uint32_t* local, const uint64_t* diffs, OutputWriter<T>& writer) {
  switch (g_simd.load(std::memory_order_relaxed)) {
#if defined(__x86_64__)
    case Simd::kAvx512: return ApplyByClassAvx512(classes, n, k, class_start, local, diffs, writer);
    case Simd::kAvx2: return ApplyByClassAvx2(classes, n, k, class_start, local, diffs, writer);
#endif
    default: return ApplyByClassT<BlockSse2>(classes, n, k, class_start, local, diffs, writer);
  }
}

template <typename T>
Status DecodeT(DType dtype, std::span<const uint8_t> body, const uint8_t* parent, uint8_t* out,
               size_t n, Scratch* scratch) {
  if (body.size() < 11) return Status::Corruption("sparse body shorter than its header");
  uint64_t count;
  std::memcpy(&count, body.data(), 8);
  uint16_t e_lo;
  std::memcpy(&e_lo, body.data() + 8, 2);
  const int k = body[10];
  if (count > n) {
    return Status::Corruption("sparse body claims " + std::to_string(count) + " changes in " +
                              std::to_string(n) + " elements");
  }
  // No bound of the count by the body size: a regular pattern (every 4th element +1) costs the
  // adaptive coder far less than a bit per change, so any such bound rejects streams the encoder
  // writes (found by chunk_roundtrip_fuzz). count <= n already caps a forged count's work at
  // that of decoding a genuine chunk of this size.
  const bool is_float = DTypeIsFloat(dtype) && DTypeSize(dtype) == sizeof(T);
  const ExponentField f = is_float ? ExponentOf(dtype) : ExponentField{};
  if (k < 1 || k > kMaxClasses || (k > 1 && (f.mask == 0 || e_lo > f.mask))) {
    return Status::Corruption("sparse body has an invalid class table");
  }
  OutputWriter<T> writer{parent, out, n, 0, is_float};
  auto model = std::make_unique<Model>();
  rc::RangeDecoder dec(body.subspan(11));
  auto bad = [](const char* what) { return Status::Corruption(std::string("sparse body: ") + what); };
  uint64_t total = 0;

  if (k == 1) {
    const uint64_t c_count = DecodeGamma<3>(dec, model->count_len, model->count_mant, 33);
    if (c_count == 0 || c_count - 1 != count) return bad("class counts do not add up");
    ClassState s;
    uint64_t next = 0;
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t gap = DecodeGap(dec, *model, s, 0);
      const uint64_t pos = next + gap - 1;
      if (gap == 0 || pos >= n || dec.overrun()) return bad("a change lies outside the chunk");
      next = pos + 1;
      T d;
      if (!DecodeValue<T>(dec, *model, s, &d)) return bad("value out of range");
      writer.Change(pos, d);
    }
  } else {
    // First the whole stream: each class's changes as class-local indices (the gaps summed)
    // and differences, class after class. Then one sweep over the chunk maps class-local
    // indices to positions and applies the differences in position order.
    std::vector<uint32_t>& local = scratch->local;
    local.resize(count);
    std::vector<uint64_t>& diffs = scratch->diffs;
    diffs.resize(count);
    uint32_t class_start[kMaxClasses + 1] = {};
    for (int c = 0; c < k; ++c) {
      const uint64_t c_count1 = DecodeGamma<3>(dec, model->count_len, model->count_mant, 33);
      if (c_count1 == 0 || c_count1 - 1 > count - total) return bad("class counts do not add up");
      const uint64_t c_count = c_count1 - 1;
      ClassState s;
      uint64_t target = 0;  // class-local index of the next change
      for (uint64_t i = 0; i < c_count; ++i) {
        const uint64_t gap = DecodeGap(dec, *model, s, c);
        if (gap == 0 || dec.overrun()) return bad("gap out of range");
        target += gap - (i == 0 ? 1 : 0);
        if (target >= n) return bad("a change lies outside the chunk");
        T d;
        if (!DecodeValue<T>(dec, *model, s, &d)) return bad("value out of range");
        local[total + i] = static_cast<uint32_t>(target);
        diffs[total + i] = d;
      }
      total += c_count;
      class_start[c + 1] = static_cast<uint32_t>(total);
    }
    if (total != count) return bad("class counts do not add up");
    std::vector<uint8_t>& classes = scratch->classes;
    classes.resize((n + 63) / 64 * 64);
    std::fill(classes.begin() + static_cast<ptrdiff_t>(n), classes.end(), kNoClass);
    ComputeClasses<T>(parent, n, f, e_lo, k, classes.data());
    if (!ApplyByClass(classes.data(), n, k, class_start, local.data(), diffs.data(), writer)) {
      return bad("a change lies outside the chunk");
    }
  }
  writer.Finish();
  if (dec.overrun() || dec.remaining() != 0) {
    return bad("range-coded stream length does not match its content");
  }
  return Status::Ok();
}

template <typename T>
bool FindChangesT(const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                  std::vector<uint32_t>* positions) {
  positions->clear();
  constexpr size_t kBlock = 32 / sizeof(T);  // elements per 32-byte block
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint8_t* pa = a + i * sizeof(T);
    const uint8_t* pb = b + i * sizeof(T);
    uint64_t diff = 0;
    for (size_t w = 0; w < 4; ++w) diff |= Load<uint64_t>(pa + 8 * w) ^ Load<uint64_t>(pb + 8 * w);
    if (diff == 0) continue;
    for (size_t j = 0; j < kBlock; ++j) {
      if (Load<T>(pa + j * sizeof(T)) != Load<T>(pb + j * sizeof(T))) {
        positions->push_back(static_cast<uint32_t>(i + j));
      }
    }
    if (positions->size() > cap) return false;
  }
  for (; i < n; ++i) {
    if (Load<T>(a + i * sizeof(T)) != Load<T>(b + i * sizeof(T))) {
      positions->push_back(static_cast<uint32_t>(i));
    }
  }
  return positions->size() <= cap;
}

}  // namespace

bool FindChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                 std::vector<uint32_t>* positions) {
  return elem::DispatchWidth(width, [&]<typename T>() { return FindChangesT<T>(a, b, n, cap, positions); });
}

void Encode(DType dtype, size_t width, const uint8_t* parent, const uint8_t* data, size_t n,
            const std::vector<uint32_t>& positions, double max_class_fraction, Scratch* scratch,
            std::vector<uint8_t>* out) {
  elem::DispatchWidth(width, [&]<typename T>() {
    EncodeT<T>(dtype, parent, data, n, positions, max_class_fraction, scratch, out);
  });
}

bool SetSimd(Simd simd) {
  if (simd == Simd::kBest) simd = BestSimd();
  if (static_cast<int>(simd) > static_cast<int>(BestSimd())) return false;
  g_simd = simd;
  return true;
}

Status Decode(DType dtype, size_t width, std::span<const uint8_t> body, const uint8_t* parent,
              uint8_t* out, size_t n, Scratch* scratch) {
  return elem::DispatchWidth(width, [&]<typename T>() {
    return DecodeT<T>(dtype, body, parent, out, n, scratch);
  });
}

}  // namespace weightfs::sparse
