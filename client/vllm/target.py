"""Where a vLLM engine's MoE layers go: ``EXPERTD_VLLM_TARGET`` or ``--additional-config
'{"expertd": {"target": ..., "timeout": ...}}'``. Standard library only (the plugin's entry point
reads it before anything of vLLM or torch is imported)."""
from __future__ import annotations

import dataclasses
import os

ENV_TARGET = "EXPERTD_VLLM_TARGET"
ENV_TIMEOUT = "EXPERTD_VLLM_TIMEOUT"
DEFAULT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Target:
    """An expert server and the deadline of each call to it."""

    address: str       # "host:port", "host1:port,host2:port", "dns:///name:port" or "shm://NAME" (ExpertClient's)
    timeout_s: float   # per call (GetModelInfo at start, each layer's Forward)
    source: str        # where it was set, for messages: "EXPERTD_VLLM_TARGET" or "additional_config expertd.target"


def env_target() -> str | None:
    """``EXPERTD_VLLM_TARGET`` when set and not blank."""
    value = os.environ.get(ENV_TARGET, "").strip()
    return value or None


def configured_target(additional_config=None) -> Target | None:
    """The engine's target from its ``additional_config`` (a dict, or vLLM's object) and the
    environment; None when neither sets one (then vLLM runs its MoE layers itself).

    ValueError names the field when a value is malformed, or when both set different targets.
    """
    section = additional_config.get("expertd") if isinstance(additional_config, dict) else None
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"additional_config expertd must be an object such as {{\"target\": \"host:port\"}}, "
                         f"got {section!r}")
    section = section or {}
    unknown = sorted(set(section) - {"target", "timeout"})
    if unknown:
        raise ValueError(f"additional_config expertd has unknown keys {unknown} (known: target, timeout)")
    from_config = section.get("target")
    if from_config is not None and (not isinstance(from_config, str) or not from_config.strip()):
        raise ValueError(f"additional_config expertd.target must be a non-empty string, got {from_config!r}")
    from_env = env_target()
    if from_config and from_env and from_config.strip() != from_env:
        raise ValueError(f"{ENV_TARGET}={from_env!r} and additional_config expertd.target={from_config!r} "
                         "name different expert servers: set one")
    address = (from_config or "").strip() or from_env
    if address is None:
        return None
    timeout = section.get("timeout", os.environ.get(ENV_TIMEOUT, DEFAULT_TIMEOUT_S))
    try:
        timeout = float(timeout)
    except (TypeError, ValueError):
        timeout = -1.0
    if not timeout > 0:
        raise ValueError(f"expertd timeout (additional_config expertd.timeout or {ENV_TIMEOUT}) must be a "
                         f"positive number of seconds, got {section.get('timeout', os.environ.get(ENV_TIMEOUT))!r}")
    source = "additional_config expertd.target" if from_config else ENV_TARGET
    return Target(address, timeout, source)
