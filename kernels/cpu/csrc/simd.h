// Element loads shared by the expertd CPU custom calls: fp32, bf16 (as its raw uint16 bits) and
// int8 (INT8 expert weights, the integer as fp32, exact), scalar and 8 at a time (AVX2), and the
// instruction-set level the kernels run at (CpuIsa).
#pragma once

#include <immintrin.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>

namespace expertd {

// What the kernels may use, each level including the ones below it:
// - kAvx2: AVX2 + FMA (the fallback vector paths);
// - kAvx512: AVX-512 F + BW (panel-major weights stream 16 columns of a panel row per zmm);
// - kAvx512Bf16: AVX512_BF16 too, and its dot product rounds as two FMAs in order (Bf16DotIsFma),
//   so bf16 x bf16 products can run on it with the results of the FMA paths;
// - kAmxBf16: AMX-BF16 tiles too, for experts of kAmxMinRows rows or more, where TDPBF16PS rounds
//   as the FMAs do in k order (amx_tiles.h).
enum class Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline uint32_t FloatBits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return bits;
}

// x's row of K floats as ceil(K / 2) bf16 pair dwords, the bf16 dot products' operand layout
// (out[j] = x[2j] high, x[2j + 1] low; a zero low half past K). Returns the bits the bf16s dropped
// (0: every value was exact in bf16).
inline uint32_t PackPairRow(const float* x, int64_t k_dim, uint32_t* out) {
  uint32_t inexact = 0;
  for (int64_t j = 0; j < k_dim / 2; ++j) {
    const uint32_t first = FloatBits(x[2 * j]), second = FloatBits(x[2 * j + 1]);
    inexact |= (first | second) & 0xFFFFu;
    out[j] = (first & 0xFFFF0000u) | (second >> 16);
  }
  if (k_dim % 2) {
    const uint32_t last = FloatBits(x[k_dim - 1]);
    inexact |= last & 0xFFFFu;
    out[k_dim / 2] = last & 0xFFFF0000u;
  }
  return inexact;
}

// One accumulation of a bf16 pair product, acc + x . w, whose two roundings in one order differ
// from the other order's and from one rounding of the sum (cancellation, a dominant accumulator,
// products of mixed magnitude): how the dot products' rounding is checked on this CPU (vdpbf16ps
// here, TDPBF16PS in amx_tiles.h). Pairs hold the earlier k in the high half.
struct Bf16RoundingCase {
  uint32_t x_pair, w_pair;
  float acc;
  static float High(uint32_t pair) { return Bf16ToFloat(static_cast<uint16_t>(pair >> 16)); }
  static float Low(uint32_t pair) { return Bf16ToFloat(static_cast<uint16_t>(pair & 0xFFFFu)); }
  // acc' = fma(lo_x, lo_w, fma(hi_x, hi_w, acc)): k in order, as every FMA path sums.
  float HighFirst() const {
    return __builtin_fmaf(Low(x_pair), Low(w_pair), __builtin_fmaf(High(x_pair), High(w_pair), acc));
  }
  float LowFirst() const {
    return __builtin_fmaf(High(x_pair), High(w_pair), __builtin_fmaf(Low(x_pair), Low(w_pair), acc));
  }
};

inline const std::array<Bf16RoundingCase, 7>& Bf16RoundingCases() {
  static const std::array<Bf16RoundingCase, 7> cases = [] {
    const float table[7][5] = {  // hi_x, hi_w, lo_x, lo_w (each truncated to bf16), acc
        {1.0f, 1.0f, 1.0f, 0x1p-24f, 0x1p-24f},   {3.0f, 0x1p-10f, -3.0f, 0x1p-10f, 1.0f},
        {1.5f, 1.5f, -1.5f, 1.5f, 0x1.000002p0f}, {255.0f, 255.0f, -1.0f, 65025.0f, 0.3f},
        {0.1f, 0.2f, 0.3f, 0.4f, 1e7f},           {-7.0f, 0x1p-20f, 5.0f, 0x1p-21f, 0x1.fffffep-1f},
        {1.0078125f, 1.0078125f, -1.0f, 1.015625f, 0x1p-30f},
    };
    auto pair = [](float hi, float lo) { return (FloatBits(hi) & 0xFFFF0000u) | FloatBits(lo) >> 16; };
    std::array<Bf16RoundingCase, 7> out{};
    for (int i = 0; i < 7; ++i) out[i] = {pair(table[i][0], table[i][2]), pair(table[i][1], table[i][3]), table[i][4]};
    return out;
  }();
  return cases;
}

// vdpbf16ps adds the products of a dword's two bf16 halves to an fp32 lane; on the CPUs this was
// checked on it adds the high half's product first, then the low half's, each rounded as an FMA
// rounds (Bf16RoundingCase::HighFirst). The kernels rely on exactly that (weights and x laid out
// so that the high half holds the earlier k), so it is checked once on this CPU; a CPU that
// rounds otherwise keeps the FMA paths.
__attribute__((target("avx512f,avx512bf16,avx512vl,fma"))) inline bool Bf16DotIsFma() {
  for (const Bf16RoundingCase& c : Bf16RoundingCases()) {
    const __m128 got = _mm_dpbf16_ps(_mm_set1_ps(c.acc), (__m128bh)_mm_set1_epi32(static_cast<int>(c.x_pair)),
                                     (__m128bh)_mm_set1_epi32(static_cast<int>(c.w_pair)));
    if (FloatBits(_mm_cvtss_f32(got)) != FloatBits(c.HighFirst())) return false;
  }
  return true;
}

// Whether the AMX path may run on this CPU: AMX-BF16 present and permitted, and its TDPBF16PS adds
// in k order (amx_tiles.h HardwareOrder; defined in library.cc, probed once per process).
bool AmxBf16Ready();

inline Isa DetectIsa() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return Isa::kPortable;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")) return Isa::kAvx2;
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vl") || !Bf16DotIsFma()) {
    return Isa::kAvx512;  // (the check runs the 128-bit form, which needs AVX512VL)
  }
  return AmxBf16Ready() ? Isa::kAmxBf16 : Isa::kAvx512Bf16;
}

// The process-wide cap on the level, set once when the library is loaded
// (expertd_native_cpu_cap_isa, from the loader's `isa_cap` option: how a deployment pins a level).
inline std::atomic<int>& IsaCap() {
  static std::atomic<int> cap{static_cast<int>(Isa::kAmxBf16)};
  return cap;
}

// The level this CPU runs (detected once per process), capped by IsaCap().
inline Isa DetectedIsa() {
  static const Isa detected = DetectIsa();
  const int cap = IsaCap().load(std::memory_order_relaxed);
  return static_cast<int>(detected) < cap ? detected : static_cast<Isa>(cap);
}

// A further cap set at run time between calls (expertd_native_cpu_limit_isa: how the tests and the
// benchmarks run every level in one process).
inline std::atomic<int>& IsaLimit() {
  static std::atomic<int> limit{static_cast<int>(Isa::kAmxBf16)};
  return limit;
}

// The level the kernels run at now.
inline Isa CpuIsa() {
  const int limit = IsaLimit().load(std::memory_order_relaxed);
  return static_cast<int>(DetectedIsa()) < limit ? DetectedIsa() : static_cast<Isa>(limit);
}

inline bool HasAvx2() { return CpuIsa() >= Isa::kAvx2; }

inline float Load(const float* w, int64_t i) { return w[i]; }
inline float Load(const uint16_t* w, int64_t i) { return Bf16ToFloat(w[i]); }
inline float Load(const int8_t* w, int64_t i) { return static_cast<float>(w[i]); }

__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* w) {
  return _mm256_loadu_ps(w);
}

__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* w) {
  // bf16 is the top half of an fp32: zero-extend to 32 bits and shift into place.
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

__attribute__((target("avx2,fma"))) inline __m256 Load8(const int8_t* w) {
  // int8 sign-extended to int32, then converted (exact: |q| <= 128).
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

}  // namespace expertd
