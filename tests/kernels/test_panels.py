"""Panel-major expert weights (kernels/panels.py): an exact relayout that goes through jit as the
array it stands for, and the MoE layer computes the same output from it on every backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import moe, native_cpu, panels


@pytest.mark.parametrize("width", panels.PANEL_WIDTHS)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("shape", ((1, 3, 16), (2, 5, 40), (3, 64, 7), (2, 4, 136)))
def test_relayout_is_exact_and_keeps_the_logical_shape(shape, dtype, width):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    pw = panels.to_panels(w, width)
    e, k, c = shape
    assert pw.shape == shape and pw.dtype == dtype and pw.ndim == 3 and pw.panel_columns == width
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
    assert isinstance(out, panels.PanelWeights) and out.shape == shape
    np.testing.assert_array_equal(np.asarray(panels.dense(out)), np.asarray(w) * 2)
    assert panels.to_panels(pw, width) is pw and panels.dense(w) is w
    np.testing.assert_array_equal(np.asarray(pw), np.asarray(w))  # read back as the array it stands for
    assert np.asarray(pw, np.float32).dtype == np.float32


def test_the_width_follows_the_kernel_instruction_set():
    assert [panels.panel_columns(level) for level in native_cpu.ISA_LEVELS] == [16, 16, 64, 64]
    want = panels.panel_columns(native_cpu.isa())
    assert panels.panel_columns() == want and panels.to_panels(jnp.ones((1, 2, 64))).panel_columns == want
    with pytest.raises(ValueError, match="columns must be one of"):
        panels.to_panels(jnp.ones((1, 2, 64)), 32)


def test_relayout_names_what_it_expected():
    with pytest.raises(ValueError, match=r"expert weights must be \[E, K, C\]"):
        panels.to_panels(jnp.ones((4, 4)))


@pytest.mark.skipif(not native_cpu.available(), reason="no native kernel")
@pytest.mark.parametrize("family,dtype", [("mixtral", jnp.float32), ("deepseek_v3", jnp.bfloat16)])
def test_moe_layer_on_panel_params_equals_row_major(family, dtype):
    """`panel_params` (what the engine serves on CPU): the native path bit for bit, another backend
    through `dense` within its own tolerance; the router and shared experts are left as they are."""
    hf = dict(model_type="mixtral", hidden_size=48, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2)
    if family == "deepseek_v3":
        hf = dict(model_type="deepseek_v3", hidden_size=48, moe_intermediate_size=40, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                  norm_topk_prob=True)
    cfg = moe.MoEConfig.from_hf_config(hf)
    params = moe.init_params(cfg, jax.random.key(1), dtype)
    on_panels = panels.panel_params(params)
    assert {n for n, p in on_panels.items() if isinstance(p, panels.PanelWeights)} == set(panels.EXPERT_WEIGHTS)
    assert all(on_panels[n] is params[n] for n in params if n not in panels.EXPERT_WEIGHTS)
    layer = jax.jit(moe.moe_layer, static_argnames=("cfg", "backend"))
    for t in (5, 90):  # few rows per expert (streaming) and many (packed)
        x = jax.random.normal(jax.random.key(t), (t, 48), jnp.float32).astype(dtype)
        want = np.asarray(layer(params, x, cfg=cfg, backend="native_cpu"), np.float32)
        np.testing.assert_array_equal(np.asarray(layer(on_panels, x, cfg=cfg, backend="native_cpu"), np.float32), want)
        np.testing.assert_array_equal(np.asarray(layer(on_panels, x, cfg=cfg, backend="capacity"), np.float32),
                                      np.asarray(layer(params, x, cfg=cfg, backend="capacity"), np.float32))
