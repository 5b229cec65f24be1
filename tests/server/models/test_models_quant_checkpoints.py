"""Quantised checkpoints end to end at the loader: FP8 block (float and ue8m0 scales, fused experts),
Mistral per-tensor FP8 (`qscale_weight`), DeepSeek-V4-style FP4 experts (DeepSeek-V4 itself, its
hash-routed layer included), Kimi INT4 compressed-tensors, MXFP4 (fused, and gpt-oss's interleaved,
transposed layout with its biases), FP8 block on stacked `[E, I, H]` experts (Step-3.7). The fixtures
quantise tiny random weights with simple quantisers (tests/hf_quantizers.py); the loader must give
exactly their dequantised values, and each layer must compute the family's transformers block on
them. Corrupt or mis-shaped scales and unknown methods are refused, naming the tensor / method."""
import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import hf_reference, write_checkpoint
from hf_quantizers import save_safetensors

from expertd.kernels.moe import MoEParams, moe_layer
from expertd.kernels.params import param_dtype
from expertd.server.cli import main
from expertd.server.models.checkpoint import CheckpointError, CheckpointRefused, load_checkpoint, plan_checkpoint
from expertd.server.models.quant import fp8_tables
from expertd.server.models.stored import StoredTensors

BF16 = np.dtype(ml_dtypes.bfloat16)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
CASES = [("deepseek_v3", "fp8"), ("mistral_large3", "fp8_ue8m0"), ("minimax_m2", "fp8"), ("mistral4", "fp8"),
         ("qwen3_5_moe", "fp8"), ("deepseek_v3", "fp4"), ("kimi_k25", "int4"), ("mixtral_fused", "mxfp4"),
         ("mistral_large4", "fp8_qscale"), ("gpt_oss", "mxfp4"), ("deepseek_v4", "fp4"), ("step3p7", "fp8")]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, x, token_ids, cfg):
    return moe_layer(params, x, cfg, token_ids=token_ids)


def forward(layer, x, token_ids=None):
    ids = None if token_ids is None else jnp.asarray(token_ids, jnp.int32)
    return np.asarray(_forward(MoEParams.from_dict({k: jnp.asarray(v) for k, v in layer.params.items()}),
                               jnp.asarray(x), ids, layer.cfg))


@pytest.mark.parametrize("family, quantize", CASES, ids=[f"{f}-{q}" for f, q in CASES])
def test_quantised_checkpoint_loads_its_dequantised_weights(tmp_path, family, quantize):
    expected = write_checkpoint(tmp_path, family, num_layers=3, quantize=quantize, dtype="bfloat16")
    plan = plan_checkpoint(tmp_path)
    assert plan.dtype == "bfloat16" and "quantised checkpoint" in plan.dtype_reason  # --dtype auto
    for dtype in (np.float32, BF16):
        layers = load_checkpoint(tmp_path, dtype=np.dtype(dtype).name)
        assert [layer.index for layer in layers] == sorted(expected)
        for layer in layers:
            for name, want in expected[layer.index].items():
                held = np.dtype(param_dtype(name, dtype))
                got = layer.params[name]
                assert got.dtype == held, name
                np.testing.assert_array_equal(got, want.astype(held), err_msg=name)
    rng = np.random.default_rng(3)
    for layer in layers if dtype == np.float32 else load_checkpoint(tmp_path, dtype="float32"):
        for tokens in (2, 9):
            x = rng.standard_normal((tokens, layer.cfg.hidden_size)).astype(np.float32)
            ids = rng.integers(0, layer.cfg.hash_vocab_size, tokens) if layer.cfg.hash_routed else None
            want = hf_reference(tmp_path, layer.index, x, expected[layer.index], token_ids=ids)
            np.testing.assert_allclose(forward(layer, x, ids), want, rtol=1e-4, atol=1e-5)


def _rewrite(tmp_path, name, value):
    """Rewrite one tensor of the fixture's single file (dtype and shape may change)."""
    with StoredTensors(tmp_path) as stored:
        tensors = {n: np.array(stored[n]) for n in stored}
    tensors[name] = value
    save_safetensors(tmp_path / "model.safetensors", tensors)


@pytest.mark.parametrize("quantize, tensor, value, message", [
    ("fp8", "model.layers.2.mlp.experts.1.up_proj.weight_scale_inv", np.ones((4, 3), np.float32),
     r"shape \[4, 3\], expected \[4, 2\] \(one scale per 8x8 block"),
    ("fp8", "model.layers.2.mlp.experts.1.up_proj.weight_scale_inv",
     np.array([[1, 1], [1, -1], [1, 1], [1, 1]], np.float32), r"scale -1.0 at index \[1, 1\] is negative"),
    ("fp4", "model.layers.2.mlp.experts.3.down_proj.scale", np.full((32, 1), 0xFF, np.uint8).view(E8M0),
     r"e8m0 scale code 0xFF \(NaN\) at index \[0, 0\]"),
    ("int4", "model.layers.1.mlp.experts.0.gate_proj.weight_scale", np.ones((32, 3), ml_dtypes.bfloat16),
     r"shape \[32, 3\], expected \[32, 2\]"),
])
def test_corrupt_or_misshaped_scales_name_the_tensor(tmp_path, quantize, tensor, value, message):
    family = "kimi_k25" if quantize == "int4" else "deepseek_v3"
    write_checkpoint(tmp_path, family, num_layers=3, quantize=quantize)
    if family == "kimi_k25":
        tensor = "language_model." + tensor  # Kimi-K2.5's prefix
    _rewrite(tmp_path, tensor, value)
    with pytest.raises(CheckpointError, match=f"tensor '{tensor}': .*{message}"):
        load_checkpoint(tmp_path)


def test_missing_scale_is_named(tmp_path):
    name = "model.layers.2.mlp.shared_experts.down_proj.weight"
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", omit=(name + "_scale_inv",))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' .float8_e4m3fn, fp8. has no scale tensor"):
        load_checkpoint(tmp_path)


def test_unknown_quantization_method_is_refused_at_start(tmp_path, capsys):
    write_checkpoint(tmp_path, "qwen3_moe", num_layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointRefused, match=r"quantization_config.quant_method 'awq' is not supported; supported: "
                                                r"compressed-tensors, fbgemm_fp8, fp8, mxfp4"):
        plan_checkpoint(tmp_path)
    assert main(["serve", "--checkpoint", str(tmp_path), "--port", "0", "--metrics-port", "0"]) == 2
    assert "quant_method 'awq' is not supported" in capsys.readouterr().out


def test_fp8_blocks_of_table_size_load_their_dequantised_weights(tmp_path, monkeypatch):
    """32x32 blocks (1024 elements) take the codec's look-up-table path inside the real loader."""
    tabled = []
    by_table = fp8_tables.dequantize_into
    monkeypatch.setattr(fp8_tables, "dequantize_into", lambda *args: tabled.append(by_table(*args)) or tabled[-1])
    expected = write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16",
                                block=(32, 32))
    for layer in load_checkpoint(tmp_path, dtype="bfloat16", workers=1):
        for name, want in expected[layer.index].items():
            held = np.dtype(param_dtype(name, BF16))
            np.testing.assert_array_equal(layer.params[name], want.astype(held), err_msg=name)
    assert tabled and all(tabled)

