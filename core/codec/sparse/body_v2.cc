// Body version 2 of the sparse codec: static per-chunk tables and interleaved rANS (format in
// sparse_coder.h), the encoder's choice of tables and the decoder's stream reader.
//
// Version 2 codes the same (class, gap, difference) stream as version 1, with per-chunk static
// frequency tables and four interleaved rANS states instead of adaptive binary decisions.
// Why: at 5-10% changed, version 1 spends ~5 adaptive decisions and a division per change, each
// a link of one dependency chain, with an unpredictable branch or two: ~100 cycles per change.
// A table-driven rANS symbol is a load, a multiply and a branch-free refill, and four states
// let the CPU run four chains at once. What it gives up: adaptivity along the chunk, the
// previous-symbol contexts, and the bytes of the tables; the encoder keeps version 1 when that
// is smaller (small chunks, few changes).
//
// Symbols, per change of class c (gaps in the class's own index space, as in version 1):
//   gap:   v = gap - 1, q = v >> s_c. Symbol min(q, 63); 63 escapes to Elias-gamma(q - 62) in
//          the bit stream. Then the s_c low bits of v in the bit stream. The encoder picks s_c
//          (per class, by cost) so that q has a mean of a few units: the table captures the
//          shape of the gap distribution and the low bits are close to uniform.
//   value: d = ord(new) - ord(parent) as sign + magnitude: symbol 2 (|d| - 1) + sign for
//          |d| <= 15, 30 + sign above, with Elias-gamma(|d| - 15) in the bit stream.
// Tables: per class one for gaps and one for values, each normalized to 2^P (P in 4..11,
// chosen by the encoder for the least table + payload cost: a class with few changes gets a
// coarse, cheap table).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "core/codec/sparse/internal.h"

namespace weightfs::sparse::detail {
namespace {

using elem::BitLength;
using elem::Load;

constexpr int kGapSymbols = 64;
constexpr uint32_t kGapEscape = kGapSymbols - 1;
constexpr int kValueSymbols = 32;
constexpr uint32_t kValueEscape = 30;  // and 31: the escapes of the two signs
constexpr uint64_t kMaxValueDirect = kValueEscape / 2;  // largest magnitude with its own symbol
constexpr int kMinTableBits = 4;
constexpr int kMaxTableBits = 11;
constexpr int kMaxGapShift = 32;  // gaps are below 2^32
constexpr uint32_t kRansL = 1u << 16;  // state interval [2^16, 2^32), 16-bit renormalization
constexpr int kRansStates = 4;
constexpr size_t kV2HeaderBytes = 19;

// A normalized frequency table: freq sums to 2^bits; symbols that occur have freq >= 1.
struct FreqTable {
  int bits = kMaxTableBits;
  int nsym = 0;  // symbols [0, nsym) are described; freq is 0 beyond
  uint32_t freq[kGapSymbols] = {};
  uint32_t start[kGapSymbols + 1] = {};
};

void FillStarts(FreqTable* t) {
  uint32_t acc = 0;
  for (int i = 0; i < kGapSymbols; ++i) {
    t->start[i] = acc;
    acc += t->freq[i];
  }
  t->start[kGapSymbols] = acc;
}

// The same probabilities at the decoder's precision, 2^kMaxTableBits (one table size and no
// variable shifts in the decoding loop).
void ScaleTable(FreqTable* t) {
  for (uint32_t& f : t->freq) f <<= kMaxTableBits - t->bits;
  t->bits = kMaxTableBits;
  FillStarts(t);
}

// Normalizes counts to 2^bits. False when more symbols occur than the table has slots.
bool Normalize(const uint32_t* counts, int nsym, int bits, FreqTable* t) {
  uint64_t total = 0;
  int used = 0;
  for (int i = 0; i < nsym; ++i) {
    total += counts[i];
    used += counts[i] != 0;
  }
  const int64_t target = int64_t{1} << bits;
  if (total == 0 || used > target) return false;
  *t = FreqTable{};
  t->bits = bits;
  int64_t sum = 0;
  for (int i = 0; i < nsym; ++i) {
    if (counts[i] == 0) continue;
    const uint64_t f = (uint64_t{counts[i]} * static_cast<uint64_t>(target) + total / 2) / total;
    t->freq[i] = static_cast<uint32_t>(std::max<uint64_t>(1, f));
    t->nsym = i + 1;
    sum += t->freq[i];
  }
  // Rounding moved the sum by at most `used`; settle it on the largest frequencies.
  while (sum != target) {
    int best = 0;
    for (int i = 1; i < nsym; ++i) {
      if (t->freq[i] > t->freq[best]) best = i;
    }
    const int64_t change =
        sum < target ? target - sum : -std::min<int64_t>(sum - target, t->freq[best] - 1);
    if (change == 0) return false;  // unreachable: used <= target
    t->freq[best] = static_cast<uint32_t>(t->freq[best] + change);
    sum += change;
  }
  FillStarts(t);
  return true;
}

// Bits to code `counts` with t, plus an estimate of the table's description.
double TableCost(const uint32_t* counts, const FreqTable& t) {
  double bits = 12;
  for (int i = 0; i < t.nsym; ++i) {
    if (counts[i] != 0) {
      bits += counts[i] * (t.bits - std::log2(static_cast<double>(t.freq[i])));
    }
    bits += 1.5 * BitLength(uint64_t{t.freq[i]} + 1);
  }
  return bits;
}

// The cheapest table for `counts` over the allowed precisions.
FreqTable ChooseTable(const uint32_t* counts, int nsym, double* cost) {
  FreqTable best, t;
  double best_cost = 1e300;
  for (int bits = kMinTableBits; bits <= kMaxTableBits; ++bits) {
    if (!Normalize(counts, nsym, bits, &t)) continue;
    const double c = TableCost(counts, t);
    if (c < best_cost) {
      best_cost = c;
      best = t;
    }
  }
  *cost = best_cost;
  return best;
}

// Adaptive models of the version 2 class table (range-coded: it is small and read once).
struct TableModel {
  rc::Prob count_len[64];
  rc::Prob count_mant[65][8];
  rc::Prob shift[64];
  rc::Prob nsym[2][64];
  rc::Prob freq_len[2][14][64];
  rc::Prob freq_mant[2][65][4];
  rc::Prob new_table[2];
  TableModel() {
    FillProbs(new_table);
    FillProbs(count_len);
    FillProbs(count_mant);
    FillProbs(shift);
    FillProbs(nsym);
    FillProbs(freq_len);
    FillProbs(freq_mant);
  }
};

// A table: nsym - 1 (6-bit tree), P - 4 (3 direct bits), then freq + 1 of each symbol below
// nsym (Elias-gamma, its length in the context of the previous one's).
void EncodeTable(rc::RangeEncoder& enc, TableModel& m, int kind, const FreqTable& t) {
  enc.EncodeTree(m.nsym[kind], 6, static_cast<uint32_t>(t.nsym - 1));
  enc.EncodeDirect(static_cast<uint32_t>(t.bits - kMinTableBits), 3);
  int prev_len = 0;
  for (int i = 0; i < t.nsym; ++i) {
    const uint64_t v = uint64_t{t.freq[i]} + 1;
    EncodeGamma<2>(enc, m.freq_len[kind][prev_len], m.freq_mant[kind], v);
    prev_len = BitLength(v);
  }
}

// False on an inconsistent table (frequencies not summing to 2^P, or past max_sym).
bool DecodeTable(rc::RangeDecoder& dec, TableModel& m, int kind, int max_sym, FreqTable* t) {
  *t = FreqTable{};
  t->nsym = static_cast<int>(dec.DecodeTree(m.nsym[kind], 6)) + 1;
  t->bits = static_cast<int>(dec.DecodeDirect(3)) + kMinTableBits;
  if (t->nsym > max_sym || t->bits > kMaxTableBits) return false;
  int prev_len = 0;
  uint64_t sum = 0;
  for (int i = 0; i < t->nsym; ++i) {
    const uint64_t v = DecodeGamma<2>(dec, m.freq_len[kind][prev_len], m.freq_mant[kind], 13);
    if (v == 0) return false;
    t->freq[i] = static_cast<uint32_t>(v - 1);
    sum += v - 1;
    prev_len = BitLength(v);
  }
  if (sum != (uint64_t{1} << t->bits)) return false;
  ScaleTable(t);
  return true;
}

// Forward bit stream, least significant bit first.
class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>* out) : out_(out) {}
  void Put(uint64_t v, int nbits) {  // REQUIRES: nbits <= 32
    acc_ |= (v & ((uint64_t{1} << nbits) - 1)) << fill_;
    fill_ += nbits;
    while (fill_ >= 8) {
      out_->push_back(static_cast<uint8_t>(acc_));
      acc_ >>= 8;
      fill_ -= 8;
    }
  }
  void PutWide(uint64_t v, int nbits) {  // REQUIRES: nbits <= 64
    if (nbits > 32) {
      Put(v, 32);
      Put(v >> 32, nbits - 32);
    } else {
      Put(v, nbits);
    }
  }
  // Elias-gamma of v >= 1: its bit length in 7 bits, then the bits below the leading one.
  void PutGamma(uint64_t v) {
    const int len = BitLength(v);
    Put(static_cast<uint64_t>(len), 7);
    PutWide(v, len - 1);
  }
  void Finish() {
    if (fill_ > 0) out_->push_back(static_cast<uint8_t>(acc_));
  }

 private:
  std::vector<uint8_t>* out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
};

// Sign + magnitude symbol of a difference; the magnitude is >= 1.
inline uint32_t ValueSymbol(uint32_t sign, uint64_t mag) {
  return mag <= kMaxValueDirect ? static_cast<uint32_t>(2 * (mag - 1)) + sign : kValueEscape + sign;
}

// Splits the classes with changes into runs of consecutive classes that share one table, for
// the least estimated cost (tables and payload; dynamic programming over the run boundaries):
// a table costs 20-60 bytes, a lot for a class of a few hundred changes, and neighbouring
// classes often have near-identical distributions. Sets tables[c] for every class with changes
// and is_new[c] where a run starts.
void GroupTables(int k, const uint32_t* start, int nsym, const uint32_t (*counts)[kGapSymbols],
                 FreqTable* tables, bool* is_new) {
  int classes[kMaxClasses];
  int m = 0;
  for (int c = 0; c < k; ++c) {
    is_new[c] = false;
    if (start[c + 1] > start[c]) classes[m++] = c;
  }
  double best[kMaxClasses + 1];
  int from[kMaxClasses + 1] = {};
  best[0] = 0;
  for (int j = 1; j <= m; ++j) {
    best[j] = 1e300;
    uint32_t sum[kGapSymbols] = {};
    for (int i = j - 1; i >= 0; --i) {  // run classes[i .. j - 1]
      for (int x = 0; x < nsym; ++x) sum[x] += counts[classes[i]][x];
      double cost;
      ChooseTable(sum, nsym, &cost);
      if (best[i] + cost + 1 < best[j]) {
        best[j] = best[i] + cost + 1;
        from[j] = i;
      }
    }
  }
  for (int j = m; j > 0; j = from[j]) {
    const int i = from[j];
    uint32_t sum[kGapSymbols] = {};
    for (int r = i; r < j; ++r) {
      for (int x = 0; x < nsym; ++x) sum[x] += counts[classes[r]][x];
    }
    double cost;
    const FreqTable t = ChooseTable(sum, nsym, &cost);
    for (int r = i; r < j; ++r) tables[classes[r]] = t;
    is_new[classes[i]] = true;
  }
}

}  // namespace

// Writes the version 2 body (see sparse_coder.h). Changes come grouped by class: the o-th is
// positions[order[o]], class-local index local[order[o]], classes in [start[c], start[c + 1]).
template <typename T>
void EncodeStaticT(const uint8_t* parent, const uint8_t* data, bool is_float, int e_lo, int k,
                   const std::vector<uint32_t>& positions, const std::vector<uint32_t>& order,
                   const std::vector<uint32_t>& local, const uint32_t* start,
                   std::vector<uint8_t>* out) {
  const size_t count = positions.size();
  std::vector<uint8_t> gap_sym(count), value_sym(count);
  std::vector<uint64_t> mags(count);
  // Every change's difference, read in position order: the loops below go class by class, and
  // reading the two chunks at each class's positions missed the cache at nearly every change
  // (70% of this function's time at 1% changed).
  std::vector<T> deltas(count);
  for (size_t i = 0; i < count; ++i) {
    const size_t at = size_t{positions[i]} * sizeof(T);
    deltas[i] = T(elem::ToOrd(Load<T>(data + at), is_float) - elem::ToOrd(Load<T>(parent + at), is_float));
  }
  auto gap_tables = std::make_unique<FreqTable[]>(kMaxClasses);
  auto value_tables = std::make_unique<FreqTable[]>(kMaxClasses);
  int shifts[kMaxClasses] = {};
  uint32_t gap_counts[kMaxClasses][kGapSymbols] = {};
  uint32_t value_counts[kMaxClasses][kGapSymbols] = {};
  for (int c = 0; c < k; ++c) {
    const uint32_t n_c = start[c + 1] - start[c];
    if (n_c == 0) continue;
    // Shifts around log2(mean gap) - 2, the cheapest kept.
    const uint64_t span = uint64_t{local[order[start[c + 1] - 1]]} + 1;
    const int center = std::max(0, BitLength(span / n_c) - 3);
    double best_cost = 1e300;
    for (int s = std::max(0, center - 2); s <= std::min(center + 2, kMaxGapShift); ++s) {
      uint32_t counts[kGapSymbols] = {};
      int64_t prev = -1;
      double extra = static_cast<double>(n_c) * s;
      for (uint32_t o = start[c]; o < start[c + 1]; ++o) {
        const uint64_t q = static_cast<uint64_t>(int64_t{local[order[o]]} - prev - 1) >> s;
        prev = local[order[o]];
        ++counts[std::min<uint64_t>(q, kGapEscape)];
        if (q >= kGapEscape) extra += 7 + BitLength(q - kGapEscape + 1);
      }
      double cost;
      ChooseTable(counts, kGapSymbols, &cost);
      if (cost + extra < best_cost) {
        best_cost = cost + extra;
        shifts[c] = s;
        std::copy(counts, counts + kGapSymbols, gap_counts[c]);
      }
    }
    uint32_t* counts = value_counts[c];
    for (uint32_t o = start[c]; o < start[c + 1]; ++o) {
      const T d = deltas[order[o]];
      const auto sign = static_cast<uint32_t>(d >> (sizeof(T) * 8 - 1));
      mags[o] = sign ? uint64_t(T(T(0) - d)) : uint64_t(d);
      // A change whose value equals the parent's: the input changed since FindChanges (a file
      // written while it is encoded; ChunkCodec's callers must give stable input, and
      // VersionEncoder copies each chunk first). Any valid symbol keeps the tables in range:
      // the payload then decodes to bytes whose hash is not the header's, and is refused.
      if (mags[o] == 0) mags[o] = 1;
      value_sym[o] = static_cast<uint8_t>(ValueSymbol(sign, mags[o]));
      ++counts[value_sym[o]];
    }
  }
  bool new_gap_table[kMaxClasses], new_value_table[kMaxClasses];
  GroupTables(k, start, kGapSymbols, gap_counts, gap_tables.get(), new_gap_table);
  GroupTables(k, start, kValueSymbols, value_counts, value_tables.get(), new_value_table);

  // Header; the class table; the bit stream.
  const size_t at = out->size();
  out->resize(at + kV2HeaderBytes);
  const uint64_t tagged = uint64_t{count} | (kBodyVersion2 << 56);
  std::memcpy(out->data() + at, &tagged, 8);
  const auto e_lo16 = static_cast<uint16_t>(e_lo);
  std::memcpy(out->data() + at + 8, &e_lo16, 2);
  (*out)[at + 10] = static_cast<uint8_t>(k);
  const size_t table_at = out->size();
  {
    auto model = std::make_unique<TableModel>();
    rc::RangeEncoder enc(out);
    bool first = true;  // the first class with changes always has its own tables
    for (int c = 0; c < k; ++c) {
      const uint32_t n_c = start[c + 1] - start[c];
      EncodeGamma<3>(enc, model->count_len, model->count_mant, uint64_t{n_c} + 1);
      if (n_c == 0) continue;
      enc.EncodeTree(model->shift, 6, static_cast<uint32_t>(shifts[c]));
      if (!first) enc.EncodeBit(model->new_table[0], new_gap_table[c]);
      if (new_gap_table[c]) EncodeTable(enc, *model, 0, gap_tables[c]);
      if (!first) enc.EncodeBit(model->new_table[1], new_value_table[c]);
      if (new_value_table[c]) EncodeTable(enc, *model, 1, value_tables[c]);
      first = false;
    }
    for (int c = 0; c < k; ++c) {
      ScaleTable(&gap_tables[c]);
      ScaleTable(&value_tables[c]);
    }
    enc.Finish();
  }
  const auto table_bytes = static_cast<uint32_t>(out->size() - table_at);
  const size_t bits_at = out->size();
  {
    BitWriter bits(out);
    for (int c = 0; c < k; ++c) {
      int64_t prev = -1;
      const int s = shifts[c];
      for (uint32_t o = start[c]; o < start[c + 1]; ++o) {
        const auto v = static_cast<uint64_t>(int64_t{local[order[o]]} - prev - 1);
        prev = local[order[o]];
        const uint64_t q = v >> s;
        gap_sym[o] = static_cast<uint8_t>(std::min<uint64_t>(q, kGapEscape));
        if (q >= kGapEscape) bits.PutGamma(q - kGapEscape + 1);
        bits.Put(v, s);
        if (value_sym[o] >= kValueEscape) bits.PutGamma(mags[o] - kMaxValueDirect);
      }
    }
    bits.Finish();
  }
  const auto bit_bytes = static_cast<uint32_t>(out->size() - bits_at);
  std::memcpy(out->data() + at + 11, &table_bytes, 4);
  std::memcpy(out->data() + at + 15, &bit_bytes, 4);

  // rANS, in reverse decoding order into one word stream shared by the four states: the o-th
  // change's gap is on state 2 (o & 1), its value on state 2 (o & 1) + 1.
  std::vector<uint16_t> words;
  uint32_t x[kRansStates] = {kRansL, kRansL, kRansL, kRansL};
  auto put = [&](uint32_t& state, const FreqTable& t, uint32_t sym) {
    const uint32_t freq = t.freq[sym];
    if (state >= (uint64_t{freq} << (32 - t.bits))) {
      words.push_back(static_cast<uint16_t>(state));
      state >>= 16;
    }
    state = ((state / freq) << t.bits) + (state % freq) + t.start[sym];
  };
  int cls = k - 1;
  for (size_t o = count; o-- > 0;) {
    while (o < start[cls]) --cls;
    put(x[2 * (o & 1) + 1], value_tables[cls], value_sym[o]);
    put(x[2 * (o & 1)], gap_tables[cls], gap_sym[o]);
  }
  for (uint32_t state : x) {
    const size_t p = out->size();
    out->resize(p + 4);
    std::memcpy(out->data() + p, &state, 4);
  }
  for (size_t i = words.size(); i-- > 0;) {
    out->push_back(static_cast<uint8_t>(words[i]));
    out->push_back(static_cast<uint8_t>(words[i] >> 8));
  }
}

namespace {

// Where the version 2 decoder is in its two streams, and its four rANS states.
struct StaticCursor {
  const uint8_t* words;  // padded (see DecodeStaticT)
  const uint8_t* bits;   // padded
  size_t wi;             // bytes of words consumed
  uint64_t bit_pos;      // bits of bits consumed
  uint32_t a[kRansStates];
};

// An Elias-gamma code from the bit stream (an escape): 0 when corrupt. Checks the position
// first, so that its reads stay inside the padding.
struct GammaRead {
  uint64_t value;
  uint64_t bit_pos;
};
[[gnu::noinline]] GammaRead ReadGamma(const uint8_t* bits, uint64_t bit_pos, uint64_t bit_end) {
  auto read = [&](int nbits) {  // REQUIRES: nbits <= 32
    uint64_t w;
    std::memcpy(&w, bits + (bit_pos >> 3), 8);
    bit_pos += static_cast<uint64_t>(nbits);
    return (w >> ((bit_pos - static_cast<uint64_t>(nbits)) & 7)) & ((uint64_t{1} << nbits) - 1);
  };
  if (bit_pos > bit_end) return {0, bit_pos};
  const int len = static_cast<int>(read(7));
  if (len < 1 || len > 64) return {0, bit_pos};
  const int m = len - 1;
  uint64_t v = read(std::min(m, 32));
  if (m > 32) v |= read(m - 32) << 32;
  return {v | (uint64_t{1} << m), bit_pos};
}

// Decodes the changes [first, end) of one class (see EncodeStaticT) into class-local indices
// and differences. Returns nullptr, or what is wrong. Reads stay within the padding: the
// positions are checked once per change, and a change reads at most 4 bytes of words and
// (escapes aside, which check for themselves) 32 bits.
template <typename T>
[[gnu::always_inline]] inline const char* DecodeClassStatic(
    const uint32_t* gap_table, const uint32_t* value_table, int s,
    size_t n, size_t word_bytes, uint64_t bit_end, uint32_t first, uint32_t end,
    uint32_t* __restrict local, T* __restrict diffs, StaticCursor* cursor) {
  const uint8_t* const words = cursor->words;
  const uint8_t* const bits = cursor->bits;
  size_t wi = cursor->wi;
  uint64_t bit_pos = cursor->bit_pos;
  uint32_t a0 = cursor->a[0], a1 = cursor->a[1], a2 = cursor->a[2], a3 = cursor->a[3];
  const uint64_t low_mask = (uint64_t{1} << s) - 1;
  const uint64_t max_q = n >> s;  // q << s must stay below n
  constexpr int kWidthBits = static_cast<int>(sizeof(T) * 8);
  auto step = [&](uint32_t& a, const uint32_t* table) __attribute__((always_inline)) {
    const uint32_t e = table[a & ((1u << kMaxTableBits) - 1)];
    a = ((e >> 6) & 0xFFF) * (a >> kMaxTableBits) + (e >> 18);
    // Refill without a branch (it would mispredict): shift by 0 or 16, or in 0 or the word.
    uint16_t w;
    std::memcpy(&w, words + wi, 2);
    const uint32_t refill = a < kRansL;
    a = (a << (refill << 4)) | (w & (0u - refill));
    wi += refill << 1;
    return e & 63;
  };
  // The difference of each direct value symbol: 2 (|d| - 1) + sign.
  constexpr auto kDirect = [] {
    std::array<T, kValueSymbols> v{};
    for (uint32_t sym = 0; sym < kValueEscape; ++sym) {
      const T mag = static_cast<T>(sym / 2 + 1);
      v[sym] = (sym & 1) ? T(T(0) - mag) : mag;
    }
    return v;
  }();
  const char* error = nullptr;
  uint64_t next = 0;  // class-local index after the previous change
  for (uint32_t i = first; i < end; ++i) {
    uint64_t q = step(a0, gap_table);
    const uint32_t vs = step(a1, value_table);
    std::swap(a0, a2);
    std::swap(a1, a3);
    if (q == kGapEscape) [[unlikely]] {
      const GammaRead g = ReadGamma(bits, bit_pos, bit_end);
      bit_pos = g.bit_pos;
      if (g.value == 0 || g.value > max_q || q + g.value - 1 > max_q) {
        error = "gap out of range";
        break;
      }
      q += g.value - 1;
    }
    // Without an escape q < 63 and s <= 32: no overflow, and the position check below suffices.
    uint64_t w;
    std::memcpy(&w, bits + (bit_pos >> 3), 8);
    const uint64_t low = (w >> (bit_pos & 7)) & low_mask;  // s <= 32 of the 57 bits loaded
    bit_pos += static_cast<uint64_t>(s);
    const uint64_t pos = next + ((q << s) | low);
    next = pos + 1;
    T d = kDirect[vs];
    if (vs >= kValueEscape) [[unlikely]] {
      const GammaRead g = ReadGamma(bits, bit_pos, bit_end);
      bit_pos = g.bit_pos;
      if (g.value == 0 || (kWidthBits < 64 && (g.value >> (kWidthBits - 1)) != 0) ||
          g.value > ~uint64_t{0} - kMaxValueDirect) {
        error = "value out of range";
        break;
      }
      const uint64_t mag = g.value + kMaxValueDirect;
      d = (vs & 1) ? T(T(0) - T(mag)) : T(mag);
    }
    local[i] = static_cast<uint32_t>(pos);
    diffs[i] = d;
    // One branch for the three checks (each change: the streams' positions bound the next
    // change's reads to the padding).
    if ((pos >= n) | (wi > word_bytes) | (bit_pos > bit_end)) [[unlikely]] {
      error = pos >= n ? "a change lies outside the chunk" : "stream shorter than its changes";
      break;
    }
  }
  cursor->wi = wi;
  cursor->bit_pos = bit_pos;
  cursor->a[0] = a0;
  cursor->a[1] = a1;
  cursor->a[2] = a2;
  cursor->a[3] = a3;
  return error;
}

}  // namespace

// Decodes the version 2 stream (body from its start) into class-local indices and
// differences, class by class (class_start as ApplyByClassT takes them), into local and
// diff_bytes (elements of T).
template <typename T>
Status DecodeStaticT(std::span<const uint8_t> body, uint64_t count, int k, size_t n,
                     Scratch* scratch, uint32_t* class_start, std::vector<uint32_t>& local,
                     std::vector<uint8_t>& diff_bytes) {
  auto bad = [](const char* what) { return Status::Corruption(std::string("sparse body: ") + what); };
  if (body.size() < kV2HeaderBytes) return bad("shorter than its header");
  uint32_t table_bytes, bit_bytes;
  std::memcpy(&table_bytes, body.data() + 11, 4);
  std::memcpy(&bit_bytes, body.data() + 15, 4);
  size_t rest = body.size() - kV2HeaderBytes;
  if (table_bytes > rest || bit_bytes > rest - table_bytes ||
      rest - table_bytes - bit_bytes < 4 * kRansStates ||
      (rest - table_bytes - bit_bytes) % 2 != 0) {
    return bad("section lengths do not fit the body");
  }
  const size_t word_bytes = rest - table_bytes - bit_bytes - 4 * kRansStates;
  const uint8_t* bits_in = body.data() + kV2HeaderBytes + table_bytes;
  const uint8_t* rans_in = bits_in + bit_bytes;

  // The class table.
  int shifts[kMaxClasses] = {};
  auto gap_tables = std::make_unique<FreqTable[]>(kMaxClasses);
  auto value_tables = std::make_unique<FreqTable[]>(kMaxClasses);
  int table_slot[2][kMaxClasses] = {};                // per kind and class: its decoding table
  const FreqTable* slot_source[2 * kMaxClasses] = {};  // the distinct tables, in order
  int num_slot_tables = 0;
  {
    auto model = std::make_unique<TableModel>();
    rc::RangeDecoder dec(body.subspan(kV2HeaderBytes, table_bytes));
    uint64_t total = 0;
    int gap_at = -1, value_at = -1;  // the last class with changes
    class_start[0] = 0;
    for (int c = 0; c < k; ++c) {
      const uint64_t n_c1 = DecodeGamma<3>(dec, model->count_len, model->count_mant, 33);
      if (n_c1 == 0 || n_c1 - 1 > count - total) return bad("class counts do not add up");
      total += n_c1 - 1;
      class_start[c + 1] = static_cast<uint32_t>(total);
      if (n_c1 == 1) continue;
      shifts[c] = static_cast<int>(dec.DecodeTree(model->shift, 6));
      if (shifts[c] > kMaxGapShift) return bad("gap shift out of range");
      for (int kind = 0; kind < 2; ++kind) {
        FreqTable* tables = kind == 0 ? gap_tables.get() : value_tables.get();
        int& at = kind == 0 ? gap_at : value_at;
        if (at < 0 || dec.DecodeBit(model->new_table[kind])) {
          if (!DecodeTable(dec, *model, kind, kind == 0 ? kGapSymbols : kValueSymbols, &tables[c])) {
            return bad("invalid frequency table");
          }
          table_slot[kind][c] = num_slot_tables;
          slot_source[num_slot_tables++] = &tables[c];
        } else {
          table_slot[kind][c] = table_slot[kind][at];
        }
        at = c;
      }
    }
    if (total != count) return bad("class counts do not add up");
    if (dec.overrun() || dec.remaining() != 0) return bad("class table length does not match its content");
  }

  // Decoding tables, one per distinct table: per slot, symbol | freq << 6 | (slot - start) << 18.
  constexpr size_t kSlots = size_t{1} << kMaxTableBits;
  std::vector<uint32_t>& slots = scratch->rans_slots;
  slots.resize(num_slot_tables * kSlots);
  for (int i = 0; i < num_slot_tables; ++i) {
    const FreqTable& t = *slot_source[i];
    uint32_t* e = slots.data() + i * kSlots;
    for (int s = 0; s < t.nsym; ++s) {
      for (uint32_t j = 0; j < t.freq[s]; ++j) {
        e[t.start[s] + j] = static_cast<uint32_t>(s) | (t.freq[s] << 6) | (j << 18);
      }
    }
  }
  // Both streams copied with zero padding: reads stay in bounds without a branch per read (the
  // loop checks the positions once per change; an escape checks before each of its reads).
  constexpr size_t kPad = 32;
  std::vector<uint8_t>& bits = scratch->bits;
  bits.assign(bit_bytes + kPad, 0);
  std::memcpy(bits.data(), bits_in, bit_bytes);
  std::vector<uint8_t>& words = scratch->words;
  words.assign(word_bytes + kPad, 0);
  std::memcpy(words.data(), rans_in + 4 * kRansStates, word_bytes);
  uint32_t a0, a1, a2, a3;
  std::memcpy(&a0, rans_in, 4);
  std::memcpy(&a1, rans_in + 4, 4);
  std::memcpy(&a2, rans_in + 8, 4);
  std::memcpy(&a3, rans_in + 12, 4);
  if (a0 < kRansL || a1 < kRansL || a2 < kRansL || a3 < kRansL) return bad("invalid rANS state");

  local.resize(count);
  T* diffs = DiffBuffer<T>(diff_bytes, count);
  StaticCursor cur{words.data(), bits.data(), 0, 0, {a0, a1, a2, a3}};
  const uint64_t bit_end = uint64_t{bit_bytes} * 8;
  for (int c = 0; c < k; ++c) {
    if (class_start[c] == class_start[c + 1]) continue;
    const uint32_t* gap_table = slots.data() + table_slot[0][c] * kSlots;
    const uint32_t* value_table = slots.data() + table_slot[1][c] * kSlots;
    const char* error = DecodeClassStatic<T>(gap_table, value_table, shifts[c], n, word_bytes,
                                             bit_end, class_start[c], class_start[c + 1],
                                             local.data(), diffs, &cur);
    if (error != nullptr) return bad(error);
  }
  for (uint32_t state : cur.a) {
    if (state != kRansL) return bad("stream length does not match its content");
  }
  if (cur.wi != word_bytes || (cur.bit_pos + 7) / 8 != bit_bytes) {
    return bad("stream length does not match its content");
  }
  return Status::Ok();
}

#define WFS_INSTANTIATE(T)                                                                      \
  template void EncodeStaticT<T>(const uint8_t*, const uint8_t*, bool, int, int,                \
                                 const std::vector<uint32_t>&, const std::vector<uint32_t>&,    \
                                 const std::vector<uint32_t>&, const uint32_t*,                 \
                                 std::vector<uint8_t>*);                                        \
  template Status DecodeStaticT<T>(std::span<const uint8_t>, uint64_t, int, size_t, Scratch*,   \
                                   uint32_t*, std::vector<uint32_t>&, std::vector<uint8_t>&);
WFS_SPARSE_FOR_EACH_WIDTH(WFS_INSTANTIATE)
#undef WFS_INSTANTIATE

}  // namespace weightfs::sparse::detail
