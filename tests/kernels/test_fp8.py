"""Block-scaled FP8 expert weights (experts/fp8.py): the codes and scales against numpy, and the
kernels that read them (the Pallas kernel in interpret mode, tokamax's XLA path, a dequantising
backend) against the float64 oracles: per expert (test_experts.ffn_oracle) and the whole layer
(moe_oracle) for every family, on the dequantised weights within bf16's tolerance and on the
original weights within FP8's."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from fast_compile import compile_fast
from test_experts import ffn_oracle

from expertd.kernels import experts, moe
from expertd.kernels.experts import Fp8BlockWeights, dequantize, grouped_ffn, quantize_fp8_blocks
from expertd.kernels.moe_reference import FAMILIES, assert_close_to_oracle, family_config, moe_oracle

# Error per unit of output scale of FP8 weights against the exact ones: e4m3 holds 3 mantissa bits
# (relative step 1/8, rounding error <= 1/16 per weight); random signs average it down over H.
FP8_TOL = 0.1
BF16_TOL = 3e-2
READING_BACKENDS = ("pallas", "tokamax")  # read the codes themselves
BACKENDS = READING_BACKENDS + ("capacity",)  # capacity: dequantised per call


def _weights(rng, *shape):
    return jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[-2]), jnp.float32)


def test_block_scales_and_codes_match_numpy():
    rng = np.random.default_rng(0)
    w = np.asarray(_weights(rng, 2, 48, 40)) * np.array([1.0, 1e-3])[:, None, None]  # two magnitudes
    q = quantize_fp8_blocks(jnp.asarray(w), block=16)
    assert q.codes.dtype == jnp.float8_e4m3fn and q.codes.shape == (2, 48, 40)
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (2, 3, 3)  # ceil(40 / 16) = 3
    assert q.logical_shape == (2, 48, 40) and q.dtype == jnp.bfloat16
    blocks = np.pad(w, ((0, 0), (0, 0), (0, 8))).reshape(2, 3, 16, 3, 16)
    np.testing.assert_allclose(np.asarray(q.scales), np.abs(blocks).max(axis=(2, 4)) / 448.0, rtol=1e-6)
    full = np.repeat(np.repeat(np.asarray(q.scales), 16, 1), 16, 2)[:, :48, :40]
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.codes).view(np.uint8), codes.view(np.uint8))
    deq = np.asarray(dequantize(q, jnp.float32))
    np.testing.assert_allclose(deq, codes.astype(np.float32) * full, rtol=1e-7)
    assert np.abs(deq - w).max() <= np.abs(w).max() / 16  # within e4m3's rounding of the largest block


def test_fp8_weights_are_a_pytree_and_transpose_exactly():
    rng = np.random.default_rng(1)
    q = quantize_fp8_blocks(_weights(rng, 3, 32, 16), block=16)
    t = experts.tokamax_weights(q, "gpu")  # the layout tokamax's quantised kernels read
    assert t.transposed and t.codes.shape == (3, 16, 32) and t.logical_shape == (3, 32, 16)
    assert experts.tokamax_weights(q, "cpu") is q
    leaves, tree = jax.tree.flatten(t)
    assert len(leaves) == 2
    back = jax.jit(lambda v: v)(jax.tree.unflatten(tree, leaves))
    assert isinstance(back, Fp8BlockWeights) and back.block == 16 and back.transposed
    np.testing.assert_array_equal(np.asarray(dequantize(back, jnp.float32)), np.asarray(dequantize(q, jnp.float32)))
    with pytest.raises(ValueError, match="power of two"):
        quantize_fp8_blocks(jnp.zeros((1, 8, 8)), block=24)


# (H, I, block): two scale blocks along every dimension; and blocks that do not divide I (the last
# block partial; tokamax then dequantises the down projection, whose K = I is not whole blocks)
SHAPES = ((32, 64, 16), (32, 48, 32))


@pytest.fixture(scope="module")
def grouped_cases():
    rng = np.random.default_rng(2)
    cases = []
    for h, i, block in SHAPES:
        gs = jnp.asarray([6, 0, 9, 3], jnp.int32)  # an expert with no rows
        xs = jnp.asarray(rng.normal(size=(22, h)), jnp.bfloat16).at[18:].set(jnp.nan)  # garbage past the groups
        dense = (_weights(rng, 4, h, i), _weights(rng, 4, h, i), _weights(rng, 4, i, h))
        cases.append((xs, gs, dense, tuple(quantize_fp8_blocks(w, block) for w in dense)))

    def run(cases):
        return [[grouped_ffn(xs, gs, *q, backend=b) for b in BACKENDS]
                + [grouped_ffn(xs, gs, *(experts.tokamax_weights(w, "gpu") for w in q), backend="tokamax")]
                for xs, gs, _, q in cases]

    return cases, compile_fast(run, cases)(cases)


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_grouped_ffn_reads_fp8_weights(grouped_cases, shape):
    cases, outs = grouped_cases
    xs, gs, dense, q = cases[shape]
    exact = ffn_oracle(xs, gs, *dense)
    on_codes = ffn_oracle(xs, gs, *(dequantize(w, jnp.float32) for w in q))
    scale = max(1.0, float(np.abs(exact).max()))
    for backend, out in zip(BACKENDS + ("tokamax [E, C, K]",), outs[shape]):
        out = np.asarray(out, np.float64)
        assert np.isfinite(out).all(), backend
        np.testing.assert_array_equal(out[18:], 0.0)  # rows past the groups, which held NaN
        assert np.abs(out - on_codes).max() <= BF16_TOL * scale, f"{backend}: against the FP8 weights' values"
        assert np.abs(out - exact).max() <= FP8_TOL * scale, f"{backend}: against the weights before FP8"


def test_pallas_fp8_takes_all_three_projections_or_none():
    rng = np.random.default_rng(3)
    xs, gs = jnp.zeros((4, 16), jnp.bfloat16), jnp.asarray([4], jnp.int32)
    wg, wu, wd = _weights(rng, 1, 16, 16), _weights(rng, 1, 16, 16), _weights(rng, 1, 16, 16)
    with pytest.raises(ValueError, match="all three"):
        experts.grouped_ffn_pallas(xs, gs, quantize_fp8_blocks(wg, 16), wu, wd)


def test_moe_layer_with_fp8_experts_matches_the_oracle_for_every_family():
    """The layer with its routed experts in FP8 (pallas and tokamax read the codes; prepare_params
    for tokamax on GPU holds them [E, C, K]) against moe_oracle on the dequantised weights."""
    e, k, t, h, i, block = 8, 2, 12, 32, 32, 16
    cases = []
    for n, family in enumerate(FAMILIES):
        cfg = family_config(family, e, k, h, i)
        params = moe.init_params(cfg, jax.random.key(n), jnp.bfloat16)
        params = params.replace(**{f: quantize_fp8_blocks(getattr(params, f), block) for f in moe.EXPERT_WEIGHTS})
        x = jax.random.normal(jax.random.key(10 + n), (t, h), jnp.float32).astype(jnp.bfloat16)
        cases.append((cfg, params, moe.prepare_params(params, cfg, "gpu", backend="tokamax"), x))

    def run(plain, prepared, xs):
        return [[moe.moe_layer(p, x, c[0], backend=b) for p, b in ((pl, "pallas"), (pl, "tokamax"), (pr, "tokamax"))]
                for c, pl, pr, x in zip(cases, plain, prepared, xs)]

    args = ([c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases])
    for (cfg, params, prepared, x), outs in zip(cases, compile_fast(run, *args)(*args)):
        assert prepared.w_down.transposed and not params.w_down.transposed
        d = {name: (dequantize(v, jnp.float32) if experts.is_fp8(v) else v) for name, v in params.items()}
        ref = moe_oracle(d, x, cfg)
        for what, out in zip(("pallas", "tokamax", "tokamax prepared for GPU"), outs):
            assert_close_to_oracle(out, ref, jnp.bfloat16, what=f"{what} {cfg.score_function}")


def test_pallas_fp8_kernels_lower_to_triton_for_gpu():
    """No GPU here: the compiled (non-interpret) FP8 kernels lowered for CUDA run the Pallas-Triton
    lowering (e4m3 tiles converted to bf16, the scalar scale loads). PTX compilation is unverified."""
    pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    rng = np.random.default_rng(5)
    xs, gs = jnp.asarray(rng.normal(size=(12, 32)), jnp.bfloat16), jnp.asarray([5, 0, 7], jnp.int32)
    q = [quantize_fp8_blocks(_weights(rng, *shape), 16) for shape in ((3, 32, 64), (3, 32, 64), (3, 64, 32))]
    fn = jax.jit(lambda *a: experts.grouped_ffn_pallas(*a, interpret=False))
    text = fn.trace(xs, gs, *q).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # gate/up kernel and down kernel
