// The grouped matmul over panel-major weights on AVX-512 CPUs, at every row count: one zmm holds a
// panel's 16 columns, so a block of up to kMaxBlockRows rows keeps its sums in registers over all of
// K, reading each panel as one sequential stream; more rows go in 256-deep k steps of 6-row x
// 4-panel blocks (the step's slice of the panels stays in L1 across the blocks).
//
// Panel layouts (panels.py makes them once at load; grouped_matmul_cpu.cc's header has the math):
// - fp32: panel p is [K][16]: one weight row of 16 columns per zmm.
// - bf16: panel p is [ceil(K/2)][16][2] ("pair rows"): dword c of pair row j holds w[2j][c] in its
//   high half and w[2j+1][c] in its low half (K odd: the last low halves are zero). One zmm holds
//   two weight rows; the high halves are w[2j] as fp32 after an AND, the low ones w[2j+1] after a
//   shift (no shuffle), and the pair is exactly the operand vdpbf16ps multiplies.
//
// Three inner loops, all summing k in order with one rounding per product-add, as every path of
// the kernel does (so layouts, paths and instruction sets give the same bits):
// - fp32 weights: acc += x[k] * w[k];
// - bf16 weights, fp32 x: both rows of a pair widened, two FMAs;
// - bf16 weights, bf16 x (the item's rows all bf16-valued, which the layer's are: x and h are
//   rounded to the weights' dtype), Isa::kAvx512Bf16: one vdpbf16ps per pair row against the row's
//   x pair (x[2j] high, x[2j+1] low), whose two roundings are the two FMAs' (simd.h Bf16DotIsFma).
//   No widening, and 32 multiply-adds per instruction where an FMA does 16: the FMA paths' blocks
//   of 4+ rows were compute-bound on the 2-core dev box, and many rows run ~1.7x the packed fp32
//   GEMM's rate (BENCHMARKS.md). AVX512_BF16 reads subnormal inputs as zero and flushes subnormal
//   sums, which XLA:CPU does to every computation already (FTZ / DAZ), so nothing changes there.
//
// The functions carry the avx512bf16 target for the one loop that uses it; the others compile to
// AVX-512 F / BW instructions only and run on CPUs without it (Isa::kAvx512).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace expertd::avx512 {

constexpr int kMaxBlockRows = 8;       // rows whose sums stay in registers at once
// Blocks of kPrefetchMinRows rows or more prefetch each panel stream kPrefetchBytes ahead in software
// (interleaved A/B on the dev box: without it 6-8 row blocks ran 0.77-0.91x; with it 1-4 row blocks,
// which the hardware prefetcher keeps fed alone, ran 0.76-0.98x).
constexpr int kPrefetchMinRows = 5;
constexpr int64_t kPrefetchBytes = 1024;

// Elements of one panel: [K][16] fp32, [ceil(K/2)][32] bf16.
inline int64_t PanelElements(int64_t k_dim, bool bf16) { return bf16 ? (k_dim + 1) / 2 * 32 : k_dim * 16; }

// Where a block's x comes from: fp32 rows (x[r][k]) or, for the bf16 dot, pair rows (pairs[r][j] =
// x[2j] high, x[2j+1] low).
struct BlockRows {
  const float* const* x;
  const uint32_t* const* pairs;  // nullptr: the FMA paths
};

// y[r][16 (p + g) .. +16] (+)= sum over weight rows [k0, k1) for kRows rows and kPanels panels from
// `panel` (each `panel_elems` apart); `last_mask` selects the columns of the group's last panel that
// exist (a partial panel at C's tail; its padding columns are zero and never stored).
template <int kRows, int kPanels, typename W>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void StreamBlock(const BlockRows& in, const W* panel,
                                                                      int64_t panel_elems, int64_t k0, int64_t k1,
                                                                      bool accumulate, __mmask16 last_mask,
                                                                      float* y, int64_t c_dim) {
  constexpr bool kBf16 = sizeof(W) == 2;
  constexpr bool kPrefetch = kRows >= kPrefetchMinRows;
  __m512 acc[kRows][kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kPanels; ++g) {
      const __mmask16 m = g == kPanels - 1 ? last_mask : 0xFFFF;
      acc[r][g] = accumulate ? _mm512_maskz_loadu_ps(m, y + r * c_dim + 16 * g) : _mm512_setzero_ps();
    }
  }
  const W* streams[kPanels];
  for (int g = 0; g < kPanels; ++g) streams[g] = panel + g * panel_elems;
  if constexpr (!kBf16) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int g = 0; g < kPanels; ++g) {
        const float* line = streams[g] + k * 16;
        if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
        const __m512 wv = _mm512_loadu_ps(line);
        for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][k]), wv, acc[r][g]);
      }
    }
  } else {
    // k0 is even; pair rows [k0 / 2, k1 / 2) are whole, and an odd k1 (= K) leaves a half pair.
    const int64_t j0 = k0 / 2, j1 = k1 / 2;
    if (in.pairs) {
      const int64_t j_end = (k1 + 1) / 2;  // the half pair's low halves are 0 in w and x
      for (int64_t j = j0; j < j_end; ++j) {
        for (int g = 0; g < kPanels; ++g) {
          const uint16_t* line = streams[g] + j * 32;
          if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
          const __m512bh wv = (__m512bh)_mm512_loadu_si512(line);
          for (int r = 0; r < kRows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(in.pairs[r][j]));
            acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, wv);
          }
        }
      }
    } else {
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int64_t j = j0; j < j1; ++j) {
        for (int g = 0; g < kPanels; ++g) {
          const uint16_t* line = streams[g] + j * 32;
          if (kPrefetch) _mm_prefetch(reinterpret_cast<const char*>(line) + kPrefetchBytes, _MM_HINT_T0);
          const __m512i raw = _mm512_loadu_si512(line);
          const __m512 first = _mm512_castsi512_ps(_mm512_and_si512(raw, high));  // w[2j]
          const __m512 second = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));  // w[2j + 1]
          for (int r = 0; r < kRows; ++r) {
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j]), first, acc[r][g]);
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j + 1]), second, acc[r][g]);
          }
        }
      }
      if (k1 % 2) {
        for (int g = 0; g < kPanels; ++g) {
          const __m512i raw = _mm512_loadu_si512(streams[g] + j1 * 32);
          const __m512 first = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
          for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j1]), first, acc[r][g]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kPanels; ++g) {
      _mm512_mask_storeu_ps(y + r * c_dim + 16 * g, g == kPanels - 1 ? last_mask : 0xFFFF, acc[r][g]);
    }
  }
}

// kRows rows over panels [p, p1), kPanels at a time (fewer at the end), weight rows [k0, k1).
template <int kRows, int kPanels, typename W>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void StreamRows(const BlockRows& in, const W* w,
                                                                     int64_t panel_elems, int64_t p, int64_t p1,
                                                                     int64_t k0, int64_t k1, bool accumulate,
                                                                     int64_t c_dim, float* y) {
  for (; p < p1; p += kPanels) {
    const int64_t n = std::min<int64_t>(kPanels, p1 - p);
    const int64_t last_columns = std::min<int64_t>(16, c_dim - 16 * (p + n - 1));
    const __mmask16 mask = static_cast<__mmask16>((1u << last_columns) - 1);
    const W* panel = w + p * panel_elems;
    float* yp = y + 16 * p;
    if constexpr (kPanels > 1) {
      if (n < kPanels) {
        return StreamRows<kRows, kPanels / 2>(in, w, panel_elems, p, p1, k0, k1, accumulate, c_dim, y);
      }
    }
    StreamBlock<kRows, kPanels>(in, panel, panel_elems, k0, k1, accumulate, mask, yp, c_dim);
  }
}

// One block of `rows` (1..kMaxBlockRows) rows: fewer rows take more panels at once, so that every
// block keeps 4-16 independent sums in flight. fp32 blocks of 6-8 rows take 2 panels (interleaved
// A/B: 1.01-1.21x one panel), bf16 ones one (2 panels: 0.83-1.16x, mostly below 1).
template <typename W>
void StreamBlockRows(const BlockRows& in, int64_t rows, const W* w, int64_t panel_elems, int64_t p0, int64_t p1,
                     int64_t k0, int64_t k1, bool accumulate, int64_t c_dim, float* y) {
  constexpr int kPanels6To8 = sizeof(W) == 4 ? 2 : 1;
  switch (rows) {
    case 1: return StreamRows<1, 4>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 2: return StreamRows<2, 4>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 3: return StreamRows<3, 2>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 4: return StreamRows<4, 2>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 5: return StreamRows<5, 1>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 6: return StreamRows<6, kPanels6To8>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    case 7: return StreamRows<7, kPanels6To8>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
    default: return StreamRows<8, kPanels6To8>(in, w, panel_elems, p0, p1, k0, k1, accumulate, c_dim, y);
  }
}

// x's rows as the bf16 dot reads them (pairs[r][j] = x[r][2j] high, x[r][2j+1] low, a zero low half
// past K), in a buffer of this thread's; nullptr where a value is not exact in bf16 (then an FMA path
// runs).
inline const uint32_t* const* PairRows(const float* const* x, int64_t rows, int64_t k_dim) {
  thread_local std::vector<uint32_t> buffer;
  thread_local std::vector<const uint32_t*> pairs;
  const int64_t k2 = (k_dim + 1) / 2;
  buffer.resize(rows * k2);
  pairs.resize(rows);
  uint32_t inexact = 0;
  for (int64_t r = 0; r < rows; ++r) {
    uint32_t* out = buffer.data() + r * k2;
    pairs[r] = out;
    for (int64_t j = 0; j < k_dim / 2; ++j) {
      const uint32_t first = FloatBits(x[r][2 * j]), second = FloatBits(x[r][2 * j + 1]);
      inexact |= (first | second) & 0xFFFFu;
      out[j] = (first & 0xFFFF0000u) | (second >> 16);
    }
    if (k_dim % 2) {
      const uint32_t last = FloatBits(x[r][k_dim - 1]);
      inexact |= last & 0xFFFFu;
      out[k2 - 1] = last & 0xFFFF0000u;
    }
  }
  return inexact == 0 ? pairs.data() : nullptr;
}

// Items of more than kMaxBlockRows rows: blocks of 6 rows x 4 panels (24 zmm sums). Interleaved A/B on
// the dev box, bf16 dot at 12-256 rows per expert: 6 x 4 was 1.0-1.29x 8 x 1, and level with 8 x 2,
// 8 x 3 and 7 x 3 within 0.9-1.1 (4 x 4 and 12 x 2 lost up to 0.8 / 0.69x).
constexpr int kManyRowsBlock = 6;
constexpr int kManyRowsPanels = 4;
// Each block streams its 4 panels over as many weight rows as hold kGroupStepBytes (the whole of K
// for K up to 2048 fp32 / 4096 bf16), from L2 after the first block. Steps of 256 rows ran
// 0.77-0.98x whole-K ones at 16-1024 rows per expert (the blocks' sums stored and reloaded every
// step; 512 / 1024 rows: 0.81-1.0x), so the step only keeps a group within a 1 MiB L2; at
// DeepSeek-V3's K = 7168, steps of 256 KiB / 8 MiB ran 0.91-1.02x of these.
constexpr int64_t kGroupStepBytes = 512 << 10;

// Columns [c0, c1) (c0 a multiple of 16; c1 = C or a multiple of 16) of y = x @ w for `rows` rows of
// one expert's panel-major weights `w`, x from `in`. One block: each panel group over all of K.
// More: each group of kManyRowsPanels panels for every block of kManyRowsBlock rows in turn (the
// group, or its step of kGroupStepBytes, stays in L2 across the blocks).
template <typename W>
void StreamPanels(const BlockRows& in, int64_t rows, const W* w, int64_t k_dim, int64_t c0, int64_t c1,
                  int64_t c_dim, float* y) {
  const int64_t panel_elems = PanelElements(k_dim, sizeof(W) == 2);
  const int64_t p0 = c0 / 16, p1 = (c1 + 15) / 16;
  if (k_dim == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * c_dim + c0, y + r * c_dim + c1, 0.0f);
    return;
  }
  if (rows <= kMaxBlockRows) return StreamBlockRows(in, rows, w, panel_elems, p0, p1, 0, k_dim, false, c_dim, y);
  const int64_t step_k = kGroupStepBytes / (kManyRowsPanels * 64) * (sizeof(W) == 2 ? 2 : 1);  // 64 B per row / pair row
  for (int64_t k0 = 0; k0 < k_dim; k0 += step_k) {
    const int64_t k1 = std::min(k_dim, k0 + step_k);
    for (int64_t p = p0; p < p1; p += kManyRowsPanels) {
      const int64_t p_end = std::min(p1, p + kManyRowsPanels);
      int64_t r = 0;
      for (; r + kManyRowsBlock <= rows; r += kManyRowsBlock) {
        const BlockRows block{in.x + r, in.pairs ? in.pairs + r : nullptr};
        StreamRows<kManyRowsBlock, kManyRowsPanels>(block, w, panel_elems, p, p_end, k0, k1, k0 > 0, c_dim,
                                                    y + r * c_dim);
      }
      for (; r < rows; r += kMaxBlockRows) {
        const BlockRows block{in.x + r, in.pairs ? in.pairs + r : nullptr};
        StreamBlockRows(block, std::min<int64_t>(kMaxBlockRows, rows - r), w, panel_elems, p, p_end, k0, k1, k0 > 0,
                        c_dim, y + r * c_dim);
      }
    }
  }
}

}  // namespace expertd::avx512
