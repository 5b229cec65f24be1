"""moe_layer against the float64 token-by-token oracle, over the grid of the issue:
E in {1, 2, 8, 64} x topk in {1, 2, 8} x T in {1, 3, 64, 1024} x {Mixtral, Qwen2-MoE, DeepSeek-V3}
router settings x {fp32, bf16} x every expert backend, plus the edge cases.

Compilation dominates on CPU, so each (E, topk, T) point is ONE compiled program holding all its
cases, compiled at backend optimisation level 0 (the programs are tiny; run time is irrelevant)
on two threads. One backend runs the full cartesian grid; the other backends (whose code differs
only in the grouped FFN) run every E x topk at T=1024 with the (family, dtype) pair rotating over
the grid (see grid_cases); tests/kernels/test_experts.py covers the grouped FFN at every T.
"""
import itertools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from fast_compile import compile_all, compile_fast

from expertd.kernels import cpu, experts, moe
from expertd.kernels.experts import BACKENDS
from expertd.kernels.moe_reference import FAMILIES, assert_close_to_oracle, family_config, moe_oracle

H, I = 16, 32
DTYPES = (jnp.float32, jnp.bfloat16)
EXPERTS_TOPK = [(e, k) for e, k in itertools.product((1, 2, 8, 64), (1, 2, 8)) if k <= e]
def make_case(family, num_experts, topk, num_tokens, dtype, *, seed=0, hidden=H, inter=I):
    cfg = family_config(family, num_experts, topk, hidden, inter)
    params = moe.init_params(cfg, jax.random.key(seed + 7 * num_experts + topk), dtype)
    x = jax.random.normal(jax.random.key(seed + num_tokens), (num_tokens, hidden), jnp.float32).astype(dtype)
    return cfg, params, x


def check_routing(routing, ref, cfg, valid=None):
    keep = ~ref.near_tie
    ids = np.asarray(routing["topk_ids"])
    assert ids.dtype == np.int32 and ids.shape == ref.ids.shape
    np.testing.assert_array_equal(np.sort(ids[keep], axis=1), np.sort(ref.ids[keep], axis=1))
    weights = np.asarray(routing["topk_weights"])
    assert weights.dtype == np.float32
    np.testing.assert_allclose(np.sort(weights[keep], axis=1), np.sort(ref.weights[keep], axis=1),
                               rtol=2e-5, atol=1e-6)
    tpe = np.asarray(routing["tokens_per_expert"])
    assert tpe.dtype == np.int32 and tpe.shape == (cfg.num_experts,)
    # Every near-tie token can move at most one copy between two experts.
    assert np.abs(tpe - ref.tokens_per_expert).sum() <= 2 * ref.near_tie.sum()
    n_valid = len(ids) if valid is None else int(np.sum(valid))
    assert tpe.sum() == n_valid * cfg.topk


GRID_TOKENS = (1, 3, 64, 1024)
FULL_BACKEND = "capacity"  # cheapest to compile; runs the full cartesian grid
OTHER_BACKENDS = tuple(b for b in BACKENDS if b != FULL_BACKEND)
OTHER_TOKENS = (1024,)  # the other backends' grouped FFN meets small T in test_experts.py


def grid_cases(num_experts, topk, num_tokens):
    """(cfg, params, x, backends) for one grid point: FULL_BACKEND runs every family x dtype; at
    T in OTHER_TOKENS the other backends run one (family, dtype) pair that rotates with the point,
    so that every backend meets every family and dtype, and every E and topk."""
    pairs = list(itertools.product(FAMILIES, DTYPES))
    rotating = None
    if num_tokens in OTHER_TOKENS:
        index = EXPERTS_TOPK.index((num_experts, topk)) * len(OTHER_TOKENS) + OTHER_TOKENS.index(num_tokens)
        rotating = pairs[index % len(pairs)]
    cases = []
    for family, dtype in pairs:
        others = (family, dtype) == rotating
        backends = (FULL_BACKEND,) + (OTHER_BACKENDS if others else ())
        cases.append(make_case(family, num_experts, topk, num_tokens, dtype) + (backends,))
    return cases


def _compile_point(point):
    cases = grid_cases(*point)

    def run_all(params_list, xs):
        return [[moe.moe_layer(p, x, c[0], backend=b, return_routing=True) for b in c[3]]
                for c, p, x in zip(cases, params_list, xs)]

    args = ([c[1] for c in cases], [c[2] for c in cases])
    return cases, compile_fast(run_all, *args), args


@pytest.fixture(scope="module")
def compiled_grid():
    """Every grid point's program, compiled on two threads (XLA compiles outside the GIL)."""
    return compile_all(_compile_point, [(e, k, t) for (e, k) in EXPERTS_TOPK for t in GRID_TOKENS])


@pytest.mark.parametrize("num_tokens", GRID_TOKENS)
@pytest.mark.parametrize("num_experts,topk", EXPERTS_TOPK)
def test_every_backend_matches_oracle(compiled_grid, num_experts, topk, num_tokens):
    cases, program, args = compiled_grid[(num_experts, topk, num_tokens)]
    for (cfg, params, x, backends), per_backend in zip(cases, program(*args)):
        ref = moe_oracle(params, x, cfg)
        for backend, (out, routing) in zip(backends, per_backend):
            assert out.dtype == x.dtype and out.shape == x.shape
            assert_close_to_oracle(out, ref, x.dtype, what=f"{backend} {cfg.score_function} {x.dtype}")
            check_routing(routing, ref, cfg)


# ---------------------------------------------------------------------------------------------
# Edge cases and semantics


def run_layer(cfg, params, x, backends, **kwargs):
    fn = lambda p, v: [moe.moe_layer(p, v, cfg, backend=b, return_routing=True, **kwargs) for b in backends]
    return compile_fast(fn, params, x)(params, x)


@pytest.mark.parametrize("as_mask", (False, True))
def test_padding_rows_are_not_routed(as_mask):
    cfg, params, x = make_case("deepseek_v3", 8, 2, 10, jnp.float32)
    n_valid = 7
    valid = np.arange(10) < n_valid
    kwargs = {"valid_tokens": jnp.asarray(valid) if as_mask else n_valid}
    ref = moe_oracle(params, x, cfg, valid)
    for out, routing in run_layer(cfg, params, x, ("capacity", "expert_loop", "reference"), **kwargs):
        assert_close_to_oracle(out, ref, x.dtype)
        np.testing.assert_array_equal(np.asarray(out)[n_valid:], 0.0)
        check_routing(routing, ref, cfg, valid)
        np.testing.assert_array_equal(np.asarray(routing["topk_ids"])[n_valid:], -1)
        np.testing.assert_array_equal(np.asarray(routing["topk_weights"])[n_valid:], 0.0)


def test_valid_count_may_be_traced():
    cfg, params, x = make_case("mixtral", 8, 2, 12, jnp.bfloat16)
    fn = jax.jit(lambda p, v, n: moe.moe_layer(p, v, cfg, valid_tokens=n, return_routing=True))
    for n in (0, 5, 12):
        out, routing = fn(params, x, jnp.int32(n))
        assert int(np.asarray(routing["tokens_per_expert"]).sum()) == 2 * n
        np.testing.assert_array_equal(np.asarray(out, np.float32)[n:], 0.0)
        assert_close_to_oracle(out, moe_oracle(params, x, cfg, np.arange(12) < n), x.dtype)


def test_all_tokens_on_one_expert_leaves_the_others_empty():
    cfg, params, x = make_case("mixtral", 8, 1, 40, jnp.float32)
    params = params.replace(router_weight=jnp.zeros((H, 8), jnp.float32).at[:, 3].set(1.0))
    x = jnp.abs(x)  # every token's logit for expert 3 is its positive feature sum, the others 0
    ref = moe_oracle(params, x, cfg)
    for out, routing in run_layer(cfg, params, x, BACKENDS):
        np.testing.assert_array_equal(np.asarray(routing["tokens_per_expert"]), [0, 0, 0, 40, 0, 0, 0, 0])
        assert_close_to_oracle(out, ref, x.dtype)


@pytest.mark.parametrize("overrides", [
    dict(score_function="sigmoid", use_expert_bias=True, norm_topk_prob=False, topk=4, num_groups=4, group_topk=2,
         scaling_factor=2.5),
    dict(score_function="sigmoid", norm_topk_prob=True, topk=1, scaling_factor=1.5),
    dict(use_pre_softmax=True, norm_topk_prob=True, topk=3),
    dict(use_pre_softmax=True, topk=3, activation="gelu", num_shared_experts=2, shared_intermediate_size=24),
    dict(topk=2, activation="gelu_tanh", num_shared_experts=1, shared_intermediate_size=8, shared_expert_gate=True),
], ids=["deepseek-unnormalised", "sigmoid-k1-normalised", "pre-softmax-renormalised", "gelu-shared", "gelu_tanh-gated"])
def test_normalisation_and_activation_variants(overrides):
    cfg = moe.MoEConfig(**{**dict(num_experts=16, topk=2, hidden_size=H, intermediate_size=I), **overrides})
    params = moe.init_params(cfg, jax.random.key(3), jnp.float32)
    x = jax.random.normal(jax.random.key(4), (48, H), jnp.float32)
    ref = moe_oracle(params, x, cfg)
    (out, routing), = run_layer(cfg, params, x, ("capacity",))
    assert_close_to_oracle(out, ref, x.dtype)
    check_routing(routing, ref, cfg)


def test_pre_softmax_with_renormalisation_equals_post_softmax():
    base = dict(num_experts=8, topk=2, hidden_size=H, intermediate_size=I)
    post, pre = moe.MoEConfig(**base), moe.MoEConfig(**base, use_pre_softmax=True, norm_topk_prob=True)
    params = moe.init_params(post, jax.random.key(5), jnp.float32)
    x = jax.random.normal(jax.random.key(6), (32, H), jnp.float32)
    a, b = (jax.jit(lambda p, v, c=c: moe.moe_layer(p, v, c, return_routing=True))(params, x) for c in (post, pre))
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(a[1]["topk_ids"]), np.asarray(b[1]["topk_ids"]))


@pytest.mark.parametrize("family,e,k,t,dtype", [("mixtral", 8, 2, 256, jnp.bfloat16),
                                                ("qwen2_moe", 64, 8, 64, jnp.float32)])
def test_larger_shapes(family, e, k, t, dtype):
    cfg, params, x = make_case(family, e, k, t, dtype, hidden=256, inter=512)
    ref = moe_oracle(params, x, cfg)
    for out, routing in run_layer(cfg, params, x, ("capacity", "expert_loop", "auto")):
        assert_close_to_oracle(out, ref, dtype)
        check_routing(routing, ref, cfg)


def test_auto_is_the_chosen_backend():
    cfg, params, x = make_case("qwen2_moe", 8, 2, 64, jnp.float32)
    chosen = experts.choose_backend(64 * 2, 8, H, I, x.dtype)
    auto, explicit = run_layer(cfg, params, x, ("auto", chosen))
    np.testing.assert_array_equal(np.asarray(auto[0]), np.asarray(explicit[0]))


def test_init_params_keys_shapes_and_dtypes():
    cfg = family_config("qwen2_moe", 8, 2, H, I)
    params = moe.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert isinstance(params, moe.MoEParams)
    assert {k: tuple(v.shape) for k, v in params.items()} == moe.param_shapes(cfg) == params.shapes()
    assert set(params.to_dict()) == {"router_weight", "w_gate", "w_up", "w_down", "shared_w_gate", "shared_w_up",
                           "shared_w_down", "shared_gate"}
    assert params.router_weight.dtype == jnp.float32 and params.w_gate.dtype == jnp.bfloat16
    ds = moe.init_params(family_config("deepseek_v3", 8, 2, H, I), jax.random.key(0), jnp.float32)
    assert ds.expert_bias.shape == (8,) and ds.expert_bias.dtype == jnp.float32 and ds.shared_gate is None
    again = moe.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert all(np.array_equal(np.asarray(v), np.asarray(getattr(again, k))) for k, v in params.items())


def test_bad_inputs_name_the_field():
    cfg, params, x = make_case("mixtral", 4, 2, 5, jnp.float32)
    with pytest.raises(ValueError, match=r"x must be \[T, H=16\]"):
        moe.moe_layer(params, x[:, :8], cfg)
    with pytest.raises(ValueError, match="w_up"):
        moe.moe_layer(params.replace(w_up=None), x, cfg)
    with pytest.raises(ValueError, match="router_weight"):
        moe.moe_layer(params.replace(router_weight=params.router_weight[:, :3]), x, cfg)
    with pytest.raises(ValueError, match="valid_tokens"):
        moe.moe_layer(params, x, cfg, valid_tokens=jnp.ones(4, bool))
    with pytest.raises(ValueError, match="valid_tokens"):
        moe.moe_layer(params, x, cfg, valid_tokens=2.5)
    with pytest.raises(ValueError, match="backend"):
        moe.moe_layer(params, x, cfg, backend="fast")
    with pytest.raises(TypeError, match="MoEParams.from_dict"):
        moe.moe_layer(params.to_dict(), x, cfg)


@pytest.mark.parametrize("fields,match", [
    (dict(topk=5), "topk"), (dict(use_expert_bias=True), "use_expert_bias"),
    (dict(num_groups=2), "group_topk"), (dict(num_groups=3, group_topk=1), "num_groups"),
    (dict(norm_topk_prob=False), "norm_topk_prob"), (dict(num_shared_experts=1), "shared_intermediate_size"),
    (dict(shared_expert_gate=True), "shared_expert_gate"), (dict(activation="relu"), "activation"),
    (dict(score_function="tanh"), "score_function"), (dict(hidden_size=0), "hidden_size"),
])
def test_config_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        moe.MoEConfig(**{**dict(num_experts=4, topk=2, hidden_size=H, intermediate_size=I), **fields})


def _fp32_products(jaxpr):
    """(primitive name, precision) of every product in `jaxpr` (sub-jaxprs included) with an fp32 operand."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general", "ragged_dot") and any(
                v.aval.dtype == jnp.float32 for v in eqn.invars):
            found.append((eqn.primitive.name, eqn.params.get("precision")))
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found += _fp32_products(sub)
    return found


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "native_cpu"])
def test_fp32_products_run_at_highest_precision(backend):
    """The router's logits and fp32 expert weights are multiplied in full fp32: at DEFAULT precision
    GPUs run fp32 products as TF32 (~1e-3 off; an H100 swapped experts at E=64 that way)."""
    cfg, params, x = make_case("deepseek_v3", 8, 2, 16, jnp.float32)
    jaxpr = jax.make_jaxpr(lambda p, v: moe.moe_layer(p, v, cfg, backend=backend))(params, x).jaxpr
    products = _fp32_products(jaxpr)
    assert products, "no fp32 product found"
    highest = jax.lax.Precision.HIGHEST
    for name, precision in products:
        assert precision is not None and all(p == highest for p in precision), (name, precision)


@pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_prepared_params_give_every_backend_the_same_bits(dtype):
    """`moe_layer(prepare_params(p))` equals `moe_layer(p)` bit for bit on every backend (native_cpu
    reads the prepared weights in place, the others through cpu.dense_weights), at few rows per
    expert (streaming) and many (packed)."""
    cfg = family_config("deepseek_v3", 8, 2, 32, 48)
    params = moe.init_params(cfg, jax.random.key(11), dtype)
    prepared = moe.prepare_params(params, cfg, "cpu")
    assert prepared.w_gate is not params.w_gate and prepared.router_weight is params.router_weight
    xs = [jax.random.normal(jax.random.key(t), (t, 32), jnp.float32).astype(dtype) for t in (5, 90)]
    cases = [(t, b) for t in (0, 1) for b in ("auto",) + BACKENDS if b != "pallas" or t == 0]

    def both(p, q, xs):  # one program for every case: the same compiled code runs both params
        return [(moe.moe_layer(p, xs[t], cfg, backend=b), moe.moe_layer(q, xs[t], cfg, backend=b)) for t, b in cases]

    for (t, backend), (want, got) in zip(cases, compile_fast(both, params, prepared, xs)(params, prepared, xs)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=f"{backend} T={xs[t].shape[0]}")
