// The grouped matmul's streaming paths on AVX2 CPUs (few rows per expert: memory-bound): each
// expert's weights are read once, in place, bf16 widened in registers. Stream for row-major weights
// (steps of kRowsPerStep weight rows, row blocks of up to kRowBlock, the next step prefetched),
// StreamPanels for panel-major ones (16-column strips, each its own stream, the sums of a register
// block kept over all of K). Both sum k in order with one rounding per product-add, as every path
// does. Included by grouped_matmul_cpu.cc alone.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "expert_weights.h"
#include "simd.h"

namespace expertd::gmm {
// Internal linkage, as when this lived in grouped_matmul_cpu.cc, the one file that includes it:
// the compiler inlines and lays out these functions as it did then, and the library exports no
// copies of them.
namespace {

constexpr int kRowsPerStep = 16;         // weight rows streamed at once; accumulators stay in registers
// Items of one row block (up to 4 rows) stream 8 weight rows per step instead: fewer concurrent
// streams, which suits few rows; more rows keep 16 (BENCHMARKS.md).
constexpr int kRowsPerStepOneBlock = 8;
constexpr int64_t kRowBlock = 4;

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
    if constexpr (sizeof(W) != 2) {  // fp32, int8: one weight row
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
  constexpr int64_t kLine = 64 / (kStripCols * sizeof(W));  // weight rows per cache line (1, 2, 4: fp32, bf16, int8)
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

}  // namespace
}  // namespace expertd::gmm
