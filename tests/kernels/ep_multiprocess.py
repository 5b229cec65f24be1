"""Multi-process expert parallelism on CPU: N processes x D CPU devices joined by jax.distributed
(gloo collectives), each running the same `ep_moe_layer` call on one global mesh.

`run_workers(...)` (used by the tests) starts the processes as subprocesses with hard timeouts: a
process whose peer never arrives aborts (SIGABRT after `initialization_timeout`) instead of
raising, and anything still running at the deadline is killed, so a test can fail but never hang.

Run as a script, this file is one worker: it loads the inputs the test wrote (`--inputs`, an .npz
of `case()`: generating them here would cost every worker a few seconds of eager JAX compiles),
runs them on the global mesh and (process 0) writes the gathered outputs to `--out`.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import socket
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
NUM_TOKENS, HIDDEN, INTERMEDIATE = 24, 32, 16


def case():
    """(cfg, params, x): a DeepSeek-V3-style layer (sigmoid, bias, groups, scaling, shared expert)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from expertd.kernels import moe

    cfg = case_config()
    params = jax.tree.map(np.asarray, moe.init_params(cfg, jax.random.key(0), jnp.float32))
    x = np.asarray(jax.random.normal(jax.random.key(1), (NUM_TOKENS, HIDDEN), jnp.float32))
    return cfg, params, x


def family_layer_config(family: str, num_experts: int = 8, topk: int = 2, hidden: int = HIDDEN,
                        intermediate: int = INTERMEDIATE):
    """A MoEConfig with `family`'s router settings at a (tiny) test shape (what the server's
    registry makes of such a family's config.json).

    mixtral: softmax over the top-k logits. qwen2_moe: softmax, norm_topk_prob=False (pre-softmax
    weights), sigmoid-gated shared expert. qwen3_moe: softmax, norm_topk_prob=True. deepseek_v3:
    sigmoid + selection bias, group-limited top-k (E/2 groups of 2, topk/2 kept), normalised,
    scaled by 2.5, one shared expert.
    """
    from expertd.kernels.moe import MoEConfig

    base = dict(num_experts=num_experts, topk=topk, hidden_size=hidden, intermediate_size=intermediate)
    if family == "mixtral" or family == "qwen3_moe":
        return MoEConfig(**base)
    if family == "qwen2_moe":
        return MoEConfig(**base, use_pre_softmax=True, num_shared_experts=1,
                         shared_intermediate_size=intermediate + 8, shared_expert_gate=True)
    grouped = num_experts // 2 > 1
    return MoEConfig(**base, score_function="sigmoid", use_expert_bias=True,
                     num_groups=num_experts // 2 if grouped else None, group_topk=topk // 2 if grouped else None,
                     norm_topk_prob=True, scaling_factor=2.5, num_shared_experts=1,
                     shared_intermediate_size=intermediate)


def case_config():
    return family_layer_config("deepseek_v3")


MODES = ("capacity", "eplb")  # the CPU path, and the same with 4 redundant slots of a fixed placement
# (the ragged path's offsets are covered in one process)


def eplb_placement(num_ranks: int):
    """The fixed placement of the "eplb" mode: 4 redundant slots for a load rising with the expert id."""
    import numpy as np

    from expertd.kernels import eplb

    return eplb.plan_placement(np.arange(1.0, case_config().num_experts + 1) ** 2, num_ranks, 4)


def run_case(mesh, params, x):
    """Outputs and stats of each mode in MODES on `mesh`, gathered to host numpy on every process;
    params: {name: host array} (what the workers read back from the inputs file)."""
    import numpy as np
    from jax.experimental import multihost_utils

    from expertd.kernels import ep, moe

    cfg = case_config()
    logical = moe.MoEParams.from_dict(params, cfg)
    placement = eplb_placement(mesh.shape["ep"])
    results = {}
    for mode in MODES:
        chosen = placement if mode == "eplb" else None
        placed = ep.shard_params(logical, cfg, mesh, placement=chosen)  # each process builds its own shards
        out, stats = ep.ep_moe_layer(placed, x, cfg, mesh, dispatch="capacity", return_stats=True, placement=chosen)
        results[f"out_{mode}"] = multihost_utils.process_allgather(out, tiled=True)
        for name, value in stats.items():
            results[f"{name}_{mode}"] = multihost_utils.process_allgather(value, tiled=True)
    return {k: np.asarray(v) for k, v in results.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(inputs_path, out_path, *, num_processes=2, devices_per_process=2, start=None, timeout=120.0,
                initialization_timeout=30):
    """Start workers `start` (default all process ids) and wait at most `timeout` seconds.

    Returns [(returncode, stderr_text)] per started worker; a worker still running at the deadline
    is killed and reported with returncode None.
    """
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices_per_process))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    procs = []
    for pid in range(num_processes) if start is None else start:
        cmd = [sys.executable, str(HERE / "ep_multiprocess.py"), "--process-id", str(pid),
               "--num-processes", str(num_processes), "--port", str(port), "--inputs", str(inputs_path),
               "--out", str(out_path),
               "--devices", str(devices_per_process), "--init-timeout", str(initialization_timeout)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            results.append((proc.returncode, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            _, err = proc.communicate()
            results.append((None, err))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--init-timeout", type=int, required=True)
    parser.add_argument("--inputs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import jax
    import numpy as np
    from jax.sharding import AxisType

    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=args.init_timeout)
    num_devices = args.num_processes * args.devices
    mesh = jax.make_mesh((num_devices,), ("ep",), axis_types=(AxisType.Auto,))
    with np.load(args.inputs) as inputs:
        arrays = dict(inputs)
    x = arrays.pop("x")
    results = run_case(mesh, arrays, x)
    if jax.process_index() == 0:
        np.savez(args.out, num_global_devices=jax.device_count(), **results)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
