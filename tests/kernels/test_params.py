"""MoEParams / RouterParams (kernels/params.py): built from a loader's dict with errors that name the
key and its expected shape, back to a dict, through jit and tree maps as pytrees."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import moe
from expertd.kernels.params import FIELDS, MoEParams, RouterParams, check_params, logical_shape

CFG = moe.MoEConfig(num_experts=4, topk=2, hidden_size=8, intermediate_size=16, score_function="sigmoid",
                    use_expert_bias=True, num_shared_experts=1, shared_intermediate_size=12, shared_expert_gate=True)


def host_dict(cfg=CFG):
    """What a checkpoint loader builds: numpy arrays keyed by the field names."""
    return {name: np.zeros(shape, np.float32) for name, shape in moe.param_shapes(cfg).items()}


def test_from_dict_and_back():
    d = host_dict()
    params = MoEParams.from_dict(d, CFG)
    assert set(params.to_dict()) == set(d) == set(FIELDS)
    assert all(params.to_dict()[name] is d[name] for name in d)
    assert [name for name, _ in params.items()] == list(FIELDS)  # field order
    assert params.shapes() == moe.param_shapes(CFG)
    bare = MoEParams.from_dict({k: d[k] for k in ("router_weight", "w_gate", "w_up", "w_down")})
    assert bare.expert_bias is None and bare.shared_gate is None and len(bare.to_dict()) == 4
    assert "w_gate=[4, 8, 16] float32" in repr(params) and "shared_w_up=[8, 12]" in repr(params)


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
    assert len(jax.tree.leaves(params)) == len(FIELDS)
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
