// Panel-major expert weights as the kernels address them (kernels/cpu/panels.py makes them once at
// load).
//
// An expert's [K, C] matrix is held as P = ceil(C / W) panels of W columns (W = 16 or 64, the
// panel width; columns past C are zero), one after another:
//   fp32: panel [K][W]:             w[k][c] at panel c / W, element k * W + c % W;
//   bf16: panel [ceil(K / 2)][2 W]: pair row j holds rows 2j and 2j + 1: w[k][c] at panel c / W,
//         element (k / 2) * 2 W + 2 (c % W) + 1 - k % 2 (dword c % W of the pair row holds w[2j][c]
//         in its high half and w[2j + 1][c] in its low half; K odd: the last low halves are zero).
// The kernels' blocks cover strips of 16 columns (one zmm, two ymm): strip q is the 64-byte piece
// of every (pair) row at column 16 q. With W = 64, a block of a panel's 4 strips reads one
// sequential stream of 256-byte rows instead of 4 streams 16-64 KB apart. AVX2 blocks cover at most
// 4 rows x 1 strip or 1 row x 4 strips (16 ymm registers), so they would read a 64-column panel in
// up to 4 strided passes; the rule (kernels/cpu/panels.py panel_columns): W = 64 where the kernels
// run AVX-512, 16 elsewhere (BENCHMARKS.md "Weight layout on CPU" has the measurements).
#pragma once

#include <cstdint>

namespace expertd {

constexpr int64_t kStripColumns = 16;  // columns per strip (a block's unit)

// Whether `panel_cols` is a panel width the kernels take.
inline bool IsPanelWidth(int64_t panel_cols) { return panel_cols == 16 || panel_cols == 64; }

// Elements of one panel: [K][W] fp32, [ceil(K / 2)][2 W] bf16.
inline int64_t PanelElements(int64_t k_dim, bool bf16, int64_t panel_cols) {
  return bf16 ? (k_dim + 1) / 2 * 2 * panel_cols : k_dim * panel_cols;
}

// Offset of strip q's first element (weight row 0) from the expert's first weight. Its weight row
// k (k even for bf16: pair row k / 2) is panel_cols * k elements further on.
inline int64_t StripOffset(int64_t q, int64_t panel_elems, bool bf16, int64_t panel_cols) {
  const int64_t strips_per_panel = panel_cols / kStripColumns;
  return q / strips_per_panel * panel_elems + q % strips_per_panel * kStripColumns * (bf16 ? 2 : 1);
}

}  // namespace expertd
