"""The native library's XLA:CPU custom calls, each with the plain-jnp twin the tests compare it with.

  grouped_matmul(x f32 [N, K], group_sizes int [E], w bf16|f32 [E, K, C] or PanelWeights (bf16,
                 fp32 or INT8 panels), *, source=None) -> f32 [N, C]
      Each row times its expert's matrix (expert-major rows); rows past sum(group_sizes) are 0.
      Every path sums k in order with one rounding per product-add, so a row's result is the same
      bits whatever the path, the layout, the instruction set or the other rows in the call (how
      many share its expert). With `source int [N]`, output row r reads `x[source[r]]` (token rows,
      no permuted copy of x). Twin: `grouped_matmul_reference`. INT8 panels (`int8.py`): the sum of
      x * q in k order as above, times the column's scale once (twin: `int8.grouped_matmul_reference`,
      within fp32 rounding; every path and level gives the same bits).
  grouped_glu(x f32 [M, K], group_sizes [E], w_gate, w_up, activation, *, source=None,
              biases=None, round_to=float32) -> f32 [N, C]
      The layer's first half in one call: per work item its block of x @ w_gate[e] and of
      x @ w_up[e] (each exactly as grouped_matmul computes it), then glu(g + b_gate, u + b_up)
      (csrc/gated_activation.h), rounded to bf16 where round_to is bfloat16, written once; the
      gate / up `[N, C]` pair never goes to memory. For the activations of FUSED_ACTIVATIONS
      (`fuses`); within a few fp32 ulp of XLA's formulas (bf16: XLA's rounding or its neighbour;
      twin: `grouped_glu_reference`), the same bits on every path and level.
  layout(topk_ids [T, k], E, *, align_size=0, valid=None) -> dispatch.Permutation
      `dispatch.layout` as one counting sort in C++; the same Permutation, field for field.
  combine(rows f32|bf16 [N, H], perm, topk_weights=None) -> f32 [T, H]
      `dispatch.unpermute(..., out_dtype=float32)` reading each routed row once.

Paths of the grouped matmul (`diagnostics.PATHS`; `diagnostics.path_items()` counts the work items each ran):
- AVX-512 CPUs, panel-major weights ("avx512_fma", csrc/panel_stream_avx512.h): one zmm per 16
  columns of a panel row; up to 6 rows per expert x 4 such strips keep their sums in registers over
  all of K, more go in 6-row blocks plus one of the rest, each streaming 4 strips over all of K.
  bf16 panels times bf16-valued rows (the layer's: x and h are rounded to the weights' dtype) on
  CPUs with AVX512_BF16 run the bf16 dot product ("avx512_bf16_dot"): 32 multiply-adds per
  instruction, rounding as the FMAs do (checked on the CPU at load). INT8 panels: int8 widened to
  fp32 in registers ("avx512_fma"); from 2 bf16-valued rows per expert two weight rows are widened
  into one bf16 pair for the dot product ("avx512_bf16_dot"), the same bits.
- Otherwise (row-major weights, AVX2 CPUs): under 32 rows per expert the weights are read once, in
  place, bf16 widened in registers ("avx2_stream"); more rows run a BLIS-style packed GEMM
  ("avx2_packed": fp32 weight panels, a 6 x 16 register micro-kernel).
- CPUs without AVX2 / FMA: portable scalar loops ("portable").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels import dispatch
from expertd.kernels.cpu import panels
from expertd.kernels.cpu.build import TARGET, require_library
from expertd.kernels.ffn import ExpertBiases, as_gated_activation, row_biases, row_experts

# The gated activations the fused call computes (csrc/gated_activation.h Kind): name -> kind.
FUSED_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}
_LIMIT_MODES = {None: 0, "before_activation": 1, "after_activation": 2}
_ROUNDINGS = (jnp.float32, jnp.bfloat16)  # what grouped_glu rounds h to (float32: not at all)


def grouped_matmul(x, group_sizes, w, *, source=None):
    """`x f32 [N, K]`, `group_sizes int [E]`, `w bf16|f32 [E, K, C]` -> `f32 [N, C]` (module docstring).

    `w` may also be a `panels.PanelWeights` of those weights (panel-major, made once at load): the
    same result bit for bit, read faster. With `source int [N]`, x is `[T, K]` token rows and output
    row r reads `x[source[r]]` (a source outside [0, T), e.g. a permutation's pad row T, reads
    zeros): `dispatch.permute`'s gather done inside the kernel, without writing the permuted
    `[N, K]` copy of x."""
    require_library()
    _, _, c = _check_matmul_args(x, group_sizes, w, source)
    rows = x.shape[0] if source is None else source.shape[0]
    out = jax.ShapeDtypeStruct((rows, c), jnp.float32)
    x, group_sizes = x.astype(jnp.float32), group_sizes.astype(jnp.int32)
    if panels.is_panels(w) and w.int8:
        scales = w.scales.astype(jnp.float32)
        if source is None:
            return jax.ffi.ffi_call("expertd_grouped_matmul_int8", out)(x, group_sizes, w.panels, scales)
        return jax.ffi.ffi_call("expertd_grouped_matmul_int8_gathered", out)(
            x, source.astype(jnp.int32), group_sizes, w.panels, scales)
    target, w = (TARGET + "_panels", w.panels) if panels.is_panels(w) else (TARGET, w)
    if source is None:
        return jax.ffi.ffi_call(target, out)(x, group_sizes, w)
    return jax.ffi.ffi_call(target + "_gathered", out)(x, source.astype(jnp.int32), group_sizes, w)


def grouped_matmul_reference(x, group_sizes, w):
    """Plain jnp: every row times its expert's matrix (fp32), rows past sum(group_sizes) -> 0."""
    expert, valid = row_experts(group_sizes, x.shape[0])
    w = panels.dense(w)
    wr = w[jnp.minimum(expert, w.shape[0] - 1)].astype(jnp.float32)  # [N, K, C]
    y = jnp.einsum("nk,nkc->nc", x.astype(jnp.float32), wr, precision=jax.lax.Precision.HIGHEST)
    return jnp.where(valid[:, None], y, 0.0)


def _check_matmul_args(x, group_sizes, w, source):
    """(E, K, C) of a grouped matmul's arguments; ValueError naming the one that does not fit."""
    shape = w.logical_shape if panels.is_panels(w) else getattr(w, "shape", None)
    if x.ndim != 2 or shape is None or len(shape) != 3 or group_sizes.shape != (shape[0],) \
            or x.shape[1] != shape[1]:
        raise ValueError(f"expected x [N, K], group_sizes [E], w [E, K, C]; got x {x.shape}, "
                         f"group_sizes {group_sizes.shape}, w {shape}")
    if not (panels.is_panels(w) and w.int8) and w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"w must be float32 or bfloat16 (or INT8 panels), got {w.dtype}")
    if source is not None and (source.ndim != 1 or not jnp.issubdtype(source.dtype, jnp.integer)):
        raise ValueError(f"source must be an integer [N] row index, got {source.dtype} {source.shape}")
    return shape


def fuses(activation, round_to=jnp.float32) -> bool:
    """Whether `grouped_glu` computes `activation` (a GatedActivation or a name) rounded to `round_to`."""
    return as_gated_activation(activation).name in FUSED_ACTIVATIONS and jnp.dtype(round_to) in _ROUNDINGS


def grouped_glu(x, group_sizes, w_gate, w_up, activation, *, source=None, biases=None, round_to=jnp.float32):
    """`x f32 [M, K]` -> `h f32 [N, C]` = glu(x @ w_gate[e] + b_gate[e], x @ w_up[e] + b_up[e]) per
    row (module docstring), rounded to `round_to` (bfloat16, or float32: not rounded); rows past
    sum(group_sizes) are 0. `w_gate` / `w_up`: one layout and dtype, as `grouped_matmul` takes
    them (row-major `[E, K, C]` or PanelWeights, INT8 panels included). `source int [N]` as in
    `grouped_matmul` (None: row r reads x[r]). `biases`: (gate `[E, C]`, up `[E, C]`) or None.
    ValueError naming the argument for an activation `fuses` rejects or mismatched weights."""
    require_library()
    glu = as_gated_activation(activation)
    if not fuses(glu, round_to):
        raise ValueError(f"activation must be one of {tuple(FUSED_ACTIVATIONS)} and round_to float32 or "
                         f"bfloat16 for the fused call, got {glu.name!r}, {jnp.dtype(round_to)}")
    shapes = [w.logical_shape if panels.is_panels(w) else getattr(w, "shape", None) for w in (w_gate, w_up)]
    formats = [(panels.is_panels(w), getattr(w, "panel_columns", None), getattr(w, "int8", False),
                None if panels.is_panels(w) and w.int8 else w.dtype) for w in (w_gate, w_up)]
    if shapes[0] != shapes[1] or formats[0] != formats[1]:
        raise ValueError(f"w_up must have w_gate's shape and layout, got {shapes[1]} {formats[1]} "
                         f"against {shapes[0]} {formats[0]}")
    e, _, c = _check_matmul_args(x, group_sizes, w_gate, source)
    rows = x.shape[0] if source is None else source.shape[0]
    source = jnp.arange(rows, dtype=jnp.int32) if source is None else source.astype(jnp.int32)
    none = jnp.zeros((0,), jnp.float32)
    if panels.is_panels(w_gate) and w_gate.int8:
        operands = (w_gate.panels, w_up.panels, w_gate.scales.astype(jnp.float32), w_up.scales.astype(jnp.float32))
    else:
        operands = tuple(w.panels if panels.is_panels(w) else w for w in (w_gate, w_up)) + (none, none)
    bias_gate, bias_up = (none, none)
    if biases is not None:
        bias_gate, bias_up = (jnp.asarray(b).astype(jnp.float32) for b in biases)
        if bias_gate.shape != (e, c) or bias_up.shape != (e, c):
            raise ValueError(f"biases must be (gate [E, C], up [E, C]) with [E, C] = {[e, c]}, "
                             f"got {bias_gate.shape}, {bias_up.shape}")
    limit_mode = None if glu.limit is None else "before_activation" if glu.name == "swiglu_oai" else glu.limit_mode
    out = jax.ShapeDtypeStruct((rows, c), jnp.float32)
    return jax.ffi.ffi_call("expertd_grouped_glu", out)(
        x.astype(jnp.float32), source, group_sizes.astype(jnp.int32), *operands, bias_gate, bias_up,
        kind=np.int32(FUSED_ACTIVATIONS[glu.name]), limit_mode=np.int32(_LIMIT_MODES[limit_mode]),
        limit=np.float32(glu.limit or 0.0), alpha=np.float32(glu.alpha),
        round_bf16=np.int32(jnp.dtype(round_to) == jnp.bfloat16))


def grouped_glu_reference(x, group_sizes, w_gate, w_up, activation, *, source=None, biases=None,
                          round_to=jnp.float32):
    """Plain jnp: `grouped_glu` as the unfused layer computes it (two reference matmuls, the biases
    of each row's expert, `ffn.GatedActivation` in XLA, the cast to round_to and back)."""
    rows = x if source is None else x.at[source].get(mode="fill", fill_value=0)
    g = grouped_matmul_reference(rows, group_sizes, w_gate)
    u = grouped_matmul_reference(rows, group_sizes, w_up)
    if biases is not None:
        gate, up = biases
        rb = row_biases(ExpertBiases(gate, up, jnp.zeros_like(gate)), *row_experts(group_sizes, g.shape[0]))
        g, u = g + rb.gate, u + rb.up
    return as_gated_activation(activation)(g, u).astype(round_to).astype(jnp.float32)


def layout(topk_ids, num_experts: int, *, align_size: int = 0, valid=None) -> dispatch.Permutation:
    """`dispatch.layout` in one pass of C++ (a counting sort instead of XLA's stable sort); the
    same Permutation, field for field (its twin is `dispatch.layout`)."""
    require_library()
    t, k = dispatch.check_layout_args(topk_ids, num_experts, align_size, valid)
    flat = dispatch.flat_experts(topk_ids, num_experts, valid)
    n = dispatch.buffer_rows(t, k, num_experts, align_size)
    s32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    dest, token_of_row, sizes, offsets, counts = jax.ffi.ffi_call(
        "expertd_dispatch_layout", (s32(t * k), s32(n), s32(num_experts), s32(num_experts), s32(num_experts)))(
        flat, topk=k, align_size=int(align_size))
    return dispatch.Permutation(dest.reshape(t, k), token_of_row, sizes, offsets, counts)


def combine(rows, perm: dispatch.Permutation, topk_weights=None):
    """`dispatch.unpermute(rows, perm, topk_weights, out_dtype=float32)` in C++ (its twin): `rows
    f32|bf16 [N, H]` -> `f32 [T, H]`, reading each routed row once instead of materialising `[T, k, H]`."""
    require_library()
    t, k = dispatch.check_unpermute_args(rows, perm, topk_weights)
    if rows.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"rows must be float32 or bfloat16, got {rows.dtype}")
    weights = jnp.ones((t, k), jnp.float32) if topk_weights is None else topk_weights.astype(jnp.float32)
    out = jax.ShapeDtypeStruct((t, rows.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("expertd_combine", out)(rows, perm.dest.astype(jnp.int32), weights)
