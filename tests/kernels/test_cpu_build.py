"""Building and loading the native CPU library (kernels/cpu/build.py) with explicit BuildOptions:
the cache folder, the compiler, the trace build and the instruction-set cap, each in a fresh
process; the build key, the warning-free build, and the fallback without a compiler."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from expertd.kernels import cpu
from expertd.kernels.cpu import build, diagnostics

pytestmark = pytest.mark.skipif(not cpu.available(), reason=f"no native kernel: {cpu.unavailable_reason()}")


def _fresh_process(code: str) -> dict:
    """Run `code` (which prints one JSON line last) in a new interpreter on JAX's CPU platform."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_builds_into_the_cache_dir_without_warnings_and_the_next_process_loads_it(tmp_path):
    code = """
        import json, jax.numpy as jnp, numpy as np
        from expertd.kernels import cpu
        from expertd.kernels.cpu import diagnostics
        cpu.configure(cpu.BuildOptions(cache_dir={cache!r}, compiler={compiler!r}))
        ok = cpu.available()
        y = cpu.grouped_matmul(jnp.ones((3, 16), jnp.float32), jnp.asarray([2, 1], jnp.int32),
                               jnp.ones((2, 16, 32), jnp.bfloat16))
        print(json.dumps({{"ok": ok, "sum": float(np.asarray(y).sum()), "log": diagnostics.build_log()}}))
    """
    got = _fresh_process(code.format(cache=str(tmp_path), compiler=None))
    assert got == {"ok": True, "sum": 3 * 16 * 32, "log": ""}  # -Wall -Wextra report nothing
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 1 and built[0].startswith("grouped_matmul_cpu-") and built[0].endswith(".so")
    # No compiler now: the cached library still loads.
    assert _fresh_process(code.format(cache=str(tmp_path), compiler="/nonexistent/c++"))["ok"] is True


def test_trace_build_records_every_parallel_for_call_and_computes_the_same(tmp_path):
    """BuildOptions(trace=True) builds a separate library whose ParallelFor calls leave records
    (benchmarks/parallel_for_trace.py); the plain build has none to give. A call of at most
    kCallerOnlyWork multiply-adds (parallel.h) runs on the caller alone: no helper ever starts."""
    assert diagnostics.parallel_for_trace() is None
    code = f"""
        import json, os, jax.numpy as jnp, numpy as np
        from expertd.kernels import cpu
        from expertd.kernels.cpu import diagnostics
        cpu.configure(cpu.BuildOptions(cache_dir={str(tmp_path)!r}, trace=True))
        x = jnp.asarray(np.random.default_rng(0).standard_normal((40, 64)), jnp.float32)
        gs, w = jnp.asarray([10, 0, 30], jnp.int32), jnp.ones((3, 64, 256), jnp.bfloat16)
        diagnostics.parallel_for_trace()
        ys = [np.asarray(cpu.grouped_matmul(x, gs, w)) for _ in range(5)]
        records = diagnostics.parallel_for_trace()
        want = np.asarray(cpu.grouped_matmul_reference(x, gs, w))
        small = (x[:2], jnp.asarray([1, 0, 1], jnp.int32), w)  # 2 x 64 x 256 multiply-adds
        small_ys = [np.asarray(cpu.grouped_matmul(*small)) for _ in range(5)]
        small_records = diagnostics.parallel_for_trace()
        with diagnostics.caller_only_work(0):  # every call of two or more tasks shared
            np.asarray(cpu.grouped_matmul(*small))
        forced = diagnostics.parallel_for_trace().tolist()
        small_err = max(float(np.max(np.abs(y - np.asarray(cpu.grouped_matmul_reference(*small)))))
                        for y in small_ys)
        print(json.dumps({{"records": records.tolist(), "small_records": small_records.tolist(),
                          "small_err": small_err, "forced": forced, "bound": diagnostics.caller_only_work_now(),
                          "again": len(diagnostics.parallel_for_trace()),
                          "cpus": len(os.sched_getaffinity(0)),
                          "err": max(float(np.max(np.abs(y - want))) for y in ys),
                          "fields": list(diagnostics.TRACE_FIELDS), "log": diagnostics.build_log()}}))
    """
    got = _fresh_process(code)
    assert got["err"] < 1e-3 and got["again"] == 0 and got["log"] == ""
    assert len(got["records"]) == 5  # one ParallelFor call per grouped matmul
    for record in got["records"]:
        r = dict(zip(got["fields"], record))
        assert r["start"] <= r["caller_done"] <= r["returned"]
        assert r["tasks"] >= 2 and 0 <= r["caller_tasks"] <= r["tasks"]  # two experts with rows
        assert r["helpers"] >= 1 or got["cpus"] == 1  # 40 x 64 x 256 multiply-adds: shared
        if r["helper_done"]:  # a helper ran tasks: it started after the call did, and the caller waited for it
            assert r["start"] <= r["helper_start"] <= r["helper_done"] <= r["returned"]
            assert r["caller_tasks"] < r["tasks"]
        else:
            assert r["caller_tasks"] == r["tasks"]
    assert got["small_err"] < 1e-3 and len(got["small_records"]) == 5
    for record in got["small_records"]:
        r = dict(zip(got["fields"], record))
        assert r["tasks"] >= 2 and r["helpers"] == 0 and r["caller_tasks"] == r["tasks"] and r["helper_start"] == 0
    # The benchmarks' run-time control moves the bound, and puts it back after its block.
    assert len(got["forced"]) == 1 and got["bound"] == 1 << 18
    assert dict(zip(got["fields"], got["forced"][0]))["helpers"] >= 1 or got["cpus"] == 1
    assert len(list(tmp_path.glob("grouped_matmul_cpu-*.so"))) == 1  # its own build key


def test_the_build_key_covers_every_header_the_sources_include():
    """A header edit must rebuild the library: library_path() hashes HEADERS, so every local header
    that a source or header includes has to be among them."""
    included = set()
    for path in build.SOURCES + build.HEADERS:
        included |= set(re.findall(r'^#include "([^"/]+)"', path.read_text(), re.MULTILINE))
    assert included and included <= {h.name for h in build.HEADERS}


def test_without_a_compiler_auto_falls_back_and_explicit_use_says_why(tmp_path):
    code = f"""
        import json, jax.numpy as jnp
        from expertd.kernels import cpu, experts
        cpu.configure(cpu.BuildOptions(cache_dir={str(tmp_path)!r}, compiler="/nonexistent/c++"))
        try:
            cpu.grouped_matmul(jnp.ones((1, 16), jnp.float32), jnp.ones(1, jnp.int32), jnp.ones((1, 16, 16)))
            error = ""
        except RuntimeError as err:
            error = str(err)
        print(json.dumps({{"ok": cpu.available(), "why": cpu.unavailable_reason(), "error": error,
                          "auto": experts.choose_backend(32, 8, 1024, 2048, jnp.bfloat16, "cpu"),
                          "describe": cpu.describe()}}))
    """
    got = _fresh_process(code)
    assert got["ok"] is False and "/nonexistent/c++" in got["why"]
    assert "native CPU kernel is unavailable" in got["error"]
    assert got["auto"] == "expert_loop"
    assert got["describe"] == {"available": False, "reason": got["why"], "isa": None, "amx": None,
                               "weight_layout": "row_major",
                               "panel_columns": None, "expert_weights": None}


def test_isa_cap_runs_the_portable_loops_and_they_match_the_reference():
    """BuildOptions(isa_cap="portable"), the scalar paths of CPUs without AVX2: the matmul (column
    tails and k remainders included; row-major and panel-major weights) and the combine."""
    code = """
        import json, jax.numpy as jnp, numpy as np
        from expertd.kernels import cpu, dispatch
        from expertd.kernels.cpu import diagnostics
        cpu.configure(cpu.BuildOptions(isa_cap="portable"))
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((9, 40)), jnp.float32)
        gs = jnp.asarray([3, 0, 4], jnp.int32)
        err = []
        for dtype in (jnp.float32, jnp.bfloat16):
            w = jnp.asarray(rng.standard_normal((3, 40, 50)), dtype)
            got = np.asarray(cpu.grouped_matmul(x, gs, w))
            want = np.asarray(cpu.grouped_matmul_reference(x, gs, w))
            err.append(float(np.max(np.abs(got - want))))
            on_panels = np.asarray(cpu.grouped_matmul(x, gs, cpu.to_panels(w)))
            err.append(float(np.max(np.abs(on_panels - got))))  # the same loop, bit for bit
            perm = dispatch.layout(jnp.asarray(rng.integers(0, 3, (9, 1)), jnp.int32), 3)
            rows, weights = x.astype(dtype), jnp.asarray(rng.random((9, 1)), jnp.float32)
            got = np.asarray(cpu.combine(rows, perm, weights))
            want = np.asarray(dispatch.unpermute(rows, perm, weights, out_dtype=jnp.float32))
            err.append(float(np.max(np.abs(got - want))))
        with diagnostics.limit_isa("avx2"):  # a limit above the cap changes nothing
            capped = cpu.isa()
        print(json.dumps({"vectorized": diagnostics.vectorized(), "isa": cpu.isa(), "capped": capped,
                          "supported": list(diagnostics.supported_isas()), "err": err}))
    """
    got = _fresh_process(code)
    assert got["vectorized"] is False and got["isa"] == got["capped"] == "portable"
    assert got["supported"] == ["portable"]
    assert max(got["err"]) < 1e-4 and got["err"][1::3] == [0.0, 0.0]


def test_options_are_explicit_checked_and_fixed_once_loaded(tmp_path):
    assert cpu.BuildOptions().resolved_cache_dir() == build.DEFAULT_CACHE_DIR.expanduser()
    assert cpu.BuildOptions(cache_dir=str(tmp_path)).cache_dir == tmp_path  # a str becomes a Path
    with pytest.raises(ValueError, match="isa_cap must be one of"):
        cpu.BuildOptions(isa_cap="sse2")
    with pytest.raises(ValueError, match="trace must be a bool"):
        cpu.BuildOptions(trace="yes")
    with pytest.raises(TypeError, match="BuildOptions"):
        cpu.configure({"trace": True})
    assert build.TRACE_DEFINE in build.cxxflags(cpu.BuildOptions(trace=True))
    assert build.TRACE_DEFINE not in build.cxxflags(cpu.BuildOptions())
    assert {"-Wall", "-Wextra"} <= set(build.CXXFLAGS)
    assert build.library_path(cpu.BuildOptions(trace=True)) != build.library_path(cpu.BuildOptions())
    cpu.configure(diagnostics.options())  # the library is loaded: the same options are fine ...
    with pytest.raises(RuntimeError, match="call configure"):  # ... others come too late
        cpu.configure(cpu.BuildOptions(cache_dir=tmp_path))


def test_the_ahead_of_time_build_command_takes_its_options_as_flags(tmp_path):
    """`python -m expertd.kernels.cpu --cache-dir DIR` (an image's build step): here DIR already holds
    this build's library, so no compiler is needed and the command says where it is and its level."""
    built = build.library_path(cpu.BuildOptions(cache_dir=tmp_path))
    built.write_bytes(build.library_path().read_bytes())
    done = subprocess.run([sys.executable, "-m", "expertd.kernels.cpu", "--cache-dir", str(tmp_path),
                           "--compiler", "/nonexistent/c++"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"{built} (instruction set: {cpu.isa()})"
