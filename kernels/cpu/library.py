"""What the loaded native CPU library reports, and the run-time controls it takes.

  isa() -> the instruction-set level the kernels run at now (ISA_LEVELS; None without the library):
      "portable" scalar loops (CPUs without AVX2 / FMA), "avx2" (AVX2 + FMA), "avx512" (panel-major
      weights streamed 16 columns of a panel row per zmm), "avx512_bf16" (also bf16-valued rows
      times bf16 weights on the bf16 dot product, with the FMA paths' results: csrc/simd.h
      Bf16DotIsFma). The highest level the CPU runs, capped by `BuildOptions.isa_cap` and
      `limit_isa`.
  supported_isas() -> the levels this CPU runs under the isa_cap, lowest first.
  limit_isa(level) -> a `with` block running the kernels at most at `level` (the tests check
      that every level computes the same bits; the benchmarks A/B them in one process).
  path_items() -> work items each path of the grouped matmul (PATHS) ran since the library loaded.
  caller_only_work(work) -> a `with` block in which the kernels' ParallelFor calls of at most
      `work` multiply-adds run on the calling thread alone (csrc/parallel.h's rule, whose bound
      `caller_only_work_now()` reads; the benchmarks A/B the rule in one process).
  parallel_for_trace() -> the ParallelFor records of a trace build (BuildOptions(trace=True)).
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from expertd.kernels.cpu.build import ISA_LEVELS, load, require_library

PATHS = ("portable", "avx2_stream", "avx2_packed", "avx512_fma", "avx512_bf16_dot")
TRACE_FIELDS = ("start", "caller_done", "helper_start", "helper_done", "returned", "tasks", "caller_tasks", "helpers")
TRACE_CAPACITY = 1 << 16  # records the library keeps between two readings (csrc/parallel.h)

_isa_limit = ISA_LEVELS[-1]  # the library's run-time limit, as limit_isa last set it


def isa() -> str | None:
    """The instruction-set level the kernels run at now, one of ISA_LEVELS (None when the library
    is unavailable; see the module docstring)."""
    lib = load()[0]
    return None if lib is None else ISA_LEVELS[lib.expertd_native_cpu_isa()]


def supported_isas() -> tuple[str, ...]:
    """The levels this CPU runs under `BuildOptions.isa_cap`, lowest first; () without the library."""
    lib = load()[0]
    return () if lib is None else ISA_LEVELS[:lib.expertd_native_cpu_detected_isa() + 1]


def vectorized() -> bool:
    """Whether the kernels run a vector path (AVX2 and up), not the portable scalar loops."""
    return isa() not in (None, "portable")


@contextlib.contextmanager
def limit_isa(level: str):
    """Run the kernels at most at `level` (one of ISA_LEVELS) inside the `with` block. Calls
    already running are not affected; not meant for use while other threads run the kernels."""
    global _isa_limit
    if level not in ISA_LEVELS:
        raise ValueError(f"level must be one of {ISA_LEVELS}, got {level!r}")
    lib, before = require_library(), _isa_limit
    lib.expertd_native_cpu_limit_isa(ISA_LEVELS.index(level))
    _isa_limit = level
    try:
        yield
    finally:
        lib.expertd_native_cpu_limit_isa(ISA_LEVELS.index(before))
        _isa_limit = before


def caller_only_work_now() -> int | None:
    """The bound of csrc/parallel.h's rule now: ParallelFor calls of at most this many
    multiply-adds wake no helper thread (None without the library)."""
    lib = load()[0]
    return None if lib is None else int(lib.expertd_caller_only_work())


@contextlib.contextmanager
def caller_only_work(work: int):
    """Inside the `with` block, ParallelFor calls of at most `work` multiply-adds run on the calling
    thread alone (0: every call of two or more tasks is shared with the pool). Calls already
    running are not affected; not meant for use while other threads run the kernels."""
    if work < 0:
        raise ValueError(f"work must be >= 0 multiply-adds, got {work}")
    lib = require_library()
    before = lib.expertd_caller_only_work()
    lib.expertd_set_caller_only_work(work)
    try:
        yield
    finally:
        lib.expertd_set_caller_only_work(before)


def path_items() -> dict[str, int]:
    """Work items (an expert's block of output columns in one call) the grouped matmul ran on each
    of its PATHS since the library loaded: which path a workload takes (the tests and benchmarks
    diff two readings). Empty without the library."""
    lib = load()[0]
    if lib is None:
        return {}
    return {name: int(lib.expertd_native_cpu_path_items(i)) for i, name in enumerate(PATHS)}


def parallel_for_trace() -> np.ndarray | None:
    """The ParallelFor calls recorded since the last reading, then cleared: int64 `[n, 8]`, columns
    TRACE_FIELDS in steady-clock ns and task counts, oldest first: helper_start is when the first
    helper started (0: none by the time the call returned), helper_done when the last helper that
    ran a task finished (0: none did), helpers the helper tasks scheduled (0: the caller ran the
    call alone). None unless the library is the trace build."""
    lib = require_library()
    out = np.zeros((TRACE_CAPACITY, len(TRACE_FIELDS)), np.int64)
    n = lib.expertd_parallel_for_trace(out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), out.size)
    return None if n < 0 else out[:n].copy()
