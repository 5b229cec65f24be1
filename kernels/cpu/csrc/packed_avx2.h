// The grouped matmul's packed path on AVX2 CPUs (many rows per expert: compute-bound): a GEMM
// blocked in the BLIS manner, the weights widened into fp32 panels of 16 columns and the x rows
// copied into panels of 6 per block of kPackK weight rows, and a 6 x 16 register micro-kernel over
// the pairs. Sums k in order with one rounding per product-add, as every path does. Included by
// grouped_matmul_cpu.cc alone.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "expert_weights.h"
#include "simd.h"

namespace expertd::gmm {
// Internal linkage, as when this lived in grouped_matmul_cpu.cc, the one file that includes it:
// the compiler inlines and lays out these functions as it did then, and the library exports no
// copies of them.
namespace {

// Packed path, for items with many rows (compute-bound; see kPackedMinRows). GEMM blocking in the
// BLIS manner: per block of kPackK weight rows, the item's weights are widened once into fp32
// panels of 16 columns ([panel][k][16], read from w row by row) and its x rows are copied into
// panels of 6 ([panel][k][6], zero-padded); a 6 x 16 micro-kernel (12 accumulators, both operands
// contiguous) runs over the pairs, each weight panel (kPackK x 16 fp32 = 16 KB) staying in L1
// across up to kPackRowsL2 rows (their x panels, 120 KB, in L2).
constexpr int kPanelRows = 6;
constexpr int64_t kPackK = 256;
constexpr int64_t kPackRowsL2 = 120;  // a multiple of kPanelRows
// Rule: from kPackedMinRows rows per expert the packed path, below it the streaming one: the
// packed GEMM is compute-bound and wins from 32 rows on, the streaming path below (BENCHMARKS.md).
constexpr int64_t kPackedMinRows = 32;

// y[r, 0:16] (+)= sum_k a[k][r] * b[k][0:16] for the first kRows of a 6-row x panel, b's rows
// `b_stride` floats apart (16 packed, the panel width for a strip read in place); `accumulate`
// continues from y (later k blocks), else starts from zero. The sums start from the y tile, so k is
// summed in order across the k blocks as on every other path (one result whatever the path). The next
// tile's `next_rows` rows from `y_next` are prefetched for its own start.
template <int kRows>
__attribute__((target("avx2,fma"), always_inline)) inline void MicroKernel(const float* a,
                                                                            const float* b,
                                                                            int64_t b_stride, int64_t kc, float* y,
                                                                            int64_t c_dim,
                                                                            bool accumulate, const float* y_next,
                                                                            int64_t next_rows) {
  for (int64_t r = 0; r < next_rows; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(y_next + r * c_dim), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(y_next + r * c_dim + 15), _MM_HINT_T0);
  }
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = accumulate ? _mm256_loadu_ps(y + r * c_dim) : _mm256_setzero_ps();
    acc[r][1] = accumulate ? _mm256_loadu_ps(y + r * c_dim + 8) : _mm256_setzero_ps();
  }
  // Unrolled 4x, so that the loop's own add / compare / branch do not cost FMA slots (2x and 8x
  // did the same as 4x; BENCHMARKS.md).
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k, a += kPanelRows, b += b_stride) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int r = 0; r < kRows; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + r);
      acc[r][0] = _mm256_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(y + r * c_dim, acc[r][0]);
    _mm256_storeu_ps(y + r * c_dim + 8, acc[r][1]);
  }
}

// Strip p of panel-major weights over weight rows [k0, k0 + kc) (k0 even) widened to fp32 into out
// ([k][16]).
template <typename W>
__attribute__((target("avx2,fma"))) void WidenPanel(const ExpertWeights<W>& w, int64_t p, int64_t k0,
                                                    int64_t kc, float* out) {
  const W* strip = w.Strip(p, k0);
  const int64_t row = w.panel_cols;
  if constexpr (sizeof(W) != 2) {  // fp32, int8: one weight row
    for (int64_t k = 0; k < kc; ++k) {
      for (int v = 0; v < 2; ++v) _mm256_storeu_ps(out + k * kStripCols + 8 * v, Load8(strip + k * row + 8 * v));
    }
  } else {
    for (int64_t k = 0; k < kc; k += 2) {  // one pair row: weight rows k and k + 1
      for (int v = 0; v < 2; ++v) {
        _mm256_storeu_ps(out + k * kStripCols + 8 * v, WidenFirst8(strip + k * row + 16 * v));
        if (k + 1 < kc) _mm256_storeu_ps(out + (k + 1) * kStripCols + 8 * v, WidenSecond8(strip + k * row + 16 * v));
      }
    }
  }
}

// The item's `panels` panels from column c0 over weight rows [k0, k0 + kc), widened to fp32 into
// `packed` ([panel][k][16]).
template <typename W>
__attribute__((target("avx2,fma"))) void PackWeights(const ExpertWeights<W>& w, int64_t k0, int64_t kc,
                                                     int64_t c0, int64_t panels, float* packed) {
  if (w.Panels()) {  // a copy per strip
    for (int64_t p = 0; p < panels; ++p) WidenPanel(w, c0 / kStripCols + p, k0, kc, packed + p * kc * kStripCols);
    return;
  }
  const int64_t c_dim = w.c_dim;
  for (int64_t k = 0; k < kc; ++k) {
    const W* row = w.w + (k0 + k) * c_dim + c0;
    float* out = packed + k * kStripCols;
    for (int64_t p = 0; p < panels; ++p, row += kStripCols, out += kc * kStripCols) {
      _mm256_storeu_ps(out, Load8(row));
      _mm256_storeu_ps(out + 8, Load8(row + 8));
    }
  }
}

inline void PackRows(const float* const* x, int64_t rows, int64_t k0, int64_t kc, float* packed) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPanelRows, packed += kc * kPanelRows) {
    for (int r = 0; r < kPanelRows; ++r) {
      if (r0 + r >= rows) {
        for (int64_t k = 0; k < kc; ++k) packed[k * kPanelRows + r] = 0.0f;
        continue;
      }
      const float* xr = x[r0 + r] + k0;
      for (int64_t k = 0; k < kc; ++k) packed[k * kPanelRows + r] = xr[k];
    }
  }
}

// The fp32 16-column panel p (of the item's, from column c0) over weight rows [k0, k0 + kc), and
// the floats from one of its rows to the next: packed for the whole k block beforehand
// (`packed_block`: row-major weights, and panel-major ones for items of more than one row chunk,
// which reuse it); else a panel-major fp32 strip read in place, bf16 widened into `packed` (16 KB,
// stays in L1 for the panel's micro-tiles).
struct PackedB {
  const float* b;
  int64_t stride;
};
template <typename W>
__attribute__((target("avx2,fma"))) PackedB PackedPanel(const ExpertWeights<W>& w, bool packed_block,
                                                        int64_t c0, int64_t p, int64_t k0, int64_t kc,
                                                        float* packed) {
  if (packed_block) return {packed + p * kc * kStripCols, kStripCols};
  if constexpr (std::is_same_v<W, float>) {
    return {w.Strip(c0 / kStripCols + p, k0), w.panel_cols};
  } else {
    WidenPanel(w, c0 / kStripCols + p, k0, kc, packed);
    return {packed, kStripCols};
  }
}

// Columns [c0, c1) (a multiple of 16 wide) of y = x @ w for `rows` rows.
template <typename W>
__attribute__((target("avx2,fma"))) void BlockPacked(const float* const* x, int64_t rows,
                                                     const ExpertWeights<W>& w, int64_t c0,
                                                     int64_t c1, float* y) {
  // Per thread, reused across calls: at most kPackK x kBlockColumns + kPackK x kPackRowsL2 floats
  // (2 MB + 120 KB), however many rows an expert gets.
  thread_local std::vector<float> packed_w_buffer, packed_x_buffer;
  const int64_t k_dim = w.k_dim, c_dim = w.c_dim;
  if (k_dim == 0) {  // the k loop below would never write y
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * c_dim + c0, y + r * c_dim + c1, 0.0f);
    return;
  }
  const int64_t panels = (c1 - c0) / kStripCols;
  const bool packed_block = !w.Panels() || rows > kPackRowsL2;
  packed_w_buffer.resize(kPackK * (packed_block ? c1 - c0 : kStripCols));
  packed_x_buffer.resize(kPackK * kPackRowsL2);
  float* const packed_w = packed_w_buffer.data();
  float* const packed_x = packed_x_buffer.data();
  for (int64_t k0 = 0; k0 < k_dim; k0 += kPackK) {
    const int64_t kc = std::min(kPackK, k_dim - k0);
    const bool accumulate = k0 > 0;
    if (packed_block) PackWeights(w, k0, kc, c0, panels, packed_w);
    for (int64_t i0 = 0; i0 < rows; i0 += kPackRowsL2) {
      const int64_t i1 = std::min(rows, i0 + kPackRowsL2);
      PackRows(x + i0, i1 - i0, k0, kc, packed_x);
      for (int64_t p = 0; p < panels; ++p) {
        const PackedB b = PackedPanel(w, packed_block, c0, p, k0, kc, packed_w);
        for (int64_t r0 = i0; r0 < i1; r0 += kPanelRows) {
          const float* a = packed_x + (r0 - i0) * kc;
          float* yt = y + r0 * c_dim + c0 + p * kStripCols;
          const float* yn = yt + kPanelRows * c_dim;  // the next tile (prefetched when it is read first)
          const int64_t next_rows = accumulate ? std::clamp<int64_t>(i1 - r0 - kPanelRows, 0, kPanelRows) : 0;
          switch (std::min<int64_t>(kPanelRows, rows - r0)) {
            case 6: MicroKernel<6>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
            case 5: MicroKernel<5>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
            case 4: MicroKernel<4>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
            case 3: MicroKernel<3>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
            case 2: MicroKernel<2>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
            default: MicroKernel<1>(a, b.b, b.stride, kc, yt, c_dim, accumulate, yn, next_rows); break;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace expertd::gmm
