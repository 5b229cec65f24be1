"""Loading MoE layers of real-layout Hugging Face safetensors checkpoints (written by hf_fixtures)."""
import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_fixtures import FAMILIES, hf_moe_block_reference, write_checkpoint

from expertd.kernels.moe import param_shapes
from expertd.server.checkpoint import CheckpointError, load_checkpoint, read_config
from expertd.server.startup import build_engine
from expertd.server.steps import pad_rows


def _assert_layers_equal(layers, expected):
    assert [layer.index for layer in layers] == sorted(expected)
    for layer in layers:
        want = expected[layer.index]
        assert set(layer.params) == set(want) == set(param_shapes(layer.cfg))
        for name, value in want.items():
            assert layer.params[name].dtype == value.dtype, name
            np.testing.assert_array_equal(layer.params[name], value, err_msg=name)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loads_every_moe_layer_of_every_family(tmp_path, family, sharded):
    expected = write_checkpoint(tmp_path, family, num_layers=3, sharded=sharded, dtype="bfloat16")
    layers = load_checkpoint(tmp_path)
    _assert_layers_equal(layers, expected)
    cfg = layers[0].cfg
    assert cfg.hidden_size == 16 and cfg.intermediate_size == 32
    assert layers[0].source == str(tmp_path)


def test_family_configs_map_to_the_router_settings(tmp_path):
    configs = {}
    for family in FAMILIES:
        write_checkpoint(tmp_path / family, family, num_layers=3)
        configs[family] = load_checkpoint(tmp_path / family)[0].cfg
    assert (configs["mixtral"].num_experts, configs["mixtral"].topk, configs["mixtral"].score_function) \
        == (4, 2, "softmax")
    assert configs["qwen2_moe"].shared_expert_gate and configs["qwen2_moe"].shared_intermediate_size == 24
    assert configs["qwen2_moe"].use_pre_softmax  # norm_topk_prob false: no renormalisation
    assert not configs["qwen3_moe"].has_shared and not configs["qwen3_moe"].use_pre_softmax
    deepseek = configs["deepseek_v3"]
    assert (deepseek.score_function, deepseek.use_expert_bias, deepseek.num_groups, deepseek.group_topk,
            deepseek.scaling_factor, deepseek.shared_intermediate_size) == ("sigmoid", True, 4, 2, 2.5, 32)


def test_layer_selection_reads_only_the_layers_asked_for(tmp_path):
    expected = write_checkpoint(tmp_path, "deepseek_v3", num_layers=6, sharded=True)
    assert sorted(expected) == [2, 3, 4, 5]  # layers 0-1 are dense (first_k_dense_replace=2)
    layers = load_checkpoint(tmp_path, layers="3,5")
    _assert_layers_equal(layers, {i: expected[i] for i in (3, 5)})
    assert [layer.index for layer in load_checkpoint(tmp_path, layers=[4])] == [4]
    # The shard of layer 2 may be broken: it is never opened when layer 2 is not asked for.
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    (tmp_path / index["model.layers.2.mlp.gate.weight"]).write_bytes(b"not a safetensors file")
    assert [layer.index for layer in load_checkpoint(tmp_path, layers="3-4")] == [3, 4]
    with pytest.raises(CheckpointError, match="cannot read model-00004-of-00007.safetensors"):
        load_checkpoint(tmp_path, layers=[2])


def test_dtype_conversion(tmp_path):
    expected = write_checkpoint(tmp_path, "qwen2_moe", num_layers=2, dtype="float32")
    layer = load_checkpoint(tmp_path, layers=[1], dtype="bfloat16")[0]
    assert layer.params["w_up"].dtype == jnp.bfloat16 and layer.params["shared_gate"].dtype == jnp.bfloat16
    assert layer.params["router_weight"].dtype == np.float32
    np.testing.assert_array_equal(layer.params["w_down"], expected[1]["w_down"].astype(jnp.bfloat16))


def test_qwen_mlp_only_layers_and_sparse_step(tmp_path):
    expected = write_checkpoint(tmp_path, "qwen3_moe", num_layers=6,
                                config_overrides={"decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert sorted(expected) == [1, 5]
    _assert_layers_equal(load_checkpoint(tmp_path), expected)
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


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     r"unsupported architecture \['LlamaForCausalLM'\] \(model_type 'llama'\); supported: MixtralForCausalLM"),
    ({"architectures": None, "model_type": None}, r"unsupported architecture None \(model_type None\)"),
])
def test_unsupported_architecture(tmp_path, overrides, message):
    write_checkpoint(tmp_path, "mixtral", num_layers=1, config_overrides=overrides)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path)


def test_architecture_alone_identifies_the_family(tmp_path):
    expected = write_checkpoint(tmp_path, "qwen3_moe", num_layers=1, config_overrides={"model_type": "qwen3_moe"})
    config = json.loads((tmp_path / "config.json").read_text())
    assert read_config(tmp_path)["architectures"] == config["architectures"]
    _assert_layers_equal(load_checkpoint(tmp_path), expected)


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


def test_quantized_weights_are_refused_by_name(tmp_path):
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    write_checkpoint(tmp_path, "mixtral", num_layers=1, replace={name: np.zeros((32, 16), ml_dtypes.float8_e4m3fn)})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is stored as F8_E4M3 .a quantized checkpoint."):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_served_checkpoint_reproduces_the_hf_moe_block(tmp_path, family):
    expected = write_checkpoint(tmp_path, family, num_layers=3, sharded=family == "qwen2_moe")
    layer = max(expected)
    engine = build_engine(load_checkpoint(tmp_path, layers=[layer]), buckets=(8,), dtype="float32", devices=1).engine
    x = np.random.default_rng(1).standard_normal((6, 16), dtype=np.float32)
    served = engine.forward(layer, pad_rows([x], 8), 6).output
    np.testing.assert_allclose(served, hf_moe_block_reference(tmp_path, layer, x), rtol=1e-4, atol=1e-5)
