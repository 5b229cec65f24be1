"""The C++ grouped matmul (cpu.py) against its plain-jnp reference and a float64 loop, over
shapes that hit the vector chunks, the column tails and the k remainder, with empty experts, NaN
garbage past the groups and in unused experts; every path, layout and instruction-set level giving
the same bits; its build, cache and the fallback without a compiler, in fresh processes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu
from expertd.kernels.cpu import diagnostics

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")

# (group sizes, K, C): C = 17 / 50 / 40 have scalar column tails, K = 5 / 40 / 44 a k remainder past
# the 16-row steps (44: past the 8-row steps of experts with up to 4 rows), 2064 columns a second
# column block, one expert of 5 or more rows several row blocks. [3, 7] x 48 columns: 3-row blocks
# (32-column chunks in bf16) with a 16-column tail chunk.
# Experts of 32 rows or more take the packed path: 45 / 41 / 130 rows end in partial 6-row panels,
# 130 spans two 120-row L2 blocks, K = 300 / 520 end in a partial 256-deep k block, and the last
# case mixes both paths (and an empty expert) in one call. Panel-major weights (compared bit for bit
# with row-major in every case): [2, 1, 3, 4] x 80 columns streams 1-4 rows over 5 panels (groups of
# 4 / 2 and their remainders), [6, 5] one 6- / 5-row block per strip (K = 33 odd: the half pair
# row past the unrolled k loop), [9, 17] several row blocks in 256-deep k steps (9 = 5 + 4,
# 17 = 6 + 6 + 5; 7 = 4 + 3, 13 = 5 + 4 + 4 above), K = 301 a remainder past the unrolled k loop;
# 130 rows pack the panels per k block, 41 / 45 read them in place.
# On AVX-512 CPUs panel-major weights take one path at every row count (panel_stream_avx512.h): 1-6
# rows in one register block of 4 strips (K = 5 / 301 odd: bf16's half pair row), more in 6-row
# blocks and a block of the rest streaming 4 strips over all of K ([0, 0, 7, 0], [9, 17], [45],
# 130), C = 17 / 40 / 50 / 80 / 96 / 2064 blocks of 1-3 strips at the tail and partial last strips
# (masked); K = 4101 splits the strips into 512 KiB k steps (fp32 2048 rows, bf16 4096, the last
# with bf16's half pair row). Panels are 16 and 64 columns wide wherever the test takes panels.
CASES = [
    ([3], 5, 17),
    ([2, 0, 5], 40, 50),
    ([1, 2, 3, 9], 64, 96),
    ([0, 0, 7, 0], 48, 32),
    ([2, 1, 4], 44, 48),
    ([3, 7], 40, 48),
    ([4, 4], 1024, 2048),
    ([1, 0, 6, 2, 0, 0, 1, 13], 128, 2064),
    ([45], 300, 40),
    ([0, 130, 41, 3], 520, 64),
    ([2, 1, 3, 4], 301, 80),
    ([6, 5], 33, 48),
    ([9, 17], 301, 64),
    ([9, 0, 7], 4101, 24),
]


def loop_oracle(x, group_sizes, w):
    """float64 row-by-row product with each row's expert matrix; rows past the groups are 0."""
    x, w = np.asarray(x, np.float64), np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    out, start = np.zeros((x.shape[0], w.shape[2])), 0
    for e, n in enumerate(group_sizes):
        out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


def case_arrays(sizes, k, c, dtype, bf16_rows=False):
    """(x f32 [N + 3, K], group_sizes, w [E, K, C] of dtype) for a case: NaN rows past the groups and
    NaN weights in experts without rows (neither may be read); `bf16_rows` rounds x to bf16 values,
    as the layer's rows are (the bf16 dot product's input)."""
    rng = np.random.default_rng(len(sizes) * k + c)
    used = sum(sizes)
    x = rng.standard_normal((used + 3, k)).astype(np.float32)
    if bf16_rows:
        x = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    x[used:] = np.nan  # rows past the groups are never read
    w = rng.standard_normal((len(sizes), k, c)).astype(np.float32) * 0.1
    for e, n in enumerate(sizes):
        if n == 0:
            w[e] = np.nan  # experts without rows are never read
    return jnp.asarray(x), jnp.asarray(sizes, jnp.int32), jnp.asarray(w, dtype)


@pytest.mark.parametrize("bf16_rows", (False, True), ids=("f32_rows", "bf16_rows"))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("sizes,k,c", CASES)
def test_matches_reference_and_float64(sizes, k, c, dtype, bf16_rows):
    used = sum(sizes)
    x, gs, w = case_arrays(sizes, k, c, dtype, bf16_rows)
    got = np.asarray(jax.jit(cpu.grouped_matmul)(x, gs, w))
    assert got.shape == (used + 3, c) and got.dtype == np.float32
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[used:], 0)
    want = np.asarray(cpu.grouped_matmul_reference(jnp.where(jnp.isnan(x), 0, x), gs, jnp.where(jnp.isnan(w), 0, w)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    np.testing.assert_allclose(got[:used], loop_oracle(x[:used], sizes, w)[:used], rtol=1e-4, atol=1e-4 * np.sqrt(k))
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.grouped_matmul)(x, gs, cpu.to_panels(w))), got)


@pytest.mark.parametrize("sizes,k,c", CASES)
def test_every_path_layout_and_instruction_set_gives_the_same_bits(sizes, k, c):
    """Every path sums k in order with one rounding per product-add, so the result does not depend on
    the layout, the row count's path (streaming, packed, AVX-512 blocks), nor the instruction set:
    each level this CPU runs (the portable loop included; the bf16 dot product where x is bf16-valued)
    on row-major weights and on panels of both widths gives the bits of the top level on row-major
    weights."""
    call = jax.jit(cpu.grouped_matmul)
    for dtype in (jnp.float32, jnp.bfloat16):
        for bf16_rows in (False, True):
            x, gs, w = case_arrays(sizes, k, c, dtype, bf16_rows)
            want = np.asarray(call(x, gs, w))
            for level in diagnostics.supported_isas():
                with diagnostics.limit_isa(level):
                    assert cpu.isa() == level
                    for weights in (w, *(cpu.to_panels(w, width) for width in cpu.PANEL_WIDTHS)):
                        np.testing.assert_array_equal(np.asarray(call(x, gs, weights)), want,
                                                      err_msg=f"{level} {dtype.__name__} {weights!r}")


def _paths_taken(call) -> dict[str, int]:
    before = diagnostics.path_items()
    jax.block_until_ready(call())
    return {name: n - before[name] for name, n in diagnostics.path_items().items() if n > before[name]}


def test_each_level_runs_its_own_path():
    """Which path an item takes (diagnostics.path_items): bf16 panels times bf16-valued rows run the
    AMX tiles from 16 rows and the bf16 dot product below where the CPU has them; a row with one
    value that is not bf16 keeps the whole item on the FMA path; row-major weights and AVX2 CPUs
    stream below 32 rows and pack above."""
    x, gs, w = case_arrays([3, 40], 64, 32, jnp.bfloat16, bf16_rows=True)
    x = x[:43]
    pw = cpu.to_panels(w)
    call = lambda x, w: cpu.grouped_matmul(x, gs, w)  # noqa: E731
    levels = diagnostics.supported_isas()
    if "amx_bf16" in levels:  # 40 rows on the tiles, 3 on the dot product (tests/kernels/test_cpu_amx.py)
        assert _paths_taken(lambda: call(x, pw)) == {"amx_bf16": 1, "avx512_bf16_dot": 1}
    if "avx512_bf16" in levels:
        with diagnostics.limit_isa("avx512_bf16"):
            assert _paths_taken(lambda: call(x, pw)) == {"avx512_bf16_dot": 2}
            assert _paths_taken(lambda: call(x.at[1, 5].add(2.0 ** -20), pw)) == {"avx512_fma": 1,
                                                                                 "avx512_bf16_dot": 1}
    if "avx512" in levels:
        with diagnostics.limit_isa("avx512"):
            assert _paths_taken(lambda: call(x, pw)) == {"avx512_fma": 2}
            assert _paths_taken(lambda: call(x, w)) == {"avx2_stream": 1, "avx2_packed": 1}
    with diagnostics.limit_isa("avx2"):
        assert _paths_taken(lambda: call(x, pw)) == {"avx2_stream": 1, "avx2_packed": 1}
    with diagnostics.limit_isa("portable"):
        assert _paths_taken(lambda: call(x, pw)) == {"portable": 2}


def test_limit_isa_names_the_levels_and_restores_the_top_one():
    top = cpu.isa()
    assert top == diagnostics.supported_isas()[-1] and top in cpu.ISA_LEVELS
    with diagnostics.limit_isa("portable"):
        assert cpu.isa() == "portable" and not diagnostics.vectorized()
    assert cpu.isa() == top
    with pytest.raises(ValueError, match="level must be one of"):
        with diagnostics.limit_isa("sse2"):
            pass


@pytest.mark.parametrize("sizes,k,c", [([2, 1, 4], 44, 48), ([4, 4], 1024, 2048)], ids=("small", "large"))
def test_sharing_with_the_pool_or_not_gives_the_same_bits_and_the_bound_comes_back(sizes, k, c):
    """ParallelFor's rule (csrc/parallel.h) only decides who runs each work item: the caller alone
    (every call, bound 2^62) or the pool too (bound 0) give the same bits, and the bound returns
    after the block, an exception included."""
    x, gs, w = case_arrays(sizes, k, c, jnp.bfloat16)
    call = jax.jit(cpu.grouped_matmul)
    bound = diagnostics.caller_only_work_now()
    assert bound == 1 << 18
    with diagnostics.caller_only_work(1 << 62):
        alone = np.asarray(call(x, gs, w))
    with pytest.raises(RuntimeError), diagnostics.caller_only_work(0):
        assert diagnostics.caller_only_work_now() == 0
        shared = np.asarray(call(x, gs, w))
        raise RuntimeError("leaves the block")
    assert diagnostics.caller_only_work_now() == bound
    np.testing.assert_array_equal(shared, alone)
    with pytest.raises(ValueError, match="work must be >= 0"):
        with diagnostics.caller_only_work(-1):
            pass


def test_no_rows_gives_zeros_and_argument_errors_name_the_field():
    x, w = jnp.ones((4, 8), jnp.float32), jnp.ones((2, 8, 16), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(cpu.grouped_matmul(x, jnp.zeros(2, jnp.int32), w)), 0)
    with pytest.raises(ValueError, match="group_sizes"):
        cpu.grouped_matmul(x, jnp.zeros(3, jnp.int32), w)
    with pytest.raises(ValueError, match="w must be float32 or bfloat16"):
        cpu.grouped_matmul(x, jnp.zeros(2, jnp.int32), w.astype(jnp.float16))


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_panel_weights_with_gathered_rows_equal_row_major(dtype):
    """Reading token rows by index (pad rows outside [0, T) as zeros) over panel-major weights: the
    row-major result bit for bit, on the streaming and packed paths, with a column tail."""
    rng = np.random.default_rng(7)
    sizes = [3, 0, 40, 9]
    x = jnp.asarray(rng.standard_normal((20, 72)), jnp.float32)
    source = jnp.asarray(rng.integers(-1, 22, sum(sizes) + 2), jnp.int32)
    w = jnp.asarray(rng.standard_normal((4, 72, 56)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    call = jax.jit(lambda x, w, s: cpu.grouped_matmul(x, gs, w, source=s))
    want = np.asarray(call(x, w, source))
    for width in cpu.PANEL_WIDTHS:
        np.testing.assert_array_equal(np.asarray(call(x, cpu.to_panels(w, width), source)), want)
    assert np.abs(want[sum(sizes):]).max() == 0


@pytest.mark.parametrize("rows", (3, 40))  # streaming and packed paths
def test_empty_contraction_gives_zeros(rows):
    x, w = jnp.ones((rows, 0), jnp.float32), jnp.ones((1, 0, 48), jnp.bfloat16)
    got = np.asarray(jax.jit(cpu.grouped_matmul)(x, jnp.asarray([rows], jnp.int32), w))
    np.testing.assert_array_equal(got, np.zeros((rows, 48), np.float32))
