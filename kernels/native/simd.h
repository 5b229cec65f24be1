// Element loads shared by the expertd CPU custom calls: fp32 and bf16 (as its raw uint16 bits),
// scalar and 8 at a time (AVX2), and the check that picks the AVX2 paths at run time.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace expertd {

// EXPERTD_NATIVE_CPU_PORTABLE=1 forces the portable loops (how the tests exercise them on AVX2 CPUs).
inline bool HasAvx2() {
  static const bool has = std::getenv("EXPERTD_NATIVE_CPU_PORTABLE") == nullptr &&
                          __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

inline float Bf16ToFloat(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float Load(const float* w, int64_t i) { return w[i]; }
inline float Load(const uint16_t* w, int64_t i) { return Bf16ToFloat(w[i]); }

__attribute__((target("avx2,fma"))) inline __m256 Load8(const float* w) {
  return _mm256_loadu_ps(w);
}

__attribute__((target("avx2,fma"))) inline __m256 Load8(const uint16_t* w) {
  // bf16 is the top half of an fp32: zero-extend to 32 bits and shift into place.
  __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

}  // namespace expertd
