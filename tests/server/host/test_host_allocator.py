"""host_allocator: glibc keeps freed host buffers, so XLA:CPU's large outputs stop page-faulting.

Each case runs a fresh Python process (the settings must precede JAX's threads, and they would
change this test process for the rest of the suite) that calls one jitted op with a 64 MiB output
repeatedly and counts its page faults per call.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expertd.server.host import allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings (Linux)")

PROBE = """
import json, resource, sys
from expertd.server.host import allocator
when, calls, settled = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if when == "first":
    allocator.retain_freed_memory()
import jax, jax.numpy as jnp
y = jnp.ones((16 << 20,), jnp.float32)  # 64 MiB: above glibc's largest mmap threshold (32 MiB)
if when == "late":
    allocator.retain_freed_memory()
bump = jax.jit(lambda v: v + 1.0)
faults, rss = [], []
for _ in range(calls):  # or until `settled` calls in a row took fewer faults than a 2 MiB-paged output
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = bump(y)
    out.block_until_ready()
    del out
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    rss.append(int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize())
    if settled and len(faults) >= settled and max(faults[-settled:]) < (64 << 20) // (2 << 20):
        break
print(json.dumps({"state": allocator.state().as_dict(), "faults": faults, "rss": rss}))
"""
# One device, as `expertd serve` on one CPU. Retained, the heap takes some calls to settle: frees
# are asynchronous and small blocks split freed big ones, so the first outputs land on new pages
# (6 calls on the idle dev box, about 28 in a loaded CI run), hence "until settled" (at most MAX_CALLS).
MAX_CALLS = 200
SETTLED = 8
OUTPUT_PAGES_4K = (64 << 20) // 4096
OUTPUT_PAGES_2M = (64 << 20) // (2 << 20)  # a system with THP "always" faults 2 MiB at a time


def probe(when: str, calls: int = 8, settled: int = 0) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    env.pop("LD_PRELOAD", None)
    done = subprocess.run([sys.executable, "-c", PROBE, when, str(calls), str(settled)], capture_output=True,
                          text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_retained_buffers_are_reused_without_page_faults():
    result = probe("first", MAX_CALLS, SETTLED)
    assert result["state"] == {"applied": True, "reason": None}
    # the heap settles (SETTLED calls in a row without faults, so without growing): it then holds
    # the freed outputs, and each new one reuses them as they are
    assert len(result["faults"]) < MAX_CALLS, result["faults"]


def test_by_default_every_call_faults_its_output_in():
    result = probe("never")
    assert result["state"]["applied"] is False and result["state"]["reason"].startswith("off; ")
    assert min(result["faults"][-4:]) >= OUTPUT_PAGES_2M, result["faults"]
    if host_thp_mode() != "always":
        assert min(result["faults"][-4:]) >= OUTPUT_PAGES_4K, result["faults"]


def test_after_jax_started_it_changes_nothing_and_says_why():
    result = probe("late")
    assert result["state"]["applied"] is False
    reason = result["state"]["reason"]
    assert "own malloc arenas" in reason and "before JAX's first computation" in reason
    assert min(result["faults"][-4:]) >= OUTPUT_PAGES_2M, result["faults"]


def test_malloc_arenas_counts_this_process_threads_arenas():
    libc = allocator._glibc()
    if libc is None:
        pytest.skip("not glibc")
    assert allocator.malloc_arenas(libc) >= 1
    # this pytest process has run JAX: its threads have arenas, so the settings are refused here
    import jax.numpy as jnp

    jnp.ones(3).block_until_ready()
    assert allocator.malloc_arenas(libc) > 1
    assert allocator.state().applied is False


def test_other_mallocs_and_other_libcs_are_left_alone(monkeypatch):
    """Refused before any mallopt call, so safe to run in this process (its state is restored)."""
    monkeypatch.setattr(allocator, "_state", allocator.AllocatorState())
    state = allocator.retain_freed_memory(ld_preload="/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert not state.applied and state.reason.startswith("another malloc is preloaded (LD_PRELOAD=")
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    assert allocator.retain_freed_memory().reason == "not glibc on Linux"
    assert allocator.state().reason == "not glibc on Linux"


def test_summary_lines():
    assert allocator.summary({"applied": True, "reason": None}).startswith("freed buffers kept for reuse")
    assert allocator.summary({"applied": False, "reason": "not glibc on Linux"}) == (
        "large freed buffers go back to the system (not glibc on Linux)")


def test_start_up_info_reports_the_process_state():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from expertd.kernels import moe
    from expertd.server.engine.build import build_engine
    from expertd.server.models.presets import LoadedLayer

    cfg = moe.MoEConfig(num_experts=4, topk=2, hidden_size=32, intermediate_size=64)
    params = {name: np.asarray(v) for name, v in moe.init_params(cfg, jax.random.key(0), jnp.float32).items()}
    served = build_engine([LoadedLayer(index=0, cfg=cfg, params=params, source="test")], buckets=(8,),
                          dtype="float32", devices=1)
    assert served.info()["host_allocator"] == allocator.state().as_dict()
    assert served.info()["host_allocator"]["applied"] is False  # this test process never asked


def host_thp_mode() -> str | None:
    from expertd.server.host import memory  # where the THP setting is read

    return memory.thp_setting()
