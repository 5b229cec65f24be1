// The fused gate / up projection with the gated activation as an XLA FFI custom call
// (ExpertdGroupedGlu, ../ffi.py grouped_glu): the layer's first half in one call, on the grouped
// matmul's items and paths (grouped_matmul_cpu.cc, through grouped_matmul_entry.h), each item's
// gate and up blocks then gated_activation.h's epilogue over them; this file holds its shape checks
// and binding.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gated_activation.h"
#include "grouped_matmul_entry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using expertd::gmm::CheckScales;
using expertd::gmm::CheckShapes;
using expertd::gmm::GluOperands;
using expertd::gmm::Run;

namespace {

// The fused gate / up projection with the gated activation (the layer's first half, one call):
//   x f32 [M, K], source s32 [N], group_sizes s32 [E], w_gate and w_up of one layout and dtype (an
//   entry point's w: [E, K, C] row-major or panels; int8 panels with scales_gate / scales_up f32
//   [E, C], else those with no elements), bias_gate / bias_up f32 [E, C] or no elements; attrs
//   kind, limit_mode, limit, alpha, round_bf16 (gated_activation.h)  ->  h f32 [N, C]
ffi::Error GroupedGluImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> source,
                          ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                          ffi::Buffer<ffi::F32> scales_gate, ffi::Buffer<ffi::F32> scales_up,
                          ffi::Buffer<ffi::F32> bias_gate, ffi::Buffer<ffi::F32> bias_up, int32_t kind,
                          int32_t limit_mode, float limit, float alpha, int32_t round_bf16,
                          ffi::ResultBuffer<ffi::F32> h) {
  const bool panels = w_gate.dimensions().size() == 4, int8 = w_gate.element_type() == ffi::DataType::S8;
  if (auto err = CheckShapes(x, group_sizes, w_gate, panels, h); err.failure()) return err;
  const auto gd = w_gate.dimensions(), ud = w_up.dimensions();
  if (w_up.element_type() != w_gate.element_type() || gd.size() != ud.size() ||
      !std::equal(gd.begin(), gd.end(), ud.begin())) {
    return ffi::Error::InvalidArgument("w_up must have w_gate's dtype and shape");
  }
  if (source.dimensions().size() != 1 || source.dimensions()[0] != h->dimensions()[0]) {
    return ffi::Error::InvalidArgument("source must be [N], one x row index per output row");
  }
  if (int8) {
    if (!panels) return ffi::Error::InvalidArgument("int8 weights must be panels");
    if (auto err = CheckScales(w_gate, scales_gate, h); err.failure()) return err;
    if (auto err = CheckScales(w_up, scales_up, h); err.failure()) return err;
  } else if (scales_gate.element_count() != 0 || scales_up.element_count() != 0) {
    return ffi::Error::InvalidArgument("scales are for int8 weights only: pass none (no elements)");
  }
  const int64_t e_dim = gd[0], c_dim = h->dimensions()[1];
  const auto bias = [&](ffi::Buffer<ffi::F32>& b, bool* ok) -> const float* {
    const auto bd = b.dimensions();
    *ok = b.element_count() == 0 || (bd.size() == 2 && bd[0] == e_dim && bd[1] == c_dim);
    return b.element_count() == 0 ? nullptr : b.typed_data();
  };
  bool gate_ok, up_ok;
  const float *bg = bias(bias_gate, &gate_ok), *bu = bias(bias_up, &up_ok);
  if (!gate_ok || !up_ok) return ffi::Error::InvalidArgument("bias_gate and bias_up must be [E, C] or have no elements");
  if (kind < 0 || kind > 2 || limit_mode < 0 || limit_mode > 2) {
    return ffi::Error::InvalidArgument("kind must be 0 (silu), 1 (gelu_tanh) or 2 (swiglu_oai); limit_mode 0-2");
  }
  if (limit_mode != 0 && !(std::isfinite(limit) && limit > 0.0f)) {
    return ffi::Error::InvalidArgument("limit must be a finite float > 0 with a limit mode");
  }
  const GluOperands glu{w_up.untyped_data(), int8 ? scales_up.typed_data() : nullptr, bg, bu,
                        {static_cast<expertd::glu::Kind>(kind), static_cast<expertd::glu::LimitMode>(limit_mode),
                         limit, alpha, round_bf16 != 0}};
  return Run(pool, x, source.typed_data(), h->dimensions()[0], group_sizes, w_gate, panels, h->typed_data(), c_dim,
             int8 ? scales_gate.typed_data() : nullptr, &glu);
}

auto GluBinding() {  // x, source, group_sizes, w_gate, w_up, scales_gate, scales_up, bias_gate, bias_up
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Attr<int32_t>("kind")
      .Attr<int32_t>("limit_mode")
      .Attr<float>("limit")
      .Attr<float>("alpha")
      .Attr<int32_t>("round_bf16")
      .Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ExpertdGroupedGlu, GroupedGluImpl, GluBinding());
