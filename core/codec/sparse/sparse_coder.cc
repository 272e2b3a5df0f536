// The sparse codec's public API (sparse_coder.h) and its top level: the encoder's choice of
// exponent classes, class-local indices and body version, and the decoder's dispatch on the
// body version. The bodies, the class sweep and chains are in the files internal.h lists.
#include "core/codec/sparse/sparse_coder.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/codec/sparse/blocks.h"
#include "core/codec/sparse/internal.h"

namespace weightfs::sparse {
namespace detail {
namespace {

using elem::Load;

// Below this many changes the encoder also writes version 1 and keeps it when it is clearly
// smaller (by kAdaptiveMargin): version 2 decodes several times faster, so a tie goes to it.
// Above, the tables are a negligible part of the body and version 1 is not tried.
constexpr size_t kAlwaysStaticChanges = 16384;
constexpr double kAdaptiveMargin = 0.97;

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
  // Counted in four integer histograms, one per sample in turn: one histogram of doubles made
  // a chain of dependent adds through memory (most samples share a few exponents), 5% of a
  // push's CPU. The counts times the stride are the sums the doubles held, exactly.
  std::vector<uint32_t> counts(4 * range, 0);
  size_t i = 0, lane = 0;
  for (; i < n; i += stride, lane = (lane + 1) & 3) {
    ++counts[lane * range + ((Load<T>(parent + i * sizeof(T)) >> f.shift) & f.mask)];
  }
  for (size_t e = 0; e < range; ++e) {
    const uint64_t c = uint64_t{counts[e]} + counts[range + e] + counts[2 * range + e] + counts[3 * range + e];
    all[e] = static_cast<double>(c) * static_cast<double>(stride);
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

// The class-local index of every change (`local`), for two-byte elements: each block of 64
// elements' classes computed in registers from the parent (BlockAvx2, as the decoder's sweep
// does), where the portable path writes every element's class to memory and reads it back.
// The classes are ComputeClasses'. 45% of EncodeT's time was that path on a save's deltas.
#if defined(__x86_64__)
[[gnu::target("avx2")]] void LocalIndicesAvx2(const uint8_t* parent, size_t n, const ClassParams& cp, int k,
                                              const std::vector<uint32_t>& positions, uint32_t* local) {
  uint32_t seen[kMaxClasses] = {};
  size_t next = 0;
  const size_t full = n / 64;  // whole blocks; the rest below
  auto place = [&](size_t block, const uint64_t* masks) {
    const size_t end = block * 64 + 64;
    for (; next < positions.size() && positions[next] < end; ++next) {
      const uint32_t j = positions[next] - static_cast<uint32_t>(block * 64);
      int c = 0;
      while (c < k - 1 && !((masks[c] >> j) & 1)) ++c;
      local[next] = seen[c] + static_cast<uint32_t>(std::popcount(masks[c] & ((uint64_t{1} << j) - 1)));
    }
    for (int c = 0; c < k; ++c) seen[c] += static_cast<uint32_t>(std::popcount(masks[c]));
  };
  uint64_t masks[kMaxClasses];
  for (size_t block = 0; block < full && next < positions.size(); ++block) {
    const BlockAvx2 b(parent + block * 128, cp);
    for (int c = 0; c < k; ++c) masks[c] = b.Mask(static_cast<uint8_t>(c));
    place(block, masks);
  }
  if (next < positions.size()) {  // the last, partial block
    alignas(64) uint8_t classes[64];
    std::fill(classes, classes + 64, kNoClass);
    for (size_t i = full * 64; i < n; ++i) {
      const int e = static_cast<int>((elem::Load<uint16_t>(parent + i * 2) >> cp.shift) & cp.mask);
      classes[i - full * 64] = static_cast<uint8_t>(std::clamp(e - cp.e_lo, 0, cp.top));
    }
    for (int c = 0; c < k; ++c) masks[c] = ClassMask(classes, static_cast<uint8_t>(c));
    place(full, masks);
  }
}
#endif

template <typename T>
void EncodeT(DType dtype, const uint8_t* parent, const uint8_t* data, size_t n,
             const std::vector<uint32_t>& positions, double max_class_fraction, int version,
             int force_classes, Scratch* scratch, std::vector<uint8_t>* out) {
  const bool is_float = DTypeIsFloat(dtype) && DTypeSize(dtype) == sizeof(T);
  const ExponentField f = is_float ? ExponentOf(dtype) : ExponentField{};
  int e_lo = 0, k = 1;
  if (force_classes >= 2 && f.mask != 0 && !positions.empty()) {
    e_lo = static_cast<int>(f.mask);  // the lowest changed exponent
    for (uint32_t p : positions) {
      e_lo = std::min(e_lo, static_cast<int>((Load<T>(parent + size_t{p} * sizeof(T)) >> f.shift) & f.mask));
    }
    k = std::min(force_classes, kMaxClasses);
  } else if (static_cast<double>(positions.size()) <= max_class_fraction * static_cast<double>(n)) {
    ChooseClasses<T>(f, parent, n, positions, &e_lo, &k);
  }
  std::vector<uint32_t>& local = scratch->local;
  std::vector<uint32_t>& order = scratch->order;
  local.resize(positions.size());
  order.resize(positions.size());
  uint32_t start[kMaxClasses + 1] = {};
  if (k == 1) {
    std::copy(positions.begin(), positions.end(), local.begin());
    for (uint32_t i = 0; i < positions.size(); ++i) order[i] = i;
    start[1] = static_cast<uint32_t>(positions.size());
  } else {
    // The class of the parent's element at `pos` (ComputeClasses' rule).
    auto class_of = [&](uint32_t pos) {
      const int e = static_cast<int>((Load<T>(parent + size_t{pos} * sizeof(T)) >> f.shift) & f.mask);
      return static_cast<uint8_t>(std::clamp(e - e_lo, 0, k - 1));
    };
    bool placed = false;
#if defined(__x86_64__)
    if constexpr (sizeof(T) == 2) {
      if (g_simd.load(std::memory_order_relaxed) != Simd::kSse2) {
        LocalIndicesAvx2(parent, n, ClassParams{f.shift, f.mask, e_lo, k - 1}, k, positions, local.data());
        placed = true;
      }
    }
#endif
    if (!placed) {
      // Class of every element, then the class-local index of every change.
      std::vector<uint8_t>& classes = scratch->classes;
      classes.resize((n + 63) / 64 * 64);
      std::fill(classes.begin() + static_cast<ptrdiff_t>(n), classes.end(), kNoClass);
      ComputeClasses<T>(parent, n, f, e_lo, k, classes.data());
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
    }
    // Changes grouped by class, positions ascending inside each (stable).
    for (uint32_t pos : positions) ++start[class_of(pos) + 1];
    for (int c = 0; c < k; ++c) start[c + 1] += start[c];
    uint32_t fill[kMaxClasses];
    std::copy(start, start + k, fill);
    for (uint32_t i = 0; i < positions.size(); ++i) order[fill[class_of(positions[i])]++] = i;
  }
  if (version == 1) {
    EncodeAdaptiveT<T>(parent, data, is_float, e_lo, k, positions, order, local, start, out);
    return;
  }
  const size_t at = out->size();
  EncodeStaticT<T>(parent, data, is_float, e_lo, k, positions, order, local, start, out);
  if (version == 0 && positions.size() < kAlwaysStaticChanges) {
    std::vector<uint8_t>& adaptive = scratch->candidate;
    adaptive.clear();
    EncodeAdaptiveT<T>(parent, data, is_float, e_lo, k, positions, order, local, start, &adaptive);
    if (static_cast<double>(adaptive.size()) < kAdaptiveMargin * static_cast<double>(out->size() - at)) {
      out->resize(at);
      out->insert(out->end(), adaptive.begin(), adaptive.end());
    }
  }
}

// Calls on_change(i) for each element i where a and b differ, in order, skipping equal 32-byte
// blocks (most of a sparse update); stops as soon as on_change returns false. Returns whether
// it went to the end.
template <typename T, typename OnChange>
bool ForEachChangeT(const uint8_t* a, const uint8_t* b, size_t n, OnChange&& on_change) {
  constexpr size_t kBlock = 32 / sizeof(T);  // elements per 32-byte block
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    const uint8_t* pa = a + i * sizeof(T);
    const uint8_t* pb = b + i * sizeof(T);
    uint64_t diff = 0;
    for (size_t w = 0; w < 4; ++w) diff |= Load<uint64_t>(pa + 8 * w) ^ Load<uint64_t>(pb + 8 * w);
    if (diff == 0) continue;
    for (size_t j = 0; j < kBlock; ++j) {
      if (Load<T>(pa + j * sizeof(T)) != Load<T>(pb + j * sizeof(T)) && !on_change(i + j)) return false;
    }
  }
  for (; i < n; ++i) {
    if (Load<T>(a + i * sizeof(T)) != Load<T>(b + i * sizeof(T)) && !on_change(i)) return false;
  }
  return true;
}

#if defined(__x86_64__)
// ForEachChangeT for two-byte elements with AVX2: 32 elements compared per step, the changed
// ones read off the compare's mask (FindChanges was 8% of a save's daemon CPU).
template <typename OnChange>
[[gnu::target("avx2")]] bool ForEachChange16Avx2(const uint8_t* a, const uint8_t* b, size_t n, OnChange&& on_change) {
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const auto* pa = reinterpret_cast<const __m256i*>(a + 2 * i);
    const auto* pb = reinterpret_cast<const __m256i*>(b + 2 * i);
    const __m256i eq0 = _mm256_cmpeq_epi16(_mm256_loadu_si256(pa), _mm256_loadu_si256(pb));
    const __m256i eq1 = _mm256_cmpeq_epi16(_mm256_loadu_si256(pa + 1), _mm256_loadu_si256(pb + 1));
    // Two mask bits per element; the even ones say whether it differs.
    uint64_t differ = ~(uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(eq0))} |
                        uint64_t{static_cast<uint32_t>(_mm256_movemask_epi8(eq1))} << 32) &
                      0x5555555555555555ull;
    while (differ != 0) {
      if (!on_change(i + static_cast<size_t>(std::countr_zero(differ)) / 2)) return false;
      differ &= differ - 1;
    }
  }
  for (; i < n; ++i) {
    if (Load<uint16_t>(a + i * 2) != Load<uint16_t>(b + i * 2) && !on_change(i)) return false;
  }
  return true;
}
#endif

// ForEachChangeT, with the instruction set in use (g_simd).
template <typename T, typename OnChange>
bool ForEachChange(const uint8_t* a, const uint8_t* b, size_t n, OnChange&& on_change) {
#if defined(__x86_64__)
  if constexpr (sizeof(T) == 2) {
    if (g_simd.load(std::memory_order_relaxed) != Simd::kSse2) return ForEachChange16Avx2(a, b, n, on_change);
  }
#endif
  return ForEachChangeT<T>(a, b, n, on_change);
}

template <typename T>
bool FindChangesT(const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                  std::vector<uint32_t>* positions) {
  positions->clear();
  return ForEachChange<T>(a, b, n, [&](size_t i) {
    positions->push_back(static_cast<uint32_t>(i));
    return positions->size() <= cap;
  });
}

template <typename T>
uint64_t CountChangesT(const uint8_t* a, const uint8_t* b, size_t n) {
  uint64_t changed = 0;
  ForEachChange<T>(a, b, n, [&](size_t) {
    ++changed;
    return true;
  });
  return changed;
}

}  // namespace

// Reads the header, then the body version's stream, and applies the changes (see internal.h).
template <typename T, typename Writer>
Status DecodeT(DType dtype, std::span<const uint8_t> body, const uint8_t* parent, uint8_t* out,
               size_t n, Scratch* scratch, std::vector<uint32_t>* recorded) {
  BodyHeader h;
  WFS_TRY(ParseHeader<T>(dtype, body, n, &h));
  const uint64_t count = h.count;
  const uint64_t version = h.version;
  const int e_lo = h.e_lo;
  const int k = h.k;
  const bool is_float = h.is_float;
  const ExponentField f = h.f;
  Writer writer;
  writer.parent = parent;
  writer.out = out;
  writer.n = n;
  writer.done = 0;
  writer.is_float = is_float;
  if constexpr (!std::is_same_v<Writer, OutputWriter<T>>) {
    recorded->resize(count);
    writer.record = recorded->data();
  }
  if (version == kBodyVersion2) {
    uint32_t class_start[kMaxClasses + 1] = {};
    WFS_TRY(DecodeStaticT<T>(body, count, k, n, scratch, class_start, scratch->local,
                             scratch->diffs));
    if (k == 1) {
      const T* diffs = reinterpret_cast<const T*>(scratch->diffs.data());
      for (uint64_t i = 0; i < count; ++i) writer.Change(scratch->local[i], diffs[i]);
    } else {
      if (!ApplyByClass(parent, f, e_lo, n, k, class_start, scratch->local.data(),
                        reinterpret_cast<const T*>(scratch->diffs.data()), scratch, writer)) {
        return Status::Corruption("sparse body: a change lies outside the chunk");
      }
    }
    writer.Finish();
    return Status::Ok();
  }
  return DecodeAdaptiveT<T>(body, h, parent, n, scratch, writer);
}

#define WFS_INSTANTIATE(T)                                                                     \
  template Status DecodeT<T, OutputWriter<T>>(DType, std::span<const uint8_t>, const uint8_t*, \
                                              uint8_t*, size_t, Scratch*,                      \
                                              std::vector<uint32_t>*);
WFS_SPARSE_FOR_EACH_WIDTH(WFS_INSTANTIATE)
#undef WFS_INSTANTIATE

}  // namespace detail

bool FindChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n, size_t cap,
                 std::vector<uint32_t>* positions) {
  return elem::DispatchWidth(width, [&]<typename T>() {
    return detail::FindChangesT<T>(a, b, n, cap, positions);
  });
}

uint64_t CountChanges(size_t width, const uint8_t* a, const uint8_t* b, size_t n) {
  return elem::DispatchWidth(width, [&]<typename T>() { return detail::CountChangesT<T>(a, b, n); });
}

void Encode(DType dtype, size_t width, const uint8_t* parent, const uint8_t* data, size_t n,
            const std::vector<uint32_t>& positions, double max_class_fraction, int version,
            Scratch* scratch, std::vector<uint8_t>* out, int force_classes) {
  elem::DispatchWidth(width, [&]<typename T>() {
    detail::EncodeT<T>(dtype, parent, data, n, positions, max_class_fraction, version,
                       force_classes, scratch, out);
  });
}

bool SetSimd(Simd simd) {
  if (simd == Simd::kBest) simd = detail::BestSimd();
  if (static_cast<int>(simd) > static_cast<int>(detail::BestSimd())) return false;
  detail::g_simd = simd;
  return true;
}

Status DecodeChain(DType dtype, size_t width, std::span<const std::span<const uint8_t>> bodies,
                   uint8_t* data, size_t n, Scratch* scratch, size_t* failed) {
  size_t at = 0;
  if (failed == nullptr) failed = &at;
  return elem::DispatchWidth(width, [&]<typename T>() {
    return detail::DecodeChainT<T>(dtype, bodies, data, n, scratch, failed);
  });
}

Status Decode(DType dtype, size_t width, std::span<const uint8_t> body, const uint8_t* parent,
              uint8_t* out, size_t n, Scratch* scratch) {
  return elem::DispatchWidth(width, [&]<typename T>() {
    return detail::DecodeT<T>(dtype, body, parent, out, n, scratch);
  });
}

Status DecodeRecording(DType dtype, size_t width, std::span<const uint8_t> body, uint8_t* data,
                       size_t n, Scratch* scratch, std::vector<uint32_t>* positions) {
  WFS_TRY(elem::DispatchWidth(width, [&]<typename T>() {
    return detail::DecodeT<T, detail::RecordingWriter<T>>(dtype, body, data, data, n, scratch, positions);
  }));
  std::sort(positions->begin(), positions->end());
  return Status::Ok();
}

}  // namespace weightfs::sparse
