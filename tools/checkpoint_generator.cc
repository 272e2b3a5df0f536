#include "tools/checkpoint_generator.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <thread>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace weightfs {

static_assert(std::endian::native == std::endian::little,
              "the generator writes host floats as little-endian file bytes");

namespace {

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Simulation constants. docs/generator.md explains the choices.

// Elements per unit of work. Every random draw is keyed by element index, not by slice, so this
// affects speed and memory only, never the output.
constexpr uint64_t kSliceElements = uint64_t{1} << 20;

// AdamW as in torch.optim.AdamW.
constexpr float kBeta1 = 0.9f;
constexpr float kBeta2 = 0.999f;
constexpr float kEps = 1e-8f;
constexpr float kWeightDecay = 0.01f;  // not applied to 1-D tensors (norms), as usual
// The base is a checkpoint of a run in progress: the optimizer has taken this many steps
// already, so its moments are warm and the bias corrections are ~1.
constexpr uint64_t kResumeStep = 10000;
// Std of the EMA (weight 1 - beta1) of unit Gaussian noise: sqrt((1 - b1) / (1 + b1)).
constexpr float kWarmMomentNoise = 0.2294157f;

// Token frequencies are Zipfian over token ids (BPE ids are roughly in frequency order); a
// token's embedding row gets a gradient in a step only if the token occurs in that step's batch.
constexpr double kBatchTokens = 512.0 * 1024;
constexpr double kZipfExponent = 1.1;
constexpr double kZipfOffset = 10;

// Heavy tails: 1 element in 1024 is an outlier scaled by 3..8.
constexpr uint64_t kOutlierShift = 54;  // top 10 bits zero => probability 2^-10
// Input channels (columns) with "massive activations": 1 in 512, weights scaled by 3.
constexpr uint64_t kOutlierColumnMask = 511;

// ---------------------------------------------------------------------------------------------
// Counter-based random numbers: every value is a pure function of (key, index), so the output
// does not depend on how the work is split between threads.

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline uint64_t SplitMix64(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint64_t Mix(uint64_t a, uint64_t b) { return SplitMix64(a ^ SplitMix64(b + kGolden)); }

uint64_t HashString(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then mixed
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return SplitMix64(h);
}

inline uint64_t Rand(uint64_t key, uint64_t index) { return SplitMix64(key + index * kGolden); }

// Uniform in [0, 1) with 24 bits.
inline float Uniform(uint64_t r) { return static_cast<float>(r >> 40) * 0x1p-24f; }
inline double UniformD(uint64_t r) { return static_cast<double>(r >> 11) * 0x1p-53; }

// Gaussians by Box-Muller, two per 64-bit draw r:
//   u1 = bits 40..63 -> (0, 1], radius = sqrt(-2 ln u1)           (|z| <= 5.8)
//   phi = bits 16..39 -> [0, 1), angle = phi * pi/2 in the first quadrant
//   bits 0 and 1 flip the signs of the two outputs, which spreads the angle uniformly
//   over [0, 2 pi).
// ln, sin and cos are polynomials (|error| < 1e-6) of plain IEEE float operations, so the
// numbers are the same with or without SIMD and whatever the C library; the SSE2 path computes
// exactly what the scalar path computes.
constexpr float kLn2 = 0.693147180559945f;
constexpr float kSqrtHalf = 0.707106781186548f;
constexpr float kQuarterPi = 0.785398163397448f;
constexpr float kHalfPi = 1.570796326794897f;

// ln(x) for normal x > 0: x = 2^e m with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh((m-1)/(m+1)).
inline float FastLog(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  int32_t e = static_cast<int32_t>(bits >> 23) - 127;
  float m = std::bit_cast<float>((bits & 0x7FFFFFu) | 0x3F800000u);
  if (m > 1.41421356f) {
    m = m * 0.5f;
    e += 1;
  }
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  const float p = 1.0f + s2 * (1.0f / 3 + s2 * (1.0f / 5 + s2 * (1.0f / 7 + s2 * (1.0f / 9))));
  return static_cast<float>(e) * kLn2 + 2.0f * s * p;
}

// sin and cos of phi * pi/2 for phi in [0, 1), via x = angle - pi/4 in [-pi/4, pi/4).
inline void QuarterSinCos(float phi, float* sin_out, float* cos_out) {
  const float x = phi * kHalfPi - kQuarterPi;
  const float x2 = x * x;
  const float sx = x * (1.0f - x2 * (1.0f / 6 - x2 * (1.0f / 120 - x2 * (1.0f / 5040))));
  const float cx = 1.0f - x2 * (0.5f - x2 * (1.0f / 24 - x2 * (1.0f / 720 - x2 * (1.0f / 40320))));
  *sin_out = (sx + cx) * kSqrtHalf;
  *cos_out = (cx - sx) * kSqrtHalf;
}

inline void GaussianPair(uint64_t r, float* a, float* b) {
  const float u1 = static_cast<float>((r >> 40) + 1) * 0x1p-24f;
  const float phi = static_cast<float>((r >> 16) & 0xFFFFFF) * 0x1p-24f;
  const float radius = std::sqrt(-2.0f * FastLog(u1));
  float sn, cs;
  QuarterSinCos(phi, &sn, &cs);
  *a = std::bit_cast<float>(std::bit_cast<uint32_t>(radius * cs) ^ (static_cast<uint32_t>(r & 1) << 31));
  *b = std::bit_cast<float>(std::bit_cast<uint32_t>(radius * sn) ^ (static_cast<uint32_t>(r & 2) << 30));
}

#if defined(__SSE2__)
// Four GaussianPair at once; bit-identical to the scalar code.
inline void GaussianPair4(const uint64_t* r, float* out /* 8 floats: a0 b0 a1 b1 ... */) {
  auto lanes = [&](auto f) {
    return _mm_set_epi32(static_cast<int>(f(r[3])), static_cast<int>(f(r[2])),
                         static_cast<int>(f(r[1])), static_cast<int>(f(r[0])));
  };
  const __m128i hi = lanes([](uint64_t x) { return static_cast<uint32_t>(x >> 40) + 1; });
  const __m128i mid = lanes([](uint64_t x) { return static_cast<uint32_t>(x >> 16) & 0xFFFFFF; });
  const __m128i low = lanes([](uint64_t x) { return static_cast<uint32_t>(x); });
  const __m128 sa = _mm_castsi128_ps(_mm_slli_epi32(low, 31));
  const __m128 sb = _mm_castsi128_ps(_mm_slli_epi32(_mm_srli_epi32(low, 1), 31));
  const __m128 scale = _mm_set1_ps(0x1p-24f);
  const __m128 one = _mm_set1_ps(1.0f);
  // FastLog
  const __m128 x = _mm_mul_ps(_mm_cvtepi32_ps(hi), scale);
  const __m128i bits = _mm_castps_si128(x);
  __m128i e = _mm_sub_epi32(_mm_srli_epi32(bits, 23), _mm_set1_epi32(127));
  __m128 m = _mm_castsi128_ps(
      _mm_or_si128(_mm_and_si128(bits, _mm_set1_epi32(0x7FFFFF)), _mm_set1_epi32(0x3F800000)));
  const __m128 big = _mm_cmpgt_ps(m, _mm_set1_ps(1.41421356f));
  m = _mm_or_ps(_mm_and_ps(big, _mm_mul_ps(m, _mm_set1_ps(0.5f))), _mm_andnot_ps(big, m));
  e = _mm_sub_epi32(e, _mm_castps_si128(big));  // big lanes are -1
  const __m128 s = _mm_div_ps(_mm_sub_ps(m, one), _mm_add_ps(m, one));
  const __m128 s2 = _mm_mul_ps(s, s);
  __m128 p = _mm_add_ps(_mm_set1_ps(1.0f / 7), _mm_mul_ps(s2, _mm_set1_ps(1.0f / 9)));
  p = _mm_add_ps(_mm_set1_ps(1.0f / 5), _mm_mul_ps(s2, p));
  p = _mm_add_ps(_mm_set1_ps(1.0f / 3), _mm_mul_ps(s2, p));
  p = _mm_add_ps(one, _mm_mul_ps(s2, p));
  const __m128 ln = _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(e), _mm_set1_ps(kLn2)),
                               _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(2.0f), s), p));
  const __m128 radius = _mm_sqrt_ps(_mm_mul_ps(_mm_set1_ps(-2.0f), ln));
  // QuarterSinCos
  const __m128 ang = _mm_sub_ps(_mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(mid), scale), _mm_set1_ps(kHalfPi)),
                                _mm_set1_ps(kQuarterPi));
  const __m128 a2 = _mm_mul_ps(ang, ang);
  __m128 sp = _mm_sub_ps(_mm_set1_ps(1.0f / 120), _mm_mul_ps(a2, _mm_set1_ps(1.0f / 5040)));
  sp = _mm_sub_ps(_mm_set1_ps(1.0f / 6), _mm_mul_ps(a2, sp));
  const __m128 sx = _mm_mul_ps(ang, _mm_sub_ps(one, _mm_mul_ps(a2, sp)));
  __m128 cp = _mm_sub_ps(_mm_set1_ps(1.0f / 720), _mm_mul_ps(a2, _mm_set1_ps(1.0f / 40320)));
  cp = _mm_sub_ps(_mm_set1_ps(1.0f / 24), _mm_mul_ps(a2, cp));
  cp = _mm_sub_ps(_mm_set1_ps(0.5f), _mm_mul_ps(a2, cp));
  const __m128 cx = _mm_sub_ps(one, _mm_mul_ps(a2, cp));
  const __m128 sn = _mm_mul_ps(_mm_add_ps(sx, cx), _mm_set1_ps(kSqrtHalf));
  const __m128 cs = _mm_mul_ps(_mm_sub_ps(cx, sx), _mm_set1_ps(kSqrtHalf));
  const __m128 a = _mm_xor_ps(_mm_mul_ps(radius, cs), sa);
  const __m128 b = _mm_xor_ps(_mm_mul_ps(radius, sn), sb);
  _mm_storeu_ps(out, _mm_unpacklo_ps(a, b));
  _mm_storeu_ps(out + 4, _mm_unpackhi_ps(a, b));
}
#endif

// out[0 .. 2*pairs): the pairs of draws first_pair, first_pair + 1, ... of stream `key`.
void GaussianPairs(uint64_t key, uint64_t first_pair, uint64_t pairs, float* out) {
  uint64_t k = 0;
#if defined(__SSE2__)
  for (; k + 4 <= pairs; k += 4) {
    const uint64_t r[4] = {Rand(key, first_pair + k), Rand(key, first_pair + k + 1),
                           Rand(key, first_pair + k + 2), Rand(key, first_pair + k + 3)};
    GaussianPair4(r, out + 2 * k);
  }
#endif
  for (; k < pairs; ++k) GaussianPair(Rand(key, first_pair + k), &out[2 * k], &out[2 * k + 1]);
}

inline float Gaussian(uint64_t key, uint64_t index) {
  float a, b;
  GaussianPair(Rand(key, index), &a, &b);
  return a;
}

// out[i] = N(0, 1) number `first + i` of stream `key`; numbers 2k and 2k+1 share draw k.
void FillGaussian(uint64_t key, uint64_t first, uint64_t n, float* out) {
  float pair[2];
  if (n == 0) return;
  if (first & 1) {
    GaussianPair(Rand(key, first >> 1), &pair[0], &pair[1]);
    *out++ = pair[1];
    ++first;
    --n;
  }
  const uint64_t full = n / 2;
  GaussianPairs(key, first >> 1, full, out);
  if (n & 1) {
    GaussianPair(Rand(key, (first >> 1) + full), &pair[0], &pair[1]);
    out[n - 1] = pair[0];
  }
}

// One AdamW step (torch.optim.AdamW semantics) over a row whose gradient is
// gs * (c + noise). Bit-identical with and without SSE2.
struct AdamStep {
  float gs, decay, step_size, inv_sqrt_bc2;
};

void AdamRow(const AdamStep& a, uint64_t n, float* w, float* m, float* v, const float* c,
             const float* noise) {
  uint64_t j = 0;
#if defined(__SSE2__)
  const __m128 gs = _mm_set1_ps(a.gs), b1 = _mm_set1_ps(kBeta1), b2 = _mm_set1_ps(kBeta2);
  const __m128 ob1 = _mm_set1_ps(1.0f - kBeta1), ob2 = _mm_set1_ps(1.0f - kBeta2);
  const __m128 decay = _mm_set1_ps(a.decay), step = _mm_set1_ps(a.step_size);
  const __m128 ibc2 = _mm_set1_ps(a.inv_sqrt_bc2), eps = _mm_set1_ps(kEps);
  for (; j + 4 <= n; j += 4) {
    const __m128 g = _mm_mul_ps(gs, _mm_add_ps(_mm_loadu_ps(c + j), _mm_loadu_ps(noise + j)));
    const __m128 mj = _mm_add_ps(_mm_mul_ps(b1, _mm_loadu_ps(m + j)), _mm_mul_ps(ob1, g));
    const __m128 vj = _mm_add_ps(_mm_mul_ps(b2, _mm_loadu_ps(v + j)),
                                 _mm_mul_ps(_mm_mul_ps(ob2, g), g));
    const __m128 denom = _mm_add_ps(_mm_mul_ps(_mm_sqrt_ps(vj), ibc2), eps);
    const __m128 wj = _mm_sub_ps(_mm_mul_ps(_mm_loadu_ps(w + j), decay),
                                 _mm_div_ps(_mm_mul_ps(step, mj), denom));
    _mm_storeu_ps(m + j, mj);
    _mm_storeu_ps(v + j, vj);
    _mm_storeu_ps(w + j, wj);
  }
#endif
  for (; j < n; ++j) {
    const float g = a.gs * (c[j] + noise[j]);
    m[j] = kBeta1 * m[j] + (1.0f - kBeta1) * g;
    v[j] = kBeta2 * v[j] + (1.0f - kBeta2) * g * g;
    w[j] = w[j] * a.decay - (a.step_size * m[j]) / (std::sqrt(v[j]) * a.inv_sqrt_bc2 + kEps);
  }
}

// Distinct streams derived from one tensor key.
enum Stream : uint64_t {
  kStreamTensorParams = 1,
  kStreamValue,
  kStreamOutlier,
  kStreamRowScale,
  kStreamGradRowScale,
  kStreamPersistent,
  kStreamWarmMoment,
  kStreamNoise,
  kStreamColumnScale,
  kStreamBatch,
};

// ---------------------------------------------------------------------------------------------
// Model shape.

uint64_t RoundTo(double x, uint64_t multiple) {
  return static_cast<uint64_t>(std::llround(x / static_cast<double>(multiple))) * multiple;
}

// Realistic vocabulary sizes by model size, with a score penalty. From 150M on the sizes real
// tokenizers have (Llama-2 32000, Llama-3 128256, Qwen2 151936); below, any multiple of 128 near
// a power-of-two target, so that tiny parameter budgets can still be met closely.
std::vector<std::pair<uint64_t, double>> VocabCandidates(uint64_t params) {
  if (params >= 50'000'000'000ull) return {{151936, 0}};
  if (params >= 3'000'000'000ull) return {{128256, 0}};
  if (params >= 150'000'000ull) return {{32000, 0}};
  const uint64_t target = params < 3'000'000    ? 1024
                          : params < 15'000'000 ? 4096
                          : params < 60'000'000 ? 8192
                                                : 16384;
  std::vector<std::pair<uint64_t, double>> out;
  for (uint64_t v = std::max<uint64_t>(256, target / 4); v <= target * 2; v += 128) {
    const double penalty = 0.5 * std::fabs(std::log(static_cast<double>(v) /
                                                    static_cast<double>(target))) +
                           (std::has_single_bit(v) ? 0.0 : 0.1);
    out.emplace_back(v, penalty);
  }
  return out;
}

ModelShape ShapeFor(uint64_t vocab, uint64_t d, uint64_t intermediate, uint64_t layers) {
  ModelShape s;
  s.vocab_size = vocab;
  s.hidden_size = d;
  s.intermediate_size = intermediate;
  s.num_layers = layers;
  s.head_dim = d >= 3072 ? 128 : 64;
  s.num_heads = d / s.head_dim;
  s.num_kv_heads = s.num_heads % 4 == 0   ? s.num_heads / 4
                   : s.num_heads % 2 == 0 ? s.num_heads / 2
                                          : s.num_heads;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Conversions and unit-in-the-last-place distances.

// Sign-magnitude bits -> integers whose order is the order of the floats (+0 and -0 both 0).
inline int64_t OrderedKey16(uint16_t x) {
  return (x & 0x8000) ? -static_cast<int64_t>(x & 0x7FFF) : static_cast<int64_t>(x);
}
inline int64_t OrderedKey32(uint32_t x) {
  return (x & 0x80000000u) ? -static_cast<int64_t>(x & 0x7FFFFFFFu) : static_cast<int64_t>(x);
}

// ---------------------------------------------------------------------------------------------
// The plan: tensors with their simulation parameters, shards, and file layouts.

enum class Kind { kEmbed, kLmHead, kNorm, kQ, kK, kV, kO, kGate, kUp, kDown, kExtra };

struct TensorSim {
  std::string name;
  Kind kind = Kind::kQ;
  std::vector<uint64_t> shape;
  uint64_t rows = 0;
  uint64_t cols = 0;
  uint64_t numel = 0;
  uint64_t first_param = 0;  // module-order index of element 0 (optimizer.bin); base tensors only
  int shard = 0;
  bool extra = false;        // present only from header_change_at on
  uint64_t key = 0;
  // Initial values: mean + std * row_scale * col_scale * z (z Gaussian with outliers).
  float mean = 0;
  float std = 0;
  float row_sigma = 0;       // lognormal sigma of the per-row scale
  bool column_scale = false;
  // Gradients: grad_scale * row_grad_scale * (persistent + noise), persistent ~ N(0, persist^2).
  float grad_scale = 0;
  float grad_row_sigma = 0;
  float persist = 0;
  bool decay = false;
  bool sparse_rows = false;  // embedding: rows of tokens absent from the batch get no gradient
};

// Where each tensor lives in one file, for one of the two header layouts.
struct ShardLayout {
  std::vector<uint8_t> prefix;  // 8 + N header bytes
  uint64_t file_size = 0;
  uint64_t tensor_bytes = 0;
  std::vector<std::string> tensor_names;  // sorted
};

struct VersionCounts {
  uint64_t compared = 0, changed = 0, ulp1 = 0, ulp2 = 0;
};

struct Plan {
  GenOptions options;
  ModelShape shape;
  uint64_t params = 0;
  size_t elem_size = 2;
  std::vector<TensorSim> tensors;  // module order; the extra tensor (if any) last
  int shards = 0;
  // layouts[0]: headers without the extra tensor; layouts[1]: with it (header_change_at > 0).
  std::vector<std::vector<ShardLayout>> layouts;
  // begins[layout][tensor]: absolute file offset of the tensor's data, or UINT64_MAX if absent.
  std::vector<std::vector<uint64_t>> begins;
  double zipf_norm = 1;  // sum over tokens of (r + offset)^-s
  uint64_t opaque_values = 0;
  uint64_t total_elements = 0;

  int LayoutOf(int version) const {
    return options.header_change_at > 0 && version >= options.header_change_at ? 1 : 0;
  }
  bool Present(const TensorSim& t, int version) const { return !t.extra || LayoutOf(version) == 1; }
  uint64_t StepOf(int version) const {
    return static_cast<uint64_t>(version) * static_cast<uint64_t>(options.steps_per_version);
  }
};

std::string VersionName(int v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "v%03d", v);
  return buf;
}

float LogUniform(uint64_t r, float lo, float hi) {
  return lo * std::pow(hi / lo, Uniform(r));
}

void SetSimParameters(TensorSim& t, uint64_t seed) {
  t.key = Mix(seed, HashString(t.name));
  uint64_t pk = Mix(t.key, kStreamTensorParams);
  auto r = [&](uint64_t i) { return Rand(pk, i); };
  t.row_sigma = 0.25f;
  t.column_scale = true;
  t.grad_scale = LogUniform(r(0), 1e-5f, 1e-3f);
  t.grad_row_sigma = 0.5f;
  t.persist = 0.05f + 0.25f * Uniform(r(1));
  t.decay = true;
  switch (t.kind) {
    case Kind::kEmbed:
      t.std = LogUniform(r(2), 0.012f, 0.025f);
      t.row_sigma = 0.35f;
      t.column_scale = false;
      t.sparse_rows = true;
      break;
    case Kind::kLmHead:
      t.std = LogUniform(r(2), 0.015f, 0.04f);
      t.row_sigma = 0.3f;
      break;
    case Kind::kNorm:
      t.mean = 0.9f + 0.2f * Uniform(r(2));
      t.std = 0.05f;
      t.row_sigma = 0;
      t.column_scale = false;
      t.decay = false;
      break;
    case Kind::kQ:
    case Kind::kK: t.std = LogUniform(r(2), 0.02f, 0.06f); break;
    case Kind::kV:
    case Kind::kO: t.std = LogUniform(r(2), 0.01f, 0.03f); break;
    case Kind::kGate:
    case Kind::kUp: t.std = LogUniform(r(2), 0.015f, 0.035f); break;
    case Kind::kDown: t.std = LogUniform(r(2), 0.01f, 0.03f); break;
    case Kind::kExtra: t.std = 0.02f; break;
  }
}

Kind KindOf(const std::string& name) {
  auto ends = [&](std::string_view suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (name == "model.embed_tokens.weight") return Kind::kEmbed;
  if (name == "lm_head.weight") return Kind::kLmHead;
  if (name == kGenExtraTensorName) return Kind::kExtra;
  if (ends("norm.weight")) return Kind::kNorm;
  if (ends("q_proj.weight")) return Kind::kQ;
  if (ends("k_proj.weight")) return Kind::kK;
  if (ends("v_proj.weight")) return Kind::kV;
  if (ends("o_proj.weight")) return Kind::kO;
  if (ends("gate_proj.weight")) return Kind::kGate;
  if (ends("up_proj.weight")) return Kind::kUp;
  return Kind::kDown;
}

Expected<Plan> MakePlan(const GenOptions& options) {
  Plan plan;
  plan.options = options;
  WFS_ASSIGN_OR_RETURN(plan.shape, ChooseModelShape(options.params));
  plan.params = plan.shape.ParamCount();
  plan.elem_size = DTypeSize(options.dtype);

  std::vector<TensorInfo> infos = ModelTensors(plan.shape, options.dtype);
  if (options.header_change_at > 0) {
    TensorInfo extra;
    extra.name = kGenExtraTensorName;
    extra.dtype = options.dtype;
    extra.shape = {16, plan.shape.hidden_size};
    infos.push_back(extra);
  }

  // Shards: fill in module order like transformers' split_torch_state_dict_into_shards; a tensor
  // larger than the limit gets a shard of its own. The extra tensor joins the first shard.
  uint64_t first_param = 0, shard_bytes = 0;
  int shard = 0;
  for (const TensorInfo& info : infos) {
    TensorSim t;
    t.name = info.name;
    t.kind = KindOf(info.name);
    t.shape = info.shape;
    t.numel = 1;
    for (uint64_t d : info.shape) t.numel *= d;
    t.cols = info.shape.back();
    t.rows = t.numel / t.cols;
    t.extra = t.kind == Kind::kExtra;
    if (t.extra) {
      t.shard = 0;
    } else {
      uint64_t bytes = t.numel * plan.elem_size;
      if (shard_bytes > 0 && shard_bytes + bytes > options.shard_size) {
        ++shard;
        shard_bytes = 0;
      }
      shard_bytes += bytes;
      t.shard = shard;
      t.first_param = first_param;
      first_param += t.numel;
    }
    SetSimParameters(t, options.seed);
    plan.total_elements += t.numel;
    plan.tensors.push_back(std::move(t));
  }
  plan.shards = shard + 1;

  // Headers: inside a file tensors are sorted by name, as the safetensors writer does.
  int layouts = options.header_change_at > 0 ? 2 : 1;
  for (int l = 0; l < layouts; ++l) {
    std::map<std::string, std::string> metadata = {{"format", "pt"}};
    if (l == 1) metadata[kGenExtraMetadataKey] = "added in " + VersionName(options.header_change_at);
    std::vector<ShardLayout> shard_layouts(plan.shards);
    std::vector<uint64_t> begins(plan.tensors.size(), UINT64_MAX);
    for (int s = 0; s < plan.shards; ++s) {
      std::vector<std::pair<std::string, size_t>> members;
      for (size_t i = 0; i < plan.tensors.size(); ++i) {
        const TensorSim& t = plan.tensors[i];
        if (t.shard == s && (!t.extra || l == 1)) members.emplace_back(t.name, i);
      }
      std::sort(members.begin(), members.end());
      std::vector<TensorInfo> infos_in_file;
      for (const auto& [name, i] : members) {
        TensorInfo ti;
        ti.name = name;
        ti.dtype = options.dtype;
        ti.shape = plan.tensors[i].shape;
        ti.begin = 0;
        ti.end = plan.tensors[i].numel * plan.elem_size;
        infos_in_file.push_back(std::move(ti));
      }
      ShardLayout& sl = shard_layouts[s];
      sl.prefix = BuildSafetensorsHeader(infos_in_file, metadata);
      for (size_t k = 0; k < members.size(); ++k) {
        begins[members[k].second] = sl.prefix.size() + infos_in_file[k].begin;
        sl.tensor_bytes += infos_in_file[k].size();
        sl.tensor_names.push_back(members[k].first);
      }
      sl.file_size = sl.prefix.size() + sl.tensor_bytes;
    }
    plan.layouts.push_back(std::move(shard_layouts));
    plan.begins.push_back(std::move(begins));
  }

  for (uint64_t r = 0; r < plan.shape.vocab_size; ++r) {
    plan.zipf_norm += std::pow(static_cast<double>(r) + kZipfOffset, -kZipfExponent);
  }
  plan.zipf_norm -= 1;
  if (options.opaque_size > 0) {
    plan.opaque_values = (options.opaque_size - kGenOpaqueHeaderBytes) / 4;
  }
  return plan;
}

// ---------------------------------------------------------------------------------------------
// Files.

std::string ErrnoText(int err) { return std::strerror(err); }

Status WriteAll(int fd, const void* data, size_t size, uint64_t offset, const std::string& path) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Status::IOError("cannot write " + path + " at offset " + std::to_string(offset) +
                             ": " + ErrnoText(errno));
    }
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status WriteTextFile(const fs::path& path, const std::string& text) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("cannot create " + path.string() + ": " + ErrnoText(errno));
  Status s = WriteAll(fd, text.data(), text.size(), 0, path.string());
  if (::close(fd) != 0 && s.ok()) {
    s = Status::IOError("cannot close " + path.string() + ": " + ErrnoText(errno));
  }
  return s;
}

// Open files of all versions; closes them on destruction.
class OutputFiles {
 public:
  OutputFiles() = default;
  OutputFiles(const OutputFiles&) = delete;
  OutputFiles& operator=(const OutputFiles&) = delete;
  ~OutputFiles() {
    for (auto& f : files_) {
      if (f.fd >= 0) ::close(f.fd);
    }
  }

  // Creates `path` with `size` bytes, `prefix` at offset 0 and zeros elsewhere; returns its id.
  Expected<size_t> Create(const fs::path& path, std::span<const uint8_t> prefix, uint64_t size) {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
      std::string hint = errno == EMFILE ? " (too many open files: raise --shard-size or ulimit -n)"
                                         : "";
      return Status::IOError("cannot create " + path.string() + ": " + ErrnoText(errno) + hint);
    }
    files_.push_back({fd, path.string()});
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
      return Status::IOError("cannot size " + path.string() + " to " + std::to_string(size) +
                             " bytes: " + ErrnoText(errno));
    }
    WFS_TRY(WriteAll(fd, prefix.data(), prefix.size(), 0, path.string()));
    return files_.size() - 1;
  }

  Status Write(size_t id, const void* data, size_t size, uint64_t offset) const {
    return WriteAll(files_[id].fd, data, size, offset, files_[id].path);
  }

  Status CloseAll() {
    Status first;
    for (auto& f : files_) {
      if (f.fd >= 0 && ::close(f.fd) != 0 && first.ok()) {
        first = Status::IOError("cannot close " + f.path + ": " + ErrnoText(errno));
      }
      f.fd = -1;
    }
    return first;
  }

 private:
  struct File {
    int fd;
    std::string path;
  };
  std::vector<File> files_;
};

// optimizer.bin, a stand-in for a torch optimizer state file (opaque to weightfs):
//   0   8  magic "WFSOPT01"
//   8   8  u64 LE  optimizer step (kResumeStep + steps since the base)
//   16  8  u64 LE  P = parameters of the model
//   24  8  u64 LE  n = (file size - 32) / 4, the number of fp32 values that follow
//   32  4n fp32 LE values: Adam exp_avg of parameters 0, 1, ... in module order, then
//          exp_avg_sq of parameters 0, 1, ..., then zeros; cut off after n values
//   ..     (file size - 32) % 4 zero bytes
std::vector<uint8_t> OpaqueHeader(const Plan& plan, int version) {
  std::vector<uint8_t> h(kGenOpaqueHeaderBytes, 0);
  std::memcpy(h.data(), "WFSOPT01", 8);
  uint64_t fields[3] = {kResumeStep + plan.StepOf(version), plan.params, plan.opaque_values};
  std::memcpy(h.data() + 8, fields, sizeof fields);
  return h;
}

// ---------------------------------------------------------------------------------------------
// The simulation of one slice of one tensor through all versions.

struct Sink {
  const Plan* plan;
  const OutputFiles* files;
  std::vector<std::vector<size_t>> shard_ids;  // [version][shard]
  std::vector<size_t> opaque_ids;              // [version]
};

struct SliceBuffers {
  std::vector<float> w, m, v, c, noise, col_scale, row_grad, row_q;
  std::vector<uint8_t> prev, cur;
  void Resize(uint64_t n, uint64_t cols, size_t elem_size) {
    for (auto* b : {&w, &m, &v, &c, &noise}) b->resize(n);
    col_scale.resize(cols);
    prev.resize(n * elem_size);
    cur.resize(n * elem_size);
  }
};

// Probability that token `r` occurs in a batch.
double TokenInBatchProbability(const Plan& plan, uint64_t r) {
  double p = std::pow(static_cast<double>(r) + kZipfOffset, -kZipfExponent) / plan.zipf_norm;
  return 1.0 - std::exp(-kBatchTokens * p);
}

void CastSlice(DType dtype, const float* w, uint64_t n, uint8_t* out) {
  if (dtype == DType::kBF16) {
    auto* o = reinterpret_cast<uint16_t*>(out);
    for (uint64_t i = 0; i < n; ++i) o[i] = Fp32ToBf16(w[i]);
  } else if (dtype == DType::kF16) {
    auto* o = reinterpret_cast<uint16_t*>(out);
    for (uint64_t i = 0; i < n; ++i) o[i] = Fp32ToFp16(w[i]);
  } else {
    std::memcpy(out, w, n * 4);
  }
}

void CountChanges(size_t elem_size, const uint8_t* a, const uint8_t* b, uint64_t n,
                  VersionCounts* counts) {
  uint64_t changed = 0, ulp1 = 0, ulp2 = 0;
  if (elem_size == 2) {
    const auto* x = reinterpret_cast<const uint16_t*>(a);
    const auto* y = reinterpret_cast<const uint16_t*>(b);
    for (uint64_t i = 0; i < n; ++i) {
      if (x[i] == y[i]) continue;
      ++changed;
      int64_t d = OrderedKey16(y[i]) - OrderedKey16(x[i]);
      if (d == 1 || d == -1) ++ulp1;
      else if (d == 2 || d == -2) ++ulp2;
    }
  } else {
    const auto* x = reinterpret_cast<const uint32_t*>(a);
    const auto* y = reinterpret_cast<const uint32_t*>(b);
    for (uint64_t i = 0; i < n; ++i) {
      if (x[i] == y[i]) continue;
      ++changed;
      int64_t d = OrderedKey32(y[i]) - OrderedKey32(x[i]);
      if (d == 1 || d == -1) ++ulp1;
      else if (d == 2 || d == -2) ++ulp2;
    }
  }
  counts->compared += n;
  counts->changed += changed;
  counts->ulp1 += ulp1;
  counts->ulp2 += ulp2;
}

// Calls fn(row, first column, length, offset in slice) for the row segments of [start, start+n).
template <typename Fn>
void ForEachRow(const TensorSim& t, uint64_t start, uint64_t n, Fn&& fn) {
  uint64_t e = start;
  const uint64_t end = start + n;
  while (e < end) {
    uint64_t row = e / t.cols, col = e % t.cols;
    uint64_t len = std::min(t.cols - col, end - e);
    fn(row, col, len, e - start);
    e += len;
  }
}

Status WriteOpaque(const Sink& sink, const TensorSim& t, uint64_t start, uint64_t n,
                   const SliceBuffers& b, int version) {
  const Plan& plan = *sink.plan;
  if (plan.opaque_values == 0 || t.extra) return Status::Ok();
  // exp_avg at value index first_param + start, exp_avg_sq at P + first_param + start.
  const std::pair<const std::vector<float>*, uint64_t> regions[2] = {
      {&b.m, t.first_param + start}, {&b.v, plan.params + t.first_param + start}};
  for (const auto& [values, index] : regions) {
    if (index >= plan.opaque_values) continue;
    uint64_t count = std::min(n, plan.opaque_values - index);
    WFS_TRY(sink.files->Write(sink.opaque_ids[version], values->data(), count * 4,
                              kGenOpaqueHeaderBytes + index * 4));
  }
  return Status::Ok();
}

// Simulates elements [start, start + n) of tensor `index` from the base to the last version,
// writing each version's bytes and adding the changes between versions to `counts`.
Status SimulateSlice(const Sink& sink, size_t index, uint64_t start, uint64_t n, SliceBuffers& b,
                     std::vector<VersionCounts>& counts) {
  const Plan& plan = *sink.plan;
  const TensorSim& t = plan.tensors[index];
  const GenOptions& o = plan.options;
  const size_t es = plan.elem_size;
  b.Resize(n, t.cols, es);
  const uint64_t first_row = start / t.cols;
  const uint64_t last_row = (start + n - 1) / t.cols;
  b.row_grad.assign(last_row - first_row + 1, 0);
  b.row_q.assign(last_row - first_row + 1, 1);

  // Column scales: keyed by (seed, number of columns), so every tensor reading the residual
  // stream shares the same few "massive activation" channels.
  if (t.column_scale) {
    uint64_t ck = Mix(Mix(o.seed, kStreamColumnScale), t.cols);
    for (uint64_t c = 0; c < t.cols; ++c) {
      uint64_t r = Rand(ck, c);
      float s = std::exp(0.1f * Gaussian(ck ^ 1, c));
      b.col_scale[c] = (r & kOutlierColumnMask) == 0 ? 3.0f * s : s;
    }
  }

  // Initial state: weights, persistent gradient direction, warm Adam moments.
  FillGaussian(Mix(t.key, kStreamValue), start, n, b.w.data());
  FillGaussian(Mix(t.key, kStreamPersistent), start, n, b.c.data());
  FillGaussian(Mix(t.key, kStreamWarmMoment), start, n, b.noise.data());
  const uint64_t outlier_key = Mix(t.key, kStreamOutlier);
  const uint64_t row_key = Mix(t.key, kStreamRowScale);
  const uint64_t grad_row_key = Mix(t.key, kStreamGradRowScale);
  ForEachRow(t, start, n, [&](uint64_t row, uint64_t col, uint64_t len, uint64_t off) {
    const float row_scale = t.std * std::exp(t.row_sigma * Gaussian(row_key, row));
    const float gs = t.grad_scale * std::exp(t.grad_row_sigma * Gaussian(grad_row_key, row));
    const float q = t.sparse_rows ? static_cast<float>(TokenInBatchProbability(plan, row)) : 1.0f;
    b.row_grad[row - first_row] = gs;
    b.row_q[row - first_row] = q;
    for (uint64_t j = 0; j < len; ++j) {
      const uint64_t i = off + j;
      float z = b.w[i];
      uint64_t r = Rand(outlier_key, start + i);
      if ((r >> kOutlierShift) == 0) z *= 3.0f + 5.0f * static_cast<float>(r & 0xFFFF) * 0x1p-16f;
      const float cs = t.column_scale ? b.col_scale[col + j] : 1.0f;
      b.w[i] = t.mean + row_scale * cs * z;
      const float c = t.persist * b.c[i];
      b.c[i] = c;
      b.m[i] = q * gs * (c + kWarmMomentNoise * b.noise[i]);
      b.v[i] = q * gs * gs * (c * c + 1.0f);
    }
  });

  auto emit = [&](int version) -> Status {
    CastSlice(o.dtype, b.w.data(), n, b.cur.data());
    if (version > 0 && plan.Present(t, version) && plan.Present(t, version - 1)) {
      CountChanges(es, b.prev.data(), b.cur.data(), n, &counts[version]);
    }
    if (plan.Present(t, version)) {
      const uint64_t begin = plan.begins[plan.LayoutOf(version)][index];
      WFS_TRY(sink.files->Write(sink.shard_ids[version][t.shard], b.cur.data(), n * es,
                                begin + start * es));
    }
    WFS_TRY(WriteOpaque(sink, t, start, n, b, version));
    std::swap(b.prev, b.cur);
    return Status::Ok();
  };
  WFS_TRY(emit(0));

  const uint64_t noise_key = Mix(t.key, kStreamNoise);
  const uint64_t batch_key = Mix(o.seed, kStreamBatch);
  const float lr = static_cast<float>(o.lr);
  for (int version = 1; version <= o.versions; ++version) {
    for (int s = 1; s <= o.steps_per_version; ++s) {
      const uint64_t step = plan.StepOf(version - 1) + static_cast<uint64_t>(s);
      const double adam_t = static_cast<double>(kResumeStep + step);
      const float step_size = static_cast<float>(o.lr / (1.0 - std::pow(double{kBeta1}, adam_t)));
      const float inv_sqrt_bc2 =
          static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{kBeta2}, adam_t)));
      const float decay = t.decay ? 1.0f - lr * kWeightDecay : 1.0f;
      FillGaussian(Mix(noise_key, step), start, n, b.noise.data());
      const uint64_t step_batch_key = Mix(batch_key, step);
      ForEachRow(t, start, n, [&](uint64_t row, uint64_t, uint64_t len, uint64_t off) {
        float gs = b.row_grad[row - first_row];
        if (t.sparse_rows && UniformD(Rand(step_batch_key, row)) >= b.row_q[row - first_row]) {
          gs = 0;  // token not in this batch
        }
        AdamRow({gs, decay, step_size, inv_sqrt_bc2}, len, b.w.data() + off, b.m.data() + off,
                b.v.data() + off, b.c.data() + off, b.noise.data() + off);
      });
    }
    WFS_TRY(emit(version));
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// versions.json, config.json, index json.

std::string DTypeTorchName(DType d) {
  return d == DType::kBF16 ? "bfloat16" : d == DType::kF16 ? "float16" : "float32";
}
std::string DTypeOptionName(DType d) {
  return d == DType::kBF16 ? "bf16" : d == DType::kF16 ? "fp16" : "fp32";
}

std::string ConfigJson(const Plan& plan) {
  const ModelShape& s = plan.shape;
  nlohmann::ordered_json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["hidden_size"] = s.hidden_size;
  j["intermediate_size"] = s.intermediate_size;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.num_heads;
  j["num_key_value_heads"] = s.num_kv_heads;
  j["head_dim"] = s.head_dim;
  j["vocab_size"] = s.vocab_size;
  j["hidden_act"] = "silu";
  j["max_position_embeddings"] = 4096;
  j["rms_norm_eps"] = 1e-5;
  j["rope_theta"] = 500000.0;
  j["tie_word_embeddings"] = false;
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["bos_token_id"] = 1;
  j["eos_token_id"] = 2;
  j["torch_dtype"] = DTypeTorchName(plan.options.dtype);
  j["weightfs_gen_seed"] = plan.options.seed;
  return j.dump(2) + "\n";
}

std::string IndexJson(const Plan& plan, int layout) {
  nlohmann::json j;  // keys sorted, as transformers writes it (json.dumps(sort_keys=True))
  uint64_t total = 0;
  for (const ShardLayout& sl : plan.layouts[layout]) total += sl.tensor_bytes;
  j["metadata"]["total_size"] = total;
  j["weight_map"] = nlohmann::json::object();
  for (int s = 0; s < plan.shards; ++s) {
    for (const std::string& name : plan.layouts[layout][s].tensor_names) {
      j["weight_map"][name] = ShardFileName(s, plan.shards);
    }
  }
  return j.dump(2) + "\n";
}

std::string VersionsJson(const Plan& plan, const GenResult& result) {
  const GenOptions& o = plan.options;
  const ModelShape& s = plan.shape;
  nlohmann::ordered_json j;
  j["generator"] = "weightfs gen";
  j["options"] = {{"params", o.params},
                  {"versions", o.versions},
                  {"lr", o.lr},
                  {"dtype", DTypeOptionName(o.dtype)},
                  {"shard_size", o.shard_size},
                  {"steps_per_version", o.steps_per_version},
                  {"seed", o.seed},
                  {"header_change_at", o.header_change_at},
                  {"opaque_size", o.opaque_size}};
  j["model"] = {{"parameters", plan.params},
                {"vocab_size", s.vocab_size},
                {"hidden_size", s.hidden_size},
                {"num_layers", s.num_layers},
                {"num_heads", s.num_heads},
                {"num_kv_heads", s.num_kv_heads},
                {"head_dim", s.head_dim},
                {"intermediate_size", s.intermediate_size},
                {"shards", plan.shards}};
  j["versions"] = nlohmann::ordered_json::array();
  for (const GenVersionSummary& v : result.versions) {
    nlohmann::ordered_json e;
    e["name"] = v.name;
    e["parent"] = v.parent.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v.parent);
    e["step"] = v.step;
    e["files"] = v.files;
    e["bytes"] = v.bytes;
    if (!v.parent.empty()) {
      e["compared_elements"] = v.compared;
      e["changed_elements"] = v.changed;
      e["changed_fraction"] = v.changed_fraction();
      double c = v.changed ? static_cast<double>(v.changed) : 1.0;
      e["ulp1_share"] = static_cast<double>(v.ulp1) / c;
      e["ulp2_share"] = static_cast<double>(v.ulp2) / c;
    }
    j["versions"].push_back(std::move(e));
  }
  return j.dump(2) + "\n";
}

}  // namespace

// ---------------------------------------------------------------------------------------------

uint16_t Fp32ToBf16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((x >> 16) | 0x0040);  // NaN
  x += 0x7FFFu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

uint16_t Fp32ToFp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00u;       // NaN
  if (ax >= 0x477FF000u) return sign | 0x7C00u;      // rounds to >= 65520: infinity
  if (ax < 0x33000001u) return sign;                 // <= 2^-25: rounds to zero
  const int exp = static_cast<int>(ax >> 23) - 127;
  uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;      // 24 bits with the implicit one
  int shift;                                          // bits dropped from the 24-bit mantissa
  uint32_t base;
  if (exp < -14) {                                    // subnormal half
    shift = 13 + (-14 - exp);
    base = 0;
  } else {
    shift = 13;
    base = static_cast<uint32_t>(exp + 15) << 10;
    mant &= 0x7FFFFFu;                                // normal: drop the implicit one
  }
  uint32_t kept = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1u))) ++kept;  // carries into the exponent are right
  return static_cast<uint16_t>(sign | (base + kept));
}

uint64_t ModelShape::ParamCount() const {
  const uint64_t d = hidden_size, q = num_heads * head_dim, kv = num_kv_heads * head_dim;
  const uint64_t per_layer = d * q + 2 * d * kv + q * d + 3 * d * intermediate_size + 2 * d;
  return 2 * vocab_size * d + num_layers * per_layer + d;
}

Expected<ModelShape> ChooseModelShape(uint64_t target_params) {
  if (target_params < kGenMinParams || target_params > kGenMaxParams) {
    return Status::InvalidArgument("parameter count " + std::to_string(target_params) +
                                   " is outside the supported range [300K, 2T]");
  }
  const double p = static_cast<double>(target_params);
  // Width/depth ratio d/L of real models: ~32 for tiny ones, ~128 from 1B on.
  const double target_aspect = std::clamp(32.0 * std::pow(p / 1e6, 0.2), 32.0, 128.0);
  double best_score = 1e300;
  ModelShape best;
  for (const auto& [vocab, vocab_penalty] : VocabCandidates(target_params)) {
    // Widths as real models use them: multiples of 128, of 256 from 1024, of 512 from 2048
    // (so that head counts stay divisible by the GQA group size).
    for (uint64_t d = 128; d <= 32768; d += d >= 2048 ? 512 : d >= 1024 ? 256 : 128) {
      const uint64_t granule = d >= 1024 ? 256 : 128;
      const uint64_t i_lo = std::max<uint64_t>(granule, RoundTo(2.7 * static_cast<double>(d), granule));
      for (uint64_t inter = i_lo; inter <= 3.5 * static_cast<double>(d) + 1e-9; inter += granule) {
        if (static_cast<double>(inter) < 2.69 * static_cast<double>(d)) continue;
        ModelShape one = ShapeFor(vocab, d, inter, 1);
        ModelShape zero = ShapeFor(vocab, d, inter, 0);
        const double fixed = static_cast<double>(zero.ParamCount());
        const double per_layer = static_cast<double>(one.ParamCount()) - fixed;
        const double layers_exact = (p - fixed) / per_layer;
        if (layers_exact < 0.5) continue;
        const uint64_t layers = std::max<uint64_t>(1, std::llround(layers_exact));
        if (layers > 256) continue;
        ModelShape s = ShapeFor(vocab, d, inter, layers);
        const double err = std::fabs(static_cast<double>(s.ParamCount()) - p) / p;
        if (err > 0.10) continue;
        const double aspect = static_cast<double>(d) / static_cast<double>(layers);
        const double ratio_penalty =
            0.05 * std::fabs(static_cast<double>(inter) / static_cast<double>(d) - 3.0);
        const double score = 10 * err + std::fabs(std::log(aspect / target_aspect)) +
                             vocab_penalty + ratio_penalty;
        if (score < best_score) {
          best_score = score;
          best = s;
        }
      }
    }
  }
  if (best.hidden_size == 0) {
    return Status::InvalidArgument("no Llama-like shape has within 10% of " +
                                   std::to_string(target_params) +
                                   " parameters; try a slightly different --params");
  }
  return best;
}

std::vector<TensorInfo> ModelTensors(const ModelShape& s, DType dtype) {
  std::vector<TensorInfo> out;
  auto add = [&](std::string name, std::vector<uint64_t> shape) {
    TensorInfo t;
    t.name = std::move(name);
    t.dtype = dtype;
    t.shape = std::move(shape);
    out.push_back(std::move(t));
  };
  const uint64_t d = s.hidden_size, q = s.num_heads * s.head_dim, kv = s.num_kv_heads * s.head_dim;
  add("model.embed_tokens.weight", {s.vocab_size, d});
  // Module registration order of LlamaDecoderLayer: self_attn, mlp, then the two norms.
  for (uint64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    add(p + "self_attn.q_proj.weight", {q, d});
    add(p + "self_attn.k_proj.weight", {kv, d});
    add(p + "self_attn.v_proj.weight", {kv, d});
    add(p + "self_attn.o_proj.weight", {d, q});
    add(p + "mlp.gate_proj.weight", {s.intermediate_size, d});
    add(p + "mlp.up_proj.weight", {s.intermediate_size, d});
    add(p + "mlp.down_proj.weight", {d, s.intermediate_size});
    add(p + "input_layernorm.weight", {d});
    add(p + "post_attention_layernorm.weight", {d});
  }
  add("model.norm.weight", {d});
  add("lm_head.weight", {s.vocab_size, d});
  return out;
}

std::string ShardFileName(int index, int count) {
  if (count == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", index + 1, count);
  return buf;
}

Status ValidateGenOptions(const GenOptions& o) {
  if (o.out_dir.empty()) return Status::InvalidArgument("no output directory given");
  if (o.params < kGenMinParams || o.params > kGenMaxParams) {
    return Status::InvalidArgument("--params " + std::to_string(o.params) +
                                   " is outside the supported range 300K..2T");
  }
  if (o.versions < 1 || o.versions > kGenMaxVersions) {
    return Status::InvalidArgument("--versions must be between 1 and " +
                                   std::to_string(kGenMaxVersions));
  }
  if (!(o.lr > 0) || !(o.lr <= 1)) return Status::InvalidArgument("--lr must be in (0, 1]");
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF16 && o.dtype != DType::kF32) {
    return Status::InvalidArgument("--dtype must be bf16, fp16 or fp32");
  }
  if (o.shard_size < 1) return Status::InvalidArgument("--shard-size must be positive");
  if (o.steps_per_version < 1 || o.steps_per_version > 100000) {
    return Status::InvalidArgument("--steps-per-version must be between 1 and 100000");
  }
  if (o.header_change_at < 0 || o.header_change_at > o.versions) {
    return Status::InvalidArgument("--header-change-at must be between 1 and --versions (" +
                                   std::to_string(o.versions) + "), or 0 for never");
  }
  if (o.opaque_size != 0 && o.opaque_size < kGenOpaqueHeaderBytes) {
    return Status::InvalidArgument("--opaque-size must be 0 or at least " +
                                   std::to_string(kGenOpaqueHeaderBytes) + " bytes");
  }
  if (o.threads < 0 || o.threads > 1024) {
    return Status::InvalidArgument("--threads must be between 1 and 1024 (0 = all cores)");
  }
  return Status::Ok();
}

Expected<GenResult> GenerateCheckpoints(const GenOptions& options,
                                        const GenProgressCallback& progress) {
  const auto t0 = std::chrono::steady_clock::now();
  WFS_TRY(ValidateGenOptions(options));
  WFS_ASSIGN_OR_RETURN(Plan plan, MakePlan(options));

  // Directories. An existing non-empty OUT is refused: mixing two runs would be confusing.
  const fs::path out(options.out_dir);
  std::error_code ec;
  if (fs::exists(out, ec)) {
    if (!fs::is_directory(out, ec)) {
      return Status::InvalidArgument(out.string() + " exists and is not a directory");
    }
    if (!fs::is_empty(out, ec)) {
      return Status::InvalidArgument(out.string() +
                                     " is not empty; choose a new directory or remove it first");
    }
  }
  fs::create_directories(out, ec);
  if (ec) return Status::IOError("cannot create " + out.string() + ": " + ec.message());

  GenResult result;
  result.shape = plan.shape;
  result.params = plan.params;
  result.shards = plan.shards;

  OutputFiles files;
  Sink sink{&plan, &files, {}, {}};
  const std::string config = ConfigJson(plan);
  for (int v = 0; v <= options.versions; ++v) {
    const fs::path dir = out / VersionName(v);
    fs::create_directory(dir, ec);
    if (ec) return Status::IOError("cannot create " + dir.string() + ": " + ec.message());
    GenVersionSummary summary;
    summary.name = VersionName(v);
    summary.parent = v == 0 ? "" : VersionName(v - 1);
    summary.step = plan.StepOf(v);
    const int layout = plan.LayoutOf(v);
    std::vector<size_t> ids;
    for (int s = 0; s < plan.shards; ++s) {
      const ShardLayout& sl = plan.layouts[layout][s];
      const std::string name = ShardFileName(s, plan.shards);
      WFS_ASSIGN_OR_RETURN(size_t id, files.Create(dir / name, sl.prefix, sl.file_size));
      ids.push_back(id);
      summary.files.push_back(name);
      summary.bytes += sl.file_size;
    }
    sink.shard_ids.push_back(std::move(ids));
    auto add_text = [&](const std::string& name, const std::string& text) -> Status {
      WFS_TRY(WriteTextFile(dir / name, text));
      summary.files.push_back(name);
      summary.bytes += text.size();
      return Status::Ok();
    };
    WFS_TRY(add_text("config.json", config));
    if (plan.shards > 1) WFS_TRY(add_text("model.safetensors.index.json", IndexJson(plan, layout)));
    if (options.opaque_size > 0) {
      WFS_ASSIGN_OR_RETURN(size_t id, files.Create(dir / "optimizer.bin", OpaqueHeader(plan, v),
                                                   options.opaque_size));
      sink.opaque_ids.push_back(id);
      summary.files.push_back("optimizer.bin");
      summary.bytes += options.opaque_size;
    }
    std::sort(summary.files.begin(), summary.files.end());
    result.bytes_written += summary.bytes;
    result.versions.push_back(std::move(summary));
  }

  // Work: every slice of every tensor, handed out in order by an atomic counter.
  struct Item {
    size_t tensor;
    uint64_t start, n;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    for (uint64_t s = 0; s < plan.tensors[i].numel; s += kSliceElements) {
      items.push_back({i, s, std::min(kSliceElements, plan.tensors[i].numel - s)});
    }
  }
  unsigned threads = options.threads > 0 ? static_cast<unsigned>(options.threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
  threads = static_cast<unsigned>(std::min<size_t>(threads, items.size()));

  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done_elements{0};
  std::atomic<bool> stop{false};
  std::mutex mu;  // guards first_error, totals, finished_workers
  std::condition_variable cv;
  Status first_error;
  std::vector<VersionCounts> totals(options.versions + 1);
  unsigned finished_workers = 0;

  auto worker = [&] {
    SliceBuffers buffers;
    std::vector<VersionCounts> counts(options.versions + 1);
    while (!stop.load(std::memory_order_relaxed)) {
      const size_t k = next.fetch_add(1);
      if (k >= items.size()) break;
      const Item& it = items[k];
      Status s = SimulateSlice(sink, it.tensor, it.start, it.n, buffers, counts);
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = s;
        stop = true;
        break;
      }
      done_elements += it.n;
    }
    std::lock_guard<std::mutex> lock(mu);
    for (size_t v = 0; v < counts.size(); ++v) {
      totals[v].compared += counts[v].compared;
      totals[v].changed += counts[v].changed;
      totals[v].ulp1 += counts[v].ulp1;
      totals[v].ulp2 += counts[v].ulp2;
    }
    ++finished_workers;
    cv.notify_all();
  };
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i) pool.emplace_back(worker);
  {
    std::unique_lock<std::mutex> lock(mu);
    while (finished_workers < threads) {
      cv.wait_for(lock, std::chrono::milliseconds(100));
      if (progress) {
        lock.unlock();
        progress(done_elements.load(), plan.total_elements);
        lock.lock();
      }
    }
  }
  for (auto& t : pool) t.join();
  if (!first_error.ok()) return first_error;
  if (progress) progress(plan.total_elements, plan.total_elements);
  WFS_TRY(files.CloseAll());

  for (int v = 1; v <= options.versions; ++v) {
    GenVersionSummary& s = result.versions[v];
    s.compared = totals[v].compared;
    s.changed = totals[v].changed;
    s.ulp1 = totals[v].ulp1;
    s.ulp2 = totals[v].ulp2;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string versions_json = VersionsJson(plan, result);
  WFS_TRY(WriteTextFile(out / "versions.json", versions_json));
  result.bytes_written += versions_json.size();
  return result;
}

}  // namespace weightfs
