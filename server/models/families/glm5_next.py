"""GLM-5.3-Flash (`glm5_next`, decoder keys under `text_config`): recognised, refused at start.

As GLM-5 (`glm_moe_dsa`: the DeepSeek-V3 router, `mlp_layer_types`) but every expert, the shared
one included, uses the clamped SwiGLU silu(min(g, L)) * clip(u, -L, L) with L = `swiglu_limit`
(10). Missing: the clamped SwiGLU. Tensors as GLM-5 under `model.language_model.layers.N.`.
"""
from __future__ import annotations

from expertd.server.models.config import HFConfig
from expertd.server.models.families import deepseek_v3
from expertd.server.models.family import Family


def missing(c: HFConfig) -> str:
    return ("glm5_next: the clamped SwiGLU silu(min(g, L)) * clip(u, -L, L) (swiglu_limit) on routed and shared "
            "experts is not supported yet")


FAMILY = Family(
    name="glm5_next", model_types=("glm5_next", "glm5_next_text"), architectures=(),
    layer_config=deepseek_v3.layer_config, moe_layers=deepseek_v3.moe_layers, tensors=deepseek_v3.tensors,
    missing=missing, served=False, router=deepseek_v3.FAMILY.router, activation="clamped SwiGLU",
    shared="n_shared_experts x moe_intermediate_size, ungated, clamped", formats="BF16, FP8 128x128 block")
