"""The grouped expert FFN's contract, the math every backend shares, and its plain-jnp reference.

    y = glu(x @ W_gate[e] + b_gate[e], x @ W_up[e] + b_up[e]) @ W_down[e] + b_down[e]
    glu(g, u) = act(g) * u                                     (SwiGLU with act = silu)

The gated activation `glu` is a `GatedActivation` (plain act(g) * u, or a family's clamped or
gpt-oss variant, see its docstring); the biases are optional (`ExpertBiases`, gpt-oss).

Contract of every grouped-FFN backend (N rows, H hidden, I intermediate, E experts):
  xs [N, H], group_sizes int32 [E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H] -> [N, H] xs.dtype.
  Rows are expert-major: expert e owns rows [offset_e, offset_e + group_sizes[e]) with
  offset = exclusive cumsum(group_sizes) (the layout of `dispatch.permute`, pad rows included).
  Rows at or past sum(group_sizes) are not read as data (they may hold NaN garbage) and come back
  as exact zeros; experts with no rows produce nothing (a bias never reaches a row of another
  expert, a pad row or an empty expert). bf16 inputs run with fp32 accumulation; biases are added
  and the activation product is taken in fp32, rounded to xs.dtype before the down projection (as
  the Hugging Face models do in bf16).

Here: `activation_fn`, `GatedActivation` / `as_gated_activation` and the config's
(`expert_activation`, `shared_activation`), `ExpertBiases` (`expert_biases` of a layer's params),
`rms_norm`, `matmul_precision` / `matmul_f32` (fp32 accumulation, full fp32 products for fp32
operands), `gated_mlp` (one dense gated MLP, also the shared experts), `row_experts`,
`row_biases`, `check_ffn_args`, `grouped_ffn_by` (the contract around a library's grouped product:
the "ragged_dot" and "tokamax" backends) and `grouped_ffn_reference` (a per-expert loop over all
rows, E x the FLOPs: the backends' twin in the tests). `expertd.kernels.experts` is the door that
picks a backend.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels.config import ACTIVATIONS, DEFAULT_SWIGLU_ALPHA, SWIGLU_LIMIT_MODES, MoEConfig
from expertd.kernels.params import logical_shape

ELEMENTWISE = ("silu", "gelu", "gelu_tanh")  # the activations act(g) of a plain gated MLP


def activation_fn(name: str):
    """The elementwise activation `name` (one of ELEMENTWISE), applied in fp32."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda v: jax.nn.gelu(v, approximate=False)
    if name == "gelu_tanh":
        return lambda v: jax.nn.gelu(v, approximate=True)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


@dataclasses.dataclass(frozen=True)
class GatedActivation:
    """glu(g, u) of a gated MLP, elementwise on fp32 `g = x @ W_gate (+ b)`, `u = x @ W_up (+ b)`.

      name silu / gelu / gelu_tanh, limit None:     act(g) * u
      limit L, mode "before_activation":            act(min(g, L)) * clip(u, -L, L)
          (GLM-5 Next, DeepSeek-V4: modeling_deepseek_v4.py DeepseekV4Experts._apply_gate)
      limit L, mode "after_activation":             min(act(g), L) * clip(u, -L, L)
          (Step-3.5 / 3.7: modeling_step3p7.py Step3p7Experts._apply_gate)
      name swiglu_oai (gpt-oss, modeling_gpt_oss.py GptOssExperts), g' = min(g, L):
                                                    (clip(u, -L, L) + 1) * g' * sigmoid(alpha * g')
          (limit None: no clamp)

    Hashable (static under jit); `GatedActivation()` is plain SwiGLU, the same ops as before these
    variants existed.
    """

    name: str = "silu"
    limit: float | None = None
    limit_mode: str = "before_activation"
    alpha: float = DEFAULT_SWIGLU_ALPHA

    def __post_init__(self):
        if self.name not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.name!r}")
        if self.limit is not None and not (isinstance(self.limit, (int, float)) and math.isfinite(self.limit)
                                           and self.limit > 0):
            raise ValueError(f"activation limit must be None or a finite float > 0, got {self.limit!r}")
        if self.limit_mode not in SWIGLU_LIMIT_MODES:
            raise ValueError(f"activation limit_mode must be one of {SWIGLU_LIMIT_MODES}, got {self.limit_mode!r}")

    def __call__(self, g, u):
        """glu(g, u), fp32 in and out."""
        lim = self.limit
        if self.name == "swiglu_oai":
            if lim is not None:
                g, u = jnp.minimum(g, lim), jnp.clip(u, -lim, lim)
            return (u + 1.0) * (g * jax.nn.sigmoid(self.alpha * g))
        act = activation_fn(self.name)
        if lim is None:
            return act(g) * u
        if self.limit_mode == "before_activation":
            return act(jnp.minimum(g, lim)) * jnp.clip(u, -lim, lim)
        return jnp.minimum(act(g), lim) * jnp.clip(u, -lim, lim)


def as_gated_activation(activation) -> GatedActivation:
    """A GatedActivation from one, or from an activation name (plain act(g) * u)."""
    if isinstance(activation, GatedActivation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS} or a GatedActivation, got {activation!r}")
    return GatedActivation(activation)


def expert_activation(cfg: MoEConfig) -> GatedActivation:
    """The routed experts' gated activation of `cfg` (activation, swiglu_limit, mode, alpha)."""
    return GatedActivation(cfg.activation, cfg.swiglu_limit, cfg.swiglu_limit_mode, cfg.swiglu_alpha)


def shared_activation(cfg: MoEConfig) -> GatedActivation:
    """The shared experts' gated activation of `cfg` (their own limit, shared_swiglu_limit)."""
    return GatedActivation(cfg.activation, cfg.shared_swiglu_limit, cfg.swiglu_limit_mode, cfg.swiglu_alpha)


class ExpertBiases(NamedTuple):
    """Per-expert projection biases (gpt-oss): gate [E, I], up [E, I], down [E, H], any float dtype,
    added in fp32."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


def expert_biases(params, cfg: MoEConfig) -> ExpertBiases | None:
    """The routed experts' biases of a MoEParams (None unless cfg.expert_proj_bias)."""
    return ExpertBiases(params.b_gate, params.b_up, params.b_down) if cfg.expert_proj_bias else None


def rms_norm(x, weight, eps: float):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis, in fp32 (x any float dtype, weight
    [H] or None): the fp32 result (Hugging Face's Gemma3n / Gemma 4 RMSNorm before its cast)."""
    x = x.astype(jnp.float32)
    y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps))
    return y if weight is None else y * weight.astype(jnp.float32)


def matmul_precision(*operands) -> lax.Precision:
    """The precision of a product of `operands`: HIGHEST where one is fp32, DEFAULT otherwise.

    fp32 weights are computed in fp32: left at DEFAULT, GPUs run fp32 products as TF32 (or bf16
    passes), ~1e-3 relative error. bf16 operands are exact in any mode (their products accumulate
    in fp32 through preferred_element_type). On CPU both settings compute the same fp32 product.
    """
    return lax.Precision.HIGHEST if any(jnp.dtype(o.dtype) == jnp.float32 for o in operands) else lax.Precision.DEFAULT


def matmul_f32(a, b):
    """a @ b (batched over leading dims of both) with fp32 accumulation and fp32 result."""
    return jnp.matmul(a, b, preferred_element_type=jnp.float32, precision=matmul_precision(a, b))


def gated_mlp(x, w_gate, w_up, w_down, activation="silu", biases: ExpertBiases | None = None):
    """One (or a batch of) dense gated MLP(s): `x [..., M, H]` -> `[..., M, H]` in x.dtype.

    activation: a name or a GatedActivation. biases: gate / up `[..., 1, I]` and down `[..., 1, H]`
    (broadcast over the M rows), or None."""
    glu = as_gated_activation(activation)
    g, u = matmul_f32(x, w_gate), matmul_f32(x, w_up)
    if biases is not None:
        g, u = g + biases.gate.astype(jnp.float32), u + biases.up.astype(jnp.float32)
    y = matmul_f32(glu(g, u).astype(x.dtype), w_down)
    if biases is not None:
        y = y + biases.down.astype(jnp.float32)
    return y.astype(x.dtype)


def row_experts(group_sizes, num_rows: int):
    """Expert of every row `int32 [N]` (E for rows past the last block) and the row's validity."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return expert, rows < ends[-1]


def row_biases(biases: ExpertBiases | None, expert, valid):
    """Each row's gate / up `[N, I]` and down `[N, H]` fp32 biases (its expert's; zero on rows past
    the groups, whose `expert` is E), or None without biases."""
    if biases is None:
        return None
    safe = jnp.minimum(expert, biases.gate.shape[0] - 1)

    def rows(b):
        return jnp.where(valid[:, None], jnp.take(b, safe, axis=0).astype(jnp.float32), 0.0)

    return ExpertBiases(rows(biases.gate), rows(biases.up), rows(biases.down))


def check_biases(biases: ExpertBiases | None, e: int, h: int, i: int) -> None:
    """ValueError naming the bias whose shape is not gate [E, I], up [E, I], down [E, H]."""
    if biases is None:
        return
    if not isinstance(biases, ExpertBiases):
        raise ValueError(f"biases must be an ExpertBiases(gate, up, down) or None, got {type(biases).__name__}")
    for name, want in (("gate", (e, i)), ("up", (e, i)), ("down", (e, h))):
        if tuple(getattr(biases, name).shape) != want:
            raise ValueError(f"biases.{name} must have shape {want}, got {tuple(getattr(biases, name).shape)}")


def check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases: ExpertBiases | None = None):
    """ValueError naming the argument whose shape does not fit the grouped FFN contract (weights a
    backend prepared are checked by their `logical_shape`)."""
    if xs.ndim != 2:
        raise ValueError(f"xs must be [N, H], got shape {xs.shape}")
    h = xs.shape[1]
    gate, up, down = (logical_shape(w) for w in (w_gate, w_up, w_down))
    if len(gate) != 3 or gate[1] != h:
        raise ValueError(f"w_gate must be [E, H={h}, I], got shape {gate}")
    e, _, i = gate
    if up != (e, h, i):
        raise ValueError(f"w_up must be [E, H, I] = {(e, h, i)}, got shape {up}")
    if down != (e, i, h):
        raise ValueError(f"w_down must be [E, I, H] = {(e, i, h)}, got shape {down}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes must be int32 [E={e}], got shape {group_sizes.shape}")
    check_biases(biases, e, h, i)


def grouped_ffn_by(rdot, xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None):
    """The contract's grouped FFN with `rdot(a [N, K], w [E, K, C], group_sizes int32 [E]) -> [N, C]
    fp32` as its grouped product (a ragged dot of some library): rows past sum(group_sizes) are
    zeroed before the first product and after the last, so they are never read and come back zero."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    expert, valid = row_experts(group_sizes, xs.shape[0])
    xs = jnp.where(valid[:, None], xs, 0)
    gs = group_sizes.astype(jnp.int32)
    glu = as_gated_activation(activation)
    rb = row_biases(biases, expert, valid)
    g, u = rdot(xs, w_gate, gs), rdot(xs, w_up, gs)
    if rb is not None:
        g, u = g + rb.gate, u + rb.up
    y = rdot(glu(g, u).astype(xs.dtype), w_down, gs)
    if rb is not None:
        y = y + rb.down
    return jnp.where(valid[:, None], y.astype(xs.dtype), 0)


def grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None):
    """Per-expert reference: run expert e on every row, keep the rows of its block."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    expert, valid = row_experts(group_sizes, xs.shape[0])
    xs = jnp.where(valid[:, None], xs, 0)

    def one_expert(e, out):
        b = None if biases is None else ExpertBiases(*(v[e][None] for v in biases))
        y = gated_mlp(xs, w_gate[e], w_up[e], w_down[e], activation, b)
        return jnp.where((expert == e)[:, None], y, out)

    return lax.fori_loop(0, w_gate.shape[0], one_expert, jnp.zeros_like(xs))
