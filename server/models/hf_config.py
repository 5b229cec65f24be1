"""`moe_config_from_hf(config)`: a config.json dict -> the `MoEConfig` of its MoE layers.

Kept for the callers that build a layer description from a config dict alone (benchmarks, tests):
it is the registry's `layer_config` (`expertd.server.models`) of layer `index` (default 0, which is
what every family but per-layer-list Hunyuan configs give for all their MoE layers). Errors are
the registry's: `ConfigError` / `UnsupportedModel` (ValueErrors) naming the key or model_type.
"""
from __future__ import annotations

from collections.abc import Mapping

from expertd.kernels.config import MoEConfig
from expertd.server import models


def moe_config_from_hf(config: Mapping, index: int = 0) -> MoEConfig:
    """The MoEConfig of decoder layer `index` of a Hugging Face config.json dict (any served family)."""
    return models.layer_config(config, index)
