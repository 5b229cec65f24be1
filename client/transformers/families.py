"""The sparse-MoE blocks of transformers 5.x model families, and what the expert server must hold
for each: the table ``FAMILIES`` (block class name -> :class:`Family`), ``find_moe_blocks`` and
``expected_layer``.

Every block listed takes ``hidden_states [batch, seq, H]``. Most return the output ``[batch, seq, H]``;
gpt-oss returns ``(output [batch, seq, H], router scores)`` and Llama 4 ``(output [batch*seq, H],
router logits)`` (``Family.returns_router``, ``Family.flat_output``). Router logits for
``output_router_logits`` are recorded by transformers from the block's router child
(``Family.router``), not from the block's return value.

What the server must hold for a block of decoder layer i (``LayerSpec``, compared with GetModelInfo):
hidden size H, routed experts E, top-k, expert intermediate size I, score function, group-limited
routing (n_group > 1: groups and groups kept), whether a selection bias is used, whether the layer
has shared experts, and for the families the server loads from checkpoints (Mixtral, Qwen2/3-MoE,
the DeepSeek-V3 style) whether the k routing weights are divided by their sum and the routed
scaling factor. Values are read from the model's (text) config by the attribute names of the
family's row; transformers' ``attribute_map`` makes the 4.x and 5.x spellings read the same.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from torch import nn


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's sparse-MoE block (transformers 5.x) and the config attributes that describe it."""

    model_type: str
    block: str                           # class name of the sparse-MoE block
    router: str = "gate"                 # the block's router child (it computes the router logits)
    score_function: str = "softmax"      # "softmax" | "sigmoid" | "sqrtsoftplus"
    num_experts: str = "num_experts"     # config attribute: E (an int, or one per layer)
    topk: str = "num_experts_per_tok"    # config attribute: k (an int, or one per layer)
    intermediate: str = "moe_intermediate_size"  # config attribute: I of a routed expert
    grouped: bool = False                # n_group / topk_group group-limited routing when n_group > 1
    expert_bias: bool = False            # selection-only expert bias (e_score_correction_bias)
    shared: str | bool | None = None     # config attribute > 0 when the layer has shared experts; True: always
    normalised: str | bool | None = None  # k weights divided by their sum: config attribute, or always; None: unchecked
    scaling: str | float | None = None   # routed scaling factor: config attribute, or a constant; None: unchecked
    returns_router: bool = False         # the block returns (output, router output), not the output alone
    flat_output: bool = False            # the output is [batch*seq, H], not the input's [batch, seq, H]


def _ds_v3_style(model_type: str, block: str) -> Family:
    """DeepSeek-V3 router: sigmoid, selection bias, groups; n_shared_experts ungated shared experts."""
    return Family(model_type, block, score_function="sigmoid", num_experts="n_routed_experts", grouped=True,
                  expert_bias=True, shared="n_shared_experts", normalised="norm_topk_prob",
                  scaling="routed_scaling_factor")


FAMILIES: dict[str, Family] = {f.block: f for f in (
    Family("mixtral", "MixtralSparseMoeBlock", num_experts="num_local_experts", intermediate="intermediate_size",
           normalised=True, scaling=1.0),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", shared="shared_expert_intermediate_size",
           normalised="norm_topk_prob", scaling=1.0),
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", normalised="norm_topk_prob", scaling=1.0),
    _ds_v3_style("deepseek_v3", "DeepseekV3MoE"),  # also Kimi K2 / K2.5 (their text model is DeepSeek-V3)
    Family("qwen3_next", "Qwen3NextSparseMoeBlock", shared="shared_expert_intermediate_size"),
    Family("qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", shared="shared_expert_intermediate_size"),
    Family("olmoe", "OlmoeSparseMoeBlock", intermediate="intermediate_size"),
    _ds_v3_style("glm4_moe", "Glm4MoeMoE"),
    _ds_v3_style("glm_moe_dsa", "GlmMoeDsaMoE"),
    _ds_v3_style("deepseek_v32", "DeepseekV32MoE"),
    Family("minimax_m2", "MiniMaxM2SparseMoeBlock", score_function="sigmoid", num_experts="num_local_experts",
           intermediate="intermediate_size", expert_bias=True),
    Family("granitemoe", "GraniteMoeMoE", router="router", num_experts="num_local_experts",
           intermediate="intermediate_size"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1Moe", topk="moe_topk", intermediate="intermediate_size", shared=True),
    Family("mistral4", "Mistral4MoE", num_experts="n_routed_experts", grouped=True, shared="n_shared_experts"),
    Family("gpt_oss", "GptOssMLP", router="router", num_experts="num_local_experts",
           intermediate="intermediate_size", returns_router=True),
    Family("llama4", "Llama4TextMoe", router="router", score_function="sigmoid", num_experts="num_local_experts",
           intermediate="intermediate_size", shared=True, returns_router=True, flat_output=True),
)}


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What the server must hold as layer ``index`` for one of the model's MoE blocks."""

    index: int
    hidden_size: int
    num_experts: int
    topk: int
    intermediate_size: int
    score_function: str
    num_groups: int          # 0: no group-limited routing
    group_topk: int
    has_expert_bias: bool
    has_shared_experts: bool
    topk_normalised: bool | None = None   # None: not compared
    scaling_factor: float | None = None   # None: not compared

    def differences(self, served) -> list[str]:
        """``"field: model X, server Y"`` for each field where ``served`` (a GetModelInfo LayerInfo) differs."""
        router = served.router
        found = {
            "hidden_size": served.hidden_size, "num_experts": served.num_experts, "topk": served.topk,
            "intermediate_size": served.intermediate_size, "score_function": served.router.score_function,
            "num_groups": served.router.num_groups, "group_topk": served.router.group_topk,
            "has_expert_bias": served.router.has_expert_bias,
            "has_shared_experts": served.num_shared_experts > 0,
        }
        if not self.num_groups:
            found["group_topk"] = 0  # without groups the server's group_topk means nothing
        if self.topk_normalised is not None:
            found["topk_normalised"] = served_normalisation(router, served.topk)
        if self.scaling_factor is not None:  # float32 on the wire
            found["scaling_factor"] = router.scaling_factor
        return [f"{name}: model {getattr(self, name)!r}, server {value!r}" for name, value in found.items()
                if not _same(getattr(self, name), value)]


def served_normalisation(router, topk: int) -> bool:
    """Whether a server layer divides its k routing weights by their sum (before scaling): its
    ``norm_topk_prob`` when set, else the score function's own rule (softmax after top-k sums to 1,
    softmax before top-k is not renormalised, sigmoid is divided by the sum when k > 1)."""
    if router.HasField("norm_topk_prob"):
        return router.norm_topk_prob
    if router.score_function == "softmax":
        return not router.use_pre_softmax
    return topk > 1


def _same(model, server) -> bool:
    if isinstance(model, float):
        return abs(model - server) <= 1e-6 * max(1.0, abs(model))
    return model == server


@dataclasses.dataclass(frozen=True)
class MoEBlock:
    """A sparse-MoE block found in a model: its module path, decoder-layer index, module and family."""

    path: str
    index: int
    module: nn.Module
    family: Family


_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|blocks|h)\.(\d+)(?:\.|$)")


def family_of(module: nn.Module) -> Family | None:
    """The family of a sparse-MoE block module (or of a placeholder standing in for one), else None."""
    family = getattr(module, "expertd_family", None)
    return family if isinstance(family, Family) else FAMILIES.get(type(module).__name__)


def find_moe_blocks(model: nn.Module) -> Iterator[MoEBlock]:
    """The sparse-MoE blocks of ``model`` (known families and placeholders), in module order; blocks
    already offloaded (and the original blocks they keep) are not listed."""
    offloaded: list[str] = []
    for path, module in model.named_modules():
        if any(path.startswith(prefix + ".") for prefix in offloaded):
            continue
        if getattr(module, "expertd_offloaded", False):
            offloaded.append(path)
            continue
        family = family_of(module)
        if family is None:
            continue
        indices = _LAYER_INDEX.findall(path)
        if not indices:
            raise ValueError(f"{path} ({type(module).__name__}): no decoder-layer index in its module path")
        yield MoEBlock(path, int(indices[-1]), module, family)


def expected_layer(family: Family, config, index: int) -> LayerSpec:
    """The LayerSpec of decoder layer ``index``'s block from the model's (text) ``config``."""
    def read(name: str):
        value = getattr(config, name, None)
        if value is None:
            raise ValueError(f"{family.model_type} config has no {name!r}, needed to check layer {index}")
        return value[index] if isinstance(value, (list, tuple)) else value

    groups = int(getattr(config, "n_group", None) or 1) if family.grouped else 1
    normalised = family.normalised if not isinstance(family.normalised, str) else bool(read(family.normalised))
    scaling = family.scaling if not isinstance(family.scaling, str) else read(family.scaling)
    shared = family.shared is True or (isinstance(family.shared, str) and bool(getattr(config, family.shared, 0)))
    return LayerSpec(
        index=index, hidden_size=int(read("hidden_size")), num_experts=int(read(family.num_experts)),
        topk=int(read(family.topk)), intermediate_size=int(read(family.intermediate)),
        score_function=family.score_function, num_groups=groups if groups > 1 else 0,
        group_topk=int(read("topk_group")) if groups > 1 else 0, has_expert_bias=family.expert_bias,
        has_shared_experts=shared, topk_normalised=normalised,
        scaling_factor=None if scaling is None else float(scaling))
