"""The whole MoE layer forward on one device: router -> dispatch -> grouped experts -> combine
(+ shared experts).

For the fast path, call `prepare_params(params, cfg)` once after loading the weights and pass its
result to `moe_layer` on every call: it lays the expert weights out for the platform's fastest
backend (on CPU, the native kernel's layout), so a plain call runs as fast as the server does.
Unprepared params work too, with the same outputs.

Public API (T tokens, H hidden, I expert intermediate, Is shared intermediate, E experts, k top-k):

  MoEConfig                  the layer's shapes and routing settings (`expertd.kernels.config`).
  MoEParams                  the layer's typed params (`expertd.kernels.params`: names, shapes and
                             dtypes per field); `init_params(cfg, key, dtype)` makes seeded ones,
                             `MoEParams.from_dict(d, cfg)` wraps a loader's dict of arrays.
  prepare_params(params, cfg, platform=None, *, backend="auto", expert_weights="dtype") -> MoEParams
      Once after loading (the role vLLM's process_weights_after_loading plays): on CPU, where the
      native kernel is available and `backend` would run it ("auto" or "native_cpu"), the routed
      expert weights in its layout (opaque, not arrays); elsewhere `params` unchanged. Exact.
      expert_weights="int8" (CPU only): the routed expert weights quantised to INT8 (W8A16,
      per-output-channel scales; `cpu.int8`), not exact.
  moe_layer(params, x [T, H], cfg, *, backend="auto", valid_tokens=None, return_routing=False,
            token_ids=None)
      -> out [T, H] in x.dtype, or (out, routing) with routing a dict:
         topk_ids int32 [T, k] (descending weight; -1 on padding rows),
         topk_weights fp32 [T, k] (0 on padding rows), tokens_per_expert int32 [E] (padding excluded).
      valid_tokens: None, an int n (rows >= n are padding) or a bool [T] mask. Padding rows are not
      routed, not counted and come back as zeros.
      token_ids: int32 [T], required by hash-routed layers (cfg.hash_vocab_size > 0; ids outside
      [0, V) are clipped here: check them on the host with `routing.check_token_ids`), ignored
      by the others.
      backend: an expert backend of `expertd.kernels.experts` ("auto", "reference", "ragged_dot",
      "capacity", "expert_loop", "native_cpu", "pallas", "tokamax"). The routed expert weights may
      be block-scaled FP8 (`experts.Fp8BlockWeights`): "pallas" and "tokamax" read the codes and
      scale in the kernel, the others dequantise per call. With "native_cpu" (auto's CPU choice
      where its library builds) the dispatch runs in C++ too (`cpu.routed_experts`); the other
      backends use dispatch.permute / unpermute. Prepared params give every backend the outputs
      of unprepared ones, bit for bit. Every backend runs every semantic of MoEConfig.
  route(params, x [T, H], cfg, valid=None, *, token_ids=None) -> (ids int32 [T, k], weights fp32
      [T, k]); params a MoEParams or RouterParams (the router's part alone). `router_logits`,
      `route_from_logits` and `check_token_ids` too: `expertd.kernels.routing`.
  compiler_options(cfg, T, *, dtype, backend="auto") -> dict for `jax.jit(..., compiler_options=...)`
      of the program calling moe_layer on T tokens with expert weights of `dtype` (empty where the
      defaults are fastest; see experts.compiler_options).

The layer's parts, which the expert-parallel layer (`expertd.kernels.ep`) calls in the same order:
  route -> expert_input(params, x, cfg) (the rows the routed experts read) -> dispatch.permute ->
  input_weights(rows, perm, weights, cfg) -> (rows, combine weights) -> routed_ffn(params, rows,
  group_sizes, cfg, backend=, capacity=) -> dispatch.unpermute(..., combine weights) ->
  finish(params, routed [T, H] fp32, x, cfg) (output norm, shared experts).

Semantics (checked against the Hugging Face modelling code; router math in fp32; the families'
variants are MoEConfig's docstring and docs/semantics.md):
  logits = x @ router_weight in fp32; the router is expertd.kernels.router (TE semantics).
  Mixtral: softmax over the top-k logits (= softmax over all E, top-k, renormalise).
  Qwen2/3-MoE: softmax over all E, top-k; renormalised only with norm_topk_prob (then equal to
  Mixtral's), so norm_topk_prob=False maps to use_pre_softmax=True.
  DeepSeek-V3: sigmoid scores, selection on score + e_score_correction_bias limited to the
  topk_group best of n_group groups (group score = sum of the top 2: group_score_topk=2),
  weights = unbiased scores, divided by their sum (+1e-20) if norm_topk_prob, times
  routed_scaling_factor.
  out = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  (fp32 accumulation)
        + [sigmoid(x @ shared_gate)] * shared_mlp(x)  (Qwen2-MoE gate; DeepSeek-V3 ungated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from expertd.kernels import cpu, dispatch, experts
from expertd.kernels.config import SCORE_FUNCTIONS, MoEConfig
from expertd.kernels.ffn import expert_activation, expert_biases, rms_norm, shared_activation
from expertd.kernels.params import (
    EXPERT_FIELDS,
    EXPERT_WEIGHTS,
    MoEParams,
    RouterParams,
    check_params,
    init_params,
    logical_shape,
    param_dtype,
    param_shapes,
)
from expertd.kernels.routing import check_token_ids, route, route_from_logits, router_logits

__all__ = [
    "EXPERT_FIELDS", "EXPERT_WEIGHTS", "SCORE_FUNCTIONS", "MoEConfig", "MoEParams", "RouterParams", "check_params",
    "check_token_ids", "compiler_options", "expert_input", "finish", "init_params", "input_weights", "logical_shape",
    "moe_layer", "param_dtype", "param_shapes", "prepare_params", "route", "route_from_logits", "routed_ffn",
    "router_logits", "shared_experts", "valid_mask",
]


def valid_mask(valid_tokens, num_tokens: int):
    """Bool `[T]` mask from None / an int count / a bool `[T]` mask (None stays None)."""
    if valid_tokens is None:
        return None
    v = jnp.asarray(valid_tokens)
    if v.ndim == 0:
        if not jnp.issubdtype(v.dtype, jnp.integer):
            raise ValueError(f"valid_tokens must be an int count or a bool [T] mask, got dtype {v.dtype}")
        return jnp.arange(num_tokens) < v
    if v.shape != (num_tokens,):
        raise ValueError(f"valid_tokens mask must have shape [T]=({num_tokens},), got {v.shape}")
    return v.astype(bool)


def shared_experts(params: MoEParams, x, cfg: MoEConfig):
    """Shared-expert output `[T, H]` fp32 (only called when cfg.has_shared)."""
    y = experts.gated_mlp(x, params.shared_w_gate, params.shared_w_up, params.shared_w_down,
                          shared_activation(cfg)).astype(jnp.float32)
    if cfg.shared_expert_gate:
        gate = experts.matmul_f32(x, params.shared_gate.astype(x.dtype))  # [T, 1]
        y = jax.nn.sigmoid(gate) * y
    return y


def expert_input(params: MoEParams, x, cfg: MoEConfig):
    """The `[T, H]` rows the routed experts read (x.dtype): x, or with cfg.expert_input_norm
    rmsnorm(x) * expert_input_norm_weight (Gemma 4's pre_feedforward_layernorm_2)."""
    if not cfg.expert_input_norm:
        return x
    return rms_norm(x, params.expert_input_norm_weight, cfg.norm_eps).astype(x.dtype)


def input_weights(rows, perm: dispatch.Permutation, weights, cfg: MoEConfig):
    """(expert input rows, the weights to combine their outputs with): `(rows, weights)`, or with
    cfg.router_weight_on_input (Llama 4) `(w * rows, None)`, combined unweighted."""
    if not cfg.router_weight_on_input:
        return rows, weights
    return dispatch.scale_rows(rows, perm, weights), None


def routed_ffn(params: MoEParams, rows, group_sizes, cfg: MoEConfig, *, backend: str = "auto", capacity=None):
    """`experts.grouped_ffn` of the layer's routed experts over expert-major `rows [N, H]`, with the
    config's gated activation (clamps, gpt-oss's variant) and per-expert biases."""
    return experts.grouped_ffn(rows, group_sizes, params.w_gate, params.w_up, params.w_down,
                               activation=expert_activation(cfg), biases=expert_biases(params, cfg),
                               backend=backend, capacity=capacity)


def finish(params: MoEParams, routed, x, cfg: MoEConfig):
    """The layer's fp32 `[T, H]` output from the routed experts' fp32 combine: with
    cfg.expert_output_norm rmsnorm(routed) * expert_output_norm_weight, plus the shared experts
    (which read x)."""
    out = routed
    if cfg.expert_output_norm:  # Gemma 4's post_feedforward_layernorm_2
        out = rms_norm(out, params.expert_output_norm_weight, cfg.norm_eps)
    if cfg.has_shared:
        out = out + shared_experts(params, x, cfg)
    return out


def compiler_options(cfg: MoEConfig, num_tokens: int, *, dtype, backend: str = "auto",
                     platform: str | None = None) -> dict:
    """XLA compiler options for the jit of a program running `moe_layer` on `num_tokens` tokens.

    `jax.jit(f, compiler_options=moe.compiler_options(cfg, T, dtype=params.w_gate.dtype))`: the
    grouped FFN sees T * topk rows (see `experts.compiler_options`); empty where the defaults are
    fastest. The same options fit `ep.ep_moe_layer`, whose ranks see the same rows per expert on
    average."""
    return experts.compiler_options(num_tokens * cfg.topk, cfg.num_experts, cfg.hidden_size,
                                    cfg.intermediate_size, dtype=dtype, backend=backend, platform=platform)


def prepare_params(params: MoEParams, cfg: MoEConfig, platform: str | None = None, *,
                   backend: str = "auto", expert_weights: str = "dtype") -> MoEParams:
    """`params` laid out for the fastest backend of `platform` (default: JAX's default backend),
    once after loading. CPU with `backend` "auto" or "native_cpu" and the native library
    available: the routed expert weights in its layout (`cpu.prepare_params`); "tokamax" on GPU:
    FP8 expert weights (`experts.Fp8BlockWeights`) with their codes held `[E, C, K]`
    (`experts.tokamax_weights`); otherwise `params` itself. `moe_layer` computes the same outputs
    from either. `expert_weights` "int8": the routed expert weights quantised (`cpu.prepare_params`;
    FP8 ones straight from their codes, `cpu.int8.fp8_to_int8_panels`); ValueError off CPU, where
    nothing reads them."""
    check_params(params, cfg)
    experts.check_backend(backend)
    platform = platform or jax.default_backend()
    if platform != "cpu" and expert_weights != "dtype":
        raise ValueError(f"expert_weights={expert_weights!r} is served on CPU only")
    if backend == "tokamax":  # FP8 codes held as its quantised kernels read them
        return params.replace(**{n: experts.tokamax_weights(getattr(params, n), platform) for n in EXPERT_WEIGHTS})
    if platform != "cpu":
        return params
    if expert_weights == "int8" and backend in cpu.PREPARING_BACKENDS:  # FP8 codes straight to INT8
        params = params.replace(**{n: cpu.int8.fp8_to_int8_panels(w.codes, w.scales, w.block, w.transposed)
                                   for n in EXPERT_WEIGHTS if experts.is_fp8(w := getattr(params, n))})
    return cpu.prepare_params(params, backend=backend, expert_weights=expert_weights)


def moe_layer(params: MoEParams, x, cfg: MoEConfig, *, backend: str = "auto", valid_tokens=None,
              return_routing: bool = False, token_ids=None):
    """MoE layer forward `x [T, H]` -> `[T, H]` (x.dtype); see the module docstring. For the fast
    path, pass params made once by `prepare_params`."""
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, H={cfg.hidden_size}], got shape {x.shape}")
    check_params(params, cfg)
    experts.check_backend(backend)
    t = x.shape[0]
    valid = valid_mask(valid_tokens, t)
    ids, weights = route(params, x, cfg, valid, token_ids=token_ids)
    if backend == "auto":
        backend = experts.choose_backend(t * cfg.topk, cfg.num_experts, cfg.hidden_size,
                                         cfg.intermediate_size, params.w_gate.dtype,
                                         fp8_weights=experts.is_fp8(params.w_gate))
    xe = expert_input(params, x, cfg)
    if backend == "native_cpu" and experts.is_fp8(params.w_gate):  # its kernel reads dense weights
        params = params.replace(**{n: experts.dequantize(getattr(params, n), x.dtype) for n in EXPERT_WEIGHTS})
    if backend == "native_cpu":
        out, perm = cpu.routed_experts(params, xe, ids, weights, valid, cfg)
    else:
        rows, perm = dispatch.permute(xe, jnp.maximum(ids, 0), cfg.num_experts, valid=valid)
        rows, combine_weights = input_weights(rows, perm, weights, cfg)
        ys = routed_ffn(params, rows, perm.group_sizes, cfg, backend=backend, capacity=t)
        out = dispatch.unpermute(ys, perm, combine_weights, out_dtype=jnp.float32)
    out = finish(params, out, x, cfg)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0.0)
    out = out.astype(x.dtype)
    if not return_routing:
        return out
    return out, {"topk_ids": ids, "topk_weights": weights, "tokens_per_expert": perm.tokens_per_expert}
