// The gated activation as the fused gate / up projection's epilogue (ExpertdGroupedGlu: its handler
// in grouped_glu_cpu.cc, each item's epilogue run by grouped_matmul_cpu.cc's GroupedMatmul): for one
// item's rows and columns, in place over its gate block,
//
//   h = glu(g + b_gate, u + b_up)             elementwise, fp32
//   h = bf16(h) (round to nearest even)       where the layer rounds h to bf16 before the down
//                                             projection (the result stays fp32, bf16-valued)
//
// glu is `kernels/ffn.py` GatedActivation's, for these of its activations:
//   kSilu       act(v) = v * sigmoid(v)
//   kGeluTanh   act(v) = v * sigmoid(2 sqrt(2/pi) (v + 0.044715 v^3))   (= gelu_tanh: 0.5 v (1 + tanh(...)))
//     limit none: act(g) * u;  before: act(min(g, L)) * clip(u, -L, L);  after: min(act(g), L) * clip(u, -L, L)
//   kSwigluOai  g' = min(g, L), u' = clip(u, -L, L) (no clamp without a limit):
//               (u' + 1) * (g' * sigmoid(alpha g'))
// (gelu with erf is not here: the layer applies it in XLA between two unfused projections.)
//
// sigmoid(s) = 1 / (1 + exp(-s)), exp by Cephes' expf reduction (s clamped to [-87.33, 88], n =
// round(s / ln 2), a degree-6 polynomial on the remainder, times 2^n): within 2 ulp of exp, so h
// is within a few fp32 ulp of XLA's jax.nn formulas (not its bits: XLA's exp and tanh are other
// polynomials) and, rounded to bf16, equal to XLA's or its neighbour where h lies that close to
// a rounding boundary. The AVX2 loop (8 columns at a time; the tail through an 8-lane copy) and
// the portable loop do the same operations in the same order (FMAs as std::fma, IEEE division,
// the build's -ffp-contract=off), so every instruction-set level gives the same bits, and a
// column's result never depends on its position or the other rows. NaN in g or u stays NaN.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace expertd::glu {

enum class Kind : int32_t { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 };
enum class LimitMode : int32_t { kNone = 0, kBefore = 1, kAfter = 2 };

struct Activation {
  Kind kind;
  LimitMode limit_mode;  // kNone: no clamp (kSwigluOai: kBefore or kAfter both clamp g and u first)
  float limit, alpha;
  bool round_bf16;
};

constexpr float kExpMin = -87.33654f, kExpMax = 88.0f;  // 2^n stays a normal float
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kGeluCubic = 0.044715f, kGeluScale = 1.5957691216057308f;  // 2 sqrt(2 / pi)

// ---- portable: one element, the operations of the AVX2 lanes below in their order ----

inline float Min(float bound, float v) { return bound < v ? bound : v; }  // minps(bound, v): NaN v passes
inline float Max(float bound, float v) { return bound > v ? bound : v; }

inline float Exp(float s) {
  s = Min(kExpMax, Max(kExpMin, s));
  const float n = std::nearbyint(s * kLog2e);
  float r = std::fma(n, -kLn2Hi, s);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
  const float e = std::fma(p, r * r, r) + 1.0f;
  const int32_t ni = n == n ? static_cast<int32_t>(n) : 0;  // NaN s: its NaN reaches h through v
  const uint32_t bits = static_cast<uint32_t>(ni + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

inline float Sigmoid(float s) { return 1.0f / (1.0f + Exp(-s)); }

inline float Act(Kind kind, float v) {
  if (kind == Kind::kGeluTanh) return v * Sigmoid(kGeluScale * (v + kGeluCubic * (v * v * v)));
  return v * Sigmoid(v);
}

inline float Glu(const Activation& a, float g, float u) {
  if (a.limit_mode != LimitMode::kNone) u = Min(a.limit, Max(-a.limit, u));
  if (a.kind == Kind::kSwigluOai) {
    if (a.limit_mode != LimitMode::kNone) g = Min(a.limit, g);
    return (u + 1.0f) * (g * Sigmoid(a.alpha * g));
  }
  if (a.limit_mode == LimitMode::kBefore) g = Min(a.limit, g);
  const float act = Act(a.kind, g);
  return (a.limit_mode == LimitMode::kAfter ? Min(a.limit, act) : act) * u;
}

inline float RoundBf16(float h) {
  uint32_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  bits = h != h ? (bits | 0x00400000u) & 0xFFFF0000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&h, &bits, sizeof(h));
  return h;
}

// rows x columns [c0, c1) of g (`stride` floats a row; h is written over it) and u (the same
// layout); bias_gate / bias_up: the expert's [C] biases, or nullptr.
inline void ApplyScalar(const Activation& a, int64_t rows, int64_t c0, int64_t c1, int64_t stride, float* g,
                        const float* u, const float* bias_gate, const float* bias_up) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; ++c) {
      float gv = g[r * stride + c], uv = u[r * stride + c];
      if (bias_gate) gv = gv + bias_gate[c];
      if (bias_up) uv = uv + bias_up[c];
      const float h = Glu(a, gv, uv);
      g[r * stride + c] = a.round_bf16 ? RoundBf16(h) : h;
    }
  }
}

// ---- AVX2: 8 columns at a time ----

#define EXPERTD_AVX2 __attribute__((target("avx2,fma")))

EXPERTD_AVX2 inline __m256 Exp8(__m256 s) {
  s = _mm256_min_ps(_mm256_set1_ps(kExpMax), _mm256_max_ps(_mm256_set1_ps(kExpMin), s));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(s, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), s);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 e = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_and_si256(_mm256_cvtps_epi32(n), _mm256_castps_si256(_mm256_cmp_ps(n, n, _CMP_ORD_Q)));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(e, scale);
}

EXPERTD_AVX2 inline __m256 Sigmoid8(__m256 s) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 minus_s = _mm256_xor_ps(s, _mm256_set1_ps(-0.0f));  // -s, as the scalar negation
  return _mm256_div_ps(one, _mm256_add_ps(one, Exp8(minus_s)));
}

EXPERTD_AVX2 inline __m256 Act8(Kind kind, __m256 v) {
  if (kind == Kind::kGeluTanh) {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(v, v), v);
    const __m256 inner = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(kGeluCubic), cube));
    return _mm256_mul_ps(v, Sigmoid8(_mm256_mul_ps(_mm256_set1_ps(kGeluScale), inner)));
  }
  return _mm256_mul_ps(v, Sigmoid8(v));
}

EXPERTD_AVX2 inline __m256 Glu8(const Activation& a, __m256 g, __m256 u) {
  const __m256 limit = _mm256_set1_ps(a.limit);
  if (a.limit_mode != LimitMode::kNone) u = _mm256_min_ps(limit, _mm256_max_ps(_mm256_set1_ps(-a.limit), u));
  if (a.kind == Kind::kSwigluOai) {
    if (a.limit_mode != LimitMode::kNone) g = _mm256_min_ps(limit, g);
    const __m256 gated = _mm256_mul_ps(g, Sigmoid8(_mm256_mul_ps(_mm256_set1_ps(a.alpha), g)));
    return _mm256_mul_ps(_mm256_add_ps(u, _mm256_set1_ps(1.0f)), gated);
  }
  if (a.limit_mode == LimitMode::kBefore) g = _mm256_min_ps(limit, g);
  const __m256 act = Act8(a.kind, g);
  return _mm256_mul_ps(a.limit_mode == LimitMode::kAfter ? _mm256_min_ps(limit, act) : act, u);
}

EXPERTD_AVX2 inline __m256 RoundBf168(__m256 h) {
  const __m256i bits = _mm256_castps_si256(h), high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), high);
  const __m256i quiet = _mm256_and_si256(_mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), high);
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quiet), _mm256_cmp_ps(h, h, _CMP_UNORD_Q));
}

EXPERTD_AVX2 inline __m256 Step8(const Activation& a, __m256 g, __m256 u, const float* bias_gate,
                                 const float* bias_up) {
  if (bias_gate) g = _mm256_add_ps(g, _mm256_loadu_ps(bias_gate));
  if (bias_up) u = _mm256_add_ps(u, _mm256_loadu_ps(bias_up));
  const __m256 h = Glu8(a, g, u);
  return a.round_bf16 ? RoundBf168(h) : h;
}

// ApplyScalar's contract, the same bits.
EXPERTD_AVX2 inline void ApplyAvx2(const Activation& a, int64_t rows, int64_t c0, int64_t c1, int64_t stride,
                                   float* g, const float* u, const float* bias_gate, const float* bias_up) {
  const int64_t c_vec = c0 + (c1 - c0) / 8 * 8, tail = c1 - c_vec;
  for (int64_t r = 0; r < rows; ++r) {
    float* gr = g + r * stride;
    const float* ur = u + r * stride;
    for (int64_t c = c0; c < c_vec; c += 8) {
      _mm256_storeu_ps(gr + c, Step8(a, _mm256_loadu_ps(gr + c), _mm256_loadu_ps(ur + c), bias_gate ? bias_gate + c : nullptr,
                                     bias_up ? bias_up + c : nullptr));
    }
    if (tail == 0) continue;
    alignas(32) float lanes[4][8] = {};  // g, u, bias_gate, bias_up of the last columns
    std::memcpy(lanes[0], gr + c_vec, tail * sizeof(float));
    std::memcpy(lanes[1], ur + c_vec, tail * sizeof(float));
    if (bias_gate) std::memcpy(lanes[2], bias_gate + c_vec, tail * sizeof(float));
    if (bias_up) std::memcpy(lanes[3], bias_up + c_vec, tail * sizeof(float));
    _mm256_store_ps(lanes[0], Step8(a, _mm256_load_ps(lanes[0]), _mm256_load_ps(lanes[1]), bias_gate ? lanes[2] : nullptr,
                                    bias_up ? lanes[3] : nullptr));
    std::memcpy(gr + c_vec, lanes[0], tail * sizeof(float));
  }
}

#undef EXPERTD_AVX2

}  // namespace expertd::glu
