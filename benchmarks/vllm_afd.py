"""vLLM offline generation with its MoE layers local vs on expertd (the vLLM plugin): tokens/s and
the per-layer cost the plugin adds.

    .venv-vllm/bin/python benchmarks/vllm_afd.py            # tiny and mid shapes, batch 1 and 16
    .venv-vllm/bin/python benchmarks/vllm_afd.py --short    # tiny shape, batch 1, a few tokens

Needs vLLM (``make install-vllm`` builds .venv-vllm); without it the script says so and exits 0
(``make bench`` runs every script with .venv). For each shape (a random Qwen3-MoE checkpoint written
by transformers, bfloat16) it serves the checkpoint with ``expertd serve --checkpoint`` (the main
gRPC port, the native Forward port where gRPC C++ is installed, and the same-host channel
``--shm-channel``), then for each transport runs
one vLLM engine in this process (``enforce_eager``, greedy, ``ignore_eos``) and times
``LLM.generate`` of B prompts x N new tokens after a warm-up: tokens/s = B * N / wall time; the
per-layer cost added = (wall - local wall) / (N forward passes x MoE layers), the prefill pass
counted as one. Writes benchmarks/results/vllm_afd.json.
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import harness  # noqa: E402 - benchmarks/ is on sys.path when run as a script

# name -> (H, E, k, I, MoE layers, attention heads, KV heads, head size, vocabulary)
SHAPES = {
    "tiny": (64, 4, 2, 32, 2, 2, 1, 32, 128),
    "mid": (1024, 32, 4, 512, 4, 16, 4, 64, 4096),
}


def write_checkpoint(path: Path, shape: str) -> None:
    import torch
    import transformers

    hidden, experts, topk, inter, layers, heads, kv_heads, head_dim, vocab = SHAPES[shape]
    config = transformers.Qwen3MoeConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=inter,
        intermediate_size=4 * inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, norm_topk_prob=True,
        initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def native_front_available() -> bool:
    return shutil.which("pkg-config") is not None and subprocess.run(
        ["pkg-config", "--exists", "grpc++", "protobuf"]).returncode == 0


def time_generation(path: Path, target: str | None, batches: list[int], tokens: int, vocab: int) -> dict[int, float]:
    """Wall seconds of one ``generate`` of each batch size (after a warm-up), one engine."""
    import vllm
    from vllm.inputs import TokensPrompt

    extra = {} if target is None else {"additional_config": {"expertd": {"target": target}}}
    llm = vllm.LLM(model=str(path), enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
                   dtype="bfloat16", gpu_memory_utilization=0.15, seed=0, **extra)
    params = vllm.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    walls = {}
    try:
        for batch in batches:
            prompts = [TokensPrompt(prompt_token_ids=[(7 * b + 3 * i) % vocab for i in range(16)])
                       for b in range(batch)]
            llm.generate(prompts, vllm.SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            walls[batch] = time.perf_counter() - start
    finally:
        del llm
        gc.collect()
    return walls


def run_shape(shape: str, batches: list[int], tokens: int, folder: Path) -> list[dict]:
    hidden, experts, topk, inter, layers, *_, vocab = SHAPES[shape]
    path = folder / shape
    write_checkpoint(path, shape)
    native = native_front_available()
    channel = f"expertd-vllm-afd-{os.getpid()}-{shape}"
    args = ["--checkpoint", str(path), "--dtype", "bfloat16", "--num-devices", "1", "--metrics-port", "0",
            "--max-queue-delay-ms", "0", "--shm-channel", channel, *(["--native-port", "0"] if native else [])]
    server = harness.ServeProcess(harness.free_port(), args, name=f"expertd serve ({shape})")
    rows = []
    with harness.serving([server], timeout=900):
        transports = {"local": None, "main port": f"127.0.0.1:{server.port}"}
        if native:
            port = next(match.group(1) for line in server.lines
                        if (match := re.search(r"native Forward port (\d+)", line)))
            transports["native port"] = f"127.0.0.1:{port}"
        transports["shm channel"] = f"shm://{channel}"
        walls = {name: time_generation(path, target, batches, tokens, vocab) for name, target in transports.items()}
    for name, by_batch in walls.items():
        for batch, wall in by_batch.items():
            added = (wall - walls["local"][batch]) / (tokens * layers)
            rows.append(dict(shape=shape, H=hidden, E=experts, k=topk, I=inter, layers=layers, transport=name,
                             batch=batch, new_tokens=tokens, wall_s=wall, tokens_per_s=batch * tokens / wall,
                             added_ms_per_layer=None if name == "local" else 1e3 * added))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="tiny shape, batch 1, 8 tokens: proves it runs")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--out", type=Path, default=harness.results.RESULTS / "vllm_afd.json")
    args = parser.parse_args(argv)
    try:
        import vllm
    except ImportError:
        print("vllm_afd: vLLM is not installed here; run it with .venv-vllm/bin/python (make install-vllm)")
        return 0
    shapes, batches, tokens = (["tiny"], [1], 8) if args.short else (list(SHAPES), [1, 16], args.tokens)
    with tempfile.TemporaryDirectory() as folder:
        rows = [row for shape in shapes for row in run_shape(shape, batches, tokens, Path(folder))]
    harness.results.print_table(f"vLLM {vllm.__version__} generation, MoE layers local vs on expertd (bfloat16)",
                                rows, ["shape", "transport", "batch", "new_tokens", "wall_s", "tokens_per_s",
                                       "added_ms_per_layer"])
    if not args.short:
        harness.results.write_json(args.out, dict(benchmark="vllm_afd", date=harness.machine.today(),
                                                  vllm=vllm.__version__, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
