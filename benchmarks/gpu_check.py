"""The MoE layer's backends on the machine at hand (meant for a lent GPU) against the float64 oracle.

CI and the test suite run on CPU only (tests/conftest.py pins JAX_PLATFORMS=cpu), where the Pallas
kernels run in interpret mode. This script runs what the platform compiles: on a GPU, the Pallas
grouped GEMM and router kernels through Triton, `ragged_dot` on XLA's grouped GEMM, `capacity`,
`expert_loop` and `auto`; `native_cpu` only on CPU. For each backend, model family (Mixtral,
Qwen2-MoE, DeepSeek-V3 router settings at POINTS; the layer semantics of issue 25 at
SEMANTIC_POINTS: gpt-oss, DeepSeek-V4 and its hash-routed layers, GLM-5 Next, Step-3.7, ERNIE 4.5,
Llama 4, Mistral 4, Gemma 4, see docs/semantics.md), dtype and (E, k, T) it compares the layer's output with
kernels/moe_reference.py (token by token in float64; near-tie tokens left out) and reports the
largest error per unit of output scale against moe_reference.tolerance(dtype) (bf16 3e-2, fp32 2e-5; an
fp32 layer whose matmuls run in TF32 on the GPU would show it here as ~1e-3). Where some experts
get no tokens, the layer runs again with those experts' weights set to NaN: "reads unused" says
whether NaN reached the output, i.e. whether the backend touches the weights of experts without
tokens (information, not a failure: on CPU XLA's ragged_dot does, as it runs every group over
every row; the others do not). Router backends are compared the same way (ids and weights).

Prints a table and writes benchmarks/results/gpu_check.json (or --out); exits 1 if a case fails.
    python3 benchmarks/gpu_check.py [--quick] [--families all|served|semantics|NAME,NAME...]
--quick runs one point of the served families (what the CPU test of the runbook runs); the
semantics alone fit one device call: GPU_CHECK_ARGS="--families semantics" benchmarks/gpu_session.sh check.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import experts, moe, router
from expertd.kernels.experts import tokamax
from expertd.kernels.moe_reference import (
    FAMILIES,
    HASH_VOCAB,
    SEMANTIC_FAMILIES,
    family_config,
    max_error,
    moe_oracle,
    tolerance,
)

RESULTS = os.path.join(harness.RESULTS, "gpu_check.json")
HIDDEN, INTER = 64, 48
POINTS = ((8, 2, 64), (64, 8, 256), (8, 2, 1), (2, 1, 3))  # (E, k, T)
QUICK_POINTS = ((8, 2, 64),)
SEMANTIC_POINTS = ((16, 4, 256),)  # the semantic families: one point keeps a device call under 10 minutes
FAMILY_SETS = {"served": FAMILIES, "semantics": SEMANTIC_FAMILIES, "all": FAMILIES + SEMANTIC_FAMILIES}


def backends_here() -> tuple[str, ...]:
    """The expert backends this platform runs (native_cpu is an XLA:CPU custom call; tokamax where
    its package imports: on the GPU machine, from the wheels carried in .whl)."""
    cpu = jax.default_backend() == "cpu"
    runs = {"native_cpu": cpu, "tokamax": tokamax.available()}
    return tuple(b for b in experts.BACKENDS if runs.get(b, True)) + ("auto",)


def token_ids_of(cfg, t):
    """A hash-routed layer's token ids int32 [T] (None for the others)."""
    return jax.random.randint(jax.random.key(t + 2), (t,), 0, HASH_VOCAB, jnp.int32) if cfg.hash_routed else None


def layer_case(family, e, k, t, dtype_name, backend):
    dtype = jnp.dtype(dtype_name)
    cfg = family_config(family, e, k, HIDDEN, INTER)
    params = moe.init_params(cfg, jax.random.key(e * 31 + k), dtype)
    x = jax.random.normal(jax.random.key(t), (t, HIDDEN), jnp.float32).astype(dtype)
    tids = token_ids_of(cfg, t)
    layer = jax.jit(lambda p, v, i: moe.moe_layer(p, v, cfg, backend=backend, return_routing=True, token_ids=i))
    start = time.perf_counter()
    out, routing = layer(params, x, tids)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    seconds = time.perf_counter() - start
    err, scale = max_error(out, moe_oracle(params, x, cfg, token_ids=tids))
    err /= scale
    # Experts without tokens: their weights set to NaN; does NaN reach the output?
    unused = np.flatnonzero(np.asarray(routing["tokens_per_expert"]) == 0)
    nan_free = True
    if unused.size:
        poisoned = params.replace(**{name: getattr(params, name).at[unused].set(jnp.nan)
                                     for name in moe.EXPERT_FIELDS if getattr(params, name) is not None})
        again = layer(poisoned, x, tids)[0]
        nan_free = bool(np.isfinite(np.asarray(again.astype(jnp.float32))).all())
    ok = np.isfinite(out).all() and err <= tolerance(dtype)
    return dict(kind="layer", family=family, E=e, k=k, T=t, dtype=dtype_name, backend=backend,
                err_per_scale=err, tolerance=tolerance(dtype), unused_experts=int(unused.size),
                reads_unused_experts=not nan_free, compile_and_run_s=seconds, ok=bool(ok))


def router_case(family, e, k, t, backend):
    cfg = family_config(family, e, k, HIDDEN, INTER)
    params = moe.init_params(cfg, jax.random.key(e * 31 + k), jnp.float32)
    x = jax.random.normal(jax.random.key(t + 1), (t, HIDDEN), jnp.float32)
    tids = token_ids_of(cfg, t)
    ids, weights = jax.jit(lambda p, v, i: moe.route(p, v, cfg, router_backend=backend, token_ids=i))(params, x, tids)
    ref = moe_oracle(params, x, cfg, token_ids=tids)
    keep = ~ref.near_tie
    ids_ok = bool(np.array_equal(np.sort(np.asarray(ids)[keep], 1), np.sort(ref.ids[keep], 1)))
    w_err = (float(np.abs(np.sort(np.asarray(weights)[keep], 1) - np.sort(ref.weights[keep], 1)).max())
             if keep.any() else 0.0)
    return dict(kind="router", family=family, E=e, k=k, T=t, dtype="float32", backend=backend,
                err_per_scale=w_err, tolerance=2e-5, ids_equal=ids_ok, ok=bool(ids_ok and w_err <= 2e-5))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one (E, k, T) point of the served families")
    parser.add_argument("--families", default=None,
                        help="all (default), served, semantics, or a comma list of family names")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    families = _families(args.families or ("served" if args.quick else "all"))
    print(f"jax {jax.__version__} on {jax.default_backend()}: {jax.devices()}")
    rows = []
    points = QUICK_POINTS if args.quick else POINTS
    plan = [(point, family) for point in points for family in families if family in FAMILIES]
    plan += [(point, family) for point in (QUICK_POINTS if args.quick else SEMANTIC_POINTS)
             for family in families if family in SEMANTIC_FAMILIES]
    print(f"{'kind':>6} {'family':>16} {'E':>3} {'k':>2} {'T':>5} {'dtype':>8} {'backend':>12} "
          f"{'err/scale':>10} {'tol':>8} {'ok':>4} {'reads unused':>12}")
    for (e, k, t), family in plan:
        first = len(rows)
        for backend in router.BACKENDS:
            rows.append(router_case(family, e, k, t, backend))
        for dtype_name in ("float32", "bfloat16"):
            for backend in backends_here():
                try:
                    rows.append(layer_case(family, e, k, t, dtype_name, backend))
                except Exception as err:  # a backend that does not build here: recorded, not fatal
                    rows.append(dict(kind="layer", family=family, E=e, k=k, T=t, dtype=dtype_name,
                                     backend=backend, error=f"{type(err).__name__}: {err}"[:400], ok=False))
        for r in rows[first:]:
            err = f"{r['err_per_scale']:>10.2e} {r['tolerance']:>8.0e}" if "err_per_scale" in r else r["error"][:60]
            unused = ("yes" if r["reads_unused_experts"] else "no") if r.get("unused_experts") else "-"
            print(f"{r['kind']:>6} {family:>16} {e:>3} {k:>2} {t:>5} {r['dtype']:>8} {r['backend']:>12} "
                  f"{err} {'yes' if r['ok'] else 'NO':>4} {unused:>12}")
        sys.stdout.flush()
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases within tolerance")
    harness.write_results(args.out, "gpu_check", rows)
    return 1 if failed else 0


def _families(spec: str) -> tuple[str, ...]:
    if spec in FAMILY_SETS:
        return FAMILY_SETS[spec]
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in FAMILY_SETS["all"]]
    if unknown or not names:
        raise SystemExit(f"--families: unknown {unknown or spec!r}; use {sorted(FAMILY_SETS)} or names of "
                         f"{FAMILY_SETS['all']}")
    return names


if __name__ == "__main__":
    sys.exit(main())
