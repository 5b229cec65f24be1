// Grouped matmul on CPU, as an XLA FFI custom call.
//
//   y[r, :] = x[r, :] @ w[e(r)]   for the rows r of expert e (expert-major, group_sizes[e] rows each)
//   x f32 [N, K], group_sizes s32 [E], w bf16 or f32 [E, K, C]  ->  y f32 [N, C]
//   rows past sum(group_sizes) -> 0; experts without rows are never read.
// The *Panels entry points take the weights panel-major instead (kernels/cpu/panels.py, made once
// at load by prepare_params), P = ceil(C / W) panels of W = 16 or 64 columns per expert (columns past C zero; W
// read from w's last dimension):
//   fp32: w [E, P, K, W], column c of expert e at w[e, c / W, k, c % W];
//   bf16: w [E, P, ceil(K / 2), 2 W] ("pair rows"): w[e, c / W, k / 2, 2 (c % W) + 1 - k % 2], i.e.
//         dword c of pair row j holds w[2j][c] in its high half and w[2j + 1][c] in its low half
//         (K odd: the last low halves are zero), which the AVX-512 path widens with an AND and a
//         shift and its bf16 dot product multiplies as it lies (panel_layout.h has the addressing;
//         every path reads 16-column strips of the panels).
// Every path sums k in order with one rounding per product-add (FMA; std::fma in the portable
// loop), so a row's result is the same bits whatever the layout, the path its expert's row count
// takes, the instruction set or the other rows of the call.
// ExpertdGroupedMatmulGathered reads its rows from token rows instead (the permutation's gather
// done in place, so the layer never writes the [N, K] permuted copy of x):
//   y[r, :] = x[source[r], :] @ w[e(r)]   x f32 [T, K], source s32 [N]; a source outside [0, T)
//   (a pad row) reads as zeros.
//
// Why it exists: XLA:CPU's small-M dots copy each expert's weight slice (and widen bf16 weights to
// fp32) into fresh buffers before multiplying, so a decode batch moves several times the weight
// bytes; here the weights are read in place, and many rows per expert run a packed GEMM
// (BENCHMARKS.md has the measurements).
//
// Work split: items of (expert, block of output columns), shared by the calling thread and helper
// tasks on XLA's intra-op thread pool (expertd::ParallelFor, parallel.h; a small call by the
// calling thread alone).
//
// Paths per item (Path; counted in path_items):
// - Panel-major weights on AVX-512 CPUs, every row count: avx512::StreamPanels
//   (panel_stream_avx512.h; bf16-valued rows times bf16 weights on the bf16 dot product where the
//   CPU has one that rounds as the FMAs do).
// - Otherwise, by the item's rows (kPackedMinRows):
//   - Streaming (few rows: memory-bound). The expert's weights are read once, in place, bf16
//     widened in registers. Panel-major weights: StreamPanels. Row-major, loop order: k in steps of
//     kRowsPerStep weight rows (kRowsPerStepOneBlock for items of up to 4 rows), row blocks of up
//     to 4, column chunks: the accumulators of a row block (8 ymm: 4 rows x 16 columns, 2 x 32 or
//     1 x 64 for bf16) stay in registers across the step, and the item's output block (rows x
//     kBlockColumns fp32) in L1/L2. The first row block of a step also prefetches the next step's
//     weight rows (PrefetchNextStep).
//   - Packed (many rows: compute-bound). BLIS-style blocking, see BlockPacked; panel-major weights
//     skip its per-call repacking up to kPackRowsL2 rows (PackedPanel).
// - CPUs without AVX2 / FMA: BlockScalar; on the others it computes the column tail past the last
//   16-column chunk of the AVX2 paths.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "panel_layout.h"
#include "panel_stream_avx512.h"
#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using expertd::HasAvx2;
using expertd::Load;
using expertd::Load8;

namespace {

// Streaming items: 2048 output columns x 16 weight rows per step, the fastest of the column blocks
// (512-4096) and steps (4-16 rows) compared with benchmarks/native_cpu_kernel.py (BENCHMARKS.md).
constexpr int64_t kBlockColumns = 2048;  // output columns per work item
constexpr int64_t kMinBlockColumns = 256;
// Streaming items on panel-major weights: a narrower block costs nothing (each strip is a stream
// of its own), and more items even out experts of unequal row counts across the threads, so they
// are split into up to kItemsPerThreadPanels items per thread. The packed path keeps wide blocks
// (narrow ones would repack x per block).
constexpr int64_t kItemsPerThreadPanels = 16;
constexpr int kRowsPerStep = 16;         // weight rows streamed at once; accumulators stay in registers
// Items of one row block (up to 4 rows) stream 8 weight rows per step instead: fewer concurrent
// streams, which suits few rows; more rows keep 16 (BENCHMARKS.md).
constexpr int kRowsPerStepOneBlock = 8;
constexpr int64_t kRowBlock = 4;

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

// The weights of the next step (its weight rows x the item's columns), prefetched a slice per
// column chunk while the current step runs, so they arrive one step ahead in memory order. Without
// it, rows of 1-2 KB (E=64, C=512) restart the hardware prefetcher's streams every step, and bf16's
// widening leaves too few loads in flight. Rule: on for bf16 weights, and for fp32 from 4 rows
// (fp32 with 1-3 rows already streams at the read rate, where the extra instructions only cost).
struct NextStep {
  const char* first;  // the next step's first weight row, at the item's first column
  int64_t rows;       // weight rows it has (0: this is the last step)
  int64_t row_bytes;  // c_dim * sizeof(W): from one weight row to the next
  int64_t span;       // the item's columns in bytes
};

// Prefetch bytes [begin, begin + size) of the next step, counted row by row over its span.
inline void PrefetchNextStep(const NextStep& next, int64_t begin, int64_t size) {
  int64_t row = begin / next.span, col = begin % next.span;
  for (int64_t b = 0; b < size && row < next.rows; b += 64) {
    _mm_prefetch(next.first + row * next.row_bytes + col, _MM_HINT_T0);
    if ((col += 64) >= next.span) col = 0, ++row;
  }
}

// y[r, c + j] += sum_{k in [k0, k0+kk)} x[r, k] * w[k, c + j] for kRows rows and the 8 * kVecs
// columns j at c; the kRows x kVecs accumulators (independent FMA chains) stay in registers.
template <int kRows, int kVecs, int kk, typename W>
__attribute__((target("avx2,fma"), always_inline)) inline void Chunk(const float* const* x,
                                                                      const ExpertWeights<W>& w,
                                                                      int64_t k0, int64_t c,
                                                                      float* y) {
  const int64_t c_dim = w.c_dim;
  __m256 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm256_loadu_ps(y + r * c_dim + c + 8 * v);
  }
  for (int k = 0; k < kk; ++k) {
    __m256 xv[kRows];
    for (int r = 0; r < kRows; ++r) xv[r] = _mm256_broadcast_ss(x[r] + k0 + k);
    for (int v = 0; v < kVecs; ++v) {
      const __m256 wv = Load8(w.w + (k0 + k) * c_dim + c + 8 * v);
      for (int r = 0; r < kRows; ++r) acc[r][v] = _mm256_fmadd_ps(xv[r], wv, acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVecs; ++v) _mm256_storeu_ps(y + r * c_dim + c + 8 * v, acc[r][v]);
  }
}

// Columns [c0, c1) (a multiple of 16 wide) in chunks of 8 * kVecs, then of 16 for what is left;
// with `next`, each chunk also prefetches its share of the next step.
template <int kRows, int kVecs, int kk, typename W>
__attribute__((target("avx2,fma"))) void Columns(const float* const* x, const ExpertWeights<W>& w,
                                                 int64_t k0, int64_t c0, int64_t c1, float* y,
                                                 const NextStep* next) {
  constexpr int64_t kShare = kk * 8 * kVecs * sizeof(W), kTailShare = kk * 16 * sizeof(W);
  int64_t c = c0, fetched = 0;
  for (; c + 8 * kVecs <= c1; c += 8 * kVecs, fetched += kShare) {
    if (next) PrefetchNextStep(*next, fetched, kShare);
    Chunk<kRows, kVecs, kk>(x, w, k0, c, y);
  }
  for (; c < c1; c += 16, fetched += kTailShare) {
    if (next) PrefetchNextStep(*next, fetched, kTailShare);
    Chunk<kRows, 2, kk>(x, w, k0, c, y);
  }
}

// One step (kk weight rows from k0) for all rows of the item. Rule: bf16 gives its 1- and 2-row
// blocks wider chunks (8 accumulators, as for 4 rows) and its 3-row blocks 32 columns (12
// accumulators instead of 6), where the widening leaves the FMAs room; fp32 keeps 16 columns, where
// wider chunks gained nothing (BENCHMARKS.md).
template <int kk, typename W>
__attribute__((target("avx2,fma"))) void RowBlocks(const float* const* x, int64_t rows,
                                                   const ExpertWeights<W>& w, int64_t k0,
                                                   int64_t c0, int64_t c1, float* y) {
  constexpr bool kBf16 = sizeof(W) == 2;
  const int64_t c_dim = w.c_dim;
  NextStep next_step{reinterpret_cast<const char*>(w.w + (k0 + kk) * c_dim + c0),
                     std::max<int64_t>(0, std::min<int64_t>(kk, w.k_dim - k0 - kk)),
                     c_dim * static_cast<int64_t>(sizeof(W)),
                     (c1 - c0) * static_cast<int64_t>(sizeof(W))};
  const bool prefetch = kk > 1 && next_step.rows > 0 && (kBf16 || rows >= kRowBlock);
  for (int64_t r = 0; r < rows; r += kRowBlock) {
    const float* const* xr = x + r;
    float* yr = y + r * w.c_dim;
    const NextStep* next = prefetch && r == 0 ? &next_step : nullptr;  // later blocks hit L1/L2
    switch (std::min<int64_t>(kRowBlock, rows - r)) {
      case 4: Columns<4, 2, kk>(xr, w, k0, c0, c1, yr, next); break;
      case 3: Columns<3, kBf16 ? 4 : 2, kk>(xr, w, k0, c0, c1, yr, next); break;
      case 2: Columns<2, kBf16 ? 4 : 2, kk>(xr, w, k0, c0, c1, yr, next); break;
      default: Columns<1, kBf16 ? 8 : 2, kk>(xr, w, k0, c0, c1, yr, next); break;
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

// acc[r][v0] += x[r][k] * w0 and acc[r][v0 + 1] += x[r][k] * w1 for every row: one broadcast of x
// feeds its two FMAs at once.
template <int kRows, int kSums>
__attribute__((target("avx2,fma"), always_inline)) inline void FmaRows(const float* const* x, int64_t k,
                                                                        __m256 w0, __m256 w1, int v0,
                                                                        __m256 (&acc)[kRows][kSums]) {
  for (int r = 0; r < kRows; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x[r] + k);
    acc[r][v0] = _mm256_fmadd_ps(xv, w0, acc[r][v0]);
    acc[r][v0 + 1] = _mm256_fmadd_ps(xv, w1, acc[r][v0 + 1]);
  }
}

// acc[r][2g + v] += x[r][k] * panel g's weight row k (its columns 8v..8v+7), and for bf16 then the
// same for row k + 1 (k even: one pair row), unless `half` (K odd: row k is the last).
template <int kRows, int kPanels, typename W>
__attribute__((target("avx2,fma"), always_inline)) inline void PanelRow(const float* const* x,
                                                                         const W* const* panel, int64_t row,
                                                                         int64_t k, __m256 (&acc)[kRows][2 * kPanels],
                                                                         bool half = false) {
  // bf16 widens each half of the pair row just before its FMAs: at most 12 sums + 2 weight vectors
  // + 1 broadcast live, within AVX2's 16 ymm.
  for (int g = 0; g < kPanels; ++g) {
    const W* wk = panel[g] + k * row;  // for bf16, pair row k / 2
    if constexpr (sizeof(W) == 4) {
      FmaRows(x, k, Load8(wk), Load8(wk + 8), 2 * g, acc);
    } else {
      FmaRows(x, k, WidenFirst8(wk), WidenFirst8(wk + 16), 2 * g, acc);
      if (!half) FmaRows(x, k + 1, WidenSecond8(wk), WidenSecond8(wk + 16), 2 * g, acc);
    }
  }
}

// Streaming over panel-major weights: kPanels adjacent 16-column strips (each its own stream on the
// 16-column panels the engine makes for AVX2 CPUs; panel_layout.h) for kRows rows over weight rows
// [k0, k1), the kRows x 2 * kPanels accumulators in registers throughout; they start from zero, or
// with `accumulate` from y. Fewer rows take more strips at once, to keep 8-12 independent FMA
// chains. Summation in k order, as the row-major path's (the results are equal bit for bit).
// Each stream is prefetched kPanelPrefetchBytes ahead in software, and k is unrolled 4x with the
// prefetches hoisted out of the unrolled rows: both made this path at least level with the
// row-major one (benchmarks/native_cpu_kernel.py; BENCHMARKS.md).
constexpr int64_t kPanelPrefetchBytes = 1024;
template <int kRows, int kPanels, typename W>
__attribute__((target("avx2,fma"))) void PanelStream(const float* const* x, const ExpertWeights<W>& w,
                                                     int64_t p, int64_t k0, int64_t k1, bool accumulate,
                                                     float* y) {
  __m256 acc[kRows][2 * kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < 2 * kPanels; ++v) {
      acc[r][v] = accumulate ? _mm256_loadu_ps(y + r * w.c_dim + p * kStripCols + 8 * v) : _mm256_setzero_ps();
    }
  }
  const W* panel[kPanels];
  for (int g = 0; g < kPanels; ++g) panel[g] = w.Strip(p + g, 0);
  const int64_t row = w.panel_cols;  // elements from one weight row of a strip to the next
  constexpr int64_t kLine = 64 / (kStripCols * sizeof(W));  // weight rows per cache line (1 or 2)
  constexpr int64_t kUnroll = 4;
  int64_t k = k0;
  for (; k + kUnroll <= k1; k += kUnroll) {  // k0 is a multiple of kLine: one prefetch per line
    for (int g = 0; g < kPanels; ++g) {
      for (int64_t l = 0; l < kUnroll; l += kLine) {
        _mm_prefetch(reinterpret_cast<const char*>(panel[g] + (k + l) * row) + kPanelPrefetchBytes, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int64_t u = 0; u < kUnroll; u += kPanelStep<W>) PanelRow<kRows, kPanels>(x, panel, row, k + u, acc);
  }
  for (; k + kPanelStep<W> <= k1; k += kPanelStep<W>) PanelRow<kRows, kPanels>(x, panel, row, k, acc);
  if (k < k1) PanelRow<kRows, kPanels>(x, panel, row, k, acc, /*half=*/true);  // bf16, K odd
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < 2 * kPanels; ++v) _mm256_storeu_ps(y + r * w.c_dim + p * kStripCols + 8 * v, acc[r][v]);
  }
}

// Panels [p, p + n) (n <= kPanels) of one block of kRows rows over all of K.
template <int kRows, int kPanels, typename W>
__attribute__((target("avx2,fma"))) void PanelGroup(const float* const* x, const ExpertWeights<W>& w,
                                                    int64_t p, int64_t n, float* y) {
  if constexpr (kPanels > 1) {
    if (n < kPanels) return PanelGroup<kRows, kPanels - 1>(x, w, p, n, y);
  }
  PanelStream<kRows, kPanels>(x, w, p, 0, w.k_dim, false, y);
}

// Rows of one register block on the panels: 6 rows x one 16-column strip is 12 sums, the most
// AVX2's 16 ymm hold beside the weights and a broadcast (PanelRow).
constexpr int64_t kPanelRowBlock = 6;

// k rows per step when an item has several row blocks: the blocks of a step read the step's slice
// of the strip (8-16 KB) and of the x rows from L1.
constexpr int64_t kPanelStepK = 256;

// Full strips [c0, c1) / 16 of an item (the streaming path, panel-major weights). Up to 4 rows: one
// block, each group of strips over all of K; 5-6 rows: one block, each strip over all of K. More:
// each strip in turn, in steps of kPanelStepK weight rows, each step for blocks of as equal a size
// as fit (7 = 4 + 3, 13 = 5 + 4 + 4), so that no block is left with 1-2 rows, whose few FMA chains
// wait on each other's latency.
// These blocks replaced 4-row blocks of 1 strip each taken k step by k step across all the strips:
// faster from 5 rows, level below (BENCHMARKS.md "AVX2 register blocks of 5-6 rows").
template <typename W>
__attribute__((target("avx2,fma"))) void StreamPanels(const float* const* x, int64_t rows,
                                                      const ExpertWeights<W>& w, int64_t c0,
                                                      int64_t c1, float* y) {
  const int64_t p0 = c0 / kStripCols, p1 = c1 / kStripCols;
  if (rows <= kRowBlock) {
    constexpr int kGroup = 4;  // strips at once: 1 / 2 / 4 of them for 4 / 2-3 / 1 rows
    for (int64_t p = p0; p < p1; p += kGroup) {
      const int64_t n = std::min<int64_t>(kGroup, p1 - p);
      switch (rows) {
        case 4:
          for (int64_t q = 0; q < n; ++q) PanelGroup<4, 1>(x, w, p + q, 1, y);
          break;
        case 3:
          for (int64_t q = 0; q < n; q += 2) PanelGroup<3, 2>(x, w, p + q, n - q, y);
          break;
        case 2:
          for (int64_t q = 0; q < n; q += 2) PanelGroup<2, 2>(x, w, p + q, n - q, y);
          break;
        default: PanelGroup<1, kGroup>(x, w, p, n, y); break;
      }
    }
    return;
  }
  if (rows <= kPanelRowBlock) {
    for (int64_t p = p0; p < p1; ++p) {
      if (rows == 6) {
        PanelGroup<6, 1>(x, w, p, 1, y);
      } else {
        PanelGroup<5, 1>(x, w, p, 1, y);
      }
    }
    return;
  }
  // Blocks of base or base + 1 rows: 3-6 of them (base >= 3 for rows >= 7).
  const int64_t blocks = (rows + kPanelRowBlock - 1) / kPanelRowBlock, base = rows / blocks, extra = rows % blocks;
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t k0 = 0; k0 < w.k_dim; k0 += kPanelStepK) {
      const int64_t k1 = std::min(w.k_dim, k0 + kPanelStepK);
      for (int64_t b = 0, r = 0, n; b < blocks; r += n, ++b) {
        n = base + (b < extra);
        const float* const* xr = x + r;
        float* yr = y + r * w.c_dim;
        switch (n) {
          case 6: PanelStream<6, 1>(xr, w, p, k0, k1, k0 > 0, yr); break;
          case 5: PanelStream<5, 1>(xr, w, p, k0, k1, k0 > 0, yr); break;
          case 4: PanelStream<4, 1>(xr, w, p, k0, k1, k0 > 0, yr); break;
          default: PanelStream<3, 1>(xr, w, p, k0, k1, k0 > 0, yr); break;
        }
      }
    }
  }
}

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
  if constexpr (sizeof(W) == 4) {
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

void PackRows(const float* const* x, int64_t rows, int64_t k0, int64_t kc, float* packed) {
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

// All of k for the streaming path: steps of kk weight rows, then single rows for the remainder.
template <int kk, typename W>
__attribute__((target("avx2,fma"))) void Steps(const float* const* x, int64_t rows,
                                               const ExpertWeights<W>& w, int64_t c0, int64_t c1,
                                               float* y) {
  int64_t k0 = 0;
  for (; k0 + kk <= w.k_dim; k0 += kk) RowBlocks<kk>(x, rows, w, k0, c0, c1, y);
  for (; k0 < w.k_dim; ++k0) RowBlocks<1>(x, rows, w, k0, c0, c1, y);
}

// The streaming path over row-major weights, all of k: steps of kk weight rows (fewer for items of
// one row block).
template <typename W>
__attribute__((target("avx2,fma"))) void Stream(const float* const* x, int64_t rows,
                                                const ExpertWeights<W>& w, int64_t c0, int64_t c1,
                                                float* y) {
  for (int64_t r = 0; r < rows; ++r) std::fill(y + r * w.c_dim + c0, y + r * w.c_dim + c1, 0.0f);
  if (rows <= kRowBlock) return Steps<kRowsPerStepOneBlock>(x, rows, w, c0, c1, y);
  Steps<kRowsPerStep>(x, rows, w, c0, c1, y);
}

// The paths an item can take, counted per item since the library loaded (expertd_native_cpu_path_items:
// how the tests and benchmarks see which one ran).
enum Path { kPathPortable, kPathAvx2Stream, kPathAvx2Packed, kPathAvx512Fma, kPathAvx512Bf16Dot, kNumPaths };
std::atomic<int64_t> path_items[kNumPaths];

template <typename W>
__attribute__((target("avx2,fma"))) Path BlockAvx2(const float* const* x, int64_t rows,
                                                   const ExpertWeights<W>& w, int64_t c0, int64_t c1,
                                                   float* y) {
  // Panel-major weights on AVX-512 CPUs: every row count (its register blocks of up to 6 x 4 strips
  // streaming all of K are at least level with the packed path at every row count; BENCHMARKS.md
  // "Native CPU kernel"), bf16-valued rows on the bf16 dot product; the column tail
  // included.
  if (w.Panels() && expertd::CpuIsa() >= expertd::Isa::kAvx512) {
    const uint32_t* const* pairs = nullptr;
    if (ExpertWeights<W>::kBf16 && expertd::CpuIsa() >= expertd::Isa::kAvx512Bf16) {
      pairs = expertd::avx512::PairRows(x, rows, w.k_dim);
    }
    expertd::avx512::StreamPanels({x, pairs}, rows, w.w, w.k_dim, w.panel_cols, c0, c1, w.c_dim, y);
    return pairs ? kPathAvx512Bf16Dot : kPathAvx512Fma;
  }
  const int64_t c_vec = c0 + (c1 - c0) / 16 * 16;
  if (c_vec < c1) BlockScalar(x, rows, w, c_vec, c1, y);
  if (c_vec == c0) return kPathPortable;
  if (rows >= kPackedMinRows) {
    BlockPacked(x, rows, w, c0, c_vec, y);
    return kPathAvx2Packed;
  }
  if (w.Panels()) {
    StreamPanels(x, rows, w, c0, c_vec, y);
  } else {
    Stream(x, rows, w, c0, c_vec, y);
  }
  return kPathAvx2Stream;
}

struct Item {
  int64_t row0, rows, expert, c0, c1;
};

// Where the rows of x come from: row r of the output reads x[source[r]] (gathered) or x[r].
struct RowSource {
  const float* x;
  int64_t x_rows;         // rows of x; a source outside [0, x_rows) reads as zeros
  int64_t k_dim;
  const int32_t* source;  // [N], or nullptr: row r is x[r]
  const float* zeros;     // k_dim zeros

  const float* Row(int64_t r) const {
    const int64_t s = source ? source[r] : r;
    return s >= 0 && s < x_rows ? x + s * k_dim : zeros;
  }
};

// `w` holds E experts of k_dim x c_dim weights, row-major (panel_cols 0) or panel-major in panels
// of panel_cols columns.
template <typename W>
void GroupedMatmul(ffi::ThreadPool& pool, const RowSource& rows_in, int64_t n,
                   const int32_t* group_sizes, int64_t e_dim, const W* w, int64_t c_dim, int64_t panel_cols,
                   float* y) {
  const int64_t k_dim = rows_in.k_dim;
  // Rows of each expert (clamped to the buffer), then items: narrower column blocks when there
  // would be fewer than two per thread (one or two experts in use), and on panel-major weights
  // for the streaming experts (under kPackedMinRows rows) when there would be fewer than
  // kItemsPerThreadPanels.
  std::vector<int64_t> rows_of(e_dim, 0);
  int64_t row = 0, used = 0;
  for (int64_t e = 0; e < e_dim && row < n; ++e) {
    rows_of[e] = std::min<int64_t>(std::max<int32_t>(group_sizes[e], 0), n - row);
    row += rows_of[e];
    used += rows_of[e] > 0;
  }
  const int64_t work = row * k_dim * c_dim;  // multiply-adds: every row an expert owns
  const int64_t threads = expertd::SharingThreads(pool, work);
  const auto block_for = [&](int64_t per_thread) {
    int64_t block = kBlockColumns;
    while (block > kMinBlockColumns && used * ((c_dim + block - 1) / block) < per_thread * threads) block /= 2;
    return block;
  };
  const int64_t block_wide = block_for(2), block_streaming = panel_cols > 0 ? block_for(kItemsPerThreadPanels) : block_wide;
  std::vector<Item> items;
  row = 0;
  for (int64_t e = 0; e < e_dim; row += rows_of[e], ++e) {
    const int64_t block = rows_of[e] < kPackedMinRows ? block_streaming : block_wide;
    for (int64_t c0 = 0; rows_of[e] > 0 && c0 < c_dim; c0 += block) {
      items.push_back({row, rows_of[e], e, c0, std::min(c_dim, c0 + block)});
    }
  }
  std::fill(y + row * c_dim, y + n * c_dim, 0.0f);  // rows no expert owns
  const int64_t expert_elems = ExpertWeights<W>{w, k_dim, c_dim, panel_cols}.Elems();
  expertd::ParallelFor(pool, static_cast<int64_t>(items.size()), work, [&](int64_t i) {
    const Item& it = items[i];
    std::vector<const float*> x(it.rows);
    for (int64_t r = 0; r < it.rows; ++r) x[r] = rows_in.Row(it.row0 + r);
    const ExpertWeights<W> we{w + it.expert * expert_elems, k_dim, c_dim, panel_cols};
    float* ye = y + it.row0 * c_dim;
    Path path = kPathPortable;
    if (HasAvx2()) {
      path = BlockAvx2(x.data(), it.rows, we, it.c0, it.c1, ye);
    } else {
      BlockScalar(x.data(), it.rows, we, it.c0, it.c1, ye);
    }
    path_items[path].fetch_add(1, std::memory_order_relaxed);
  });
}

// Every entry point: output row r of y [n, C] reads x [M, K] row source[r] (or row r without a
// source); w is [E, K, C], or with `panels` [E, P, K, W] (fp32) / [E, P, ceil(K/2), 2 W] (bf16).
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const int32_t* source, int64_t n,
               ffi::Buffer<ffi::S32>& group_sizes, ffi::AnyBuffer& w, bool panels, float* y, int64_t c_dim) {
  const int64_t e_dim = w.dimensions()[0], k_dim = x.dimensions()[1];
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  const int64_t panel_cols = panels ? w.dimensions()[3] / (bf16 ? 2 : 1) : 0;
  std::vector<float> zeros(k_dim, 0.0f);
  const RowSource rows_in{x.typed_data(), x.dimensions()[0], k_dim, source, zeros.data()};
  switch (w.element_type()) {
    case ffi::DataType::F32:
      GroupedMatmul(pool, rows_in, n, group_sizes.typed_data(), e_dim, w.typed_data<float>(), c_dim, panel_cols, y);
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      GroupedMatmul(pool, rows_in, n, group_sizes.typed_data(), e_dim, w.reinterpret_data<uint16_t>(),
                    c_dim, panel_cols, y);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
  }
}

// Shapes shared by every entry point: x [M, K], group_sizes [E], y [N, C], and w [E, K, C] or
// (`panels`) [E, ceil(C / W), K, W] (fp32) / [E, ceil(C / W), ceil(K / 2), 2 W] (bf16), W 16 or 64.
ffi::Error CheckShapes(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::S32>& group_sizes, ffi::AnyBuffer& w,
                       bool panels, ffi::ResultBuffer<ffi::F32>& y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != (panels ? 4u : 3u) || group_sizes.dimensions().size() != 1 || yd.size() != 2) {
    return ffi::Error::InvalidArgument(panels ? "expected x [N, K], group_sizes [E], w [E, P, K, W] (fp32) or "
                                                "[E, P, ceil(K/2), 2 W] (bf16), W 16 or 64, y [N, C]"
                                              : "expected x [N, K], group_sizes [E], w [E, K, C], y [N, C]");
  }
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  const int64_t width = panels ? wd[3] / (bf16 ? 2 : 1) : 0;
  const bool fits = panels ? wd[2] == (bf16 ? (xd[1] + 1) / 2 : xd[1]) && wd[3] == (bf16 ? 2 : 1) * width &&
                                 expertd::IsPanelWidth(width) && wd[1] == (yd[1] + width - 1) / width
                           : wd[1] == xd[1] && yd[1] == wd[2];
  if (!fits || group_sizes.dimensions()[0] != wd[0]) {
    return ffi::Error::InvalidArgument(panels ? "shapes disagree: x [N, K], group_sizes [E], w [E, ceil(C/W), K, W] "
                                                "(fp32) or [E, ceil(C/W), ceil(K/2), 2 W] (bf16), W 16 or 64"
                                              : "shapes disagree: x [N, K], group_sizes [E], w [E, K, C]");
  }
  return ffi::Error::Success();
}

template <bool kPanels>
ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w,
                             ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = CheckShapes(x, group_sizes, w, kPanels, y); err.failure()) return err;
  const int64_t n = x.dimensions()[0];
  if (y->dimensions()[0] != n) return ffi::Error::InvalidArgument("y must have the rows of x");
  return Run(pool, x, nullptr, n, group_sizes, w, kPanels, y->typed_data(), y->dimensions()[1]);
}

template <bool kPanels>
ffi::Error GroupedMatmulGatheredImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                                     ffi::Buffer<ffi::S32> source, ffi::Buffer<ffi::S32> group_sizes,
                                     ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = CheckShapes(x, group_sizes, w, kPanels, y); err.failure()) return err;
  const int64_t n = y->dimensions()[0];
  if (source.dimensions().size() != 1 || source.dimensions()[0] != n) {
    return ffi::Error::InvalidArgument("source must be [N], one x row index per output row");
  }
  return Run(pool, x, source.typed_data(), n, group_sizes, w, kPanels, y->typed_data(), y->dimensions()[1]);
}

auto Binding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>();  // pool, x
}

auto PlainBinding() {
  return Binding().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::F32>>();
}

auto GatheredBinding() {
  return Binding()
      .Arg<ffi::Buffer<ffi::S32>>()  // source
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmul, GroupedMatmulImpl<false>, PlainBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulGathered, GroupedMatmulGatheredImpl<false>, GatheredBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulPanels, GroupedMatmulImpl<true>, PlainBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulPanelsGathered, GroupedMatmulGatheredImpl<true>, GatheredBinding());

// The expertd::Isa level the kernels run at (0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 with the bf16 dot
// product), and the highest one this CPU runs under the process cap; cap_isa sets that cap (once, at
// load), limit_isa a further cap for later calls.
extern "C" int expertd_native_cpu_isa() { return static_cast<int>(expertd::CpuIsa()); }
extern "C" int expertd_native_cpu_detected_isa() { return static_cast<int>(expertd::DetectedIsa()); }
extern "C" void expertd_native_cpu_cap_isa(int level) { expertd::IsaCap().store(level); }
extern "C" void expertd_native_cpu_limit_isa(int level) { expertd::IsaLimit().store(level); }
// The ParallelFor rule's bound (parallel.h): calls of at most this many multiply-adds run on the
// caller alone; the setter is for benchmarks that A/B the rule in one process.
extern "C" int64_t expertd_caller_only_work() { return expertd::caller_only_work.load(); }
extern "C" void expertd_set_caller_only_work(int64_t work) { expertd::caller_only_work.store(work); }
// Work items run on each Path since the library loaded (a column tail alone counts as portable).
extern "C" int64_t expertd_native_cpu_path_items(int path) {
  return path >= 0 && path < kNumPaths ? path_items[path].load() : -1;
}

// Copies the ParallelFor records (parallel.h, 8 int64 each) kept since the last call into out, at
// most capacity / 8 of them, and clears them; -1 unless built with -DEXPERTD_TRACE_PARALLEL_FOR.
extern "C" int64_t expertd_parallel_for_trace(int64_t* out, int64_t capacity) {
#ifdef EXPERTD_TRACE_PARALLEL_FOR
  const int64_t n = std::min({expertd::trace_count.load(), expertd::kTraceCapacity, capacity / 8});
  for (int64_t i = 0; i < n; ++i) {
    const expertd::ParallelForRecord& r = expertd::trace_records[i];
    const int64_t fields[8] = {r.start, r.caller_done, r.helper_start, r.helper_done, r.returned, r.tasks,
                               r.caller_tasks, r.helpers};
    std::copy(fields, fields + 8, out + 8 * i);
  }
  expertd::trace_count.store(0);
  return n;
#else
  (void)out;
  (void)capacity;
  return -1;
#endif
}
