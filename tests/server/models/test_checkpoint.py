"""Loading the MoE layers of real-layout Hugging Face checkpoints of every served family (written by
hf_fixtures), and every layer computing its family's transformers MoE block (the float64 oracle
`hf_fixtures.hf_reference`) through expertd's kernels."""
import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import FAMILIES, hf_reference, write_checkpoint

from expertd.kernels.moe import MoEParams, moe_layer, param_shapes
from expertd.kernels.params import param_dtype
from expertd.server.models.checkpoint import (
    CheckpointError,
    CheckpointRefused,
    load_checkpoint,
    plan_checkpoint,
    read_config,
)
from expertd.server.models.host_arrays import copy_into, host_empty
from expertd.server.models.stored import StoredTensors

BF16 = np.dtype(ml_dtypes.bfloat16)
ROWS = 16  # the oracle comparison runs padded to this many rows: one compilation per layer config


def assert_layers_equal(layers, expected, dtype=np.float32):
    """Loaded params equal the expected values (float32, as stored or dequantised) cast to `dtype`."""
    assert [layer.index for layer in layers] == sorted(expected)
    for layer in layers:
        want = expected[layer.index]
        assert set(layer.params) == set(want) == set(param_shapes(layer.cfg))
        for name, value in want.items():
            got = layer.params[name]
            held = np.dtype(param_dtype(name, dtype))  # router tensors and norms fp32, hash table int32
            assert got.dtype == held, name
            assert got.flags.c_contiguous, name
            np.testing.assert_array_equal(got, value.astype(held), err_msg=name)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, x, valid, token_ids, cfg):
    return moe_layer(params, x, cfg, valid_tokens=valid, token_ids=token_ids)


def forward(layer, x: np.ndarray, token_ids=None) -> np.ndarray:
    """The layer's kernels on x; `token_ids [T]` for a hash-routed layer (DeepSeek-V4's hash_moe)."""
    padded = np.zeros((ROWS, x.shape[1]), np.float32)
    padded[:len(x)] = x
    ids = None if token_ids is None else jnp.asarray(np.pad(token_ids, (0, ROWS - len(x))), jnp.int32)
    params = MoEParams.from_dict({k: jnp.asarray(v) for k, v in layer.params.items()})
    return np.asarray(_forward(params, jnp.asarray(padded), len(x), ids, layer.cfg))[:len(x)]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_and_computes_its_transformers_block(tmp_path, family):
    """Every MoE layer, two token counts, fp32: expertd's layer equals the family's HF block."""
    expected = write_checkpoint(tmp_path, family, num_layers=3, sharded=family in ("mixtral", "kimi_k25"))
    layers = load_checkpoint(tmp_path)
    assert_layers_equal(layers, expected)  # a float32 checkpoint is served in float32 (--dtype auto)
    rng = np.random.default_rng(7)
    for layer in layers:
        for tokens in (3, 13):
            x = rng.standard_normal((tokens, layer.cfg.hidden_size)).astype(np.float32)
            ids = rng.integers(0, layer.cfg.hash_vocab_size, tokens) if layer.cfg.hash_routed else None
            want = hf_reference(tmp_path, layer.index, x, expected[layer.index], token_ids=ids)
            np.testing.assert_allclose(forward(layer, x, ids), want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"{family} layer {layer.index}, {tokens} tokens")


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "dbrx", "mistral4", "gpt_oss", "deepseek_v4", "gemma4",
                                    "step3p7"])
def test_bfloat16_checkpoints_load_as_stored(tmp_path, family):
    expected = write_checkpoint(tmp_path, family, num_layers=3, sharded=True, dtype="bfloat16")
    assert_layers_equal(load_checkpoint(tmp_path), expected, BF16)  # --dtype auto keeps bfloat16
    assert_layers_equal(load_checkpoint(tmp_path, dtype="float32"), expected, np.float32)


def test_float16_checkpoint_is_served_in_bfloat16_unless_told(tmp_path):
    expected = write_checkpoint(tmp_path, "mixtral", num_layers=1, dtype="float16")
    assert_layers_equal(load_checkpoint(tmp_path), {0: {k: v.astype(BF16).astype(np.float32) if k.startswith("w_")
                                                        else v for k, v in expected[0].items()}}, BF16)
    assert_layers_equal(load_checkpoint(tmp_path, dtype="float32"), expected)


def test_family_configs_map_to_the_router_settings(tmp_path):
    configs = {}
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "mistral4", "minimax_m2"):
        write_checkpoint(tmp_path / family, family, num_layers=3)
        configs[family] = load_checkpoint(tmp_path / family)[-1].cfg
    assert (configs["mixtral"].num_experts, configs["mixtral"].topk, configs["mixtral"].score_function) \
        == (4, 2, "softmax")
    assert configs["qwen2_moe"].shared_expert_gate and configs["qwen2_moe"].shared_intermediate_size == 24
    assert configs["qwen2_moe"].use_pre_softmax  # norm_topk_prob false: no renormalisation
    assert not configs["qwen3_moe"].has_shared and not configs["qwen3_moe"].use_pre_softmax
    deepseek = configs["deepseek_v3"]
    assert (deepseek.score_function, deepseek.use_expert_bias, deepseek.num_groups, deepseek.group_topk,
            deepseek.scaling_factor, deepseek.shared_intermediate_size) == ("sigmoid", True, 4, 2, 2.5, 32)
    mistral = configs["mistral4"]
    assert (mistral.score_function, mistral.use_pre_softmax, mistral.num_groups, mistral.norm_topk_prob,
            mistral.scaling_factor) == ("softmax", True, 4, True, 1.5)
    minimax = configs["minimax_m2"]
    assert (minimax.score_function, minimax.use_expert_bias, minimax.norm_topk_prob) == ("sigmoid", True, True)


def test_qwen3_moe_written_by_transformers_5_loads_every_layer(tmp_path):
    """Regression: transformers 5 saves Qwen3MoeConfig's expert count as num_local_experts only."""
    expected = write_checkpoint(tmp_path, "qwen3_moe", num_layers=3)
    config = read_config(tmp_path)
    assert "num_local_experts" in config and "num_experts" not in config and "dtype" in config
    layers = load_checkpoint(tmp_path)
    assert [layer.index for layer in layers] == [0, 1, 2] and layers[0].cfg.num_experts == 4
    assert_layers_equal(layers, expected)
    # transformers 4.x spelling, torch_dtype
    write_checkpoint(tmp_path / "v4", "qwen3_moe", num_layers=2,
                     config_overrides={"num_local_experts": None, "num_experts": 4, "dtype": None,
                                       "torch_dtype": "float32"})
    assert [layer.cfg.num_experts for layer in load_checkpoint(tmp_path / "v4")] == [4, 4]
    write_checkpoint(tmp_path / "both", "qwen3_moe", num_layers=1, config_overrides={"num_experts": 8})
    with pytest.raises(CheckpointError, match=r"config\['num_experts'\] = 8 and config\['num_local_experts'\] = 4 "
                                              "are two spellings"):
        load_checkpoint(tmp_path / "both")


def test_layer_selection_reads_only_the_layers_asked_for(tmp_path):
    expected = write_checkpoint(tmp_path, "deepseek_v3", num_layers=6, sharded=True)
    assert sorted(expected) == [2, 3, 4, 5]  # layers 0-1 are dense (first_k_dense_replace=2)
    assert_layers_equal(load_checkpoint(tmp_path, layers="3,5"), {i: expected[i] for i in (3, 5)})
    assert [layer.index for layer in load_checkpoint(tmp_path, layers=[4])] == [4]
    assert [layer.index for layer in load_checkpoint(tmp_path, num_layers=2)] == [2, 3]
    # The shard of layer 2 may be broken: it is never opened when layer 2 is not asked for.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / index["model.layers.2.mlp.gate.weight"]).write_bytes(b"not a safetensors file")
    assert [layer.index for layer in load_checkpoint(tmp_path, layers="3-4")] == [3, 4]
    with pytest.raises(CheckpointError, match="cannot read model-00004-of-00007.safetensors"):
        load_checkpoint(tmp_path, layers=[2])


def test_qwen_mlp_only_layers_and_sparse_step(tmp_path):
    expected = write_checkpoint(tmp_path, "qwen3_moe", num_layers=6,
                                config_overrides={"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sorted(expected) == [1, 5]
    assert_layers_equal(load_checkpoint(tmp_path), expected)
    with pytest.raises(CheckpointError, match=r"layers \[3\] of checkpoint .* are not MoE layers.* are 1,5"):
        load_checkpoint(tmp_path, layers=[3])


def test_dense_layer_asked_for(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=4)
    with pytest.raises(CheckpointError, match=r"layers \[0, 1\] of checkpoint .*\(deepseek_v3\) are not MoE "
                                              r"layers; its MoE layers are 2-3"):
        load_checkpoint(tmp_path, layers="0-2")
    with pytest.raises(CheckpointError, match=r"layers \[9\]"):
        load_checkpoint(tmp_path, layers=[9])


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_missing_tensor_is_named(tmp_path, sharded):
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    write_checkpoint(tmp_path, "mixtral", num_layers=2, sharded=sharded, omit=(name,))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        load_checkpoint(tmp_path)
    assert [layer.index for layer in load_checkpoint(tmp_path, layers=[0])] == [0]


def test_layer_without_its_router_names_what_was_looked_for(tmp_path):
    write_checkpoint(tmp_path, "qwen3_moe", num_layers=2, omit=("model.layers.1.mlp.gate.weight",))
    with pytest.raises(CheckpointError, match=r"MoE layer 1 \(qwen\): none of its router tensors is stored with its "
                                              r"experts \(looked for .*'model.layers.1.mlp.gate.weight'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name, shape, expected", [
    ("model.layers.2.mlp.experts.1.down_proj.weight", (16, 30), r"\[16, 30\], expected \[16, 32\]"),
    ("model.layers.2.mlp.gate.weight", (7, 16), r"\[7, 16\], expected \[8, 16\]"),
    ("model.layers.2.mlp.gate.e_score_correction_bias", (9,), r"\[9\], expected \[8\]"),
    ("model.layers.2.mlp.shared_experts.up_proj.weight", (16, 32), r"\[16, 32\], expected \[32, 16\]"),
])
def test_misshaped_tensor_is_named(tmp_path, name, shape, expected):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, replace={name: np.zeros(shape, np.float32)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has shape {expected} from config.json"):
        load_checkpoint(tmp_path)


def test_misshaped_fused_tensor_is_named(tmp_path):
    name = "model.layers.1.mlp.experts.gate_up_proj"
    write_checkpoint(tmp_path, "mistral4", num_layers=2, replace={name: np.zeros((8, 60, 16), np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[8, 60, 16\], expected \[8, 64, 16\]"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     r"unsupported model: model_type 'llama', architectures \['LlamaForCausalLM'\]; expertd serves .*mixtral"),
    ({"architectures": None, "model_type": None}, r"unsupported model: model_type None, architectures None"),
])
def test_unsupported_architecture(tmp_path, overrides, message):
    write_checkpoint(tmp_path, "mixtral", num_layers=1, config_overrides=overrides)
    with pytest.raises(CheckpointRefused, match=message):
        load_checkpoint(tmp_path)


def test_architecture_alone_identifies_the_family(tmp_path):
    expected = write_checkpoint(tmp_path, "qwen3_moe", num_layers=1, config_overrides={"model_type": None})
    assert "model_type" not in read_config(tmp_path)
    assert_layers_equal(load_checkpoint(tmp_path), expected)


def test_directory_problems(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_checkpoint(tmp_path)
    write_checkpoint(tmp_path, "mixtral", num_layers=1)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        load_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match="gone.safetensors .listed in model.safetensors.index.json. is missing"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_checkpoint(tmp_path)


def test_corrupt_safetensors_headers_name_the_file(tmp_path):
    write_checkpoint(tmp_path, "mixtral", num_layers=1)
    file = tmp_path / "model.safetensors"
    data = bytearray(file.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(data[:100])  # truncated inside the header
    with pytest.raises(CheckpointError, match="cannot read model.safetensors: header length"):
        load_checkpoint(tmp_path)
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_length])
    name = "model.layers.0.block_sparse_moe.gate.weight"
    header[name]["shape"] = [5, 16]  # 4 x 16 floats stored, 5 x 16 claimed
    text = json.dumps(header).encode().ljust(header_length)
    file.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + header_length:])
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds 256 bytes, but F32 \\[5, 16\\] needs 320"):
        load_checkpoint(tmp_path)


def test_float8_weights_without_a_quantization_config_are_refused_by_name(tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    write_checkpoint(tmp_path, "mixtral", num_layers=1,
                     replace={name: np.zeros((32, 16), ml_dtypes.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is stored as float8_e4m3fn but config.json declares "
                                              "no quantization_config"):
        load_checkpoint(tmp_path)


def test_stored_tensors_are_memory_mapped_views(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8")
    with StoredTensors(tmp_path) as stored:
        name = "model.layers.2.mlp.experts.0.gate_proj.weight"
        assert stored.header(name) == ("F8_E4M3", (32, 16))
        weight = stored[name]
        assert weight.dtype == ml_dtypes.float8_e4m3fn and not weight.flags.writeable
        assert stored.header(name + "_scale_inv") == ("F32", (4, 2))
        stored.release(name)  # pages dropped from the process, values still readable
        assert np.isfinite(weight.astype(np.float32)).all()


def test_plan_reads_headers_only_and_states_the_served_bytes(tmp_path):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=3, quantize="fp8", dtype="bfloat16")
    plan = plan_checkpoint(tmp_path)
    assert [layer.index for layer in plan.layers] == [2] and plan.moe_layers == [2]
    assert plan.layers[0].tensors.router == "model.layers.2.mlp.gate.weight"
    assert (plan.stored_dtype, plan.dtype, plan.scheme.method) == ("F8_E4M3", "bfloat16", "fp8")
    assert "quantised checkpoint (fp8: float8 e4m3, 8x8 block scales (float))" in plan.dtype_reason
    # router fp32 [16, 8] + bias fp32 [8] + 3 x [8, 16, 32] bf16 experts + 3 x [16, 32] bf16 shared
    assert plan.served_bytes == 16 * 8 * 4 + 8 * 4 + 3 * 8 * 16 * 32 * 2 + 3 * 16 * 32 * 2


@pytest.mark.parametrize("src_dtype, out_dtype", [(BF16, BF16), (np.float32, BF16), (np.float16, np.float32),
                                                  (np.float32, np.float32)])
def test_transposing_copy_equals_numpy(src_dtype, out_dtype):
    src = np.random.default_rng(0).standard_normal((300, 700)).astype(src_dtype)
    for view in (src.T, src[:, ::2].T, src[::3]):
        out = host_empty(view.shape, out_dtype)
        copy_into(out, view)
        np.testing.assert_array_equal(out, view.astype(out_dtype))
    big = host_empty((4096, 4096), BF16)  # its own huge-page mapping
    big[...] = 1
    assert big.dtype == BF16 and big.flags.writeable and float(big[-1, -1]) == 1.0


def test_one_worker_loads_what_many_do(tmp_path):
    expected = write_checkpoint(tmp_path, "mistral4", num_layers=3, quantize="fp8")
    for workers in (1, 3):
        assert_layers_equal(load_checkpoint(tmp_path, dtype="float32", workers=workers), expected)


def test_hash_table_entries_and_shape_are_checked(tmp_path):
    """DeepSeek-V4's tid2eid: int64 on disk, int32 served; an entry that is no expert id is named."""
    name = "layers.0.ffn.gate.tid2eid"
    expected = write_checkpoint(tmp_path / "good", "deepseek_v4", num_layers=2)
    layer = load_checkpoint(tmp_path / "good", layers=[0])[0]
    assert layer.cfg.hash_vocab_size == 32 and not layer.cfg.use_expert_bias and "expert_bias" not in layer.params
    np.testing.assert_array_equal(layer.params["tid2eid"], expected[0]["tid2eid"])
    bad = expected[0]["tid2eid"].astype(np.int64)
    bad[5, 1] = 8
    write_checkpoint(tmp_path / "bad", "deepseek_v4", num_layers=2, replace={name: bad})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}': entry \[5, 1\] = 8 is not an expert id in \[0, 8\)"):
        load_checkpoint(tmp_path / "bad")
    write_checkpoint(tmp_path / "shape", "deepseek_v4", num_layers=2, replace={name: np.zeros((32, 3), np.int64)})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[32, 3\], expected \[32, 2\]"):
        load_checkpoint(tmp_path / "shape")
    write_checkpoint(tmp_path / "float", "deepseek_v4", num_layers=2, replace={name: np.zeros((32, 2), np.float32)})
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' must be an integer table \[32, 2\]"):
        load_checkpoint(tmp_path / "float")
