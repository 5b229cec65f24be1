"""The CPU backend policy (kernels/cpu/policy.py): which backend "auto" runs on CPU, with the native
library and on a machine without it (`native=False`), and the XLA:CPU options it compiles with."""
import functools

import jax.numpy as jnp
import pytest

from expertd.kernels import cpu, experts
from expertd.kernels.cpu import diagnostics, policy

DTYPES = (jnp.float32, jnp.bfloat16)


def test_cpu_auto_picks_capacity_for_fp32_few_rows_per_large_expert_with_most_experts_in_use():
    mixtral = (8, 1024, 2048)  # fp32 expert matrices of 8 MiB
    choose = functools.partial(policy.choose_backend, native=False)  # a machine without a C++ compiler
    assert choose(32, *mixtral, jnp.float32) == "capacity"  # T=16, k=2: 4 rows per expert, 98% in use
    assert choose(8, *mixtral, jnp.float32) == "capacity"  # T=4: 66% of the experts expected in use
    assert choose(4, *mixtral, jnp.float32) == "expert_loop"  # T=2: 41%
    assert choose(8 * 15, *mixtral, jnp.float32) == "capacity"
    assert choose(8 * 16, *mixtral, jnp.float32) == "expert_loop"  # 16 rows per expert: C = 32 pads
    assert choose(32, *mixtral, jnp.bfloat16) == "expert_loop"  # bf16 weights would be converted whole
    assert choose(128, 64, 1024, 512, jnp.float32) == "expert_loop"  # 2 MiB matrices
    assert choose(128, 128, 2048, 768, jnp.float32) == "capacity"  # Qwen3-30B-A3B, T=16
    assert choose(128 * 16, 128, 2048, 768, jnp.float32) == "expert_loop"  # T=256: 16 rows per expert
    assert choose(32, 128, 2048, 768, jnp.float32) == "expert_loop"  # T=4: 22% in use
    assert policy.expected_touched_fraction(8, 8) == pytest.approx(1 - (7 / 8) ** 8)


def test_compiler_options_turn_ynn_off_only_for_few_rows_per_large_expert():
    small_rows = policy.small_rows_cpu_options()
    assert small_rows == policy.SMALL_ROWS_CPU_OPTIONS  # this jaxlib knows the option
    mixtral = (8, 1024, 2048)  # fp32 expert matrices of 8 MiB
    options = functools.partial(policy.compiler_options, native=False)  # a machine without a C++ compiler
    for dtype in DTYPES:  # auto: capacity (fp32) or expert_loop (bf16), both with YNNPACK off
        assert options(32, *mixtral, dtype=dtype) == small_rows
        assert options(2, *mixtral, dtype=dtype) == small_rows  # expert_loop for both
        assert options(8 * 63, *mixtral, dtype=dtype) == small_rows
        assert options(8 * 64, *mixtral, dtype=dtype) == {}  # 64 rows per expert
        assert options(32, 64, 1024, 512, dtype=dtype) == {}  # 2 MiB matrices
        assert options(32, *mixtral, dtype=dtype, backend="expert_loop") == small_rows
        assert options(32, *mixtral, dtype=dtype, backend="ragged_dot") == {}
    assert options(32, *mixtral, dtype=jnp.float32, backend="capacity") == small_rows
    assert options(32, *mixtral, dtype=jnp.bfloat16, backend="capacity") == {}  # bf16 stays on expert_loop's rule


@pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")
def test_cpu_auto_picks_native_at_every_batch_size():
    assert diagnostics.vectorized()  # the dev box and CI have AVX2 + FMA
    for e, h, i in ((8, 1024, 2048), (64, 1024, 512), (4, 64, 128)):
        for dtype in DTYPES:
            for rows in (1, 31 * e, 32 * e, 1024 * e):
                assert experts.choose_backend(rows, e, h, i, dtype, "cpu") == "native_cpu"
                assert experts.compiler_options(rows, e, h, i, dtype=dtype, platform="cpu") == {}
    assert experts.choose_backend(16, 8, 1024, 2048, jnp.bfloat16, "gpu") == "ragged_dot"


def test_int8_weights_run_native_where_it_is_and_expert_loop_without_it():
    qwen3 = (128, 2048, 768)
    for rows in (8, 128, 8192):
        assert policy.choose_backend(rows, *qwen3, jnp.int8, native=True) == "native_cpu"
        assert policy.choose_backend(rows, *qwen3, jnp.int8, native=False) == "expert_loop"
