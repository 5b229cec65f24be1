"""FP8 expert weights straight to INT8 (kernels/cpu/int8.py `Int8FromFp8`, `fp8_to_int8_panels`;
csrc/fp8_int8.cc): the native conversion at every instruction-set level, and its numpy path, equal
bit for bit the numpy reference (`quantize_reference` of the exactly dequantised weights) over a grid
of odd sizes, block sizes, both orientations, both panel widths, zero columns and every code; NaN codes
and bad shapes are refused by name; `moe.prepare_params` serves an FP8 layer as INT8 within the
documented error."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from expertd.kernels import cpu, experts, moe
from expertd.kernels.cpu import diagnostics, int8, panels
from expertd.kernels.moe_reference import moe_oracle

native = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")
E4M3 = ml_dtypes.float8_e4m3fn


def fp8_case(e, k, c, block, seed=0):
    """(codes e4m3 [E, C, K] as stored, scales fp32 [E, ceil(K/b), ceil(C/b)]): Gaussian codes over
    e4m3's range with subnormals, an all-zero column, a column of zero scales, scales over decades."""
    rng = np.random.default_rng(seed)
    codes = (rng.standard_normal((e, c, k)) * rng.choice([0.01, 1.0, 60.0], (e, c, 1))).astype(E4M3)
    codes[0, c // 2, :] = 0
    scales = (10.0 ** rng.uniform(-6, 1, (e, -(-k // block), -(-c // block)))).astype(np.float32)
    if e > 1:
        scales[1, :, -1] = 0.0  # the last block column's weights are all zero
    return codes, scales


def dense_q(pw: panels.PanelWeights) -> np.ndarray:
    """int8 [E, K, C] of INT8 panels (their padding columns checked to be zero)."""
    e, k, c = pw.logical_shape
    q = np.asarray(pw.panels).transpose(0, 2, 1, 3).reshape(e, k, -1)
    assert not q[:, :, c:].any(), "padding columns are zero"
    return q[:, :, :c]


# (E, K, C, block): K under and over 16 with tails, C not a multiple of 16 (a partial strip), blocks
# of 16 and 128 (16-row vectors) and 8 and 24 (not multiples of 16: element by element).
GRID = [(1, 1, 1, 16), (2, 15, 17, 16), (3, 130, 70, 128), (2, 33, 40, 8), (2, 300, 129, 128), (1, 64, 33, 24)]


@native
@pytest.mark.parametrize("e,k,c,block", GRID)
@pytest.mark.parametrize("transposed", (True, False))
def test_native_conversion_equals_the_reference_bit_for_bit_at_every_level(e, k, c, block, transposed):
    stored, scales = fp8_case(e, k, c, block, seed=k * c)
    q_ref, s_ref = int8.fp8_to_int8_reference(stored, scales, block, transposed=True)
    held = stored if transposed else np.ascontiguousarray(np.swapaxes(stored, 1, 2))
    assert np.abs(q_ref.astype(int)).max() <= int8.QMAX and not q_ref[0, :, c // 2].any()
    for level in diagnostics.supported_isas():
        with diagnostics.limit_isa(level):
            for width in panels.PANEL_WIDTHS:
                pw = int8.fp8_to_int8_panels(held, scales, block, transposed, width)
                assert pw.int8 and pw.logical_shape == (e, k, c) and pw.panel_columns == width
                np.testing.assert_array_equal(dense_q(pw), q_ref, err_msg=f"{level} W{width}")
                np.testing.assert_array_equal(np.asarray(pw.scales), s_ref, err_msg=f"{level} W{width}")


@native
def test_every_finite_code_converts_exactly():
    """All 254 finite codes (subnormals, both zeros, 448) in one column of each sign pattern."""
    finite = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    codes = np.stack([np.resize(finite, 512), np.resize(finite[::-1], 512)])[None].view(E4M3)  # [1, 2, 512]
    scales = np.array([[[0.37]], [[1.0]], [[2.0 ** -20]], [[3.0e4]]], np.float32).reshape(1, 4, 1)
    q_ref, s_ref = int8.fp8_to_int8_reference(codes, scales, 128, transposed=True)
    for level in diagnostics.supported_isas():
        with diagnostics.limit_isa(level):
            pw = int8.fp8_to_int8_panels(codes, scales, 128, transposed=True)
            np.testing.assert_array_equal(dense_q(pw), q_ref, err_msg=level)
            np.testing.assert_array_equal(np.asarray(pw.scales), s_ref, err_msg=level)
    # Dequantised, each weight within half a step of its column, as for bf16 sources.
    w = int8._dequantize_fp8(codes, scales, 128, True)
    np.testing.assert_array_less(np.abs(int8.dequantize_reference(q_ref, s_ref) - w),
                                 np.broadcast_to(0.5 * s_ref[:, None, :] * (1 + 1e-5) + 1e-30, w.shape))


def test_numpy_path_equals_the_reference():
    """The conversion without the native library (Int8FromFp8's numpy path) gives the same panels."""
    stored, scales = fp8_case(2, 40, 37, 16, seed=5)
    q_ref, s_ref = int8.fp8_to_int8_reference(stored, scales, 16, transposed=True)
    out = int8.Int8FromFp8(2, 40, 37, 16, panel_columns=16)
    out._lib = None  # the path a machine without a compiler takes
    for j in range(2):
        out.add(j, stored[j], scales[j])
    pw = out.weights()
    np.testing.assert_array_equal(dense_q(pw), q_ref)
    np.testing.assert_array_equal(np.asarray(pw.scales), s_ref)


@native
def test_nan_codes_and_bad_shapes_are_refused_by_name():
    stored, scales = fp8_case(3, 32, 16, 16)
    stored[2, 3, 5] = np.uint8(0x7F).view(E4M3)
    stored[2, 4, 6] = np.uint8(0xFF).view(E4M3)
    with pytest.raises(ValueError, match="expert 2 has 2 NaN codes"):
        int8.fp8_to_int8_panels(stored, scales, 16, transposed=True)
    out = int8.Int8FromFp8(3, 32, 16, 16)
    with pytest.raises(ValueError, match=r"codes of expert 0 must be 1-byte FP8 codes \[16, 32\]"):
        out.add(0, stored[0].T, scales[0])
    with pytest.raises(ValueError, match=r"scales of expert 1 must be fp32 \[2, 1\] for block 16"):
        out.add(1, stored[1], scales[1, :1])
    with pytest.raises(ValueError, match="panel_columns must be one of"):
        int8.Int8FromFp8(3, 32, 16, 16, panel_columns=32)
    with pytest.raises(ValueError, match="codes must be"):
        int8.fp8_to_int8_panels(stored.astype(np.float32), scales, 16, transposed=True)


@native
@pytest.mark.parametrize("t", (1, 9, 70))
def test_prepare_params_serves_fp8_experts_as_int8_within_the_documented_error(t):
    cfg = moe.MoEConfig(num_experts=8, topk=2, hidden_size=48, intermediate_size=40)
    params = moe.init_params(cfg, jax.random.key(t), jnp.float32)
    fp8 = params.replace(**{n: experts.quantize_fp8_blocks(getattr(params, n), 16) for n in moe.EXPERT_WEIGHTS})
    prepared = moe.prepare_params(fp8, cfg, "cpu", expert_weights="int8")
    for n in moe.EXPERT_WEIGHTS:
        w, source = getattr(prepared, n), getattr(fp8, n)
        assert panels.is_panels(w) and w.int8
        q_ref, _ = int8.fp8_to_int8_reference(np.asarray(source.codes), np.asarray(source.scales), 16)
        np.testing.assert_array_equal(dense_q(w), q_ref)
    x = jax.random.normal(jax.random.key(t + 1), (t, cfg.hidden_size), jnp.bfloat16)
    y = np.asarray(moe.moe_layer(prepared, x, cfg), np.float32)
    dense = fp8.replace(**{n: experts.dequantize(getattr(fp8, n), jnp.float32) for n in moe.EXPERT_WEIGHTS})
    oracle = moe_oracle(dict(dense.items()), x, cfg)
    ref, routed_alike = oracle.out.astype(np.float32), ~oracle.near_tie  # near ties may pick other experts
    assert np.abs(y - ref)[routed_alike].max() / np.abs(ref).max() < int8.ERROR_BOUND
