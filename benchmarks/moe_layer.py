"""MoE layer forward benchmark: every expert backend against four baselines measured in the same run.

  (a) dense:     every expert on every token, masked by the routing weights (the naive layer)
  (b) roofline:  one dense gated MLP on T*k rows (the same active FLOPs), fastest formulation
  (c) floor:     bytes of the expert weights the batch touches / measured copy bandwidth
                 (read + write, STREAM's convention; the issue's definition). Reported beside it:
  (c') read floor: the same bytes / measured read bandwidth (the fastest of XLA's sum and
                 matrix-vector product and numpy's BLAS one over 256 MiB). A layer only reads its
                 weights, so (c') is the floor this machine can reach. A machine reads slower than
                 it copies (r+w), so (c') lies above (c); the paired floors report by how much, per
                 round (BENCHMARKS.md has the ratios of the machines measured).
  (d) HF:        transformers' MixtralSparseMoeBlock (E=8) / Qwen3MoeSparseMoeBlock (E=64) on torch
                 CPU with the same weights and tokens, in a process of its own with torch's default
                 threads and malloc (benchmarks/hf_peer.py; skipped with a note when torch is not
                 installed)

Shapes: T in {16, 256, 4096}; (E, k, H, I) in {(8, 2, 1024, 2048), (64, 8, 1024, 512)}; bf16 and
fp32. Reports median times, active FLOP/s and ratios; prints a table and writes
benchmarks/results/moe_layer.json. Run it alone (`flock /tmp/expertd-bench.lock ...`): timings
on a shared machine are noisy, so compare the ratios of one run.

Backends whose work grows with E (reference, ragged_dot: E x the active FLOPs on CPU) or with T*E
(capacity, (a)) are skipped above FLOP_CAP, and the Pallas backend (interpret mode on CPU, a GPU
kernel) runs at T=16 only; skipped entries say why. (d) in bf16 is very slow on CPUs without
bf16 matmul units: when one call would exceed HF_CALL_CAP_S it is estimated by a linear fit of
two smaller token counts and marked "fit". The `auto` column compiles with
`moe.compiler_options(cfg, T, dtype=...)`, as the server does per bucket; where its calls are long
(PAIRED_MIN_CALL_S: T=4096 on the dev box) its ratios to (b) and (d) (the issue's targets) come from one
more timing of auto and (b) in alternation ("paired"), and of auto and (d) in alternating whole
timing runs, each side in its own process (hf_peer.Peer.alternate_with; (d) only where one call
takes at most PAIRED_HF_CALL_CAP_S). Shorter `auto` calls (T=16, T=256) are timed once more in alternation with
the copy and read probes instead (bursts of back-to-back layer calls between the probes), and
their (c) and (c') ratios (T=16's target) are the median over the rounds of each round's burst
against that round's floors ("paired floors": a shared VM's bandwidth drifts between runs and
within one, so a layer call is compared with the bandwidth of its own minute). The weights are
moved onto huge pages as the engine places them (expertd.server.host.memory); (d) keeps torch's
defaults.
`auto` runs on `moe.prepare_params(params, cfg)`, as a library user following `moe_layer`'s
docstring and the engine do (on CPU where the native kernel runs: its prepared layout, panels of 64
columns on AVX-512 CPUs, 16 elsewhere); every other backend, (a) and (b) on the params as loaded;
a "weight layout A/B" line times auto on the prepared params, on the params as loaded and on
panels of the other width (`cpu.to_panels`), in alternation (>1x: the prepared params are faster).
The process keeps freed host buffers for reuse as `expertd serve --retain-freed-memory` does
(expertd.server.host.allocator: no page faults on the large buffers of T=4096); (d)'s process keeps
glibc's defaults.

`--options-ab` instead checks the CPU rules on this machine (benchmarks/moe_layer_options.py): the
layer ("expert_loop") compiled with the default options and with YNNPACK off, and "auto" as the
server compiles and serves it, calls interleaved, at T in {1, 4, 16, 64, 128, 256}; `--experts 128`
adds Qwen3-30B-A3B's layer shape; writes benchmarks/results/moe_layer_options_ab.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import harness
import hf_peer  # benchmarks/hf_peer.py, beside this script: (d) in a process of its own
import jax
import jax.numpy as jnp
import moe_layer_options  # benchmarks/moe_layer_options.py: --options-ab
import numpy as np

from expertd.kernels import cpu, experts, moe
from expertd.kernels.cpu import policy as cpu_policy
from expertd.server.host import allocator, memory

SHAPES = harness.LAYER_SHAPES
TOKENS = (16, 256, 4096)
DTYPES = harness.LAYER_DTYPES
BACKENDS = experts.BACKENDS + ("auto",)
FLOP_CAP = 1.0e12  # skip a variant whose real work exceeds this many FLOPs per call
HF_CALL_CAP_S = 60.0
# Where one `auto` call takes at least PAIRED_MIN_CALL_S, auto, (b)'s fastest formulation and (d)
# (when one call of it takes at most PAIRED_HF_CALL_CAP_S) are timed once more in alternation, and
# auto's ratios to (b) and (d) come from that timing: a shared machine's speed drifts over minutes
# by more than the margins those targets are judged by. Shorter calls are left to their own
# medians: a short call right after another program's (or after an idle pause) runs slower than
# back to back, a larger effect than the drift over their short timing.
PAIRED_MIN_CALL_S = 0.1
PAIRED_HF_CALL_CAP_S = 2.0
RESULTS = os.path.join(harness.RESULTS, "moe_layer.json")
AB_RESULTS, AB_TOKENS = moe_layer_options.AB_RESULTS, moe_layer_options.AB_TOKENS


def layer_time(fn, *args):
    """(median seconds per call, first-call seconds incl. compile) of ``fn(*args)``: 3 to 15 timed
    calls, as many as fit in 6 s."""
    timing = harness.time_calls(lambda: jax.block_until_ready(fn(*args)), max_calls=15, budget_s=6.0)
    return timing.median, timing.first_s


def dense_all_experts(params, x, cfg):
    """(a): every expert on every token ([E, T, H] work), weighted by the dense routing weights."""
    ids, weights = moe.route(params, x, cfg)
    dense_w = jnp.zeros((x.shape[0], cfg.num_experts), jnp.float32).at[
        jnp.arange(x.shape[0])[:, None], ids].set(weights)
    xe = jnp.broadcast_to(x, (cfg.num_experts,) + x.shape)
    y = experts.gated_mlp(xe, params.w_gate, params.w_up, params.w_down, cfg.activation)
    return jnp.einsum("eth,te->th", y.astype(jnp.float32), dense_w).astype(x.dtype)


def roofline_variants(dtype):
    """(b) formulations of one dense gated MLP; the fastest is the roofline."""
    def native(x, g, u, d):
        return experts.gated_mlp(x, g, u, d)

    def upcast(x, g, u, d):
        f = lambda a: a.astype(jnp.float32)
        return experts.gated_mlp(f(x), f(g), f(u), f(d)).astype(x.dtype)

    return {"native": native} if dtype == jnp.float32 else {"native": native, "fp32 upcast": upcast}


def measure_hf(cfg, params, family, dtype_name, x, row, keep_open=False):
    """(d): transformers' block in a process of its own (benchmarks/hf_peer.py) on the same weights and
    tokens x [T, H]. Sets row["hf_s"] (seconds per call), row["hf_how"] ("measured", "fit(...)",
    "skipped" or "failed") and row["hf_peer"] (the peer's torch, transformers, threads and experts
    implementation); returns (its output [T, H] fp32 numpy, None where fitted or not run; the peer
    process, kept open for the paired timing when `keep_open` and one call takes at most
    PAIRED_HF_CALL_CAP_S, else None)."""
    if not hf_peer.available():
        row["notes"].append("(d) skipped: torch / transformers not installed (pip install '.[bench]')")
        row["hf_s"], row["hf_how"] = None, "skipped"
        return None, None
    peer = hf_peer.Peer(family, cfg.topk, dtype_name, {name: params[name] for name in hf_peer.WEIGHTS}, x,
                        cap_s=HF_CALL_CAP_S, serve=keep_open)
    try:
        result = peer.measurement()
    except hf_peer.PeerError as e:
        row["notes"].append(f"(d) failed: {e}")
        row["hf_s"], row["hf_how"] = None, "failed"
        return None, None
    row["hf_s"], row["hf_how"] = result["seconds"], result["how"]
    row["hf_peer"] = {name: result[name] for name in ("torch", "transformers", "threads", "experts_implementation")}
    if not (keep_open and result["how"] == "measured" and result["seconds"] <= PAIRED_HF_CALL_CAP_S):
        peer.close()
        peer = None
    return result["output"], peer


def run_case(e, k, h, i, family, t, dtype_name, bandwidth, read_rate, only_backends=None, with_hf=True):
    """One shape: every backend and the baselines; `bandwidth` is the copy rate (r+w) for (c),
    `read_rate` the read rate for (c'), both in bytes/s. `auto` runs on the prepared params
    (`moe.prepare_params`), every other backend on the params as loaded."""
    dtype = jnp.dtype(dtype_name)
    cfg, params, served, auto_backend, x = harness.served_case(e, k, h, i, family, t, dtype)
    active_flops = 2 * 3 * t * k * h * i
    row = dict(E=e, k=k, H=h, I=i, T=t, dtype=dtype_name, family=family, active_gflop=active_flops / 1e9,
               backends={}, notes=[])
    reference = jax.jit(lambda p, v: moe.moe_layer(p, v, cfg, backend="expert_loop", return_routing=True))
    out_ref, routing = reference(params, x)
    touched = int(np.sum(np.asarray(routing["tokens_per_expert"]) > 0))
    row["touched_experts"] = touched
    touched_bytes = touched * 3 * h * i * dtype.itemsize
    row["touched_bytes"] = touched_bytes
    row["floor_s"] = touched_bytes / bandwidth  # STREAM-style copy rate (r+w)
    row["read_floor_s"] = touched_bytes / read_rate
    compiled = {}
    on_cpu = jax.default_backend() == "cpu"
    work = {"reference": e * active_flops, "ragged_dot": e * active_flops if on_cpu else active_flops,
            "capacity": e * 6 * t * h * i, "expert_loop": active_flops, "native_cpu": active_flops,
            "auto": active_flops, "pallas": active_flops}
    for backend in only_backends or BACKENDS:
        if backend == "pallas" and t > 16 and on_cpu:
            row["backends"][backend] = {"skipped": "interpret mode on CPU (a GPU kernel); run at T=16 only"}
            continue
        if backend == "native_cpu" and not on_cpu:
            row["backends"][backend] = {"skipped": "an XLA:CPU kernel"}
            continue
        if work[backend] > FLOP_CAP:
            row["backends"][backend] = {"skipped": f"{work[backend] / 1e12:.1f} TFLOP per call (E x or T*E work)"}
            continue
        # `auto` compiles as a server would: with the options moe.compiler_options picks for T
        options = moe.compiler_options(cfg, t, dtype=dtype) if backend == "auto" else {}
        fn = compiled[backend] = jax.jit(lambda p, v, b=backend: moe.moe_layer(p, v, cfg, backend=b),
                                         compiler_options=options or None)
        p = served if backend == "auto" else params
        median, first = layer_time(fn, p, x)
        err = float(jnp.max(jnp.abs(fn(p, x).astype(jnp.float32) - out_ref.astype(jnp.float32))))
        row["backends"][backend] = {"median_s": median, "first_call_s": first, "max_abs_diff_vs_expert_loop": err}
    row["auto_backend"] = auto_backend
    row["auto_weight_layout"] = cpu.describe(served)["weight_layout"] if served is not params else "row_major"
    row["auto_compiler_options"] = moe.compiler_options(cfg, t, dtype=dtype)
    if e * 6 * t * h * i <= FLOP_CAP:
        row["dense_s"], _ = layer_time(jax.jit(lambda p, v: dense_all_experts(p, v, cfg)), params, x)
    else:
        row["notes"].append("(a) skipped: above FLOP_CAP")
    rows = jax.random.normal(jax.random.key(2), (t * k, h), jnp.float32).astype(dtype)
    w = (params.w_gate[0], params.w_up[0], params.w_down[0])
    # (b) is the fastest formulation, so it also tries the XLA:CPU options the layer may compile with
    option_sets = [("", None)] + ([(" no-ynn", opts)] if (opts := cpu_policy.small_rows_cpu_options())
                                  and jax.default_backend() == "cpu" else [])
    roof_fns = {name + tag: jax.jit(f, compiler_options=opts)
                for name, f in roofline_variants(dtype).items() for tag, opts in option_sets}
    roof = {name: layer_time(fn, rows, *w)[0] for name, fn in roof_fns.items()}
    row["roofline_s"], row["roofline_variant"] = min((v, n) for n, v in roof.items())
    if with_hf:  # its peer process stays up for the paired timing below where there is one
        hf_out, hf = measure_hf(cfg, params.to_dict(), family, dtype_name, x, row,
                                keep_open=row["backends"].get("auto", {}).get("median_s", 0.0) >= PAIRED_MIN_CALL_S)
    else:
        row["hf_s"], row["hf_how"], hf_out, hf = None, "not run (--no-hf)", None, None
    if hf_out is not None:
        row["hf_max_abs_diff"] = float(np.max(np.abs(hf_out - np.asarray(out_ref.astype(jnp.float32)))))
    auto_s = row["backends"].get("auto", {}).get("median_s", 0.0)
    if "auto" in compiled and served is not params:  # the layout's gain: auto on each, interleaved
        row["panel_columns"] = cpu.describe(served)["panel_columns"]
        other = served.replace(**{name: cpu.to_panels(getattr(params, name), 80 - row["panel_columns"])
                                  for name in moe.EXPERT_WEIGHTS})  # the other panel width (16 <-> 64)
        memory.advise_huge_pages(jax.tree.leaves(other))
        row["layout_ab_s"] = harness.interleaved_medians({
            "panels": lambda: jax.block_until_ready(compiled["auto"](served, x)),
            "row_major": lambda: jax.block_until_ready(compiled["auto"](params, x)),
            "other_width_panels": lambda: jax.block_until_ready(compiled["auto"](other, x))}, budget_s=6.0)
    if "auto" in compiled and auto_s >= PAIRED_MIN_CALL_S:  # the target ratios, in alternation
        calls = {"auto": lambda: jax.block_until_ready(compiled["auto"](served, x)),
                 "roofline": lambda: jax.block_until_ready(roof_fns[row["roofline_variant"]](rows, *w))}
        row["paired_s"] = harness.interleaved_medians(calls)
        if hf is not None:  # (d) alternates with auto in whole timing runs, each side in its own process
            row["paired_hf"] = hf.alternate_with(calls["auto"])
            # (d)'s time at the ratio to auto that alternation measured, in this timing's units
            row["paired_s"]["hf"] = row["paired_s"]["auto"] * row["paired_hf"]["peer_x_other"]
    elif "auto" in compiled:  # short calls: the floors measured in alternation with them
        row["paired_floor"] = harness.paired_floors(lambda: jax.block_until_ready(compiled["auto"](served, x)),
                                            touched_bytes)
    if hf is not None:
        hf.close()
    return row


def seconds_of(row, name):
    """A backend's time per call: for `auto`, its median in the paired (interleaved) timing when
    there is one, else its own median."""
    if name == "auto":
        for paired in ("paired_s", "paired_floor"):
            if paired in row:
                return row[paired]["auto"]
    return row["backends"][name]["median_s"]


def ratios(row, name):
    """Ratios of a backend's time to the baselines: >1 for (a), (d) means faster; (b) as a fraction
    of roofline. For `auto`, (b) and (d) come from the paired timing where it has them, (c) and (c')
    from the floors measured in alternation with it (short calls) where it has those: the median of
    the rounds' ratios (`paired_floors`)."""
    seconds = seconds_of(row, name)
    paired = row.get("paired_s", {}) if name == "auto" else {}
    floors = row.get("paired_floor", row) if name == "auto" else row
    hf_s = paired.get("hf", row.get("hf_s"))
    x_read = seconds / floors["read_floor_s"] if floors.get("read_floor_s") else float("nan")
    return {"vs_dense": row.get("dense_s", float("nan")) / seconds,
            "of_roofline": paired.get("roofline", row["roofline_s"]) / seconds,
            "x_floor": floors.get("x_floor", seconds / floors["floor_s"]),
            "x_read_floor": floors.get("x_read_floor", x_read),
            "vs_hf": hf_s / seconds if hf_s else float("nan")}


def auto_label(row):
    """The backend `auto` ran, with "+no-ynn" when it compiled with YNNPACK off."""
    return row["auto_backend"] + ("+no-ynn" if row.get("auto_compiler_options") else "")


def print_table(rows):
    read_col = "x(c')"
    head = (f"{'E':>3} {'k':>2} {'T':>5} {'dtype':>8} {'backend':>12} {'ms':>9} {'GFLOP/s':>8} "
            f"{'vs(a)':>7} {'of(b)':>6} {'x(c)':>7} {read_col:>6} {'vs(d)':>7}")
    print(head)
    print("-" * len(head))
    for row in rows:
        for name, m in row["backends"].items():
            if "skipped" in m:
                continue
            r, seconds = ratios(row, name), seconds_of(row, name)
            print(f"{row['E']:>3} {row['k']:>2} {row['T']:>5} {row['dtype']:>8} {name:>12} "
                  f"{seconds * 1e3:>9.2f} {row['active_gflop'] / seconds:>8.1f} "
                  f"{r['vs_dense']:>7.2f} {r['of_roofline']:>6.2f} {r['x_floor']:>7.2f} {r['x_read_floor']:>6.2f} "
                  f"{r['vs_hf']:>7.2f}")
        base = [f"(a) {row['dense_s'] * 1e3:.1f} ms" if "dense_s" in row else "(a) -",
                f"(b) {row['roofline_s'] * 1e3:.1f} ms [{row['roofline_variant']}]",
                f"(c) {row['floor_s'] * 1e3:.2f} ms ({row['touched_experts']} experts)",
                f"(c') {row['read_floor_s'] * 1e3:.2f} ms" if row.get("read_floor_s") else "(c') -",
                f"(d) {row['hf_s'] * 1e3:.1f} ms [{row['hf_how']}]" if row.get("hf_s") else "(d) -"]
        print(f"{'':>24} baselines: " + ", ".join(base) + f"; auto -> {auto_label(row)}")
        if "paired_s" in row:
            print(f"{'':>24} paired: " + ", ".join(f"{name} {v * 1e3:.2f} ms" for name, v in row["paired_s"].items()))
        if "layout_ab_s" in row:
            ab = row["layout_ab_s"]
            width = row.get("panel_columns", 16)
            other = (f", {80 - width}-column panels {ab['other_width_panels'] * 1e3:.2f} ms "
                     f"({ab['other_width_panels'] / ab['panels']:.2f}x)" if "other_width_panels" in ab else "")
            print(f"{'':>24} weight layout A/B (auto, interleaved): {width}-column panels {ab['panels'] * 1e3:.2f} ms, "
                  f"row-major {ab['row_major'] * 1e3:.2f} ms ({ab['row_major'] / ab['panels']:.2f}x){other}")
        if "paired_floor" in row:
            f = row["paired_floor"]
            print(f"{'':>24} paired floors: auto {f['auto'] * 1e3:.2f} ms, (c) {f['floor_s'] * 1e3:.2f} ms "
                  f"(copy {f['copy_bytes_per_s'] / 1e9:.1f} GB/s), (c') {f['read_floor_s'] * 1e3:.2f} ms "
                  f"(read {f['read_bytes_per_s'] / 1e9:.1f} GB/s) at the fastest probes; per round x (c) "
                  f"{harness.spread(f['rounds']['x_floor'])}, x (c') {harness.spread(f['rounds']['x_read_floor'])}"
                  f"; (c') in units of (c) {harness.spread(f['rounds']['read_floor_x_floor'])}")


def markdown(rows):
    """The BENCHMARKS.md table: one line per shape, auto's time and ratios, the other backends."""
    out = ["| E | k | T | dtype | auto (backend) ms | GFLOP/s | vs (a) | of (b) | x (c) | x (c') | vs (d) "
           "| others ms |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        auto = row["backends"].get("auto")
        if not auto or "skipped" in auto:
            continue
        r, seconds = ratios(row, "auto"), seconds_of(row, "auto")
        others = ", ".join(f"{n} {m['median_s'] * 1e3:.0f}" for n, m in row["backends"].items()
                           if n != "auto" and "skipped" not in m)
        hf = "" if row.get("hf_how") == "measured" else f" ({row.get('hf_how')})"
        out.append(f"| {row['E']} | {row['k']} | {row['T']} | {row['dtype']} | {seconds * 1e3:.1f} "
                   f"({auto_label(row)}) | {row['active_gflop'] / seconds:.1f} | {r['vs_dense']:.2f} | "
                   f"{r['of_roofline']:.2f} | {r['x_floor']:.1f} | {r['x_read_floor']:.2f} | {r['vs_hf']:.2f}{hf} | "
                   f"{others} |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="*", help=f"default {TOKENS} ({AB_TOKENS} with --options-ab)")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES))
    parser.add_argument("--experts", type=int, nargs="*", default=[s[0] for s in SHAPES])
    parser.add_argument("--backends", nargs="*", default=None)
    parser.add_argument("--no-hf", action="store_true", help="skip (d), the transformers peer")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--markdown", metavar="JSON", help="print the BENCHMARKS.md table of a results file and exit")
    parser.add_argument("--options-ab", action="store_true",
                        help="A/B the layer's expert_loop with and without cpu.policy.SMALL_ROWS_CPU_OPTIONS and "
                             f"auto as served (interleaved) at T in {AB_TOKENS} (or --tokens; --experts 128 adds "
                             f"Qwen3-30B-A3B's shape); writes {os.path.basename(AB_RESULTS)}")
    args = parser.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)["rows"]))
        return
    allocator.retain_freed_memory()  # as `serve --retain-freed-memory`, before JAX's first computation
    load_before = os.getloadavg()
    matmul_rate = None
    if args.options_ab:
        name, bandwidth, read_rate, rows = "moe_layer_options_ab", None, None, moe_layer_options.run(args)
        out = AB_RESULTS if args.out == RESULTS else args.out
        save = _saver(out, name, rows, xla_flags=os.environ.get("XLA_FLAGS", ""), load_average_before=load_before,
                      copy_bandwidth_bytes_per_s=None, read_bandwidth_bytes_per_s=None)
    else:
        bandwidth, read_rate = harness.copy_bandwidth(), harness.read_bandwidth()
        print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write), read bandwidth {read_rate / 1e9:.1f} GB/s; "
              f"jax {jax.__version__} on {jax.default_backend()}")
        if jax.default_backend() == "gpu":  # the GPU target: T=4096 at >= 60% of this
            matmul_rate = harness.dense_matmul_rate()
            print(f"dense bf16 matmul (8192^3, random data): {matmul_rate / 1e12:.0f} TFLOP/s")
        name, out, rows = "moe_layer", args.out, []
        save = _saver(out, name, rows, xla_flags=os.environ.get("XLA_FLAGS", ""), load_average_before=load_before,
                      copy_bandwidth_bytes_per_s=bandwidth, read_bandwidth_bytes_per_s=read_rate,
                      **({"dense_bf16_matmul_flops_per_s": matmul_rate} if matmul_rate else {}))
        for (e, k, h, i, family), dtype_name, t in harness.selected_cases(args, SHAPES, TOKENS):
            rows.append(run_case(e, k, h, i, family, t, dtype_name, bandwidth, read_rate, args.backends,
                                 not args.no_hf))
            print_table(rows[-1:])
            sys.stdout.flush()
            save(complete=False)  # a run stopped by a time limit keeps the shapes it finished
        print()
        print_table(rows)
    save(complete=True)


def _saver(out, name, rows, **fields):
    """A function writing the rows so far (`complete=False` while the run goes on)."""
    def save(complete):
        harness.write_results(out, name, rows, complete=complete, **fields)
    return save


if __name__ == "__main__":
    main()
