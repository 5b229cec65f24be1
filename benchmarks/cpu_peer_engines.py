"""One MoE layer engine in a process of its own: the worker side of benchmarks/cpu_peers.py.

  python benchmarks/cpu_peer_engines.py ENGINE CASE_DIR --tokens 1,16,64 --out OUT_DIR [--cap-s S]

ENGINE is one of ENGINES:

  expertd       expertd's layer as a library user (and the server) runs it: `moe.prepare_params` once,
                `moe.moe_layer(..., backend="auto")` jitted per token count with
                `moe.compiler_options` (the native CPU kernel where it is built), weights on huge pages
  vllm          vLLM CPU's fused MoE as its CPU experts class calls it (`vllm/model_executor/layers/
                fused_moe/experts/cpu_moe.py`): w13 = [gate | up] `[E, 2I, H]` and w2 `[E, H, I]`
                prepacked once with `cpu_prepack_moe_weight(w, isa)`, then `cpu_fused_moe(...)` per
                call; isa "amx" where torch sees AMX tiles (after `torch.cpu._init_amx()`), else "vec"
  kt            kt-kernel's BF16 MoE (`AMXBF16_MOE`, or `AVX2BF16_MOE` where its build for this CPU has
                no AMX class) on a `CPUInfer` pool of one subpool with --kt-threads threads (default:
                every CPU), weights loaded once with `load_weights_task`, then `forward_task` + `sync`
  transformers  transformers' Qwen3MoeSparseMoeBlock with its default experts implementation
                (hf_peer.build_block: `grouped_mm` in 5.x), torch's default threads
  floor         not an engine: the probes of the floor (`read N`: the fastest of N numpy BLAS fp32
                matrix-vector products over harness.PROBE_BYTES, bytes a second; `dense`: torch's fastest
                dense matmul, bf16 or fp32, FLOP a second, each of its own size)

Every engine computes the same layer (Qwen3-MoE's routing: fp32 logits x @ router_weight, softmax,
top-k, renormalised; SwiGLU experts, the intermediate rounded to bf16) in bf16 from the same case,
router included in the timed call, as each engine's users run it. The torch engines route in torch
(fp32), expertd in its own router (fp32).

Case folder (cpu_peers.write_case): meta.json {"topk", "tokens"}, router_weight.npy fp32 [H, E],
w_gate.npy / w_up.npy uint16 [E, H, I] and w_down.npy uint16 [E, I, H] (bf16 bits, expertd's
checkpoint layout), x_T.npy uint16 [T, H] for every token count T.

Protocol: the worker runs every token count of --tokens once in ascending order (its warm-up: compiled,
pages faulted in), saving each output to OUT_DIR/ENGINE_T.npy (fp32 [T, H]) and timing a second call;
a token count whose call would take more than --cap-s by the last one's time per token is not run. Then
it writes one JSON line {"ready": true, "engine", "info", "prepare_s", "warm_s": {T: s}, "skipped": {T:
why}} and answers commands on stdin, one a line, each with one JSON line: "time T N" -> {"calls": [N
seconds]}; floor: "read N" -> {"bytes_per_s"}, "dense" -> {"flop_per_s", "how"}; "quit" or the end of
stdin ends it; anything else -> {"error"}. An engine that cannot start writes {"ready": false, "error"}.
The protocol's lines go to the stdout the worker started with; everything else it (or a native library)
prints goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import harness  # benchmarks/harness: stdlib only at import, so every engine's environment has it
import numpy as np

ENGINES = ("expertd", "vllm", "kt", "transformers", "floor")
CAP_S = 20.0  # a token count whose call would take longer than this is not run


# ---- the case ---------------------------------------------------------------------------------

def read_case(case_dir) -> dict:
    """The case's arrays (weights memory-mapped, bf16 as uint16 bits) and meta.json's fields."""
    case_dir = pathlib.Path(case_dir)
    case = json.loads((case_dir / "meta.json").read_text())
    for name in ("router_weight", "w_gate", "w_up", "w_down"):
        case[name] = np.load(case_dir / f"{name}.npy", mmap_mode="r")
    case["x"] = {t: np.load(case_dir / f"x_{t}.npy") for t in case["tokens"]}
    return case


def torch_bf16(bits):
    """uint16 bf16 bits (numpy) as a contiguous torch bf16 tensor (a copy)."""
    import torch

    return torch.from_numpy(np.array(bits).view(np.int16)).view(torch.bfloat16)


def torch_route(router_weight, k: int):
    """Qwen3-MoE's routing in torch, fp32: (ids int64 [T, k], weights fp32 [T, k]) of tokens x [T, H]."""
    import torch

    def route(x):
        probs = torch.softmax(x.float() @ router_weight, dim=-1)
        weights, ids = torch.topk(probs, k, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)
    return route


# ---- the engines: each builds from a case and returns {T: zero-argument call -> fp32 [T, H]} ----

def expertd_engine(case):
    import jax
    import jax.numpy as jnp

    from expertd.kernels import cpu, moe
    from expertd.kernels.params import MoEParams
    from expertd.server.host import memory
    from expertd.server.models.hf_config import moe_config_from_hf

    e, h, i = case["w_gate"].shape
    cfg = moe_config_from_hf(dict(model_type="qwen3_moe", hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                  num_experts_per_tok=case["topk"], norm_topk_prob=True))
    bf16 = jnp.bfloat16
    arrays = {"router_weight": jnp.asarray(case["router_weight"], jnp.float32),
              **{n: jnp.asarray(np.asarray(case[n]).view(bf16)) for n in ("w_gate", "w_up", "w_down")}}
    params = moe.prepare_params(MoEParams.from_dict(arrays, cfg), cfg)
    del arrays
    memory.advise_huge_pages(jax.tree.leaves(params))
    calls = {}
    for t, bits in case["x"].items():
        x = jnp.asarray(bits.view(bf16))
        fn = jax.jit(lambda p, v: moe.moe_layer(p, v, cfg, backend="auto"),
                     compiler_options=moe.compiler_options(cfg, t, dtype=bf16) or None)
        calls[t] = (lambda fn=fn, x=x: np.asarray(fn(params, x).block_until_ready(), np.float32))
    native = cpu.describe(params)
    return calls, {"jax": jax.__version__, "isa": native["isa"], "amx": native["amx"],
                   "weight_layout": native["weight_layout"], "panel_columns": native["panel_columns"]}


def vllm_engine(case):
    import torch
    import vllm
    from vllm import _custom_ops as ops

    amx = torch.cpu._is_amx_tile_supported()
    if amx:
        torch.cpu._init_amx()  # the tile state; without it the first AMX op is SIGILL
    isa = "amx" if amx else "vec"
    w13 = torch.cat([torch_bf16(case["w_gate"]).transpose(1, 2), torch_bf16(case["w_up"]).transpose(1, 2)], 1)
    w13 = ops.cpu_prepack_moe_weight(w13.contiguous(), isa)
    w2 = ops.cpu_prepack_moe_weight(torch_bf16(case["w_down"]).transpose(1, 2).contiguous(), isa)
    route = torch_route(torch.from_numpy(np.array(case["router_weight"])), case["topk"])
    calls = {}
    for t, bits in case["x"].items():
        x, out = torch_bf16(bits), torch.empty(t, bits.shape[1], dtype=torch.bfloat16)

        def call(x=x, out=out):
            with torch.inference_mode():
                ids, weights = route(x)
                ops.cpu_fused_moe(out, x, w13, w2, None, None, weights, ids.int(), "silu", isa, False)
            return out.float().numpy()
        calls[t] = call
    return calls, {"vllm": vllm.__version__, "torch": torch.__version__, "isa": isa,
                   "threads": torch.get_num_threads()}


def kt_engine(case, threads: int):
    import kt_kernel
    import torch
    from kt_kernel import kt_kernel_ext as kx

    moe_class = getattr(kx.moe, "AMXBF16_MOE", None) or kx.moe.AVX2BF16_MOE
    e, h, i = case["w_gate"].shape
    gate = torch_bf16(case["w_gate"]).transpose(1, 2).contiguous()  # kt reads [E, I, H] / [E, H, I]
    up = torch_bf16(case["w_up"]).transpose(1, 2).contiguous()
    down = torch_bf16(case["w_down"]).transpose(1, 2).contiguous()
    pool = kx.WorkerPoolConfig()
    pool.subpool_count, pool.subpool_numa_map, pool.subpool_thread_count = 1, [0], [threads]
    infer = kx.CPUInfer(pool)
    on_gpu = torch.zeros(e, dtype=torch.bool)  # every expert on the CPU
    config = kx.moe.MOEConfig(e, case["topk"], h, i, on_gpu.data_ptr())
    config.layer_idx, config.pool, config.max_len = 0, infer.backend_, max(case["tokens"])
    config.gate_projs = [[gate[j].data_ptr() for j in range(e)]]
    config.up_projs = [[up[j].data_ptr() for j in range(e)]]
    config.down_projs = [[down[j].data_ptr() for j in range(e)]]
    config.gate_scales = config.up_scales = config.down_scales = [[0] * e]  # BF16: no scales
    layer = moe_class(config)
    identity = torch.arange(e, dtype=torch.int64)  # physical -> logical expert ids (int64)
    infer.submit(layer.load_weights_task(identity.data_ptr()))
    infer.sync()
    route = torch_route(torch.from_numpy(np.array(case["router_weight"])), case["topk"])
    calls = {}
    for t, bits in case["x"].items():
        x, out = torch_bf16(bits), torch.zeros(t, h, dtype=torch.bfloat16)
        size = torch.tensor([t], dtype=torch.int32)

        def call(x=x, out=out, size=size):
            ids, weights = route(x)
            ids, weights = ids.contiguous(), weights.contiguous()
            infer.submit(layer.forward_task(size.data_ptr(), case["topk"], ids.data_ptr(), weights.data_ptr(),
                                            x.data_ptr(), out.data_ptr(), False))
            infer.sync()
            return out.float().numpy()
        calls[t] = call
    keep = (gate, up, down, on_gpu, identity, infer, layer)  # kt holds raw pointers into these
    return calls, {"kt_kernel": getattr(kt_kernel, "__version__", "?"), "torch": torch.__version__,
                   "class": moe_class.__name__, "threads": threads, "_keep": keep}


def transformers_engine(case):
    import hf_peer  # benchmarks/hf_peer.py: transformers' block from expertd's layout
    import torch
    import transformers

    weights = {"router_weight": torch.from_numpy(np.array(case["router_weight"])),
               **{n: torch_bf16(case[n]) for n in ("w_gate", "w_up", "w_down")}}
    block, implementation = hf_peer.build_block({"family": "qwen3_moe", "topk": case["topk"],
                                                 "dtype": "bfloat16", **weights})
    del weights
    calls = {t: hf_peer.block_call(block, torch_bf16(bits)) for t, bits in case["x"].items()}
    return calls, {"transformers": transformers.__version__, "torch": torch.__version__,
                   "experts_implementation": implementation, "threads": torch.get_num_threads()}


# ---- the floor's probes -----------------------------------------------------------------------

def read_rate(reps: int) -> float:
    """Bytes a second of the fastest of `reps` numpy (BLAS) fp32 matrix-vector products over
    harness.PROBE_BYTES (after one untimed call)."""
    matrix, ones = np.ones((harness.PROBE_BYTES // 4 // 4096, 4096), np.float32), np.ones(4096, np.float32)
    return harness.PROBE_BYTES / harness.fastest({"numpy matvec": lambda: matrix @ ones}, reps)


def dense_rate() -> tuple[float, str]:
    """(FLOP a second, "dtype n") of torch's fastest dense square matmul: bf16 and fp32, each at a
    size that takes about a second or more at its own rate (the fastest of 3 calls)."""
    import torch

    best = (0.0, "")
    for dtype in (torch.bfloat16, torch.float32):
        n = 512
        while True:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            torch.mm(a, b)
            seconds = min(harness.timed(lambda a=a, b=b: torch.mm(a, b)) for _ in range(3))
            if seconds > 0.3 or n >= 8192:
                break
            n *= 2
        best = max(best, (2 * n ** 3 / seconds, f"{str(dtype).removeprefix('torch.')} n={n}"))
    return best


# ---- the worker ---------------------------------------------------------------------------------

def warm(calls: dict, out_dir: pathlib.Path, engine: str, cap_s: float) -> tuple[dict, dict]:
    """Run every token count once (its output saved), then once more timed; ({T: warm seconds},
    {T: why skipped}) with counts past the cap skipped."""
    warm_s, skipped, per_token = {}, {}, None
    for t in sorted(calls):
        if per_token is not None and per_token * t > cap_s:
            skipped[t] = f"estimated {per_token * t:.1f} s a call (cap {cap_s:g} s)"
            continue
        np.save(out_dir / f"{engine}_{t}.npy", calls[t]())
        warm_s[t] = harness.timed(calls[t])
        per_token = warm_s[t] / t
    return warm_s, skipped


def serve(engine: str, calls: dict, protocol) -> None:
    """Answer the parent's commands (module docstring) until "quit" or the end of stdin."""
    for line in sys.stdin:
        words = line.split()
        try:
            if not words or words[0] == "quit":
                break
            if words[0] == "time" and engine != "floor":
                t, n = int(words[1]), int(words[2])
                reply = {"calls": [harness.timed(calls[t]) for _ in range(n)]}
            elif words[0] == "read" and engine == "floor":
                reply = {"bytes_per_s": read_rate(int(words[1]))}
            elif words[0] == "dense" and engine == "floor":
                rate, how = dense_rate()
                reply = {"flop_per_s": rate, "how": how}
            else:
                reply = {"error": f"unknown command {line.strip()!r} for engine {engine}"}
        except (IndexError, KeyError, ValueError) as exc:
            reply = {"error": f"bad command {line.strip()!r}: {exc!r}"}
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", nargs="?", choices=ENGINES)
    parser.add_argument("case", nargs="?", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--cap-s", type=float, default=CAP_S)
    parser.add_argument("--kt-threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if args.engine is None or (args.engine != "floor" and (args.case is None or args.out is None)):
        # `make bench` runs every script in benchmarks/ without arguments
        print("cpu_peer_engines.py is the worker of cpu_peers.py; it needs ENGINE CASE_DIR --out OUT_DIR (see --help)")
        return 0
    protocol = os.fdopen(os.dup(1), "w")  # the protocol's lines; fd 1 now goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start = time.perf_counter()
    try:
        info, calls, warm_s, skipped = {}, {}, {}, {}
        if args.engine != "floor":
            case = read_case(args.case)
            build = {"expertd": expertd_engine, "vllm": vllm_engine, "transformers": transformers_engine,
                     "kt": lambda c: kt_engine(c, args.kt_threads)}[args.engine]
            calls, info = build(case)
            keep = info.pop("_keep", None)  # noqa: F841  (alive as long as the calls)
            args.out.mkdir(parents=True, exist_ok=True)
            warm_s, skipped = warm(calls, args.out, args.engine, args.cap_s)
    except Exception as exc:  # an engine that cannot start here: the parent reports why
        protocol.write(json.dumps({"ready": False, "error": f"{type(exc).__name__}: {exc}"}) + "\n")
        protocol.flush()
        return 1
    protocol.write(json.dumps({"ready": True, "engine": args.engine, "info": info,
                               "prepare_s": time.perf_counter() - start, "warm_s": warm_s,
                               "skipped": skipped}) + "\n")
    protocol.flush()
    serve(args.engine, calls, protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
