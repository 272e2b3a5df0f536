// Body version 1 of the sparse codec: the adaptive binary range-coded stream (format in
// sparse_coder.h). Still decoded, and written when clearly smaller than version 2 (small
// chunks, few changes; see EncodeT in sparse_coder.cc).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "core/codec/sparse/internal.h"

namespace weightfs::sparse::detail {
namespace {

using elem::BitLength;
using elem::Load;

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
    FillProbs(count_len);
    FillProbs(count_mant);
    FillProbs(gap_q);
    FillProbs(gap_top);
    FillProbs(esc_len);
    FillProbs(esc_mant);
    FillProbs(sign);
    FillProbs(mag_unary);
    FillProbs(mag_tree);
    FillProbs(mag_mant);
  }
};

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
  // (0 only if the input changed since the changes were found: see ChunkCodec::EncodeDelta.
  // Any magnitude keeps the coder defined; the payload then fails its hash check.)
  const uint64_t mag = std::max<uint64_t>(1, sign ? uint64_t(T(T(0) - d)) : uint64_t(d));
  enc.EncodeBit(m.sign[s.prev_sign], sign);
  EncodeMagnitude(enc, m, s, mag);
  s.prev_sign = sign;
}

// Decodes one change's difference (sign and magnitude). False when out of range (corrupt).
// The sign's context is the previous sign only: the parent's own sign was measured to add
// nothing, and leaving it out lets values be decoded without touching the parent (see
// DecodeAdaptiveT).
template <typename T>
[[gnu::always_inline]] inline bool DecodeValue(rc::RangeDecoder& dec, Model& m, ClassState& s, T* d) {
  const uint32_t sign = dec.DecodeBit(m.sign[s.prev_sign]);
  const uint64_t mag = DecodeMagnitude(dec, m, s, static_cast<int>(sizeof(T) * 8));
  if (mag == 0) return false;
  s.prev_sign = sign;
  *d = sign ? T(T(0) - T(mag)) : T(mag);
  return true;
}

}  // namespace

// Writes the version 1 body: the adaptive range-coded stream (see sparse_coder.h).
template <typename T>
void EncodeAdaptiveT(const uint8_t* parent, const uint8_t* data, bool is_float, int e_lo, int k,
                     const std::vector<uint32_t>& positions, const std::vector<uint32_t>& order,
                     const std::vector<uint32_t>& local, const uint32_t* start,
                     std::vector<uint8_t>* out) {
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

// Reads the version 1 stream after the header and applies its changes through `writer`.
template <typename T, typename Writer>
Status DecodeAdaptiveT(std::span<const uint8_t> body, const BodyHeader& h, const uint8_t* parent,
                       size_t n, Scratch* scratch, Writer writer) {
  const uint64_t count = h.count;
  const int e_lo = h.e_lo;
  const int k = h.k;
  const ExponentField f = h.f;
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
    T* diffs = DiffBuffer<T>(scratch->diffs, count);
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
    if (!ApplyByClass(parent, f, e_lo, n, k, class_start, local.data(), diffs, scratch,
                      writer)) {
      return bad("a change lies outside the chunk");
    }
  }
  writer.Finish();
  if (dec.overrun() || dec.remaining() != 0) {
    return bad("range-coded stream length does not match its content");
  }
  return Status::Ok();
}

#define WFS_INSTANTIATE(T)                                                                        \
  template void EncodeAdaptiveT<T>(const uint8_t*, const uint8_t*, bool, int, int,                \
                                   const std::vector<uint32_t>&, const std::vector<uint32_t>&,    \
                                   const std::vector<uint32_t>&, const uint32_t*,                 \
                                   std::vector<uint8_t>*);                                        \
  template Status DecodeAdaptiveT<T, OutputWriter<T>>(std::span<const uint8_t>, const BodyHeader&, \
                                                      const uint8_t*, size_t, Scratch*,           \
                                                      OutputWriter<T>);                           \
  template Status DecodeAdaptiveT<T, RecordingWriter<T>>(std::span<const uint8_t>,                \
                                                         const BodyHeader&, const uint8_t*,       \
                                                         size_t, Scratch*, RecordingWriter<T>);
WFS_SPARSE_FOR_EACH_WIDTH(WFS_INSTANTIATE)
#undef WFS_INSTANTIATE

}  // namespace weightfs::sparse::detail
