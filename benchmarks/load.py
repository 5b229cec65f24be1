"""Checkpoint loading: time and peak memory of `load_checkpoint` against reading the files' bytes.

A synthetic DeepSeek-V3 checkpoint is written to a temporary directory: decoder layer 3 (the first
MoE layer) at full size, E=256 routed experts of H=7168, I=2048 (one shared expert, router, bias),
in two formats: bfloat16, and FP8 e4m3 with 128x128 float32 block scales (`weight_scale_inv`, as
DeepSeek ships it). Per format:

- read: the time to read every byte of the checkpoint's files (16 MiB `readinto` chunks), cold;
- load: `expertd.server.models.checkpoint.load_checkpoint(dir, dtype="bfloat16")` in a fresh process,
  cold: wall time, and the process's peak RSS above its RSS before loading (after imports);
- the ratios load / read (goal: <= 2) and peak RSS / served weights (goal: <= 1.5);
- "fp8->int8": the FP8 checkpoint loaded as `--expert-weights int8` serves it on CPU
  (`load_checkpoint(dir, fp8_as_int8=True)`: each routed expert converted from its stored codes to
  INT8 panels as it is read, `kernels.cpu.int8.Int8FromFp8`), against the read of the same FP8 files
  (goal, issue 50: load <= 1.5x the read); served bytes are then the INT8 weights and the rest;
- touch: the machine's other floor, writing the served bytes into fresh memory once in a fresh
  process (the loader's huge-page allocation, first touch: the kernel zeroes every page, and a VM's
  host may back it only then), measured after each load.

Both formats are written first; then ``--rounds`` (3) rounds each read and load both formats cold,
alternating, and the table gives every round and each format's range (a read right after a large
write runs slower on some virtual disks: the rounds show it).

Cold means: the files' pages are evicted from the page cache before each run with
`posix_fadvise(POSIX_FADV_DONTNEED)` after an `fsync` (clean pages are dropped; a page another
process maps stays). The table says whether eviction was possible. `--warm` also runs both warm.

Run: `.venv/bin/python benchmarks/load.py [--quick] [--experts N] [--rounds N] [--dir DIR] [--workers N] [--out F]`
  --quick: 4 experts (about 0.4 GB bf16) to prove the script works; the full run writes about
  34 GB (22.6 GB bf16 + 11.3 GB FP8) and needs as much free disk and ~24 GB of memory for the bf16
  load. Writes benchmarks/results/load.json (load_quick.json with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import harness
import ml_dtypes
import numpy as np

RESULTS = harness.RESULTS
H, I, LAYER = 7168, 2048, 3
CHUNK = 16 << 20
AS_INT8 = "fp8->int8"  # the FP8 files loaded as --expert-weights int8 serves them on CPU
BLOCK = 128
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)


def config(experts: int, quantized: bool) -> dict:
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
           "moe_intermediate_size": I, "intermediate_size": 18432, "num_hidden_layers": LAYER + 1,
           "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": min(8, experts),
           "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
           "scoring_func": "sigmoid", "first_k_dense_replace": LAYER, "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    if quantized:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK]}
    return out


def _tensors(experts: int, quantized: bool):
    """(name, shape, dtype, maker) of every tensor, in file order; makers build one tensor at a time."""
    rng = np.random.default_rng(0)
    base = {shape: rng.standard_normal(shape, dtype=np.float32) * 0.02 for shape in ((I, H), (H, I))}
    p = f"model.layers.{LAYER}.mlp."
    yield p + "gate.weight", (experts, H), BF16, lambda: (rng.standard_normal((experts, H)) * 0.02).astype(BF16)
    yield p + "gate.e_score_correction_bias", (experts,), np.dtype(np.float32), \
        lambda: np.zeros(experts, np.float32)
    modules = [f"experts.{j}.{n}" for j in range(experts) for n in ("gate_proj", "up_proj", "down_proj")]
    modules += [f"shared_experts.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    for k, module in enumerate(modules):
        shape = (H, I) if module.endswith("down_proj") else (I, H)
        if quantized:
            yield p + module + ".weight", shape, E4M3, lambda s=shape, k=k: (base[s] * 40 + k % 7).astype(E4M3)
            scales = (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))
            yield p + module + ".weight_scale_inv", scales, np.dtype(np.float32), \
                lambda s=scales: np.full(s, 1 / 448, np.float32)
        else:
            yield p + module + ".weight", shape, BF16, lambda s=shape, k=k: (base[s] + k * 1e-3).astype(BF16)


def write_checkpoint(path: pathlib.Path, experts: int, quantized: bool, shard_bytes: int = 4 << 30) -> int:
    """Write the checkpoint shard by shard (one tensor in memory at a time); returns its bytes."""
    path.mkdir(parents=True, exist_ok=True)
    names = {np.dtype(np.float32): "F32", BF16: "BF16", E4M3: "F8_E4M3"}
    shards, current, size = [], [], 0
    for entry in _tensors(experts, quantized):
        nbytes = int(np.prod(entry[1])) * entry[2].itemsize
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for n, shard in enumerate(shards, start=1):
        filename = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape, dtype, _make in shard:
            nbytes = int(np.prod(shape)) * dtype.itemsize
            header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = filename
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(path / filename, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for _name, _shape, _dtype, make in shard:
                f.write(np.ascontiguousarray(make()).tobytes())
            f.flush()
            os.fsync(f.fileno())
        total += 8 + len(text) + offset
    (path / "config.json").write_text(json.dumps(config(experts, quantized)))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


def evict(path: pathlib.Path) -> bool:
    """Drop the checkpoint files' pages from the page cache (clean pages only); False if not possible."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in path.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_seconds(path: pathlib.Path) -> float:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    started = time.perf_counter()
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - started


def child(path: str, workers: int, as_int8: bool = False) -> None:
    """In a fresh process: load and print {seconds, rss_before, peak_rss, served_bytes} as JSON."""
    import jax

    from expertd.kernels import cpu, moe
    from expertd.server.models.checkpoint import load_checkpoint, plan_checkpoint

    plan = plan_checkpoint(path, dtype="bfloat16")
    cpu.available()  # the native library built or loaded before the clock starts, as a server has it
    before = _rss()
    started = time.perf_counter()
    layers = load_checkpoint(path, dtype="bfloat16", workers=workers, fp8_as_int8=as_int8)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = layers[0].params
    assert moe.logical_shape(params["w_gate"]) == (plan.layers[0].cfg.num_experts, H, I)
    if as_int8:
        assert all(params[n].int8 for n in moe.EXPERT_WEIGHTS), "the routed experts were converted"
    served = sum(leaf.nbytes for layer in layers for leaf in jax.tree.leaves(layer.params))
    print(json.dumps({"seconds": seconds, "rss_before": before, "peak_rss": peak, "served_bytes": served}))


def touch_child(nbytes: int) -> None:
    """In a fresh process: print the seconds to write `nbytes` of fresh memory once, as JSON."""
    from expertd.server.models.checkpoint_layer import host_empty

    started = time.perf_counter()
    host_empty((nbytes,), np.uint8).fill(1)
    print(json.dumps({"seconds": time.perf_counter() - started}))


def touch_seconds(nbytes: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--touch", str(nbytes)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["seconds"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_run(path: pathlib.Path, workers: int, as_int8: bool = False) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path), "--workers", str(workers)]
                         + (["--as-int8"] if as_int8 else []), check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(path: pathlib.Path, fmt: str, mode: str, experts: int, file_bytes: int, workers: int) -> dict:
    """One read and one load of the checkpoint at ``path``, both cold (evicted first) or both warm."""
    cold = mode == "cold"
    evicted = evict(path) if cold else False
    read = read_seconds(path)
    if cold:
        evict(path)
    loaded = load_run(path, workers, as_int8=fmt == AS_INT8)
    peak = loaded["peak_rss"] - loaded["rss_before"]
    touch = touch_seconds(loaded["served_bytes"])
    return {"format": fmt, "mode": mode, "evicted": evicted, "experts": experts, "file_bytes": file_bytes,
            "served_bytes": loaded["served_bytes"], "read_s": read, "load_s": loaded["seconds"],
            "load_over_read": loaded["seconds"] / read, "peak_rss_bytes": peak,
            "peak_over_served": peak / loaded["served_bytes"], "read_gb_s": file_bytes / read / 1e9,
            "load_gb_s": file_bytes / loaded["seconds"] / 1e9, "touch_s": touch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 experts: prove the script works")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (default 256; --quick: 4)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    parser.add_argument("--workers", type=int, default=None, help="loader threads (default: the loader's)")
    parser.add_argument("--warm", action="store_true", help="also time warm (cached) read and load")
    parser.add_argument("--rounds", type=int, default=3, help="cold read-and-load rounds, formats alternating "
                        "(default 3; the table gives each and the range)")
    parser.add_argument("--out", default=None, help="the JSON to write (default results/load.json, "
                        "load_quick.json with --quick)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--as-int8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--touch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from expertd.server.models.checkpoint import DEFAULT_WORKERS

    workers = args.workers or DEFAULT_WORKERS
    if args.touch:
        touch_child(args.touch)
        return
    if args.child:
        child(args.child, workers, args.as_int8)
        return
    experts = args.experts or (4 if args.quick else 256)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        paths = {}
        for fmt, quantized in (("bf16", False), ("fp8-128x128", True)):  # both written before any is timed
            path = pathlib.Path(tmp) / fmt
            paths[fmt] = path, write_checkpoint(path, experts, quantized)
        paths[AS_INT8] = paths["fp8-128x128"]  # the same files, loaded as INT8
        runs = [("cold", args.rounds)] + ([("warm", 1)] if args.warm else [])
        for mode, rounds in runs:
            for round_, fmt in harness.alternate(rounds, paths):  # the formats alternate within each round
                rows.append({"round": round_, **measure(paths[fmt][0], fmt, mode, experts, paths[fmt][1], workers)})
        for path, _ in set(paths.values()):
            (path / "config.json").unlink()
    print(f"{'format':>12} {'mode':>5} {'round':>5} {'files GB':>9} {'served GB':>9} {'read s':>8} {'load s':>8} "
          f"{'load/read':>9} {'peak GB':>8} {'peak/served':>11} {'touch s':>8}")
    for r in rows:
        print(f"{r['format']:>12} {r['mode']:>5} {r['round']:>5} {r['file_bytes'] / 1e9:9.3f} "
              f"{r['served_bytes'] / 1e9:9.3f} {r['read_s']:8.3f} {r['load_s']:8.3f} {r['load_over_read']:9.2f} "
              f"{r['peak_rss_bytes'] / 1e9:8.3f} {r['peak_over_served']:11.2f} {r['touch_s']:8.3f}"
              + ("" if r["evicted"] or r["mode"] == "warm" else "  (not evicted)"))
    for fmt in paths:
        cold = [r for r in rows if r["format"] == fmt and r["mode"] == "cold"]
        print(f"{fmt:>12} cold, {len(cold)} rounds: " + ", ".join(
            f"{key} {harness.span((r[key] for r in cold), collapse=False)}"
            for key in ("read_s", "load_s", "load_over_read", "peak_over_served", "touch_s")))
    print(f"goals: load/read <= 2 (<= 1.5 for {AS_INT8}), peak/served <= 1.5")
    result = {"benchmark": "load", "date": harness.machine.now(),
              "machine": harness.machine.summary(with_processor=True), "workers": workers, "quick": args.quick,
              "shape": {"experts": experts, "hidden": H, "intermediate": I, "block": BLOCK}, "rows": rows}
    out = args.out or RESULTS / ("load_quick.json" if args.quick else "load.json")
    harness.write_json(out, result, indent=2)


if __name__ == "__main__":
    main()
