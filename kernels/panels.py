"""Panel-major expert weights: the layout the native CPU kernel reads fastest, made once at load.

A row-major expert matrix `[K, C]` (the checkpoint's layout) is read by the kernel 16 columns at a
time; panel-major stores those 16-column panels one after another, each a contiguous `[K, 16]`
block:

    PanelWeights.panels [E, P, K, 16]   P = ceil(C / 16)
    column c of expert e  = panels[e, c // 16, :, c % 16]   (columns past C are zero padding)

What it buys on the 2-core AVX2 dev box (BENCHMARKS.md "Panel-major expert weights"): the packed
path (32+ rows per expert) reads the panels in place instead of re-packing every weight each call
(the re-packing was 20-32% of the matmul at 32-64 rows per expert), and the streaming path (few
rows) reads one sequential stream per panel with its sums in registers across all of K.

`PanelWeights` is a pytree (it goes through `jax.jit` and into params dicts as an array does) whose
`shape`, `dtype` and `ndim` are the logical `[E, K, C]` array's, so shape checks and configs treat
it as the weights it stands for. Only `native_cpu.grouped_matmul` reads the panels; every other
consumer calls `dense(w)`, which gives the `[E, K, C]` array back (a transpose per call: correct,
not fast; the engine only makes panels where the native kernel runs every expert matmul).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PANEL_COLUMNS = 16  # the kernel's panel width (kPanelCols in native/grouped_matmul_cpu.cc)


@jax.tree_util.register_pytree_node_class
class PanelWeights:
    """Expert weights `[E, K, C]` held panel-major as `panels [E, ceil(C / 16), K, 16]` (see the
    module docstring). Build with `to_panels`; `columns` is C."""

    def __init__(self, panels, columns: int):
        # No checks here: jax.tree_util rebuilds this with placeholder leaves (tracers, None).
        self.panels = panels
        self.columns = columns

    def tree_flatten(self):
        return (self.panels,), self.columns

    @classmethod
    def tree_unflatten(cls, columns, children):
        return cls(children[0], columns)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, _, k, _ = self.panels.shape
        return (e, k, self.columns)

    @property
    def dtype(self):
        return self.panels.dtype

    ndim = 3

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    @property
    def sharding(self):
        return self.panels.sharding

    def __array__(self, dtype=None, copy=None):
        """`np.asarray(w)`: the logical `[E, K, C]` weights, row-major (a relayout on the host), so
        code that reads an engine's weights back as arrays keeps working."""
        out = np.asarray(dense(self))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"PanelWeights(shape={self.shape}, dtype={self.dtype}, panels={tuple(self.panels.shape)})"


def to_panels(w) -> PanelWeights:
    """`w [E, K, C]` (any float dtype, kept) -> the same weights panel-major; exact (a relayout)."""
    if isinstance(w, PanelWeights):
        return w
    if getattr(w, "ndim", None) != 3:
        raise ValueError(f"expert weights must be [E, K, C], got shape {getattr(w, 'shape', None)}")
    return PanelWeights(_relayout(jnp.asarray(w)), w.shape[2])


@jax.jit
def _relayout(w):
    """`[E, K, C]` -> `[E, ceil(C/16), K, 16]`, zero-padded: one jitted copy, so a load holds at most
    one extra copy of the matrix at a time."""
    e, k, c = w.shape
    p = -(-c // PANEL_COLUMNS)
    if p * PANEL_COLUMNS != c:
        w = jnp.pad(w, ((0, 0), (0, 0), (0, p * PANEL_COLUMNS - c)))
    return w.reshape(e, k, p, PANEL_COLUMNS).transpose(0, 2, 1, 3)


def dense(w):
    """The row-major `[E, K, C]` array of `w`: a PanelWeights relaid out, anything else as it is."""
    if not isinstance(w, PanelWeights):
        return w
    e, k, c = w.shape
    return w.panels.transpose(0, 2, 1, 3).reshape(e, k, -1)[:, :, :c]


def is_panels(w) -> bool:
    return isinstance(w, PanelWeights)


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # the moe.init_params keys of routed expert matrices


def panel_params(params: dict) -> dict:
    """A MoE layer's params (moe.init_params keys) with the routed expert matrices panel-major; the
    rest (router, shared experts) as they are."""
    return {name: to_panels(p) if name in EXPERT_WEIGHTS else p for name, p in params.items()}
