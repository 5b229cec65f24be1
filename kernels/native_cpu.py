"""A C++ grouped matmul for XLA:CPU (kernels/native/grouped_matmul_cpu.cc), built on first use.

`grouped_matmul(x, group_sizes, w)`: `x f32 [N, K]` (expert-major rows), `group_sizes int [E]`,
`w bf16|f32 [E, K, C]` -> `f32 [N, C]`, each row times its expert's matrix; rows past
sum(group_sizes) are 0. Every path sums k in order with one rounding per product-add, so a row's
result is the same bits whatever the path, the layout, the instruction set or the other rows in
the call (how many share its expert). `grouped_matmul_reference` is its plain-jnp twin.
`grouped_matmul(x, gs, w, source=rows)` reads output row r from `x[rows[r]]` (token rows, no
permuted copy of x).

`w` may be a `panels.PanelWeights` (the weights panel-major, made once at load, as the engine serves
them on CPU; bf16 in pair rows; 64-column panels on AVX-512 CPUs, 16 elsewhere), each panel one
contiguous stream. The paths (`PATHS`; `path_items()` counts the work items each ran):
- AVX-512 CPUs, panel-major weights ("avx512_fma", native/panel_stream_avx512.h): one zmm per 16
  columns of a panel row; up to 6 rows per expert x 4 such strips keep their sums in registers over
  all of K, more go in 6-row blocks plus one of the rest, each streaming 4 strips over all of K.
  bf16 panels times bf16-valued rows (the layer's: x and h are rounded to the weights' dtype) on
  CPUs with AVX512_BF16 run the bf16 dot product ("avx512_bf16_dot"): 32 multiply-adds per
  instruction, rounding as the FMAs do (checked on the CPU at load).
- Otherwise (row-major weights, AVX2 CPUs): under 32 rows per expert the weights are read once, in
  place, bf16 widened in registers ("avx2_stream"; XLA:CPU copies and widens each expert's slice
  first); more rows run a BLIS-style packed GEMM ("avx2_packed": fp32 weight panels, a 6 x 16
  register micro-kernel).
- CPUs without AVX2 / FMA: portable scalar loops ("portable").
`isa()` says which level runs (`ISA_LEVELS`), `limit_isa(level)` caps it for a `with` block and
EXPERTD_NATIVE_CPU_ISA=<level> for a process. The layer runs faster on it than on any XLA:CPU
backend at every benchmarked batch size (BENCHMARKS.md).

The dispatch passes of the CPU layer (native/dispatch_cpu.cc), with the contracts of their jnp
twins in dispatch.py, which the tests compare them with:
  layout(topk_ids [T, k], E, *, align_size=0, valid=None) -> dispatch.Permutation (counting sort)
  combine(rows f32|bf16 [N, H], perm, topk_weights=None) -> f32 [T, H]  (= dispatch.unpermute
      with out_dtype float32; each routed row read once)

The shared library (SOURCES, one .so) is compiled with the system C++ compiler (`$CXX`, else
c++ / g++ / clang++) against the XLA FFI headers jaxlib ships, into `$EXPERTD_CACHE_DIR` (default
`~/.cache/expertd`), keyed by a hash of the sources and headers, jaxlib's version and the flags;
later processes load it from there (`python -m expertd.kernels.native_cpu` builds it ahead of
time, e.g. in an image). Where there is no compiler or the build fails, `available()` is False
with the reason in `unavailable_reason()`, and `experts.choose_backend` keeps to XLA's paths. The
custom calls exist for the CPU platform only, on x86-64 (AVX-512 and AVX2 + FMA paths, portable
scalar loops for older x86 CPUs).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from expertd.kernels import dispatch, panels
from expertd.kernels.experts import row_experts

log = logging.getLogger(__name__)

NATIVE_DIR = pathlib.Path(__file__).with_name("native")
SOURCE = NATIVE_DIR / "grouped_matmul_cpu.cc"
# One library: the grouped matmul and the dispatch passes (layout, combine), and their headers.
SOURCES = (SOURCE, NATIVE_DIR / "dispatch_cpu.cc")
HEADERS = tuple(sorted(NATIVE_DIR.glob("*.h")))  # every one is in the build key
TARGET = "expertd_grouped_matmul"
# XLA FFI targets registered from the library: name -> exported handler symbol.
TARGETS = {TARGET: "ExpertdGroupedMatmul",
           "expertd_grouped_matmul_gathered": "ExpertdGroupedMatmulGathered",
           "expertd_grouped_matmul_panels": "ExpertdGroupedMatmulPanels",
           "expertd_grouped_matmul_panels_gathered": "ExpertdGroupedMatmulPanelsGathered",
           "expertd_dispatch_layout": "ExpertdDispatchLayout",
           "expertd_combine": "ExpertdCombine"}
# -ffp-contract=off: the combine rounds its products and sums separately, as XLA's does (the matmul
# asks for its FMAs explicitly).
CXXFLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")
# EXPERTD_TRACE_PARALLEL_FOR=1 (set before the first call) builds and loads a library that records
# every ParallelFor call's timing (native/parallel.h; `parallel_for_trace()`,
# benchmarks/parallel_for_trace.py). Its own build key: the plain library stays as it is.
TRACE_ENV = "EXPERTD_TRACE_PARALLEL_FOR"
TRACE_FIELDS = ("start", "caller_done", "helper_start", "helper_done", "returned", "tasks", "caller_tasks")
BUILD_TIMEOUT_S = 300


def cache_dir() -> pathlib.Path:
    env = os.environ.get("EXPERTD_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "expertd"


def cxxflags() -> tuple[str, ...]:
    """CXXFLAGS, plus the trace define where TRACE_ENV is "1"."""
    return CXXFLAGS + ((f"-D{TRACE_ENV}",) if os.environ.get(TRACE_ENV) == "1" else ())


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path() -> pathlib.Path:
    """Where the built library lives: keyed by the source, jaxlib's version (its FFI headers) and
    the flags, not the compiler, so a cache filled at image build time loads without one."""
    key = hashlib.sha256()
    for path in SOURCES + HEADERS:
        key.update(path.read_bytes())
    for part in (jaxlib.__version__.encode(), " ".join(cxxflags()).encode()):
        key.update(part)
    return cache_dir() / f"grouped_matmul_cpu-{key.hexdigest()[:16]}.so"


def _build(cxx: str, target: pathlib.Path, sources: tuple[pathlib.Path, ...] = SOURCES) -> None:
    """Compile `sources` into `target` atomically (concurrent processes may build at once);
    benchmarks/native_cpu_kernel.py builds variants of SOURCE alone with it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *cxxflags(), f"-I{jax.ffi.include_dir()}", f"-I{NATIVE_DIR}", *map(str, sources), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _register(path: pathlib.Path, targets: dict[str, str]) -> ctypes.CDLL:
    """Load a built library and register its handlers with XLA:CPU, `{target name: symbol}`
    (benchmarks/native_cpu_kernel.py registers a variant of the matmul under another name)."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    if hasattr(lib, "expertd_native_cpu_path_items"):  # (benchmark variants of older sources lack it)
        lib.expertd_native_cpu_path_items.restype = ctypes.c_int64
    if hasattr(lib, "expertd_parallel_for_trace"):
        trace = lib.expertd_parallel_for_trace
        trace.restype, trace.argtypes = ctypes.c_int64, (ctypes.POINTER(ctypes.c_int64), ctypes.c_int64)
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


_LOAD_LOCK = threading.Lock()


def _load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") once registered with XLA, else (None, why not). Built at most once per process."""
    with _LOAD_LOCK:
        return _load_once()


@functools.cache
def _load_once() -> tuple[ctypes.CDLL | None, str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is written for x86-64 (AVX2), this machine is {platform.machine()}"
    try:
        path = library_path()
        if not path.exists():
            cxx = _compiler()
            if cxx is None:
                return None, "no C++ compiler found (set CXX)"
            log.info("building %s with %s into %s", SOURCE.name, cxx, path)
            _build(cxx, path)
        lib = _register(path, TARGETS)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("native CPU kernel unavailable: %s", err)
        return None, str(err)
    return lib, ""


def available() -> bool:
    """Whether the kernel is built and registered (building it now if need be)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    return _load()[1]


def vectorized() -> bool:
    """Whether this CPU runs the AVX2/FMA path (else a portable scalar loop: correct, slow; set
    EXPERTD_NATIVE_CPU_PORTABLE=1 before the first call to force it)."""
    return isa() not in (None, "portable")


ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16")


def isa() -> str | None:
    """The instruction-set level the kernels run at now, one of ISA_LEVELS (None when the library is
    unavailable): "avx512" streams panel-major weights 16 columns of a panel row per zmm,
    "avx512_bf16" also multiplies bf16-valued rows by bf16 weights on the bf16 dot product, with the
    FMA paths' results (native/simd.h Bf16DotIsFma). The highest level the CPU runs is used, capped by
    EXPERTD_NATIVE_CPU_ISA=<level> (set before the first call) and by `limit_isa`."""
    lib = _load()[0]
    return None if lib is None else ISA_LEVELS[lib.expertd_native_cpu_isa()]


def supported_isas() -> tuple[str, ...]:
    """The levels this CPU (and EXPERTD_NATIVE_CPU_ISA) allows, lowest first; () without the library."""
    lib = _load()[0]
    return () if lib is None else ISA_LEVELS[:lib.expertd_native_cpu_detected_isa() + 1]


PATHS = ("portable", "avx2_stream", "avx2_packed", "avx512_fma", "avx512_bf16_dot")


def path_items() -> dict[str, int]:
    """Work items (an expert's block of output columns in one call) the grouped matmul ran on each
    of its PATHS since the library loaded: which path a workload takes (the tests and benchmarks
    diff two readings). Empty without the library."""
    lib = _load()[0]
    if lib is None:
        return {}
    return {name: int(lib.expertd_native_cpu_path_items(i)) for i, name in enumerate(PATHS)}


_isa_limit = ISA_LEVELS[-1]  # the library's run-time cap, as limit_isa last set it


@contextlib.contextmanager
def limit_isa(level: str):
    """Run the kernels at most at `level` (one of ISA_LEVELS) inside the `with` block: how the tests
    check that every level computes the same bits, and the benchmarks A/B them in one process. Calls
    already running are not affected; not meant for use while other threads run the kernels."""
    global _isa_limit
    if level not in ISA_LEVELS:
        raise ValueError(f"level must be one of {ISA_LEVELS}, got {level!r}")
    _require_library()
    lib, before = _load()[0], _isa_limit
    lib.expertd_native_cpu_limit_isa(ISA_LEVELS.index(level))
    _isa_limit = level
    try:
        yield
    finally:
        lib.expertd_native_cpu_limit_isa(ISA_LEVELS.index(before))
        _isa_limit = before


def parallel_for_trace() -> np.ndarray | None:
    """The ParallelFor calls recorded since the last reading, then cleared: int64 `[n, 7]`, columns
    TRACE_FIELDS in steady-clock ns and task counts, oldest first: helper_start is when the first
    helper started (0: none by the time the call returned), helper_done when the last helper that
    ran a task finished (0: none did). None unless the library was built with
    EXPERTD_TRACE_PARALLEL_FOR=1."""
    _require_library()
    out = np.zeros((1 << 16, len(TRACE_FIELDS)), np.int64)  # the library keeps at most 1 << 16
    n = _load()[0].expertd_parallel_for_trace(out.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), out.size)
    return None if n < 0 else out[:n].copy()


def _require_library():
    if not available():
        raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")


def grouped_matmul(x, group_sizes, w, *, source=None):
    """`x f32 [N, K]`, `group_sizes int [E]`, `w bf16|f32 [E, K, C]` -> `f32 [N, C]` (see module doc).

    `w` may also be a `panels.PanelWeights` of those weights (panel-major, made once at load): the
    same result bit for bit, read faster (BENCHMARKS.md "Panel-major expert weights").
    With `source int [N]`, x is `[T, K]` token rows and output row r reads `x[source[r]]` (a
    source outside [0, T), e.g. a permutation's pad row T, reads zeros): `dispatch.permute`'s
    gather done inside the kernel, without writing the permuted `[N, K]` copy of x."""
    _require_library()
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [N, K], group_sizes [E], w [E, K, C]; got x {x.shape}, "
                         f"group_sizes {group_sizes.shape}, w {w.shape}")
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"w must be float32 or bfloat16, got {w.dtype}")
    if source is not None and (source.ndim != 1 or not jnp.issubdtype(source.dtype, jnp.integer)):
        raise ValueError(f"source must be an integer [N] row index, got {source.dtype} {source.shape}")
    rows = x.shape[0] if source is None else source.shape[0]
    out = jax.ShapeDtypeStruct((rows, w.shape[2]), jnp.float32)
    x, group_sizes = x.astype(jnp.float32), group_sizes.astype(jnp.int32)
    target, w = (TARGET + "_panels", w.panels) if panels.is_panels(w) else (TARGET, w)
    if source is None:
        return jax.ffi.ffi_call(target, out)(x, group_sizes, w)
    return jax.ffi.ffi_call(target + "_gathered", out)(x, source.astype(jnp.int32), group_sizes, w)


def layout(topk_ids, num_experts: int, *, align_size: int = 0, valid=None) -> dispatch.Permutation:
    """`dispatch.layout` in one pass of C++ (a counting sort instead of XLA's stable sort); the
    same Permutation, field for field."""
    _require_library()
    t, k = dispatch.check_layout_args(topk_ids, num_experts, align_size, valid)
    flat = dispatch.flat_experts(topk_ids, num_experts, valid)
    n = dispatch.buffer_rows(t, k, num_experts, align_size)
    s32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    dest, token_of_row, sizes, offsets, counts = jax.ffi.ffi_call(
        "expertd_dispatch_layout", (s32(t * k), s32(n), s32(num_experts), s32(num_experts), s32(num_experts)))(
        flat, topk=k, align_size=int(align_size))
    return dispatch.Permutation(dest.reshape(t, k), token_of_row, sizes, offsets, counts)


def combine(rows, perm: dispatch.Permutation, topk_weights=None):
    """`dispatch.unpermute(rows, perm, topk_weights, out_dtype=float32)` in C++: `rows f32|bf16
    [N, H]` -> `f32 [T, H]`, reading each routed row once instead of materialising `[T, k, H]`."""
    _require_library()
    t, k = dispatch.check_unpermute_args(rows, perm, topk_weights)
    if rows.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"rows must be float32 or bfloat16, got {rows.dtype}")
    weights = jnp.ones((t, k), jnp.float32) if topk_weights is None else topk_weights.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((t, rows.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("expertd_combine", out)(rows, perm.dest.astype(jnp.int32), weights)


def grouped_matmul_reference(x, group_sizes, w):
    """Plain jnp: every row times its expert's matrix (fp32), rows past sum(group_sizes) -> 0."""
    expert, valid = row_experts(group_sizes, x.shape[0])
    w = panels.dense(w)
    wr = w[jnp.minimum(expert, w.shape[0] - 1)].astype(jnp.float32)  # [N, K, C]
    y = jnp.einsum("nk,nkc->nc", x.astype(jnp.float32), wr, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None], y, 0.0)


if __name__ == "__main__":
    if not available():
        raise SystemExit(f"native CPU kernel unavailable: {unavailable_reason()}")
    print(f"{library_path()} (instruction set: {isa()})")
