"""Process-wide settings, applied once by ``expertd serve`` before any JAX work (the server's
in-process users, tests and benchmarks, leave the process as it is).

- the host allocator (``--retain-freed-memory``): must precede JAX's first computation, whose
  thread pools take their own malloc arenas (``expertd.server.host.allocator``);
- JAX's CPU dispatch (``--cpu-sync-dispatch``): must precede JAX's first use of a device, which
  creates the CPU client with it (``configure_cpu_dispatch``);
- the native CPU kernel's build options (``[native_cpu]``): must precede its first build or load.

Importing this module runs no JAX computation.
"""
from __future__ import annotations

import logging
import os

from expertd.kernels import cpu
from expertd.server.config import NativeCpuConfig, ServerConfig
from expertd.server.host import allocator

log = logging.getLogger(__name__)


def prepare_process(config: ServerConfig) -> None:
    """Apply the process-wide settings of ``config`` (see module docstring)."""
    if config.retain_freed_memory:
        allocator.retain_freed_memory(config.ld_preload)
    configure_cpu_dispatch(asynchronous=not config.cpu_sync_dispatch)
    configure_native_cpu(config.native_cpu)


def configure_cpu_dispatch(asynchronous: bool) -> bool:
    """Make JAX's CPU client run computations asynchronously (JAX's default: each on a worker thread
    of XLA's, the caller waiting for its result) or synchronously (on the calling thread, which then
    holds no GIL while it computes). The server fetches every step's result at once, so async
    dispatch buys it no overlap and costs each step a hand-over to the worker thread and back:
    synchronous, a single-token step takes about half the time in-process, but under load the
    main port's idle fast path then takes most steps one row at a time (BENCHMARKS.md, Serving).
    Multi-device computations are asynchronous either way (XLA's rule).

    JAX reads the setting when it creates its CPU client, at its first use of a device: after that
    this changes nothing, logs why and returns False (True: set). Importing JAX is not a use.
    """
    import jax
    from jax._src import xla_bridge

    current = jax.config.values["jax_cpu_enable_async_dispatch"]
    if current != asynchronous and xla_bridge.backends_are_initialized():
        log.warning("JAX's CPU dispatch stays %s: JAX started its devices before expertd could set it",
                    "asynchronous" if current else "synchronous")
        return False
    jax.config.update("jax_cpu_enable_async_dispatch", asynchronous)
    return True


def configure_native_cpu(options: NativeCpuConfig) -> None:
    """Make ``options`` the native CPU kernel's build options in this process (``cpu.configure``),
    before its first build or load: the one place they are applied."""
    cache_dir = os.path.expanduser(options.cache_dir) if options.cache_dir else None
    cpu.configure(cpu.BuildOptions(cache_dir=cache_dir, isa_cap=options.isa, trace=options.trace,
                                   compiler=options.compiler))
