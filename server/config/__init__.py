"""expertd serve's configuration: frozen dataclasses (``sections``), parsed once at the entry
point from flags, an optional TOML file and the environment (``sources``, the only module of the
server that reads any of them); the security files they name read and checked once
(``credentials``: fail closed)."""
from expertd.server.config.sections import (
    AUTH_TOKEN_ENV,
    DEFAULT_COORDINATOR_PORT,
    DTYPES,
    EXPERT_BACKENDS,
    NATIVE_CPU_ISA_LEVELS,
    SECTIONS,
    BatchingConfig,
    ModelConfig,
    MultihostConfig,
    NativeCpuConfig,
    SecurityConfig,
    ServerConfig,
    flag,
    options,
)
from expertd.server.config.sources import add_arguments, build, command_line, from_args, multihost_from, parse_args

__all__ = [
    "AUTH_TOKEN_ENV", "DEFAULT_COORDINATOR_PORT", "DTYPES", "EXPERT_BACKENDS", "NATIVE_CPU_ISA_LEVELS", "SECTIONS",
    "BatchingConfig", "ModelConfig", "MultihostConfig", "NativeCpuConfig", "SecurityConfig", "ServerConfig",
    "add_arguments", "build", "command_line", "flag", "from_args", "multihost_from", "options", "parse_args",
]
