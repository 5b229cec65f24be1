"""Which grouped-FFN backend "auto" runs on CPU, and the XLA:CPU options that program compiles with.

The rules (BENCHMARKS.md "MoE layer" has the measurements behind them;
`benchmarks/moe_layer.py --options-ab` re-checks them on any CPU):

1. "native_cpu" at every batch size whenever its library is available (`native=True`): below 32
   rows per expert it reads each used expert's weights once in place and widens bf16 in registers,
   from 32 rows it runs a register-blocked GEMM; it was faster than every XLA:CPU backend at every
   measured shape. It needs no compiler options. Inside it the level decides the path per expert
   and call: on AMX CPUs whose tiles round in k order (`library.amx()` "high_first"), experts of
   16 or more bf16 rows run on the tiles (csrc/amx_tiles.h), fewer on the AVX-512 dot product;
   the tiles' speed on a Xeon is not measured yet (docs/kernels.md).
   INT8 expert weights (`prepare_params(..., expert_weights="int8")`) are read by it alone, in
   place, on the same paths (int8 widened to fp32 in registers, from 2 bf16 rows per expert into
   bf16 pairs for the dot product, scaled as it stores). They are a serving choice, not a
   per-batch one (the weights are held one way): faster than bf16 while a step is memory-bound
   (a few rows per expert: it reads half the bytes) and slower once it is compute-bound (the
   widening costs instructions bf16's dot product does not); `benchmarks/moe_layer_int8.py`
   measures both against their read floors, docs/kernels.md has the numbers.
2. Without it, "capacity" for fp32 weights with fewer than CAPACITY_ROWS_PER_EXPERT rows per expert
   of large expert matrices (`few_rows_per_large_expert`) when at least CAPACITY_MIN_TOUCHED of the
   experts are expected in use (`expected_touched_fraction`): its one batched dot per projection
   reads the weights in place, where "expert_loop" copies each expert's slice first. It reads every
   expert, so with under half of them in use it loses, and from 16 rows per expert its padded rows
   make it compute-bound. bf16 weights stay on "expert_loop": a batched dot over bf16 weights
   converts all of them on every call.
3. Otherwise "expert_loop" (INT8 weights too, read dequantised through `dense_weights`;
   "ragged_dot" and "reference" do E x the FLOPs on CPU, "capacity" E/k x
   at large T, and "pallas" runs interpreted).
4. Compiler options: SMALL_ROWS_CPU_OPTIONS (YNNPACK off) for "expert_loop", and for "capacity"
   with fp32 weights, when there are fewer than SMALL_ROWS_PER_EXPERT rows per expert and fp32
   expert matrices of at least SMALL_ROWS_MIN_MATRIX_BYTES: XLA's own dot emitter beats YNNPACK for
   few rows of large matrices, not for small matrices nor from 64 rows per expert (the 4 MiB cut
   lies between the largest matrix size where it lost and the smallest where it won). Options are
   per compiled program, so a server applies them per token bucket.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertd.kernels.cpu.build import available

SMALL_ROWS_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}
SMALL_ROWS_PER_EXPERT = 64
SMALL_ROWS_MIN_MATRIX_BYTES = 4 << 20
CAPACITY_ROWS_PER_EXPERT = 16
CAPACITY_MIN_TOUCHED = 0.5


def expected_touched_fraction(num_rows: int, num_experts: int) -> float:
    """Expected fraction of the experts that get at least one of `num_rows` rows, each row routed to
    an expert uniformly at random (a top-k layout of T*k rows is within 0.03 of this for T >= 4)."""
    return 1.0 - (1.0 - 1.0 / num_experts) ** num_rows


def few_rows_per_large_expert(num_rows: int, num_experts: int, hidden: int, intermediate: int) -> bool:
    """Fewer than SMALL_ROWS_PER_EXPERT rows per expert, and fp32 expert matrices of at least
    SMALL_ROWS_MIN_MATRIX_BYTES: the regime of rules 2 and 4."""
    return (num_rows < SMALL_ROWS_PER_EXPERT * num_experts
            and hidden * intermediate * 4 >= SMALL_ROWS_MIN_MATRIX_BYTES)


def choose_backend(num_rows: int, num_experts: int, hidden: int, intermediate: int, dtype, *,
                   native: bool | None = None) -> str:
    """The backend "auto" runs on CPU for `num_rows` (= T*k) rows of this shape with expert weights
    of `dtype` (rules 1-3 of the module docstring). `native`: whether the native library is
    available (None: ask `build.available()`, which builds it once)."""
    if available() if native is None else native:
        return "native_cpu"
    if (jnp.dtype(dtype) == jnp.float32 and num_rows < CAPACITY_ROWS_PER_EXPERT * num_experts
            and few_rows_per_large_expert(num_rows, num_experts, hidden, intermediate)
            and expected_touched_fraction(num_rows, num_experts) >= CAPACITY_MIN_TOUCHED):
        return "capacity"
    return "expert_loop"


@functools.cache
def small_rows_cpu_options() -> dict:
    """SMALL_ROWS_CPU_OPTIONS if this jaxlib's compiler knows them, else {} (debug option names
    change across XLA releases; an unknown one fails the compile)."""
    try:
        jax.jit(lambda v: v + 1, compiler_options=SMALL_ROWS_CPU_OPTIONS).lower(jnp.zeros((), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - an unknown option name raises a version-specific error type
        return {}
    return dict(SMALL_ROWS_CPU_OPTIONS)


def compiler_options(num_rows: int, num_experts: int, hidden: int, intermediate: int, *, dtype,
                     backend: str = "auto", native: bool | None = None) -> dict:
    """XLA:CPU compiler options for a program running the grouped FFN on `num_rows` rows of this
    shape (rule 4): SMALL_ROWS_CPU_OPTIONS where they apply and this jaxlib accepts them, else {}.
    `backend` "auto" is resolved by `choose_backend` (with `native` as there)."""
    if backend == "auto":
        backend = choose_backend(num_rows, num_experts, hidden, intermediate, dtype, native=native)
    wants_no_ynn = backend == "expert_loop" or (backend == "capacity" and jnp.dtype(dtype) == jnp.float32)
    if not wants_no_ynn or not few_rows_per_large_expert(num_rows, num_experts, hidden, intermediate):
        return {}
    return small_rows_cpu_options()
