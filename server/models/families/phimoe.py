"""Phi-3.5-MoE (`phimoe`): recognised, refused at start.

PhimoeSparseMoeBlock uses SparseMixer top-2 routing: the first expert is the argmax of the logits,
weighted by a softmax over the logits within a relative threshold 2 * `router_jitter_noise` of the
max; the second likewise with the first masked. Experts SwiGLU, no shared expert. Every layer.
Missing: SparseMixer routing.

Tensors (under `model.layers.N.`): `block_sparse_moe.gate.weight [E, H]`,
`block_sparse_moe.experts.j.{w1,w3,w2}.weight`. BF16.
"""
from __future__ import annotations

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig
from expertd.server.models.family import Family, LayerTensors, per_expert


def layer_config(c: HFConfig, index: int) -> MoEConfig:
    return MoEConfig(num_experts=c.integer("num_local_experts", default=16),
                     topk=c.integer("num_experts_per_tok", default=2), hidden_size=c.integer("hidden_size"),
                     intermediate_size=c.integer("intermediate_size"), activation=c.activation())


def moe_layers(c: HFConfig) -> list[int]:
    return list(range(c.num_layers()))


def tensors(c: HFConfig, index: int) -> tuple[LayerTensors, ...]:
    return (LayerTensors("block_sparse_moe.gate.weight", per_expert("block_sparse_moe", ("w1", "w3", "w2"))),)


def missing(c: HFConfig) -> str:
    return "phimoe: SparseMixer top-2 routing (router_jitter_noise relative threshold) is not supported yet"


FAMILY = Family(
    name="phimoe", model_types=("phimoe",), architectures=("PhimoeForCausalLM",),
    layer_config=layer_config, moe_layers=moe_layers, tensors=tensors, missing=missing, served=False,
    router="SparseMixer top-2")
