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

  Backends:
      "reference"   per-expert loop over all rows (clarity, E x FLOPs; `ffn.grouped_ffn_reference`)
      "ragged_dot"  jax.lax.ragged_dot (a real grouped GEMM on GPU/TPU; E x FLOPs on CPU)
      "capacity"    rows scattered into [E, C, H], one batched matmul per projection
      "expert_loop" loop over the experts that have rows, each running only its rows in row tiles
      "native_cpu"  the C++ XLA:CPU custom calls of `expertd.kernels.cpu` (CPU only)
      "pallas"      fused grouped-GEMM Pallas kernel (experts_pallas.py): compiled with
                    Pallas-Triton on GPU, interpret mode on CPU
      "auto"        chosen per platform and shape by `choose_backend`

  choose_backend(num_rows, E, H, I, dtype, platform=None) -> the backend "auto" runs.
  compiler_options(num_rows, E, H, I, *, dtype, backend="auto", platform=None) -> dict of XLA
      compiler options for the jit of a program running the grouped FFN at that shape and weight
      dtype (per compiled shape: a server passes them per token bucket); non-empty only on CPU
      (`cpu.compiler_options`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from expertd.kernels import cpu
from expertd.kernels.config import ACTIVATIONS
from expertd.kernels.experts_pallas import grouped_ffn_pallas
from expertd.kernels.experts_xla import (
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
from expertd.kernels.names import EXPERT_BACKENDS
from expertd.kernels.params import logical_shape

BACKENDS = EXPERT_BACKENDS  # kernels/names.py, JAX-free
# GPU, bf16 weights: from this many rows (T*k) on, the Pallas grouped GEMM beats ragged_dot
# (BENCHMARKS.md, GPU section); below it ragged_dot is faster.
GPU_PALLAS_MIN_ROWS = 2048

__all__ = [
    "ACTIVATIONS", "BACKENDS", "CAPACITY_BUCKETS", "GPU_PALLAS_MIN_ROWS", "LOOP_TILES", "ExpertBiases",
    "GatedActivation", "activation_fn", "as_gated_activation",
    "capacity_buckets", "capacity_slots", "check_backend", "check_ffn_args", "choose_backend", "compiler_options",
    "expert_weights_f32", "gated_mlp", "grouped_ffn", "grouped_ffn_capacity", "grouped_ffn_expert_loop",
    "grouped_ffn_pallas", "grouped_ffn_ragged_dot", "grouped_ffn_reference", "matmul_f32", "matmul_precision",
    "row_experts",
]


def check_backend(backend: str) -> None:
    """ValueError unless `backend` is "auto" or one of BACKENDS."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")


def choose_backend(num_rows: int, num_experts: int, hidden: int, intermediate: int, dtype,
                   platform: str | None = None) -> str:
    """The backend "auto" runs for `num_rows` (= T*k) rows of this shape on this platform.

    `dtype` is the expert weights' dtype. GPU: the Pallas grouped GEMM for bf16 weights from
    GPU_PALLAS_MIN_ROWS rows on (H and I multiples of 16), "ragged_dot" (XLA's grouped GEMM) below
    that, for fp32 weights and on other accelerators. "capacity" is never chosen on GPU: its
    dropless buffer is E x the rows. CPU: `cpu.choose_backend` ("native_cpu" whenever its library
    is available, else "capacity" or "expert_loop"; its module docstring has the rules).
    """
    platform = platform or jax.default_backend()
    if platform == "gpu" and (jnp.dtype(dtype) == jnp.bfloat16 and num_rows >= GPU_PALLAS_MIN_ROWS
                              and hidden % 16 == 0 and intermediate % 16 == 0):
        return "pallas"
    if platform != "cpu":
        return "ragged_dot"
    return cpu.choose_backend(num_rows, num_experts, hidden, intermediate, dtype)


def compiler_options(num_rows: int, num_experts: int, hidden: int, intermediate: int, *, dtype,
                     backend: str = "auto", platform: str | None = None) -> dict:
    """XLA compiler options for a program running the grouped FFN on `num_rows` rows of this shape.

    Pass them to `jax.jit(..., compiler_options=...)` of the program that calls `grouped_ffn` (or
    `moe.moe_layer`, see `moe.compiler_options`); `dtype` is the expert weights' dtype. On CPU the
    rules of `cpu.compiler_options` (YNNPACK off for few rows per large expert on the XLA
    backends); elsewhere an empty dict.
    """
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return {}
    return cpu.compiler_options(num_rows, num_experts, hidden, intermediate, dtype=dtype, backend=backend)


def grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", backend="auto",
                capacity=None, biases=None):
    """Grouped gated-MLP over expert-major rows; see the module docstring for the contract."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    activation = as_gated_activation(activation)  # validate early
    check_backend(backend)
    if backend == "auto":
        e, h, i = logical_shape(w_gate)
        backend = choose_backend(xs.shape[0], e, h, i, w_gate.dtype)
    kwargs = dict(activation=activation, biases=biases)
    if backend == "native_cpu":  # reads prepared weights in place
        return cpu.grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
    w_gate, w_up, w_down = (cpu.dense_weights(w) for w in (w_gate, w_up, w_down))
    if backend == "reference":
        return grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
    if backend == "ragged_dot":
        return grouped_ffn_ragged_dot(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
    if backend == "capacity":
        return grouped_ffn_capacity(xs, group_sizes, w_gate, w_up, w_down, capacity=capacity, **kwargs)
    if backend == "expert_loop":
        return grouped_ffn_expert_loop(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
    return grouped_ffn_pallas(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
