"""INT8 expert weights (kernels/cpu/int8.py): the jitted quantiser against its numpy twin, the C++
grouped matmul on int8 panels against the numpy quantise / dequantise reference (every path, panel
width and instruction-set level giving the same bits), and the layer on INT8 weights against the
same layer on bf16 weights within the documented error, over a grid of T, E, k, H and I with odd
sizes and experts without rows."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from expertd.kernels import cpu, moe
from expertd.kernels.cpu import diagnostics, int8, panels

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_quantize_matches_its_numpy_twin(dtype):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 67, 41)).astype(np.float32) * np.float32(rng.uniform(1e-3, 10, (5, 1, 41)))
    w[1, :, 3] = 0.0  # an all-zero column: scale 0, q 0
    w[2, 5, 7] = 1e4  # one outlier: its column's other weights quantise coarsely
    w = np.asarray(jnp.asarray(w, dtype).astype(jnp.float32))
    q, scales = (np.asarray(a) for a in int8.quantize(jnp.asarray(w, dtype)))
    q_ref, scales_ref = int8.quantize_reference(w)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and q.shape == w.shape and scales.shape == (5, 41)
    np.testing.assert_array_equal(scales, scales_ref)
    assert np.abs(q.astype(int)).max() <= int8.QMAX and scales[1, 3] == 0 and not q[1, :, 3].any()
    # Equal except at exact ties of w / scale, where the two divisions may round apart (module docstring).
    quotient = w / np.where(scales_ref > 0, scales_ref, 1)[:, None, :]
    tie = np.abs(np.abs(quotient - np.trunc(quotient)) - 0.5) < 1e-5
    differ = q != q_ref
    assert not (differ & ~tie).any() and np.abs(q.astype(int) - q_ref)[differ].max(initial=0) <= 1
    # Dequantised, each weight within half a step of its column.
    np.testing.assert_array_less(np.abs(int8.dequantize_reference(q, scales) - w),
                                 np.broadcast_to(0.5 * scales[:, None, :] * (1 + 1e-5) + 1e-30, w.shape))


# (group sizes, K, C): odd K and C (partial strips, the scalar column tail on AVX2), empty experts,
# 1-6 rows (one AVX-512 register block), 7+ rows (6-row blocks), 32+ rows (AVX2's packed path),
# K = 8197 past one 512 KiB int8 k step of AVX-512.
CASES = [([3], 5, 17), ([2, 0, 5], 40, 50), ([1, 0, 7, 9], 301, 80), ([0, 41, 3], 130, 64), ([2, 0, 1], 8197, 24)]


@native
@pytest.mark.parametrize("sizes,k,c", CASES)
def test_int8_matmul_matches_the_dequantised_reference_with_the_same_bits_everywhere(sizes, k, c):
    rng = np.random.default_rng(k * c)
    n = sum(sizes)
    x = np.array(jnp.asarray(rng.standard_normal((n + 3, k)), jnp.bfloat16).astype(jnp.float32))
    x[n:] = np.nan  # rows past the groups are never read
    w = rng.standard_normal((len(sizes), k, c)).astype(np.float32)
    for e, rows in enumerate(sizes):
        if rows == 0:
            w[e] = np.nan  # experts without rows are never read
    group_sizes = jnp.asarray(sizes, jnp.int32)
    q, scales = int8.quantize(jnp.asarray(w))
    want = int8.grouped_matmul_reference(x, sizes, q, scales)
    source = jnp.asarray(rng.permutation(n + 1), jnp.int32)  # gathered rows; n is a pad row of zeros...
    xt = np.where(np.arange(n + 3)[:, None] < n, x, 0).astype(np.float32)  # ...as is every row past n
    want_gathered = int8.grouped_matmul_reference(xt[np.asarray(source)], sizes, q, scales)
    got = {}
    for level in diagnostics.supported_isas():
        with diagnostics.limit_isa(level):
            for width in panels.PANEL_WIDTHS:
                pw = int8.to_int8_panels(jnp.asarray(w), width)
                assert pw.int8 and pw.dtype == jnp.int8 and pw.logical_shape == w.shape
                got[level, width] = np.asarray(cpu.grouped_matmul(jnp.asarray(x), group_sizes, pw))
                got[level, width, "gathered"] = np.asarray(
                    cpu.grouped_matmul(jnp.asarray(xt[:n]), group_sizes, pw, source=source))
    first = got[diagnostics.supported_isas()[0], 16]
    for key, y in got.items():
        ref = want_gathered if "gathered" in key else want
        scale = np.abs(ref).max() + 1e-30
        assert np.abs(y - ref).max() / scale < 1e-5, key  # fp32 sums in k order against fp64
        if "gathered" not in key:
            np.testing.assert_array_equal(y.view(np.int32), first.view(np.int32), err_msg=str(key))
    np.testing.assert_array_equal(got[diagnostics.supported_isas()[0], 16][n:], 0)


@native
def test_int8_matmul_names_bad_scales():
    pw = int8.to_int8_panels(jnp.ones((2, 8, 16)))
    bad = panels.PanelWeights(pw.panels, pw.k_dim, pw.columns, jnp.ones((2, 15), jnp.float32))
    with pytest.raises(Exception, match=r"scales must be \[E, C\]"):
        jax.block_until_ready(cpu.grouped_matmul(jnp.ones((3, 8)), jnp.asarray([3, 0], jnp.int32), bad))


def layer_error(cfg, t, seed=0):
    """max |y_int8 - y_bf16| / max |y_bf16| of the layer on bf16 weights and on the same weights
    quantised (both through moe_layer's auto backend), and the int8 layer's output."""
    params = moe.init_params(cfg, jax.random.key(seed), jnp.bfloat16)
    x = jax.random.normal(jax.random.key(seed + 1), (t, cfg.hidden_size), jnp.bfloat16)
    bf16 = moe.moe_layer(moe.prepare_params(params, cfg, "cpu"), x, cfg).astype(jnp.float32)
    prepared = moe.prepare_params(params, cfg, "cpu", expert_weights="int8")
    y = moe.moe_layer(prepared, x, cfg).astype(jnp.float32)
    return float(jnp.max(jnp.abs(y - bf16)) / jnp.max(jnp.abs(bf16))), prepared, x, y


# (T, E, k, H, I, semantics): T from 1 to 300 (256 rows per expert and more at E = 4), odd H and I,
# E = 16 with T = 1 leaving most experts without rows; gpt-oss's clamped activation with expert
# biases (run in XLA around the INT8 projections), Llama 4's router weight on the input rows.
GPT_OSS = dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True)
GRID = [(1, 16, 2, 64, 48, {}), (7, 8, 2, 33, 40, {}), (64, 8, 3, 72, 31, GPT_OSS),
        (300, 4, 1, 48, 64, dict(router_weight_on_input=True))]


@native
@pytest.mark.parametrize("t,e,k,h,i,semantics", GRID)
def test_layer_on_int8_weights_is_within_the_documented_error_of_bf16(t, e, k, h, i, semantics):
    cfg = moe.MoEConfig(num_experts=e, topk=k, hidden_size=h, intermediate_size=i, **semantics)
    error, prepared, x, y = layer_error(cfg, t)
    assert error < int8.ERROR_BOUND
    assert all(getattr(prepared, n).int8 for n in moe.EXPERT_WEIGHTS)
    if t != 7:
        return
    # Another backend reads the same INT8 weights dequantised (dense_weights): the same layer.
    other = moe.moe_layer(prepared, x, cfg, backend="expert_loop").astype(jnp.float32)
    assert float(jnp.max(jnp.abs(other - y)) / jnp.max(jnp.abs(y))) < 2e-2  # bf16 rounding of h apart


def test_prepare_params_int8_quantises_the_routed_experts_only():
    cfg = moe.MoEConfig(num_experts=4, topk=2, hidden_size=48, intermediate_size=40, num_shared_experts=1,
                        shared_intermediate_size=24)
    params = moe.init_params(cfg, jax.random.key(1), jnp.bfloat16)
    prepared = moe.prepare_params(params, cfg, "cpu", expert_weights="int8")
    assert {n for n, p in prepared.items() if isinstance(p, panels.PanelWeights) and p.int8} == set(moe.EXPERT_WEIGHTS)
    assert all(getattr(prepared, n) is p for n, p in params.items() if n not in moe.EXPERT_WEIGHTS)
    assert prepared.shapes() == params.shapes()
    assert cpu.describe(prepared)["expert_weights"] == "int8" and cpu.describe(params)["expert_weights"] == "bfloat16"
    assert moe.prepare_params(prepared, cfg, "cpu", expert_weights="int8").w_gate is prepared.w_gate  # idempotent
    assert prepared.w_gate.panels.dtype == jnp.int8 and prepared.w_gate.scales.shape == (4, 40)
    q, scales = int8.quantize(params.w_up)
    np.testing.assert_array_equal(np.asarray(panels.dense(prepared.w_up)), int8.dequantize_reference(q, scales))
    assert moe.prepare_params(params, cfg, "cpu", backend="expert_loop", expert_weights="int8") is params
    with pytest.raises(ValueError, match="CPU only"):
        moe.prepare_params(params, cfg, "gpu", expert_weights="int8")
    with pytest.raises(ValueError, match="expert_weights must be one of"):
        moe.prepare_params(params, cfg, "cpu", expert_weights="fp4")


@native
def test_int8_paths_bf16_rows_from_two_rows_take_the_bf16_dot_where_the_cpu_has_it():
    w = int8.to_int8_panels(jax.random.normal(jax.random.key(0), (2, 64, 64)))
    x = jnp.asarray(jax.random.normal(jax.random.key(1), (5, 64)).astype(jnp.bfloat16), jnp.float32)
    ran = {}
    for sizes in ([1, 0], [3, 2]):
        before = diagnostics.path_items()
        jax.block_until_ready(cpu.grouped_matmul(x, jnp.asarray(sizes, jnp.int32), w))
        ran[tuple(sizes)] = {p for p, n in diagnostics.path_items().items() if n > before[p]}
    if cpu.isa() == "avx512_bf16":
        assert ran == {(1, 0): {"avx512_fma"}, (3, 2): {"avx512_bf16_dot"}}
    elif cpu.isa() == "avx512":
        assert ran == {(1, 0): {"avx512_fma"}, (3, 2): {"avx512_fma"}}
