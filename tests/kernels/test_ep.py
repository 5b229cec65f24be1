"""Expert-parallel MoE layer (expertd.kernels.ep) against the single-device layer, on 1-8 simulated
CPU devices.

Compiling one (family, R, mode, shape) costs 1-3 s of CPU, so shapes are shared on purpose: most
tests use T=24, E=8, k=2 and a (family, R, mode) that an earlier test compiled (jit cache hits).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ep_multiprocess import family_layer_config
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from expertd.kernels import ep, moe, ragged

H, I = 32, 16
FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16: both layers round the same fp32-accumulated values to bf16, but matmuls over different row
# counts may differ in the last fp32 bits, which can move a bf16 rounding by one ulp (2^-8 relative).
BF16_TOL = dict(rtol=1e-2, atol=1e-2)

moe_layer_jit = jax.jit(moe.moe_layer, static_argnames=("cfg", "backend", "return_routing"))
emulated = ragged.ragged_all_to_all_emulated


@functools.cache
def mesh_of(r):
    return jax.make_mesh((r,), ("ep",), axis_types=(AxisType.Auto,), devices=jax.devices()[:r])


@functools.cache
def setup(family, num_experts=None, topk=None, dtype="float32"):
    # Qwen3 with k=4 of 16 experts: more experts per token than a rank holds at R=8 (E/R=2).
    e, k = (16, 4) if family == "qwen3_moe" else (8, 2)
    cfg = family_layer_config(family, num_experts or e, topk or k, H, I)
    params = moe.init_params(cfg, jax.random.key(0), jnp.dtype(dtype))
    return cfg, jax.tree.map(np.asarray, params)


def tokens(t, seed=1, dtype=np.float32):
    return np.asarray(jax.random.normal(jax.random.key(seed), (t, H), jnp.float32)).astype(dtype)


def reference(params, x, cfg, **kw):
    out, routing = moe_layer_jit(params, jnp.asarray(x), cfg, return_routing=True, **kw)
    return np.asarray(out.astype(jnp.float32)), jax.tree.map(np.asarray, routing)


def run_ep(params, x, cfg, r, **kw):
    out, stats = ep.ep_moe_layer(params, x, cfg, mesh_of(r), return_stats=True, **kw)
    return np.asarray(out.astype(jnp.float32)), jax.tree.map(np.asarray, stats)


def skewed_params(cfg, params, target_rank, r):
    """Router weights that send every token to experts of `target_rank` only (x[:, 0] is set to 8)."""
    el = cfg.num_experts // r
    w = np.array(params.router_weight)
    w[0] = -4.0
    w[0, target_rank * el:(target_rank + 1) * el] = 4.0 + np.arange(el) * 0.5
    params = params.replace(router_weight=w)
    if params.expert_bias is not None:
        params = params.replace(expert_bias=np.zeros_like(params.expert_bias))
    return params


def skewed_tokens(t, seed=2):
    x = tokens(t, seed)
    x[:, 0] = 8.0
    return x


@pytest.mark.parametrize("family,r", [(f, r) for f in ("mixtral", "qwen2_moe", "deepseek_v3") for r in (1, 2, 4, 8)]
                         + [("qwen3_moe", 2), ("qwen3_moe", 8)])
def test_capacity_dispatch_equals_moe_layer(family, r):
    cfg, params = setup(family)
    x = tokens(24)
    want, routing = reference(params, x, cfg)
    got, stats = run_ep(params, x, cfg, r, dispatch="capacity")
    np.testing.assert_allclose(got, want, **FP32_TOL)
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])
    # The routing each rank computed comes back with the stats: a caller needs no second pass.
    np.testing.assert_array_equal(stats["topk_ids"], routing["topk_ids"])
    np.testing.assert_allclose(stats["topk_weights"], routing["topk_weights"], rtol=1e-6, atol=0)
    assert stats["dropped_pairs"] == 0
    assert stats["rows_received"].sum() == 24 * cfg.topk


@pytest.mark.parametrize("r", (2, 4))
def test_capacity_expert_backend_inside_the_ranks_equals_moe_layer(r):
    """The "capacity" expert backend picks its bucket with lax.switch on each rank's own groups."""
    cfg, params = setup("mixtral")
    x = tokens(24)
    got, stats = run_ep(params, x, cfg, r, dispatch="capacity", backend="capacity")
    np.testing.assert_allclose(got, reference(params, x, cfg)[0], **FP32_TOL)
    assert stats["dropped_pairs"] == 0


@pytest.mark.parametrize("num_tokens", (24, 256))  # ~6 rows per expert (streaming path), ~64 (packed)
@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_native_cpu_expert_backend_inside_the_ranks_equals_moe_layer(dtype, num_tokens):
    """The C++ custom call runs per simulated device inside shard_map (concurrently, each on its
    own thread-local panels in the packed path), on each rank's own groups."""
    from expertd.kernels import cpu

    if not cpu.available():
        pytest.skip(f"no native kernel: {cpu.unavailable_reason()}")
    cfg, params = setup("mixtral", dtype=dtype)
    x = tokens(num_tokens, dtype=jnp.dtype(dtype))
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", backend="native_cpu")
    want = reference(params, x, cfg, backend="native_cpu")[0]
    np.testing.assert_allclose(got, want, **(FP32_TOL if dtype == "float32" else BF16_TOL))
    np.testing.assert_allclose(got, reference(params, x, cfg, backend="expert_loop")[0],
                               **(FP32_TOL if dtype == "float32" else BF16_TOL))
    assert stats["dropped_pairs"] == 0


@pytest.mark.parametrize("family,r", [("mixtral", 2), ("qwen2_moe", 8), ("deepseek_v3", 4), ("qwen3_moe", 8)])
def test_ragged_dispatch_through_the_emulation_equals_capacity_dispatch(family, r):
    cfg, params = setup(family)
    x = tokens(24)
    want, _ = run_ep(params, x, cfg, r, dispatch="capacity")
    got, stats = run_ep(params, x, cfg, r, dispatch="ragged", ragged_all_to_all=emulated)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    np.testing.assert_allclose(got, reference(params, x, cfg)[0], **FP32_TOL)
    assert stats["dropped_pairs"] == 0


def test_bf16_matches_moe_layer_within_documented_tolerance():
    cfg, params = setup("deepseek_v3", dtype="bfloat16")
    x = tokens(24, dtype=jnp.bfloat16)
    want, _ = reference(params, x, cfg)
    got, stats = run_ep(params, x, cfg, 4, dispatch="ragged", ragged_all_to_all=emulated)
    np.testing.assert_allclose(got, want, **BF16_TOL)
    # bf16 rows are 2 bytes per element: the minimum is (rows out + rows back) * H * 2.
    assert stats["min_bytes"].sum() == 2 * 24 * cfg.topk * H * 2


@pytest.mark.parametrize("mode", ["capacity", "ragged"])
@pytest.mark.parametrize("r", [2, 4])
def test_all_tokens_to_one_ranks_experts(mode, r):
    cfg, params = setup("mixtral")
    params = skewed_params(cfg, params, target_rank=r - 1, r=r)
    x = skewed_tokens(24)
    want, routing = reference(params, x, cfg)
    el = cfg.num_experts // r
    assert (routing["topk_ids"] // el == r - 1).all()  # the setup really is skewed
    kw = dict(ragged_all_to_all=emulated) if mode == "ragged" else {}
    got, stats = run_ep(params, x, cfg, r, dispatch=mode, **kw)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    assert np.isfinite(got).all()
    assert stats["dropped_pairs"] == 0  # the worst-case capacity holds exactly this case
    np.testing.assert_array_equal(stats["rows_received"], [0] * (r - 1) + [24 * cfg.topk])


def test_ranks_that_receive_nothing_and_more_ranks_than_tokens():
    cfg, params = setup("deepseek_v3")
    x = tokens(3)  # R=8: 5 ranks hold only padding rows
    want, _ = reference(params, x, cfg)
    for mode, kw in (("capacity", {}), ("ragged", dict(ragged_all_to_all=emulated))):
        got, stats = run_ep(params, x, cfg, 8, dispatch=mode, **kw)
        np.testing.assert_allclose(got, want, **FP32_TOL)
        assert got.shape == (3, H)
        assert (stats["rows_received"] == 0).any()


def test_valid_tokens_count_and_mask_with_nan_padding():
    cfg, params = setup("qwen2_moe")
    x = tokens(24)
    x[20:] = np.nan  # padding rows never reach an expert, so their garbage cannot leak
    want, routing = reference(params, x, cfg, valid_tokens=20)
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=20)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    np.testing.assert_array_equal(got[20:], 0)
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])
    assert stats["tokens_per_expert"].sum() == 20 * cfg.topk
    np.testing.assert_array_equal(stats["topk_ids"], routing["topk_ids"])  # -1 on padding rows
    np.testing.assert_array_equal(stats["topk_ids"][20:], -1)
    np.testing.assert_array_equal(stats["topk_weights"][20:], 0)
    mask = np.arange(24) % 3 != 0
    x = tokens(24)
    want, _ = reference(params, x, cfg, valid_tokens=mask)
    got, _ = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=mask)
    np.testing.assert_allclose(got, want, **FP32_TOL)
    got, stats = run_ep(params, x, cfg, 4, dispatch="capacity", valid_tokens=0)
    np.testing.assert_array_equal(got, 0)
    assert stats["tokens_per_expert"].sum() == 0 and stats["bytes_ratio"] == np.inf


def dropped_pairs_by_hand(topk_ids, r, el, capacity):
    """Per source rank and destination, pairs sent in (expert, token) order; those past `capacity` drop."""
    t = topk_ids.shape[0]
    per_rank = -(-t // r)
    dropped = set()
    for src in range(r):
        pairs = sorted((e, tok, j) for tok in range(src * per_rank, min(t, (src + 1) * per_rank))
                       for j, e in enumerate(topk_ids[tok]) if e >= 0)
        for dst in range(r):
            to_dst = [p for p in pairs if p[0] // el == dst]
            dropped.update((tok, j) for _, tok, j in to_dst[capacity:])
    return dropped


def gated_mlp_np(x, wg, wu, wd):
    g, u = x @ wg, x @ wu
    return (g / (1 + np.exp(-g)) * u) @ wd


def test_low_capacity_factor_reports_the_exact_dropped_pairs():
    capacity_factor = 0.75
    cfg, params = setup("deepseek_v3", num_experts=16, topk=4)
    r, t = 4, 32
    params = skewed_params(cfg, params, target_rank=1, r=r)
    params.router_weight[0, :4] = 3.0  # most pairs go to rank 1, some to rank 0
    x = tokens(t, seed=5)
    x[:, 0] = 1.5  # moderate logits: sigmoid scores stay distinct (no saturation ties)
    x[::3, 0] = 0.0  # a third of the tokens route by their random features
    _, routing = reference(params, x, cfg)
    ids, weights = routing["topk_ids"], routing["topk_weights"]
    per_rank, el = t // r, cfg.num_experts // r
    capacity = min(per_rank * min(cfg.topk, el), max(1, math.ceil(capacity_factor * per_rank * cfg.topk / r)))
    dropped = dropped_pairs_by_hand(ids, r, el, capacity)
    assert 0 < len(dropped) < t * cfg.topk

    got, stats = run_ep(params, x, cfg, r, dispatch="capacity", capacity_factor=capacity_factor)
    assert stats["dropped_pairs"] == len(dropped)
    np.testing.assert_array_equal(stats["tokens_per_expert"], routing["tokens_per_expert"])  # routed, pre-drop
    assert stats["rows_received"].sum() == t * cfg.topk - len(dropped)
    # Dropped pairs contribute nothing and the kept weights are NOT renormalised.
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    x64 = x.astype(np.float64)
    want = gated_mlp_np(x64, p["shared_w_gate"], p["shared_w_up"], p["shared_w_down"])
    for tok in range(t):
        for j, e in enumerate(ids[tok]):
            if (tok, j) not in dropped:
                want[tok] += weights[tok, j] * gated_mlp_np(x64[tok], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The bytes on the wire are the fixed buffers: R * C rows out and back per rank.
    np.testing.assert_allclose(stats["bytes_sent"], 2 * r * capacity * H * 4 + r * cfg.num_experts * 4)


def test_bytes_accounting_ragged_is_minimal_and_capacity_is_worst_case():
    cfg, params = setup("mixtral")
    x = tokens(24)
    r, row = 2, H * 4
    _, cap = run_ep(params, x, cfg, r, dispatch="capacity")
    _, rag = run_ep(params, x, cfg, r, dispatch="ragged", ragged_all_to_all=emulated)
    np.testing.assert_array_equal(cap["min_bytes"], rag["min_bytes"])
    assert cap["min_bytes"].sum() == 2 * 24 * cfg.topk * row
    meta = r * cfg.num_experts * 4  # the int32 [R, E] count all_gather
    np.testing.assert_allclose(rag["bytes_sent"], rag["min_bytes"] + meta)
    worst = 12 * min(cfg.topk, cfg.num_experts // r)  # T/R * min(k, El) rows per destination
    np.testing.assert_allclose(cap["bytes_sent"], 2 * r * worst * row + meta)
    np.testing.assert_allclose(cap["bytes_ratio"], cap["bytes_sent"].sum() / cap["min_bytes"].sum(), rtol=1e-6)


def test_device_inputs_and_placed_params_give_the_same_output():
    cfg, params = setup("mixtral")
    mesh = mesh_of(4)
    placed = ep.shard_params(params, cfg, mesh)
    assert isinstance(placed, moe.MoEParams) and placed.w_gate.sharding.spec == P("ep")
    assert placed.w_gate.addressable_shards[0].data.shape == (2, H, I)
    assert placed.router_weight.sharding.is_fully_replicated
    assert ep.shard_params(placed, cfg, mesh).w_up is placed.w_up  # placing again is a no-op
    x = tokens(24)
    host = np.asarray(ep.ep_moe_layer(params, x, cfg, mesh, dispatch="capacity"))
    x_placed = jax.device_put(x, NamedSharding(mesh, P("ep")))
    on_device = ep.ep_moe_layer(placed, x_placed, cfg, mesh, dispatch="capacity")
    np.testing.assert_array_equal(np.asarray(on_device), host)


def test_auto_dispatch_is_capacity_on_cpu():
    mesh = mesh_of(2)
    assert ep.resolve_dispatch("auto", mesh) == "capacity"
    assert ep.resolve_dispatch("ragged", mesh, ragged_all_to_all=emulated) == "ragged"


@pytest.mark.parametrize("kwargs,match", [
    (dict(dispatch="ragged"), "XLA:CPU cannot compile"),
    (dict(dispatch="dense"), "dispatch must be one of"),
    (dict(dispatch="capacity", capacity_factor=0.0), "capacity_factor must be a finite number > 0"),
    (dict(dispatch="ragged", capacity_factor=1.0, ragged_all_to_all=emulated), "capacity_factor applies to"),
    (dict(axis="tp"), "axis 'tp' is not a mesh axis"),
])
def test_bad_arguments_raise_value_errors_naming_them(kwargs, match):
    cfg, params = setup("mixtral")
    with pytest.raises(ValueError, match=match):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(2), **kwargs)


def test_bad_shapes_raise_value_errors():
    cfg, params = setup("mixtral")
    with pytest.raises(ValueError, match="must be divisible by the 3 ranks"):
        ep.ep_moe_layer(params, tokens(4), cfg, mesh_of(3))
    with pytest.raises(ValueError, match=r"x must be \[T, H=32\]"):
        ep.ep_moe_layer(params, np.zeros((4, 8), np.float32), cfg, mesh_of(2))
    with pytest.raises(ValueError, match="w_down"):
        ep.ep_moe_layer(params.replace(w_down=None), tokens(4), cfg, mesh_of(2))
    with pytest.raises(TypeError, match="MoEParams"):
        ep.ep_moe_layer(params.to_dict(), tokens(4), cfg, mesh_of(2))
