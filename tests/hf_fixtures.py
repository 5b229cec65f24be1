"""Small synthetic Hugging Face checkpoints of every served MoE family: config.json + *.safetensors.

Each checkpoint is laid out as the family's real ones are (config.json keys, nested `text_config`,
layer prefixes, tensor names, `nn.Linear` weights `[out_features, in_features]`, fused / flat
expert tensors), with tiny shapes and seeded random values, optionally quantised in an official
format (`tests/hf_quantizers.py`). `write_checkpoint` returns what the loader must produce, and
`hf_reference` computes a layer's output in float64 by the family's transformers semantics,
restated here independently of expertd:

    expected = write_checkpoint(tmp_path, "deepseek_v3", sharded=True, dtype="bfloat16")
    layers = load_checkpoint(tmp_path)                          # expertd.server.models.checkpoint
    out = hf_reference(tmp_path, layer.index, x, expected[layer.index])

Expected params use expertd's layouts (`router_weight [H, E]`, `expert_bias [E]`, `w_gate / w_up
[E, H, I]`, `w_down [E, I, H]`, `shared_w_gate / shared_w_up [H, Is]`, `shared_w_down [Is, H]`,
`shared_gate [H, 1]`), as float32 arrays holding the values exactly as stored (or as
dequantised: the loader's output in float32 must equal them bit for bit). Dense layers,
attention and embeddings get a few tensors too, so the loader must skip what it does not need.
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from hf_layouts import expert_tensors, semantic_tensors
from hf_oracle import moe_block
from hf_quantizers import QUANTIZE, Quantizer, quantization_config, save_safetensors

HIDDEN = 16          # H (32 for FP4 / MXFP4, whose groups are 32 inputs)
INTERMEDIATE = 32    # I (routed experts' intermediate size)
SHARED = 24          # Qwen's shared_expert_intermediate_size
DENSE_INTERMEDIATE = 48
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_PER_EXPERT = ("gate_proj", "up_proj", "down_proj")
_W = ("w1", "w3", "w2")
_DS = dict(moe_intermediate_size=INTERMEDIATE, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=4,
           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
           topk_method="noaux_tc", first_k_dense_replace=2, moe_layer_freq=1)
_KIMI = dict(_DS, n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.827,
             first_k_dense_replace=1)
_GLM = dict(_DS, n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.8, first_k_dense_replace=1)
_QWEN = dict(moe_intermediate_size=INTERMEDIATE, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
             mlp_only_layers=[])


def _sparse(first_dense: int, n: int) -> list[str]:
    return ["dense" if i < first_dense else "sparse" for i in range(n)]


# family -> (model_type, architecture, text keys, outer (nested configs: the top level), layer prefix,
#            router, bias, experts (kind, names), shared (module names) and shared gate, routing, dtype key)
SPECS = {
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=INTERMEDIATE, router_jitter_noise=0.0), None, "model.layers.{i}.",
                "block_sparse_moe.gate.weight", None,
                ("per_expert", tuple(f"block_sparse_moe.experts.{{j}}.{n}.weight" for n in _W)), None, None,
                "softmax", "torch_dtype"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=INTERMEDIATE), None, "model.layers.{i}.",
                   "block_sparse_moe.router.layer.weight", None,
                   ("fused_rows", ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight")),
                   None, None, "softmax", "torch_dtype"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(_QWEN, shared_expert_intermediate_size=SHARED,
                  norm_topk_prob=False), None, "model.layers.{i}.", "mlp.gate.weight", None,
                  ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                  "mlp.shared_expert", "mlp.shared_expert_gate.weight", "softmax", "torch_dtype"),
    # transformers 5 writes Qwen3MoeConfig's expert count as num_local_experts (and dtype, not torch_dtype)
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict({k: v for k, v in _QWEN.items() if k != "num_experts"},
                  num_local_experts=4, norm_topk_prob=True), None, "model.layers.{i}.", "mlp.gate.weight", None,
                  ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)), None, None,
                  "softmax", "dtype"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", dict(_QWEN, shared_expert_intermediate_size=SHARED,
                   norm_topk_prob=True), None, "model.layers.{i}.", "mlp.gate.weight", None,
                   ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                   "mlp.shared_expert", "mlp.shared_expert_gate.weight", "softmax", "dtype"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration",
                    dict(moe_intermediate_size=INTERMEDIATE, num_experts=4, num_experts_per_tok=2,
                         shared_expert_intermediate_size=SHARED), dict(model_type="qwen3_5_moe"),
                    "model.language_model.layers.{i}.", "mlp.gate.weight", None,
                    ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                    "mlp.shared_expert", "mlp.shared_expert_gate.weight", "softmax_renorm", "dtype"),
    "olmoe": ("olmoe", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=INTERMEDIATE,
              norm_topk_prob=False), None, "model.layers.{i}.", "mlp.gate.weight", None,
              ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)), None, None, "softmax",
              "torch_dtype"),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", dict(_DS), None, "model.layers.{i}.", "mlp.gate.weight",
                    "mlp.gate.e_score_correction_bias",
                    ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                    "mlp.shared_experts", None, "sigmoid_groups", "torch_dtype"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32ForCausalLM", dict(_DS), None, "model.layers.{i}.",
                     "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                     ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                     "mlp.shared_experts", None, "sigmoid_groups", "torch_dtype"),
    "kimi_k2": ("kimi_k2", "DeepseekV3ForCausalLM", dict(_KIMI), None, "model.layers.{i}.", "mlp.gate.weight",
                "mlp.gate.e_score_correction_bias",
                ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                "mlp.shared_experts", None, "sigmoid_groups", "torch_dtype"),
    "kimi_k25": ("kimi_k2", "KimiK25ForConditionalGeneration", dict(_KIMI), dict(model_type="kimi_k25"),
                 "language_model.model.layers.{i}.", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                 ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                 "mlp.shared_experts", None, "sigmoid_groups", "torch_dtype"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM", dict(_GLM), None, "model.layers.{i}.", "mlp.gate.weight",
                 "mlp.gate.e_score_correction_bias",
                 ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                 "mlp.shared_experts", None, "sigmoid_groups", "torch_dtype"),
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsaForCausalLM", dict(_GLM, first_k_dense_replace=3), None,
                    "model.layers.{i}.", "mlp.gate.weight", "mlp.gate.e_score_correction_bias",
                    ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                    "mlp.shared_experts", None, "sigmoid_groups", "dtype"),
    "mistral_large3": ("deepseek_v3", "Mistral3ForConditionalGeneration", dict(_DS, first_k_dense_replace=1),
                       dict(model_type="mistral3"), "model.language_model.layers.{i}.", "mlp.gate.weight",
                       "mlp.gate.e_score_correction_bias",
                       ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                       "mlp.shared_experts", None, "sigmoid_groups", "dtype"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=INTERMEDIATE, scoring_func="sigmoid", use_routing_bias=True), None,
                   "model.layers.{i}.", "block_sparse_moe.gate.weight", "block_sparse_moe.e_score_correction_bias",
                   ("per_expert", tuple(f"block_sparse_moe.experts.{{j}}.{n}.weight" for n in _W)), None, None,
                   "sigmoid_renorm", "dtype"),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", dict(num_experts=4, moe_topk=2,
                       intermediate_size=INTERMEDIATE), None, "model.layers.{i}.", "mlp.gate.wg.weight", None,
                       ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                       "mlp.shared_mlp", None, "softmax_renorm", "torch_dtype"),
    "dbrx": ("dbrx", "DbrxForCausalLM", dict(ffn_config=dict(moe_num_experts=4, moe_top_k=2,
             ffn_hidden_size=INTERMEDIATE, moe_normalize_expert_weights=1, ffn_act_fn={"name": "silu"})), None,
             "transformer.blocks.{i}.", "ffn.router.layer.weight", None,
             ("flat_rows", ("ffn.experts.mlp.w1", "ffn.experts.mlp.v1", "ffn.experts.mlp.w2")), None, None,
             "softmax_renorm", "torch_dtype"),
    "mistral4": ("mistral4", "Mistral4ForCausalLM", dict(_DS, routed_scaling_factor=1.5, first_k_dense_replace=1),
                 None, "model.layers.{i}.", "mlp.gate.weight", None,
                 ("fused_rows", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")), "mlp.shared_experts", None,
                 "softmax_groups", "dtype"),
    "mistral_large4": ("mistral_large4", "Mistral3ForConditionalGeneration",
                       dict(_GLM, num_experts_per_tok=2, routed_scaling_factor=1.0, norm_topk_prob=False),
                       dict(model_type="mistral3"), "layers.{i}.", "gate.weight", None,
                       ("per_expert", tuple(f"experts.{{j}}.{n}.weight" for n in _W)), "shared_experts", None,
                       "softmax_groups_renorm", "dtype"),
    # transformers 5's in-memory names: `mlp.gate` and fused `mlp.experts.gate_up_proj [E, 2I, H]`
    "mixtral_fused": ("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                      intermediate_size=INTERMEDIATE), None, "model.layers.{i}.", "mlp.gate.weight", None,
                      ("fused_rows", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")), None, None,
                      "softmax", "dtype"),
    # --- the families whose semantics expertd's kernels gained in 2026 (hf_oracle.py restates them)
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                intermediate_size=INTERMEDIATE, swiglu_limit=1.0), None, "model.layers.{i}.", "mlp.router.weight",
                None, ("fused_columns_interleaved", ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")), None,
                None, "logits_bias_topk", "torch_dtype"),
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM", dict(n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=INTERMEDIATE, n_shared_experts=1, scoring_func="sqrtsoftplus",
                    routed_scaling_factor=1.5, swiglu_limit=1.0), None, "layers.{i}.", "ffn.gate.weight",
                    "ffn.gate.bias", ("per_expert", tuple(f"ffn.experts.{{j}}.{n}.weight" for n in _W)),
                    "ffn.shared_experts", None, "sqrtsoftplus", "dtype"),
    "glm5_next": ("glm5_next_text", "Glm5NextForConditionalGeneration", dict(_GLM, swiglu_limit=1.0),
                  dict(model_type="glm5_next"), "model.language_model.layers.{i}.", "mlp.gate.weight",
                  "mlp.gate.e_score_correction_bias",
                  ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                  "mlp.shared_experts", None, "sigmoid_groups", "dtype"),
    "step3p7": ("step3p5", "Step3p7ForConditionalGeneration", dict(n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=INTERMEDIATE, share_expert_dim=SHARED, moe_router_scaling_factor=2.0),
                dict(model_type="step3p7"), "model.layers.{i}.", "moe.gate.weight", "moe.router_bias",
                ("stacked", ("moe.gate_proj.weight", "moe.up_proj.weight", "moe.down_proj.weight")),
                "share_expert", None, "sigmoid_scaled", "dtype"),
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", dict(moe_num_experts=4, moe_k=2,
                     moe_intermediate_size=INTERMEDIATE, moe_num_shared_experts=1, moe_layer_start_index=1,
                     moe_layer_end_index=-1, moe_layer_interval=1, moe_norm_min=0.7), None, "model.layers.{i}.",
                     "mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias",
                     ("per_expert", tuple(f"mlp.experts.{{j}}.{n}.weight" for n in _PER_EXPERT)),
                     "mlp.shared_experts", None, "softmax_probs_bias", "torch_dtype"),
    "llama4": ("llama4_text", "Llama4ForConditionalGeneration", dict(num_local_experts=4, num_experts_per_tok=2,
               intermediate_size=INTERMEDIATE, intermediate_size_mlp=DENSE_INTERMEDIATE),
               dict(model_type="llama4"), "language_model.model.layers.{i}.", "feed_forward.router.weight", None,
               ("fused_columns", ("feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj")),
               "feed_forward.shared_expert", None, "llama4", "torch_dtype"),
    "gemma4": ("gemma4_text", "Gemma4ForConditionalGeneration", dict(num_experts=4, top_k_experts=2,
               moe_intermediate_size=INTERMEDIATE, hidden_activation="gelu_pytorch_tanh", enable_moe_block=True),
               dict(model_type="gemma4"), "model.language_model.layers.{i}.", "router.proj.weight", None,
               ("fused_rows", ("experts.gate_up_proj", "experts.down_proj")), None, None, "gemma4", "dtype"),
}
FAMILIES = tuple(SPECS)
_SHARED_NAMES = {"mistral_large4": _W, "deepseek_v4": _W}
_BIAS_STEP = {"ernie4_5_moe": 0.1, "deepseek_v4": 0.1, "step3p7": 0.1}  # selection bias per expert index


def hf_config(family: str, *, num_layers: int = 3, dtype: str = "float32", hidden: int = HIDDEN) -> dict:
    """The config.json dict of a tiny model of `family` with `num_layers` decoder layers."""
    if family not in SPECS:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    model_type, arch, keys, outer, *_rest, dtype_key = SPECS[family]
    text = {"model_type": model_type, "hidden_size": hidden, "intermediate_size": DENSE_INTERMEDIATE,
            "num_hidden_layers": num_layers, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 32,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, dtype_key: dtype, **keys}
    if family == "dbrx":  # DbrxConfig's own names
        text = {k: v for k, v in text.items() if k not in ("hidden_size", "num_hidden_layers", "intermediate_size")}
        text.update(d_model=hidden, n_layers=num_layers, n_heads=2)
    if family in ("glm_moe_dsa", "deepseek_v32", "mistral_large4", "glm5_next"):
        text["mlp_layer_types"] = _sparse(1, num_layers)  # wins over first_k_dense_replace
    if family == "hunyuan_v1_moe":
        text["moe_topk"] = [2] * num_layers  # per-layer list
    if family == "deepseek_v4":  # the first layer routes by token id
        text["mlp_layer_types"] = ["hash_moe" if i < 1 else "moe" for i in range(num_layers)]
    if family == "step3p7":  # per-layer limits, 0 = no clamp (layer 1: shared only, 2: routed only)
        text.update(mlp_layer_types=_sparse(1, num_layers), swiglu_limits=[0.8 * (i % 2 == 0) for i in
                                                                           range(num_layers)],
                    swiglu_limits_shared=[0.9 * (i % 2) for i in range(num_layers)])
    if family == "llama4":
        text["moe_layers"] = list(range(0, num_layers, 2))
    if family == "gemma4":  # Gemma4TextConfig names its activation hidden_activation only
        del text["hidden_act"]
    if outer is None:
        return {"architectures": [arch], **text}
    return {"architectures": [arch], **outer, "text_config": text, dtype_key: dtype}


def text_of(config: dict) -> dict:
    return config.get("text_config", config)


def moe_layer_indices(config: dict, family: str) -> list[int]:
    """Which decoder layers of a `family` fixture config are MoE (the transformers rules, restated)."""
    c = text_of(config)
    n = c.get("num_hidden_layers", c.get("n_layers"))
    if "mlp_layer_types" in c:
        return [i for i, kind in enumerate(c["mlp_layer_types"]) if kind in ("sparse", "moe", "hash_moe")]
    if "moe_layers" in c:  # Llama 4
        return list(c["moe_layers"])
    if "moe_layer_start_index" in c:  # ERNIE 4.5
        end = n - 1 if c["moe_layer_end_index"] == -1 else c["moe_layer_end_index"]
        return [i for i in range(n) if (i + 1) % c["moe_layer_interval"] == 0
                and c["moe_layer_start_index"] <= i <= end]
    if "first_k_dense_replace" in c:
        return [i for i in range(n) if i >= c["first_k_dense_replace"] and i % c.get("moe_layer_freq", 1) == 0]
    if "decoder_sparse_step" in c:
        return [i for i in range(n) if i not in set(c["mlp_only_layers"]) and (i + 1) % c["decoder_sparse_step"] == 0]
    return list(range(n))


def _shapes(family, config):
    """(E, k, I, Is) of a fixture config."""
    c = text_of(config)
    if family == "dbrx":
        f = c["ffn_config"]
        return f["moe_num_experts"], f["moe_top_k"], f["ffn_hidden_size"], 0
    e = c.get("num_experts", c.get("num_local_experts", c.get("n_routed_experts", c.get("moe_num_experts"))))
    k = c.get("num_experts_per_tok", c.get("moe_topk", c.get("top_k_experts", c.get("moe_k"))))
    k = k[0] if isinstance(k, list) else k
    inter = c.get("moe_intermediate_size", c.get("intermediate_size"))
    if family in ("hunyuan_v1_moe", "llama4"):
        shared = c["intermediate_size"]
    elif "share_expert_dim" in c:
        shared = c["share_expert_dim"]
    elif "moe_num_shared_experts" in c:
        shared = c["moe_num_shared_experts"] * inter
    elif "shared_expert_intermediate_size" in c:
        shared = c["shared_expert_intermediate_size"]
    else:
        shared = c.get("n_shared_experts", 0) * inter
    return e, k, inter, shared


def write_checkpoint(path, family: str, *, num_layers: int = 3, sharded: bool = False, dtype: str = "float32",
                     seed: int = 0, config_overrides: dict | None = None, omit: tuple[str, ...] = (),
                     replace: dict[str, np.ndarray] | None = None, quantize: str | None = None,
                     hidden: int | None = None, block=(8, 8), group: int = 8) -> dict[int, dict[str, np.ndarray]]:
    """Write a tiny HF checkpoint of `family` into directory `path`; return the expected MoE params.

    Args:
      dtype: storage dtype of the unquantised weights ("float32", "bfloat16", "float16"); the
        expert bias is always stored float32, as in the real checkpoints.
      config_overrides: keys merged into config.json (into text_config for nested ones) before the
        tensors are generated; a value None removes the key.
      omit / replace: tensor names to leave out / to write with the given array instead.
      quantize: one of QUANTIZE: routed experts (and shared experts for the FP8 ones) stored
        quantised with a matching quantization_config; block: FP8 block size; group: INT4 group.
      hidden: H (default 16; 32 for fp4 / mxfp4).
    Returns:
      {layer index: params} for every MoE layer in expertd's layouts (see module docstring).
    """
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    hidden = hidden or (32 if quantize in ("fp4", "mxfp4") else HIDDEN)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(family, num_layers=num_layers, dtype=dtype, hidden=hidden)
    for key, value in (config_overrides or {}).items():
        if value is None:
            text_of(config).pop(key, None)
            config.pop(key, None)
        else:
            text_of(config)[key] = value
    if quantize is not None:
        config["quantization_config"] = quantization_config(quantize, block, group)
    _, _, _, _, prefix, router, bias, (kind, names), shared, shared_gate, *_ = SPECS[family]
    store = _DTYPES[dtype]
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])).astype(store)

    groups = [{"model.embed_tokens.weight": rand(32, hidden), "lm_head.weight": rand(32, hidden)}]
    expected = {}
    e, k, inter, shared_size = _shapes(family, config)
    for layer in range(num_layers):
        p = prefix.format(i=layer)
        tensors = {p + "input_layernorm.weight": np.ones(hidden, store),
                   p + "self_attn.o_proj.weight": rand(hidden, hidden)}
        if layer not in moe_layer_indices(config, family):
            tensors.update({p + "mlp.gate_proj.weight": rand(DENSE_INTERMEDIATE, hidden),
                            p + "mlp.up_proj.weight": rand(DENSE_INTERMEDIATE, hidden),
                            p + "mlp.down_proj.weight": rand(hidden, DENSE_INTERMEDIATE)})
            groups.append(tensors)
            continue
        quant = Quantizer(quantize, block, group, tensors)
        params = {"router_weight": _store(tensors, p + router, rand(e, hidden)).astype(np.float32).T.copy()}
        hashed = family == "deepseek_v4" and text_of(config)["mlp_layer_types"][layer] == "hash_moe"
        if bias is not None and not hashed:
            value = ((np.arange(e, dtype=np.float32) - e / 2) * _BIAS_STEP.get(family, 0.01))
            stored = value.reshape(1, e) if family == "ernie4_5_moe" else value  # ERNIE's moe_statics: [1, E]
            _store(tensors, p + bias, stored)
            params["expert_bias"] = value
        params.update(expert_tensors(kind, [p + n for n in names], e, hidden, inter, rand, quant))
        params.update(semantic_tensors(family, tensors, p, hashed, config, e, k, hidden, inter, rand, rng))
        if shared is not None:
            proj = _SHARED_NAMES.get(family, _PER_EXPERT)
            weights = [rand(shared_size, hidden), rand(shared_size, hidden), rand(hidden, shared_size)]
            deq = [quant.weight(f"{p}{shared}.{n}.weight", w, shared=True) for n, w in zip(proj, weights)]
            params.update(shared_w_gate=deq[0].T.copy(), shared_w_up=deq[1].T.copy(), shared_w_down=deq[2].T.copy())
            if shared_gate is not None:
                params["shared_gate"] = _store(tensors, p + shared_gate, rand(1, hidden)).T.copy()
        expected[layer] = params
        groups.append(tensors)
    _edit(groups, replace or {}, omit)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if sharded:
        weight_map = {}
        for n, tensors in enumerate(groups, start=1):
            filename = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
            save_safetensors(path / filename, tensors)
            weight_map.update(dict.fromkeys(tensors, filename))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_safetensors(path / "model.safetensors", {k: v for t in groups for k, v in t.items()})
    return expected


def _store(tensors, name, value):
    tensors[name] = value
    return value


def _edit(groups, replace, omit):
    for name, value in replace.items():
        holder = next((t for t in groups if name in t), None)
        if holder is None:
            raise ValueError(f"replace: no tensor named {name!r} in this checkpoint")
        holder[name] = value
    for name in omit:
        if not any(t.pop(name, None) is not None for t in groups):
            raise ValueError(f"omit: no tensor named {name!r} in this checkpoint")


def hf_reference(path, layer: int, x: np.ndarray, params: dict, token_ids=None) -> np.ndarray:
    """The MoE block of decoder `layer` of the fixture at `path` on x `[T, H]`, in float64, by the
    family's transformers semantics (`hf_oracle.moe_block`; `params` are the layer's expected params,
    `token_ids [T]` the tokens' ids for a hash-routed layer)."""
    config = json.loads((Path(path) / "config.json").read_text())
    family = next(f for f, s in SPECS.items() if s[0] == text_of(config)["model_type"]
                  and s[1] in config["architectures"])
    e, k, _, _ = _shapes(family, config)
    return moe_block(family, SPECS[family][10], text_of(config), params, x, layer, token_ids, k=k, e=e)
