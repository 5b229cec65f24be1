"""Keep freed host buffers in the process for reuse, so XLA:CPU's large buffers stop page-faulting
on every call (glibc malloc only).

Why: XLA:CPU allocates each execution's temporaries and outputs with malloc. glibc serves a block
above its mmap threshold (32 MiB at most) with a fresh mmap and gives it back with munmap when it is
freed, and a thread's own arena holds no block over 64 MiB, so every call of a large layer has the
kernel fault its big buffers in again, 4 KiB at a time, zero-filled: a T=4096 layer takes tens of
thousands of page faults per call (what that costs: BENCHMARKS.md, Host allocator).

`retain_freed_memory()` sets glibc's malloc to one arena (M_ARENA_MAX=1), no mmap'd blocks
(M_MMAP_MAX=0) and no trimming of the heap's top (M_TRIM_THRESHOLD at its int maximum, 2 GiB): every
block then comes from the one heap, and a freed block is handed to the next call as it is, already
faulted in. The process's resident memory stays at its high-water mark instead of shrinking between
calls, as with a caching allocator (PyTorch's; vLLM's CPU backend preloads tcmalloc for this).

It must run before any thread other than the main one has allocated, i.e. before JAX's first
computation (which starts its thread pools): a thread keeps the arena it first got, and a second
arena cannot hold the large blocks. It checks that (glibc's malloc_info lists the arenas) and
otherwise changes nothing and says why; likewise off Linux/glibc or with another malloc preloaded.
`expertd serve --retain-freed-memory` (multi-host processes included) calls it first thing
(`expertd.server.engine.build.prepare_process`), and the MoE benchmarks do. It is off by default: the one
arena is shared by gRPC, Python and XLA threads, and small requests pay for that in latency and CPU
(BENCHMARKS.md, Host allocator), so it pays only where buckets of 1024 tokens or more dominate. `state()` is
what this process did.
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
import sys

# glibc <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
SETTINGS = {"M_ARENA_MAX": (M_ARENA_MAX, 1), "M_MMAP_MAX": (M_MMAP_MAX, 0),
            "M_TRIM_THRESHOLD": (M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX)}
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")


@dataclasses.dataclass(frozen=True)
class AllocatorState:
    """`applied`: the settings in SETTINGS are in force; else `reason` says why not."""
    applied: bool = False
    reason: str | None = "off; `expertd serve --retain-freed-memory` or retain_freed_memory() turns it on"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


_state = AllocatorState()


def state() -> AllocatorState:
    """What `retain_freed_memory` did in this process (off, applied, or why not)."""
    return _state


def note(state_dict: dict | None) -> str | None:
    """The start-up line about host malloc (``state().as_dict()``); None off CPU (no state given)."""
    return None if state_dict is None else "host memory: " + summary(state_dict)


def summary(state_dict: dict) -> str:
    """One line for logs and `expertd serve`."""
    if state_dict["applied"]:
        return "freed buffers kept for reuse (glibc malloc: one arena, no mmap'd blocks, no trimming)"
    return f"large freed buffers go back to the system ({state_dict['reason']})"


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_info") else None


def malloc_arenas(libc: ctypes.CDLL) -> int:
    """How many malloc arenas glibc has made so far (1: only the main thread's), from malloc_info's XML."""
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    libc.open_memstream.restype = ctypes.c_void_p
    stream = ctypes.c_void_p(libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size)))
    if not stream:
        raise OSError("open_memstream failed")
    try:
        libc.malloc_info(0, stream)
    finally:
        libc.fclose(stream)
    try:
        return len(re.findall(rb'<heap nr="\d+">', ctypes.string_at(buffer, size.value)))
    finally:
        libc.free(buffer)


def _why_not(libc: ctypes.CDLL | None, preload: str) -> str | None:
    if any(name in preload for name in OTHER_ALLOCATORS):
        return f"another malloc is preloaded (LD_PRELOAD={preload})"
    if libc is None:
        return "not glibc on Linux"
    arenas = malloc_arenas(libc)
    if arenas > 1:
        return (f"other threads already allocate from their own malloc arenas ({arenas}); call "
                "retain_freed_memory() before JAX's first computation")
    return None


def retain_freed_memory(ld_preload: str = "") -> AllocatorState:
    """Apply SETTINGS if this process can still take them (see the module docstring); idempotent.

    ``ld_preload``: the process's LD_PRELOAD (the config reads it); another malloc there is left alone.
    """
    global _state
    if _state.applied:
        return _state
    libc = _glibc()
    reason = _why_not(libc, ld_preload)
    if reason is None:
        failed = [name for name, (param, value) in SETTINGS.items() if libc.mallopt(param, value) != 1]
        reason = f"mallopt refused {', '.join(failed)}" if failed else None
    _state = AllocatorState(applied=reason is None, reason=reason)
    return _state
