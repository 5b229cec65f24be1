"""The instruction-set level the loaded native CPU library runs at, and its run-time limit.

  isa() -> the instruction-set level the kernels run at now (ISA_LEVELS; None without the library):
      "portable" scalar loops (CPUs without AVX2 / FMA), "avx2" (AVX2 + FMA), "avx512" (panel-major
      weights streamed 16 columns of a panel row per zmm), "avx512_bf16" (also bf16-valued rows
      times bf16 weights on the bf16 dot product, with the FMA paths' results: csrc/simd.h
      Bf16DotIsFma), "amx_bf16" (also AMX tiles for experts of 16 rows or more, where they round
      as the FMAs do: csrc/amx_tiles.h). The highest level the CPU runs, capped by `BuildOptions.isa_cap` and
      `limit_isa`.
  supported_isas() -> the levels this CPU runs under the isa_cap, lowest first; vectorized() ->
      whether the kernels run a vector path (AVX2 and up).
  limit_isa(level) -> a `with` block running the kernels at most at `level` (the tests check
      that every level computes the same bits; the benchmarks A/B them in one process).
  amx() -> what the AMX probe found on this CPU (AMX_ORDERS): "none" (no AMX-BF16, or the OS
      refused the tile state), "high_first" (TDPBF16PS adds a pair's products in k order: the
      kernels run "amx_bf16"), "low_first" or "other" (it rounds unlike the other paths: the
      kernels keep "avx512_bf16" and say so at start-up).
Only isa() is behind the package's door; the others, with the per-path counters, the ParallelFor
trace and the sharing rule's knob, are in `diagnostics` (for tests and benchmarks).
"""
from __future__ import annotations

import contextlib

from expertd.kernels.cpu.build import ISA_LEVELS, load, require_library

AMX_ORDERS = ("none", "high_first", "low_first", "other")  # csrc/amx_tiles.h AmxOrder
_isa_limit = ISA_LEVELS[-1]  # the library's run-time limit, as limit_isa last set it


def isa() -> str | None:
    """The instruction-set level the kernels run at now, one of ISA_LEVELS (None when the library
    is unavailable; see the module docstring)."""
    lib = load()[0]
    return None if lib is None else ISA_LEVELS[lib.expertd_native_cpu_isa()]


def amx() -> str | None:
    """What the AMX probe found on this CPU, one of AMX_ORDERS (None without the library; see the
    module docstring)."""
    lib = load()[0]
    return None if lib is None else AMX_ORDERS[lib.expertd_native_cpu_amx_order()]


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
