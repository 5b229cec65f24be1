"""GLM-5.3-Flash (`glm5_next`, decoder keys under `text_config`, model_type `glm5_next_text`).

As GLM-5 (`glm_moe_dsa`: the DeepSeek-V3 router with GLM's defaults, `mlp_layer_types`; see
deepseek_v3.py) but every expert, the shared one included, uses the clamped SwiGLU
silu(min(g, L)) * clip(u, -L, L) with L = `swiglu_limit` (10).
expertd: deepseek_v3's layer description plus swiglu_limit = shared_swiglu_limit = swiglu_limit.
Tensors as GLM-5 under `model.language_model.layers.N.`: `mlp.gate.weight`,
`mlp.gate.e_score_correction_bias`, `mlp.experts.j.{gate,up,down}_proj.weight` (or fused),
`mlp.shared_experts.*_proj.weight`. Formats: BF16, FP8 128x128 block.
"""
from __future__ import annotations

import dataclasses

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.families import deepseek_v3
from expertd.server.models.family import Family


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    cfg = deepseek_v3.layer_config(c, index)
    limit = c.number("swiglu_limit", default=10.0)
    return dataclasses.replace(cfg, swiglu_limit=limit, shared_swiglu_limit=limit if cfg.has_shared else None)


FAMILY = Family(
    name="glm5_next", model_types=("glm5_next", "glm5_next_text"), architectures=(),
    layer_config=layer_config, moe_layers=deepseek_v3.moe_layers, tensors=deepseek_v3.tensors,
    router=deepseek_v3.FAMILY.router, activation="clamped SwiGLU",
    shared="n_shared_experts x moe_intermediate_size, ungated, clamped", formats="BF16, FP8 128x128 block")
