"""The fused gate / up projection with the gated activation (`cpu.grouped_glu`, csrc/gated_activation.h)
against its reference (two reference matmuls, the biases, `ffn.GatedActivation` in XLA, the cast):
over a grid of row counts (1 to 2048 rows, experts without rows, pad rows), odd K and C, every weight
layout (row-major fp32 / bf16, panels of both widths, INT8 panels), every fused activation and clamp,
with and without biases, rounded to bf16 or kept fp32; the same bits at every instruction-set level
and on the AMX tiles' model; and the layer's CPU pass on it against the unfused composition."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu, ffn
from expertd.kernels.cpu import diagnostics, int8, layer, panels

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")

ACTIVATIONS = [ffn.GatedActivation(), ffn.GatedActivation("gelu_tanh"), ffn.GatedActivation("swiglu_oai"),
               ffn.GatedActivation("swiglu_oai", 7.0), ffn.GatedActivation("silu", 2.5, "before_activation"),
               ffn.GatedActivation("gelu_tanh", 1.5, "after_activation")]
# (group sizes, K, C): one row; odd K and C (the 8-column epilogue's tail, partial strips); experts
# without rows; 32+ rows (AVX2's packed path, AMX's tiles); 2048 rows in all.
CASES = [([1], 5, 3), ([2, 0, 5], 37, 45), ([0, 41, 3, 0], 66, 80), ([1024, 0, 1000, 24], 48, 19)]


def weights(kind, w):
    """`w` fp32 [E, K, C] in layout `kind`."""
    if kind == "int8":
        return int8.to_int8_panels(jnp.asarray(w))
    dtype = jnp.bfloat16 if "bf16" in kind else jnp.float32
    a = jnp.asarray(w, dtype)
    return panels.to_panels(a, int(kind.split("panels")[1])) if "panels" in kind else a


def close(got, want, round_to):
    """Within a few fp32 ulp of the reference (its XLA exp / tanh are other polynomials; where
    gelu_tanh's 1 + tanh cancels, XLA's is off by a few ulp of 1, hence the absolute part), rounded:
    the reference's bf16 value or its neighbour, no more than 2 % of them the neighbour."""
    atol = 2.0 ** -20 * max(1.0, float(np.abs(want).max()))
    if round_to == jnp.float32:
        np.testing.assert_allclose(got, want, rtol=2.0 ** -19, atol=atol)
        return
    np.testing.assert_array_equal(got, np.asarray(jnp.asarray(got, jnp.bfloat16).astype(jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=atol)
    assert (got != want).mean() < 0.02


def case_inputs(sizes, k, c, seed):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    x = np.asarray(jnp.asarray(rng.standard_normal((n + 2, k)), jnp.bfloat16).astype(jnp.float32))
    scale = 1.5 / np.sqrt(k)  # g and u of about unit size, so the activations' curved parts are hit
    w_gate, w_up = (rng.standard_normal((len(sizes), k, c)).astype(np.float32) * scale for _ in range(2))
    for e, rows in enumerate(sizes):
        if rows == 0:
            w_gate[e] = w_up[e] = np.nan  # experts without rows are never read
    biases = tuple(jnp.asarray(rng.standard_normal((len(sizes), c)), jnp.float32) for _ in range(2))
    source = jnp.asarray(rng.permutation(n + 1), jnp.int32)  # n: a pad row, read as zeros
    return x, w_gate, w_up, biases, source


@native
@pytest.mark.parametrize("sizes,k,c", CASES)
@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp32_panels16", "bf16_panels64", "bf16_panels16", "int8"])
def test_grouped_glu_matches_the_unfused_reference(sizes, k, c, kind):
    x, w_gate, w_up, biases, source = case_inputs(sizes, k, c, seed=k * c)
    n, group_sizes = sum(sizes), jnp.asarray(sizes, jnp.int32)
    wg, wu = weights(kind, w_gate), weights(kind, w_up)
    xt = jnp.asarray(x[:n])
    for i, act in enumerate(ACTIVATIONS):
        round_to = (jnp.bfloat16, jnp.float32)[i % 2]
        bias = biases if i % 3 == 0 else None
        got = np.asarray(cpu.grouped_glu(jnp.asarray(x), group_sizes, wg, wu, act, biases=bias, round_to=round_to))
        want = np.asarray(cpu.grouped_glu_reference(jnp.asarray(x), group_sizes, wg, wu, act, biases=bias,
                                                    round_to=round_to))
        assert got.shape == (n + 2, c) and np.isfinite(got).all(), act
        close(got[:n], want[:n], round_to)
        np.testing.assert_array_equal(got[n:], 0)  # rows past the groups
        gathered = np.asarray(cpu.grouped_glu(xt, group_sizes, wg, wu, act, source=source, biases=bias,
                                              round_to=round_to))
        want = np.asarray(cpu.grouped_glu_reference(xt, group_sizes, wg, wu, act, source=source, biases=bias,
                                                    round_to=round_to))
        assert gathered.shape == (n + 1, c)
        close(gathered[:n], want[:n], round_to)


@native
@pytest.mark.parametrize("sizes,k,c", CASES[1:])
def test_grouped_glu_gives_the_same_bits_at_every_level_and_on_the_tiles(sizes, k, c):
    x, w_gate, w_up, biases, _ = case_inputs(sizes, k, c, seed=7)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = {}
    for kind in ("bf16_panels16", "bf16_panels64", "int8"):
        wg, wu = weights(kind, w_gate), weights(kind, w_up)
        for level in diagnostics.supported_isas():
            with diagnostics.limit_isa(level):
                for act in ACTIVATIONS[:4]:
                    got[kind, level, act] = np.asarray(
                        cpu.grouped_glu(jnp.asarray(x), group_sizes, wg, wu, act, biases=biases))
        if kind != "int8" and "avx2" in diagnostics.supported_isas():
            before = diagnostics.path_items()["amx_bf16"]
            with diagnostics.limit_isa("avx2"), diagnostics.emulate_amx("high_first"):
                for act in ACTIVATIONS[:4]:
                    got[kind, "amx", act] = np.asarray(
                        cpu.grouped_glu(jnp.asarray(x), group_sizes, wg, wu, act, biases=biases))
            assert (diagnostics.path_items()["amx_bf16"] > before) == (max(sizes) >= 16)
    for key, h in got.items():
        np.testing.assert_array_equal(h.view(np.int32), got[(key[0], "portable", key[2])].view(np.int32),
                                      err_msg=str(key))
    # Each row's h is its own: a row alone gives the bits it gives among the others.
    wg, wu = weights("bf16_panels16", w_gate), weights("bf16_panels16", w_up)
    first = next(e for e, rows in enumerate(sizes) if rows)
    alone = jnp.asarray([1 if e == first else 0 for e in range(len(sizes))], jnp.int32)
    one = np.asarray(cpu.grouped_glu(jnp.asarray(x[:1]), alone, wg, wu, ACTIVATIONS[0], biases=biases))
    top = diagnostics.supported_isas()[-1]
    np.testing.assert_array_equal(one[0].view(np.int32), got["bf16_panels16", top, ACTIVATIONS[0]][0].view(np.int32))


@native
def test_grouped_glu_on_extreme_values_and_nan():
    """exp's clamps (|g| up to 1e4) and signed zeros against XLA's formulas; NaN passing through."""
    g = np.array([[-1e4, -120, -88.5, -87, -20, -1e-30, -0.0, 0.0, 1e-30, 3, 20, 87, 88.5, 120, 1e4, 0.5]], np.float32)
    for act in ACTIVATIONS:
        for u in (np.full_like(g, 1.5), g[:, ::-1].copy()):
            close(glu_of(g, u, act), np.asarray(act(jnp.asarray(g), jnp.asarray(u))), jnp.float32)
    # NaN in g alone (its bias) or in u alone: that column's h is NaN, whatever the clamps; the rest finite.
    x, nan = np.array([[0.5, -2.0, 3.0, 20.0]], np.float32), np.float32(np.nan)
    for act in ACTIVATIONS:
        for which in (0, 1):
            b = [np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32)]
            b[which][0, 1 + which] = nan
            got = glu_of(x, x, act, biases=tuple(jnp.asarray(v) for v in b))
            np.testing.assert_array_equal(np.isnan(got[0]), np.arange(4) == 1 + which, err_msg=f"{act} {which}")


def glu_of(g, u, act, biases=None):
    """grouped_glu's h for given g and u rows: x = [g | u] against [I ; 0] and [0 ; I] (exact)."""
    c = g.shape[1]
    x = jnp.asarray(np.concatenate([g, u], axis=1))
    eye = np.eye(c, dtype=np.float32)
    w_gate = jnp.asarray(np.concatenate([eye, np.zeros_like(eye)])[None])
    w_up = jnp.asarray(np.concatenate([np.zeros_like(eye), eye])[None])
    return np.asarray(cpu.grouped_glu(x, jnp.asarray([g.shape[0]], jnp.int32), w_gate, w_up, act, biases=biases))


@native
def test_grouped_glu_names_what_it_cannot_take():
    x, sizes = jnp.ones((3, 8)), jnp.asarray([3, 0], jnp.int32)
    w = jnp.ones((2, 8, 16), jnp.bfloat16)
    assert not cpu.fuses("gelu") and cpu.fuses("silu") and not cpu.fuses("silu", jnp.float16)
    with pytest.raises(ValueError, match="activation must be one of"):
        cpu.grouped_glu(x, sizes, w, w, "gelu")
    with pytest.raises(ValueError, match="w_up must have w_gate's shape and layout"):
        cpu.grouped_glu(x, sizes, w, panels.to_panels(w), "silu")
    with pytest.raises(ValueError, match="w_up must have w_gate's shape and layout"):
        cpu.grouped_glu(x, sizes, w, w.astype(jnp.float32), "silu")
    with pytest.raises(ValueError, match=r"biases must be \(gate \[E, C\], up \[E, C\]\)"):
        cpu.grouped_glu(x, sizes, w, w, "silu", biases=(jnp.ones((2, 16)), jnp.ones((2, 15))))
    with pytest.raises(ValueError, match=r"expected x \[N, K\]"):
        cpu.grouped_glu(jnp.ones((3, 7)), sizes, w, w, "silu")


# The layer's CPU pass: fused where the activation is (silu, gpt-oss's clamped swiglu with biases),
# against the unfused composition of the same kernels (gelu with erf still runs unfused).
@native
@pytest.mark.parametrize("activation,bias", [(ffn.GatedActivation(), False),
                                             (ffn.GatedActivation("swiglu_oai", 7.0), True),
                                             (ffn.GatedActivation("gelu"), True)])
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32))
def test_grouped_ffn_fused_equals_the_unfused_composition(activation, bias, dtype):
    rng = np.random.default_rng(5)
    sizes, h, i = [3, 0, 40, 1], 40, 27
    n = sum(sizes)
    xs = jnp.asarray(rng.standard_normal((n, h)), dtype)
    w = [jnp.asarray(rng.standard_normal(s) / np.sqrt(s[1]), dtype) for s in ((4, h, i), (4, h, i), (4, i, h))]
    biases = ffn.ExpertBiases(*(jnp.asarray(rng.standard_normal(s), dtype) for s in ((4, i), (4, i), (4, h))))
    biases = biases if bias else None
    prepared = [panels.to_panels(a) for a in w]
    group_sizes = jnp.asarray(sizes, jnp.int32)
    got = layer.grouped_ffn(xs, group_sizes, *prepared, activation=activation, biases=biases).astype(jnp.float32)
    lowered = jax.jit(lambda v: layer.grouped_ffn(v, group_sizes, *prepared, activation=activation,
                                                  biases=biases)).lower(xs).as_text()
    assert ("expertd_grouped_glu" in lowered) == cpu.fuses(activation, dtype)
    assert lowered.count("expertd_grouped_matmul") == (1 if cpu.fuses(activation, dtype) else 3)
    x32 = xs.astype(jnp.float32)
    g, u = (cpu.grouped_matmul(x32, group_sizes, p) for p in prepared[:2])
    if biases is not None:
        rb = ffn.row_biases(biases, *ffn.row_experts(group_sizes, n))
        g, u = g + rb.gate, u + rb.up
    y = cpu.grouped_matmul(activation(g, u).astype(dtype).astype(jnp.float32), group_sizes, prepared[2])
    want = (y if biases is None else y + rb.down).astype(dtype).astype(jnp.float32)
    if not cpu.fuses(activation, dtype):  # unfused: the same kernels in the same order, the same bits
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        return
    scale = float(jnp.max(jnp.abs(want)))  # h's bf16 rounding apart at most one ulp in 50, then the sums
    assert float(jnp.max(jnp.abs(got - want))) <= (2.0 ** -6 if dtype == jnp.bfloat16 else 1e-5) * scale
