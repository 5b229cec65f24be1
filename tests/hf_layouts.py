"""How tests/hf_fixtures.py stores one MoE layer's routed experts in each checkpoint layout, and the
tensors of the families' own semantics (router and projection biases, hash tables, Gemma 4's
norms); each returns the params the loader must produce, in expertd's layouts (float32 values as
stored or dequantised)."""
from __future__ import annotations

import numpy as np


def text_of(config: dict) -> dict:
    return config.get("text_config", config)


def semantic_tensors(family, tensors, p, hashed, config, e, k, h, inter, rand, rng) -> dict:
    """The tensors of the families' own semantics (stored under prefix `p`); their expected params."""
    store = next(iter(tensors.values())).dtype

    def put(name, value):
        tensors[p + name] = value.astype(store)
        return tensors[p + name].astype(np.float32)

    if family == "gpt_oss":  # router bias; expert biases with gate / up interleaved like the weight's columns
        gate_up = put("mlp.experts.gate_up_proj_bias", rng.standard_normal((e, 2 * inter)) * 0.3)
        return {"router_bias": put("mlp.router.bias", rng.standard_normal(e) * 0.5),
                "b_gate": gate_up[:, 0::2].copy(), "b_up": gate_up[:, 1::2].copy(),
                "b_down": put("mlp.experts.down_proj_bias", rng.standard_normal((e, h)) * 0.3)}
    if family == "deepseek_v4" and hashed:  # DeepSeek stores the table as int64 [vocab, k], distinct ids per row
        table = np.stack([rng.permutation(e)[:k] for _ in range(text_of(config)["vocab_size"])])
        tensors[p + "ffn.gate.tid2eid"] = table.astype(np.int64)
        return {"tid2eid": table.astype(np.int32)}
    if family == "gemma4":
        scale = put("router.scale", 1 + 0.3 * rng.standard_normal(h))
        return {"router_input_scale": scale * np.float32(h ** -0.5),
                "per_expert_scale": put("router.per_expert_scale", 1 + 0.3 * rng.standard_normal(e)),
                "expert_input_norm_weight": put("pre_feedforward_layernorm_2.weight", 1 + 0.3 * rng.standard_normal(h)),
                "expert_output_norm_weight": put("post_feedforward_layernorm_2.weight",
                                                 1 + 0.3 * rng.standard_normal(h))}
    return {}


def expert_tensors(kind, names, e, h, inter, rand, quant) -> dict:
    """Store the routed experts in `kind`'s layout; their dequantised params in expertd's layouts."""
    if kind == "per_expert":
        shapes = ((inter, h), (inter, h), (h, inter))
        w = [[quant.weight(t.format(j=j), rand(*shape)) for t, shape in zip(names, shapes)] for j in range(e)]
        return {"w_gate": np.stack([g.T for g, _, _ in w]), "w_up": np.stack([u.T for _, u, _ in w]),
                "w_down": np.stack([d.T for _, _, d in w])}
    if kind == "fused_rows":  # [E, 2I, H] gate rows first, [E, H, I]
        gate_up, down = quant.weight(names[0], rand(e, 2 * inter, h)), quant.weight(names[1], rand(e, h, inter))
        return {"w_gate": np.swapaxes(gate_up[:, :inter], 1, 2).copy(),
                "w_up": np.swapaxes(gate_up[:, inter:], 1, 2).copy(), "w_down": np.swapaxes(down, 1, 2).copy()}
    if kind == "flat_rows":  # DBRX [E*I, H] each; down used untransposed
        w1, v1, w2 = (quant.weight(n, rand(e * inter, h)) for n in names)
        return {"w_gate": np.swapaxes(w1.reshape(e, inter, h), 1, 2).copy(),
                "w_up": np.swapaxes(v1.reshape(e, inter, h), 1, 2).copy(), "w_down": w2.reshape(e, inter, h).copy()}
    if kind.startswith("fused_columns"):  # [E, H, 2I] (gpt-oss: gate even columns; Llama 4: gate half first)
        gate_up = quant.weight(names[0], rand(e, 2 * inter, h), transposed=True)  # [E, H, 2I]; MXFP4 transposed
        down = quant.weight(names[1], rand(e, h, inter), transposed=True)  # [E, I, H]
        gate, up = (gate_up[:, :, 0::2], gate_up[:, :, 1::2]) if kind.endswith("interleaved") else \
            (gate_up[:, :, :inter], gate_up[:, :, inter:])
        return {"w_gate": gate.copy(), "w_up": up.copy(), "w_down": down.copy()}
    if kind == "stacked":  # Step-3.7: gate, up [E, I, H], down [E, H, I]
        gate, up = quant.weight(names[0], rand(e, inter, h)), quant.weight(names[1], rand(e, inter, h))
        down = quant.weight(names[2], rand(e, h, inter))
        return {"w_gate": np.swapaxes(gate, 1, 2).copy(), "w_up": np.swapaxes(up, 1, 2).copy(),
                "w_down": np.swapaxes(down, 1, 2).copy()}
    raise ValueError(kind)
