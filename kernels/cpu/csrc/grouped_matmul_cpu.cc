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
// ExpertdGroupedMatmulInt8 (and its Gathered twin) take INT8 expert weights (W8A16): int8 panels
// laid out as fp32's, w s8 [E, P, K, W], and per-output-column scales s f32 [E, C]:
//   y[r, c] = (sum_k x[r, k] * float(w[e(r)][k, c])) * s[e(r), c]
// the sum in k order with one rounding per product-add as on every path, then one multiplication
// (the AVX-512 path folds it into the store; the others scale their item's block after it).
// ExpertdGroupedMatmulGathered reads its rows from token rows instead (the permutation's gather
// done in place, so the layer never writes the [N, K] permuted copy of x):
//   y[r, :] = x[source[r], :] @ w[e(r)]   x f32 [T, K], source s32 [N]; a source outside [0, T)
//   (a pad row) reads as zeros.
//
// ExpertdGroupedGlu is the layer's first half in one call: per item its block of the gate
// projection into h, the same block of the up projection (the same path, the same bits as the
// grouped matmul's) into a buffer of the item's thread, then the gated activation over both into h
// (gated_activation.h), so the gate / up pair is never written to memory:
//   h[r, :] = glu(x[source[r]] @ w_gate[e(r)] (+ b_gate[e(r)]), x[source[r]] @ w_up[e(r)] (+ b_up[e(r)]))
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
// Paths per item (Path; counted in path_items, grouped_matmul_paths.h), chosen by BlockAvx2 here:
// - bf16 panel-major weights times bf16-valued rows, kAmxMinRows rows or more, on CPUs with AMX
//   tiles that round as the FMAs do: amx::Panels (amx_tiles.h).
// - Panel-major weights on AVX-512 CPUs, every row count: avx512::StreamPanels
//   (panel_stream_avx512.h; bf16-valued rows times bf16 weights on the bf16 dot product where the
//   CPU has one that rounds as the FMAs do).
// - Otherwise, by the item's rows (kPackedMinRows):
//   - Streaming (few rows: memory-bound; stream_avx2.h). The expert's weights are read once, in
//     place, bf16 widened in registers. Panel-major weights: StreamPanels. Row-major, loop order: k in steps of
//     kRowsPerStep weight rows (kRowsPerStepOneBlock for items of up to 4 rows), row blocks of up
//     to 4, column chunks: the accumulators of a row block (8 ymm: 4 rows x 16 columns, 2 x 32 or
//     1 x 64 for bf16) stay in registers across the step, and the item's output block (rows x
//     kBlockColumns fp32) in L1/L2. The first row block of a step also prefetches the next step's
//     weight rows (PrefetchNextStep).
//   - Packed (many rows: compute-bound; packed_avx2.h). BLIS-style blocking, see BlockPacked;
//     panel-major weights skip its per-call repacking up to kPackRowsL2 rows (PackedPanel).
// - CPUs without AVX2 / FMA: BlockScalar (expert_weights.h); on the others it computes the column
//   tail past the last 16-column chunk of the AVX2 paths.
//
// This file holds the work split (items, ParallelFor), the choice of path per item, the shape
// checks, and the XLA FFI handlers but the fused one's (grouped_glu_cpu.cc, through
// grouped_matmul_entry.h); the library's C entry points are in library.cc.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "expert_weights.h"
#include "gated_activation.h"
#include "grouped_matmul_entry.h"
#include "grouped_matmul_paths.h"
#include "packed_avx2.h"
#include "panel_layout.h"
#include "panel_stream_avx512.h"
#include "parallel.h"
#include "simd.h"
#include "stream_avx2.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using expertd::HasAvx2;
using expertd::Path;
using expertd::gmm::BlockPacked;
using expertd::gmm::BlockScalar;
using expertd::gmm::ExpertWeights;
using expertd::gmm::kPackedMinRows;
using expertd::gmm::Stream;
using expertd::gmm::StreamPanels;

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
// INT8 weights times bf16-valued rows take the bf16 dot product (weight row pairs widened into its
// operand, panel_stream_avx512.h Int8Pair) from this many rows of an expert; fewer rows keep the
// FMAs, where the pair's extra shift and OR are not paid back by fewer multiply instructions.
constexpr int64_t kInt8DotMinRows = 2;

// y[r, c] *= scales[c] for `rows` rows (c_dim apart) and columns [c0, c1): int8 weights' scales on
// the paths that do not fold them into their store.
void ScaleColumns(int64_t rows, int64_t c0, int64_t c1, int64_t c_dim, const float* scales, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = c0; c < c1; ++c) y[r * c_dim + c] *= scales[c];
  }
}

// An item's rows as the bf16 dot products read them (AMX tiles' A rows, the AVX-512 dot product's
// pair rows), each made on first use: the fused call's two projections of one item convert x once.
// The buffers are the item's thread's (amx::AmxRows, avx512::PairRows), and the item's calls run
// back to back on it.
struct RowOperands {
  const uint32_t* amx = nullptr;  // nullptr: a value is not exact in bf16 (or not made yet)
  int64_t amx_stride = 0;
  bool amx_made = false;
  const uint32_t* const* pairs = nullptr;
  bool pairs_made = false;
};

// `scales`: the expert's C column scales for int8 weights (nullptr for fp32 / bf16).
template <typename W>
__attribute__((target("avx2,fma"))) Path BlockAvx2(const float* const* x, int64_t rows,
                                                   const ExpertWeights<W>& w, int64_t c0, int64_t c1,
                                                   float* y, const float* scales, RowOperands& ops) {
  // bf16 panels times bf16-valued rows of kAmxMinRows or more on AMX tiles (amx_tiles.h), where the
  // CPU runs them (Isa::kAmxBf16) or the tests run the tiles' software model.
  if constexpr (ExpertWeights<W>::kBf16) {
    const int emulated = expertd::amx::EmulatedOrder().load(std::memory_order_relaxed);
    if (w.Panels() && rows >= expertd::amx::kAmxMinRows && (emulated || expertd::CpuIsa() >= expertd::Isa::kAmxBf16)) {
      if (!ops.amx_made) ops.amx = expertd::amx::AmxRows(x, rows, w.k_dim, &ops.amx_stride);
      ops.amx_made = true;
      if (ops.amx) {
        const auto panels = emulated ? &expertd::amx::Panels<expertd::amx::EmulatedTiles>
                                     : &expertd::amx::Panels<expertd::amx::HardwareTiles>;
        panels(ops.amx, ops.amx_stride, rows, w.w, w.k_dim, w.panel_cols, c0, c1, w.c_dim, y);
        return expertd::kPathAmxBf16;
      }
    }
  }
  // Panel-major weights on AVX-512 CPUs: every row count (its register blocks of up to 6 x 4 strips
  // streaming all of K are at least level with the packed path at every row count; BENCHMARKS.md
  // "Native CPU kernel"), bf16-valued rows on the bf16 dot product; the column tail
  // included.
  if (w.Panels() && expertd::CpuIsa() >= expertd::Isa::kAvx512) {
    const uint32_t* const* pairs = nullptr;
    if ((ExpertWeights<W>::kBf16 || (scales && rows >= kInt8DotMinRows)) &&
        expertd::CpuIsa() >= expertd::Isa::kAvx512Bf16) {
      if (!ops.pairs_made) ops.pairs = expertd::avx512::PairRows(x, rows, w.k_dim);
      ops.pairs_made = true;
      pairs = ops.pairs;
    }
    expertd::avx512::StreamPanels({x, pairs}, rows, w.w, w.k_dim, w.panel_cols, c0, c1, w.c_dim, y, scales);
    return pairs ? expertd::kPathAvx512Bf16Dot : expertd::kPathAvx512Fma;
  }
  const int64_t c_vec = c0 + (c1 - c0) / 16 * 16;
  if (c_vec < c1) BlockScalar(x, rows, w, c_vec, c1, y);
  Path path = expertd::kPathPortable;
  if (c_vec > c0 && rows >= kPackedMinRows) {
    BlockPacked(x, rows, w, c0, c_vec, y);
    path = expertd::kPathAvx2Packed;
  } else if (c_vec > c0) {
    if (w.Panels()) {
      StreamPanels(x, rows, w, c0, c_vec, y);
    } else {
      Stream(x, rows, w, c0, c_vec, y);
    }
    path = expertd::kPathAvx2Stream;
  }
  if (scales) ScaleColumns(rows, c0, c1, w.c_dim, scales, y);
  return path;
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

// The fused gate / up projection's second half (ExpertdGroupedGlu): each item computes its block of
// the gate projection into y, the same block of the up projection into a buffer of its thread's,
// then the gated activation over both into y (gated_activation.h).
template <typename W>
struct UpProjection {
  const W* w;              // the up weights, laid out as the gate's
  const float* scales;     // [E, C] int8 column scales, or nullptr
  const float* bias_gate;  // [E, C] or nullptr
  const float* bias_up;    // [E, C] or nullptr
  expertd::glu::Activation activation;
};

// This thread's buffer for an item's up block: `floats` of them, grown as needed and kept for the
// thread's life: at most an expert's rows x C floats (in the layer, at most T rows an expert).
float* UpScratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// `w` holds E experts of k_dim x c_dim weights, row-major (panel_cols 0) or panel-major in panels
// of panel_cols columns; `scales` [E, c_dim] the int8 weights' column scales (else nullptr). With
// `up`: y = glu(x @ w[e] (+ b_gate), x @ up->w[e] (+ b_up)) instead of x @ w[e].
template <typename W>
void GroupedMatmul(ffi::ThreadPool& pool, const RowSource& rows_in, int64_t n,
                   const int32_t* group_sizes, int64_t e_dim, const W* w, int64_t c_dim, int64_t panel_cols,
                   float* y, const float* scales = nullptr, const UpProjection<W>* up = nullptr) {
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
  const int64_t work = row * k_dim * c_dim * (up ? 2 : 1);  // multiply-adds: every row an expert owns
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
    // One projection's block of this item into out (c_dim floats a row), counted by its path.
    RowOperands ops;
    const auto block = [&](const W* weights, const float* column_scales, float* out) {
      const ExpertWeights<W> we{weights + it.expert * expert_elems, k_dim, c_dim, panel_cols};
      const float* se = column_scales ? column_scales + it.expert * c_dim : nullptr;
      Path path = expertd::kPathPortable;
      if (HasAvx2()) {
        path = BlockAvx2(x.data(), it.rows, we, it.c0, it.c1, out, se, ops);
      } else {
        BlockScalar(x.data(), it.rows, we, it.c0, it.c1, out);
        if (se) ScaleColumns(it.rows, it.c0, it.c1, c_dim, se, out);
      }
      expertd::path_items[path].fetch_add(1, std::memory_order_relaxed);
    };
    float* ye = y + it.row0 * c_dim;
    block(w, scales, ye);
    if (!up) return;
    float* u = UpScratch((it.rows - 1) * c_dim + it.c1);  // written at [r c_dim + c0, r c_dim + c1)
    block(up->w, up->scales, u);
    const float* bg = up->bias_gate ? up->bias_gate + it.expert * c_dim : nullptr;
    const float* bu = up->bias_up ? up->bias_up + it.expert * c_dim : nullptr;
    if (HasAvx2()) {
      expertd::glu::ApplyAvx2(up->activation, it.rows, it.c0, it.c1, c_dim, ye, u, bg, bu);
    } else {
      expertd::glu::ApplyScalar(up->activation, it.rows, it.c0, it.c1, c_dim, ye, u, bg, bu);
    }
  });
}

}  // namespace

namespace expertd::gmm {

// grouped_matmul_entry.h has the contracts of Run, CheckShapes and CheckScales.
ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const int32_t* source, int64_t n,
               ffi::Buffer<ffi::S32>& group_sizes, ffi::AnyBuffer& w, bool panels, float* y, int64_t c_dim,
               const float* scales, const GluOperands* glu) {
  const int64_t e_dim = w.dimensions()[0], k_dim = x.dimensions()[1];
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  const int64_t panel_cols = panels ? w.dimensions()[3] / (bf16 ? 2 : 1) : 0;
  std::vector<float> zeros(k_dim, 0.0f);
  const RowSource rows_in{x.typed_data(), x.dimensions()[0], k_dim, source, zeros.data()};
  const auto run = [&](const auto* typed_w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(typed_w)>>;
    UpProjection<W> up{};
    if (glu) up = {static_cast<const W*>(glu->w_up), glu->scales_up, glu->bias_gate, glu->bias_up, glu->activation};
    GroupedMatmul(pool, rows_in, n, group_sizes.typed_data(), e_dim, typed_w, c_dim, panel_cols, y, scales,
                  glu ? &up : nullptr);
    return ffi::Error::Success();
  };
  if (scales) {
    if (w.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("int8 entry: w must be int8");
    return run(w.reinterpret_data<int8_t>());
  }
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return run(w.typed_data<float>());
    case ffi::DataType::BF16:
      return run(w.reinterpret_data<uint16_t>());
    default:
      return ffi::Error::InvalidArgument("w must be float32 or bfloat16");
  }
}

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

ffi::Error CheckScales(ffi::AnyBuffer& w, ffi::Buffer<ffi::F32>& scales, ffi::ResultBuffer<ffi::F32>& y) {
  const auto sd = scales.dimensions();
  if (w.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("w must be int8 panels");
  if (sd.size() != 2 || sd[0] != w.dimensions()[0] || sd[1] != y->dimensions()[1]) {
    return ffi::Error::InvalidArgument("scales must be [E, C], one per expert and output column");
  }
  return ffi::Error::Success();
}

}  // namespace expertd::gmm

namespace {

using expertd::gmm::CheckScales;
using expertd::gmm::CheckShapes;
using expertd::gmm::Run;

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

ffi::Error Int8(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, const int32_t* source,
                ffi::Buffer<ffi::S32>& group_sizes, ffi::AnyBuffer& w, ffi::Buffer<ffi::F32>& scales,
                ffi::ResultBuffer<ffi::F32>& y) {
  if (auto err = CheckShapes(x, group_sizes, w, true, y); err.failure()) return err;
  if (auto err = CheckScales(w, scales, y); err.failure()) return err;
  return Run(pool, x, source, y->dimensions()[0], group_sizes, w, true, y->typed_data(), y->dimensions()[1],
             scales.typed_data());
}

ffi::Error GroupedMatmulInt8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> group_sizes,
                                 ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  if (y->dimensions().size() != 2 || x.dimensions()[0] != y->dimensions()[0]) {
    return ffi::Error::InvalidArgument("y must have the rows of x");
  }
  return Int8(pool, x, nullptr, group_sizes, w, scales, y);
}

ffi::Error GroupedMatmulInt8GatheredImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> source,
                                         ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w,
                                         ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y) {
  if (y->dimensions().size() != 2 || source.dimensions().size() != 1 || source.dimensions()[0] != y->dimensions()[0]) {
    return ffi::Error::InvalidArgument("source must be [N], one x row index per output row");
  }
  return Int8(pool, x, source.typed_data(), group_sizes, w, scales, y);
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

auto Int8Binding() {  // x, group_sizes, w, scales
  return Binding().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>();
}

auto Int8GatheredBinding() {  // x, source, group_sizes, w, scales
  return Binding()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulInt8, GroupedMatmulInt8Impl, Int8Binding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulInt8Gathered, GroupedMatmulInt8GatheredImpl, Int8GatheredBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmul, GroupedMatmulImpl<false>, PlainBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulGathered, GroupedMatmulGatheredImpl<false>, GatheredBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulPanels, GroupedMatmulImpl<true>, PlainBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedMatmulPanelsGathered, GroupedMatmulGatheredImpl<true>, GatheredBinding());
