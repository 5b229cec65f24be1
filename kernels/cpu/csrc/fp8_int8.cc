// FP8 expert weights converted to INT8 panels at load, without a dense copy in between: one
// expert's block-scaled e4m3 codes, as a checkpoint stores them ([out, in]: a row per output
// column), become the int8 panels and per-column scales the grouped matmul reads (../int8.py,
// panel_layout.h's fp32 panel layout with int8 elements). Not a custom call: a plain C entry point
// for ctypes (../int8.py fp8_to_int8_panels), which releases the GIL for the call.
//
// The arithmetic is ../int8.py's quantisation of the exactly dequantised weights, in fp32:
//   w[k, c]  = e4m3(code[c, k]) * block_scale[k / b, c / b]          (one rounding)
//   scale[c] = max_k |w[k, c]| * fp32(1 / 127)                         (one rounding)
//   q[k, c]  = clip(round_half_even(w[k, c] / scale[c]), -127, 127), 0 where scale[c] is 0
// so the result equals int8.quantize_reference(dequantised fp32 weights) bit for bit. The column
// maximum is found on the codes' magnitude bits (e4m3fn magnitudes order as their bits, and a
// product with a positive scale keeps that order), a byte maximum per block. The AVX2 path (with
// F16C) decodes 16 codes at a time exactly through fp16 (Decode16) and writes the panels through
// 16 x 16 byte transposes; the portable path is the same arithmetic per element.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace expertd {
namespace {

constexpr int kQmax = 127;
const float kInvQmax = static_cast<float>(1.0 / kQmax);  // numpy's np.float32(1.0 / 127)
constexpr uint8_t kNanMagnitude = 0x7f;                  // e4m3fn: S.1111.111 is NaN, no infinities

// The e4m3fn value of code (exact in fp32), NaN for the two NaN codes.
float DecodeE4m3Slow(uint8_t code) {
  const int magnitude = code & 0x7f, exponent = magnitude >> 3, mantissa = magnitude & 7;
  if (magnitude == kNanMagnitude) return std::nanf("");
  const float value = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                    : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return code & 0x80 ? -value : value;
}

struct E4m3Table {
  float value[256];
  E4m3Table() {
    for (int code = 0; code < 256; ++code) value[code] = DecodeE4m3Slow(static_cast<uint8_t>(code));
  }
};

float DecodeE4m3(uint8_t code) {
  static const E4m3Table table;  // built once, thread-safe
  return table.value[code];
}

int8_t Quantize(float w, float scale) {
  if (scale == 0.0f) return 0;
  const float q = std::nearbyint(w / scale);  // the default rounding mode: to nearest, ties to even
  if (std::isnan(q)) return 0;                // a NaN code's (the caller counts them)
  return static_cast<int8_t>(std::min(std::max(q, -static_cast<float>(kQmax)), static_cast<float>(kQmax)));
}

// The arguments of one conversion (see the entry point).
struct Fp8Expert {
  const uint8_t* codes;  // [c_dim][k_dim], rows code_stride bytes apart
  int64_t c_dim, k_dim, code_stride;
  const float* block_scales;  // [ceil(k_dim / block)][ceil(c_dim / block)]
  int64_t block, panel_cols;
  int8_t* panels;     // [ceil(c_dim / panel_cols)][k_dim][panel_cols]
  float* col_scales;  // [c_dim]

  const uint8_t* Row(int64_t c) const { return codes + c * code_stride; }
  float BlockScale(int64_t k, int64_t c) const {
    return block_scales[(k / block) * ((c_dim + block - 1) / block) + c / block];
  }
  int8_t* PanelRow(int64_t c, int64_t k) const {  // panel c / W, weight row k, column c % W
    return panels + ((c / panel_cols) * k_dim + k) * panel_cols + c % panel_cols;
  }
};

// The largest magnitude bits of codes [begin, end) of a row.
uint8_t MaxMagnitude(const uint8_t* row, int64_t begin, int64_t end) {
  uint8_t most = 0;
  for (int64_t k = begin; k < end; ++k) most = std::max<uint8_t>(most, row[k] & 0x7f);
  return most;
}

__attribute__((target("avx2"))) uint8_t MaxMagnitudeAvx2(const uint8_t* row, int64_t begin, int64_t end) {
  const __m256i magnitude_bits = _mm256_set1_epi8(0x7f);
  __m256i most = _mm256_setzero_si256();
  int64_t k = begin;
  for (; k + 32 <= end; k += 32) {
    const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
    most = _mm256_max_epu8(most, _mm256_and_si256(codes, magnitude_bits));
  }
  __m128i half = _mm_max_epu8(_mm256_castsi256_si128(most), _mm256_extracti128_si256(most, 1));
  half = _mm_max_epu8(half, _mm_srli_si128(half, 8));
  half = _mm_max_epu8(half, _mm_srli_si128(half, 4));
  half = _mm_max_epu8(half, _mm_srli_si128(half, 2));
  half = _mm_max_epu8(half, _mm_srli_si128(half, 1));
  return std::max(MaxMagnitude(row, k, end), static_cast<uint8_t>(_mm_cvtsi128_si32(half) & 0xff));
}

// Column c's scale (max_k |w| / 127) and its count of NaN codes; `avx2` picks the byte maximum.
template <bool kAvx2>
float ColumnScale(const Fp8Expert& x, int64_t c, int64_t* nans) {
  const uint8_t* row = x.Row(c);
  float most = 0.0f;
  for (int64_t k0 = 0; k0 < x.k_dim; k0 += x.block) {
    const int64_t k1 = std::min(x.k_dim, k0 + x.block);
    const uint8_t bits = kAvx2 ? MaxMagnitudeAvx2(row, k0, k1) : MaxMagnitude(row, k0, k1);
    if (bits == kNanMagnitude) {
      for (int64_t k = k0; k < k1; ++k) *nans += (row[k] & 0x7f) == kNanMagnitude;
      continue;
    }
    most = std::max(most, std::fabs(DecodeE4m3(bits) * x.BlockScale(k0, c)));
  }
  return most * kInvQmax;
}

// The portable path: every element as Quantize(DecodeE4m3(code) * block scale, column scale).
int64_t ConvertScalar(const Fp8Expert& x) {
  int64_t nans = 0;
  for (int64_t c = 0; c < x.c_dim; ++c) {
    const float scale = x.col_scales[c] = ColumnScale<false>(x, c, &nans);
    const uint8_t* row = x.Row(c);
    for (int64_t k = 0; k < x.k_dim; ++k) *x.PanelRow(c, k) = Quantize(DecodeE4m3(row[k]) * x.BlockScale(k, c), scale);
  }
  return nans;
}

// 16 codes -> their e4m3fn values / 256, exactly, as two vectors of 8: the magnitude bits shifted
// into an fp16's exponent and mantissa (fp16's exponent bias is 8 above e4m3's, and its subnormals
// hold e4m3's), widened by F16C. NaN codes decode to a finite value here; the caller counts them.
__attribute__((target("avx2,f16c"), always_inline)) inline void Decode16(__m128i codes16, __m256& lo, __m256& hi) {
  const __m256i codes = _mm256_cvtepu8_epi16(codes16);
  const __m256i halves = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x7f)), 7),
                                         _mm256_slli_epi16(_mm256_and_si256(codes, _mm256_set1_epi16(0x80)), 8));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
}

// q of 8 weights w = value * block_scale (value / 256 times block_scale * 256: the same product,
// the factor a power of two), as Quantize does, as int32 lanes. No clip: |w| <= max_k |w| makes
// |w / scale| at most 127 (1 + 2^-23), and the caller's packs saturate.
__attribute__((target("avx2"), always_inline)) inline __m256i Quantize8(__m256 value_256th, __m256 block_scale_x256,
                                                                         __m256 scale) {
  const __m256 w = _mm256_mul_ps(value_256th, block_scale_x256);
  return _mm256_cvtps_epi32(_mm256_round_ps(_mm256_div_ps(w, scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 16 codes of one row (one block scale, times 256) -> 16 int8 in order.
__attribute__((target("avx2,f16c"), always_inline)) inline __m128i Quantize16(const uint8_t* codes,
                                                                               __m256 block_scale_x256, __m256 scale) {
  __m256 lo, hi;
  Decode16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)), lo, hi);
  // packs work per 128-bit lane: [lo0-3, hi0-3, lo4-7, hi4-7] -> reorder the 64-bit quarters.
  const __m256i words = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(Quantize8(lo, block_scale_x256, scale), Quantize8(hi, block_scale_x256, scale)), 0xd8);
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}

// out row i (16 bytes, rows out_stride apart) = byte i of each of in[0..16).
__attribute__((target("avx2"))) inline void Transpose16x16(const __m128i (&in)[16], int8_t* out, int64_t out_stride) {
  __m128i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm_unpacklo_epi8(in[2 * i], in[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi8(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      b[4 * i + 2 * j] = _mm_unpacklo_epi16(a[4 * i + j], a[4 * i + j + 2]);
      b[4 * i + 2 * j + 1] = _mm_unpackhi_epi16(a[4 * i + j], a[4 * i + j + 2]);
    }
  }
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 4; ++j) {
      a[8 * i + 2 * j] = _mm_unpacklo_epi32(b[8 * i + j], b[8 * i + j + 4]);
      a[8 * i + 2 * j + 1] = _mm_unpackhi_epi32(b[8 * i + j], b[8 * i + j + 4]);
    }
  }
  for (int j = 0; j < 8; ++j) {
    b[2 * j] = _mm_unpacklo_epi64(a[j], a[j + 8]);
    b[2 * j + 1] = _mm_unpackhi_epi64(a[j], a[j + 8]);
  }
  for (int i = 0; i < 16; ++i) _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i * out_stride), b[i]);
}

// The AVX2 path: groups of 16 columns (a strip of a panel), the scales first, then every 16 weight
// rows as one 16 x 16 transpose; columns past c_dim are zero, as are the panels' padding columns.
__attribute__((target("avx2,f16c"))) int64_t ConvertAvx2(const Fp8Expert& x) {
  int64_t nans = 0;
  for (int64_t c0 = 0; c0 < x.c_dim; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, x.c_dim - c0);
    float scales[16] = {};
    for (int64_t j = 0; j < n; ++j) scales[j] = x.col_scales[c0 + j] = ColumnScale<true>(x, c0 + j, &nans);
    const bool full = n == 16 && std::all_of(scales, scales + 16, [](float s) { return s != 0.0f; });
    // Per block of k: the 16 columns' block scales once, then its rows 16 at a time (blocks that
    // do not divide into 16s, and a k tail of under 16 rows, element by element).
    const int64_t scale_cols = (x.c_dim + x.block - 1) / x.block;
    int8_t* panel = x.PanelRow(c0, 0);
    for (int64_t k0 = 0; k0 < x.k_dim; k0 += x.block) {
      const int64_t k1 = std::min(x.k_dim, k0 + x.block);
      const float* block_row = x.block_scales + (k0 / x.block) * scale_cols;
      float block_scale[16] = {};
      __m256 block_scale_x256[16], scale[16];
      bool vector_rows = x.block % 16 == 0;  // and every scale x 256 exact (normal, finite)
      for (int64_t j = 0; j < 16; ++j) {
        block_scale[j] = j < n ? block_row[(c0 + j) / x.block] : 0.0f;
        const float x256 = block_scale[j] * 256.0f;
        vector_rows &= j >= n || block_scale[j] == 0.0f ||
                       (std::isnormal(block_scale[j]) && std::isfinite(x256));
        block_scale_x256[j] = _mm256_set1_ps(x256);
        scale[j] = _mm256_set1_ps(scales[j]);
      }
      int64_t k = k0;
      for (; vector_rows && full && k + 16 <= k1; k += 16) {  // 16 columns with scales: no branches
        __m128i rows[16];
#pragma GCC unroll 16
        for (int64_t j = 0; j < 16; ++j) rows[j] = Quantize16(x.Row(c0 + j) + k, block_scale_x256[j], scale[j]);
        Transpose16x16(rows, panel + k * x.panel_cols, x.panel_cols);
      }
      for (; vector_rows && k + 16 <= k1; k += 16) {
        __m128i rows[16];
        for (int64_t j = 0; j < 16; ++j) {
          rows[j] = j < n && scales[j] != 0.0f ? Quantize16(x.Row(c0 + j) + k, block_scale_x256[j], scale[j])
                                               : _mm_setzero_si128();
        }
        Transpose16x16(rows, panel + k * x.panel_cols, x.panel_cols);
      }
      for (; k < k1; ++k) {
        int8_t* out = panel + k * x.panel_cols;
        for (int64_t j = 0; j < 16; ++j) {
          out[j] = j < n ? Quantize(DecodeE4m3(x.Row(c0 + j)[k]) * block_scale[j], scales[j]) : 0;
        }
      }
    }
  }
  return nans;
}

}  // namespace
}  // namespace expertd

// One expert's block-scaled e4m3 codes -> int8 panels and per-column scales (the file comment's
// arithmetic). codes [c_dim][k_dim] (rows code_stride >= k_dim bytes apart: a stored [out, in]
// weight), block_scales fp32 [ceil(k_dim / block)][ceil(c_dim / block)] (w = code * scale),
// panels int8 [ceil(c_dim / panel_cols)][k_dim][panel_cols] (every byte written, padding columns
// 0), col_scales fp32 [c_dim]. The AVX2 path where the kernels run AVX2 or above (CpuIsa, under the
// cap and `diagnostics.limit_isa`) and the CPU has F16C, else the portable one: the same bits.
// Returns the number of NaN codes (their columns' scales leave them out, their q is meaningless),
// or -1 for arguments out of range (sizes below 1, a stride below k_dim, a panel width not 16 / 64).
extern "C" int64_t expertd_fp8_to_int8_panels(const uint8_t* codes, int64_t c_dim, int64_t k_dim,
                                              int64_t code_stride, const float* block_scales, int64_t block,
                                              int64_t panel_cols, int8_t* panels, float* col_scales) {
  if (c_dim < 1 || k_dim < 1 || code_stride < k_dim || block < 1 || (panel_cols != 16 && panel_cols != 64)) return -1;
  const expertd::Fp8Expert x{codes, c_dim, k_dim, code_stride, block_scales, block, panel_cols, panels, col_scales};
  const int64_t padded = (c_dim + panel_cols - 1) / panel_cols * panel_cols;
  if (padded > c_dim) {  // the last panel's columns past c_dim
    for (int64_t k = 0; k < k_dim; ++k) std::memset(x.PanelRow(c_dim, k), 0, padded - c_dim);
  }
  static const bool f16c = __builtin_cpu_supports("f16c");
  return expertd::HasAvx2() && f16c ? expertd::ConvertAvx2(x) : expertd::ConvertScalar(x);
}
