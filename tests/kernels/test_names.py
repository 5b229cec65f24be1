"""The kernels' JAX-free modules: kernels/names.py (the backend names and ISA levels a server's
config checks its flags against, defined once, the very tuples the kernels use) and
kernels/moe_reference.py (the float64 whole-layer reference, numpy only)."""
import subprocess
import sys

import pytest

from expertd.kernels import cpu, experts, names


@pytest.mark.parametrize("module", ["expertd.kernels.names", "expertd.kernels.moe_reference"])
def test_importing_loads_no_jax(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_the_kernels_use_these_names():
    assert experts.BACKENDS is names.EXPERT_BACKENDS
    assert cpu.ISA_LEVELS is names.NATIVE_CPU_ISA_LEVELS
    assert cpu.EXPERT_WEIGHTS_CHOICES is names.EXPERT_WEIGHTS
    assert "auto" not in names.EXPERT_BACKENDS and "native_cpu" in names.EXPERT_BACKENDS
    assert names.NATIVE_CPU_ISA_LEVELS[0] == "portable"
