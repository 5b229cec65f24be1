"""Grouped-GEMM expert FFN as two Pallas kernels (the "pallas" backend of experts.grouped_ffn).

Written for Pallas-Triton (GPU): every block is a power of two >= 16 and weights are read with
dynamic `pl.ds` slices of whole-array refs (Triton has no scalar prefetch). On CPU the same
kernels run in interpret mode (tests only: it is slow).

Layout: rows are re-laid so that every expert's block starts on a multiple of the row tile
`block_m` (pad rows are zero); `tile_expert[i]` names the expert owning row tile i (E for tiles
past the last block, which write zeros and read no weights).

  kernel 1, grid (row tiles, I / block_n):  h = glu(x W_gate[e] (+ b_gate[e]), x W_up[e] (+ b_up[e]))
                                        fp32 accumulation; glu a `ffn.GatedActivation`
  kernel 2, grid (row tiles, H / block_n):  y = h W_down[e]   (+ b_down[e] after the kernel)

With per-expert biases kernel 1 takes the gate / up biases as two more whole-array operands
(a separate compiled kernel: the bias-free one is unchanged).

FP8 weights (`fp8.Fp8BlockWeights`, all three projections): the kernels read the e4m3 codes
`[E, K, C]` and the fp32 block scales `[E, ceil(K / B), ceil(C / B)]` (B the scale block, a power
of two; the tiles' block_n and block_k are capped at B so that every weight tile lies in one scale
block). Per contraction step: the code tile converted to x's dtype, its product with the row tile
accumulated in fp32, then times its block's scale: sum_k x[m, k] code[k, c] scale[k // B, c // B],
the dequantised product up to the order of the fp32 sums. Codes held `[E, C, K]` (tokamax's
layout) are transposed per call (`fp8.row_major`).

Tiles (`PallasTiles`): the output tile's columns `block_n` and the contraction step `block_k` are
caps (the largest power of two <= the cap dividing the dimension is used), with Triton's warps per
program and software-pipelining stages; `block_m` rows per tile. Every choice computes the same
function; `benchmarks/pallas_tiles.py` times them on a GPU. Unless told, the layer runs
`default_tiles(block_m, element size, the GPU's compute capability)`: `HOPPER_TILES` for
64-row tiles of bf16 / fp16 on Hopper (compute capability 9.x), `PallasTiles()` elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from expertd.kernels.experts import fp8
from expertd.kernels.ffn import as_gated_activation, check_ffn_args, matmul_precision, row_biases, row_experts

MIN_BLOCK = 16  # tl.dot needs every dimension >= 16


@dataclasses.dataclass(frozen=True)
class PallasTiles:
    """Tile sizes and Triton launch parameters of the two kernels (module docstring); the defaults
    are what the layer runs."""

    block_n: int = 128  # cap on the output tile's columns (I for kernel 1, H for kernel 2)
    block_k: int = 64  # cap on the contraction step (H for kernel 1, I for kernel 2)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_n", "block_k"):
            value = getattr(self, name)
            if not _power_of_two(value, MIN_BLOCK):
                raise ValueError(f"PallasTiles.{name} must be a power of two >= {MIN_BLOCK}, got {value}")
        if not _power_of_two(self.num_warps, 1) or self.num_stages < 1:
            raise ValueError(f"PallasTiles: num_warps must be a power of two and num_stages >= 1, got "
                             f"{self.num_warps} and {self.num_stages}")


def _power_of_two(value: int, least: int) -> bool:
    return value >= least and value & (value - 1) == 0


HOPPER_TILES = PallasTiles(block_n=256, block_k=64, num_warps=8, num_stages=3)
# Chosen on an H100 for bf16 (pallas_tiles.py's sweep, then --confirm in alternation; BENCHMARKS.md
# "On GPUs"): with 64-row tiles, faster than PallasTiles() at every measured shape from 1024 tokens,
# most at 16384. Three stages of kernel 1's tiles (x 64 x 64, gate and up 64 x 256, 2 bytes each)
# take 216 KB of shared memory a block: Hopper has 227 KB, older GPUs less; 128-row tiles or 4-byte
# elements would not fit.


def default_tiles(block_m: int, itemsize: int, compute_capability: str | None) -> PallasTiles:
    """The tiles the layer runs for row tiles of `block_m` rows of `itemsize`-byte elements on a
    GPU of `compute_capability` ("9.0"; None when not compiling for a GPU): HOPPER_TILES for 64-row
    tiles of 2-byte elements (bf16, fp16) on 9.x; else the defaults (what HOPPER_TILES would not
    fit, and what was not measured against them)."""
    hopper = compute_capability is not None and compute_capability.split(".")[0] == "9"
    return HOPPER_TILES if hopper and block_m == 64 and itemsize == 2 else PallasTiles()


def gpu_compute_capability() -> str | None:
    """The default device's CUDA compute capability ("9.0"), None off CUDA GPUs."""
    device = jax.devices()[0]
    return getattr(device, "compute_capability", None) if device.platform == "gpu" else None


def _pow2_block(dim: int, cap: int) -> int:
    """Largest power of two <= cap dividing dim (>= MIN_BLOCK, else ValueError)."""
    block = cap
    while block >= MIN_BLOCK:
        if dim % block == 0:
            return block
        block //= 2
    raise ValueError(f"the pallas backend needs H and I to be multiples of {MIN_BLOCK}, got {dim}")


def _scaled_dot(a, w_ref, scale_ref, e, rows, cols, block):
    """a @ w[e, rows, cols] with fp32 accumulation: `w_ref` dense, or FP8 codes whose tile lies
    in one scale block (`scale_ref [E, Kb, Cb]`, blocks of `block`), converted to a's dtype for the
    product and the fp32 partial product scaled."""
    w = w_ref[e, rows, cols]
    if scale_ref is None:
        return jnp.dot(a, w, preferred_element_type=jnp.float32, precision=matmul_precision(a, w))
    w = w.astype(a.dtype)
    part = jnp.dot(a, w, preferred_element_type=jnp.float32, precision=matmul_precision(a, w))
    return part * scale_ref[e, rows.start // block, cols.start // block]


def _gate_up_kernel(tile_expert_ref, x_ref, wg_ref, wu_ref, *refs, num_experts, block_k, glu, fp8_block):
    # refs: (gate / up scales if FP8) + (b_gate [E, I], b_up [E, I] if biases) + (h_ref,)
    h_ref = refs[-1]
    sg_ref, su_ref = refs[:2] if fp8_block else (None, None)
    bias_refs = refs[2 if fp8_block else 0:-1]
    i, j = pl.program_id(0), pl.program_id(1)
    block_m, block_n = h_ref.shape
    e = tile_expert_ref[i]

    @pl.when(e < num_experts)
    def _compute():
        def step(kk, acc):
            g, u = acc
            xk = x_ref[pl.ds(i * block_m, block_m), pl.ds(kk * block_k, block_k)]
            rows, cols = pl.ds(kk * block_k, block_k), pl.ds(j * block_n, block_n)
            g += _scaled_dot(xk, wg_ref, sg_ref, e, rows, cols, fp8_block)
            u += _scaled_dot(xk, wu_ref, su_ref, e, rows, cols, fp8_block)
            return g, u

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        g, u = lax.fori_loop(0, x_ref.shape[1] // block_k, step, (zeros, zeros))
        if bias_refs:
            cols = pl.ds(j * block_n, block_n)
            g = g + bias_refs[0][pl.ds(e, 1), cols].astype(jnp.float32)
            u = u + bias_refs[1][pl.ds(e, 1), cols].astype(jnp.float32)
        h_ref[...] = glu(g, u).astype(h_ref.dtype)

    @pl.when(e >= num_experts)
    def _empty():
        h_ref[...] = jnp.zeros(h_ref.shape, h_ref.dtype)


def _down_kernel(tile_expert_ref, h_ref, wd_ref, *refs, num_experts, block_k, fp8_block):
    y_ref = refs[-1]
    sd_ref = refs[0] if fp8_block else None
    i, j = pl.program_id(0), pl.program_id(1)
    block_m, block_n = y_ref.shape
    e = tile_expert_ref[i]

    @pl.when(e < num_experts)
    def _compute():
        def step(kk, acc):
            hk = h_ref[pl.ds(i * block_m, block_m), pl.ds(kk * block_k, block_k)]
            rows, cols = pl.ds(kk * block_k, block_k), pl.ds(j * block_n, block_n)
            return acc + _scaled_dot(hk, wd_ref, sd_ref, e, rows, cols, fp8_block)

        acc = lax.fori_loop(0, h_ref.shape[1] // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)

    @pl.when(e >= num_experts)
    def _empty():
        y_ref[...] = jnp.zeros(y_ref.shape, y_ref.dtype)


def tile_layout(group_sizes, num_rows: int, block_m: int):
    """Row tiles for `num_rows` expert-major rows grouped by `group_sizes [E]`.

    Returns (dest int32 [N]: row of each input row in the tiled layout (its block padded to
    block_m); tile_expert int32 [tiles]; tiled_rows: static row count, a multiple of block_m).
    """
    e = group_sizes.shape[0]
    tiled_rows = max(block_m, (num_rows + min(e, num_rows) * (block_m - 1)) // block_m * block_m)
    gs = group_sizes.astype(jnp.int32)
    tiled = (gs + block_m - 1) // block_m * block_m
    expert, _ = row_experts(gs, num_rows)
    safe = jnp.minimum(expert, e - 1)
    pos = jnp.arange(num_rows, dtype=jnp.int32) - jnp.take(jnp.cumsum(gs) - gs, safe)
    dest = jnp.take(jnp.cumsum(tiled) - tiled, safe) + pos
    tile_start = jnp.arange(tiled_rows // block_m, dtype=jnp.int32) * block_m
    tile_expert = jnp.searchsorted(jnp.cumsum(tiled), tile_start, side="right").astype(jnp.int32)
    return dest, tile_expert, tiled_rows


def grouped_ffn_pallas(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None, block_m=None,
                       tiles: PallasTiles | None = None, interpret=None):
    """Pallas grouped gated MLP; same contract as `experts.grouped_ffn` (xs [N, H] -> [N, H]).
    `block_m` (rows per tile, a power of two >= 16; default by rows per expert) and `tiles` (default
    `default_tiles`) choose the tiling, never the result. The weights are arrays or all three
    `fp8.Fp8BlockWeights` (e4m3 codes read by the kernels, scaled per tile; the tiles are capped at
    the scale block)."""
    check_ffn_args(xs, group_sizes, w_gate, w_up, w_down, biases)
    quantised = [fp8.is_fp8(w) for w in (w_gate, w_up, w_down)]
    if any(quantised) and not all(quantised):
        raise ValueError("the pallas backend takes FP8 weights for all three projections or none")
    fp8_block = w_gate.block if all(quantised) else 0
    scales = ()
    if fp8_block:
        if len({w.block for w in (w_gate, w_up, w_down)}) != 1:
            raise ValueError("the pallas backend needs one FP8 scale block for all three projections")
        w_gate, w_up, w_down = (fp8.row_major(w) for w in (w_gate, w_up, w_down))
        scales = (w_gate.scales, w_up.scales, w_down.scales)
        w_gate, w_up, w_down = w_gate.codes, w_up.codes, w_down.codes
    n, h = xs.shape
    e, _, inter = w_gate.shape
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if block_m is None:  # small tiles when experts get few rows (decode), else larger ones
        block_m = 16 if n <= 16 * e else 64
    if not _power_of_two(block_m, MIN_BLOCK):
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK}, got {block_m}")
    if tiles is None:
        itemsize = max(a.dtype.itemsize for a in (xs, w_gate, w_up, w_down))  # the widest tile decides
        tiles = default_tiles(block_m, itemsize, None if interpret else gpu_compute_capability())
    if fp8_block:  # every weight tile within one scale block
        tiles = dataclasses.replace(tiles, block_n=min(tiles.block_n, fp8_block),
                                    block_k=min(tiles.block_k, fp8_block))
    block_k_h, block_k_i = _pow2_block(h, tiles.block_k), _pow2_block(inter, tiles.block_k)
    block_n_i, block_n_h = _pow2_block(inter, tiles.block_n), _pow2_block(h, tiles.block_n)
    dest, tile_expert, tiled_rows = tile_layout(group_sizes, n, block_m)
    expert, valid = row_experts(group_sizes, n)
    dest = jnp.where(valid, dest, tiled_rows)  # invalid rows (maybe NaN garbage) are never read
    source = jnp.full((tiled_rows,), n, jnp.int32).at[dest].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    x_tiled = xs.at[source].get(mode="fill", fill_value=0)  # [tiled_rows, H]
    row_tiles = tiled_rows // block_m
    whole = pl.BlockSpec()  # the whole array; sliced inside the kernel
    # Name Triton explicitly: newer JAX may default GPU Pallas to Mosaic GPU.
    params = pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)

    gate_up_extra = scales[:2] + (() if biases is None else (biases.gate, biases.up))
    gate_up = pl.pallas_call(
        functools.partial(_gate_up_kernel, num_experts=e, block_k=block_k_h, glu=as_gated_activation(activation),
                          fp8_block=fp8_block),
        out_shape=jax.ShapeDtypeStruct((tiled_rows, inter), xs.dtype),
        grid=(row_tiles, inter // block_n_i),
        in_specs=[whole] * (4 + len(gate_up_extra)),
        out_specs=pl.BlockSpec((block_m, block_n_i), lambda i, j: (i, j)),
        interpret=interpret, compiler_params=params, name="grouped_gate_up")
    hidden = gate_up(tile_expert, x_tiled, w_gate, w_up, *gate_up_extra)

    down_extra = scales[2:]
    down = pl.pallas_call(
        functools.partial(_down_kernel, num_experts=e, block_k=block_k_i, fp8_block=fp8_block),
        out_shape=jax.ShapeDtypeStruct((tiled_rows, h), xs.dtype),
        grid=(row_tiles, h // block_n_h),
        in_specs=[whole] * (3 + len(down_extra)),
        out_specs=pl.BlockSpec((block_m, block_n_h), lambda i, j: (i, j)),
        interpret=interpret, compiler_params=params, name="grouped_down")
    y = down(tile_expert, hidden, w_down, *down_extra).at[dest].get(mode="fill", fill_value=0)
    if biases is not None:
        y = (y.astype(jnp.float32) + row_biases(biases, expert, valid).down).astype(xs.dtype)
    return jnp.where(valid[:, None], y, 0)
