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
  Int8FromFp8(E, K, C, block, panel_columns=None, empty=None): INT8 panels filled an expert at a time
      from the codes as a checkpoint stores them (`add(j, codes [C, K], scales)`, any thread), then
      `weights()` -> PanelWeights: what the checkpoint loader converts FP8 experts with as it reads
      them (`--expert-weights int8` on an FP8 checkpoint), never holding them dense or as FP8.
  fp8_to_int8_panels(codes, scales, block, transposed=False, columns=None) -> PanelWeights: block-
      scaled FP8 expert weights (`experts.Fp8BlockWeights`' fields: codes e4m3 [E, K, C], or [E, C, K]
      when `transposed`, as a checkpoint stores them; fp32 scales [E, ceil(K / block), ceil(C / block)],
      w = code * scale) straight to INT8 panels: the result is `quantize_reference` (the twin of
      `to_int8_panels`' quantiser: equal but at exact ties) of the weights dequantised exactly in
      fp32 (not through bf16), laid out as panels, without that dense copy: each expert in one
      pass of the native library (csrc/fp8_int8.cc: the arithmetic and the rules it relies on) on a
      thread per CPU, or of numpy without it. ValueError naming the expert for NaN codes.
  fp8_to_int8_reference(codes, scales, block, transposed=False) -> (q int8 [E, K, C], scales fp32
      [E, C]): `quantize_reference` of the exactly dequantised weights (numpy), the twin of both.
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

import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from expertd.kernels.cpu import panels
from expertd.kernels.cpu.build import load

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


def fp8_to_int8_reference(codes, scales, block: int, transposed: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [E, K, C], scales fp32 [E, C]) of block-scaled FP8 weights (module docstring): the
    codes decoded exactly, times their block's scale in fp32, then `quantize_reference`."""
    return quantize_reference(_dequantize_fp8(codes, scales, block, transposed))


def _dequantize_fp8(codes, scales, block: int, transposed: bool) -> np.ndarray:
    """fp32 [E, K, C]: every code's e4m3 value times its block's scale, one fp32 rounding (numpy)."""
    w = np.asarray(codes).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    if transposed:
        w = np.swapaxes(w, 1, 2)
    k, c = w.shape[1:]
    full = np.repeat(np.repeat(np.asarray(scales, np.float32), block, axis=1), block, axis=2)[:, :k, :c]
    return w * full


class Int8FromFp8:
    """INT8 panels of `[E, K, C]` expert weights filled expert by expert from block-scaled FP8 codes
    (what the checkpoint loader converts each expert with as it reads it: no dense copy, no FP8
    copy). `add(j, codes, scales)` converts expert j (any thread; distinct experts at once);
    `weights()` the PanelWeights once every expert is in. `empty(shape, dtype)` allocates the
    panels (the loader's huge-page allocation; by default 64-byte aligned numpy arrays, which JAX
    uses in place)."""

    def __init__(self, num_experts: int, k_dim: int, columns: int, block: int, panel_columns: int | None = None,
                 empty=None):
        self.width = panels.panel_columns() if panel_columns is None else panel_columns
        if self.width not in panels.PANEL_WIDTHS:
            raise ValueError(f"panel_columns must be one of {panels.PANEL_WIDTHS}, got {self.width}")
        if min(num_experts, k_dim, columns, block) < 1:
            raise ValueError(f"num_experts, k_dim, columns and block must be >= 1, got {num_experts}, {k_dim}, "
                             f"{columns}, {block}")
        self.shape, self.block = (num_experts, k_dim, columns), block
        empty = empty or _aligned_empty
        self.panels = empty((num_experts, -(-columns // self.width), k_dim, self.width), np.int8)
        self.scales = empty((num_experts, columns), np.float32)
        self._lib = load()[0]

    def add(self, j: int, codes, scales) -> None:
        """Expert j from `codes` e4m3 (or uint8 bits) `[C, K]` as stored (a row per output column,
        any row stride) and its fp32 `scales [ceil(K / block), ceil(C / block)]` (w[k, c] =
        codes[c, k] * scales[k // block, c // block]). ValueError naming the argument for shapes
        that disagree, naming the expert for NaN codes."""
        _, k, c = self.shape
        codes = np.asarray(codes)
        if codes.shape != (c, k) or codes.dtype.itemsize != 1:
            raise ValueError(f"codes of expert {j} must be 1-byte FP8 codes [{c}, {k}] (as stored: [out, in]), got "
                             f"{codes.dtype} {list(codes.shape)}")
        scales = np.ascontiguousarray(scales, np.float32)
        if scales.shape != (-(-k // self.block), -(-c // self.block)):
            raise ValueError(f"scales of expert {j} must be fp32 [{-(-k // self.block)}, {-(-c // self.block)}] for "
                             f"block {self.block}, got {list(scales.shape)}")
        if codes.strides[1] != 1:
            codes = np.ascontiguousarray(codes)
        if self._lib is not None:
            nans = self._lib.expertd_fp8_to_int8_panels(codes.ctypes.data, c, k, codes.strides[0], scales.ctypes.data,
                                                        self.block, self.width, self.panels[j].ctypes.data,
                                                        self.scales[j].ctypes.data)
        else:  # numpy: the reference, relaid out
            dense = _dequantize_fp8(codes[None], scales[None], self.block, True)
            nans = int(np.isnan(dense).sum())
            q, self.scales[j] = (part[0] for part in quantize_reference(np.nan_to_num(dense)))
            padded = np.zeros((k, self.panels.shape[1] * self.width), np.int8)
            padded[:, :c] = q
            self.panels[j] = padded.reshape(k, -1, self.width).transpose(1, 0, 2)
        if nans:
            raise ValueError(f"FP8 expert weights: expert {j} has {nans} NaN codes" if nans > 0 else
                             f"FP8 expert weights: expert {j}: the native conversion refused its arguments")

    def weights(self) -> panels.PanelWeights:
        """The PanelWeights of the experts added (the arrays aliased where JAX can, not copied)."""
        _, k, c = self.shape
        return panels.PanelWeights(_device_array(self.panels), k, c, _device_array(self.scales))


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised array whose data starts on an `align`-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buffer = np.empty(nbytes + align, np.uint8)
    start = -buffer.ctypes.data % align
    return buffer[start:start + nbytes].view(dtype).reshape(shape)


def _device_array(array: np.ndarray) -> jax.Array:
    """`array` as a JAX array on the default device, sharing its memory where JAX can (on CPU an
    aligned host array is used in place, not copied)."""
    return jax.device_put(array, may_alias=True)


def fp8_to_int8_panels(codes, scales, block: int, transposed: bool = False, columns: int | None = None
                       ) -> panels.PanelWeights:
    """Block-scaled FP8 expert weights -> INT8 panels of `columns` (default `panels.panel_columns()`)
    with their per-column scales: `quantize_reference` of the exactly dequantised weights, laid out
    as `to_int8_panels` lays out its result (module docstring). `codes` e4m3 (or its uint8 bits)
    `[E, K, C]`, `[E, C, K]` when `transposed`; `scales` fp32 `[E, ceil(K / block), ceil(C / block)]`.
    Experts convert on a thread per CPU.
    ValueError naming the argument for shapes that disagree, naming the expert for NaN codes."""
    codes = np.asarray(codes)
    if codes.ndim != 3 or codes.dtype.itemsize != 1:
        raise ValueError(f"codes must be [E, K, C] (or [E, C, K]) 1-byte FP8 codes, got {codes.dtype} "
                         f"{list(codes.shape)}")
    e, k, c = (codes.shape[0], codes.shape[2], codes.shape[1]) if transposed else codes.shape
    scales = np.asarray(scales, np.float32)
    if scales.ndim != 3 or scales.shape[0] != e:
        raise ValueError(f"scales must be fp32 [{e}, ceil(K / block), ceil(C / block)], got {list(scales.shape)}")
    out = Int8FromFp8(e, k, c, block, columns)
    add = lambda j: out.add(j, codes[j] if transposed else codes[j].T, scales[j])  # noqa: E731
    workers = min(e, os.cpu_count() or 1)
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:  # ctypes releases the GIL for each expert's call
            list(pool.map(add, range(e)))
    else:
        for j in range(e):
            add(j)
    return out.weights()
