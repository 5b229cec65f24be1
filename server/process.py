"""Process-wide settings, applied once by ``expertd serve`` before any JAX work (the server's
in-process users, tests and benchmarks, leave the process as it is).

- the host allocator (``--retain-freed-memory``): must precede JAX's first computation, whose
  thread pools take their own malloc arenas (``expertd.server.host_allocator``);
- the native CPU kernel's build options (``[native_cpu]``): must precede its first build or load.

Importing this module runs no JAX computation.
"""
from __future__ import annotations

import os

from expertd.kernels import cpu
from expertd.server import host_allocator
from expertd.server.config import NativeCpuConfig, ServerConfig


def prepare_process(config: ServerConfig) -> None:
    """Apply the process-wide settings of ``config`` (see module docstring)."""
    if config.retain_freed_memory:
        host_allocator.retain_freed_memory(config.ld_preload)
    configure_native_cpu(config.native_cpu)


def configure_native_cpu(options: NativeCpuConfig) -> None:
    """Make ``options`` the native CPU kernel's build options in this process (``cpu.configure``),
    before its first build or load: the one place they are applied."""
    cache_dir = os.path.expanduser(options.cache_dir) if options.cache_dir else None
    cpu.configure(cpu.BuildOptions(cache_dir=cache_dir, isa_cap=options.isa, trace=options.trace,
                                   compiler=options.compiler))
