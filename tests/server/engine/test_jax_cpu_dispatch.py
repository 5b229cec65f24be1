"""process.configure_cpu_dispatch: JAX's CPU client runs each step on the calling thread
(``expertd serve --cpu-sync-dispatch``) or on its worker thread (JAX's default, and serve's).

Each case runs a fresh Python process: the setting is read when JAX creates its CPU client, which
this test process has long done. A synchronous call returns with its result computed; an
asynchronous one returns before a computation of ~0.1 s is done.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from expertd.server.config import ServerConfig, parse_args

PROBE = """
import json, sys
from expertd.server.host.process import configure_cpu_dispatch
when, asynchronous = sys.argv[1], sys.argv[2] == "async"
import jax, jax.numpy as jnp
if when == "late":
    jax.devices()  # JAX's CPU client exists before the setting
applied = configure_cpu_dispatch(asynchronous)
x = jnp.ones((1200, 1200), jnp.float32)
cube = jax.jit(lambda a: (a @ a @ a @ a).sum())
cube(x).block_until_ready()
ready = []
for _ in range(4):
    out = cube(x)
    ready.append(out.is_ready())  # before anything waits for it
    out.block_until_ready()
print(json.dumps({"applied": applied, "ready_at_return": ready}))
"""


def probe(when: str, dispatch: str) -> tuple[dict, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    done = subprocess.run([sys.executable, "-c", PROBE, when, dispatch], capture_output=True, text=True, env=env,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_cpu_sync_dispatch_returns_with_the_result_computed():
    assert parse_args(["--cpu-sync-dispatch"]).cpu_sync_dispatch is True
    result, _ = probe("first", "sync")
    assert result == {"applied": True, "ready_at_return": [True] * 4}


def test_by_default_a_cpu_step_returns_before_its_result():
    assert ServerConfig().cpu_sync_dispatch is False
    result, _ = probe("first", "async")
    assert result["applied"] is True and not any(result["ready_at_return"]), result


def test_after_jax_started_its_devices_it_changes_nothing_and_says_why():
    result, stderr = probe("late", "sync")
    assert result["applied"] is False and not any(result["ready_at_return"]), result
    assert "JAX's CPU dispatch stays asynchronous: JAX started its devices before expertd could set it" in stderr
