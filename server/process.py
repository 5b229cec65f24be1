"""Process-wide settings, applied once by ``expertd serve`` before any JAX work (the server's
in-process users, tests and benchmarks, leave the process as it is).

- the host allocator (``--retain-freed-memory``): must precede JAX's first computation, whose
  thread pools take their own malloc arenas (``expertd.server.host_allocator``);
- the native CPU kernel's build options (``[native_cpu]``): must precede its first build or load.

This module imports nothing that starts JAX.
"""
from __future__ import annotations

import os

from expertd.server import host_allocator
from expertd.server.config import NativeCpuConfig, ServerConfig


def prepare_process(config: ServerConfig) -> None:
    """Apply the process-wide settings of ``config`` (see module docstring)."""
    if config.retain_freed_memory:
        host_allocator.retain_freed_memory(config.ld_preload)
    configure_native_cpu(config.native_cpu)


def configure_native_cpu(options: NativeCpuConfig) -> None:
    """Make ``options`` the native CPU kernel's build options in this process, before its first use.

    The one place they are applied. The kernels read them from these variables when they first build
    or load their library; the config has already folded the variables' own values in (flags and
    TOML win over them), so they are set to the config's values or removed.
    """
    # until kernels.cpu.configure lands: then this is
    # cpu.configure(BuildOptions(cache_dir=options.cache_dir, isa_cap=options.isa, trace=options.trace,
    #                            compiler=options.compiler))
    values = {"EXPERTD_NATIVE_CPU_ISA": options.isa, "EXPERTD_NATIVE_CPU_PORTABLE": None,
              "EXPERTD_CACHE_DIR": options.cache_dir, "EXPERTD_TRACE_PARALLEL_FOR": "1" if options.trace else None,
              "CXX": options.compiler}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
