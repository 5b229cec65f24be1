"""Diagnostics and benchmark knobs of the native CPU library: for tests and benchmarks, not serving.

Nothing in the serving path uses these; they look inside the loaded library (which path ran, when
ParallelFor's helpers woke, what the compiler said) or move one of its rules for a `with` block, so
that a test can check a rule and a benchmark can A/B it in one process. The door for the rest of
expertd is `expertd.kernels.cpu`.

  path_items() -> work items each path of the grouped matmul (PATHS) ran since the library loaded.
  parallel_for_trace() -> the ParallelFor records of a trace build (BuildOptions(trace=True)),
      columns TRACE_FIELDS.
  caller_only_work(work) -> a `with` block in which the kernels' ParallelFor calls of at most
      `work` multiply-adds run on the calling thread alone (csrc/parallel.h's rule, whose bound
      `caller_only_work_now()` reads).
  limit_isa(level) -> a `with` block running the kernels at most at `level` (the tests check that
      every level computes the same bits; the benchmarks A/B them); supported_isas() -> the levels
      this CPU runs under the isa_cap, lowest first; vectorized() -> whether a vector path runs.
  emulate_amx(order) -> a `with` block running the AMX path on the tiles' software model (adding a
      pair's products "high_first", in k order, or "low_first") at every level from AVX2, on any
      CPU: how the tests run the tile kernel where there is no AMX; amx_faults() -> operations the
      model refused as the hardware would; emulated_amx_order() -> the AMX probe run on the model.
  build_log() -> the compiler's messages of the build this process ran ("" when clean);
      options() -> the BuildOptions in force.
"""
from __future__ import annotations

import contextlib
import ctypes

import numpy as np

from expertd.kernels.cpu.build import build_log, load, options, require_library
from expertd.kernels.cpu.library import AMX_ORDERS, limit_isa, supported_isas, vectorized

# csrc/grouped_matmul_paths.h
PATHS = ("portable", "avx2_stream", "avx2_packed", "avx512_fma", "avx512_bf16_dot", "amx_bf16")
TRACE_FIELDS = ("start", "caller_done", "helper_start", "helper_done", "returned", "tasks", "caller_tasks", "helpers")
TRACE_CAPACITY = 1 << 16  # records the library keeps between two readings (csrc/parallel.h)

__all__ = ["PATHS", "TRACE_FIELDS", "amx_faults", "build_log", "caller_only_work", "caller_only_work_now",
           "emulate_amx", "emulated_amx_order", "limit_isa", "options", "parallel_for_trace", "path_items",
           "supported_isas", "vectorized"]


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


@contextlib.contextmanager
def emulate_amx(order: str = "high_first"):
    """Inside the `with` block the grouped matmul's AMX path (bf16 panels times bf16-valued rows, 16
    or more rows per expert) runs on the tiles' software model, adding a pair's products in `order`
    ("high_first": k order, the other paths' bits; "low_first"), at every level from AVX2. Not
    meant for use while other threads run the kernels."""
    if order not in AMX_ORDERS[1:3]:
        raise ValueError(f"order must be one of {AMX_ORDERS[1:3]}, got {order!r}")
    lib = require_library()
    lib.expertd_native_cpu_emulate_amx(AMX_ORDERS.index(order))
    try:
        yield
    finally:
        lib.expertd_native_cpu_emulate_amx(0)


def amx_faults() -> int:
    """Tile operations the software model refused since the library loaded, as the hardware would
    have (a configuration or operand shape it does not take); 0 when the kernel is right."""
    return int(require_library().expertd_native_cpu_amx_faults())


def emulated_amx_order() -> str:
    """The AMX probe (csrc/amx_tiles.h DotOrder) run on the software model in the order
    `emulate_amx` set: what the probe reports on hardware that adds that way."""
    return AMX_ORDERS[require_library().expertd_native_cpu_emulated_amx_order()]
