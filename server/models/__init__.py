"""The model registry: which MoE family a Hugging Face config.json is, and what its MoE layers are.

The door (every caller uses these names; `config` is a config.json dict or an `HFConfig`):

  family_of(config) -> Family
      The family module's declaration, found by model_type (top level, then text_config's), then
      by `architectures`. `UnsupportedModel` (a ValueError) names what it is and lists the families.
  moe_layer_indices(config) -> [i, ...]
      The decoder layers holding an MoE block, by the family's transformers rule.
  layer_config(config, index) -> MoEConfig
      Layer `index`'s description (shapes, router, shared experts, activation).
  layer_tensors(config, index) -> (LayerTensors, ...)
      Its tensor names relative to a layer prefix, one entry per layout the family comes in; the
      loader (`expertd.server.models.checkpoint`) picks the prefix (`family.prefixes`) and layout the
      checkpoint holds.
  refusal(config) -> str | None
      Why expertd cannot serve this config yet (the family lacks semantics in expertd's kernels),
      None when it can.
  FAMILIES: every family module's `Family`, served and refused alike.

`ConfigError` (a ValueError) names a config.json key that is missing or has a value expertd cannot
serve. The family modules live in `expertd.server.models.families` (one file each; see
`family.py` for what a module declares). Checkpoint formats: `quant` (dequantisers), `stored`
(memory-mapped safetensors), `dtypes` (the serving dtype `--dtype auto` picks).

The layers served, built on the registry: `presets` (the presets with seeded weights, `LoadedLayer`,
layer selection), `checkpoint` (a Hugging Face checkpoint's plan and its MoE layers loaded),
`checkpoint_layer` (one layer's tensors read and dequantised), `inspect` (`expertd inspect DIR`).
They import JAX; this door and the registry do not.
"""
from __future__ import annotations

from collections.abc import Mapping

from expertd.kernels.config import MoEConfig
from expertd.server.models.config import ConfigError, HFConfig
from expertd.server.models.families import FAMILIES
from expertd.server.models.family import Family, LayerTensors

__all__ = ["FAMILIES", "ConfigError", "Family", "HFConfig", "LayerTensors", "UnsupportedModel", "family_of",
           "layer_config", "layer_tensors", "moe_layer_indices", "reader", "refusal", "served_families"]

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}


class UnsupportedModel(ConfigError):
    """config.json is of a model expertd does not know."""


def reader(config: Mapping | HFConfig) -> HFConfig:
    """`config` as an HFConfig (config.json dicts are wrapped)."""
    return config if isinstance(config, HFConfig) else HFConfig(config)


def family_of(config: Mapping | HFConfig) -> Family:
    """The Family of `config` (see the module docstring); UnsupportedModel if none."""
    c = reader(config)
    for model_type in (c.model_type, c.text_model_type):
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
    for arch in c.architectures:
        if arch in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[arch]
    served = ", ".join(t for f in served_families() for t in f.model_types)
    raise UnsupportedModel(
        f"unsupported model: {c.describe()}, architectures {c.architectures or None}; expertd serves the MoE "
        f"layers of model_type {served} (docs/models.md lists the families and what is not supported yet)")


def served_families() -> tuple[Family, ...]:
    """The families expertd serves (some of their configs may still be refused, see `refusal`)."""
    return tuple(f for f in FAMILIES if f.served)


def moe_layer_indices(config: Mapping | HFConfig) -> list[int]:
    """The MoE decoder layers of `config` (see the module docstring)."""
    c = reader(config)
    return family_of(c).moe_layers(c)


def layer_config(config: Mapping | HFConfig, index: int) -> MoEConfig:
    """The MoEConfig of decoder layer `index` (see the module docstring)."""
    c = reader(config)
    return family_of(c).layer_config(c, index)


def layer_tensors(config: Mapping | HFConfig, index: int) -> tuple[LayerTensors, ...]:
    """The candidate tensor layouts of decoder layer `index` (see the module docstring)."""
    c = reader(config)
    return tuple(family_of(c).tensors(c, index))


def refusal(config: Mapping | HFConfig) -> str | None:
    """Why `config` cannot be served yet (None: it can); UnsupportedModel for an unknown model."""
    c = reader(config)
    return family_of(c).missing(c)
