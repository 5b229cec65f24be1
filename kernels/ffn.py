"""The grouped expert FFN's contract, the math every backend shares, and its plain-jnp reference.

    y = (act(x @ W_gate[e]) * (x @ W_up[e])) @ W_down[e]      (SwiGLU with act = silu)

Contract of every grouped-FFN backend (N rows, H hidden, I intermediate, E experts):
  xs [N, H], group_sizes int32 [E], w_gate [E, H, I], w_up [E, H, I], w_down [E, I, H] -> [N, H] xs.dtype.
  Rows are expert-major: expert e owns rows [offset_e, offset_e + group_sizes[e]) with
  offset = exclusive cumsum(group_sizes) (the layout of `dispatch.permute`, pad rows included).
  Rows at or past sum(group_sizes) are not read as data (they may hold NaN garbage) and come back
  as exact zeros; experts with no rows produce nothing. bf16 inputs run with fp32 accumulation;
  the activation product is taken in fp32 and rounded to xs.dtype before the down projection (as
  the Hugging Face models do in bf16).

Here: `activation_fn`, `matmul_precision` / `matmul_f32` (fp32 accumulation, full fp32 products
for fp32 operands), `gated_mlp` (one dense gated MLP, also the shared experts), `row_experts`,
`check_ffn_args` and `grouped_ffn_reference` (a per-expert loop over all rows, E x the FLOPs:
the backends' twin in the tests). `expertd.kernels.experts` is the door that picks a backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from expertd.kernels.config import ACTIVATIONS
from expertd.kernels.params import logical_shape


def activation_fn(name: str):
    """The elementwise activation `name` (one of ACTIVATIONS), applied in fp32."""
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":
        return lambda v: jax.nn.gelu(v, approximate=False)
    if name == "gelu_tanh":
        return lambda v: jax.nn.gelu(v, approximate=True)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {name!r}")


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


def gated_mlp(x, w_gate, w_up, w_down, activation: str = "silu"):
    """One (or a batch of) dense gated MLP(s): `x [..., M, H]` -> `[..., M, H]` in x.dtype."""
    act = activation_fn(activation)
    h = act(matmul_f32(x, w_gate)) * matmul_f32(x, w_up)
    return matmul_f32(h.astype(x.dtype), w_down).astype(x.dtype)


def row_experts(group_sizes, num_rows: int):
    """Expert of every row `int32 [N]` (E for rows past the last block) and the row's validity."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    return expert, rows < ends[-1]


def check_ffn_args(xs, group_sizes, w_gate, w_up, w_down):
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


def grouped_ffn_reference(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu"):
    """Per-expert reference: run expert e on every row, keep the rows of its block."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down)
    expert, valid = row_experts(group_sizes, xs.shape[0])
    xs = jnp.where(valid[:, None], xs, 0)

    def one_expert(e, out):
        y = gated_mlp(xs, w_gate[e], w_up[e], w_down[e], activation)
        return jnp.where((expert == e)[:, None], y, out)

    return lax.fori_loop(0, w_gate.shape[0], one_expert, jnp.zeros_like(xs))
