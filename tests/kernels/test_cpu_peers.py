"""benchmarks/cpu_peers.py end to end on a tiny layer: every engine it can start here computes the
layer its numpy reference computes, is timed in every round, and an engine that cannot start is
reported with why while the run goes on. No timing is asserted."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cpu_peers.py"
SHAPE = (8, 2, 64, 96)  # E, k, H, I: vLLM's kernel wants H and I in multiples of 32
TOKENS = (1, 5, 33)
ROUNDS = 2


def run_benchmark(tmp_path, *extra):
    out = tmp_path / "cpu_peers.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "qwen3", "--tokens", ",".join(map(str, TOKENS)),
                           "--rounds", str(ROUNDS), "--shape-override", ",".join(map(str, SHAPE)),
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    # vLLM's worker runs under this interpreter, where vllm is not installed: it must fail to start
    # and be reported; kt-kernel's interpreter does not exist.
    return run_benchmark(tmp_path_factory.mktemp("peers"), "--engines", "expertd,transformers,vllm,kt",
                         "--vllm-python", sys.executable, "--kt-python", "/nonexistent/python")


def test_engines_that_start_agree_with_the_reference_and_are_timed_every_round(result):
    data, _ = result
    shape = data["shapes"]["qwen3"]
    assert shape["shape"] == dict(zip(("E", "k", "H", "I"), SHAPE))
    assert len(shape["read_bytes_per_s"]) == ROUNDS and min(shape["read_bytes_per_s"]) > 0
    assert shape["dense_flop_per_s"] > 0
    for t in TOKENS:
        row = shape["tokens"][str(t)]
        assert set(row["times"]) == {"expertd", "transformers"}
        for name in ("expertd", "transformers"):
            assert row["rel_error"][name] <= data["agree_tol"], (t, name, row["rel_error"])
            assert len(row["times"][name]) == ROUNDS and min(row["times"][name]) > 0
            assert len(row["x_floor"][name]) == ROUNDS
        assert len(row["expertd_over"]["transformers"]) == ROUNDS
        assert 1 <= row["touched_experts"] <= SHAPE[0]
        assert row["touched_bytes"] == row["touched_experts"] * 3 * SHAPE[2] * SHAPE[3] * 2
        assert row["flops"] == 2 * t * SHAPE[1] * 3 * SHAPE[2] * SHAPE[3]
        assert all(f > 0 for f in row["floor_s"])


def test_engines_that_cannot_start_are_reported_with_why(result):
    data, stdout = result
    engines = data["shapes"]["qwen3"]["engines"]
    assert engines["vllm"]["available"] is False and "vllm" in engines["vllm"]["why"]
    assert engines["kt"] == {"available": False, "why": "no interpreter for kt"}
    assert engines["expertd"]["available"] and engines["expertd"]["info"]["isa"]
    assert "not run: " in stdout and "vllm: ModuleNotFoundError" in stdout and "kt: no interpreter for kt" in stdout


def test_reference_routing_is_qwen3_moe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import cpu_peers

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((7, 16), np.float32), rng.standard_normal((16, 6), np.float32)
    ids, weights = cpu_peers.routing(x, w, 2)
    logits = x @ w
    for t in range(7):
        assert set(ids[t]) == set(np.argsort(logits[t])[-2:])
        top = np.exp(logits[t][ids[t]] - logits[t].max())
        np.testing.assert_allclose(weights[t], top / top.sum(), rtol=1e-6)
