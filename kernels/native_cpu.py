"""A C++ grouped matmul for XLA:CPU (kernels/native/grouped_matmul_cpu.cc), built on first use.

`grouped_matmul(x, group_sizes, w)`: `x f32 [N, K]` (expert-major rows), `group_sizes int [E]`,
`w bf16|f32 [E, K, C]` -> `f32 [N, C]`, each row times its expert's matrix; rows past
sum(group_sizes) are 0. Experts with few rows (under 32) have their weights read once, in place,
with bf16 widened in registers (XLA:CPU copies and widens each expert's slice first); experts with
more rows run a BLIS-style packed GEMM (fp32 weight panels, a 6 x 16 register micro-kernel); the
layer ran faster with it than with any XLA:CPU backend at every benchmarked batch size (BENCHMARKS.md).
`grouped_matmul_reference` is its plain-jnp twin.

The shared library is compiled with the system C++ compiler (`$CXX`, else c++ / g++ / clang++)
against the XLA FFI headers jaxlib ships, into `$EXPERTD_CACHE_DIR` (default `~/.cache/expertd`),
keyed by a hash of the source, jaxlib's version and the flags; later processes load it from there
(`python -m expertd.kernels.native_cpu` builds it ahead of time, e.g. in an image). Where there is no
compiler or the build fails, `available()` is False with the reason in `unavailable_reason()`, and
`experts.choose_backend` keeps to XLA's paths. The custom call exists for the CPU platform only,
on x86-64 (AVX2 + FMA, with a portable scalar loop for older x86 CPUs).
"""

from __future__ import annotations

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

from expertd.kernels.experts import row_experts

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("native") / "grouped_matmul_cpu.cc"
TARGET = "expertd_grouped_matmul"
CXXFLAGS = ("-O3", "-DNDEBUG", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300


def cache_dir() -> pathlib.Path:
    env = os.environ.get("EXPERTD_CACHE_DIR")
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "expertd"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def library_path() -> pathlib.Path:
    """Where the built library lives: keyed by the source, jaxlib's version (its FFI headers) and
    the flags, not the compiler, so a cache filled at image build time loads without one."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), jaxlib.__version__.encode(), " ".join(CXXFLAGS).encode()):
        key.update(part)
    return cache_dir() / f"grouped_matmul_cpu-{key.hexdigest()[:16]}.so"


def _build(cxx: str, target: pathlib.Path, source: pathlib.Path = SOURCE) -> None:
    """Compile `source` into `target` atomically (concurrent processes may build at once);
    benchmarks/native_cpu_kernel.py builds variants of SOURCE with it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *CXXFLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _register(path: pathlib.Path, target: str) -> ctypes.CDLL:
    """Load a built library and register its kernel with XLA:CPU under `target` (benchmarks/
    native_cpu_kernel.py registers variants of SOURCE under other names)."""
    lib = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.ExpertdGroupedMatmul), platform="cpu")
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
        lib = _register(path, TARGET)
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
    lib = _load()[0]
    return lib is not None and bool(lib.expertd_grouped_matmul_has_avx2())


def grouped_matmul(x, group_sizes, w):
    """`x f32 [N, K]`, `group_sizes int [E]`, `w bf16|f32 [E, K, C]` -> `f32 [N, C]` (see module doc)."""
    if not available():
        raise RuntimeError(f"the native CPU kernel is unavailable: {unavailable_reason()}")
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
        raise ValueError(f"expected x [N, K], group_sizes [E], w [E, K, C]; got x {x.shape}, "
                         f"group_sizes {group_sizes.shape}, w {w.shape}")
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"w must be float32 or bfloat16, got {w.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x.astype(jnp.float32), group_sizes.astype(jnp.int32), w)


def grouped_matmul_reference(x, group_sizes, w):
    """Plain jnp: every row times its expert's matrix (fp32), rows past sum(group_sizes) -> 0."""
    expert, valid = row_experts(group_sizes, x.shape[0])
    wr = w[jnp.minimum(expert, w.shape[0] - 1)].astype(jnp.float32)  # [N, K, C]
    y = jnp.einsum("nk,nkc->nc", x.astype(jnp.float32), wr, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None], y, 0.0)


if __name__ == "__main__":
    if not available():
        raise SystemExit(f"native CPU kernel unavailable: {unavailable_reason()}")
    print(f"{library_path()} (AVX2/FMA path: {'yes' if vectorized() else 'no, portable loop'})")
