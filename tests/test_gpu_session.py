"""The lent-GPU runbook (benchmarks/gpu_session.sh) stays runnable: its correctness step, run here
on CPU (quick grid), imports the package the way the GPU machine does (links on PYTHONPATH, no
install) and finds every backend within the oracle's tolerance."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_check_step_passes_on_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
           "GPU_CHECK_ARGS": "--quick"}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "check"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    backends = {r["backend"] for r in rows if r["kind"] == "layer"}
    assert {"pallas", "ragged_dot", "capacity", "expert_loop", "native_cpu", "auto"} <= backends
    assert all(r["ok"] for r in rows) and len(rows) == 54
    assert "CpuDevice" in (tmp_path / "env.txt").read_text()  # the environment step ran, with the package importable
