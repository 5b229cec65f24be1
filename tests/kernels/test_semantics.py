"""The families' layer semantics (issue 25, docs/semantics.md) against the float64 oracle on every
expert backend: gpt-oss, DeepSeek-V4 (and its hash-routed layers), GLM-5 Next, Step-3.7, ERNIE 4.5,
Llama 4, Mistral 4, Gemma 4; hash routing with and without token ids; per-expert biases that never
reach empty experts or padding; prepared (native CPU) params; the expert-parallel layer.

As in test_moe.py, each family is ONE compiled program holding all its cases (compiled at backend
optimisation level 0 on two threads): "capacity" runs both dtypes; one dtype (alternating over the
families) runs every other backend for the families whose semantics live in each backend's own
code (the gated activations: gpt-oss, Step-3.7, DeepSeek-V4; the per-expert biases: gpt-oss; the
weight on the input in the native CPU pass: Llama 4), and native_cpu and expert_loop (the CPU's
paths) for the families whose semantics are the router's or the layer's, shared by every backend.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fast_compile import compile_all, compile_fast
from test_moe import check_routing

from expertd.kernels import cpu, moe
from expertd.kernels.experts import BACKENDS
from expertd.kernels.moe_reference import (
    HASH_VOCAB,
    SEMANTIC_FAMILIES,
    assert_close_to_oracle,
    family_config,
    moe_oracle,
)
from expertd.kernels.routing import TokenIdsError, check_token_ids

H, I = 16, 32
DTYPES = (jnp.float32, jnp.bfloat16)
OTHER_BACKENDS = tuple(b for b in BACKENDS if b != "capacity")
EVERY_BACKEND_FAMILIES = ("gpt_oss", "step3p7", "deepseek_v4", "llama4")


def family_case(family, dtype, *, num_experts=8, topk=2, num_tokens=40, seed=0):
    """(cfg, params, x, token_ids or None) of `family` at a test shape."""
    cfg = family_config(family, num_experts, topk, H, I)
    params = moe.init_params(cfg, jax.random.key(seed + 7 * num_experts + topk), dtype)
    x = jax.random.normal(jax.random.key(seed + num_tokens), (num_tokens, H), jnp.float32).astype(dtype)
    token_ids = (jax.random.randint(jax.random.key(seed + 1), (num_tokens,), 0, HASH_VOCAB, jnp.int32)
                 if cfg.hash_routed else None)
    return cfg, params, x, token_ids


def _family_point(family):
    index = SEMANTIC_FAMILIES.index(family)
    shape = dict(num_experts=8, topk=2) if index % 2 else dict(num_experts=16, topk=4)
    others_dtype = DTYPES[index % 2]
    others = OTHER_BACKENDS if family in EVERY_BACKEND_FAMILIES else ("native_cpu", "expert_loop")
    cases = [family_case(family, dtype, **shape) + ((("capacity",) + (others if dtype == others_dtype else ())),)
             for dtype in DTYPES]

    def run_all(params_list, xs, ids_list):
        return [[moe.moe_layer(p, x, c[0], backend=b, return_routing=True, token_ids=t) for b in c[4]]
                for c, p, x, t in zip(cases, params_list, xs, ids_list)]

    args = ([c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases])
    return cases, compile_fast(run_all, *args), args


@pytest.fixture(scope="module")
def compiled_families():
    return compile_all(_family_point, SEMANTIC_FAMILIES)


@pytest.mark.parametrize("family", SEMANTIC_FAMILIES)
def test_every_backend_matches_oracle(compiled_families, family):
    cases, program, args = compiled_families[family]
    for (cfg, params, x, token_ids, backends), per_backend in zip(cases, program(*args)):
        ref = moe_oracle(params, x, cfg, token_ids=token_ids)
        for backend, (out, routing) in zip(backends, per_backend):
            assert out.dtype == x.dtype and out.shape == x.shape
            assert_close_to_oracle(out, ref, x.dtype, what=f"{family} {backend} {x.dtype}")
            check_routing(routing, ref, cfg)


# ---------------------------------------------------------------------------------------------
# Hash routing


def test_hash_routed_layer_needs_token_ids_and_takes_the_table_order():
    cfg, params, x, token_ids = family_case("deepseek_v4_hash", jnp.float32, num_tokens=12)
    with pytest.raises(TokenIdsError, match="token_ids: required: this layer is hash-routed") as err:
        moe.moe_layer(params, x, cfg)
    assert err.value.field == "token_ids"
    with pytest.raises(TokenIdsError, match=r"must be \[T=12\], got shape \(5,\)"):
        moe.moe_layer(params, x, cfg, token_ids=token_ids[:5])
    fn = jax.jit(lambda p, v, t: (moe.moe_layer(p, v, cfg, backend="expert_loop", token_ids=t, return_routing=True),
                                  moe.route(p.router, v, cfg, token_ids=t)))
    (out, routing), (ids, weights) = fn(params, x, token_ids)
    ref = moe_oracle(params, x, cfg, token_ids=token_ids)
    assert_close_to_oracle(out, ref, x.dtype)
    check_routing(routing, ref, cfg)
    table = np.asarray(params.tid2eid)[np.asarray(token_ids)]
    np.testing.assert_array_equal(np.sort(np.asarray(ids), 1), np.sort(table, 1))  # exactly the table's experts
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(routing["topk_ids"]))
    assert (np.diff(np.asarray(weights), axis=1) <= 0).all()  # descending weight
    np.testing.assert_allclose(np.asarray(weights).sum(1), cfg.scaling_factor, rtol=1e-6)  # renormalised
    # Out-of-vocabulary ids never read out of bounds (they are clipped; the host check rejects them).
    far = token_ids.at[0].set(10 ** 6).at[1].set(-3)
    clipped = token_ids.at[0].set(HASH_VOCAB - 1).at[1].set(0)
    np.testing.assert_array_equal(np.asarray(fn(params, x, far)[1][0]), np.asarray(fn(params, x, clipped)[1][0]))


def test_check_token_ids_names_the_bad_id():
    cfg = family_config("deepseek_v4_hash", 8, 2, H, I)
    check_token_ids(np.arange(5, dtype=np.int32), cfg, 5)
    check_token_ids(None, family_config("deepseek_v4", 8, 2, H, I))  # not hash-routed: nothing to check
    with pytest.raises(TokenIdsError, match="token_ids: required: this layer is hash-routed"):
        check_token_ids(None, cfg)
    with pytest.raises(TokenIdsError, match=r"token_ids\[2\] = 50 is out of the vocabulary \[0, 50\)") as err:
        check_token_ids(np.array([0, 49, 50, 3]), cfg)
    assert err.value.field == "token_ids" and isinstance(err.value, ValueError)
    with pytest.raises(TokenIdsError, match=r"token_ids\[0\] = -1 is out of the vocabulary \[0, 50\) \(2 ids"):
        check_token_ids(np.array([-1, 1, 99]), cfg)
    with pytest.raises(TokenIdsError, match="must be an integer array"):
        check_token_ids(np.array([1.0, 2.0]), cfg)
    with pytest.raises(TokenIdsError, match="expected 3, got 2"):
        check_token_ids(np.array([1, 2]), cfg, 3)


# ---------------------------------------------------------------------------------------------
# Empty experts, padding and prepared params


def test_biases_never_reach_empty_experts_or_padding():
    """gpt-oss with every token on expert 3: the other experts' biases (NaN here) must not reach any
    output, nor may expert 3's reach the padding rows."""
    cfg, params, x, _ = family_case("gpt_oss", jnp.float32, num_tokens=20)
    params = params.replace(router_weight=jnp.zeros((H, 8), jnp.float32).at[:, 3].set(1.0),
                            router_bias=jnp.zeros(8, jnp.float32))
    x = jnp.abs(x)  # expert 3's logit is each token's positive feature sum, the others 0
    cfg = dataclasses.replace(cfg, topk=1)
    ref = moe_oracle(params, x, cfg, valid=np.arange(20) < 15)
    poisoned = params.replace(**{name: getattr(params, name).at[jnp.arange(8) != 3].set(jnp.nan)
                                 for name in ("b_gate", "b_up", "b_down")})
    fn = lambda p, v: [moe.moe_layer(p, v, cfg, backend=b, valid_tokens=15, return_routing=True)  # noqa: E731
                       for b in BACKENDS]
    for backend, (out, routing) in zip(BACKENDS, compile_fast(fn, poisoned, x)(poisoned, x)):
        assert np.asarray(routing["tokens_per_expert"])[3] == 15, backend
        assert_close_to_oracle(out, ref, x.dtype, what=backend)
        np.testing.assert_array_equal(np.asarray(out)[15:], 0.0)


@pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")
def test_prepared_params_keep_the_families_bits():
    """`prepare_params` lays out the expert matrices only (biases, norms, tables stay arrays), and
    the layer gives the same bits from either, on native_cpu and through cpu.dense_weights."""
    families = ("gpt_oss", "llama4", "gemma4", "deepseek_v4_hash")
    cases = [family_case(f, jnp.bfloat16, num_tokens=24) for f in families]
    prepared = [moe.prepare_params(c[1], c[0], "cpu") for c in cases]
    for (_, params, _, _), prep in zip(cases, prepared):
        assert all(isinstance(getattr(prep, n), cpu.PanelWeights) for n in moe.EXPERT_WEIGHTS)
        assert all(getattr(prep, n) is v for n, v in params.items() if n not in moe.EXPERT_WEIGHTS)

    def both(ps, qs, xs, ts):
        return [(moe.moe_layer(p, x, c[0], backend=b, token_ids=t), moe.moe_layer(q, x, c[0], backend=b, token_ids=t))
                for c, p, q, x, t in zip(cases, ps, qs, xs, ts) for b in ("native_cpu", "expert_loop")]

    args = ([c[1] for c in cases], prepared, [c[2] for c in cases], [c[3] for c in cases])
    for want, got in compile_fast(both, *args)(*args):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_expert_parallel_layer_runs_the_families():
    """ep_moe_layer over 4 simulated devices equals the oracle for every family (per-expert biases
    split with the experts; a hash-routed layer's token ids sharded with the tokens, T not a
    multiple of the ranks), and needs the token ids of a hash-routed layer."""
    from jax.sharding import Mesh

    from expertd.kernels import ep

    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    cases = [family_case(f, jnp.float32, num_tokens=14) for f in SEMANTIC_FAMILIES]
    outs = jax.jit(lambda ps, xs, ts: [ep.ep_moe_layer(p, x, c[0], mesh, backend="capacity", token_ids=t)
                                       for c, p, x, t in zip(cases, ps, xs, ts)])(
        [c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases])
    for family, (cfg, params, x, token_ids), out in zip(SEMANTIC_FAMILIES, cases, outs):
        assert_close_to_oracle(out, moe_oracle(params, x, cfg, token_ids=token_ids), x.dtype, what=family)
    cfg, params, x, token_ids = family_case("deepseek_v4_hash", jnp.float32, num_tokens=8)
    with pytest.raises(TokenIdsError, match="token_ids: required: this layer is hash-routed"):
        ep.ep_moe_layer(params, x, cfg, mesh)
    with pytest.raises(TokenIdsError, match=r"token_ids: must hold one id per token: expected shape \[8\], got \[5\]"):
        ep.ep_moe_layer(params, x, cfg, mesh, token_ids=token_ids[:5])


def test_gpu_check_runs_the_semantic_families():
    """benchmarks/gpu_check.py's cases (what a lent GPU runs for every family) take token ids."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
    import gpu_check

    assert set(SEMANTIC_FAMILIES) <= set(gpu_check._families("all"))
    row = gpu_check.layer_case("deepseek_v4_hash", 8, 2, 16, "float32", "capacity")
    assert row["ok"] and row["err_per_scale"] < 1e-5, row
    assert gpu_check.router_case("deepseek_v4_hash", 8, 2, 16, "xla")["ok"]
