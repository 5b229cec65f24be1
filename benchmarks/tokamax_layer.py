"""The tokamax backend on the machine at hand (meant for a lent H200; `gpu_session.sh tokamax`):
correctness against the float64 oracle, then the whole MoE layer per backend beside the dense bf16
matmul rate and the weight-read floor of the same run.

1. probe: which tokamax implementation takes a bf16 and an FP8 ragged_dot here (`implementation=
   "mosaic"` strictly, then tokamax's own default), with the error where one refuses.
2. check: `moe_layer` for every family of moe_reference.FAMILIES at a small point, tokamax in fp32,
   bf16 and FP8 (block-scaled e4m3, `experts.quantize_fp8_blocks`) and pallas in FP8, against
   `moe_oracle` (FP8: on the dequantised weights, bf16's tolerance; and the FP8 step against the
   bf16 step on the weights before FP8, within FP8_TOL per unit of output scale).
3. floors: the dense bf16 matmul rate (an 8192^3 product) and the device's copy and read rates
   (harness.probes: the fastest of numpy's and XLA's copies; XLA's sum and matrix-vector product).
4. layer: at each (E, k, H, I) of SHAPES (Mixtral-style routing, no shared experts; E cut to the
   experts whose weights fit in MEMORY_FRACTION of the device's memory, bf16 and FP8 copies
   together) and T of TOKENS, `moe_layer` jitted as the engine serves it (router, dispatch, both
   projections and combine in one program, params from `moe.prepare_params(..., backend=)`, x on
   the device) for each backend of --backends, and for --fp8-backends on the FP8 weights:
     call_s    one call, wall clock to block_until_ready (dispatch + device), median
     device_s  per layer call inside one program that chains `--chain` calls (x <- layer(x), a
               fori_loop: one dispatch for the lot), median over repeats / chain: the device's time
     dispatch_s  call_s - device_s
     tflops    active FLOPs (2 * T * k * 3 * H * I) / device_s; x_dense: that over the dense rate
     x_floor / x_read_floor  device_s over the touched experts' bytes (routing's tokens_per_expert
               > 0 times each expert's bytes: FP8 codes + scales, or bf16) at the copy / read rate
     x_bf16    FP8 rows: device_s over the bf16 row's of the same backend and T (the goal: <= 0.6
               at T <= 128)
   Cases whose work exceeds FLOP_CAP (ragged_dot and the XLA lowerings run every expert over every
   row on GPU: E x the FLOPs) are skipped with the reason. --budget-s is shared out over the shapes
   (shape n starts no case after n / len(shapes) of it, what one leaves passes on): cases past it
   are skipped and the results written after each shape, so one device call brings its file back.

Prints a table and writes benchmarks/results/tokamax_layer.json (or --out). On CPU it runs the
same steps at the small shapes a test gives (tests/test_gpu_session.py); there tokamax is XLA's
ragged_dot and pallas is interpreted.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import experts, moe
from expertd.kernels.moe_reference import FAMILIES, family_config, max_error, moe_oracle, tolerance

RESULTS = os.path.join(harness.RESULTS, "tokamax_layer.json")
SHAPES = ((8, 2, 4096, 14336), (64, 8, 2048, 768), (256, 8, 7168, 2048))  # (E, k, H, I)
TOKENS = (1, 16, 128, 1024, 4096)
BACKENDS = ("tokamax", "pallas", "ragged_dot", "auto")
FP8_BACKENDS = ("tokamax", "pallas")
FP8_TOL = 0.1  # error per unit of output scale of FP8 weights against the weights before FP8
FLOP_CAP = 2e15  # per layer call (~3 s on an H200 at its dense rate)
MEMORY_FRACTION = 0.5
CHECK_POINT = (8, 2, 16, 256, 512)  # (E, k, T, H, I): FP8 blocks of 128 inside H and I


def fp8_params(params):
    return params.replace(**{n: jax.jit(experts.quantize_fp8_blocks)(getattr(params, n)) for n in moe.EXPERT_WEIGHTS})


def dense_params(params):
    return params.replace(**{n: experts.dequantize(getattr(params, n), jnp.float32) for n in moe.EXPERT_WEIGHTS})


def probe(rows=64, e=4, h=256, n=256):
    """Which tokamax implementation takes a bf16 and an FP8 ragged_dot on this platform."""
    from expertd.kernels.experts import tokamax as backend

    tokamax = backend._tokamax()  # a clear error without the package; tokamax's absl flags settled
    x = jax.random.normal(jax.random.key(0), (rows, h), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (e, h, n), jnp.float32) / 16
    gs = jnp.full((e,), rows // e, jnp.int32)
    out = []
    for kind, rhs in (("bf16", w.astype(jnp.bfloat16)), ("fp8", experts.quantize_fp8_blocks(w))):
        for impl in ("mosaic", None):
            try:
                f = jax.jit(lambda a, r, g, impl=impl: tokamax.ragged_dot(
                    a, backend._rhs(r, a.dtype), g, preferred_element_type=a.dtype, implementation=impl))
                f(x, experts.tokamax_weights(rhs), gs).block_until_ready()
                out.append(dict(kind="probe", weights=kind, implementation=impl or "default", ok=True))
            except Exception as err:  # recorded: which implementation refuses, and why
                out.append(dict(kind="probe", weights=kind, implementation=impl or "default", ok=False,
                                error=f"{type(err).__name__}: {err}"[:300]))
    return out


def check(point=CHECK_POINT):
    """Every family through tokamax (fp32, bf16, FP8) and pallas (FP8) against the oracle."""
    e, k, t, h, i = point
    rows = []
    for n, family in enumerate(FAMILIES):
        cfg = family_config(family, e, k, h, i)
        for dtype_name, backend, quantised in (("float32", "tokamax", False), ("bfloat16", "tokamax", False),
                                               ("bfloat16", "tokamax", True), ("bfloat16", "pallas", True)):
            dtype = jnp.dtype(dtype_name)
            params = moe.init_params(cfg, jax.random.key(n), dtype)
            x = jax.random.normal(jax.random.key(10 + n), (t, h), jnp.float32).astype(dtype)
            row = dict(kind="check", family=family, dtype="fp8" if quantised else dtype_name, backend=backend,
                       E=e, k=k, T=t, H=h, I=i)
            try:
                served = fp8_params(params) if quantised else params
                layer = jax.jit(lambda p, v, cfg=cfg, backend=backend: moe.moe_layer(p, v, cfg, backend=backend))
                out = np.asarray(layer(moe.prepare_params(served, cfg, backend=backend), x).astype(jnp.float32))
                err, scale = max_error(out, moe_oracle(dense_params(served) if quantised else params, x, cfg))
                row.update(err_per_scale=err / scale, tolerance=tolerance(dtype), finite=bool(np.isfinite(out).all()))
                ok = row["finite"] and err / scale <= tolerance(dtype)
                if quantised:  # the FP8 step against the weights before FP8
                    err8, scale8 = max_error(out, moe_oracle(params, x, cfg))
                    row.update(err_vs_bf16_weights=err8 / scale8, fp8_tolerance=FP8_TOL)
                    ok = ok and err8 / scale8 <= FP8_TOL
                row["ok"] = bool(ok)
            except Exception as err:
                row.update(ok=False, error=f"{type(err).__name__}: {err}"[:400])
            rows.append(row)
            print({key: row.get(key) for key in ("family", "dtype", "backend", "err_per_scale", "ok", "error")},
                  flush=True)
    return rows


def floors(matmul_n: int):
    probes = harness.probes
    return dict(kind="floors", dense_bf16_flops=probes.dense_matmul_rate(matmul_n),
                copy_bytes_per_s=probes.copy_bandwidth(), read_bytes_per_s=probes.read_bandwidth())


def experts_that_fit(e: int, h: int, i: int) -> int:
    """E, or fewer experts where their bf16 and FP8 weights would not fit in MEMORY_FRACTION of
    the device's memory (bytes_limit where the device reports it)."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return e
    per_expert = 3 * h * i * (2 + 1 + 1)  # bf16, FP8 codes, and the copy tokamax's layout may make
    return max(1, min(e, int(MEMORY_FRACTION * limit // per_expert)))


def timings(layer, params, x, chain: int, reps: int):
    """(call_s, device_s): a call's median wall time, and the device's per call in a chain of up
    to `chain` calls (fewer repeats and a shorter chain for long calls: about a second each)."""
    def call():
        return layer(params, x, jnp.int32(1)).block_until_ready()

    first = harness.timed(call)
    calls = [harness.timed(call) for _ in range(max(3, min(reps, int(1.0 / first))))]
    n = max(2, min(chain, int(0.3 / first)))
    layer(params, x, jnp.int32(n)).block_until_ready()
    chained = [harness.timed(lambda: layer(params, x, jnp.int32(n)).block_until_ready())
               for _ in range(max(2, min(reps // 4, int(1.0 / (n * first)))))]
    return statistics.median(calls), statistics.median(chained) / n


def layer_rows(shape, tokens, backends, fp8_backends, rates, deadline, chain, reps):
    e0, k, h, i = shape
    e = experts_that_fit(e0, h, i)
    cfg = family_config("mixtral", e, k, h, i)
    params = moe.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    quantised = fp8_params(params) if fp8_backends else None
    rows = []
    for t in tokens:
        x = jax.random.normal(jax.random.key(t), (t, h), jnp.float32).astype(jnp.bfloat16)
        ids, _ = jax.jit(lambda p, v: moe.route(p, v, cfg))(params, x)
        tpe = np.bincount(np.asarray(ids).ravel(), minlength=e)
        touched = int((tpe > 0).sum())
        flops = 2.0 * t * k * 3 * h * i
        for backend, weights in [(b, "bf16") for b in backends] + [(b, "fp8") for b in fp8_backends]:
            row = dict(kind="layer", E=e, E_asked=e0, k=k, H=h, I=i, T=t, backend=backend, weights=weights,
                       touched_experts=touched)
            resolved = backend if backend != "auto" else experts.choose_backend(t * k, e, h, i, jnp.bfloat16)
            row["runs"] = resolved
            work = flops * (e if resolved in ("ragged_dot", "reference", "capacity") else 1)
            if work > FLOP_CAP:
                rows.append({**row, "skipped": f"{work:.2g} FLOPs per call (E x the active ones) > FLOP_CAP"})
                continue
            if time.monotonic() > deadline:
                rows.append({**row, "skipped": "out of --budget-s"})
                continue
            try:
                source = quantised if weights == "fp8" else params
                served = moe.prepare_params(source, cfg, backend=backend)

                def chained(p, v, n, backend=backend):
                    return jax.lax.fori_loop(0, n, lambda _, y: moe.moe_layer(p, y, cfg, backend=backend), v)

                layer = jax.jit(chained)
                start = time.monotonic()
                layer(served, x, jnp.int32(1)).block_until_ready()
                row["compile_s"] = time.monotonic() - start
                call_s, device_s = timings(layer, served, x, chain, reps)
                # bf16 weights, or FP8 codes and fp32 scales per 128 x 128 block
                per_expert = 3 * h * i * 2 if weights == "bf16" else 3 * h * i + 3 * 4 * -(-h // 128) * -(-i // 128)
                nbytes = touched * per_expert
                row.update(call_s=call_s, device_s=device_s, dispatch_s=max(0.0, call_s - device_s),
                           tflops=flops / device_s / 1e12, x_dense=flops / device_s / rates["dense_bf16_flops"],
                           touched_bytes=nbytes, x_floor=device_s / (nbytes / rates["copy_bytes_per_s"]),
                           x_read_floor=device_s / (nbytes / rates["read_bytes_per_s"]))
            except Exception as err:
                row["error"] = f"{type(err).__name__}: {err}"[:400]
            rows.append(row)
            print({key: row.get(key) for key in ("E", "T", "backend", "weights", "runs", "device_s", "dispatch_s",
                                                  "x_dense", "x_floor", "skipped", "error")}, flush=True)
        del x
    for row in rows:  # the FP8 goal: the FP8 step's device time over the bf16 step's, same backend and T
        twin = [r for r in rows if r["weights"] == "bf16" and (r["backend"], r["T"]) == (row["backend"], row["T"])]
        if row["weights"] == "fp8" and twin and "device_s" in row and "device_s" in twin[0]:
            row["x_bf16"] = row["device_s"] / twin[0]["device_s"]
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=[",".join(map(str, s)) for s in SHAPES], help="E,k,H,I ...")
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--backends", nargs="*", default=list(BACKENDS))
    parser.add_argument("--fp8-backends", nargs="*", default=list(FP8_BACKENDS))
    parser.add_argument("--check-point", default=",".join(map(str, CHECK_POINT)), help="E,k,T,H,I of the check")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--chain", type=int, default=20, help="layer calls chained in one program (device_s)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=400.0, help="stop starting layer cases after this")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    print(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}", flush=True)
    rows = probe()
    print(rows, flush=True)
    if not args.no_check:
        rows += check(tuple(int(v) for v in args.check_point.split(",")))
    rates = floors(args.matmul_n)
    rows.append(rates)
    print(rates, flush=True)
    start = time.monotonic()
    for n, spec in enumerate(args.shapes, 1):  # shape n may start cases until n / len of the budget is spent
        shape = tuple(int(v) for v in spec.split(","))
        share = start + (deadline - start) * n / len(args.shapes)
        rows += layer_rows(shape, args.tokens, args.backends, args.fp8_backends, rates, share, args.chain,
                           args.reps)
        harness.write_results(args.out, "tokamax_layer", rows)  # what is done so far survives a timeout
    harness.print_table("the layer per backend (device_s: per call in a chain; x_dense at T=4096: the goal >= 0.6)",
                        [r for r in rows if r["kind"] == "layer"],
                        ["E", "k", "H", "I", "T", "backend", "weights", "runs", "call_s", "device_s", "dispatch_s",
                         "tflops", "x_dense", "x_floor", "x_read_floor", "x_bf16", "skipped"])
    failed = [r for r in rows if r["kind"] == "check" and not r["ok"]]
    print(f"check: {sum(r['kind'] == 'check' for r in rows) - len(failed)} of "
          f"{sum(r['kind'] == 'check' for r in rows)} within tolerance")
    harness.write_results(args.out, "tokamax_layer", rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
