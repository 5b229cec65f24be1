"""INT8 expert weights (W8A16): symmetric per-output-channel int8, quantised once at load, kept as
int8 and widened to fp32 in the kernel's registers; activations stay in the serving dtype (bf16).

  quantize(w [E, K, C] float) -> (q int8 [E, K, C], scales fp32 [E, C])
      Per expert e and output column c: scale = max_k |w[e, k, c]| * fp32(1 / 127) (0 for an all-zero
      column), q = clip(round_half_even(w / scale), -127, 127) (0 where the scale is 0), all in
      fp32. Jitted; its twin `quantize_reference` (numpy) gives the same scales bit for bit and
      the same q except at exact ties (w / scale = n + 1/2, which bf16 weights hit), where XLA:CPU's
      division, within an ulp of numpy's exactly rounded one, may round to the other neighbour.
  dequantize_reference(q, scales) -> fp32 [E, K, C]: q * scales[:, None, :] (numpy).
  to_int8_panels(w [E, K, C] float or PanelWeights, columns=None) -> PanelWeights: the quantised
      weights as the native kernel reads them (int8 panels in the fp32 panel layout, `scales`
      beside them; `panels.py` module docstring), W = `panels.panel_columns()` by default.
  grouped_matmul_reference(x [N, K], group_sizes [E], q, scales) -> fp64 [N, C] (numpy): every row
      times its expert's dequantised matrix, rows past the groups 0; the kernel's twin
      (`ffi.grouped_matmul` on int8 panels sums x * q in fp32 in k order, then scales once).

The error against bf16 weights (tests/kernels/test_cpu_int8.py asserts it; docs/kernels.md): each
weight is off by at most half a step, scale / 2 = max|w[:, c]| / 254. A layer's output on INT8
weights against the same layer on the bf16 weights they were quantised from (same routing: the
router stays fp32), as max |y_int8 - y_bf16| / max |y_bf16| over seeded Gaussian weights and tokens,
E 8-128, k 2-8, H 64-2880, I 48-2880, T 1-1024: 1.0-2.1 % (bf16 against fp32 weights on the same
routing: 0.4-0.7 %). ERROR_BOUND, the bound the tests assert, is 3 %.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from expertd.kernels.cpu import panels

QMAX = 127  # symmetric: -128 is never used, so q and -q are both representable
# The scale is a product, not a quotient: XLA may turn a division by a constant into this product,
# so both twins multiply and agree bit for bit.
INV_QMAX = np.float32(1.0 / QMAX)
ERROR_BOUND = 0.03  # max |y_int8 - y_bf16| / max |y_bf16| of a layer output, the documented bound


@jax.jit
def quantize(w):
    """`w [E, K, C]` (any float dtype) -> (int8 `[E, K, C]`, fp32 scales `[E, C]`); module docstring.
    One expert at a time (`lax.map`): the fp32 temporaries are one expert's, not the whole matrix's
    (a 256-expert 7168 x 2048 matrix would need 15 GB of them)."""
    return jax.lax.map(_quantize_expert, w)


def _quantize_expert(w):
    """One expert `[K, C]` -> (int8 `[K, C]`, fp32 scales `[C]`)."""
    w32 = w.astype(jnp.float32)
    scales = jnp.max(jnp.abs(w32), axis=0) * INV_QMAX
    safe = jnp.where(scales > 0, scales, 1.0)
    q = jnp.clip(jnp.round(w32 / safe), -QMAX, QMAX)
    return jnp.where(scales > 0, q, 0.0).astype(jnp.int8), scales


def quantize_reference(w) -> tuple[np.ndarray, np.ndarray]:
    """numpy twin of `quantize`: (q int8 [E, K, C], scales fp32 [E, C])."""
    w32 = np.asarray(jnp.asarray(w, jnp.float32))
    scales = (np.max(np.abs(w32), axis=1) * INV_QMAX).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(w32 / safe[:, None, :]), -QMAX, QMAX)
    q = np.where(scales[:, None, :] > 0, q, 0.0)
    return q.astype(np.int8), scales


def dequantize_reference(q, scales) -> np.ndarray:
    """fp32 `[E, K, C]`: q * scales per output column (numpy)."""
    return np.asarray(q, np.float32) * np.asarray(scales, np.float32)[:, None, :]


def to_int8_panels(w, columns: int | None = None) -> panels.PanelWeights:
    """`w [E, K, C]` (bf16 / fp32, row-major or PanelWeights) quantised (`quantize`) and laid out as
    int8 panels of `columns` (default `panels.panel_columns()`) with their scales. INT8 panels of
    another width are relaid out, of this width returned as they are."""
    if isinstance(w, panels.PanelWeights) and w.int8:
        return panels.to_panels(w, columns)
    q, scales = quantize(panels.dense(w))
    held = panels.to_panels(q, columns)
    return panels.PanelWeights(held.panels, held.k_dim, held.columns, scales)


def grouped_matmul_reference(x, group_sizes, q, scales) -> np.ndarray:
    """float64 `[N, C]`: row r of expert e(r) times dequantize_reference(q, scales)[e]; rows past
    sum(group_sizes) are 0 (numpy)."""
    x, q, scales = np.asarray(x, np.float64), np.asarray(q), np.asarray(scales)
    out, start = np.zeros((x.shape[0], q.shape[2])), 0
    for e, n in enumerate(np.asarray(group_sizes)):
        if n > 0:  # experts without rows are never read
            w = dequantize_reference(q[e:e + 1], scales[e:e + 1])[0].astype(np.float64)
            out[start:start + n] = x[start:start + n] @ w
        start += n
    return out
