"""The lent-GPU runbook (benchmarks/gpu_session.sh) stays runnable: its correctness step, run here
on CPU (one family at the quick point), imports the package the way the GPU machine does (links on PYTHONPATH, no
install) and finds every backend within the oracle's tolerance; its engine step (one short round)
times every way of the step cycle; its tiles step (the smoke shape, interpreted) checks and times
every tiling; its semantics step splits the families over processes and sums them up; its floor
step measures a server with the callers split over load processes; its shapes step alternates
the batcher's queue delays; several steps in one call leave one archive."""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_step(step: str, out: pathlib.Path, **env) -> None:
    """One runbook step as a GPU session runs it, on CPU, with its results in `out`."""
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", **env}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), step], env=env, cwd=out,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_check_step_passes_on_cpu(tmp_path):
    # One family: every backend's correctness over the families is tests/kernels' job; this keeps
    # the step runnable (the same code runs every family).
    _run_step("check", tmp_path, GPU_CHECK_ARGS="--quick --families mixtral")
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    backends = {r["backend"] for r in rows if r["kind"] == "layer"}
    assert {"pallas", "ragged_dot", "capacity", "expert_loop", "native_cpu", "auto"} <= backends
    assert {r["family"] for r in rows} == {"mixtral"} and {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    assert all(r["ok"] for r in rows) and len(rows) == 18 + 2 * ("tokamax" in backends)
    assert "CpuDevice" in (tmp_path / "env.txt").read_text()  # the environment step ran, with the package importable


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_shapes_step_alternates_the_queue_delays(tmp_path):
    _run_step("shapes", tmp_path, SHAPES_PLATFORMS="cpu",
              SHAPES_ARGS="--ports main --callers 4 --rounds 1 --duration 0.3 --max-queue-delay-ms 2,0")
    rows = json.loads((tmp_path / "batch_shapes_gpu.json").read_text())["rows"]
    assert [(r["port"], r["max_queue_delay_ms"]) for r in rows] == [("main", 2.0), ("main", 0.0)]
    assert all(r["requests_per_s"] > 0 and r["steps_per_s"] > 0 and r["direct"] == 0 for r in rows)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_engine_step_times_every_way_on_cpu(tmp_path):
    _run_step("engine", tmp_path, ENGINE_STEP_ARGS="--rows 1,16 --rounds 2 --calls 2")
    result = json.loads((tmp_path / "engine_step_gpu.json").read_text())
    assert [r["rows"] for r in result["rows"]] == [1, 16]
    ways = {"host+asarray", "host+device_get", "device_put+asarray", "device_put+device_get"}
    for row in result["rows"]:
        assert set(row["step_us"]) == ways and all(t > 0 for t in row["step_us"].values())
        base = row["step_us"]["device_put+device_get"]  # each way's ratio is its own time over the baseline's
        assert row["ratio_to_device_put_device_get"] == pytest.approx({w: t / base for w, t in row["step_us"].items()})


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_floor_step_splits_the_callers_over_load_processes(tmp_path):
    _run_step("floor", tmp_path, FLOOR_ARGS="--servers bare --rounds 1 --duration 0.2 --load-processes 2")
    result = json.loads((tmp_path / "python_floor_gpu_host.json").read_text())
    assert result["load_processes"] == 2 and [row["server"] for row in result["rows"]] == ["bare"]
    row = result["rows"][0]
    for load, processes in (("Check_1", 1), ("Forward_1", 1), ("Check_64", 2), ("Forward_64", 2)):
        assert row[load]["load_processes"] == processes and row[load]["calls"] > 0, load
        assert row[load]["requests_per_s"] > 0 and row[load]["p50_ms"] > 0, load
        if sys.platform == "linux":  # the CPU readings come from /proc
            assert row[load]["server_cpu_us_per_call"] > 0 and row[load]["load_busiest_thread"]["busy"] > 0
    assert row["hop_over_check"] == pytest.approx(
        (row["Forward_1"]["p50_ms"] - result["in_process_step_p50_ms"]) / row["Check_1"]["p50_ms"])
    assert result["in_process_step_after_idle_p50_ms"] > 0 and result["idle_gap_s"] > 0
    assert row["hop_over_check_idle_step"] == pytest.approx(
        (row["Forward_1"]["p50_ms"] - result["in_process_step_after_idle_p50_ms"]) / row["Check_1"]["p50_ms"])


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_semantics_and_tiles_steps_leave_one_archive(tmp_path):
    import tarfile

    env = dict(SEMANTICS_FAMILIES="llama4 ernie4_5_moe", SEMANTICS_JOBS="2", SEMANTICS_ARGS="--quick",
               TILES_ARGS="--smoke")
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "semantics", "tiles"],
                         env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu",
                              **env}, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_steps.tgz"]  # several steps: one archive
    with tarfile.open(tmp_path / "gpu_steps.tgz") as archive:
        archive.extractall(tmp_path / "steps", filter="data")
    rows = [json.loads((tmp_path / "steps" / f"gpu_check_semantics_{i}.json").read_text())["rows"] for i in (0, 1)]
    assert [{r["family"] for r in part} for part in rows] == [{"llama4"}, {"ernie4_5_moe"}]
    assert {(r["E"], r["k"], r["T"]) for part in rows for r in part} == {(8, 2, 64)}  # SEMANTICS_ARGS reached it
    cases = len(rows[0]) + len(rows[1])
    assert f"semantics: {cases} of {cases} cases within tolerance" in run.stdout
    # The tiles step (the smoke shape, interpreted) checked and timed every tiling.
    (case,) = json.loads((tmp_path / "steps" / "pallas_tiles.json").read_text())["rows"]
    assert case["best"] is not None and not case["wrong"] and len(case["tilings"]) >= 4
    assert all(r["err_per_scale"] <= 3e-2 for r in case["tilings"])


def test_pallas_tiles_confirm_times_named_tilings_against_the_default_in_alternation(tmp_path):
    out = tmp_path / "confirm.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "pallas_tiles.py"), "--smoke", "--rounds", "2",
                          "--confirm", "16,32,16,8,3", "32,16,16,4,2", "--out", str(out)],
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (case,) = json.loads(out.read_text())["rows"]
    assert [r["tiling"] for r in case["rows"]] == ["default", "16,32,16,8,3", "32,16,16,4,2"]
    for r in case["rows"]:
        assert len(r["seconds"]) == 2 and r["err_per_scale"] <= 3e-2
        assert r["ratio_to_default"] == pytest.approx([s / d for s, d in zip(r["seconds"], case["rows"][0]["seconds"])])
    script = str(ROOT / "benchmarks" / "pallas_tiles.py")
    bad = subprocess.run([sys.executable, script, "--smoke", "--confirm", "16,32"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "block_m,block_n,block_k,num_warps,num_stages" in bad.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_session_tokamax_step_checks_and_times_every_case_on_cpu(tmp_path):
    """The tokamax step at a small shape: the probe, every family through tokamax (fp32, bf16, FP8)
    and pallas (FP8) within the oracle's tolerance, the floors, and every (backend, weights) timed."""
    pytest.importorskip("tokamax")
    _run_step("tokamax", tmp_path, TOKAMAX_ARGS="--shapes 4,2,128,128 --tokens 2 --backends tokamax auto "
              "--fp8-backends tokamax pallas --check-point 4,2,4,128,128 --matmul-n 256 --chain 2 --reps 3")
    rows = json.loads((tmp_path / "tokamax_layer_gpu.json").read_text())["rows"]
    checks = [r for r in rows if r["kind"] == "check"]
    assert len(checks) == 12 and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]
    assert {(r["backend"], r["dtype"]) for r in checks} == {("tokamax", "float32"), ("tokamax", "bfloat16"),
                                                            ("tokamax", "fp8"), ("pallas", "fp8")}
    assert {(r["weights"], r["ok"]) for r in rows if r["kind"] == "probe" and r["implementation"] == "default"} \
        == {("bf16", True), ("fp8", True)}
    (floors,) = [r for r in rows if r["kind"] == "floors"]
    assert all(floors[k] > 0 for k in ("dense_bf16_flops", "copy_bytes_per_s", "read_bytes_per_s"))
    layers = [r for r in rows if r["kind"] == "layer"]
    assert [(r["backend"], r["weights"]) for r in layers] == [("tokamax", "bf16"), ("auto", "bf16"),
                                                              ("tokamax", "fp8"), ("pallas", "fp8")]
    for r in layers:
        assert "error" not in r and r["device_s"] > 0 and r["call_s"] > 0 and r["x_floor"] > 0, r
    assert (tmp_path / "tokamax_layer.log").exists()
