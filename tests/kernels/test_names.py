"""kernels/names.py: the backend names and ISA levels a server's config checks its flags against,
defined once, importable without JAX, and the very tuples the kernels use."""
import subprocess
import sys

from expertd.kernels import cpu, experts, names


def test_importing_names_loads_no_jax():
    code = ("import sys, expertd.kernels.names; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_kernels_use_these_names():
    assert experts.BACKENDS is names.EXPERT_BACKENDS
    assert cpu.ISA_LEVELS is names.NATIVE_CPU_ISA_LEVELS
    assert "auto" not in names.EXPERT_BACKENDS and "native_cpu" in names.EXPERT_BACKENDS
    assert names.NATIVE_CPU_ISA_LEVELS[0] == "portable"
