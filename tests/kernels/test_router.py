"""Router API: semantics against the float64 NumPy oracle, validation errors, aux loss, top-k ids."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from router_cases import np_aux_loss, np_aux_scores, np_router, te_bias, te_logits, tie_free_logits

from expertd.kernels.router import fused_moe_aux_loss, fused_topk_with_score_function, topk_ids_and_weights

BACKENDS = ("reference", "xla", "pallas")


def fp32_tol(num_cols):
    """TE's PyTorch router tolerance for fp32 (moe-semantics.md 5.4), against a float64 oracle."""
    return dict(atol=max(1e-5, 2 * num_cols * 2e-7), rtol=max(1.3e-6, 2 * num_cols * 2e-7))


# ---------------------------------------------------------------- semantics vs the float64 oracle

ORACLE_CASES = [
    # (T, E, k, kwargs)
    (64, 8, 2, dict(score_function="softmax")),
    (64, 8, 2, dict(score_function="softmax", use_pre_softmax=True)),
    (64, 7, 3, dict(score_function="softmax")),  # E < 32 lanes, odd E
    (32, 5, 1, dict(score_function="softmax", use_pre_softmax=True)),
    (128, 32, 4, dict(score_function="sigmoid")),
    (128, 32, 1, dict(score_function="sigmoid")),  # topk == 1: raw sigmoid, no normalisation
    (128, 32, 4, dict(score_function="sigmoid", expert_bias="te", scaling_factor=1.2)),
    (128, 64, 8, dict(score_function="sigmoid", expert_bias="te", num_groups=8, group_topk=4)),
    (128, 64, 6, dict(score_function="sqrtsoftplus", num_groups=8, group_topk=3, scaling_factor=2.5)),
    (128, 64, 4, dict(score_function="sqrtsoftplus", expert_bias="te")),
    (96, 128, 8, dict(score_function="softmax", num_groups=8, group_topk=4)),
    (96, 128, 8, dict(score_function="softmax", use_pre_softmax=True, num_groups=8, group_topk=2,
                      scaling_factor=1.2)),
    # beyond TE (issue 25): ERNIE's selection bias on softmax probabilities, HF's top-2 group score
    (64, 16, 4, dict(score_function="softmax", use_pre_softmax=True, expert_bias="probs")),
    (96, 64, 3, dict(score_function="sigmoid", expert_bias="te", num_groups=8, group_topk=2,
                     group_score_topk=2, scaling_factor=2.5)),
    (96, 64, 8, dict(score_function="softmax", use_pre_softmax=True, num_groups=8, group_topk=4,
                     group_score_topk=3, expert_bias="probs")),
]


def _materialise(e, kwargs):
    kwargs = dict(kwargs)
    bias = kwargs.get("expert_bias")
    if isinstance(bias, str):  # "te": TE's test bias; "probs": scaled to softmax probabilities
        kwargs["expert_bias"] = te_bias(e) / (e if bias == "probs" else 1)
    return kwargs


# The pallas backend is checked against the reference over the grid (test_router_grid.py);
# compiling its 12 variants again here would only repeat that at CI's expense.
@pytest.mark.parametrize("backend", ["reference", "xla"])
@pytest.mark.parametrize("t,e,k,kwargs", ORACLE_CASES, ids=lambda v: str(v))
def test_matches_float64_oracle(backend, t, e, k, kwargs):
    kwargs = _materialise(e, kwargs)
    oracle_kwargs = {n: v for n, v in kwargs.items()}
    logits = tie_free_logits(e * 31 + k, t, e, k, **{n: v for n, v in oracle_kwargs.items()
                                                     if n != "scaling_factor"})
    want_probs, want_map = np_router(logits, k, **oracle_kwargs)
    bias = kwargs.pop("expert_bias", None)
    probs, rmap = fused_topk_with_score_function(
        jnp.asarray(logits), k, expert_bias=None if bias is None else jnp.asarray(bias),
        backend=backend, **kwargs)
    assert probs.dtype == jnp.float32 and rmap.dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    assert (np.asarray(rmap).sum(-1) == k).all()
    np.testing.assert_allclose(np.asarray(probs), want_probs, **fp32_tol(e))


@pytest.mark.parametrize("kwargs", [
    dict(score_function="softmax", use_pre_softmax=True, expert_bias="probs", num_groups=4, group_topk=2,
         group_score_topk=2),
    dict(score_function="sigmoid", expert_bias="te", num_groups=4, group_topk=2, group_score_topk=2,
         scaling_factor=2.5),
], ids=["softmax-pre-bias-groups", "sigmoid-bias-hf-groups"])
def test_pallas_runs_the_family_extensions(kwargs):
    """The Pallas kernel's softmax-pre selection bias and fixed group score (the grid covers TE's)."""
    t, e, k = 64, 32, 3
    kwargs = _materialise(e, kwargs)
    logits = tie_free_logits(e + k, t, e, k, **{n: v for n, v in kwargs.items() if n != "scaling_factor"})
    want_probs, want_map = np_router(logits, k, **kwargs)
    bias = jnp.asarray(kwargs.pop("expert_bias"))
    probs, rmap = fused_topk_with_score_function(jnp.asarray(logits), k, expert_bias=bias, backend="pallas", **kwargs)
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    np.testing.assert_allclose(np.asarray(probs), want_probs, **fp32_tol(e))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_te_deterministic_inputs(score_function):
    """TE's own tie-free construction (5.3): ascending logits, flipped bias, groups 8/4."""
    t, e, k = 256, 128, 8
    logits = te_logits(t, e, score_function)
    kwargs = dict(score_function=score_function, num_groups=8, group_topk=4, scaling_factor=1.2)
    if score_function == "sigmoid":
        kwargs["expert_bias"] = te_bias(e)
    want_probs, want_map = np_router(logits, k, **kwargs)
    probs, rmap = fused_topk_with_score_function(jnp.asarray(logits), k, backend="reference", **kwargs)
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    np.testing.assert_allclose(np.asarray(probs), want_probs, **fp32_tol(e))


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("k", [1, 4])
def test_aux_scores_match_oracle(score_function, k):
    t, e = 128, 32
    logits = tie_free_logits(3, t, e, k, score_function=score_function)
    want_scores, want_map = np_aux_scores(logits, k, score_function)
    for backend in BACKENDS:
        scores, rmap = fused_topk_with_score_function(
            jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32), k,
            score_function=score_function, compute_aux_scores=True, backend=backend)
        assert scores.dtype == jnp.float32
        want_scores, want_map = np_aux_scores(
            np.asarray(jnp.asarray(logits).astype(jnp.bfloat16).astype(jnp.float32)), k, score_function)
        np.testing.assert_allclose(np.asarray(scores), want_scores, **fp32_tol(e))
        np.testing.assert_array_equal(np.asarray(rmap), want_map)
        # normalised over all E for every topk, including 1
        np.testing.assert_allclose(np.asarray(scores).sum(-1), 1.0, rtol=1e-5)


def test_aux_scores_are_fp32_for_bf16_logits_and_ignore_bias_groups_scaling():
    logits = tie_free_logits(5, 64, 32, 4, score_function="sigmoid")
    lb = jnp.asarray(logits, jnp.bfloat16)
    scores, rmap = fused_topk_with_score_function(
        lb, 4, score_function="sigmoid", compute_aux_scores=True, expert_bias=jnp.asarray(te_bias(32)),
        num_groups=8, group_topk=2, scaling_factor=3.0, backend="reference")
    plain, plain_map = fused_topk_with_score_function(lb, 4, score_function="sigmoid", compute_aux_scores=True)
    assert scores.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(scores), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(plain_map))


def test_leading_dims_are_tokens():
    logits = tie_free_logits(7, 256, 32, 4).reshape(128, 2, 32)
    probs, rmap = fused_topk_with_score_function(jnp.asarray(logits), 4)
    assert probs.shape == (128, 2, 32) and rmap.shape == (128, 2, 32)
    want_probs, want_map = np_router(logits.reshape(-1, 32), 4)
    np.testing.assert_array_equal(np.asarray(rmap).reshape(-1, 32), want_map)
    np.testing.assert_allclose(np.asarray(probs).reshape(-1, 32), want_probs, **fp32_tol(32))


def test_sigmoid_all_very_negative_logits_give_zeros_not_nan():
    logits = jnp.full((16, 32), -200.0, jnp.float32) - jnp.arange(32, dtype=jnp.float32)
    for score_function in ("sigmoid", "sqrtsoftplus"):
        for backend in BACKENDS:
            probs, rmap = fused_topk_with_score_function(logits, 4, score_function=score_function, backend=backend)
            assert np.isfinite(np.asarray(probs)).all()
            np.testing.assert_array_equal(np.asarray(rmap)[:, :4], True)  # ties / near ties: lowest ids
            grads = jax.grad(lambda x, s=score_function, b=backend: fused_topk_with_score_function(
                x, 4, score_function=s, backend=b)[0].sum())(logits)
            assert np.isfinite(np.asarray(grads)).all()


def test_ties_go_to_the_lowest_expert_index():
    """Documents tie behaviour: equal scores are taken in ascending expert id (lax.top_k order)."""
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0, -1.0, 2.0],
                          [0.0] * 8,
                          [5.0, 5.0, 4.0, 4.0, 4.0, 4.0, 1.0, 1.0]], jnp.float32)
    want = np.zeros((3, 8), bool)
    want[0, [1, 2, 3]] = True
    want[1, [0, 1, 2]] = True
    want[2, [0, 1, 2]] = True
    for backend in BACKENDS:
        for score_function in ("softmax", "sigmoid", "sqrtsoftplus"):
            _, rmap = fused_topk_with_score_function(logits, 3, score_function=score_function, backend=backend)
            np.testing.assert_array_equal(np.asarray(rmap), want, err_msg=f"{backend} {score_function}")
        # groups tie too: two groups of 4 with equal group scores -> the lower group is kept
        _, rmap = fused_topk_with_score_function(
            jnp.zeros((2, 8)), 2, num_groups=2, group_topk=1, backend=backend)
        np.testing.assert_array_equal(np.asarray(rmap), [[True, True] + [False] * 6] * 2)
        ids, weights = topk_ids_and_weights(*fused_topk_with_score_function(logits, 3, backend=backend), 3)
        np.testing.assert_array_equal(np.asarray(ids), [[1, 2, 3], [0, 1, 2], [0, 1, 2]])


# ---------------------------------------------------------------------------------- aux loss

@pytest.mark.parametrize("t,e,k,mult", [(128, 32, 4, 1), (256, 128, 4, 2), (64, 256, 8, 1), (64, 1024, 4, 2),
                                        (14234, 128, 4, 1), (8192, 256, 32, 2)])
def test_aux_loss_formula(t, e, k, mult):
    rng = np.random.default_rng(t + e)
    probs = te_logits(t, e * mult, "sigmoid")
    tpe = rng.integers(1, 1000, e * mult).astype(np.int32)
    got = fused_moe_aux_loss(jnp.asarray(probs), jnp.asarray(tpe), k, 0.01, num_experts=e)
    assert got.dtype == jnp.float32 and got.shape == ()
    want = np_aux_loss(probs, tpe, k, 0.01, num_experts=e)
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-7)
    # bf16 probs and a float tokens_per_expert are accepted; T may be given (global token count)
    got = fused_moe_aux_loss(jnp.asarray(probs, jnp.bfloat16), jnp.asarray(tpe, jnp.float32), k, 0.01,
                             num_experts=e, total_num_tokens=4 * t)
    want = np_aux_loss(np.asarray(jnp.asarray(probs, jnp.bfloat16).astype(jnp.float32)), tpe, k, 0.01,
                       num_experts=e, total_num_tokens=4 * t)
    np.testing.assert_allclose(float(got), want, rtol=1e-4, atol=1e-7)


def test_aux_loss_with_tokens_from_the_main_router():
    """The intended use: scores from compute_aux_scores, counts from the main (biased, grouped) map."""
    t, e, k = 512, 64, 8
    logits = jnp.asarray(tie_free_logits(11, t, e, k, score_function="sigmoid"))
    bias = jnp.asarray(te_bias(e))
    _, main_map = fused_topk_with_score_function(
        logits, k, score_function="sigmoid", expert_bias=bias, num_groups=8, group_topk=4)
    tpe = main_map.sum(0, dtype=jnp.int32)
    assert int(tpe.sum()) == t * k
    scores, _ = fused_topk_with_score_function(logits, k, score_function="sigmoid", compute_aux_scores=True)
    loss = jax.jit(lambda s, n: fused_moe_aux_loss(s, n, k, 1e-2))(scores, tpe)
    np.testing.assert_allclose(float(loss), np_aux_loss(np.asarray(scores), np.asarray(tpe), k, 1e-2), rtol=1e-5)
    # gradient: C * tokens_per_expert[c], constant along tokens
    g = jax.grad(lambda s: fused_moe_aux_loss(s, tpe, k, 1e-2))(scores)
    want = np.broadcast_to(e * 1e-2 / (k * t * t) * np.asarray(tpe, np.float64), (t, e))
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)
    # a uniform router has loss coeff * 1 (E * sum_e (T k / E)(T / E) / (k T^2) = 1)
    uniform = jnp.full((t, e), 1.0 / e)
    np.testing.assert_allclose(float(fused_moe_aux_loss(uniform, jnp.full((e,), t * k // e), k, 1e-2)), 1e-2, rtol=1e-6)


# ---------------------------------------------------------------------------------- top-k ids

def test_topk_ids_and_weights_order_and_values():
    logits = tie_free_logits(13, 64, 32, 4, score_function="sigmoid")
    probs, rmap = fused_topk_with_score_function(jnp.asarray(logits), 4, score_function="sigmoid")
    ids, weights = jax.jit(topk_ids_and_weights, static_argnums=2)(probs, rmap, 4)
    assert ids.dtype == jnp.int32 and weights.dtype == jnp.float32 and ids.shape == (64, 4)
    p = np.asarray(probs)
    want_ids = np.argsort(-np.where(np.asarray(rmap), p, -np.inf), axis=-1, kind="stable")[:, :4]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(weights), np.take_along_axis(p, want_ids, -1))
    assert (np.diff(np.asarray(weights), axis=-1) <= 0).all()
    # routed experts with weight 0 still come before unrouted ones; equal weights: lower id first
    probs0 = jnp.zeros((1, 8)).at[0, 6].set(0.5)
    map0 = jnp.zeros((1, 8), bool).at[0, jnp.asarray([2, 5, 6])].set(True)
    ids0, w0 = topk_ids_and_weights(probs0, map0, 3)
    np.testing.assert_array_equal(np.asarray(ids0), [[6, 2, 5]])
    np.testing.assert_array_equal(np.asarray(w0), [[0.5, 0.0, 0.0]])


# ---------------------------------------------------------------------------------- validation

X = jnp.zeros((4, 16), jnp.float32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(topk=0), r"topk must be an int in \[1, E=16\], got 0"),
    (dict(topk=17), r"topk must be an int in \[1, E=16\], got 17"),
    (dict(topk=2.0), r"topk must be an int"),
    (dict(topk=True), r"topk must be an int"),
    (dict(score_function="relu"), r"score_function must be one of .*got 'relu'"),
    (dict(use_pre_softmax=1), r"use_pre_softmax must be a Python bool, got 1"),
    (dict(compute_aux_scores="yes"), r"compute_aux_scores must be a Python bool"),
    (dict(use_pre_softmax=True, score_function="sigmoid"), r"use_pre_softmax=True applies to .*'sigmoid'"),
    (dict(scaling_factor=float("nan")), r"scaling_factor must be finite, got nan"),
    (dict(scaling_factor=float("inf")), r"scaling_factor must be finite"),
    (dict(scaling_factor=jnp.float32(2.0)), r"scaling_factor must be a Python float or int, got"),
    (dict(scaling_factor="2"), r"scaling_factor must be a Python float or int, got str"),
    (dict(num_groups=4, group_topk=3, topk=4), r"topk must be a multiple of group_topk=3, got topk=4"),
    (dict(num_groups=3, group_topk=1), r"num_groups must divide the number of experts E=16, got num_groups=3"),
    (dict(num_groups=4, group_topk=5, topk=5), r"group_topk must be <= num_groups=4, got group_topk=5"),
    (dict(num_groups=None, group_topk=2), r"group_topk=2 needs num_groups > 0, got num_groups=None"),
    (dict(num_groups=8, group_topk=1, topk=4), r"topk // group_topk must be <= experts per group \(2\)"),
    (dict(num_groups=2.0, group_topk=1), r"num_groups must be an int or None, got 2.0"),
    (dict(expert_bias=jnp.zeros(16)),
     r"expert_bias needs score_function 'sigmoid' or 'sqrtsoftplus', or 'softmax' with use_pre_softmax=True; got "
     r"softmax post-top-k"),
    (dict(expert_bias=jnp.zeros(8), score_function="sigmoid"),
     r"expert_bias must have shape \[E\]=\(16,\), got \(8,\)"),
    (dict(expert_bias=jnp.zeros(16, jnp.int32), score_function="sigmoid"),
     r"expert_bias must be a float array, got dtype int32"),
    (dict(backend="cuda"), r"backend must be one of .*got 'cuda'"),
])
def test_router_validation_errors(kwargs, match):
    kwargs = dict(kwargs)
    topk = kwargs.pop("topk", 2)
    with pytest.raises(ValueError, match=match):
        fused_topk_with_score_function(X, topk, **kwargs)


@pytest.mark.parametrize("logits,match", [
    (jnp.zeros((4, 16), jnp.int32), r"logits dtype must be float32, bfloat16 or float16, got int32"),
    (np.zeros((4, 16), np.float64), r"logits dtype must be .* got float64"),
    (jnp.zeros((4, 0)), r"logits must have shape \[\.\.\., E\] with E >= 1, got shape \(4, 0\)"),
    ([[1.0, 2.0]], r"logits must be a JAX or NumPy array \[\.\.\., E\], got list"),
])
def test_router_rejects_bad_logits(logits, match):
    with pytest.raises(ValueError, match=match):
        fused_topk_with_score_function(logits, 1)


def test_grouping_disabled_by_none_or_non_positive():
    logits = jnp.asarray(tie_free_logits(17, 8, 16, 2))
    want = fused_topk_with_score_function(logits, 2)
    for groups in [(None, None), (4, 0), (4, -1), (-1, -1), (3, None)]:
        got = fused_topk_with_score_function(logits, 2, num_groups=groups[0], group_topk=groups[1])
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("args,kwargs,match", [
    ((jnp.zeros((4, 8)), jnp.zeros(8), 2, 0.1), dict(num_experts=3),
     r"num_experts must be an int dividing the 8 columns of probs, got 3"),
    ((jnp.zeros((4, 8)), jnp.zeros(4), 2, 0.1), {}, r"tokens_per_expert must have shape \[C\]=\(8,\), got \(4,\)"),
    ((jnp.zeros((4, 8)), jnp.zeros(8), 0, 0.1), {}, r"topk must be an int >= 1, got 0"),
    ((jnp.zeros((4, 8)), jnp.zeros(8), 2, float("nan")), {}, r"coeff must be a finite Python float, got nan"),
    ((jnp.zeros((4, 8)), jnp.zeros(8), 2, 0.1), dict(total_num_tokens=0), r"total_num_tokens must be >= 1, got 0"),
    ((jnp.zeros((4, 8)), jnp.zeros(8), 2, 0.1), dict(total_num_tokens=jnp.ones(2)),
     r"total_num_tokens must be an int or a scalar array"),
    ((jnp.zeros((2, 4, 8)), jnp.zeros(8), 2, 0.1), {}, r"probs must have shape \[T, C\], got shape \(2, 4, 8\)"),
    ((jnp.zeros((4, 8), jnp.int32), jnp.zeros(8), 2, 0.1), {}, r"probs dtype must be float32, bfloat16 or float16"),
])
def test_aux_loss_validation_errors(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fused_moe_aux_loss(*args, **kwargs)


@pytest.mark.parametrize("args,match", [
    ((jnp.zeros((4, 8)), jnp.zeros((4, 7), bool), 2),
     r"routing_map must have the shape of probs \(4, 8\), got \(4, 7\)"),
    ((jnp.zeros((4, 8)), jnp.zeros((4, 8), bool), 9), r"topk must be an int in \[1, E=8\], got 9"),
])
def test_topk_ids_validation_errors(args, match):
    with pytest.raises(ValueError, match=match):
        topk_ids_and_weights(*args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edge_shapes(backend):
    """No tokens, a single un-batched token [E], and topk == E (every expert routed)."""
    probs, rmap = fused_topk_with_score_function(jnp.zeros((0, 8), jnp.bfloat16), 2, backend=backend)
    assert probs.shape == rmap.shape == (0, 8) and probs.dtype == jnp.bfloat16
    probs, rmap = fused_topk_with_score_function(jnp.arange(8.0), 3, backend=backend)
    np.testing.assert_array_equal(np.asarray(rmap), [False] * 5 + [True] * 3)
    probs, rmap = fused_topk_with_score_function(jnp.arange(16.0).reshape(2, 8), 8, score_function="sigmoid",
                                                 backend=backend)
    assert np.asarray(rmap).all()
    np.testing.assert_allclose(np.asarray(probs).sum(-1), 1.0, rtol=1e-6)
