"""The ``[native_cpu]`` section: how the native CPU expert kernel is built and run."""
from __future__ import annotations

import dataclasses

from expertd.kernels.names import NATIVE_CPU_ISA_LEVELS
from expertd.server.config.fields import (
    option,
    optional_str,
)


@dataclasses.dataclass(frozen=True)
class NativeCpuConfig:
    """How the native CPU expert kernel is built and run (flags ``--native-cpu-*``, TOML
    ``[native_cpu]``); the kernel's former environment variables fill what no flag or key sets."""

    isa: str | None = option(None, f"cap the native kernel's instruction set: {', '.join(NATIVE_CPU_ISA_LEVELS)} "
                             "(default: the best this CPU runs; $EXPERTD_NATIVE_CPU_ISA, or "
                             "$EXPERTD_NATIVE_CPU_PORTABLE for portable)", parse=optional_str, metavar="LEVEL",
                             env="EXPERTD_NATIVE_CPU_ISA", env_set=("EXPERTD_NATIVE_CPU_PORTABLE", "portable"))
    cache_dir: str | None = option(None, "where the built kernel library is kept (default: $EXPERTD_CACHE_DIR, "
                                   "else ~/.cache/expertd)", parse=optional_str, metavar="DIR", env="EXPERTD_CACHE_DIR")
    trace: bool = option(False, "build the kernel library that records every parallel-for call's timing "
                                "($EXPERTD_TRACE_PARALLEL_FOR=1)", env="EXPERTD_TRACE_PARALLEL_FOR")
    compiler: str | None = option(None, "C++ compiler that builds the kernel (default: $CXX, else c++, g++ or "
                                  "clang++)", parse=optional_str, metavar="CXX", env="CXX")

    def __post_init__(self):
        if self.isa is not None and self.isa not in NATIVE_CPU_ISA_LEVELS:
            raise ValueError(f"--native-cpu-isa must be one of {', '.join(NATIVE_CPU_ISA_LEVELS)}, got {self.isa!r}")
