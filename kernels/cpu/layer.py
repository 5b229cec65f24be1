"""The native CPU backend as the MoE layer uses it: the grouped FFN, the layer's routed-expert pass,
the weights prepared once after loading, and what a server reports about it.

  grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", source=None, biases=None)
      -> [N, H]
      The "native_cpu" grouped-FFN backend (the contract of `expertd.kernels.ffn`): fp32
      accumulation, weights row-major or prepared. Gate, up, their biases and the gated activation
      in one `ffi.grouped_glu` call where it computes the activation (`ffi.fuses`: silu,
      gelu_tanh, swiglu_oai with their clamps; h rounded to bf16 or kept fp32), then the down
      projection (`ffi.grouped_matmul`) and its bias. Otherwise (gelu with erf, other dtypes) one
      `ffi.grouped_matmul` per projection with the activation and biases in XLA between them.
  routed_experts(params, x, ids, weights, valid, cfg) -> (fp32 [T, H], dispatch.Permutation)
      `moe.moe_layer`'s routed part with backend "native_cpu": the dispatch in C++ too. With
      cfg.router_weight_on_input (Llama 4) the weighted rows are gathered in XLA first.
  prepare_params(params, *, backend="auto", expert_weights="dtype") -> MoEParams
      The routed expert weights in the layout the kernel reads fastest (panel-major, `panels`)
      where the library is available and `backend` would run it; otherwise `params` unchanged.
      expert_weights="int8": quantised to INT8 panels instead (`int8.py`, W8A16), wherever
      `backend` is one of PREPARING_BACKENDS (without the library the other backends read them
      dequantised through `dense_weights`).
  dense_weights(w) -> the `[E, K, C]` array of prepared weights (arrays as they are): the one door
      through which the other backends read prepared weights.
  describe(params=None) -> dict: availability, why not, instruction-set level, weight layout and
      what the expert weights are served as.
"""
from __future__ import annotations

import jax.numpy as jnp

from expertd.kernels import dispatch, names
from expertd.kernels.config import MoEConfig
from expertd.kernels.cpu import ffi, int8, library, panels
from expertd.kernels.cpu.build import available, unavailable_reason
from expertd.kernels.ffn import (
    as_gated_activation,
    check_ffn_args,
    expert_activation,
    expert_biases,
    row_biases,
    row_experts,
)
from expertd.kernels.params import EXPERT_WEIGHTS, MoEParams

PREPARING_BACKENDS = ("auto", "native_cpu")  # the backends whose CPU runs read prepared weights
EXPERT_WEIGHTS_CHOICES = names.EXPERT_WEIGHTS  # as loaded (the serving dtype), or INT8 (int8.py); kernels/names.py

dense_weights = panels.dense


def grouped_ffn(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", source=None, biases=None):
    """Grouped FFN through the C++ grouped matmul, one call per projection, fp32 accumulation; `h`
    is rounded to xs.dtype before the down projection as in the other backends. The kernel never
    reads rows past sum(group_sizes) nor experts without rows, and writes zeros there.

    With `source int32 [N]` (a Permutation's token_of_row), `xs` is the `[T, H]` token rows and the
    gate / up projections gather their rows by it inside the kernel (the layer's CPU path: the
    permuted `[N, H]` copy of x is never written); the result is `[N, H]` either way."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    glu = as_gated_activation(activation)
    x32 = xs.astype(jnp.float32)
    if ffi.fuses(glu, xs.dtype):  # gate, up and the activation in one call; h never leaves it unrounded
        gate_up_biases = None if biases is None else (biases.gate, biases.up)
        h = ffi.grouped_glu(x32, group_sizes, w_gate, w_up, glu, source=source, biases=gate_up_biases,
                            round_to=xs.dtype)
        y = ffi.grouped_matmul(h, group_sizes, w_down)
        if biases is not None:
            y = y + row_biases(biases, *row_experts(group_sizes, y.shape[0])).down
        return y.astype(xs.dtype)
    g = ffi.grouped_matmul(x32, group_sizes, w_gate, source=source)
    u = ffi.grouped_matmul(x32, group_sizes, w_up, source=source)
    rb = None
    if biases is not None:  # each row's expert's biases; rows past the groups get none
        rb = row_biases(biases, *row_experts(group_sizes, g.shape[0]))
        g, u = g + rb.gate, u + rb.up
    y = ffi.grouped_matmul(glu(g, u).astype(xs.dtype).astype(jnp.float32), group_sizes, w_down)
    if rb is not None:
        y = y + rb.down
    return y.astype(xs.dtype)


def routed_experts(params: MoEParams, x, ids, weights, valid, cfg: MoEConfig):
    """(the routed experts' fp32 `[T, H]` output, its Permutation) through the C++ passes: the
    layout as a counting sort, gate / up reading token rows by index (no permuted copy of x), the
    combine reading each expert row once. x `[T, H]`, ids int32 `[T, k]` (-1 on padding), weights
    fp32 `[T, k]`, valid bool `[T]` or None. Each pass equals its jnp twin in the generic path
    (tests/kernels/test_cpu_dispatch.py) and the layer matches the oracle (test_moe.py)."""
    perm = ffi.layout(jnp.maximum(ids, 0), cfg.num_experts, valid=valid)
    kwargs = dict(activation=expert_activation(cfg), biases=expert_biases(params, cfg))
    if cfg.router_weight_on_input:  # Llama 4: experts(w * x), summed unweighted
        rows = dispatch.scale_rows(x.at[perm.token_of_row].get(mode="fill", fill_value=0), perm, weights)
        ys = grouped_ffn(rows, perm.group_sizes, params.w_gate, params.w_up, params.w_down, **kwargs)
        return ffi.combine(ys, perm), perm
    ys = grouped_ffn(x, perm.group_sizes, params.w_gate, params.w_up, params.w_down, source=perm.token_of_row,
                     **kwargs)
    return ffi.combine(ys, perm, weights), perm


def prepare_params(params: MoEParams, *, backend: str = "auto", expert_weights: str = "dtype") -> MoEParams:
    """`params` with the routed expert matrices panel-major (panels of `panels.panel_columns()`
    for this CPU) where the library is available and `backend` is one of PREPARING_BACKENDS; the
    rest (router, shared experts) as they are. Otherwise `params` itself. Exact: a relayout.
    `expert_weights` "int8": the routed expert matrices quantised to INT8 panels
    (`int8.to_int8_panels`; not exact: int8.py has the error) wherever `backend` is one of
    PREPARING_BACKENDS, the library available or not."""
    if expert_weights not in EXPERT_WEIGHTS_CHOICES:
        raise ValueError(f"expert_weights must be one of {EXPERT_WEIGHTS_CHOICES}, got {expert_weights!r}")
    if backend not in PREPARING_BACKENDS:
        return params
    if expert_weights == "int8":
        return params.replace(**{name: int8.to_int8_panels(getattr(params, name)) for name in EXPERT_WEIGHTS})
    if not available():
        return params
    return params.replace(**{name: panels.to_panels(getattr(params, name)) for name in EXPERT_WEIGHTS})


def describe(params: MoEParams | None = None) -> dict:
    """The native CPU backend as a server reports it:

      available      whether the library is built and loaded (building it now if need be)
      reason         why not (None when available)
      isa            the instruction-set level it runs at (`library.isa()`), None without it
      amx            what the AMX probe found (`library.amx()`: "none", "high_first", ...)
      weight_layout  "panels" or "row_major": of `params`' routed expert weights when given,
                     else of what `prepare_params` makes on this machine
      panel_columns  the panels' width (16 or 64), None for row-major
      expert_weights "int8" (INT8 panels, W8A16) or the dtype of `params`' routed expert weights
                     as held ("bfloat16", "float32"); None without `params`
    """
    ok = available()
    held = None
    if params is not None:
        w = params.w_gate
        columns = w.panel_columns if panels.is_panels(w) else None
        held = "int8" if panels.is_panels(w) and w.int8 else str(w.dtype)
    else:
        columns = panels.panel_columns() if ok else None
    return {"available": ok, "reason": unavailable_reason() or None, "isa": library.isa(), "amx": library.amx(),
            "weight_layout": "row_major" if columns is None else "panels", "panel_columns": columns,
            "expert_weights": held}

