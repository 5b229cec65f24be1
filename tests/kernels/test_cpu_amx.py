"""The grouped matmul's AMX path (csrc/amx_tiles.h) over a grid of shapes: on the tiles' software
model on every CPU (diagnostics.emulate_amx), and on the hardware where the CPU has AMX. Adding a
pair's products high half first (k order) it gives the other paths' bits; low half first, values
within the kernel's tolerance of the reference and other bits; experts under 16 rows, fp32 rows or
fp32 weights never take it; the model refused no tile operation; the probe tells the two orders
apart (tests/server/engine/test_amx_serving.py serves a layer on it through the real client)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu
from expertd.kernels.cpu import diagnostics

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")

# (group sizes, K, C): 16 / 17 / 31 / 32 / 33 rows end a 16-row tile or a 32-row block partway,
# 100 / 2048 rows several blocks; experts of 0 and under 16 rows beside them take the other paths.
# K = 1 / 2 / 33 / 257 end in a partial 32-k step (odd: a half pair row), 32 / 64 fill them; C = 3 /
# 17 / 50 end in a partial strip, 130 in a lone strip past pairs of strips, 96 fills 64-column panels
# and a 16-column one's pairs.
CASES = [
    ([16], 32, 16),
    ([17, 0, 33], 33, 17),
    ([31, 5, 40], 64, 50),
    ([64, 0], 100, 130),
    ([20, 16], 257, 64),
    ([48], 1, 3),
    ([100, 0, 18], 2, 96),
    ([32, 15, 1], 48, 32),
    ([2048], 64, 32),
]


def case_arrays(sizes, k, c, seed=0):
    """(x f32 [N + 3, K] of bf16 values, group_sizes, w bf16 [E, K, C]): NaN past the groups and in
    experts without rows (never read)."""
    rng = np.random.default_rng(seed + len(sizes) * k + c)
    used = sum(sizes)
    x = np.asarray(jnp.asarray(rng.standard_normal((used + 3, k)), jnp.bfloat16), np.float32)
    x[used:] = np.nan
    w = rng.standard_normal((len(sizes), k, c)).astype(np.float32) * 0.1
    for e, n in enumerate(sizes):
        if n == 0:
            w[e] = np.nan
    return jnp.asarray(x), jnp.asarray(sizes, jnp.int32), jnp.asarray(w, jnp.bfloat16)


def run(x, gs, w):
    """(y, {path: items}) of one grouped matmul."""
    before = diagnostics.path_items()
    y = np.asarray(jax.jit(cpu.grouped_matmul)(x, gs, w))
    return y, {name: n - before[name] for name, n in diagnostics.path_items().items() if n > before[name]}


def amx_items(sizes):
    """Items the AMX path runs for a case: one per (expert of >= 16 rows, column block)."""
    return sum(1 for n in sizes if n >= 16)


@pytest.mark.parametrize("width", cpu.PANEL_WIDTHS)
@pytest.mark.parametrize("sizes,k,c", CASES)
def test_high_half_first_gives_the_other_paths_bits(sizes, k, c, width):
    x, gs, w = case_arrays(sizes, k, c)
    panels = cpu.to_panels(w, width)
    with diagnostics.limit_isa("avx512_bf16"):  # the AVX paths (AVX2 here, or AVX-512), never the tiles
        want, plain = run(x, gs, panels)
    assert "amx_bf16" not in plain
    faults = diagnostics.amx_faults()
    with diagnostics.emulate_amx("high_first"):
        got, paths = run(x, gs, panels)
    assert diagnostics.amx_faults() == faults  # every configuration and operand shape the hardware takes
    assert paths.get("amx_bf16", 0) >= amx_items(sizes) > 0
    np.testing.assert_array_equal(got, want)
    used = sum(sizes)
    np.testing.assert_array_equal(got[used:], 0)
    ref = cpu.grouped_matmul_reference(jnp.where(jnp.isnan(x), 0, x), gs, jnp.where(jnp.isnan(w), 0, w))
    np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("sizes,k,c", CASES[:5])
def test_low_half_first_is_within_tolerance_with_other_bits(sizes, k, c):
    x, gs, w = case_arrays(sizes, k, c, seed=1)
    panels = cpu.to_panels(w)
    with diagnostics.emulate_amx("high_first"):
        high, _ = run(x, gs, panels)
    with diagnostics.emulate_amx("low_first"):
        low, paths = run(x, gs, panels)
    assert paths.get("amx_bf16", 0) > 0
    ref = np.asarray(cpu.grouped_matmul_reference(jnp.where(jnp.isnan(x), 0, x), gs, jnp.where(jnp.isnan(w), 0, w)))
    np.testing.assert_allclose(low, ref, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    if k > 2:  # enough product-adds per sum that the order shows in some of them
        assert (low != high).any()


def test_the_probe_tells_the_orders_apart():
    with diagnostics.emulate_amx("high_first"):
        assert diagnostics.emulated_amx_order() == "high_first"
    with diagnostics.emulate_amx("low_first"):
        assert diagnostics.emulated_amx_order() == "low_first"
    with pytest.raises(ValueError, match="order must be one of"):
        with diagnostics.emulate_amx("none"):
            pass
    assert cpu.amx() in cpu.AMX_ORDERS
    assert (cpu.isa() == "amx_bf16") == (cpu.amx() == "high_first")  # the level only where it rounds in k order


def test_few_rows_fp32_rows_and_fp32_weights_keep_the_other_paths():
    x, gs, w = case_arrays([15, 3, 0, 1], 64, 48)
    with diagnostics.emulate_amx("high_first"):
        assert "amx_bf16" not in run(x, gs, cpu.to_panels(w))[1]  # under 16 rows per expert
        x, gs, w = case_arrays([40], 64, 48)
        assert "amx_bf16" not in run(x.at[3, 7].add(2.0 ** -20), gs, cpu.to_panels(w))[1]  # a row not bf16
        assert "amx_bf16" not in run(x, gs, cpu.to_panels(w.astype(jnp.float32)))[1]
        assert "amx_bf16" not in run(x, gs, w)[1]  # row-major weights
        with diagnostics.limit_isa("portable"):
            assert run(x, gs, cpu.to_panels(w))[1] == {"portable": 1}


@pytest.mark.skipif(cpu.isa() != "amx_bf16", reason=f"this CPU does not run AMX tiles (probe: {cpu.amx()})")
@pytest.mark.parametrize("sizes,k,c", CASES)
def test_the_hardware_tiles_give_the_models_bits(sizes, k, c):
    x, gs, w = case_arrays(sizes, k, c)
    panels = cpu.to_panels(w)
    got, paths = run(x, gs, panels)
    assert paths.get("amx_bf16", 0) >= amx_items(sizes)
    with diagnostics.emulate_amx("high_first"):
        np.testing.assert_array_equal(run(x, gs, panels)[0], got)
