"""Test-wide setup.

JAX reads these when it initialises its backend, so they are set here, at conftest import, before
any test module imports jax: CPU only, 8 simulated devices for the expert-parallel tests
(single-device code simply uses device 0), and XLA's LLVM backend at optimisation level 0.

The tests' programs are small, so compiling them dominates, and LLVM's optimisation costs more
than it saves. XLA's HLO passes still run and its CPU code is not fast-math, so results agree
within every test's tolerance. Servers the tests start as processes inherit the flags; the benchmarks and the GPU
runbook compile at the default level. A level already in XLA_FLAGS is kept.
"""
import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_given = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_given, *(f for f in FAST_COMPILE_FLAGS if f.split("=")[0] not in _given)]).strip()
