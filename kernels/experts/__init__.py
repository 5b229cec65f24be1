"""Grouped expert FFN: every expert's gated MLP over its block of expert-major rows, by backend.

    y = glu(x @ W_gate[e] + b_gate[e], x @ W_up[e] + b_up[e]) @ W_down[e] + b_down[e]
    (SwiGLU: glu(g, u) = silu(g) * u, no biases)

Public API (the expert-parallel layer reuses it; N rows, H hidden, I intermediate, E experts):

  grouped_ffn(xs [N, H], group_sizes int32 [E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H],
              *, activation="silu", backend="auto", capacity=None, biases=None) -> [N, H] xs.dtype
      The contract of `expertd.kernels.ffn` (expert-major rows, rows past sum(group_sizes) never
      read and zero, fp32 accumulation). `activation`: a name of ACTIVATIONS or a
      `ffn.GatedActivation` (the clamped / gpt-oss variants; `ffn.expert_activation(cfg)` is a
      layer's). `biases`: an `ffn.ExpertBiases` (gate [E, I], up [E, I], down [E, H]) or None;
      every backend takes both. `capacity` (static int, "capacity" backend only): rows per
      expert in the padded [E, C, H] buffer; None = dropless (C = N, or pass the largest possible
      group, e.g. T for a top-k layout). Rows past the capacity of their expert are dropped
      (zeros). The weights may be in the native CPU backend's prepared layout
      (`moe.prepare_params`): "native_cpu" reads them as they are, the others through
      `cpu.dense_weights` (a relayout per call: correct, not fast).

  The weights may also be `Fp8BlockWeights` (experts/fp8.py: e4m3 codes [E, K, C] and fp32 scales
  per 128 x 128 block, as FP8 checkpoints ship them; `quantize_fp8_blocks`, `dequantize`): "pallas"
  and "tokamax" read the codes in the kernel, the other backends dequantise them per call.

  Backends:
      "reference"   per-expert loop over all rows (clarity, E x FLOPs; `ffn.grouped_ffn_reference`)
      "ragged_dot"  jax.lax.ragged_dot (a real grouped GEMM on GPU/TPU; E x FLOPs on CPU)
      "capacity"    rows scattered into [E, C, H], one batched matmul per projection
      "expert_loop" loop over the experts that have rows, each running only its rows in row tiles
      "native_cpu"  the C++ XLA:CPU custom calls of `expertd.kernels.cpu` (CPU only)
      "pallas"      fused grouped-GEMM Pallas kernel (experts/pallas.py): compiled with
                    Pallas-Triton on GPU, interpret mode on CPU; reads FP8 weights itself
      "tokamax"     tokamax.ragged_dot per projection (experts/tokamax.py): its Mosaic GPU kernels
                    on sm90 / sm100, XLA's ragged_dot on CPU; reads FP8 weights itself; needs the
                    `tokamax` extra (imported on first use; `TokamaxMissing` without it). "auto"
                    does not pick it until a GPU run shows where it wins.
      "auto"        chosen per platform and shape by `choose_backend`

  choose_backend(num_rows, E, H, I, dtype, platform=None) -> the backend "auto" runs.
  compiler_options(num_rows, E, H, I, *, dtype, backend="auto", platform=None) -> dict of XLA
      compiler options for the jit of a program running the grouped FFN at that shape and weight
      dtype (per compiled shape: a server passes them per token bucket); non-empty only on CPU
      (`cpu.compiler_options`).

An op family in megablox's manner: this door exports the public names; beside it
  ops     check_backend, choose_backend, compiler_options, grouped_ffn (the backend choice)
  xla     the "ragged_dot", "capacity" and "expert_loop" backends
  pallas  the "pallas" backend (PallasTiles, default_tiles, grouped_ffn_pallas)
  tokamax the "tokamax" backend (grouped_ffn_tokamax, tokamax_weights; tokamax imported lazily)
  fp8     block-scaled FP8 expert weights (Fp8BlockWeights)
The contract and the per-expert reference are `expertd.kernels.ffn`'s; "native_cpu" is
`expertd.kernels.cpu`'s. Imports point inward: ops uses xla, pallas, tokamax, fp8, ffn and cpu;
pallas and tokamax use fp8.
"""
from expertd.kernels.config import ACTIVATIONS
from expertd.kernels.experts.fp8 import Fp8BlockWeights, dequantize, is_fp8, quantize_fp8_blocks
from expertd.kernels.experts.ops import (
    BACKENDS,
    GPU_PALLAS_MIN_ROWS,
    check_backend,
    choose_backend,
    compiler_options,
    grouped_ffn,
)
from expertd.kernels.experts.pallas import grouped_ffn_pallas
from expertd.kernels.experts.tokamax import TokamaxMissing, grouped_ffn_tokamax
from expertd.kernels.experts.tokamax import prepare_weights as tokamax_weights
from expertd.kernels.experts.xla import (
    CAPACITY_BUCKETS,
    LOOP_TILES,
    capacity_buckets,
    capacity_slots,
    expert_weights_f32,
    grouped_ffn_capacity,
    grouped_ffn_expert_loop,
    grouped_ffn_ragged_dot,
)
from expertd.kernels.ffn import (
    ExpertBiases,
    GatedActivation,
    activation_fn,
    as_gated_activation,
    check_ffn_args,
    gated_mlp,
    grouped_ffn_reference,
    matmul_f32,
    matmul_precision,
    row_experts,
)

__all__ = [
    "ACTIVATIONS", "BACKENDS", "CAPACITY_BUCKETS", "GPU_PALLAS_MIN_ROWS", "LOOP_TILES", "ExpertBiases",
    "Fp8BlockWeights", "GatedActivation", "TokamaxMissing", "activation_fn", "as_gated_activation", "dequantize",
    "grouped_ffn_tokamax", "is_fp8", "quantize_fp8_blocks", "tokamax_weights",
    "capacity_buckets", "capacity_slots", "check_backend", "check_ffn_args", "choose_backend", "compiler_options",
    "expert_weights_f32", "gated_mlp", "grouped_ffn", "grouped_ffn_capacity", "grouped_ffn_expert_loop",
    "grouped_ffn_pallas", "grouped_ffn_ragged_dot", "grouped_ffn_reference", "matmul_f32", "matmul_precision",
    "row_experts",
]
