"""vLLM's default loader, for a model whose MoE layers expertd computes: the start-up check first,
then the checkpoint without the routed experts' tensors.

``DefaultModelLoader.load_weights(model, model_config)`` is wrapped: when ``model`` has expertd
layers (``ExpertdMoERunner`` with a session), their session checks the server's layers
(GetModelInfo) before any tensor is read, and while the checkpoint is read every tensor under an
expertd layer's module path (``model.layers.3.mlp.experts.*``, after the model's
``hf_to_vllm_mapper``) is skipped: the safetensors reader does not read it (its expert-parallel
filter ``should_skip_weight`` is consulted first) and, for the other readers, the weights
iterator drops it before the model's ``load_weights`` sees it. Router gates and shared experts
load as usual. Models without expertd layers load exactly as before.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable

from vllm.model_executor.model_loader import default_loader, weight_utils

from expertd.client.vllm.layers import ExpertdMoERunner

_SKIP: contextvars.ContextVar[Callable[[str], bool] | None] = contextvars.ContextVar("expertd_skip", default=None)
_INSTALLED = False


def routed_expert_filter(model) -> Callable[[str], bool] | None:
    """``skip(checkpoint_name) -> bool`` for ``model``'s expertd layers, or None when it has none."""
    runners = [module for module in model.modules()
               if isinstance(module, ExpertdMoERunner) and module.expertd_session is not None]
    if not runners:
        return None
    prefixes = tuple(f"{runner.layer_name}." for runner in runners)
    mapper = getattr(model, "hf_to_vllm_mapper", None)

    def skip(name: str) -> bool:
        mapped = mapper._map_name(name) if mapper is not None else name
        return mapped is not None and mapped.startswith(prefixes)

    return skip


def install() -> None:
    """Wrap the default loader and its safetensors filter (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    loader_class = default_loader.DefaultModelLoader
    load_weights, get_all_weights = loader_class.load_weights, loader_class.get_all_weights
    should_skip_weight = weight_utils.should_skip_weight

    def expertd_load_weights(self, model, model_config):
        skip = routed_expert_filter(model)
        if skip is None:
            return load_weights(self, model, model_config)
        for session in {id(r.expertd_session): r.expertd_session for r in model.modules()
                        if isinstance(r, ExpertdMoERunner) and r.expertd_session is not None}.values():
            session.check()
        token = _SKIP.set(skip)
        try:
            return load_weights(self, model, model_config)
        finally:
            _SKIP.reset(token)

    def expertd_get_all_weights(self, model_config, model):
        skip = _SKIP.get()
        for name, tensor in get_all_weights(self, model_config, model):
            if skip is None or not skip(name):
                yield name, tensor

    def expertd_should_skip_weight(weight_name, local_expert_ids):
        skip = _SKIP.get()
        return (skip is not None and skip(weight_name)) or should_skip_weight(weight_name, local_expert_ids)

    expertd_load_weights.__wrapped__ = load_weights
    loader_class.load_weights = expertd_load_weights
    loader_class.get_all_weights = expertd_get_all_weights
    weight_utils.should_skip_weight = expertd_should_skip_weight
    _INSTALLED = True
