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
moved onto huge pages as the engine places them (expertd.server.host_memory); (d) keeps torch's
defaults.
`auto` runs on `moe.prepare_params(params, cfg)`, as a library user following `moe_layer`'s
docstring and the engine do (on CPU where the native kernel runs: its prepared layout, panels of 64
columns on AVX-512 CPUs, 16 elsewhere); every other backend, (a) and (b) on the params as loaded;
a "weight layout A/B" line times auto on the prepared params, on the params as loaded and on
panels of the other width (`cpu.to_panels`), in alternation (>1x: the prepared params are faster).
The process keeps freed host buffers for reuse as `expertd serve --retain-freed-memory` does
(expertd.server.host_allocator: no page faults on the large buffers of T=4096); (d)'s process keeps
glibc's defaults.

`--options-ab` instead checks the CPU rules on this machine: the layer ("expert_loop") compiled
with the default options and with YNNPACK off (cpu.policy.SMALL_ROWS_CPU_OPTIONS), and "auto" as the
server compiles and serves it (experts.choose_backend picks "native_cpu" where its C++ kernel builds, else
"capacity" for fp32 weights with few rows per large expert), calls
interleaved, at T in {1, 4, 16, 64, 128, 256}; `--experts 128` adds
Qwen3-30B-A3B's layer shape; writes benchmarks/results/moe_layer_options_ab.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import hf_peer  # benchmarks/hf_peer.py, beside this script: (d) in a process of its own
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import cpu, experts, moe
from expertd.kernels.cpu import policy as cpu_policy
from expertd.server import host_allocator, host_memory
from expertd.server.models.hf_config import moe_config_from_hf

SHAPES = ((8, 2, 1024, 2048, "mixtral"), (64, 8, 1024, 512, "qwen3_moe"))
TOKENS = (16, 256, 4096)
DTYPES = ("bfloat16", "float32")
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
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe_layer.json")
AB_RESULTS = os.path.join(os.path.dirname(RESULTS), "moe_layer_options_ab.json")
AB_TOKENS = (1, 4, 16, 64, 128, 256)
# --options-ab only, with --experts 128: Qwen3-30B-A3B's layer shape (6 MiB fp32 expert matrices)
AB_EXTRA_SHAPES = ((128, 8, 2048, 768, "qwen3_moe"),)


def median_time(fn, *args, budget_s=6.0, max_reps=15):
    """(median seconds per call, first-call seconds incl. compile) of a blocking call."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    while len(times) < 3 or (sum(times) < budget_s and len(times) < max_reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def interleaved_medians(calls, budget_s=8.0, min_rounds=5, max_rounds=15):
    """Median seconds of each zero-argument call in `calls`, timed in rounds that call each once
    (the order reversed every other round), so the machine's drift hits them alike."""
    times = {name: [] for name in calls}
    order, spent = list(calls), 0.0
    for round_ in range(max_rounds):
        if round_ >= min_rounds and spent >= budget_s:
            break
        for name in order if round_ % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
            spent += times[name][-1]
    return {name: statistics.median(t) for name, t in times.items()}


PROBE_BYTES = 256 << 20


def copy_probes(nbytes=PROBE_BYTES):
    """Zero-argument calls that each copy `nbytes` (read nbytes + write nbytes): numpy's copy and
    an XLA in-place add (donated: no fresh output pages)."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    state = [jnp.ones(nbytes // 4, jnp.float32)]
    bump = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def xla_copy():
        state[0] = bump(state[0]).block_until_ready()
    return {"numpy copy": lambda: np.copyto(dst, src), "xla copy": xla_copy}


def read_probes(nbytes=PROBE_BYTES, blas=True):
    """Zero-argument calls that each read `nbytes`: XLA's sum, XLA's and (with `blas`) numpy's
    BLAS fp32 matrix-vector products."""
    rows = nbytes // 4 // 4096
    host = np.ones((rows, 4096), np.float32)
    ones = np.ones(4096, np.float32)
    device = jnp.ones((rows, 4096), jnp.float32)
    host_memory.advise_huge_pages([device])  # like the weights (numpy's large arrays have them already)
    xla_sum, xla_matvec = jax.jit(jnp.sum), jax.jit(lambda a: a @ jnp.ones(4096, jnp.float32))
    probes = {"xla sum": lambda: xla_sum(device).block_until_ready(),
              "xla matvec": lambda: xla_matvec(device).block_until_ready()}
    return {"numpy matvec": lambda: host @ ones, **probes} if blas else probes


def _fastest(probes, reps):
    for probe in probes.values():
        probe()  # compile, fault the pages in
    return min(_timed(probe) for probe in probes.values() for _ in range(reps))


def copy_bandwidth(nbytes=PROBE_BYTES):
    """Bytes moved per second (read + written) by the fastest of a numpy and an XLA copy."""
    return 2 * nbytes / _fastest(copy_probes(nbytes), reps=5)


def read_bandwidth(nbytes=PROBE_BYTES):
    """Bytes read per second by the fastest of XLA's sum, XLA's and numpy's (BLAS) fp32
    matrix-vector product over `nbytes`: the rate a weight-streaming layer can at best reach."""
    return nbytes / _fastest(read_probes(nbytes), reps=7)


def dense_matmul_rate(n=8192, reps=10):
    """FLOP/s of one n x n x n bf16 matrix product on random data (median of `reps` after a
    warm-up): the device's dense matmul rate, which the GPU target at T=4096 is a fraction of."""
    a, b = (jax.random.normal(jax.random.key(s), (n, n), jnp.bfloat16) for s in (0, 1))
    product = jax.jit(jnp.matmul)
    product(a, b).block_until_ready()
    return 2 * n ** 3 / statistics.median(_timed(lambda: product(a, b).block_until_ready()) for _ in range(reps))


def paired_floors(layer_call, touched_bytes, rounds=9, burst=5):
    """The layer call timed in rounds with the copy and read probes (for short calls: T=16's target
    is a ratio to (c), and a shared machine's bandwidth drifts between minutes and within one).
    Each round times a burst of back-to-back layer calls, as a server runs them (the first call
    after a probe runs slower, so it is not counted), then
    each probe once. Returns the layer's median, (c) / (c') from the probes' fastest calls over all
    rounds, and the ratios the table reports: per round, the burst's median over that round's
    floors (its fastest copy / read probe), the median of those over the rounds, so that a layer
    call is only ever compared with the bandwidth of its own minute. Each round also records
    where its read floor lies in units of its copy floor ("read_floor_x_floor", = copy rate / read
    rate): the x (c) of a layer that reads its weights at the read probe's rate. Above 1.5 the
    T=16 target is out of reach in that round by (c)'s definition."""
    copies, reads = copy_probes(), read_probes(blas=False)  # BLAS's threads spin on after a call
    probes = {**copies, **reads}
    for probe in probes.values():
        probe()
    layer, probe_s = [], {name: [] for name in probes}
    by_round = {"x_floor": [], "x_read_floor": [], "read_floor_x_floor": []}
    for _ in range(rounds):
        layer_call()
        burst_s = [_timed(layer_call) for _ in range(burst)]
        layer += burst_s
        for name, probe in probes.items():
            probe_s[name].append(_timed(probe))
        copy_s, read_s = min(probe_s[n][-1] for n in copies), min(probe_s[n][-1] for n in reads)
        by_round["x_floor"].append(statistics.median(burst_s) / (touched_bytes * copy_s / (2 * PROBE_BYTES)))
        by_round["x_read_floor"].append(statistics.median(burst_s) / (touched_bytes * read_s / PROBE_BYTES))
        by_round["read_floor_x_floor"].append(2 * read_s / copy_s)
    copy_rate = 2 * PROBE_BYTES / min(min(probe_s[n]) for n in copies)
    read_rate = PROBE_BYTES / min(min(probe_s[n]) for n in reads)
    return {"auto": statistics.median(layer), "copy_bytes_per_s": copy_rate, "read_bytes_per_s": read_rate,
            "floor_s": touched_bytes / copy_rate, "read_floor_s": touched_bytes / read_rate,
            **{name: statistics.median(values) for name, values in by_round.items()},
            "rounds": {name: values for name, values in by_round.items()}}


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def layer_config(e, k, h, i, family):
    if family == "mixtral":
        return moe_config_from_hf(dict(model_type="mixtral", hidden_size=h, intermediate_size=i,
                                       num_local_experts=e, num_experts_per_tok=k))
    return moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=h, moe_intermediate_size=i,
                                   num_experts=e, num_experts_per_tok=k, norm_topk_prob=True))


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


def served_case(e, k, h, i, family, t, dtype):
    """One shape as a library user (and the engine) runs it: (cfg, params, served, auto_backend, x).
    `params` are the seeded params as loaded; `served` = `moe.prepare_params(params, cfg)`, the ones
    `auto` runs on (the native CPU kernel's layout where it runs, else `params` itself); both on
    huge pages as the engine places them. x: `[t, h]` random tokens in `dtype`."""
    cfg = layer_config(e, k, h, i, family)
    params = moe.init_params(cfg, jax.random.key(0), dtype)
    host_memory.advise_huge_pages(jax.tree.leaves(params))
    auto_backend = experts.choose_backend(t * k, e, h, i, dtype)
    served = moe.prepare_params(params, cfg)
    if served is not params:
        host_memory.advise_huge_pages(jax.tree.leaves(served))
    x = jax.random.normal(jax.random.key(1), (t, h), jnp.float32).astype(dtype)
    return cfg, params, served, auto_backend, x


def run_case(e, k, h, i, family, t, dtype_name, bandwidth, read_rate, only_backends=None, with_hf=True):
    """One shape: every backend and the baselines; `bandwidth` is the copy rate (r+w) for (c),
    `read_rate` the read rate for (c'), both in bytes/s. `auto` runs on the prepared params
    (`moe.prepare_params`), every other backend on the params as loaded."""
    dtype = jnp.dtype(dtype_name)
    cfg, params, served, auto_backend, x = served_case(e, k, h, i, family, t, dtype)
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
        median, first = median_time(fn, p, x)
        err = float(jnp.max(jnp.abs(fn(p, x).astype(jnp.float32) - out_ref.astype(jnp.float32))))
        row["backends"][backend] = {"median_s": median, "first_call_s": first, "max_abs_diff_vs_expert_loop": err}
    row["auto_backend"] = auto_backend
    row["auto_weight_layout"] = cpu.describe(served)["weight_layout"] if served is not params else "row_major"
    row["auto_compiler_options"] = moe.compiler_options(cfg, t, dtype=dtype)
    if e * 6 * t * h * i <= FLOP_CAP:
        row["dense_s"], _ = median_time(jax.jit(lambda p, v: dense_all_experts(p, v, cfg)), params, x)
    else:
        row["notes"].append("(a) skipped: above FLOP_CAP")
    rows = jax.random.normal(jax.random.key(2), (t * k, h), jnp.float32).astype(dtype)
    w = (params.w_gate[0], params.w_up[0], params.w_down[0])
    # (b) is the fastest formulation, so it also tries the XLA:CPU options the layer may compile with
    option_sets = [("", None)] + ([(" no-ynn", opts)] if (opts := cpu_policy.small_rows_cpu_options())
                                  and jax.default_backend() == "cpu" else [])
    roof_fns = {name + tag: jax.jit(f, compiler_options=opts)
                for name, f in roofline_variants(dtype).items() for tag, opts in option_sets}
    roof = {name: median_time(fn, rows, *w)[0] for name, fn in roof_fns.items()}
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
        host_memory.advise_huge_pages(jax.tree.leaves(other))
        row["layout_ab_s"] = interleaved_medians({
            "panels": lambda: jax.block_until_ready(compiled["auto"](served, x)),
            "row_major": lambda: jax.block_until_ready(compiled["auto"](params, x)),
            "other_width_panels": lambda: jax.block_until_ready(compiled["auto"](other, x))}, budget_s=6.0)
    if "auto" in compiled and auto_s >= PAIRED_MIN_CALL_S:  # the target ratios, in alternation
        calls = {"auto": lambda: jax.block_until_ready(compiled["auto"](served, x)),
                 "roofline": lambda: jax.block_until_ready(roof_fns[row["roofline_variant"]](rows, *w))}
        row["paired_s"] = interleaved_medians(calls)
        if hf is not None:  # (d) alternates with auto in whole timing runs, each side in its own process
            row["paired_hf"] = hf.alternate_with(calls["auto"])
            # (d)'s time at the ratio to auto that alternation measured, in this timing's units
            row["paired_s"]["hf"] = row["paired_s"]["auto"] * row["paired_hf"]["peer_x_other"]
    elif "auto" in compiled:  # short calls: the floors measured in alternation with them
        row["paired_floor"] = paired_floors(lambda: jax.block_until_ready(compiled["auto"](served, x)),
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
                  f"{_spread(f['rounds']['x_floor'])}, x (c') {_spread(f['rounds']['x_read_floor'])}"
                  f"; (c') in units of (c) {_spread(f['rounds']['read_floor_x_floor'])}")


def _spread(values):
    """"median (min-max)" of a list of ratios."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


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


def options_ab(e, k, h, i, family, t, dtype_name, reps=9):
    """One A/B row, calls interleaved (alternating the order), medians: the layer's "expert_loop"
    compiled with default options and with YNNPACK off, and "auto" compiled as the server does
    (backend by `experts.choose_backend`, options by `moe.compiler_options`, on `moe.prepare_params`)."""
    dtype = jnp.dtype(dtype_name)
    cfg, params, served, _, x = served_case(e, k, h, i, family, t, dtype)
    no_ynn = cpu_policy.small_rows_cpu_options() or None
    variants = {"default": ("expert_loop", None), "no_ynn": ("expert_loop", no_ynn),
                "auto": ("auto", moe.compiler_options(cfg, t, dtype=dtype) or None)}
    fns = {name: jax.jit(lambda p, v, b=backend: moe.moe_layer(p, v, cfg, backend=b), compiler_options=opts)
           for name, (backend, opts) in variants.items()}
    args = {name: served if name == "auto" else params for name in fns}  # auto as served
    times = {name: [] for name in fns}
    for name, fn in fns.items():
        jax.block_until_ready(fn(args[name], x))
    for rep in range(reps):
        for name in (list(fns) if rep % 2 else list(fns)[::-1]):
            start = time.perf_counter()
            jax.block_until_ready(fns[name](args[name], x))
            times[name].append(time.perf_counter() - start)
    default_s, no_ynn_s, auto_s = (statistics.median(times[n]) for n in ("default", "no_ynn", "auto"))
    rule_picks_no_ynn = bool(moe.compiler_options(cfg, t, dtype=dtype, backend="expert_loop"))
    loop_s = no_ynn_s if rule_picks_no_ynn else default_s  # expert_loop as auto compiled it before the backend rule
    return dict(E=e, k=k, H=h, I=i, T=t, dtype=dtype_name, rows_per_expert=t * k / e, default_s=default_s,
                no_ynn_s=no_ynn_s, speedup=default_s / no_ynn_s, rule_picks_no_ynn=rule_picks_no_ynn,
                auto_backend=experts.choose_backend(t * k, e, h, i, dtype), auto_s=auto_s,
                auto_vs_expert_loop=loop_s / auto_s)


def run_options_ab(args):
    """--options-ab: are the rules in experts.compiler_options / choose_backend right on this machine?"""
    if not cpu_policy.small_rows_cpu_options():
        sys.exit("this jaxlib does not accept cpu.policy.SMALL_ROWS_CPU_OPTIONS; nothing to compare")
    print(f"{'E':>3} {'T':>5} {'dtype':>8} {'rows/E':>7} {'default ms':>10} {'no-ynn ms':>9} {'speedup':>7} "
          f"{'rule':>7} {'auto ms':>8} {'auto backend':>12} {'vs loop':>7}")
    rows = []
    for (e, k, h, i, family), dtype_name, t in selected_cases(args, SHAPES + AB_EXTRA_SHAPES, AB_TOKENS):
        r = options_ab(e, k, h, i, family, t, dtype_name)
        rows.append(r)
        print(f"{e:>3} {t:>5} {dtype_name:>8} {r['rows_per_expert']:>7.1f} {r['default_s'] * 1e3:>10.1f} "
              f"{r['no_ynn_s'] * 1e3:>9.1f} {r['speedup']:>7.2f} "
              f"{'no-ynn' if r['rule_picks_no_ynn'] else 'default':>7} "
              f"{r['auto_s'] * 1e3:>8.1f} {r['auto_backend']:>12} {r['auto_vs_expert_loop']:>7.2f}")
        sys.stdout.flush()
    return rows


def selected_cases(args, shapes, default_tokens):
    """(shape, dtype name, T) for every shape whose E is in --experts, dtype and token count."""
    for shape in shapes:
        if shape[0] not in args.experts:
            continue
        for dtype_name in args.dtypes:
            for t in args.tokens or default_tokens:
                yield shape, dtype_name, t


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
    host_allocator.retain_freed_memory()  # as `serve --retain-freed-memory`, before JAX's first computation
    load_before = os.getloadavg()
    matmul_rate = None
    if args.options_ab:
        name, bandwidth, read_rate, rows = "moe_layer_options_ab", None, None, run_options_ab(args)
        out = AB_RESULTS if args.out == RESULTS else args.out
        save = _saver(out, name, rows, xla_flags=os.environ.get("XLA_FLAGS", ""), load_average_before=load_before,
                      copy_bandwidth_bytes_per_s=None, read_bandwidth_bytes_per_s=None)
    else:
        bandwidth, read_rate = copy_bandwidth(), read_bandwidth()
        print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read+write), read bandwidth {read_rate / 1e9:.1f} GB/s; "
              f"jax {jax.__version__} on {jax.default_backend()}")
        if jax.default_backend() == "gpu":  # the GPU target: T=4096 at >= 60% of this
            matmul_rate = dense_matmul_rate()
            print(f"dense bf16 matmul (8192^3, random data): {matmul_rate / 1e12:.0f} TFLOP/s")
        name, out, rows = "moe_layer", args.out, []
        save = _saver(out, name, rows, xla_flags=os.environ.get("XLA_FLAGS", ""), load_average_before=load_before,
                      copy_bandwidth_bytes_per_s=bandwidth, read_bandwidth_bytes_per_s=read_rate,
                      **({"dense_bf16_matmul_flops_per_s": matmul_rate} if matmul_rate else {}))
        for (e, k, h, i, family), dtype_name, t in selected_cases(args, SHAPES, TOKENS):
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
        write_results(out, name, rows, complete=complete, **fields)
    return save


def write_results(path, benchmark, rows, **fields):
    """Write a benchmark's JSON: `rows` and `fields` with the date, machine, software, the load
    average now and this process's host_allocator state (the other benchmarks use it too)."""
    result = dict(benchmark=benchmark, date=datetime.date.today().isoformat(), machine=platform.platform(),
                  cpu_count=os.cpu_count(), jax=jax.__version__, jaxlib=jax.lib.__version__,
                  device=jax.default_backend(), load_average_after=os.getloadavg(),
                  host_allocator=host_allocator.state().as_dict(), **fields, rows=rows)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
