"""Panel-major expert weights: the layout the native CPU kernel reads fastest, made once at load.

A row-major expert matrix `[K, C]` (the checkpoint's layout) is read by the kernel in blocks of
16-64 columns; panel-major stores panels of W columns one after another, each a contiguous block
(P = ceil(C / W); columns past C are zero padding):

    fp32: PanelWeights.panels [E, P, K, W]
          w[e, k, c] = panels[e, c // W, k, c % W]
    bf16: PanelWeights.panels [E, P, ceil(K / 2), 2 W]   ("pair rows": two weight rows interleaved)
          w[e, k, c] = panels[e, c // W, k // 2, 2 * (c % W) + 1 - k % 2]
          (K odd: the last pair row's second row is zero padding)

The panel width W (`panel_columns()`) is 64 where the native kernel runs AVX-512 (a block of up to
6 rows keeps the sums of a panel's 64 columns in zmm registers and reads the panel as one
sequential stream) and 16 elsewhere (AVX2 blocks hold at most 16 columns x 4 rows or 64 columns x 1
row in their 16 ymm registers, so they would read a 64-column panel in up to 4 strided passes).

INT8 expert weights (`int8.to_int8_panels`, `--expert-weights int8`) are int8 panels in the fp32
layout with per-output-column scales beside them: panels int8 [E, P, K, W], scales fp32 [E, C],
w[e, k, c] = panels[e, c // W, k, c % W] * scales[e, c] (`dense` gives that product back).

A bf16 pair row holds, per column, w[2j] in the high half of a 32-bit word and w[2j + 1] in its low
half: the AVX-512 kernel widens both rows of a 64-byte line (16 columns, a "strip") to fp32 with an
AND and a shift, and its bf16 dot product (vdpbf16ps) multiplies the word as it lies, earlier row
first (csrc/panel_layout.h, csrc/panel_stream_avx512.h).

What it buys (BENCHMARKS.md "Weight layout on CPU", "Native CPU kernel"):
every block reads its weights in place as sequential streams with its sums
in registers; on AVX-512 CPUs one zmm is a strip's row (fp32) or pair row (bf16) and the kernel runs
every row count from the panels in place (AVX2 CPUs: the packed path's strips are read in place up
to 120 rows instead of re-packed each call); on AVX512_BF16 CPUs the pair rows are the bf16 dot
product's operand as they lie.

`PanelWeights` is a pytree (it goes through `jax.jit` and into a MoEParams as an array does) but
not an array: it has no `shape` or `__array__`; `logical_shape` is the `[E, K, C]` of the weights
it holds, which shape checks read. Only `ffi.grouped_matmul` reads the panels; every other consumer
converts with `dense(w)` (exported as `cpu.dense_weights`), which gives the `[E, K, C]` array back
(a transpose per call: correct, not fast).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from expertd.kernels.cpu import library

PANEL_WIDTHS = (16, 64)  # the panel widths the kernel reads (csrc/panel_layout.h)


@jax.tree_util.register_pytree_node_class
class PanelWeights:
    """Expert weights `[E, K, C]` held panel-major as `panels` (fp32 and int8 `[E, ceil(C / W), K, W]`,
    bf16 `[E, ceil(C / W), ceil(K / 2), 2 W]`, W = `panel_columns`; see the module docstring). Build
    with `to_panels` (or `int8.to_int8_panels`); `k_dim` is K and `columns` is C; `scales` fp32
    `[E, C]` for int8 panels (the weights are panels * scales), None otherwise."""

    def __init__(self, panels, k_dim: int, columns: int, scales=None):
        # No checks here: jax.tree_util rebuilds this with placeholder leaves (tracers, None).
        self.panels = panels
        self.k_dim = k_dim
        self.columns = columns
        self.scales = scales

    def tree_flatten(self):
        return (self.panels, self.scales), (self.k_dim, self.columns)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux, scales=children[1])

    @property
    def logical_shape(self) -> tuple[int, int, int]:
        """[E, K, C]: the shape of the row-major weights these panels hold."""
        return (self.panels.shape[0], self.k_dim, self.columns)

    @property
    def dtype(self):
        """The weights' element dtype as held (the panels hold them unchanged; int8 for INT8 weights)."""
        return self.panels.dtype

    @property
    def int8(self) -> bool:
        """Whether these are INT8 weights (int8 panels times per-column `scales`)."""
        return self.scales is not None

    @property
    def panel_columns(self) -> int:
        """W, the columns per panel (16 or 64)."""
        return self.panels.shape[3] // (2 if _pairs(self.dtype) else 1)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def __repr__(self) -> str:
        return (f"PanelWeights(logical_shape={self.logical_shape}, dtype={self.dtype}, "
                f"panels={tuple(self.panels.shape)})")


def panel_columns(isa: str | None = None) -> int:
    """The panel width for native kernel instruction-set level `isa` (default: the level this
    process runs, `library.isa()`): 64 for the AVX-512 and AMX levels, else 16."""
    if isa is None:
        isa = library.isa()
    return 64 if isa in ("avx512", "avx512_bf16", "amx_bf16") else 16


def to_panels(w, columns: int | None = None) -> PanelWeights:
    """`w [E, K, C]` (any float dtype, kept) -> the same weights panel-major in panels of `columns`
    (16 or 64; default `panel_columns()`); exact (a relayout). PanelWeights of another width are
    relaid out, of the same width returned as they are."""
    columns = panel_columns() if columns is None else columns
    if columns not in PANEL_WIDTHS:
        raise ValueError(f"columns must be one of {PANEL_WIDTHS}, got {columns}")
    if isinstance(w, PanelWeights):
        if w.panel_columns == columns:
            return w
        if w.int8:  # the int8 values relaid out, the scales as they are
            q = PanelWeights(w.panels, w.k_dim, w.columns)
            return PanelWeights(to_panels(dense(q), columns).panels, w.k_dim, w.columns, w.scales)
        return to_panels(dense(w), columns)
    w = jnp.asarray(w)
    if w.ndim != 3:
        raise ValueError(f"expert weights must be [E, K, C], got shape {w.shape}")
    return PanelWeights(_relayout(w, columns), w.shape[1], w.shape[2])


def _pairs(dtype) -> bool:
    """Whether weights of `dtype` are laid out in pair rows (bf16) rather than one row per k."""
    return jnp.dtype(dtype) == jnp.bfloat16


@functools.partial(jax.jit, static_argnums=1)
def _relayout(w, columns):
    """`[E, K, C]` -> the panels of `columns` (module docstring), zero-padded: one jitted copy, so a
    load holds at most one extra copy of the matrix at a time."""
    e, k, c = w.shape
    p = -(-c // columns)
    k_pad = k + k % 2 if _pairs(w.dtype) else k
    if (p * columns, k_pad) != (c, k):
        w = jnp.pad(w, ((0, 0), (0, k_pad - k), (0, p * columns - c)))
    if not _pairs(w.dtype):
        return w.reshape(e, k, p, columns).transpose(0, 2, 1, 3)
    # [E, K/2, 2 (row in pair), P, W] -> [E, P, K/2, W, 2], the pair's later row first (the low half).
    pairs = w.reshape(e, k_pad // 2, 2, p, columns).transpose(0, 3, 1, 4, 2)[..., ::-1]
    return pairs.reshape(e, p, k_pad // 2, 2 * columns)


def dense(w):
    """The row-major `[E, K, C]` array of `w`: a PanelWeights relaid out (INT8 weights dequantised
    to fp32, panels * scales), anything else as it is."""
    if not isinstance(w, PanelWeights):
        return w
    e, k, c = w.logical_shape
    if w.int8:
        q = w.panels.transpose(0, 2, 1, 3).reshape(e, k, -1)[:, :, :c]
        return q.astype(jnp.float32) * w.scales[:, None, :]
    if not _pairs(w.dtype):
        return w.panels.transpose(0, 2, 1, 3).reshape(e, k, -1)[:, :, :c]
    p, k2, columns = w.panels.shape[1], w.panels.shape[2], w.panel_columns
    rows = w.panels.reshape(e, p, k2, columns, 2)[..., ::-1].transpose(0, 2, 4, 1, 3)
    return rows.reshape(e, 2 * k2, p * columns)[:, :k, :c]


def is_panels(w) -> bool:
    return isinstance(w, PanelWeights)
