"""The grouped expert FFN's public ops (the door, `expertd.kernels.experts`, re-exports them): the
backend check, the choice "auto" makes per platform and shape, the XLA compiler options per shape,
and `grouped_ffn`, which checks its arguments and runs the chosen backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from expertd.kernels import cpu
from expertd.kernels.experts import fp8
from expertd.kernels.experts.pallas import grouped_ffn_pallas
from expertd.kernels.experts.tokamax import grouped_ffn_tokamax
from expertd.kernels.experts.xla import (
    grouped_ffn_capacity,
    grouped_ffn_expert_loop,
    grouped_ffn_ragged_dot,
)
from expertd.kernels.ffn import (
    as_gated_activation,
    check_ffn_args,
    grouped_ffn_reference,
)
from expertd.kernels.names import EXPERT_BACKENDS
from expertd.kernels.params import logical_shape

BACKENDS = EXPERT_BACKENDS  # kernels/names.py, JAX-free
# GPU, bf16 weights: from this many rows (T*k) on, the Pallas grouped GEMM beats ragged_dot
# (BENCHMARKS.md, GPU section); below it ragged_dot is faster.
GPU_PALLAS_MIN_ROWS = 2048


def check_backend(backend: str) -> None:
    """ValueError unless `backend` is "auto" or one of BACKENDS."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")


def choose_backend(num_rows: int, num_experts: int, hidden: int, intermediate: int, dtype,
                   platform: str | None = None, *, fp8_weights: bool = False) -> str:
    """The backend "auto" runs for `num_rows` (= T*k) rows of this shape on this platform.

    `fp8_weights`: the expert weights are `Fp8BlockWeights`. On GPU then "pallas", which reads the
    codes in its kernels (H and I multiples of 16; else "ragged_dot" on the dequantised weights);
    elsewhere the choice for their bf16 compute dtype (those backends dequantise per call).

    `dtype` is the expert weights' dtype. GPU: the Pallas grouped GEMM for bf16 weights from
    GPU_PALLAS_MIN_ROWS rows on (H and I multiples of 16), "ragged_dot" (XLA's grouped GEMM) below
    that, for fp32 weights and on other accelerators. "capacity" is never chosen on GPU: its
    dropless buffer is E x the rows. CPU: `cpu.choose_backend` ("native_cpu" whenever its library
    is available, else "capacity" or "expert_loop"; its module docstring has the rules).
    """
    platform = platform or jax.default_backend()
    if platform == "gpu" and fp8_weights:
        return "pallas" if hidden % 16 == 0 and intermediate % 16 == 0 else "ragged_dot"
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
        backend = choose_backend(xs.shape[0], e, h, i, w_gate.dtype, fp8_weights=fp8.is_fp8(w_gate))
    kwargs = dict(activation=activation, biases=biases)
    if backend == "tokamax":  # reads FP8 weights itself
        return grouped_ffn_tokamax(xs, group_sizes, *(cpu.dense_weights(w) for w in (w_gate, w_up, w_down)),
                                   **kwargs)
    if backend == "pallas" and all(fp8.is_fp8(w) for w in (w_gate, w_up, w_down)):
        return grouped_ffn_pallas(xs, group_sizes, w_gate, w_up, w_down, **kwargs)
    # FP8 weights for the backends that do not read them: dequantised per call (correct, not fast)
    w_gate, w_up, w_down = (fp8.dequantize(w, xs.dtype) for w in (w_gate, w_up, w_down))
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
