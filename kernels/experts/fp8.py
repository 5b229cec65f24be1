"""Block-scaled FP8 expert weights, kept in FP8 on the device (the layout DeepSeek-V3 / Kimi /
Qwen FP8 checkpoints ship: e4m3 codes, one fp32 scale per 128 x 128 block).

  Fp8BlockWeights(codes, scales, block, transposed)
      The expert weights `w [E, K, C]` as
        codes   float8_e4m3fn [E, K, C]  (or [E, C, K] when `transposed`: tokamax's kernels read
                the weight with the contraction dimension minor, see `transposed_for_tokamax`)
        scales  float32 [E, ceil(K / block), ceil(C / block)]
      with w[e, k, c] = codes[e, k, c] * scales[e, k // block, c // block] (a checkpoint's
      `weight_scale_inv` is this scale: it multiplies). A JAX pytree (the codes and scales are its
      leaves; block and transposed are static), so it goes through jit, device_put and
      `MoEParams`, in the place of a `w_gate` / `w_up` / `w_down` array; `logical_shape` is
      [E, K, C] and `dtype` bfloat16, the dtype it computes in.

  quantize_fp8_blocks(w [E, K, C], block=128) -> Fp8BlockWeights: absmax per block scaled to the
      e4m3 range (448), the codes rounded to nearest (tests and benchmarks make FP8 weights so).
  dequantize(w, dtype) -> [E, K, C] dtype: codes x scales in fp32, rounded once to `dtype`; what
      the backends that do not read FP8 themselves compute from (a pass over the weights per call
      when the weights stay FP8; the CPU server dequantises at load instead).
  row_major(w) -> the same weights with `transposed` False (a relayout when it was True).
  is_fp8(w) -> bool.

The kernels that read the codes and scale in the kernel: the "pallas" backend (each
`block_k x block_n` weight tile lies in one scale block; the fp32 partial product of the tile is
multiplied by its scale) and the "tokamax" backend (tokamax's quantised ragged_dot; its Mosaic GPU
kernels take one scale per (block of K, column), so the block scales are repeated along C per call:
1/64 of the codes' bytes in bf16).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
DEFAULT_BLOCK = 128


@jax.tree_util.register_pytree_node_class
class Fp8BlockWeights:
    """Expert weights `[E, K, C]` as e4m3 codes and fp32 block scales (module docstring)."""

    def __init__(self, codes, scales, block: int = DEFAULT_BLOCK, transposed: bool = False):
        # No checks here: jax.tree_util rebuilds this with placeholder leaves (tracers, None).
        self.codes = codes
        self.scales = scales
        self.block = block
        self.transposed = transposed

    def tree_flatten(self):
        return (self.codes, self.scales), (self.block, self.transposed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    @property
    def logical_shape(self) -> tuple[int, int, int]:
        """[E, K, C]: the shape of the dense weights these codes stand for."""
        e, a, b = self.codes.shape
        return (e, b, a) if self.transposed else (e, a, b)

    @property
    def dtype(self):
        """bfloat16: the dtype the weights compute in (the codes are `codes.dtype`, e4m3)."""
        return jnp.dtype(jnp.bfloat16)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def __repr__(self) -> str:
        return (f"Fp8BlockWeights(logical_shape={self.logical_shape}, block={self.block}, "
                f"transposed={self.transposed}, scales={tuple(self.scales.shape)})")


def is_fp8(w) -> bool:
    return isinstance(w, Fp8BlockWeights)


def check_block(block: int) -> None:
    """ValueError unless `block` is a power of two >= 16 (the Pallas kernel's tiles divide it)."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"FP8 scale blocks must be a power of two >= 16, got {block}")


def _block_view(w, block: int):
    """`w [E, K, C]` zero-padded to whole blocks and viewed `[E, Kb, block, Cb, block]`."""
    e, k, c = w.shape
    kb, cb = -(-k // block), -(-c // block)
    padded = jnp.pad(w, ((0, 0), (0, kb * block - k), (0, cb * block - c)))
    return padded.reshape(e, kb, block, cb, block)


def quantize_fp8_blocks(w, block: int = DEFAULT_BLOCK) -> Fp8BlockWeights:
    """`w [E, K, C]` (any float dtype) as block-scaled e4m3 (absmax per block -> 448)."""
    check_block(block)
    e, k, c = w.shape
    view = _block_view(jnp.asarray(w, jnp.float32), block)
    amax = jnp.max(jnp.abs(view), axis=(2, 4))  # [E, Kb, Cb]
    scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    codes = (view / scales[:, :, None, :, None]).astype(FP8_DTYPE)
    codes = codes.reshape(e, view.shape[1] * block, view.shape[3] * block)[:, :k, :c]
    return Fp8BlockWeights(codes, scales, block)


def row_major(w: Fp8BlockWeights) -> Fp8BlockWeights:
    """`w` with codes `[E, K, C]` (a transpose of the codes when they were held `[E, C, K]`)."""
    if not w.transposed:
        return w
    return Fp8BlockWeights(jnp.swapaxes(w.codes, 1, 2), w.scales, w.block, False)


def transposed_for_tokamax(w: Fp8BlockWeights) -> Fp8BlockWeights:
    """`w` with codes held `[E, C, K]` (tokamax's quantised kernels read the weight so; done once
    at load by `prepare_params`)."""
    if w.transposed:
        return w
    return Fp8BlockWeights(jnp.swapaxes(w.codes, 1, 2), w.scales, w.block, True)


def dequantize(w, dtype=jnp.bfloat16):
    """The dense `[E, K, C]` weights in `dtype` (arrays other than Fp8BlockWeights as they are)."""
    if not is_fp8(w):
        return w
    w = row_major(w)
    e, k, c = w.logical_shape
    b = w.block
    full = jnp.repeat(jnp.repeat(w.scales, b, axis=1), b, axis=2)[:, :k, :c]
    return (w.codes.astype(jnp.float32) * full).astype(dtype)


def column_scales(w: Fp8BlockWeights, dtype) -> jax.Array:
    """The scales repeated along C: `[E, ceil(K / block), C]` in `dtype` (one per block of K and
    column, as tokamax's quantised ragged_dot takes them)."""
    c = w.logical_shape[2]
    return jnp.repeat(w.scales, w.block, axis=2)[:, :, :c].astype(dtype)
