"""Router backward (moe-semantics.md 1.6 / 2.1), jit, token sharding, and the GPU lowering."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from router_cases import np_aux_scores, np_router, np_router_grad, te_bias, tie_free_logits

from expertd.kernels.router import RouterConfig, fused_topk_with_score_function
from expertd.kernels.router import pallas as router_pallas

BACKENDS = ("reference", "xla", "pallas")
GRAD_TOL = dict(rtol=1e-5, atol=1e-6)  # fp32 grads vs the float64 formulas (TE: 1e-5)

GRAD_CASES = [
    # (E, k, kwargs) at T = 48
    (32, 4, dict(score_function="softmax")),
    (32, 4, dict(score_function="softmax", use_pre_softmax=True, scaling_factor=1.5)),
    (64, 8, dict(score_function="sigmoid", expert_bias="te", num_groups=8, group_topk=4, scaling_factor=2.5)),
    (32, 1, dict(score_function="sigmoid")),
    (64, 6, dict(score_function="sqrtsoftplus", expert_bias="te")),
]


def _loss(backend, k, kwargs, weights):
    def loss(x):
        probs, _ = fused_topk_with_score_function(x, k, backend=backend, **kwargs)
        return jnp.sum(probs.astype(jnp.float32) * weights)
    return loss


@pytest.mark.parametrize("e,k,kwargs", GRAD_CASES, ids=lambda v: str(v))
def test_grad_matches_the_backward_formulas(e, k, kwargs):
    kwargs = dict(kwargs)
    if kwargs.get("expert_bias") == "te":
        kwargs["expert_bias"] = te_bias(e)
    logits = tie_free_logits(e + k, 48, e, k, **{n: v for n, v in kwargs.items() if n != "scaling_factor"})
    weights = np.random.default_rng(1).standard_normal(logits.shape).astype(np.float32)
    _, rmap = np_router(logits, k, **kwargs)
    want = np_router_grad(logits, rmap, weights, k, score_function=kwargs["score_function"],
                          use_pre_softmax=kwargs.get("use_pre_softmax", False),
                          scaling_factor=kwargs.get("scaling_factor", 1.0))
    if kwargs.get("expert_bias") is not None:
        kwargs["expert_bias"] = jnp.asarray(kwargs["expert_bias"])
    for backend in BACKENDS:
        got = jax.jit(jax.grad(_loss(backend, k, kwargs, jnp.asarray(weights))))(jnp.asarray(logits))
        np.testing.assert_allclose(np.asarray(got), want, err_msg=backend, **GRAD_TOL)
    unrouted = np.asarray(got)[~rmap]
    if kwargs.get("use_pre_softmax"):
        assert np.abs(unrouted).max() > 0  # pre-softmax: unselected experts get gradient too
    else:
        assert not unrouted.any()


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_aux_scores_grad(score_function):
    t, e, k = 48, 32, 4
    logits = tie_free_logits(2, t, e, k, score_function=score_function)
    weights = np.random.default_rng(2).standard_normal(logits.shape).astype(np.float32)
    # aux scores are normalised over all E: the routed-set formulas with every expert "routed"
    want = np_router_grad(logits, np.ones((t, e), bool), weights, e, score_function=score_function,
                          use_pre_softmax=True)
    for backend in BACKENDS:
        got = jax.jit(jax.grad(_loss(backend, k, dict(score_function=score_function, compute_aux_scores=True),
                                     jnp.asarray(weights))))(jnp.asarray(logits))
        np.testing.assert_allclose(np.asarray(got), want, err_msg=backend, **GRAD_TOL)


@pytest.mark.parametrize("kwargs", [
    dict(score_function="softmax"), dict(score_function="softmax", use_pre_softmax=True),
    dict(score_function="sigmoid", expert_bias=te_bias(32)), dict(score_function="sqrtsoftplus"),
    dict(score_function="sigmoid", compute_aux_scores=True)], ids=lambda kw: "-".join(map(str, kw.values()))[:40])
def test_bf16_logits_give_finite_bf16_grads(kwargs):
    """The #2752 hazard: bf16 logits must keep fp32 intermediates and give finite gradients, also
    for saturated sigmoids, underflowing softmax and normalised weights that underflow."""
    t, e, k = 64, 32, 4
    base = tie_free_logits(4, t, e, k, score_function="sigmoid")
    base[:8] -= 120.0   # every sigmoid ~0 (0/1e-20 weights)
    base[8:16] += 60.0  # saturated sigmoids / sqrtsoftplus linear branch
    base[16:24] *= 40.0  # softmax far into underflow
    logits = jnp.asarray(base, jnp.bfloat16)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((t, e)), jnp.float32)
    kwargs = {n: jnp.asarray(v, jnp.bfloat16) if n == "expert_bias" else v for n, v in kwargs.items()}
    # the fp32 gradient at the bf16-rounded logits; compared to bf16 precision of the largest entry
    # (the cotangent is rounded to bf16 and softmax's p (g - <g, p>) cancels, so not elementwise)
    want = np.asarray(jax.grad(_loss("reference", k, kwargs, weights))(logits.astype(jnp.float32)))
    # xla and pallas share the custom_vjp backward; pallas's forward needs a compile per variant
    backends = BACKENDS if kwargs["score_function"] == "sigmoid" else ("reference", "xla")
    for backend in backends:
        probs, _ = fused_topk_with_score_function(logits, k, backend=backend, **kwargs)
        want_dtype = jnp.float32 if kwargs.get("compute_aux_scores") else jnp.bfloat16
        assert probs.dtype == want_dtype and np.isfinite(np.asarray(probs, np.float32)).all()
        grad = jax.grad(_loss(backend, k, kwargs, weights))(logits)
        assert grad.dtype == jnp.bfloat16, backend
        assert np.isfinite(np.asarray(grad, np.float32)).all(), backend
        np.testing.assert_allclose(np.asarray(grad, np.float32), want, rtol=0,
                                   atol=2**-7 * np.abs(want).max(), err_msg=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_bias_gets_no_gradient(backend):
    logits = jnp.asarray(tie_free_logits(6, 16, 16, 4, score_function="sigmoid"))
    grad = jax.grad(lambda b: fused_topk_with_score_function(
        logits, 4, score_function="sigmoid", expert_bias=b, backend=backend)[0].sum())(jnp.asarray(te_bias(16)))
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_under_jit_with_static_config(backend):
    logits = jnp.asarray(tie_free_logits(8, 32, 64, 8, score_function="sigmoid"))
    bias = jnp.asarray(te_bias(64))
    route = jax.jit(fused_topk_with_score_function, static_argnames=(
        "topk", "score_function", "num_groups", "group_topk", "scaling_factor", "backend"))
    kwargs = dict(score_function="sigmoid", num_groups=8, group_topk=4, scaling_factor=2.0, backend=backend)
    got = route(logits, 8, expert_bias=bias, **kwargs)
    want = fused_topk_with_score_function(logits, 8, expert_bias=bias, **kwargs)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6)
    compiled = route._cache_size()  # (jit caches are shared per function: count new entries)
    route(logits + 1.0, 8, expert_bias=bias + 0.5, **kwargs)  # new values: no new compile
    assert route._cache_size() == compiled
    # value_and_grad compiles as one program
    step = jax.jit(jax.value_and_grad(
        lambda x: fused_topk_with_score_function(x, 8, expert_bias=bias, **kwargs)[0].sum()))
    value, grad = step(logits)
    assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()


def _mesh():
    devices = jax.devices()
    if len(devices) < 2:
        raise RuntimeError("tests/conftest.py should provide 8 simulated CPU devices")
    return jax.make_mesh((len(devices),), ("data",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_token_sharded_logits(backend):
    """Tokens sharded over the devices (the expert axis replicated) give the unsharded results."""
    mesh = _mesh()
    t, e, k = 8 * len(mesh.devices), 64, 8
    logits = jnp.asarray(tie_free_logits(9, t, e, k, score_function="sigmoid", num_groups=8, group_topk=4))
    kwargs = dict(score_function="sigmoid", num_groups=8, group_topk=4, backend=backend)
    want_probs, want_map = fused_topk_with_score_function(logits, k, **kwargs)
    sharded = jax.device_put(logits, NamedSharding(mesh, P("data", None)))
    probs, rmap = jax.jit(lambda x: fused_topk_with_score_function(x, k, **kwargs))(sharded)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_map))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_probs), rtol=1e-6)
    # per-shard routing inside shard_map (Pallas calls need check_vma=False there)
    local = jax.shard_map(lambda x: fused_topk_with_score_function(x, k, **kwargs), mesh=mesh,
                          in_specs=P("data", None), out_specs=P("data", None), check_vma=False)
    probs, rmap = jax.jit(local)(sharded)
    assert probs.sharding.spec == P("data", None)
    np.testing.assert_array_equal(np.asarray(rmap), np.asarray(want_map))
    np.testing.assert_allclose(np.asarray(probs), np.asarray(want_probs), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda x: local(x)[0].sum()))(sharded)
    assert np.isfinite(np.asarray(grad)).all()


@pytest.mark.parametrize("t,e,k,kwargs", [
    (4096, 256, 8, dict(score_function="sigmoid", has_bias=True, num_groups=8, group_topk=4)),
    (1000, 60, 4, dict(score_function="softmax")),  # E not a power of two, T not a block multiple
    (128, 8, 2, dict(score_function="softmax", use_pre_softmax=True)),
    (64, 1024, 16, dict(score_function="sqrtsoftplus")),
    (64, 32, 4, dict(score_function="sigmoid", aux_scores=True)),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_kernel_lowers_to_triton_for_gpu(t, e, k, kwargs, dtype):
    """No GPU in CI: check that the compiled (interpret=False) kernel passes the Pallas-Triton
    lowering (power-of-two blocks, supported primitives) by lowering for CUDA on the CPU box."""
    cfg = RouterConfig(topk=k, **kwargs)
    route = jax.jit(functools.partial(router_pallas.router_pallas, cfg=cfg, interpret=False))
    bias = jax.ShapeDtypeStruct((e,), jnp.float32) if cfg.has_bias else None
    lowered = route.trace(jax.ShapeDtypeStruct((t, e), dtype), bias).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_aux_scores_oracle_map_under_sharding():
    """compute_aux_scores on token-sharded logits: dense fp32 scores, per-token map."""
    mesh = _mesh()
    t, e, k = 4 * len(mesh.devices), 32, 4
    logits = tie_free_logits(10, t, e, k)
    sharded = jax.device_put(jnp.asarray(logits), NamedSharding(mesh, P("data", None)))
    scores, rmap = jax.jit(lambda x: fused_topk_with_score_function(x, k, compute_aux_scores=True))(sharded)
    want_scores, want_map = np_aux_scores(logits, k, "softmax")
    np.testing.assert_array_equal(np.asarray(rmap), want_map)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5, atol=1e-7)
