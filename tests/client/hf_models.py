"""Tiny random transformers models of every family in expertd.client.transformers.FAMILIES, and a real
``expertd serve --checkpoint`` subprocess on loopback for the adapter tests.

    model = build("mixtral")                        # 2 decoder layers, H=64, E=4, k=2, seeded weights
    model.save_pretrained(path)
    with expertd_serve(path, "float32", cache) as target:   # "127.0.0.1:<port>" once ready
        ...

Weights are drawn with ``initializer_range=0.2`` (transformers' default 0.02 leaves the MoE output a
few percent of the residual stream), so each MoE block changes the greedy tokens: tests check that
it does, or an offloaded block computing the wrong thing could go unnoticed. DeepSeek-V3-style
routers get a random selection bias (transformers initialises it to zeros).
"""
from __future__ import annotations

import contextlib
import os
import queue
import re
import subprocess
import sys
import threading
import time

import torch
import transformers

H = 64
BASE = dict(hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, head_dim=16, initializer_range=0.2, tie_word_embeddings=False)
_MLA = dict(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
            v_head_dim=16)
_TWO_FULL = dict(layer_types=["full_attention", "full_attention"])

# model_type -> (config class, model class, config arguments, MoE decoder layers, (E, k, I))
TINY = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32), [0, 1], (4, 2, 32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48), [0, 1], (4, 2, 32)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
                  [0, 1], (4, 2, 32)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                         n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32, **_MLA),
                    [1, 2], (8, 4, 32)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=48, **_TWO_FULL), [0, 1], (4, 2, 32)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                    dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         shared_expert_intermediate_size=48, **_TWO_FULL), [0, 1], (4, 2, 32)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2), [0, 1], (4, 2, 96)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                      first_k_dense_replace=1, moe_intermediate_size=32), [1], (8, 2, 32)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                         moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"], index_topk=8, index_head_dim=16,
                         index_n_heads=2, **_MLA), [1], (8, 2, 32)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                          moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"], **_MLA), [1], (8, 4, 32)),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                   [0, 1], (4, 2, 96)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2),
                   [0, 1], (4, 2, 96)),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(num_experts=4, moe_topk=2),
                       [0, 1], (4, 2, 96)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM",
                 dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                      moe_intermediate_size=32, first_k_dense_replace=1, **_MLA), [1], (8, 2, 32)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2, **_TWO_FULL),
                [0, 1], (4, 2, 96)),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM",
               dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, interleave_moe_layer_step=1),
               [0, 1], (4, 1, 96)),
}


def config(model_type: str, **overrides):
    config_class, _, arguments, _, _ = TINY[model_type]
    return getattr(transformers, config_class)(**{**BASE, **arguments, **overrides})


def build(model_type: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A tiny random model of ``model_type`` in eval mode (weights a function of ``seed``)."""
    torch.manual_seed(seed)
    model = getattr(transformers, TINY[model_type][1])(config(model_type, **overrides))
    generator = torch.Generator().manual_seed(seed + 1)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    return model.to(dtype).eval()


def generate(model, input_ids, new_tokens: int = 6) -> torch.Tensor:
    """Greedy decoding of ``new_tokens`` tokens after ``input_ids [batch, seq]``."""
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def prompts(batch: int = 2, length: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def expertd_serve(checkpoint, dtype: str, cache_dir, *, ready_timeout: float = 300.0, native: bool = False,
                  port: int = 0, shm_channel: str | None = None):
    """``expertd serve --checkpoint`` on loopback in a subprocess; yields its ``host:port`` once ready and
    stops it (SIGTERM, then kill) on exit. ``native``: with ``--native-port 0``, yielding that port's target.
    ``port``: the gRPC port (0: one the system picks). ``shm_channel``: with ``--shm-channel`` at that
    path, yielding ``shm://<path>``."""
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--metrics-port", "0", "--checkpoint", str(checkpoint), "--dtype", dtype, "--num-devices", "1",
               "--bucket-sizes", "1,4,16", "--max-queue-delay-ms", "0", "--drain-grace-s", "5",
               "--compile-cache-dir", str(cache_dir), *(["--native-port", "0"] if native else []),
               *(["--shm-channel", shm_channel] if shm_channel else [])]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "1"}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in server.stdout], daemon=True)
    reader.start()
    try:
        output, port, deadline = [], None, time.monotonic() + ready_timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"expertd serve not ready after {ready_timeout}s:\n{''.join(output)}") from None
            output.append(line)
            if match := re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", line):
                port = int(match.group(1))
                if native:
                    port = int(re.search(r"native Forward port (\d+)", line).group(1))
            if "ready:" in line and port is not None:
                break
            if line.startswith("expertd: error") or server.poll() is not None:
                raise RuntimeError(f"expertd serve failed:\n{''.join(output)}")
        yield f"shm://{shm_channel}" if shm_channel else f"127.0.0.1:{port}"
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        reader.join(timeout=5)
