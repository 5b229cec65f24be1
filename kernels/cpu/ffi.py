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

from expertd.kernels import dispatch
from expertd.kernels.cpu import panels
from expertd.kernels.cpu.build import TARGET, require_library
from expertd.kernels.ffn import row_experts


def grouped_matmul(x, group_sizes, w, *, source=None):
    """`x f32 [N, K]`, `group_sizes int [E]`, `w bf16|f32 [E, K, C]` -> `f32 [N, C]` (module docstring).

    `w` may also be a `panels.PanelWeights` of those weights (panel-major, made once at load): the
    same result bit for bit, read faster. With `source int [N]`, x is `[T, K]` token rows and output
    row r reads `x[source[r]]` (a source outside [0, T), e.g. a permutation's pad row T, reads
    zeros): `dispatch.permute`'s gather done inside the kernel, without writing the permuted
    `[N, K]` copy of x."""
    require_library()
    shape = w.logical_shape if panels.is_panels(w) else getattr(w, "shape", None)
    if x.ndim != 2 or shape is None or len(shape) != 3 or group_sizes.shape != (shape[0],) \
            or x.shape[1] != shape[1]:
        raise ValueError(f"expected x [N, K], group_sizes [E], w [E, K, C]; got x {x.shape}, "
                         f"group_sizes {group_sizes.shape}, w {shape}")
    int8 = panels.is_panels(w) and w.int8
    if not int8 and w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"w must be float32 or bfloat16 (or INT8 panels), got {w.dtype}")
    if source is not None and (source.ndim != 1 or not jnp.issubdtype(source.dtype, jnp.integer)):
        raise ValueError(f"source must be an integer [N] row index, got {source.dtype} {source.shape}")
    rows = x.shape[0] if source is None else source.shape[0]
    out = jax.ShapeDtypeStruct((rows, shape[2]), jnp.float32)
    x, group_sizes = x.astype(jnp.float32), group_sizes.astype(jnp.int32)
    if int8:
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
