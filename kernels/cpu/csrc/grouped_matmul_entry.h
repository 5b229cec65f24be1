// The grouped matmul's work and shape checks as the XLA FFI handlers outside grouped_matmul_cpu.cc
// call them (grouped_glu_cpu.cc, the fused gate / up entry point): Run, the work on any weight
// dtype and layout, with the fused call's operands (GluOperands); CheckShapes and CheckScales, the
// checks every entry point shares. Defined in grouped_matmul_cpu.cc.
#pragma once

#include <cstdint>

#include "gated_activation.h"
#include "xla/ffi/api/ffi.h"

namespace expertd::gmm {

// The fused entry point's operands beyond the gate projection's: the up weights (laid out as the
// gate's), their int8 scales, the biases, the activation (any pointer may be nullptr but w_up).
struct GluOperands {
  const void* w_up;
  const float* scales_up;
  const float* bias_gate;
  const float* bias_up;
  expertd::glu::Activation activation;
};

// Output row r of y [n, C] reads x [M, K] row source[r] (or row r without a source); w is [E, K, C],
// or with `panels` [E, P, K, W] (fp32) / [E, P, ceil(K/2), 2 W] (bf16); with `scales` ([E, C]) int8
// panels; with `glu` y = glu(x @ w, x @ glu->w_up) (gated_activation.h).
xla::ffi::Error Run(xla::ffi::ThreadPool& pool, xla::ffi::Buffer<xla::ffi::F32>& x, const int32_t* source, int64_t n,
                    xla::ffi::Buffer<xla::ffi::S32>& group_sizes, xla::ffi::AnyBuffer& w, bool panels, float* y,
                    int64_t c_dim, const float* scales = nullptr, const GluOperands* glu = nullptr);

// x [M, K], group_sizes [E], y [N, C], and w [E, K, C] or (`panels`) [E, ceil(C / W), K, W] (fp32) /
// [E, ceil(C / W), ceil(K / 2), 2 W] (bf16), W 16 or 64.
xla::ffi::Error CheckShapes(xla::ffi::Buffer<xla::ffi::F32>& x, xla::ffi::Buffer<xla::ffi::S32>& group_sizes,
                            xla::ffi::AnyBuffer& w, bool panels, xla::ffi::ResultBuffer<xla::ffi::F32>& y);

// int8 panels w s8 [E, P, K, W] with scales f32 [E, C] (C: y's columns).
xla::ffi::Error CheckScales(xla::ffi::AnyBuffer& w, xla::ffi::Buffer<xla::ffi::F32>& scales,
                            xla::ffi::ResultBuffer<xla::ffi::F32>& y);

}  // namespace expertd::gmm
