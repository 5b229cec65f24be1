// The grouped matmul over panel-major weights on AVX-512 CPUs, at every row count: one zmm holds a
// strip's 16 columns, so a block of up to kMaxBlockRows rows x 4 strips keeps its sums in registers
// over all of K; on the 64-column panels the engine makes for these CPUs, the 4 strips are one panel
// and the block reads it as one sequential stream. More rows go in 6-row blocks over each 4 strips
// in turn (the strips, or their step of kGroupStepBytes, stay in L2).
//
// Panel layouts (panel_layout.h; kernels/cpu/panels.py makes them once at load), W = 64 (or 16) columns:
// - fp32: panel [K][W]: weight row k of strip s is the 16 floats at k * W + 16 s, one zmm.
// - int8 (INT8 expert weights, W8A16): the fp32 layout in bytes, weight row k of strip s the 16
//   bytes at k * W + 16 s (one xmm, sign-extended and converted to one zmm of exact fp32 integers);
//   the sums are multiplied by the columns' scales once, as they are stored after the last k.
// - bf16: panel [ceil(K/2)][2 W] ("pair rows"): dword c of pair row j holds w[2j][c] in its high
//   half and w[2j+1][c] in its low half (K odd: the last low halves are zero); strip s of pair row j
//   is the 64 bytes at 2 W j + 32 s, one zmm holding two weight rows: the high halves are w[2j] as
//   fp32 after an AND, the low ones w[2j+1] after a shift (no shuffle), and the pair is exactly the
//   operand vdpbf16ps multiplies.
//
// Three inner loops (four with int8), all summing k in order with one rounding per product-add, as
// every path of the kernel does (so layouts, paths and instruction sets give the same bits):
// - fp32 weights: acc += x[k] * w[k]; int8 weights: acc += x[k] * float(q[k]), then y = acc * scale
//   (int8 weights times bf16-valued rows of 2+ rows per expert: weight rows k, k+1 widened into one
//   bf16 pair, Int8Pair, exact, and the bf16 dot product below);
// - bf16 weights, fp32 x: both rows of a pair widened, two FMAs;
// - bf16 weights, bf16 x (the item's rows all bf16-valued, which the layer's are: x and h are
//   rounded to the weights' dtype), Isa::kAvx512Bf16: one vdpbf16ps per pair row against the row's
//   x pair (x[2j] high, x[2j+1] low), whose two roundings are the two FMAs' (simd.h Bf16DotIsFma).
//   No widening, and 32 multiply-adds per instruction where an FMA does 16: the rule is to use it
//   wherever it gives the FMAs' bits, because the FMA paths' blocks of 4+ rows are compute-bound
//   (BENCHMARKS.md, "Native CPU kernel"). AVX512_BF16 reads subnormal inputs as zero and flushes subnormal
//   sums, which XLA:CPU does to every computation already (FTZ / DAZ), so nothing changes there.
//
// The functions carry the avx512bf16 target for the one loop that uses it; the others compile to
// AVX-512 F / BW instructions only and run on CPUs without it (Isa::kAvx512).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panel_layout.h"
#include "simd.h"

namespace expertd::avx512 {

// Blocks of up to 6 rows take 4 strips (4-24 zmm sums); more rows run as 6-row blocks plus one
// block of the rest, each over the 4 strips in turn (StreamPanels). 6 is the largest block that
// was not slower at any row count (BENCHMARKS.md).
constexpr int kMaxBlockRows = 6;
constexpr __mmask16 kAllLanes = 0xFFFF;
constexpr int64_t kBlockStrips = 4;
// No software prefetch: on 64-column panels a block reads one sequential stream, which the hardware
// prefetcher keeps fed; a software prefetch only added instructions (BENCHMARKS.md).

// One expert's panel-major weights: the first weight, the panel width (16 or 64) and its length.
template <typename W>
struct Strips {
  const W* w;
  int64_t panel_cols, panel_elems;
  // Strip q's weight row 0 (its row k, k even for bf16, is k * panel_cols elements on).
  const W* At(int64_t q) const { return w + StripOffset(q, panel_elems, sizeof(W) == 2, panel_cols); }
};

// Where a block's x comes from: fp32 rows (x[r][k]) or, for the bf16 dot, pair rows (pairs[r][j] =
// x[2j] high, x[2j+1] low).
struct BlockRows {
  const float* const* x;
  const uint32_t* const* pairs;  // nullptr: the FMA paths
};

// 16 columns of an int8 weight row as fp32 (exact). The zero-masked forms, all lanes, are the same
// instructions without GCC 12's false -Wmaybe-uninitialized on the unmasked intrinsics' undefined
// pass-through operand.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512 Int8Row(const int8_t* line) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(line));
  return _mm512_maskz_cvtepi32_ps(kAllLanes, _mm512_maskz_cvtepi8_epi32(kAllLanes, bytes));
}

// 16 columns of int8 weight rows k (`first`) and k + 1 (`second`) as the bf16 dot product's pair
// operand: each dword float(w[k]) in its high half and float(w[k + 1]) in its low half. Exact: an
// integer of magnitude <= 128 is a bf16, so the fp32 of it has a zero low half.
__attribute__((target("avx512f,avx512bw"), always_inline)) inline __m512i Int8Pair(const int8_t* first,
                                                                                const int8_t* second) {
  const __m512i high = _mm512_castps_si512(Int8Row(first)), low = _mm512_castps_si512(Int8Row(second));
  return _mm512_or_si512(high, _mm512_maskz_srli_epi32(kAllLanes, low, 16));
}

// y[r][16 (q + g) .. +16] (+)= sum over weight rows [k0, k1) for kRows rows and the kStrips strips
// from q of one expert's panels `ws`; `last_mask` selects the columns of the block's last strip
// that exist (a partial strip at C's tail; its padding columns are zero and never stored).
// `scales` (int8 weights, the last k step only; else nullptr): the scales of the block's first
// column on, each column's sum multiplied by its scale as it is stored.
template <int kRows, int kStrips, typename W>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void StreamBlock(const BlockRows& in, const Strips<W>& ws,
                                                                      int64_t q, int64_t k0,
                                                                      int64_t k1, bool accumulate,
                                                                      __mmask16 last_mask, float* y, int64_t c_dim,
                                                                      const float* scales) {
  constexpr bool kBf16 = sizeof(W) == 2;
  __m512 acc[kRows][kStrips];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kStrips; ++g) {
      const __mmask16 m = g == kStrips - 1 ? last_mask : 0xFFFF;
      acc[r][g] = accumulate ? _mm512_maskz_loadu_ps(m, y + r * c_dim + 16 * g) : _mm512_setzero_ps();
    }
  }
  const W* strips[kStrips];
  for (int g = 0; g < kStrips; ++g) strips[g] = ws.At(q + g);
  const int64_t row = ws.panel_cols;  // elements from one weight row to the next
  if constexpr (sizeof(W) == 1) {
    int64_t k = k0;
    if (in.pairs) {  // bf16-valued rows: weight rows 2j, 2j + 1 widened into one bf16 pair operand
      for (; k + 1 < k1; k += 2) {
        for (int g = 0; g < kStrips; ++g) {
          const __m512i pair = Int8Pair(strips[g] + k * row, strips[g] + (k + 1) * row);
          for (int r = 0; r < kRows; ++r) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(in.pairs[r][k / 2]));
            acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, (__m512bh)pair);
          }
        }
      }
    }
    for (; k < k1; ++k) {  // fp32 rows; with pairs, an odd K's last row
      for (int g = 0; g < kStrips; ++g) {
        const __m512 wv = Int8Row(strips[g] + k * row);
        for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][k]), wv, acc[r][g]);
      }
    }
  } else if constexpr (!kBf16) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int g = 0; g < kStrips; ++g) {
        const float* line = strips[g] + k * row;
        const __m512 wv = _mm512_loadu_ps(line);
        for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][k]), wv, acc[r][g]);
      }
    }
  } else {
    // k0 is even; pair rows [k0 / 2, k1 / 2) are whole, and an odd k1 (= K) leaves a half pair.
    const int64_t pair_row = 2 * row;  // elements from one pair row to the next
    const int64_t j0 = k0 / 2, j1 = k1 / 2;
    if (in.pairs) {
      const int64_t j_end = (k1 + 1) / 2;  // the half pair's low halves are 0 in w and x
      for (int64_t j = j0; j < j_end; ++j) {
        for (int g = 0; g < kStrips; ++g) {
          const uint16_t* line = strips[g] + j * pair_row;
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
        for (int g = 0; g < kStrips; ++g) {
          const uint16_t* line = strips[g] + j * pair_row;
          const __m512i raw = _mm512_loadu_si512(line);
          const __m512 first = _mm512_castsi512_ps(_mm512_and_si512(raw, high));  // w[2j]
          // w[2j + 1]; the all-ones zero-masked form is the same vpslld, without GCC 12's false
          // -Wmaybe-uninitialized on the unmasked intrinsic's undefined pass-through operand
          const __m512 second = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAllLanes, raw, 16));
          for (int r = 0; r < kRows; ++r) {
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j]), first, acc[r][g]);
            acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j + 1]), second, acc[r][g]);
          }
        }
      }
      if (k1 % 2) {
        for (int g = 0; g < kStrips; ++g) {
          const __m512i raw = _mm512_loadu_si512(strips[g] + j1 * pair_row);
          const __m512 first = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
          for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_fmadd_ps(_mm512_set1_ps(in.x[r][2 * j1]), first, acc[r][g]);
        }
      }
    }
  }
  if (scales) {
    for (int g = 0; g < kStrips; ++g) {
      const __mmask16 m = g == kStrips - 1 ? last_mask : 0xFFFF;
      const __m512 scale = _mm512_maskz_loadu_ps(m, scales + 16 * g);
      for (int r = 0; r < kRows; ++r) acc[r][g] = _mm512_mul_ps(acc[r][g], scale);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kStrips; ++g) {
      _mm512_mask_storeu_ps(y + r * c_dim + 16 * g, g == kStrips - 1 ? last_mask : 0xFFFF, acc[r][g]);
    }
  }
}

// kRows rows over strips [q, q1), 4 at a time (fewer at C's tail: one 64-column panel, or four
// 16-column ones), weight rows [k0, k1). q is a multiple of 4 (items start at 256-column blocks).
template <int kRows, typename W>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void StreamRows(const BlockRows& in, const Strips<W>& ws,
                                                                     int64_t q, int64_t q1,
                                                                     int64_t k0, int64_t k1, bool accumulate,
                                                                     int64_t c_dim, float* y, const float* scales) {
  for (; q < q1; q += kBlockStrips) {
    const int64_t n = std::min<int64_t>(kBlockStrips, q1 - q);
    const int64_t last_columns = std::min<int64_t>(16, c_dim - 16 * (q + n - 1));
    const __mmask16 mask = static_cast<__mmask16>((1u << last_columns) - 1);
    float* yq = y + 16 * q;
    const float* sq = scales ? scales + 16 * q : nullptr;
    switch (n) {
      case 4: StreamBlock<kRows, 4>(in, ws, q, k0, k1, accumulate, mask, yq, c_dim, sq); break;
      case 3: StreamBlock<kRows, 3>(in, ws, q, k0, k1, accumulate, mask, yq, c_dim, sq); break;
      case 2: StreamBlock<kRows, 2>(in, ws, q, k0, k1, accumulate, mask, yq, c_dim, sq); break;
      default: StreamBlock<kRows, 1>(in, ws, q, k0, k1, accumulate, mask, yq, c_dim, sq); break;
    }
  }
}

// One block of `rows` (1..kMaxBlockRows) rows over strips [q0, q1).
template <typename W>
void StreamBlockRows(const BlockRows& in, int64_t rows, const Strips<W>& ws, int64_t q0, int64_t q1,
                     int64_t k0, int64_t k1, bool accumulate, int64_t c_dim, float* y, const float* scales) {
  switch (rows) {
    case 1: return StreamRows<1>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
    case 2: return StreamRows<2>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
    case 3: return StreamRows<3>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
    case 4: return StreamRows<4>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
    case 5: return StreamRows<5>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
    default: return StreamRows<6>(in, ws, q0, q1, k0, k1, accumulate, c_dim, y, scales);
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
    pairs[r] = buffer.data() + r * k2;
    inexact |= PackPairRow(x[r], k_dim, buffer.data() + r * k2);
  }
  return inexact == 0 ? pairs.data() : nullptr;
}

// Each block streams its 4 strips over as many weight rows as hold kGroupStepBytes (the whole of K
// for K up to 2048 fp32 / 4096 bf16), from L2 after the first block. Rule: steps as long as fit a
// 1 MiB L2, because every step stores and reloads the blocks' sums, so shorter steps cost and
// longer ones fall out of L2 (BENCHMARKS.md).
constexpr int64_t kGroupStepBytes = 512 << 10;

// Columns [c0, c1) (c0 a multiple of 64; c1 = C or a multiple of 64) of y = x @ w for `rows` rows of
// one expert's panel-major weights `w` (panels of `panel_cols` columns), x from `in`. Up to
// kMaxBlockRows rows: one block, each 4 strips over all of K. More: each 4 strips (or their step
// of kGroupStepBytes) for every block of kMaxBlockRows rows and then the block of the rest in turn.
// 6-row x 4-strip blocks (24 zmm sums) are the fastest shape of those compared (8 x 1, 8 x 2,
// 8 x 3, 7 x 3, 4 x 4, 12 x 2; BENCHMARKS.md). `scales` (int8 weights; else nullptr): the expert's
// C column scales, applied as the last k step stores its sums.
template <typename W>
void StreamPanels(const BlockRows& in, int64_t rows, const W* w, int64_t k_dim, int64_t panel_cols, int64_t c0,
                  int64_t c1, int64_t c_dim, float* y, const float* scales = nullptr) {
  const Strips<W> ws{w, panel_cols, PanelElements(k_dim, sizeof(W) == 2, panel_cols)};
  const int64_t q0 = c0 / kStripColumns, q1 = (c1 + kStripColumns - 1) / kStripColumns;
  if (k_dim == 0) {
    for (int64_t r = 0; r < rows; ++r) std::fill(y + r * c_dim + c0, y + r * c_dim + c1, 0.0f);
    return;
  }
  if (rows <= kMaxBlockRows) return StreamBlockRows(in, rows, ws, q0, q1, 0, k_dim, false, c_dim, y, scales);
  // A weight row of 4 strips: 256 B fp32, 128 B bf16 (half a pair row), 64 B int8.
  const int64_t step_k = kGroupStepBytes / (kBlockStrips * kStripColumns * static_cast<int64_t>(sizeof(W)));
  for (int64_t k0 = 0; k0 < k_dim; k0 += step_k) {
    const int64_t k1 = std::min(k_dim, k0 + step_k);
    for (int64_t q = q0; q < q1; q += kBlockStrips) {
      const int64_t q_end = std::min(q1, q + kBlockStrips);
      for (int64_t r = 0; r < rows; r += kMaxBlockRows) {
        const BlockRows block{in.x + r, in.pairs ? in.pairs + r : nullptr};
        StreamBlockRows(block, std::min<int64_t>(kMaxBlockRows, rows - r), ws, q, q_end, k0, k1, k0 > 0, c_dim,
                        y + r * c_dim, k1 == k_dim ? scales : nullptr);
      }
    }
  }
}

}  // namespace expertd::avx512
