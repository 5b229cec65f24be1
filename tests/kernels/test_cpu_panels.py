"""Panel-major expert weights (kernels/cpu/panels.py): an exact relayout that goes through jit as a
pytree without posing as an array, made by prepare_params where the native kernel runs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu, moe
from expertd.kernels.cpu import panels


@pytest.mark.parametrize("width", panels.PANEL_WIDTHS)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("shape", ((1, 3, 16), (2, 5, 40), (3, 64, 7), (2, 4, 136)))
def test_relayout_is_exact_and_keeps_the_logical_shape(shape, dtype, width):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    pw = panels.to_panels(w, width)
    e, k, c = shape
    assert pw.logical_shape == shape and pw.dtype == dtype and pw.panel_columns == width
    assert not any(hasattr(pw, name) for name in ("shape", "ndim", "__array__"))  # not an array
    p = -(-c // width)
    # Every weight where the module docstring says; the rest (columns past C, bf16's second row of
    # the last pair when K is odd) is zero padding.
    if dtype == jnp.float32:
        assert pw.panels.shape == (e, p, k, width)
        where = lambda kk, cc: (cc // width, kk, cc % width)  # noqa: E731
    else:
        assert pw.panels.shape == (e, p, -(-k // 2), 2 * width)
        where = lambda kk, cc: (cc // width, kk // 2, 2 * (cc % width) + 1 - kk % 2)  # noqa: E731
    held = np.asarray(pw.panels.astype(jnp.float32))
    placed = np.zeros(held.shape, bool)
    for kk in range(k):
        for cc in range(c):
            np.testing.assert_array_equal(held[(slice(None),) + where(kk, cc)], np.asarray(w[:, kk, cc], np.float32))
            placed[(slice(None),) + where(kk, cc)] = True
    assert placed.sum() == e * k * c
    np.testing.assert_array_equal(held[~placed], 0)
    np.testing.assert_array_equal(np.asarray(panels.dense(pw)), np.asarray(w))
    other = panels.to_panels(pw, 80 - width)  # the other width, relaid out from this one
    assert other.panel_columns == 80 - width and panels.to_panels(other, 80 - width) is other
    np.testing.assert_array_equal(np.asarray(panels.dense(other)), np.asarray(w))
    # A pytree: through jit and back, as an argument and as a result.
    out = jax.jit(lambda p: panels.to_panels(panels.dense(p) * 2))(pw)
    assert isinstance(out, panels.PanelWeights) and out.logical_shape == shape
    np.testing.assert_array_equal(np.asarray(panels.dense(out)), np.asarray(w) * 2)
    assert panels.to_panels(pw, width) is pw and panels.dense(w) is w
    assert cpu.dense_weights is panels.dense  # the door the other backends read prepared weights through


def test_the_width_follows_the_kernel_instruction_set():
    assert [panels.panel_columns(level) for level in cpu.ISA_LEVELS] == [16, 16, 64, 64, 64]
    want = panels.panel_columns(cpu.isa())
    assert panels.panel_columns() == want and panels.to_panels(jnp.ones((1, 2, 64))).panel_columns == want
    with pytest.raises(ValueError, match="columns must be one of"):
        panels.to_panels(jnp.ones((1, 2, 64)), 32)


def test_relayout_names_what_it_expected():
    with pytest.raises(ValueError, match=r"expert weights must be \[E, K, C\]"):
        panels.to_panels(jnp.ones((4, 4)))


@pytest.mark.skipif(not cpu.available(), reason="no native kernel")
def test_prepare_params_makes_panels_of_the_expert_weights_only_where_the_kernel_runs():
    """On CPU with auto / native_cpu: the routed expert matrices panel-major (this CPU's width),
    the router and shared experts as they are; other backends and platforms: the params themselves."""
    cfg = moe.MoEConfig(num_experts=4, topk=2, hidden_size=48, intermediate_size=40, num_shared_experts=1,
                        shared_intermediate_size=24)
    params = moe.init_params(cfg, jax.random.key(1), jnp.bfloat16)
    for backend in cpu.PREPARING_BACKENDS:
        prepared = moe.prepare_params(params, cfg, "cpu", backend=backend)
        assert {n for n, p in prepared.items() if isinstance(p, panels.PanelWeights)} == set(moe.EXPERT_WEIGHTS)
        assert all(getattr(prepared, n) is p for n, p in params.items() if n not in moe.EXPERT_WEIGHTS)
        assert prepared.shapes() == params.shapes()  # the logical shapes
        assert cpu.describe(prepared) == {**cpu.describe(), "weight_layout": "panels", "expert_weights": "bfloat16"}
        assert cpu.describe(prepared)["panel_columns"] == panels.panel_columns()
        assert moe.prepare_params(prepared, cfg, "cpu", backend=backend).w_gate is prepared.w_gate  # idempotent
    for platform, backend in (("cpu", "expert_loop"), ("cpu", "capacity"), ("gpu", "auto"), ("tpu", "native_cpu")):
        assert moe.prepare_params(params, cfg, platform, backend=backend) is params
    assert cpu.describe(params)["weight_layout"] == "row_major" and cpu.describe(params)["panel_columns"] is None
    with pytest.raises(ValueError, match="backend"):
        moe.prepare_params(params, cfg, "cpu", backend="fast")
    with pytest.raises(ValueError, match="w_up"):
        moe.prepare_params(params.replace(w_up=None), cfg)
