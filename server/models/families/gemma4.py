"""Gemma 4 (`gemma4`, decoder keys under `text_config`, model_type `gemma4_text`).

The MoE branch sits in the decoder layer beside a dense MLP (`enable_moe_block`;
Gemma4TextDecoderLayer, Gemma4TextRouter in modeling_gemma4.py). On the residual x:
  router: r = RMSNorm(x) (no weight) * router.scale * H^-1/2; p = softmax(r @ Wr^T) over E; top-k,
          renormalised, times `per_expert_scale` of each chosen expert;
  experts: GeGLU (`hidden_activation`, gelu_pytorch_tanh) on pre_feedforward_layernorm_2(x); their
          weighted sum goes through post_feedforward_layernorm_2.
Gemma 4's RMSNorm is x / sqrt(mean(x^2) + eps) * weight (the weight as stored, eps `rms_norm_eps`).
The dense MLP (`mlp`, post_feedforward_layernorm_1) runs in parallel outside the branch and is not
served. Every decoder layer.
expertd: softmax post-top-k (= softmax, top-k, renormalise), activation gelu_tanh,
router_input_norm (router_input_scale = router.scale * H^-1/2), per_expert_scale,
expert_input_norm, expert_output_norm, norm_eps = rms_norm_eps.

Tensors (under `model.language_model.layers.N.`): `router.proj.weight [E, H]`, `router.scale [H]`,
`router.per_expert_scale [E]`, fused `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj
[E, H, I]`, `pre_feedforward_layernorm_2.weight [H]`, `post_feedforward_layernorm_2.weight [H]`. BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import BranchNorms, Family, FusedRows, LayerTensors


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_experts"), topk=c.integer("top_k_experts", "num_experts_per_tok"),
                     hidden_size=c.integer("hidden_size"), intermediate_size=c.integer("moe_intermediate_size"),
                     score_function="softmax", activation=c.activation("hidden_activation", "hidden_act",
                                                                       default="gelu_pytorch_tanh"),
                     router_input_norm=True, per_expert_scale=True, expert_input_norm=True, expert_output_norm=True,
                     norm_eps=c.number("rms_norm_eps", default=1e-6))


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers())) if c.get("enable_moe_block", default=True) else []


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("router.proj.weight", FusedRows("experts.gate_up_proj", "experts.down_proj"),
                         norms=BranchNorms("router.scale", "router.per_expert_scale",
                                           "pre_feedforward_layernorm_2.weight",
                                           "post_feedforward_layernorm_2.weight")),)


FAMILY = Family(
    name="gemma4", model_types=("gemma4", "gemma4_text"), architectures=("Gemma4ForConditionalGeneration",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors,
    router="RMS-normed input x scale; softmax, top-k, renormalised, x per_expert_scale",
    activation="GeGLU (tanh), RMSNorm in and out", shared="dense MLP in parallel (not served)")
