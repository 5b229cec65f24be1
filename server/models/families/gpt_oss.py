"""gpt-oss (`gpt_oss`): recognised, refused at start (its semantics are not in expertd's kernels yet).

GptOssMLP: logits = x @ Wr^T + br (the router bias moves selection and weights); top-k logits,
softmaxed over the k; experts: gate_up = x @ W_gu[j] + b_gu[j] with gate / up interleaved on the
columns (gate even, up odd), g = min(g, L), u = clip(u, -L, L), h = (u + 1) * g * sigmoid(alpha g)
(alpha `swiglu_alpha` 1.702, L `swiglu_limit` 7), out_j = h @ W_d[j] + b_d[j]. Every layer is MoE.
Missing: the router bias, the expert biases and this activation.

config.json: `num_local_experts`, `num_experts_per_tok`, `intermediate_size`, `swiglu_limit`.
Tensors (under `model.layers.N.`): `mlp.router.weight [E, H]`, `mlp.router.bias [E]`,
`mlp.experts.gate_up_proj [E, H, 2I]` (interleaved), `gate_up_proj_bias [E, 2I]`,
`mlp.experts.down_proj [E, I, H]`, `down_proj_bias [E, H]`; official MXFP4: `*_blocks`, `*_scales`
(dequantised `[E, 2I, H]`, transposed at load), the rest BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, FusedColumns, LayerTensors


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_local_experts", "num_experts", default=128),
                     topk=c.integer("num_experts_per_tok", default=4), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("intermediate_size"), score_function="softmax")


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("mlp.router.weight",
                         FusedColumns("mlp.experts.gate_up_proj", "mlp.experts.down_proj", interleaved=True)),)


def missing(c: HFConfig) -> str:
    return ("gpt_oss: the router bias (it moves the weights too), the experts' biases and the gpt-oss SwiGLU "
            "((up + 1) * g * sigmoid(1.702 g) with swiglu_limit clamps) are not supported yet")


FAMILY = Family(
    name="gpt_oss", model_types=("gpt_oss",), architectures=("GptOssForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing, served=False,
    router="logits + router bias, top-k, softmax over the k", activation="gpt-oss SwiGLU (alpha, limit), biases",
    formats="MXFP4 experts, BF16")
