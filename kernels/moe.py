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
  prepare_params(params, cfg, platform=None, *, backend="auto") -> MoEParams
      Once after loading (the role vLLM's process_weights_after_loading plays): on CPU, where the
      native kernel is available and `backend` would run it ("auto" or "native_cpu"), the routed
      expert weights in its layout (opaque, not arrays); elsewhere `params` unchanged. Exact.
  moe_layer(params, x [T, H], cfg, *, backend="auto", valid_tokens=None, return_routing=False)
      -> out [T, H] in x.dtype, or (out, routing) with routing a dict:
         topk_ids int32 [T, k] (descending weight; -1 on padding rows),
         topk_weights fp32 [T, k] (0 on padding rows), tokens_per_expert int32 [E] (padding excluded).
      valid_tokens: None, an int n (rows >= n are padding) or a bool [T] mask. Padding rows are not
      routed, not counted and come back as zeros.
      backend: an expert backend of `expertd.kernels.experts` ("auto", "reference", "ragged_dot",
      "capacity", "expert_loop", "native_cpu", "pallas"). With "native_cpu" (auto's CPU choice
      where its library builds) the dispatch runs in C++ too (`cpu.routed_experts`); the other
      backends use dispatch.permute / unpermute. Prepared params give every backend the outputs
      of unprepared ones, bit for bit.
  route(params, x [T, H], cfg, valid=None) -> (ids int32 [T, k], weights fp32 [T, k]); params a
      MoEParams or RouterParams (the router's part alone).
  compiler_options(cfg, T, *, dtype, backend="auto") -> dict for `jax.jit(..., compiler_options=...)`
      of the program calling moe_layer on T tokens with expert weights of `dtype` (empty where the
      defaults are fastest; see experts.compiler_options).

Semantics (checked against the Hugging Face modelling code; router math in fp32):
  logits = x @ router_weight in fp32; the router is expertd.kernels.router (TE semantics).
  Mixtral: softmax over the top-k logits (= softmax over all E, top-k, renormalise).
  Qwen2/3-MoE: softmax over all E, top-k; renormalised only with norm_topk_prob (then equal to
  Mixtral's), so norm_topk_prob=False maps to use_pre_softmax=True.
  DeepSeek-V3: sigmoid scores, selection on score + e_score_correction_bias limited to the
  topk_group best of n_group groups (group score = sum of the top 2), weights = unbiased scores,
  divided by their sum (+1e-20) if norm_topk_prob, times routed_scaling_factor.
  out = sum_j w[t, j] * expert_{ids[t, j]}(x[t])  (fp32 accumulation)
        + [sigmoid(x @ shared_gate)] * shared_mlp(x)  (Qwen2-MoE gate; DeepSeek-V3 ungated).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from expertd.kernels import cpu, dispatch, experts
from expertd.kernels.config import SCORE_FUNCTIONS, MoEConfig
from expertd.kernels.params import (
    EXPERT_WEIGHTS,
    MoEParams,
    RouterParams,
    check_params,
    init_params,
    logical_shape,
    param_shapes,
)
from expertd.kernels.router import fused_topk_with_score_function, topk_ids_and_weights

__all__ = [
    "EXPERT_WEIGHTS", "SCORE_FUNCTIONS", "MoEConfig", "MoEParams", "RouterParams", "check_params",
    "compiler_options", "init_params", "logical_shape", "moe_layer", "param_shapes", "prepare_params", "route",
    "router_logits", "shared_experts", "valid_mask",
]

_EPS = 1e-20  # added to the weight sum before normalising, as TE and DeepSeek-V3


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


def _check_router_params(params) -> None:
    if not isinstance(params, (MoEParams, RouterParams)):
        raise TypeError(f"params must be a MoEParams or RouterParams (see expertd.kernels.params), "
                        f"got {type(params).__name__}")


def router_logits(params: MoEParams | RouterParams, x):
    """`x [T, H]` -> fp32 logits `[T, E]`, computed in full fp32 (HIGHEST precision: left at
    DEFAULT, GPUs round the operands to TF32 / bf16 and near-equal logits swap experts)."""
    _check_router_params(params)
    return jnp.matmul(x.astype(jnp.float32), params.router_weight.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def route(params: MoEParams | RouterParams, x, cfg: MoEConfig, valid=None, *, router_backend: str = "auto"):
    """Router step: `x [T, H]` -> (ids int32 [T, k], weights fp32 [T, k]) in HF semantics."""
    logits = router_logits(params, x)
    probs, routing_map = fused_topk_with_score_function(
        logits, cfg.topk, use_pre_softmax=cfg.use_pre_softmax, num_groups=cfg.num_groups,
        group_topk=cfg.group_topk, scaling_factor=float(cfg.scaling_factor),
        score_function=cfg.score_function, expert_bias=params.expert_bias if cfg.use_expert_bias else None,
        backend=router_backend)
    ids, weights = topk_ids_and_weights(probs, routing_map, cfg.topk)
    if _overrides_normalisation(cfg):
        # The router's weights are normalised differently; recompute from the raw scores.
        if cfg.score_function == "softmax":
            raw = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
        else:
            raw = jnp.take_along_axis(_elementwise_score(logits, cfg.score_function), ids, axis=-1)
        if cfg.norm_topk_prob:
            raw = raw / (raw.sum(axis=-1, keepdims=True) + _EPS)
        weights = raw * jnp.float32(cfg.scaling_factor)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, -1)
        weights = jnp.where(valid[:, None], weights, 0.0)
    return ids, weights


def _overrides_normalisation(cfg: MoEConfig) -> bool:
    if cfg.norm_topk_prob is None:
        return False
    if cfg.score_function == "softmax":
        return cfg.use_pre_softmax and cfg.norm_topk_prob
    return cfg.norm_topk_prob != (cfg.topk > 1)


def _elementwise_score(logits, score_function):
    if score_function == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jnp.sqrt(jax.nn.softplus(logits))


def shared_experts(params: MoEParams, x, cfg: MoEConfig):
    """Shared-expert output `[T, H]` fp32 (only called when cfg.has_shared)."""
    y = experts.gated_mlp(x, params.shared_w_gate, params.shared_w_up, params.shared_w_down,
                          cfg.activation).astype(jnp.float32)
    if cfg.shared_expert_gate:
        gate = experts.matmul_f32(x, params.shared_gate.astype(x.dtype))  # [T, 1]
        y = jax.nn.sigmoid(gate) * y
    return y


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
                   backend: str = "auto") -> MoEParams:
    """`params` laid out for the fastest backend of `platform` (default: JAX's default backend),
    once after loading. CPU with `backend` "auto" or "native_cpu" and the native library
    available: the routed expert weights in its layout (`cpu.prepare_params`); otherwise `params`
    itself. `moe_layer` computes the same outputs from either."""
    check_params(params, cfg)
    experts.check_backend(backend)
    if (platform or jax.default_backend()) != "cpu":
        return params
    return cpu.prepare_params(params, backend=backend)


def moe_layer(params: MoEParams, x, cfg: MoEConfig, *, backend: str = "auto", valid_tokens=None,
              return_routing: bool = False):
    """MoE layer forward `x [T, H]` -> `[T, H]` (x.dtype); see the module docstring. For the fast
    path, pass params made once by `prepare_params`."""
    if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
        raise ValueError(f"x must be [T, H={cfg.hidden_size}], got shape {x.shape}")
    check_params(params, cfg)
    experts.check_backend(backend)
    t = x.shape[0]
    valid = valid_mask(valid_tokens, t)
    ids, weights = route(params, x, cfg, valid)
    if backend == "auto":
        backend = experts.choose_backend(t * cfg.topk, cfg.num_experts, cfg.hidden_size,
                                         cfg.intermediate_size, params.w_gate.dtype)
    if backend == "native_cpu":
        out, perm = cpu.routed_experts(params, x, ids, weights, valid, cfg)
    else:
        rows, perm = dispatch.permute(x, jnp.maximum(ids, 0), cfg.num_experts, valid=valid)
        ys = experts.grouped_ffn(rows, perm.group_sizes, params.w_gate, params.w_up, params.w_down,
                                 activation=cfg.activation, backend=backend, capacity=t)
        out = dispatch.unpermute(ys, perm, weights, out_dtype=jnp.float32)
    if cfg.has_shared:
        out = out + shared_experts(params, x, cfg)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0.0)
    out = out.astype(x.dtype)
    if not return_routing:
        return out
    return out, {"topk_ids": ids, "topk_weights": weights, "tokens_per_expert": perm.tokens_per_expert}
