"""CPU MoE layer engines side by side: expertd against vLLM CPU's fused MoE, kt-kernel and
transformers, each in a process of its own, on the same weights, tokens and routing, against the
machine's floor measured in the same run.

  flock /tmp/expertd-bench.lock .venv/bin/python benchmarks/cpu_peers.py \
      [--shapes qwen3,gptoss] [--tokens 1,16,64,256,1024] [--rounds 3] \
      [--engines expertd,vllm,kt,transformers] [--vllm-python .venv-vllm/bin/python] \
      [--kt-python .venv-kt/bin/python] [--out benchmarks/results/cpu_peers.json]

Shapes (SHAPES, bf16, Qwen3-MoE routing: softmax, top-k, renormalised; SwiGLU experts): "qwen3" is
Qwen3-30B-A3B's layer (E 128, k 8, H 2048, I 768), "gptoss" gpt-oss-20b's sizes (E 32, k 4,
H = I = 2880; its clamped activation and biases left out, so every engine runs the same math). The
weights are random (seeded), the router's too, so routing spreads tokens over the experts about evenly.

Engines (benchmarks/cpu_peer_engines.py has how each is built and called): expertd and transformers run
in this interpreter's environment (.venv: `make install`), vLLM in .venv-vllm (`make install-vllm`), kt-kernel
in .venv-kt (`make install-kt`: `pip install --no-deps kt-kernel==0.7.2` beside torch 2.13). An engine
whose interpreter is missing or which cannot start here is reported with why, and the run goes on.

Method: every engine process loads the case, runs each token count once (its output, checked here
against a numpy reference of the layer: relative Frobenius error, AGREE_TOL), then the rounds: in each
round the floor process measures the read rate once, then for each token count every engine, in an order
that reverses every other round (harness.order), times a burst of calls (BURST_S of calls, 1 to
MAX_BURST) while every other engine's process is stopped (SIGSTOP: no idle pool spins beside the one
timed). A round's time is its burst's median; reported are the median over rounds and the range of the
rounds. "floor" = max(bytes of the experts the batch touches / that round's read rate, the layer's
FLOPs / torch's fastest dense matmul rate in this run); ratios (to the floor, expertd over a peer) are
per round, then their median and range. Writes a table and benchmarks/results/cpu_peers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import harness
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "cpu_peer_engines.py"
SHAPES = {"qwen3": (128, 8, 2048, 768), "gptoss": (32, 4, 2880, 2880)}
"""(E, k, H, I) of each shape name."""
TOKENS = (1, 16, 64, 256, 1024)
PEERS = ("vllm", "kt", "transformers")
ENGINES = ("expertd",) + PEERS
AGREE_TOL = 2e-2       # relative Frobenius error an engine's output may have against the reference
BURST_S = 1.0          # a round times about this many seconds of calls of one engine and token count
MAX_BURST = 10
READY_TIMEOUT_S = 1800.0
CALL_TIMEOUT_S = 120.0  # beyond the burst's expected time


# ---- the case and its reference ------------------------------------------------------------

def write_case(case_dir: pathlib.Path, shape: str, tokens, seed: int = 0) -> dict:
    """Write shape's case (cpu_peer_engines' layout) into case_dir; the meta dict."""
    import ml_dtypes

    e, k, h, i = SHAPES[shape]
    rng = np.random.default_rng(seed)
    case_dir.mkdir(parents=True, exist_ok=True)

    def bf16_bits(a):
        return a.astype(ml_dtypes.bfloat16).view(np.uint16)

    np.save(case_dir / "router_weight.npy", bf16_bits(rng.standard_normal((h, e), np.float32)).view(
        ml_dtypes.bfloat16).astype(np.float32))  # bf16-valued fp32, as a bf16 checkpoint's router loads
    for name, (rows, cols) in (("w_gate", (h, i)), ("w_up", (h, i)), ("w_down", (i, h))):
        out = np.lib.format.open_memmap(case_dir / f"{name}.npy", mode="w+", dtype=np.uint16, shape=(e, rows, cols))
        for j in range(e):
            out[j] = bf16_bits(rng.standard_normal((rows, cols), np.float32) * rows ** -0.5)
        out.flush()
        del out
    for t in tokens:
        np.save(case_dir / f"x_{t}.npy", bf16_bits(rng.standard_normal((t, h), np.float32)))
    meta = {"shape": shape, "topk": k, "tokens": list(tokens)}
    (case_dir / "meta.json").write_text(json.dumps(meta))
    return meta


def routing(x32, router_weight, k: int):
    """Qwen3-MoE's routing in numpy fp32: (ids [T, k], weights [T, k])."""
    logits = x32 @ router_weight
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, -1)
    return ids, weights / weights.sum(-1, keepdims=True)


def reference(case_dir: pathlib.Path, t: int, k: int) -> tuple[np.ndarray, int]:
    """(the layer's output fp32 [T, H] by numpy, the number of experts the batch touches): fp32
    products of the bf16 weights, the SwiGLU intermediate rounded to bf16 as every engine does."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    load = {n: np.load(case_dir / f"{n}.npy", mmap_mode="r") for n in ("w_gate", "w_up", "w_down")}
    x = np.load(case_dir / f"x_{t}.npy").view(bf16).astype(np.float32)
    ids, weights = routing(x, np.load(case_dir / "router_weight.npy"), k)
    out = np.zeros_like(x)
    touched = np.unique(ids)
    for e in touched:
        rows, slot = np.nonzero(ids == e)
        xs = x[rows]
        g = xs @ load["w_gate"][e].view(bf16).astype(np.float32)
        u = xs @ load["w_up"][e].view(bf16).astype(np.float32)
        hidden = (g / (1 + np.exp(-g)) * u).astype(bf16).astype(np.float32)
        out[rows] += weights[rows, slot, None] * (hidden @ load["w_down"][e].view(bf16).astype(np.float32))
    return out, len(touched)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


# ---- the engine processes ------------------------------------------------------------------

class Engine:
    """One engine's worker process (cpu_peer_engines.py): started, its ready line read, then commands;
    stopped (SIGSTOP) between them by the caller's `active` block."""

    def __init__(self, name: str, python: str, case_dir: pathlib.Path, out_dir: pathlib.Path, extra=()):
        self.name, self.ready, self.error = name, None, None
        self.proc = subprocess.Popen([python, str(WORKER), name, str(case_dir), "--out", str(out_dir), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     cwd=ROOT, env={**os.environ, "PYTHONPATH": str(HERE)})

    def read_line(self, timeout_s: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            raise RuntimeError(f"{self.name}: no answer in {timeout_s:.0f} s" if code is None else
                               f"{self.name}: the worker exited with {code} (its stderr above)")
        return json.loads(line)

    def wait_ready(self) -> dict | None:
        try:
            self.ready = self.read_line(READY_TIMEOUT_S)
        except RuntimeError as exc:
            self.ready = {"ready": False, "error": str(exc)}
        if not self.ready.get("ready"):
            self.error = self.ready.get("error")
            self.close()
            return None
        self.pause()
        return self.ready

    def ask(self, command: str, timeout_s: float) -> dict:
        self.proc.send_signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(command + "\n")
            reply = self.read_line(timeout_s)
        finally:
            self.pause()
        if "error" in reply:
            raise RuntimeError(f"{self.name}: {reply['error']}")
        return reply

    def pause(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def interpreter(engine: str, args) -> str | None:
    """The Python an engine runs under, or None where it is not installed."""
    path = {"vllm": args.vllm_python, "kt": args.kt_python}.get(engine, sys.executable)
    return path if shutil.which(path) or os.access(path, os.X_OK) else None


# ---- one shape ----------------------------------------------------------------------------

def burst_size(warm_s: float) -> int:
    return max(1, min(MAX_BURST, round(BURST_S / max(warm_s, 1e-6))))


def run_shape(shape: str, args, work: pathlib.Path) -> dict:
    e, k, h, i = SHAPES[shape]
    case_dir, out_dir = work / shape, work / f"{shape}-out"
    print(f"\n== {shape}: E {e}, k {k}, H {h}, I {i}; writing the case", flush=True)
    write_case(case_dir, shape, args.tokens)
    result = {"shape": dict(zip(("E", "k", "H", "I"), SHAPES[shape])), "engines": {}, "tokens": {}}
    engines = {}
    for name in args.engines:
        python = interpreter(name, args)
        if python is None:
            result["engines"][name] = {"available": False, "why": f"no interpreter for {name}"}
            continue
        extra = ("--kt-threads", str(args.kt_threads)) if name == "kt" else ()
        engines[name] = Engine(name, python, case_dir, out_dir, extra)
    floor = Engine("floor", sys.executable, case_dir, out_dir)
    for engine in list(engines.values()) + [floor]:  # they load side by side; each then waits stopped
        if engine.wait_ready() is None:
            print(f"  {engine.name}: not available: {engine.error}", flush=True)
            result["engines"][engine.name] = {"available": False, "why": engine.error}
            engines.pop(engine.name, None)
        elif engine is not floor:
            result["engines"][engine.name] = {"available": True, **engine.ready}
            print(f"  {engine.name}: ready in {engine.ready['prepare_s']:.0f} s {engine.ready['info']}", flush=True)
    if floor.error:
        raise RuntimeError(f"the floor's process did not start: {floor.error}")
    try:
        dense = floor.ask("dense", 600)
        result["dense_flop_per_s"], result["dense_how"] = dense["flop_per_s"], dense["how"]
        for t in args.tokens:
            want, touched = reference(case_dir, t, k)
            row = {"touched_experts": touched, "touched_bytes": touched * 3 * h * i * 2,
                   "flops": 2 * t * k * 3 * h * i, "times": {}, "rel_error": {}, "skipped": {}}
            for name, engine in engines.items():
                if str(t) in engine.ready["skipped"]:
                    row["skipped"][name] = engine.ready["skipped"][str(t)]
                    continue
                row["rel_error"][name] = relative_error(np.load(out_dir / f"{name}_{t}.npy"), want)
                row["times"][name] = []
            result["tokens"][t] = row
        result["read_bytes_per_s"] = []
        for round_index in range(args.rounds):
            result["read_bytes_per_s"].append(floor.ask("read 3", 120)["bytes_per_s"])
            for t_index, t in enumerate(args.tokens):
                row = result["tokens"][t]
                for name in harness.order(list(row["times"]), round_index + t_index):
                    n = burst_size(engines[name].ready["warm_s"][str(t)])
                    calls = engines[name].ask(f"time {t} {n}", CALL_TIMEOUT_S + 3 * n * args.cap_s)["calls"]
                    row["times"][name].append(statistics.median(calls))
            print(f"  round {round_index + 1}/{args.rounds} done", flush=True)
    finally:
        for engine in list(engines.values()) + [floor]:
            engine.close()
    summarise(result)
    return result


def summarise(result: dict) -> None:
    """Per token count: each engine's median and range over rounds, the floor per round, and the
    per-round ratios (to the floor; expertd over each peer)."""
    reads, dense = result["read_bytes_per_s"], result["dense_flop_per_s"]
    for row in result["tokens"].values():
        row["floor_s"] = [max(row["touched_bytes"] / r, row["flops"] / dense) for r in reads]
        row["median_s"] = {n: statistics.median(v) for n, v in row["times"].items()}
        row["range_s"] = {n: [min(v), max(v)] for n, v in row["times"].items()}
        row["x_floor"] = {n: harness.ratios(v, row["floor_s"]) for n, v in row["times"].items()}
        if "expertd" in row["times"]:
            row["expertd_over"] = {n: harness.ratios(row["times"]["expertd"], v)
                                   for n, v in row["times"].items() if n != "expertd"}
        row["agrees"] = {n: err <= AGREE_TOL for n, err in row["rel_error"].items()}


def print_shape(shape: str, result: dict, engines) -> None:
    rows = []
    for t, row in result["tokens"].items():
        line = {"T": t, "floor ms": statistics.median(row["floor_s"]) * 1e3}
        for name in engines:
            if name in row["times"]:
                low, high = row["range_s"][name]
                mark = "" if row["agrees"][name] else " (!)"
                line[f"{name} ms"] = f"{row['median_s'][name] * 1e3:.3g} ({low * 1e3:.3g}-{high * 1e3:.3g}){mark}"
            elif name in row["skipped"]:
                line[f"{name} ms"] = "skipped"
        if "expertd" in row["times"]:
            line["expertd x floor"] = harness.spread(row["x_floor"]["expertd"])
            for name, values in row.get("expertd_over", {}).items():
                line[f"expertd / {name}"] = harness.spread(values)
        rows.append(line)
    columns = ["T"] + [f"{n} ms" for n in engines] + ["floor ms", "expertd x floor"] + [
        f"expertd / {n}" for n in engines if n != "expertd"]
    harness.print_table(f"{shape}: ms per layer call, median (range) over rounds; (!) = output off the "
                        f"reference by more than {AGREE_TOL}", rows, columns)
    missing = {n: v["why"] for n, v in result["engines"].items() if not v.get("available")}
    if missing:
        print("not run: " + "; ".join(f"{n}: {why}" for n, why in missing.items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cap-s", type=float, default=20.0, help="a call estimated longer than this is not run")
    parser.add_argument("--kt-threads", type=int, default=os.cpu_count())
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm/bin/python"))
    parser.add_argument("--kt-python", default=str(ROOT / ".venv-kt/bin/python"))
    parser.add_argument("--out", type=pathlib.Path, default=harness.RESULTS / "cpu_peers.json")
    parser.add_argument("--shape-override", help=argparse.SUPPRESS)  # tests: "E,k,H,I" for every shape
    args = parser.parse_args(argv)
    args.tokens = sorted({int(t) for t in args.tokens.split(",")})
    args.engines = [n for n in args.engines.split(",") if n]
    unknown = [n for n in args.engines if n not in ENGINES] + [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        parser.error(f"unknown engines or shapes {unknown}; engines are {ENGINES}, shapes {tuple(SHAPES)}")
    if args.shape_override:
        for name in SHAPES:
            SHAPES[name] = tuple(int(v) for v in args.shape_override.split(","))
    started = harness.machine.now()
    results = {}
    with tempfile.TemporaryDirectory(prefix="expertd-cpu-peers-") as work:
        for shape in args.shapes.split(","):
            results[shape] = run_shape(shape, args, pathlib.Path(work))
            print_shape(shape, results[shape], args.engines)
    harness.write_json(args.out, {"benchmark": "cpu_peers", "date": harness.machine.today(), "started": started,
                                  "finished": harness.machine.now(), "rounds": args.rounds,
                                  "agree_tol": AGREE_TOL, "shapes": results})
    return 0


if __name__ == "__main__":
    start = time.perf_counter()
    code = main()
    print(f"({time.perf_counter() - start:.0f} s)")
    sys.exit(code)
