"""MoEParams / RouterParams (kernels/params.py): built from a loader's dict with errors that name the
key and its expected shape, back to a dict, through jit and tree maps as pytrees; the family
semantics' fields (shapes, dtypes, the hash table's values) and the config checks naming the field."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import moe
from expertd.kernels.params import FIELDS, ROUTER_FIELDS, MoEParams, RouterParams, check_params, logical_shape

CFG = moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=16, score_function="sigmoid",
                    use_expert_bias=True, num_shared_experts=1, shared_intermediate_size=12, shared_expert_gate=True)
# Every family field but the hash table (hash routing takes no expert bias), and the hash table.
FULL = dataclasses.replace(CFG, router_bias=True, router_input_norm=True, per_expert_scale=True, expert_proj_bias=True,
                           expert_input_norm=True, expert_output_norm=True)
HASHED = moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=16, score_function="sqrtsoftplus",
                       hash_vocab_size=10)


def host_dict(cfg=CFG):
    """What a checkpoint loader builds: numpy arrays keyed by the field names."""
    return {name: np.zeros(shape, np.float32) for name, shape in moe.param_shapes(cfg).items()}


def test_from_dict_and_back():
    d = host_dict(FULL)
    params = MoEParams.from_dict(d, FULL)
    assert set(params.to_dict()) == set(d) == set(FIELDS) - {"tid2eid"}
    assert all(params.to_dict()[name] is d[name] for name in d)
    assert [name for name, _ in params.items()] == [f for f in FIELDS if f != "tid2eid"]  # field order
    assert params.shapes() == moe.param_shapes(FULL)
    bare = MoEParams.from_dict({k: d[k] for k in ("router_weight", "w_gate", "w_up", "w_down")})
    assert bare.expert_bias is None and bare.shared_gate is None and len(bare.to_dict()) == 4
    assert "w_gate=[4, 8, 16] float32" in repr(params) and "shared_w_up=[8, 12]" in repr(params)


def test_family_fields_shapes_dtypes_and_the_hash_table():
    shapes = moe.param_shapes(FULL)
    assert {k: shapes[k] for k in ("router_bias", "router_input_scale", "per_expert_scale", "b_gate", "b_up",
                                   "b_down", "expert_input_norm_weight", "expert_output_norm_weight")} == {
        "router_bias": (4,), "router_input_scale": (8,), "per_expert_scale": (4,), "b_gate": (4, 16),
        "b_up": (4, 16), "b_down": (4, 8), "expert_input_norm_weight": (8,), "expert_output_norm_weight": (8,)}
    params = moe.init_params(FULL, jax.random.key(0), jnp.bfloat16)
    assert {n: str(v.dtype) for n, v in params.items() if n not in ("w_gate", "w_up", "w_down")} == {
        n: "bfloat16" if n.startswith(("b_", "shared_")) else "float32"
        for n in shapes if n not in ("w_gate", "w_up", "w_down")}
    assert moe.param_dtype("tid2eid", jnp.bfloat16) == jnp.int32
    assert moe.param_dtype("router_bias", jnp.bfloat16) == jnp.float32
    assert moe.param_dtype("expert_output_norm_weight", jnp.bfloat16) == jnp.float32
    assert moe.param_dtype("b_down", jnp.bfloat16) == jnp.bfloat16
    hashed = moe.init_params(HASHED, jax.random.key(0))
    table = np.asarray(hashed.tid2eid)
    assert table.shape == (10, 2) and table.dtype == np.int32 and table.min() >= 0 and table.max() < 4
    assert all(len(set(row)) == 2 for row in table)  # k distinct experts per token id
    assert set(hashed.router.to_dict()) == {"router_weight", "tid2eid"}
    d = {name: np.asarray(v) for name, v in hashed.items()}
    with pytest.raises(ValueError, match=r"params.tid2eid\[3, 1\] = 4 is not an expert id in \[0, 4\)"):
        MoEParams.from_dict({**d, "tid2eid": _with(table, (3, 1), 4)}, HASHED)
    with pytest.raises(ValueError, match=r"params.tid2eid must be an integer array"):
        MoEParams.from_dict({**d, "tid2eid": table.astype(np.float32)}, HASHED)
    with pytest.raises(ValueError, match=r"params is missing 'tid2eid' \(expected shape \(10, 2\)\)"):
        MoEParams.from_dict({k: v for k, v in d.items() if k != "tid2eid"}, HASHED)


def _with(table, index, value):
    out = table.copy()
    out[index] = value
    return out


@pytest.mark.parametrize("fields,match", [
    (dict(group_score_topk=2), "group_score_topk needs group-limited routing"),
    (dict(num_groups=2, group_topk=1, group_score_topk=3),
     r"group_score_topk must be an int in \[1, E // num_groups = 2\]"),
    (dict(num_groups=4, group_topk=1, topk=2, group_score_topk=1), r"topk=2 exceeds the 1 experts"),
    (dict(num_groups=2, group_topk=2, topk=3), "or set group_score_topk"),
    (dict(use_expert_bias=True), "'softmax' with use_pre_softmax=True"),
    (dict(norm_topk_min=0.1), "norm_topk_min needs norm_topk_prob=True"),
    (dict(norm_topk_prob=True, use_pre_softmax=True, norm_topk_min=-1.0), "norm_topk_min must be a finite float > 0"),
    (dict(hash_vocab_size=8), r"hash routing\) needs score_function 'sigmoid' or 'sqrtsoftplus'"),
    (dict(hash_vocab_size=8, score_function="sigmoid", use_expert_bias=True), "takes no use_expert_bias"),
    (dict(hash_vocab_size=-1), "hash_vocab_size must be an int >= 0"),
    (dict(swiglu_limit=0.0), r"swiglu_limit must be None \(no clamp\) or a finite float > 0"),
    (dict(shared_swiglu_limit=7.0), "shared_swiglu_limit needs shared experts"),
    (dict(swiglu_limit_mode="clamp"), "swiglu_limit_mode must be one of"),
    (dict(activation="swiglu_oai", swiglu_limit_mode="after_activation"), "'swiglu_oai' clamps before"),
    (dict(swiglu_alpha=1.0), "swiglu_alpha applies to activation 'swiglu_oai' only"),
    (dict(norm_eps=0.0), "norm_eps must be a finite float > 0"),
])
def test_family_config_errors_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        moe.MoEConfig(**{**dict(num_experts=4, topk=2, hidden_size=8, intermediate_size=16), **fields})


def test_group_score_topk_relaxes_the_multiple_rule():
    # DeepSeek-V3-shaped groups with topk not a multiple of group_topk: fine with HF's top-2 score.
    cfg = moe.MoEConfig(num_experts=16, topk=3, hidden_size=8, intermediate_size=16, num_groups=4, group_topk=2,
                        group_score_topk=2)
    assert cfg.group_score_topk == 2


@pytest.mark.parametrize("drop,with_cfg,match", [
    ("w_up", True, r"params is missing 'w_up' \(expected shape \(4, 8, 16\)\)"),
    ("w_up", False, r"params is missing 'w_up' \(expected shape \[E, H, I\]\)"),
    ("router_weight", False, r"params is missing 'router_weight' \(expected shape \[H, E\]\)"),
    ("expert_bias", True, r"params is missing 'expert_bias' \(expected shape \(4,\)\)"),
    ("shared_gate", True, r"params is missing 'shared_gate' \(expected shape \(8, 1\)\)"),
])
def test_from_dict_names_the_missing_key_and_its_shape(drop, with_cfg, match):
    d = {k: v for k, v in host_dict().items() if k != drop}
    with pytest.raises(ValueError, match=match):
        MoEParams.from_dict(d, CFG if with_cfg else None)


def test_from_dict_names_a_misshapen_or_unknown_key():
    with pytest.raises(ValueError, match=r"params.w_down must have shape \(4, 16, 8\), got \(4, 8, 16\)"):
        MoEParams.from_dict({**host_dict(), "w_down": np.zeros((4, 8, 16))}, CFG)
    with pytest.raises(ValueError, match=r"params has unknown key 'w1'; MoEParams keys are"):
        MoEParams.from_dict({**host_dict(), "w1": np.zeros(3)})
    with pytest.raises(TypeError, match="mapping"):
        MoEParams.from_dict([("router_weight", np.zeros((8, 4)))])
    with pytest.raises(TypeError, match=r"MoEParams \(MoEParams.from_dict"):
        check_params(host_dict(), CFG)


def test_a_pytree_through_jit_and_tree_map():
    params = moe.init_params(CFG, jax.random.key(0), jnp.bfloat16)
    host = jax.tree.map(np.asarray, params)
    assert isinstance(host, MoEParams) and isinstance(host.w_gate, np.ndarray)
    assert len(jax.tree.leaves(params)) == len(moe.param_shapes(CFG))
    doubled = jax.jit(lambda p: jax.tree.map(lambda a: a * 2, p))(params)
    assert isinstance(doubled, MoEParams)
    np.testing.assert_array_equal(np.asarray(doubled.w_up, np.float32), 2 * np.asarray(params.w_up, np.float32))
    no_shared = moe.init_params(moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=16),
                                jax.random.key(0))
    assert no_shared.shared_w_up is None and len(jax.tree.leaves(no_shared)) == 4  # None fields are no leaves
    assert jax.jit(lambda p: p.replace(w_up=p.w_up + 1))(no_shared).expert_bias is None


def test_router_params_are_the_router_part():
    params = moe.init_params(CFG, jax.random.key(0))
    router = params.router
    assert isinstance(router, RouterParams) and router.router_weight is params.router_weight
    assert set(router.to_dict()) == {"router_weight", "expert_bias"}
    full = moe.init_params(FULL, jax.random.key(0)).router
    assert set(full.to_dict()) == set(ROUTER_FIELDS) - {"tid2eid"}
    x = jax.random.normal(jax.random.key(1), (5, 8))
    for a, b in zip(moe.route(router, x, CFG), moe.route(params, x, CFG)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert RouterParams.from_dict({"router_weight": np.zeros((8, 4))}).expert_bias is None
    with pytest.raises(ValueError, match=r"unknown key 'shared_gate'; RouterParams keys are"):
        RouterParams.from_dict(params.to_dict())
    with pytest.raises(TypeError, match="MoEParams or RouterParams"):
        moe.route({"router_weight": params.router_weight}, x, CFG)


def test_logical_shape_reads_arrays_and_prepared_weights():
    class Prepared:  # what a backend's prepared weights show: not an array, their logical shape
        logical_shape = (4, 8, 16)

    assert logical_shape(np.zeros((2, 3))) == (2, 3) and logical_shape(Prepared()) == (4, 8, 16)
    with pytest.raises(TypeError, match="expected an array"):
        logical_shape(object())
