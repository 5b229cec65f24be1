"""The MoE layers a server holds: model presets with seeded random weights, and layer selection.

A served layer is a `LoadedLayer(index, cfg, params)`: its index in the model (DeepSeek-V3's first
MoE layer is 3, because layers 0-2 are dense), its `expertd.kernels.moe.MoEConfig`, and its weights
in expertd's layouts (`router_weight [H, E]` fp32, `expert_bias [E]` fp32 if any, `w_gate / w_up
[E, H, I]`, `w_down [E, I, H]`, `shared_w_gate / shared_w_up [H, Is]`, `shared_w_down [Is, H]`,
`shared_gate [H, 1]` if any). Checkpoints are read by `expertd.server.models.checkpoint`.

Presets (`PRESETS`), all built from Hugging Face style config dicts through the model registry
(`expertd.server.models`: `moe_layer_indices`, `layer_config`), so presets and checkpoints share
one path:
- `tiny` (default of `make serve`): H=64, E=8, k=2, I=128, 2 layers that differ in routing: even
  layers softmax top-2 (Mixtral style), odd layers grouped sigmoid top-2 with an expert bias, a
  scaling factor, 2 groups of 4 experts (the best group is kept) and a shared expert
  (DeepSeek-V3 style).
- `mixtral-8x7b`, `qwen3-30b-a3b`, `deepseek-v3`: the real models' MoE shapes and router settings
  (values from their config.json on the Hub), layers numbered as in the real model.

Preset weights are a `SeededParams` mapping: nothing is generated until a tensor is read, each
tensor is a pure function of (seed, layer index, tensor name), and the engine can generate a tensor
straight into its device sharding (`SeededParams.generate`) so a host never holds a whole real-size
layer. Reading `params[name]` on the host gives the same values (same jax.random program).
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels.moe import MoEConfig, param_shapes
from expertd.kernels.params import MoEParams, param_dtype
from expertd.server import models

DEFAULT_PRESET = "tiny"


@dataclasses.dataclass(frozen=True)
class LoadedLayer:
    """One MoE layer ready for the engine.

    index: the layer's index in the model (what requests name).
    cfg: its MoEConfig (shapes, router settings, shared experts, activation).
    params: as loaded, name -> array in expertd's layouts (see module docstring): a dict of numpy
      arrays for checkpoints, a lazy `SeededParams` mapping for presets. Start-up
      (`expertd.server.engine.weights.prepare`) replaces it with the placed, prepared `MoEParams`.
    source: where it came from, for logs and model info ("preset tiny", a checkpoint path).
    """

    index: int
    cfg: MoEConfig
    params: Mapping[str, np.ndarray] | MoEParams
    source: str = ""


# ----------------------------------------------------------------------------- layer selection

def parse_layers(spec: str) -> list[int]:
    """Parse a `--layers` value such as "1,3-5" into sorted unique indices [1, 3, 4, 5].

    Raises ValueError naming the bad part for empty parts, non-integers, negative indices and
    ranges whose end is below their start.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"layers: expected a list like '1,3-5', got {spec!r}")
    indices: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        bounds = part.split("-")
        if not part or len(bounds) > 2 or not all(b.strip().isdigit() for b in bounds):
            raise ValueError(
                f"layers: {part!r} in {spec!r} is not a layer index or a range 'a-b' of "
                "non-negative integers")
        lo, hi = int(bounds[0]), int(bounds[-1])
        if hi < lo:
            raise ValueError(f"layers: range {part!r} in {spec!r} ends before it starts")
        indices.update(range(lo, hi + 1))
    return sorted(indices)


def select_layers(available: Sequence[int], *, layers: Sequence[int] | str | None,
                  num_layers: int | None, what: str) -> list[int]:
    """Pick layers from the MoE layers `available` (in model order).

    `layers` (indices or a "1,3-5" string) picks exactly those; `num_layers` takes the first n;
    neither takes all. A requested index that is not an MoE layer raises ValueError listing the MoE
    layers of `what` (e.g. "preset deepseek-v3").
    """
    if layers is not None and num_layers is not None:
        raise ValueError("give either layers or num_layers, not both")
    if layers is not None:
        wanted = parse_layers(layers) if isinstance(layers, str) else sorted(set(int(i) for i in layers))
        missing = [i for i in wanted if i not in set(available)]
        if missing:
            raise ValueError(
                f"layers {missing} of {what} are not MoE layers; its MoE layers are "
                f"{describe_indices(available)}")
        if not wanted:
            raise ValueError("layers: no layer asked for")
        return wanted
    if num_layers is None:
        return list(available)
    if not 1 <= int(num_layers) <= len(available):
        raise ValueError(f"num_layers must be between 1 and {len(available)} for {what}, got {num_layers}")
    return list(available[: int(num_layers)])


def describe_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the inverse of parse_layers, for messages)."""
    parts, run = [], []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts) or "(none)"


# ----------------------------------------------------------------------------- seeded weights


class SeededParams(Mapping):
    """Lazily generated, deterministic random weights of one layer (see module docstring).

    Each tensor is `normal(key(seed, layer, name)) * scale` in fp32, then cast to its dtype
    (fp32 for router tensors, `dtype` for expert tensors). Scales keep activations O(1):
    1/sqrt(fan_in) for matrices, 0.05 for the expert bias.
    """

    def __init__(self, cfg: MoEConfig, *, layer_index: int, seed: int, dtype):
        self.cfg = cfg
        self.layer_index = int(layer_index)
        self.seed = int(seed)
        self.dtype = jnp.dtype(dtype)
        self._shapes = param_shapes(cfg)

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self.generate(name))

    def __iter__(self):
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)

    def __repr__(self) -> str:
        return f"SeededParams(layer={self.layer_index}, seed={self.seed}, dtype={self.dtype.name}, keys={list(self)})"

    def shape_dtype(self, name: str) -> jax.ShapeDtypeStruct:
        """Shape and dtype of `name` without generating it."""
        return jax.ShapeDtypeStruct(self._shapes[name], param_dtype(name, self.dtype))

    def generate(self, name: str, sharding=None, dtype=None) -> jax.Array:
        """Generate tensor `name` on device, laid out with `sharding` (default: the default device).

        With a sharding, each device computes only its own shard (threefry is partitionable), so the
        values do not depend on the sharding. `dtype` casts the result (after the cast to the
        tensor's own dtype, so the values are those of `params[name]`).
        """
        if name not in self._shapes:
            raise KeyError(name)
        target = self.shape_dtype(name)
        shape = target.shape
        fan_in = shape[-2] if len(shape) >= 2 else 0
        scale = 0.05 if name == "expert_bias" else 1.0 / float(np.sqrt(fan_in))
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), self.layer_index),
                                 zlib.crc32(name.encode()))
        out_dtype = jnp.dtype(dtype) if dtype is not None else target.dtype
        return _seeded_normal(key, shape, scale, target.dtype, out_dtype, sharding)


def _seeded_normal(key, shape, scale, dtype, out_dtype, sharding):
    return _normal_program(shape, jnp.dtype(dtype), jnp.dtype(out_dtype), sharding)(key, jnp.float32(scale))


@functools.lru_cache(maxsize=256)
def _normal_program(shape, dtype, out_dtype, sharding):
    """One compiled generator per (shape, dtypes, sharding): layers of one shape reuse it."""
    def make(key, scale):
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype).astype(out_dtype)

    return jax.jit(make, out_shardings=sharding)


# ----------------------------------------------------------------------------- presets

def _tiny_config(num_layers: int, layer: int) -> dict:
    """HF-style config of tiny layer `layer`: even layers Mixtral style, odd DeepSeek-V3 style."""
    common = {"hidden_size": 64, "num_hidden_layers": num_layers, "num_experts_per_tok": 2,
              "hidden_act": "silu"}
    if layer % 2 == 0:
        return {**common, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                "intermediate_size": 128, "num_local_experts": 8, "router_aux_loss_coef": 0.02}
    return {**common, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
            "intermediate_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
            "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
            "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
            "first_k_dense_replace": 0, "moe_layer_freq": 1}


# The MoE-relevant part of the real models' config.json files.
_MIXTRAL_8X7B = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_local_experts": 8,
    "num_experts_per_tok": 2, "hidden_act": "silu", "router_aux_loss_coef": 0.02,
}
_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
}
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8,
    "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "hidden_act": "silu",
}
_REAL_PRESETS = {"mixtral-8x7b": _MIXTRAL_8X7B, "qwen3-30b-a3b": _QWEN3_30B_A3B, "deepseek-v3": _DEEPSEEK_V3}
PRESETS = ("tiny", *_REAL_PRESETS)


def preset_hf_config(name: str, layer: int = 0, *, num_layers: int = 2) -> dict:
    """The HF-style config dict behind preset `name` (for tiny: of layer `layer`)."""
    if name == "tiny":
        return _tiny_config(num_layers, layer)
    if name not in _REAL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    return dict(_REAL_PRESETS[name])


def load_preset(name: str = DEFAULT_PRESET, *, num_layers: int | None = None,
                layers: Sequence[int] | str | None = None, dtype="bfloat16", seed: int = 0
                ) -> list[LoadedLayer]:
    """The MoE layers of preset `name` with seeded random weights (generated lazily).

    Args:
      name: one of PRESETS.
      num_layers: tiny: how many layers (default 2); real presets: the first n MoE layers of the
        model (default all). DeepSeek-V3's first is layer 3.
      layers: instead of num_layers, exactly these MoE layer indices (list or "1,3-5").
      dtype: dtype of the expert weights ("bfloat16", "float32", ...); router tensors are fp32.
      seed: weights are a pure function of (seed, layer index, tensor name).
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets are {', '.join(PRESETS)}")
    dtype = jnp.dtype(dtype)
    if name == "tiny":
        # tiny has as many layers as asked for (default 2); layer i's routing alternates with i.
        if layers is not None:
            wanted = parse_layers(layers) if isinstance(layers, str) else [int(i) for i in layers]
            total = max([2, *(i + 1 for i in wanted)])
        else:
            total = 2 if num_layers is None else max(1, int(num_layers))
        chosen = select_layers(range(total), layers=layers, num_layers=num_layers, what="preset tiny")
        configs = {i: _tiny_config(total, i) for i in chosen}
    else:
        hf = _REAL_PRESETS[name]
        chosen = select_layers(models.moe_layer_indices(hf), layers=layers, num_layers=num_layers,
                               what=f"preset {name}")
        configs = {i: hf for i in chosen}
    out = []
    for index in chosen:
        cfg = models.layer_config(configs[index], index)
        out.append(LoadedLayer(index, cfg, SeededParams(cfg, layer_index=index, seed=seed, dtype=dtype),
                               source=f"preset {name} (seed {seed})"))
    return out
