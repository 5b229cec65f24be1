"""transformers' sparse MoE block, timed in a process of its own: the peer (d) of benchmarks/moe_layer.py.

The worker builds `MixtralSparseMoeBlock` (family "mixtral") or `Qwen3MoeSparseMoeBlock` (family
"qwen3_moe", norm_topk_prob=True) holding the weights of a case file, casts it to the case's dtype
and times it on the case's tokens with torch's default threads, the way a user's transformers runs:
its experts use the implementation a model built by transformers gets (`grouped_mm` in 5.x where
torch has it; `--experts-implementation` picks another). Nothing of JAX or expertd is loaded here, so
no other thread pool shares the cores with torch's, and the process keeps glibc's default malloc.

Case file (`write_case`, an .npz): family, topk, dtype ("bfloat16" | "float32"), router_weight
[H, E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H] (expertd's checkpoint layout) and x
[T, H]; bf16 arrays are stored as their uint16 bits.

Timing rules (as moe_layer.py's (d) always had them): a run of a token count is one warm-up call,
then calls until 3 are timed or their time passes the budget (one at least), reporting the median.
Where T > 16 the 16-token prefix is timed first (budget PROBE_BUDGET_S); when the whole batch would
then take more than --cap-s a call, it is not run: its time is fitted on a line through T=16 and
T=min(256, T/2) (`how` = "fit(T=16,M)", no output).

Protocol: `python benchmarks/hf_peer.py CASE.npz --out OUT.npy [--cap-s S] [--serve]` writes one
JSON line to stdout when the measurement is done: {"seconds", "how" ("measured" | "fit(T=16,M)"),
"calls" (the timed calls' seconds), "output" (OUT.npy: the block's output [T, H] fp32 for the whole
batch, or null where fitted), "torch", "transformers", "threads", "experts_implementation"}. With
--serve it then reads commands on stdin, one a line, and answers each with one JSON line: "time N"
runs a warm-up call and N timed calls of the whole batch ({"calls": [...]}); "quit" or the end of
stdin ends it; a command it does not know is answered {"error": ...}. A fitted measurement also
carries "probe_calls" (the timed calls per token count). Everything else the process prints goes to
stderr. `Peer` is the parent's side of
this (subprocess, timeouts) and imports neither torch nor transformers.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile

import harness
import numpy as np

FAMILIES = ("mixtral", "qwen3_moe")
DTYPES = ("bfloat16", "float32")
WEIGHTS = ("router_weight", "w_gate", "w_up", "w_down")
CAP_S = 60.0          # a whole-batch call estimated above this is fitted, not run
BUDGET_S = 6.0        # timed calls of the whole batch stop once they add up to this
PROBE_BUDGET_S = 2.0  # the same for the 16-token probe
MAX_TIMED_CALLS = 3
MEASURE_TIMEOUT_S = 900.0  # the parent's wait for the measurement (torch import and weight load included)


def available() -> bool:
    """Whether torch and transformers are installed (the `bench` extra), checked without importing them."""
    return all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers"))


# ---- the case file --------------------------------------------------------------------------

def check_case(family, topk, dtype, shapes: dict) -> None:
    """Raise ValueError naming the field where a case is not what the module docstring says."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    missing = [name for name in WEIGHTS + ("x",) if name not in shapes]
    if missing:
        raise ValueError(f"the case lacks {missing}; expected {WEIGHTS + ('x',)}")
    if len(shapes["w_gate"]) != 3:
        raise ValueError(f"w_gate must be [E, H, I], got shape {shapes['w_gate']}")
    e, h, i = shapes["w_gate"]
    expected = {"router_weight": (h, e), "w_gate": (e, h, i), "w_up": (e, h, i), "w_down": (e, i, h)}
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{name} must have shape {shape} (from w_gate [E, H, I]), got {tuple(shapes[name])}")
    if len(shapes["x"]) != 2 or shapes["x"][1] != h or shapes["x"][0] < 1:
        raise ValueError(f"x must be [T, {h}] with T >= 1, got shape {tuple(shapes['x'])}")
    if not 1 <= topk <= e:
        raise ValueError(f"topk must be in [1, {e}], got {topk}")


def write_case(path, family: str, topk: int, dtype: str, weights: dict, x) -> None:
    """Write a case: `weights` maps WEIGHTS to arrays in expertd's layout (numpy or ml_dtypes bf16),
    x is the tokens [T, H]. bf16 arrays go in as their uint16 bits (npz has no bf16)."""
    arrays = {name: np.asarray(weights[name]) for name in WEIGHTS if name in weights}
    arrays["x"] = np.asarray(x)
    check_case(family, topk, dtype, {name: a.shape for name, a in arrays.items()})
    stored, bf16 = {}, []
    for name, a in arrays.items():
        if a.dtype.name == "bfloat16":
            stored[name], bf16 = a.view(np.uint16), bf16 + [name]
        else:
            stored[name] = a
    np.savez(path, family=np.array(family), topk=np.array(topk), dtype=np.array(dtype),
             bf16_arrays=np.array(bf16, dtype=str), **stored)


def read_case(path) -> dict:
    """The case as torch tensors (bf16 bits restored) plus family, topk and dtype."""
    import torch  # the worker's side only: the parent process never loads torch

    loaded = np.load(path)
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: not a case file (an .npz written by write_case)")
    with loaded as f:
        arrays = {name: f[name] for name in f.files}
    for name in ("family", "topk", "dtype", "bf16_arrays"):
        if name not in arrays:
            raise ValueError(f"{path}: not a case file (no {name!r}; write it with write_case)")
    case = {"family": str(arrays["family"]), "topk": int(arrays["topk"]), "dtype": str(arrays["dtype"])}
    check_case(case["family"], case["topk"], case["dtype"], {name: a.shape for name, a in arrays.items()})
    bf16 = set(arrays["bf16_arrays"].tolist())
    for name in WEIGHTS + ("x",):
        a = arrays[name]
        case[name] = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if name in bf16 else torch.from_numpy(a)
    return case


# ---- the worker -----------------------------------------------------------------------------

def default_experts_implementation(family: str) -> str:
    """The experts implementation transformers gives a model of this family it builds (as
    from_pretrained does): asked of a one-layer toy model, since the block alone defaults to eager."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    toy = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=8, num_experts_per_tok=1)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(num_local_experts=2, **toy))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=2, moe_intermediate_size=16, **toy))
    return model.config._experts_implementation or "eager"


def build_block(case: dict, experts_implementation: str | None = None):
    """transformers' block holding the case's weights, in the case's dtype, in eval mode."""
    import torch
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    e, h, i = case["w_gate"].shape
    if case["family"] == "mixtral":
        config = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e,
                               num_experts_per_tok=case["topk"])
        block_class = MixtralSparseMoeBlock
    else:
        config = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                num_experts_per_tok=case["topk"], norm_topk_prob=True)
        block_class = Qwen3MoeSparseMoeBlock
    config._experts_implementation = experts_implementation or default_experts_implementation(case["family"])
    block = block_class(config)
    with torch.no_grad():  # transformers 5.x: gate [E, H]; fused gate_up_proj [E, 2I, H]; down_proj [E, H, I]
        block.gate.weight.copy_(case["router_weight"].T)
        block.experts.gate_up_proj.copy_(torch.cat([case["w_gate"].transpose(1, 2), case["w_up"].transpose(1, 2)], 1))
        block.experts.down_proj.copy_(case["w_down"].transpose(1, 2))
    return block.to(getattr(torch, case["dtype"])).eval(), config._experts_implementation


def block_call(block, x):
    """A zero-argument call of the block on tokens x [T, H] (any float dtype), returning its output
    [T, H] as fp32 numpy."""
    import torch

    dtype = next(block.parameters()).dtype
    tokens = x.to(dtype)[None]

    def call():
        with torch.inference_mode():
            out = block(tokens)
            out = out[0] if isinstance(out, tuple) else out  # 4.x blocks also returned router logits
            return out.reshape(x.shape).float().numpy()
    return call


def time_calls(call, budget_s=BUDGET_S):
    """One warm-up call, then calls until MAX_TIMED_CALLS are timed or they add up to `budget_s`
    (one at least): `harness.Timing` (its `output`: the warm-up call's)."""
    return harness.time_calls(call, min_calls=1, max_calls=MAX_TIMED_CALLS, budget_s=budget_s)


def measure(block, x, cap_s=CAP_S, budget_s=BUDGET_S):
    """(result dict, output [T, H] fp32 numpy or None where fitted) by the module's timing rules."""
    t = x.shape[0]
    if t > 16:
        probe = time_calls(block_call(block, x[:16]), PROBE_BUDGET_S)
        mid = min(256, t // 2)
        if probe.median * t / 16 > cap_s and mid > 16:
            at_mid = time_calls(block_call(block, x[:mid]), 0.0)
            slope = max(0.0, (at_mid.median - probe.median) / (mid - 16))
            return {"seconds": probe.median + slope * (t - 16), "how": f"fit(T=16,{mid})",
                    "calls": [], "probe_calls": {"16": probe.samples, str(mid): at_mid.samples}}, None
    timing = time_calls(block_call(block, x), budget_s)
    return {"seconds": timing.median, "how": "measured", "calls": timing.samples}, timing.output


def serve(block, x, reply):
    """Answer "time N" commands on stdin until "quit" or its end."""
    call = block_call(block, x)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] != "time" or len(words) != 2 or not words[1].isdigit() or int(words[1]) < 1:
            reply({"error": f"expected 'time N' (N >= 1) or 'quit', got {line.strip()!r}"})
            continue
        reply({"calls": harness.time_calls(call, min_calls=int(words[1])).samples})


def worker(args) -> int:
    proto = os.fdopen(os.dup(1), "w")  # the protocol's stdout; anything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(message):
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    import torch
    import transformers

    case = read_case(args.case)
    block, implementation = build_block(case, args.experts_implementation)
    result, out = measure(block, case["x"], args.cap_s, args.budget_s)
    if out is not None:
        np.save(args.out, out)
    reply({**result, "output": args.out if out is not None else None, "torch": torch.__version__,
           "transformers": transformers.__version__, "threads": torch.get_num_threads(),
           "experts_implementation": implementation})
    if args.serve:
        serve(block, case["x"], reply)
    return 0


# ---- the parent's side ----------------------------------------------------------------------

class PeerError(RuntimeError):
    """The peer process failed, timed out or answered out of protocol."""


class Peer:
    """The worker in a subprocess, on a case written to a temporary folder. `measurement` waits for
    its result; with `serve=True` the process then stays up for `alternate_with` until `close`."""

    def __init__(self, family, topk, dtype, weights, x, cap_s=CAP_S, serve=False, experts_implementation=None):
        self._dir = tempfile.mkdtemp(prefix="expertd-hf-peer-")
        case, self._out = os.path.join(self._dir, "case.npz"), os.path.join(self._dir, "out.npy")
        try:
            write_case(case, family, topk, dtype, weights, x)
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise
        cmd = [sys.executable, os.path.abspath(__file__), case, "--out", self._out, "--cap-s", str(cap_s)]
        cmd += ["--serve"] if serve else []
        cmd += ["--experts-implementation", experts_implementation] if experts_implementation else []
        self._stderr = open(os.path.join(self._dir, "stderr.txt"), "w+")
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                      text=True)
        self.result = None

    def measurement(self, timeout_s=MEASURE_TIMEOUT_S):
        """The result dict (module docstring) with "output" loaded: [T, H] fp32 numpy or None."""
        if self.result is None:
            self.result = self._reply(timeout_s)
            if self.result["output"] is not None:
                self.result["output"] = np.load(self.result["output"])
            os.remove(os.path.join(self._dir, "case.npz"))  # loaded by now
        return self.result

    def alternate_with(self, other_call, rounds=5, calls=MAX_TIMED_CALLS):
        """Time `other_call` (zero arguments, blocking; in this process) and the peer's whole batch in
        alternating runs, each a warm-up call and `calls` timed calls, `rounds` each, so that the
        machine's drift hits both alike and neither side's threads run during the other's calls.
        Returns each side's per-run medians and "peer_x_other", the median of the rounds' ratios."""
        other_s, peer_s = [], []
        timeout_s = max(60.0, 20 * (calls + 1) * self.measurement()["seconds"])
        for _ in range(rounds):
            other_s.append(harness.time_calls(other_call, min_calls=calls).median)
            self._proc.stdin.write(f"time {calls}\n")
            self._proc.stdin.flush()
            peer_s.append(statistics.median(self._reply(timeout_s)["calls"]))
        return {"other_s": other_s, "peer_s": peer_s, "calls_per_run": calls,
                "peer_x_other": harness.median_ratio(peer_s, other_s)}

    def close(self, kill=False):
        """End the process (asked to quit unless `kill`; killed if it has not within 30 s) and remove
        its folder."""
        if self._proc.poll() is None and not kill:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            try:
                pipe.close()
            except OSError:  # a "quit" still buffered for a process that is gone
                pass
        self._stderr.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _reply(self, timeout_s):
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            problem = f"no answer within {timeout_s:g} s" if not ready else f"exited with {self._proc.wait()}"
            self._stderr.seek(0)
            tail = " | ".join(self._stderr.read().strip().splitlines()[-3:])
            self.close(kill=True)
            raise PeerError(f"{problem}{': ' + tail if tail else ''}")
        message = json.loads(line)
        if "error" in message:
            raise PeerError(message["error"])
        return message


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", nargs="?", help="a case file (write_case); without one, say what this is and exit")
    parser.add_argument("--out", default="hf_peer_out.npy", help="where the block's output [T, H] fp32 goes (.npy)")
    parser.add_argument("--cap-s", type=float, default=CAP_S,
                        help=f"fit the whole batch's time instead of running it above this many seconds a call "
                             f"(default {CAP_S:.0f})")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"timed calls of the whole batch stop at this total (default {BUDGET_S:.0f})")
    parser.add_argument("--serve", action="store_true", help="after the measurement, answer 'time N' on stdin")
    parser.add_argument("--experts-implementation", choices=("eager", "grouped_mm", "batched_mm"),
                        help="transformers' experts implementation (default: what transformers gives a model)")
    args = parser.parse_args(argv)
    if args.case is None:  # `make bench` runs every script in benchmarks/ without arguments
        print("hf_peer.py is the worker of moe_layer.py's peer (d); it needs a case file (see --help)")
        return 0
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
