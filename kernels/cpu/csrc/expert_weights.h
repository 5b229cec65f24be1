// One expert's weights as the grouped matmul's portable and AVX2 paths read them (ExpertWeights:
// row-major, the checkpoint's layout, or panel-major, panel_layout.h), the portable loop over them
// (BlockScalar: CPUs without AVX2 / FMA, and the column tail of the AVX2 paths), and the AVX2
// widening of a bf16 pair row that the streaming (stream_avx2.h) and packed (packed_avx2.h) paths
// share. Included by grouped_matmul_cpu.cc alone.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "panel_layout.h"
#include "simd.h"

namespace expertd::gmm {
// Internal linkage, as when this lived in grouped_matmul_cpu.cc, the one file that includes it:
// the compiler inlines and lays out these functions as it did then, and the library exports no
// copies of them.
namespace {

// Columns of a strip of panel-major weights (panel_layout.h), of the AVX2 paths' column chunks and
// of the packed path's panels.
constexpr int64_t kStripCols = expertd::kStripColumns;

// One expert's weights [K, C] as they lie in memory: row-major (the checkpoint's layout) or
// panel-major (panel_cols = 16 or 64: fp32 [P, K, W], bf16 pair rows [P, ceil(K/2), 2 W];
// panel_layout.h).
template <typename W>
struct ExpertWeights {
  static constexpr bool kBf16 = sizeof(W) == 2;
  const W* w;  // the expert's first weight
  int64_t k_dim, c_dim;
  int64_t panel_cols;  // 0: row-major

  bool Panels() const { return panel_cols > 0; }
  int64_t PanelElems() const { return expertd::PanelElements(k_dim, kBf16, panel_cols); }
  int64_t Elems() const { return Panels() ? (c_dim + panel_cols - 1) / panel_cols * PanelElems() : k_dim * c_dim; }
  float At(int64_t k, int64_t c) const {
    if (!Panels()) return Load(w, k * c_dim + c);
    const W* panel = w + c / panel_cols * PanelElems();
    const int64_t col = c % panel_cols;
    return kBf16 ? Load(panel, k / 2 * 2 * panel_cols + 2 * col + 1 - k % 2) : Load(panel, k * panel_cols + col);
  }
  // Strip p (columns 16p..16p+15) from weight row k0 (even for bf16) on: 16 fp32 weights per row,
  // 32 bf16 per pair row, panel_cols elements per weight row apart.
  const W* Strip(int64_t p, int64_t k0) const {
    return w + expertd::StripOffset(p, PanelElems(), kBf16, panel_cols) + k0 * panel_cols;
  }
};

// Portable path: any CPU, and the column tail past the last full 16-column chunk.
// `x` is a table of row pointers (each K floats) throughout: row r of an item is x[r].
// One rounding per product-add (std::fma: glibc's runs the FMA instruction where there is one), as
// the vector paths round, so a column's result does not depend on which path computed it.
template <typename W>
void BlockScalar(const float* const* x, int64_t rows, const ExpertWeights<W>& w, int64_t c0, int64_t c1,
                 float* y) {
  const int64_t c_dim = w.c_dim;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; ++c) y[r * c_dim + c] = 0.0f;
    for (int64_t k = 0; k < w.k_dim; ++k) {
      const float xv = x[r][k];
      for (int64_t c = c0; c < c1; ++c) y[r * c_dim + c] = std::fma(xv, w.At(k, c), y[r * c_dim + c]);
    }
  }
}

// 8 columns of a bf16 pair row (at `line`) as fp32: its first weight row (the dwords' high halves,
// w[2j]) and its second (the low halves, w[2j + 1]).
__attribute__((target("avx2,fma"), always_inline)) inline __m256 WidenFirst8(const uint16_t* line) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  return _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
__attribute__((target("avx2,fma"), always_inline)) inline __m256 WidenSecond8(const uint16_t* line) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)), 16));
}

// Weight rows per step of a panel stream: one fp32 row, or one bf16 pair row (two rows).
template <typename W>
constexpr int64_t kPanelStep = sizeof(W) == 2 ? 2 : 1;

}  // namespace
}  // namespace expertd::gmm
