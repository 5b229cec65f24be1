"""expertd serve's configuration (the door: every name below).

Frozen dataclasses, one module per section (``model``, ``batching``, ``security``, ``multihost``,
``native_cpu``; ``server`` holds the top level and the section table), declared with ``fields``;
parsed once at the entry point from flags, an optional TOML file and the environment
(``sources``, the only module of the server that reads any of them); the security files they name
read and checked once (``credentials``: fail closed). Imports: the kernels' names
(``expertd.kernels.names``, JAX-free); nothing else of the server or the kernels.
"""
from expertd.kernels.names import EXPERT_BACKENDS, EXPERT_WEIGHTS, NATIVE_CPU_ISA_LEVELS
from expertd.server.config.batching import BatchingConfig
from expertd.server.config.fields import (
    AUTH_TOKEN_ENV,
    DEFAULT_COORDINATOR_PORT,
    DTYPES,
)
from expertd.server.config.model import ModelConfig
from expertd.server.config.multihost import MultihostConfig
from expertd.server.config.native_cpu import NativeCpuConfig
from expertd.server.config.security import SecurityConfig
from expertd.server.config.server import SECTIONS, ServerConfig, flag, options
from expertd.server.config.sources import add_arguments, build, command_line, from_args, multihost_from, parse_args

__all__ = [
    "AUTH_TOKEN_ENV", "DEFAULT_COORDINATOR_PORT", "DTYPES", "EXPERT_BACKENDS", "EXPERT_WEIGHTS",
    "NATIVE_CPU_ISA_LEVELS", "SECTIONS",
    "BatchingConfig", "ModelConfig", "MultihostConfig", "NativeCpuConfig", "SecurityConfig", "ServerConfig",
    "add_arguments", "build", "command_line", "flag", "from_args", "multihost_from", "options", "parse_args",
]
