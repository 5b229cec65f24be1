"""`expertd inspect DIR`: family, MoE layers, shapes, router, quantisation, the serving dtype and
memory, and what serve would do; exit 0 when servable, 2 with the exact refusal otherwise."""
import json

from hf_fixtures import write_checkpoint

from expertd.server.cli import main


def inspect(capsys, *args):
    code = main(["inspect", *map(str, args)])
    return code, capsys.readouterr().out


def test_servable_quantised_checkpoint(tmp_path, capsys):
    write_checkpoint(tmp_path, "deepseek_v3", num_layers=4, quantize="fp8", dtype="bfloat16")
    code, out = inspect(capsys, tmp_path)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1] == "family       deepseek_v3 (model_type deepseek_v3; DeepseekV3ForCausalLM)"
    assert lines[2] == "MoE layers   2-3 (2 of 4 decoder layers)"
    assert lines[3] == "layers 2-3: E=8 k=4 H=16 I=32, shared 32 ungated, silu"
    assert lines[4] == ("  router     sigmoid, top-4 of score + bias, within the best 2 of 4 groups (group score: "
                        "top 2), renormalised, x 2.5")
    assert "experts PerExpert (model.layers.2.mlp.experts.0.gate_proj.weight, ...)" in lines[5]
    assert lines[6] == ("quantised    fp8: float8 e4m3, 8x8 block scales (float); left unquantised: lm_head, "
                        "model.layers.*.mlp.gate")
    assert lines[7].startswith("dtype        bfloat16 (--dtype auto: a quantised checkpoint (fp8: float8 e4m3, 8x8 "
                               "block scales (float)) is dequantised to bfloat16; experts stored as F8_E4M3)")
    assert lines[8].startswith("memory       55.1 KiB of served weights for 2 MoE layers (checkpoint files ")
    assert lines[9] == "serve        would serve MoE layers 2-3"

    assert json.loads(inspect(capsys, tmp_path, "--json")[1])["expert_weights"] == "bfloat16"
    code, out = inspect(capsys, tmp_path, "--expert-weights", "int8")  # FP8 served as INT8 (quantised at load)
    assert code == 0 and "experts      served as INT8 (--expert-weights int8" in out
    int8_report = json.loads(inspect(capsys, tmp_path, "--json", "--expert-weights", "int8")[1])
    bf16_report = json.loads(inspect(capsys, tmp_path, "--json")[1])
    assert int8_report["expert_weights"] == "int8" and int8_report["served_bytes"] < bf16_report["served_bytes"]

    code, out = inspect(capsys, tmp_path, "--json", "--dtype", "float32", "--layers", "3")
    report = json.loads(out)
    assert code == 0 and report["servable"] and report["refusal"] is None
    assert (report["family"], report["moe_layers"], report["served_layers"], report["dtype"]) == \
        ("deepseek_v3", [2, 3], [3], "float32")
    assert report["quantization"]["method"] == "fp8" and report["quantization"]["block_size"] == [8, 8]
    group = report["layers"][0]
    assert (group["indices"], group["num_experts"], group["topk"], group["num_groups"]) == ([2, 3], 8, 4, 4)
    assert report["served_bytes"] == 4 * (16 * 8 + 8) + 4 * 3 * (8 * 16 * 32 + 16 * 32)  # layer 3 in float32


def test_nested_family_with_its_prefix(tmp_path, capsys):
    write_checkpoint(tmp_path, "qwen3_5_moe", num_layers=2, dtype="bfloat16")
    code, out = inspect(capsys, tmp_path)
    assert code == 0, out
    assert "family       qwen (model_type qwen3_5_moe, text_config qwen3_5_moe_text;" in out
    assert "shared 24 sigmoid-gated" in out and "softmax over the top-2, renormalised" in out
    assert "model.language_model.layers.0.mlp.gate.weight" in out
    assert "dtype        bfloat16 (--dtype auto: config.json's dtype is bfloat16" in out


def test_refused_family_is_described_and_refused(tmp_path, capsys):
    """Phi-3.5-MoE (SparseMixer routing, not expertd's) has Mixtral's tensor layout."""
    write_checkpoint(tmp_path, "mixtral", num_layers=2, config_overrides={"model_type": "phimoe",
                                                                          "architectures": ["PhimoeForCausalLM"]})
    code, out = inspect(capsys, tmp_path)
    assert code == 2
    assert "family       phimoe (model_type phimoe; PhimoeForCausalLM)" in out
    assert "layers 0-1: E=4 k=2 H=16 I=32, no shared expert, silu" in out
    assert out.splitlines()[-1] == ("serve        refused: phimoe: SparseMixer top-2 routing (router_jitter_noise "
                                    "relative threshold) is not supported yet")
    report = json.loads(inspect(capsys, tmp_path, "--json")[1])
    assert not report["servable"] and report["family"] == "phimoe" and report["dtype"] is None


def test_new_family_semantics_are_described(tmp_path, capsys):
    write_checkpoint(tmp_path / "gpt", "gpt_oss", num_layers=2, quantize="mxfp4")
    code, out = inspect(capsys, tmp_path / "gpt")
    assert code == 0, out
    assert "layers 0-1: E=4 k=2 H=32 I=32, no shared expert, swiglu_oai, clamped at 1 before the activation, " \
           "alpha 1.702, projection biases" in out
    assert "  router     logits + router bias, softmax over the top-2, renormalised" in out
    assert ("experts FusedColumns (model.layers.0.mlp.experts.gate_up_proj, ...); model.layers.0.mlp.router.bias; "
            "model.layers.0.mlp.experts.gate_up_proj_bias; model.layers.0.mlp.experts.down_proj_bias") in out
    assert "quantised    mxfp4: e2m1 with e8m0 scales per 32" in out
    write_checkpoint(tmp_path / "v4", "deepseek_v4", num_layers=3)
    code, out = inspect(capsys, tmp_path / "v4")
    assert code == 0, out
    assert ("layers 0: E=8 k=2 H=16 I=32, shared 32 ungated, silu, clamped at 1 before the activation, shared "
            "clamped at 1") in out
    assert ("  router     sqrtsoftplus, experts tid2eid[token id] (vocabulary 32; needs token ids), renormalised, "
            "x 1.5") in out
    assert "  router     sqrtsoftplus, top-2 of score + bias, renormalised, x 1.5" in out
    write_checkpoint(tmp_path / "gemma", "gemma4", num_layers=1)
    code, out = inspect(capsys, tmp_path / "gemma")
    assert code == 0, out
    assert "gelu_tanh, RMSNorm on the experts' input and output" in out
    assert ("  router     RMS-normed input x scale, softmax over the top-2, renormalised, x per_expert_scale"
            in out)


def test_refusals_name_the_reason(tmp_path, capsys):
    write_checkpoint(tmp_path / "llama", "mixtral", num_layers=1, config_overrides={"model_type": "llama",
                                                                                    "architectures": ["Llama"]})
    code, out = inspect(capsys, tmp_path / "llama")
    assert code == 2 and "serve        refused: unsupported model: model_type 'llama'" in out

    write_checkpoint(tmp_path / "groups", "deepseek_v3", num_layers=3, config_overrides={"topk_group": 1})
    code, out = inspect(capsys, tmp_path / "groups")
    assert code == 2 and ("group-limited routing with n_group=4, topk_group=1, 8 experts and num_experts_per_tok=4 "
                          "is not servable") in out

    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    write_checkpoint(tmp_path / "missing", "deepseek_v3", num_layers=3, omit=(name,))
    code, out = inspect(capsys, tmp_path / "missing")
    assert code == 2 and f"tensor '{name}' is missing" in out

    write_checkpoint(tmp_path / "awq", "mixtral", num_layers=1)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq"}
    (tmp_path / "awq" / "config.json").write_text(json.dumps(config))
    code, out = inspect(capsys, tmp_path / "awq")
    assert code == 2 and "quant_method 'awq' is not supported" in out

    code, out = inspect(capsys, tmp_path / "nowhere")
    assert code == 2 and "refused: [Errno 2] No such file or directory" in out


def test_serve_states_the_dtype_and_refuses_unserved_checkpoints_before_loading(tmp_path, capsys):
    from expertd.server.config import ModelConfig
    from expertd.server.engine.build import serving_dtype

    write_checkpoint(tmp_path / "fp32", "dbrx", num_layers=1)
    assert serving_dtype(ModelConfig(checkpoint=str(tmp_path / "fp32"))) == \
        ("float32", "--dtype auto: config.json's dtype is float32")
    assert serving_dtype(ModelConfig(checkpoint=str(tmp_path / "fp32"), dtype="bfloat16"))[0] == "bfloat16"
    assert serving_dtype(ModelConfig()) == ("bfloat16", "--dtype auto: presets are served in bfloat16")
    write_checkpoint(tmp_path / "phi", "mixtral", num_layers=1, config_overrides={"model_type": "phimoe"})
    assert main(["serve", "--checkpoint", str(tmp_path / "phi"), "--port", "0", "--metrics-port", "0"]) == 2
    assert "error: checkpoint" in capsys.readouterr().out


def test_refused_family_with_an_incomplete_config_still_names_what_is_missing(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "longcat_flash", "num_hidden_layers": 2}))
    code, out = inspect(capsys, tmp_path)
    assert code == 2 and "refused: longcat_flash: zero-computation (identity) experts" in out
