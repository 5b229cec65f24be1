"""What a family module declares (`Family`) and how a checkpoint names one MoE layer's tensors
(`LayerTensors` and the routed-expert layouts), with the transforms into expertd's layouts.

A family module (one file in `expertd.server.models.families`) defines `FAMILY = Family(...)`:
  (a) `layer_config(c, i) -> MoEConfig`: config.json -> the layer description;
  (b) `moe_layers(c) -> [i, ...]`: which decoder layers hold an MoE block;
  (c) `tensors(c, i) -> (LayerTensors, ...)`: the layer's tensor names, relative to the layer
      prefix (`model.layers.{i}.` and the other `prefixes`), one entry per layout the family's
      checkpoints come in (the loader takes the first whose router and first expert tensors exist);
  (d) `missing(c) -> str | None`: what expertd cannot compute yet for this config (None: served).
      A family with a reason is recognised, inspected and refused at start, never served.
`c` is an `HFConfig`. Where (d) gives a reason, (a) gives the shapes and the part of the semantics
expertd has, for `expertd inspect`; start-up refuses before anything is loaded.

Layouts (transformers' names; `nn.Linear.weight` is `[out, in]`; H hidden, I expert intermediate,
E experts; every layout yields per expert j: w_gate[j], w_up[j] `[H, I]` and w_down[j] `[I, H]`):
  PerExpert      `experts.{j}.<gate|up|down>` Linear weights: gate, up `[I, H]`, down `[H, I]`
  FusedRows      `gate_up [E, 2I, H]` (gate rows first), `down [E, H, I]` (transformers 5's
                 fused experts, Mistral Small 4, GraniteMoE `input_linear`)
  FusedColumns   `gate_up [E, H, 2I]` (Llama 4: gate columns first; gpt-oss: interleaved, gate
                 on even columns), `down [E, I, H]`
  Stacked        `gate`, `up` `[E, I, H]`, `down [E, H, I]` (Step-3.7)
  FlatRows       `w1`, `v1`, `w2` `[E*I, H]` (DBRX): w_gate[j] = w1[jI:(j+1)I].T, w_down[j] = w2[jI:(j+1)I]

Beyond the router, selection bias, experts and shared expert, a `LayerTensors` names the tensors
of the families' own semantics (docs/semantics.md), each needed when its MoEConfig switch is on:
`router_bias [E]` (gpt-oss), `tid2eid [V, k]` (DeepSeek-V4 hash layers), `ProjBiases` (gpt-oss's
`gate_up [E, 2I]` + `down [E, H]` expert biases) and `BranchNorms` (Gemma 4's router scale,
per-expert scale and branch RMSNorm weights); the loader (`checkpoint_layer`) makes them MoEParams.

A layout reads through a `reader` (the checkpoint loader's) with one method:
  reader.dense(name, shape, expert=None, num_experts=None, in_out=False) -> array
      the dense weight `name` as transformers holds it (dequantised, in the serving dtype), checked
      against `shape` (the full tensor's); `expert=j` gives only expert j's slice of a tensor with
      a leading expert axis (`num_experts=E` first views a flat `[E*R, C]` tensor as `[E, R, C]`);
      `in_out`: transformers holds the parameter `[.., in, out]` (MXFP4 stores `[.., out, in]`
      blocks, so those are transposed back).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import HFConfig

# Where decoder layer i's tensors start, in the order they are tried.
PREFIXES = ("model.layers.{i}.", "model.language_model.layers.{i}.", "language_model.model.layers.{i}.",
            "layers.{i}.", "transformer.blocks.{i}.")


@dataclasses.dataclass(frozen=True)
class PerExpert:
    """One Linear per expert and projection; templates with `{j}`, e.g. "mlp.experts.{j}.gate_proj.weight"."""

    gate: str
    up: str
    down: str

    def probe(self) -> str:
        return self.gate.format(j=0)

    def shapes(self, e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
        return {name: shape for j in range(e) for name, shape in
                ((self.gate.format(j=j), (i, h)), (self.up.format(j=j), (i, h)), (self.down.format(j=j), (h, i)))}

    def expert(self, reader, j: int, e: int, h: int, i: int):
        return (reader.dense(self.gate.format(j=j), (i, h)).T, reader.dense(self.up.format(j=j), (i, h)).T,
                reader.dense(self.down.format(j=j), (h, i)).T)


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """`gate_up [E, 2I, H]` (rows: gate then up) and `down [E, H, I]`."""

    gate_up: str
    down: str

    def probe(self) -> str:
        return self.gate_up

    def shapes(self, e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
        return {self.gate_up: (e, 2 * i, h), self.down: (e, h, i)}

    def expert(self, reader, j: int, e: int, h: int, i: int):
        both = reader.dense(self.gate_up, (e, 2 * i, h), expert=j)
        return both[:i].T, both[i:].T, reader.dense(self.down, (e, h, i), expert=j).T


@dataclasses.dataclass(frozen=True)
class FusedColumns:
    """`gate_up [E, H, 2I]` and `down [E, I, H]`; gate columns first, or interleaved (gate even, up odd)."""

    gate_up: str
    down: str
    interleaved: bool = False

    def probe(self) -> str:
        return self.gate_up

    def shapes(self, e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
        return {self.gate_up: (e, h, 2 * i), self.down: (e, i, h)}

    def expert(self, reader, j: int, e: int, h: int, i: int):
        both = reader.dense(self.gate_up, (e, h, 2 * i), expert=j, in_out=True)
        gate, up = (both[:, 0::2], both[:, 1::2]) if self.interleaved else (both[:, :i], both[:, i:])
        return gate, up, reader.dense(self.down, (e, i, h), expert=j, in_out=True)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """`gate`, `up` `[E, I, H]` and `down [E, H, I]`: per-expert Linear weights stacked on axis 0."""

    gate: str
    up: str
    down: str

    def probe(self) -> str:
        return self.gate

    def shapes(self, e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
        return {self.gate: (e, i, h), self.up: (e, i, h), self.down: (e, h, i)}

    def expert(self, reader, j: int, e: int, h: int, i: int):
        return (reader.dense(self.gate, (e, i, h), expert=j).T, reader.dense(self.up, (e, i, h), expert=j).T,
                reader.dense(self.down, (e, h, i), expert=j).T)


@dataclasses.dataclass(frozen=True)
class FlatRows:
    """DBRX: `gate`, `up`, `down` each `[E*I, H]`; expert j owns rows j*I .. (j+1)*I; down is used
    as stored (`h @ w2[j]`), gate and up transposed (`x @ w1[j].T`)."""

    gate: str
    up: str
    down: str

    def probe(self) -> str:
        return self.gate

    def shapes(self, e: int, h: int, i: int) -> dict[str, tuple[int, ...]]:
        return {self.gate: (e * i, h), self.up: (e * i, h), self.down: (e * i, h)}

    def expert(self, reader, j: int, e: int, h: int, i: int):
        def rows(name):
            return reader.dense(name, (e * i, h), expert=j, num_experts=e)

        return rows(self.gate).T, rows(self.up).T, rows(self.down)


ExpertLayout = PerExpert | FusedRows | FusedColumns | Stacked | FlatRows


@dataclasses.dataclass(frozen=True)
class ProjBiases:
    """Per-expert projection biases (gpt-oss): `gate_up [E, 2I]` (gate half first, or interleaved:
    gate on even columns, up on odd, as the weight's columns) and `down [E, H]`."""

    gate_up: str
    down: str
    interleaved: bool = False


@dataclasses.dataclass(frozen=True)
class BranchNorms:
    """Gemma 4's MoE branch: `router_scale [H]` (served as router_input_scale = scale * H**-0.5),
    `per_expert_scale [E]`, and the RMSNorm weights `input_norm [H]` (pre_feedforward_layernorm_2)
    and `output_norm [H]` (post_feedforward_layernorm_2), used as stored (y = norm(x) * weight)."""

    router_scale: str
    per_expert_scale: str
    input_norm: str
    output_norm: str


@dataclasses.dataclass(frozen=True)
class Shared:
    """Shared-expert Linear weights gate, up `[Is, H]`, down `[H, Is]`, and the optional sigmoid gate `[1, H]`."""

    gate: str
    up: str
    down: str
    gate_weight: str | None = None


@dataclasses.dataclass(frozen=True)
class LayerTensors:
    """One MoE layer's tensor names relative to its layer prefix.

    router: the router Linear weight `[E, H]` (stored in any float dtype; served fp32 `[H, E]`).
    experts: the routed experts' layout (see the module docstring).
    bias: the selection-only expert bias `[E]` (or `[1, E]`), served fp32; None if the family has none.
    shared: the shared expert, None if none.
    router_bias: the router Linear's bias `[E]` (part of the logits), served fp32 (cfg.router_bias).
    tid2eid: a hash-routed layer's expert ids per token id `[V, k]` (any int dtype), served int32
      (cfg.hash_vocab_size > 0).
    proj_bias: the experts' projection biases (cfg.expert_proj_bias).
    norms: the MoE branch's own norms and scales (cfg.router_input_norm, per_expert_scale,
      expert_input_norm, expert_output_norm: all four together).
    """

    router: str
    experts: ExpertLayout
    bias: str | None = None
    shared: Shared | None = None
    router_bias: str | None = None
    tid2eid: str | None = None
    proj_bias: ProjBiases | None = None
    norms: BranchNorms | None = None

    def shapes(self, cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor `cfg` needs, name -> the dense shape transformers gives it (bias: `[E]`)."""
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        out = {self.router: (e, h), **self.experts.shapes(e, h, i)}
        if cfg.use_expert_bias:
            if self.bias is None:
                raise ValueError("the layer description asks for an expert bias the family names no tensor for")
            out[self.bias] = (e,)
        if cfg.has_shared:
            if self.shared is None:
                raise ValueError("the layer description asks for shared experts the family names no tensors for")
            s = cfg.shared_intermediate_size
            out.update({self.shared.gate: (s, h), self.shared.up: (s, h), self.shared.down: (h, s)})
            if cfg.shared_expert_gate:
                out[self.shared.gate_weight] = (1, h)
        out.update(self._semantic_shapes(cfg))
        return out

    def _semantic_shapes(self, cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        wanted = {"router_bias": (cfg.router_bias, lambda: {self.router_bias: (e,)}),
                  "tid2eid": (cfg.hash_routed, lambda: {self.tid2eid: (cfg.hash_vocab_size, cfg.topk)}),
                  "proj_bias": (cfg.expert_proj_bias,
                                lambda: {self.proj_bias.gate_up: (e, 2 * i), self.proj_bias.down: (e, h)}),
                  "norms": (cfg.router_input_norm or cfg.per_expert_scale or cfg.expert_input_norm
                            or cfg.expert_output_norm,
                            lambda: {self.norms.router_scale: (h,), self.norms.per_expert_scale: (e,),
                                     self.norms.input_norm: (h,), self.norms.output_norm: (h,)})}
        out = {}
        for field, (needed, shapes) in wanted.items():
            if not needed:
                continue
            if getattr(self, field) is None:
                raise ValueError(f"the layer description asks for {field} tensors the family names none for")
            out.update(shapes())
        return out

    def with_prefix(self, prefix: str) -> LayerTensors:
        def add(value):
            if isinstance(value, str):
                return prefix + value
            if dataclasses.is_dataclass(value):
                return dataclasses.replace(value, **{f.name: add(getattr(value, f.name))
                                                     for f in dataclasses.fields(value)
                                                     if isinstance(getattr(value, f.name), str)})
            return value

        return dataclasses.replace(self, **{f.name: add(getattr(self, f.name)) for f in dataclasses.fields(self)})


def per_expert(block: str, names=("gate_proj", "up_proj", "down_proj")) -> PerExpert:
    """`<block>.experts.{j}.<name>.weight` for the (gate, up, down) names."""
    return PerExpert(*(f"{block}.experts.{{j}}.{n}.weight" for n in names))


def fused_rows(block: str) -> FusedRows:
    """transformers 5's fused experts: `<block>.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`."""
    return FusedRows(f"{block}.experts.gate_up_proj", f"{block}.experts.down_proj")


def shared_mlp(module: str, names=("gate_proj", "up_proj", "down_proj"), gate_weight: str | None = None) -> Shared:
    return Shared(*(f"{module}.{n}.weight" for n in names), gate_weight=gate_weight)


@dataclasses.dataclass(frozen=True)
class Family:
    """One family module's declaration (see the module docstring for (a)-(d)).

    name: the family's key (its module name), e.g. "deepseek_v3".
    model_types: config.json `model_type` values it reads (top level or text_config).
    architectures: `architectures` entries that identify it when model_type does not.
    router, activation, shared, formats: one line each for `expertd inspect` and docs/models.md.
    served: False for a family recognised but not served at all yet (its `missing` always gives a
      reason); True where expertd serves it (`missing` may still refuse some configs).
    prefixes: layer prefixes to try, in order.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    layer_config: Callable[[HFConfig, int], MoEConfig]
    moe_layers: Callable[[HFConfig], list[int]]
    tensors: Callable[[HFConfig, int], Sequence[LayerTensors]]
    router: str
    activation: str = "SwiGLU"
    shared: str = "-"
    formats: str = "BF16"
    missing: Callable[[HFConfig], str | None] = lambda c: None
    served: bool = True
    prefixes: tuple[str, ...] = PREFIXES
