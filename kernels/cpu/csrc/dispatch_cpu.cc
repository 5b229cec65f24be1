// Token dispatch on CPU, as XLA FFI custom calls: the permutation layout and the weighted combine
// of kernels/dispatch.py, in the same layout (moe-semantics.md 3.1; dispatch.py's docstring).
//
// ExpertdDispatchLayout: a stable counting sort of the (token, slot) copies by expert.
//   flat s32 [T*k] (copy t*k + j -> expert; outside [0, E): not routed), attrs topk, align_size
//   -> dest s32 [T*k] (row of each copy, N if not routed), token_of_row s32 [N] (T for pad rows
//      and the unused tail), group_sizes / group_offsets / tokens_per_expert s32 [E].
//   One counting pass and one placing pass, O(T*k + E), where XLA:CPU sorts the copies (BENCHMARKS.md).
//
// ExpertdCombine: out[t] = sum_j w[t, j] * rows[dest[t, j]] in fp32, j in order; copies whose row is
//   outside [0, N) add nothing and their rows are never read.
//   rows f32 or bf16 [N, H], dest s32 [T, k], weights f32 [T, k] -> out f32 [T, H].
//   Each routed row is read once and never copied, where XLA's gather-multiply-reduce materialises
//   the [T, k, H] copies (BENCHMARKS.md).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> flat, ffi::ResultBuffer<ffi::S32> dest,
                      ffi::ResultBuffer<ffi::S32> token_of_row, ffi::ResultBuffer<ffi::S32> group_sizes,
                      ffi::ResultBuffer<ffi::S32> group_offsets,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert, int64_t topk, int64_t align_size) {
  const int64_t copies = flat.element_count(), n = token_of_row->element_count();
  const int64_t e_dim = group_sizes->element_count();
  if (topk < 1 || copies % topk != 0) return ffi::Error::InvalidArgument("flat must be [T*k] with k = topk >= 1");
  if (static_cast<int64_t>(dest->element_count()) != copies) return ffi::Error::InvalidArgument("dest must be [T*k] like flat");
  if (static_cast<int64_t>(group_offsets->element_count()) != e_dim ||
      static_cast<int64_t>(tokens_per_expert->element_count()) != e_dim) {
    return ffi::Error::InvalidArgument("group_sizes, group_offsets and tokens_per_expert must be [E]");
  }
  const int32_t* ids = flat.typed_data();
  int32_t *sizes = group_sizes->typed_data(), *offsets = group_offsets->typed_data();
  int32_t* counts = tokens_per_expert->typed_data();
  std::fill(counts, counts + e_dim, 0);
  for (int64_t c = 0; c < copies; ++c) {
    if (ids[c] >= 0 && ids[c] < e_dim) ++counts[ids[c]];
  }
  std::vector<int64_t> next_row(e_dim);
  int64_t start = 0;
  for (int64_t e = 0; e < e_dim; ++e) {
    const int64_t size = align_size > 1 ? (counts[e] + align_size - 1) / align_size * align_size : counts[e];
    sizes[e] = static_cast<int32_t>(size);
    offsets[e] = static_cast<int32_t>(start);
    next_row[e] = start;
    start += size;
  }
  if (start > n) return ffi::Error::InvalidArgument("token_of_row has fewer rows than the aligned groups need");
  const int32_t num_tokens = static_cast<int32_t>(copies / topk);
  int32_t* rows = token_of_row->typed_data();
  std::fill(rows, rows + n, num_tokens);
  int32_t* out = dest->typed_data();
  for (int64_t c = 0; c < copies; ++c) {  // copies in (t, j) order: tokens ascend inside an expert
    if (ids[c] < 0 || ids[c] >= e_dim) {
      out[c] = static_cast<int32_t>(n);
      continue;
    }
    const int64_t row = next_row[ids[c]]++;
    out[c] = static_cast<int32_t>(row);
    rows[row] = static_cast<int32_t>(c / topk);
  }
  return ffi::Error::Success();
}

// out[0:h] += w * row[0:h]; a multiply then an add (no FMA, as XLA's combine rounds).
template <typename R>
void AddScaledScalar(float* out, const R* row, float w, int64_t h, int64_t from) {
  for (int64_t i = from; i < h; ++i) out[i] = out[i] + w * expertd::Load(row, i);
}

template <typename R>
__attribute__((target("avx2,fma"))) void AddScaledAvx2(float* out, const R* row, float w, int64_t h) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= h; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_mul_ps(wv, expertd::Load8(row + i))));
  }
  AddScaledScalar(out, row, w, h, i);
}

constexpr int64_t kCombineTokensPerTask = 16;

template <typename R>
void Combine(ffi::ThreadPool& pool, const R* rows, int64_t n, int64_t h, const int32_t* dest,
             const float* weights, int64_t t_dim, int64_t topk, float* out) {
  const int64_t tasks = (t_dim + kCombineTokensPerTask - 1) / kCombineTokensPerTask;
  const bool avx2 = expertd::HasAvx2();
  expertd::ParallelFor(pool, tasks, t_dim * topk * h, [&](int64_t task) {
    const int64_t t1 = std::min(t_dim, (task + 1) * kCombineTokensPerTask);
    for (int64_t t = task * kCombineTokensPerTask; t < t1; ++t) {
      float* o = out + t * h;
      std::fill(o, o + h, 0.0f);
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t d = dest[t * topk + j];
        if (d < 0 || d >= n) continue;
        if (avx2) {
          AddScaledAvx2(o, rows + d * h, weights[t * topk + j], h);
        } else {
          AddScaledScalar(o, rows + d * h, weights[t * topk + j], h, 0);
        }
      }
    }
  });
}

ffi::Error CombineImpl(ffi::ThreadPool pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> dest,
                       ffi::Buffer<ffi::F32> weights, ffi::ResultBuffer<ffi::F32> out) {
  const auto rd = rows.dimensions(), dd = dest.dimensions(), od = out->dimensions();
  if (rd.size() != 2 || dd.size() != 2 || od.size() != 2) {
    return ffi::Error::InvalidArgument("expected rows [N, H], dest [T, k], weights [T, k], out [T, H]");
  }
  if (weights.dimensions().size() != 2 || weights.dimensions()[0] != dd[0] ||
      weights.dimensions()[1] != dd[1] || od[0] != dd[0] || od[1] != rd[1]) {
    return ffi::Error::InvalidArgument("shapes disagree: rows [N, H], dest [T, k], weights [T, k], out [T, H]");
  }
  switch (rows.element_type()) {
    case ffi::DataType::F32:
      Combine(pool, rows.typed_data<float>(), rd[0], rd[1], dest.typed_data(), weights.typed_data(), dd[0],
              dd[1], out->typed_data());
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      Combine(pool, rows.reinterpret_data<uint16_t>(), rd[0], rd[1], dest.typed_data(), weights.typed_data(),
              dd[0], dd[1], out->typed_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("rows must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdDispatchLayout, LayoutImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("topk")
                                  .Attr<int64_t>("align_size"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdCombine, CombineImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
