"""Building and loading the native CPU library (csrc/*.cc, one shared library), with explicit options.

`BuildOptions` says where the built library is cached, which compiler builds it, whether it is the
trace build, and the instruction-set cap it runs under; `configure(options)` sets them for this
process, once, before the library is first loaded (the server's config passes what its flags and
deployment settings say; nothing here reads the process's env variables). Without `configure`,
`BuildOptions()`'s defaults apply.

The library is compiled with the system C++ compiler (`options.compiler`, else the first of c++ /
g++ / clang++ on PATH) against the XLA FFI headers jaxlib ships, with warnings on (CXXFLAGS), into
`options.cache_dir` (default `~/.cache/expertd`), keyed by a hash of the sources and headers,
jaxlib's version and the flags; later processes load it from there (`python -m expertd.kernels.cpu
--cache-dir DIR` builds it ahead of time, e.g. in an image). Where there is no compiler or the
build fails, `available()` is False with the reason in `unavailable_reason()`, and the backend
policy keeps to XLA's paths. The custom calls exist for the CPU platform only, on x86-64.
"""
from __future__ import annotations

import ctypes
import dataclasses
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
import jaxlib

from expertd.kernels.names import NATIVE_CPU_ISA_LEVELS

log = logging.getLogger(__name__)

CSRC_DIR = pathlib.Path(__file__).with_name("csrc")
SOURCE = CSRC_DIR / "grouped_matmul_cpu.cc"
# One library: the grouped matmul, the fused gate / up call, the dispatch passes (layout, combine),
# the host copy the checkpoint loader transposes weights with, FP8 codes to INT8 panels at load, the
# library's C entry points, and their headers.
SOURCES = (SOURCE, CSRC_DIR / "grouped_glu_cpu.cc", CSRC_DIR / "dispatch_cpu.cc", CSRC_DIR / "host_copy.cc",
           CSRC_DIR / "fp8_int8.cc", CSRC_DIR / "library.cc")
HEADERS = tuple(sorted(CSRC_DIR.glob("*.h")))  # every one is in the build key
TARGET = "expertd_grouped_matmul"
# XLA FFI targets registered from the library: name -> exported handler symbol.
TARGETS = {TARGET: "ExpertdGroupedMatmul",
           "expertd_grouped_matmul_gathered": "ExpertdGroupedMatmulGathered",
           "expertd_grouped_matmul_panels": "ExpertdGroupedMatmulPanels",
           "expertd_grouped_matmul_panels_gathered": "ExpertdGroupedMatmulPanelsGathered",
           "expertd_grouped_matmul_int8": "ExpertdGroupedMatmulInt8",
           "expertd_grouped_matmul_int8_gathered": "ExpertdGroupedMatmulInt8Gathered",
           "expertd_grouped_glu": "ExpertdGroupedGlu",
           "expertd_dispatch_layout": "ExpertdDispatchLayout",
           "expertd_combine": "ExpertdCombine"}
# -ffp-contract=off: the combine rounds its products and sums separately, as XLA's does (the matmul
# asks for its FMAs explicitly). Warnings on; jaxlib's headers are system headers (-isystem), so
# only ours are warned about.
CXXFLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Wextra")
TRACE_DEFINE = "-DEXPERTD_TRACE_PARALLEL_FOR"  # the trace build (csrc/parallel.h)
COMPILERS = ("c++", "g++", "clang++")  # looked up on PATH in this order when no compiler is given
DEFAULT_CACHE_DIR = pathlib.Path("~/.cache/expertd")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
# The library's plain C entry points, called through ctypes: symbol -> (restype, argtypes or None).
C_SIGNATURES = {
    "expertd_native_cpu_path_items": (_I64, None),
    "expertd_native_cpu_amx_faults": (_I64, None),
    "expertd_caller_only_work": (_I64, None),
    "expertd_set_caller_only_work": (None, (_I64,)),
    "expertd_parallel_for_trace": (_I64, (ctypes.POINTER(_I64), _I64)),
    "expertd_strided_copy_2d": (ctypes.c_int, (_PTR, _I64, _I64, _PTR, _I64, _I64, _I64)),
    "expertd_block_lookup": (ctypes.c_int, (_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64)),
    "expertd_fp8_to_int8_panels": (_I64, (_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR)),
}
ISA_LEVELS = NATIVE_CPU_ISA_LEVELS  # csrc/simd.h Isa, lowest first (kernels/names.py, JAX-free)
BUILD_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How this process builds and runs the native CPU library.

    cache_dir: where built libraries are kept (None: DEFAULT_CACHE_DIR, in the user's home).
    isa_cap: the highest instruction-set level the kernels may run (one of ISA_LEVELS; None: the
      best this CPU runs). A run-time setting, not part of the build.
    trace: build (and load) the library that records every ParallelFor call
      (`diagnostics.parallel_for_trace`); a separate build with its own cache key.
    compiler: the C++ compiler to build with (None: the first of COMPILERS on PATH).
    """

    cache_dir: pathlib.Path | None = None
    isa_cap: str | None = None
    trace: bool = False
    compiler: str | None = None

    def __post_init__(self):
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", pathlib.Path(self.cache_dir))
        if self.isa_cap is not None and self.isa_cap not in ISA_LEVELS:
            raise ValueError(f"BuildOptions.isa_cap must be one of {ISA_LEVELS} or None, got {self.isa_cap!r}")
        if not isinstance(self.trace, bool):
            raise ValueError(f"BuildOptions.trace must be a bool, got {self.trace!r}")

    def resolved_cache_dir(self) -> pathlib.Path:
        return (self.cache_dir if self.cache_dir is not None else DEFAULT_CACHE_DIR).expanduser()


_LOCK = threading.Lock()
_options = BuildOptions()
_state: tuple[ctypes.CDLL | None, str] | None = None  # (library, why not) once loaded or failed
_build_log = ""  # the compiler's messages of the build this process ran


def configure(options: BuildOptions) -> None:
    """Use `options` for this process; call once, before the library is first used. Calling it
    again with the same options is a no-op; with other options after the library was loaded
    (or its build failed) it raises RuntimeError."""
    global _options
    if not isinstance(options, BuildOptions):
        raise TypeError(f"options must be a BuildOptions, got {type(options).__name__}")
    with _LOCK:
        if _state is not None and options != _options:
            raise RuntimeError(f"the native CPU library was already loaded with {_options}; "
                               "call configure() before its first use")
        _options = options


def options() -> BuildOptions:
    """The options in force (the defaults unless `configure` was called)."""
    return _options


def cxxflags(opts: BuildOptions | None = None) -> tuple[str, ...]:
    """CXXFLAGS, plus the trace define for a trace build."""
    opts = opts or _options
    return CXXFLAGS + ((TRACE_DEFINE,) if opts.trace else ())


def find_compiler(opts: BuildOptions | None = None) -> str | None:
    """The compiler `opts` names, else the first of COMPILERS on PATH (None: no compiler)."""
    opts = opts or _options
    if opts.compiler:
        return opts.compiler
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


def library_path(opts: BuildOptions | None = None) -> pathlib.Path:
    """Where the built library lives: keyed by the sources and headers, jaxlib's version (its FFI
    headers) and the flags, not the compiler, so a cache filled at image build time loads without one."""
    opts = opts or _options
    key = hashlib.sha256()
    for path in SOURCES + HEADERS:
        key.update(path.read_bytes())
    for part in (jaxlib.__version__.encode(), " ".join(cxxflags(opts)).encode()):
        key.update(part)
    return opts.resolved_cache_dir() / f"grouped_matmul_cpu-{key.hexdigest()[:16]}.so"


def compile_library(cxx: str, target: pathlib.Path, sources: tuple[pathlib.Path, ...] = SOURCES,
                    flags: tuple[str, ...] | None = None) -> str:
    """Compile `sources` into `target` atomically (concurrent processes may build at once) and
    return the compiler's messages (its warnings; "" for a clean build). RuntimeError with the
    compiler's output when it fails. benchmarks/native_cpu_kernel.py builds variants with it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    flags = cxxflags() if flags is None else flags
    try:
        cmd = [cxx, *flags, "-isystem", jax.ffi.include_dir(), f"-I{CSRC_DIR}", *map(str, sources), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
        return done.stderr
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def register(path: pathlib.Path, targets: dict[str, str]) -> ctypes.CDLL:
    """Load a built library and register its handlers with XLA:CPU, `{target name: symbol}`
    (benchmarks/native_cpu_kernel.py registers a variant of the matmul under another name)."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    for symbol, (restype, argtypes) in C_SIGNATURES.items():
        if hasattr(lib, symbol):  # (benchmark variants of older sources lack some)
            function = getattr(lib, symbol)
            function.restype = restype
            if argtypes is not None:
                function.argtypes = argtypes
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") once built, loaded, capped to `isa_cap` and registered with XLA, else (None,
    why not). Built at most once per process, with the options in force."""
    global _state
    with _LOCK:
        if _state is None:
            _state = _load(_options)
        return _state


def _load(opts: BuildOptions) -> tuple[ctypes.CDLL | None, str]:
    global _build_log
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"the kernel is written for x86-64 (AVX2), this machine is {platform.machine()}"
    try:
        path = library_path(opts)
        if not path.exists():
            cxx = find_compiler(opts)
            if cxx is None:
                return None, f"no C++ compiler found (none of {', '.join(COMPILERS)} on PATH; BuildOptions.compiler)"
            log.info("building %s with %s into %s", ", ".join(s.name for s in SOURCES), cxx, path)
            _build_log = compile_library(cxx, path, flags=cxxflags(opts))
            if _build_log.strip():
                log.warning("native CPU library built with compiler messages:\n%s", _build_log[-4000:])
        lib = register(path, TARGETS)
        if opts.isa_cap is not None:
            lib.expertd_native_cpu_cap_isa(ISA_LEVELS.index(opts.isa_cap))
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("native CPU kernel unavailable: %s", err)
        return None, str(err)
    return lib, ""


def available() -> bool:
    """Whether the library is built and registered (building it now if need be)."""
    return load()[0] is not None


def unavailable_reason() -> str:
    """Why the library is unavailable ("" when it is available)."""
    return load()[1]


def build_log() -> str:
    """The compiler's messages of the build this process ran ("" when clean, or loaded from the cache)."""
    load()
    return _build_log


def require_library() -> ctypes.CDLL:
    """The loaded library; RuntimeError saying why when it is unavailable."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"the native CPU kernel is unavailable: {why}")
    return lib
