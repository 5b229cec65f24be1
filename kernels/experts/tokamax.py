"""The "tokamax" backend: the grouped gate / up and down projections through `tokamax.ragged_dot`.

tokamax (PyPI `tokamax`, the `tokamax` extra of pyproject.toml) is imported on first use, so
expertd imports and serves without it; asking for this backend without it raises
`TokamaxMissing` (an ImportError naming the package and the extra).

  grouped_ffn_tokamax(xs [N, H], group_sizes int32 [E], w_gate [E, H, I], w_up [E, H, I],
                      w_down [E, I, H], *, activation="silu", biases=None, implementation=None)
      -> [N, H] xs.dtype. The contract of `expertd.kernels.ffn`: expert-major rows, rows past
      sum(group_sizes) never read (zeroed before the products, whatever they held) and zero out,
      experts with no rows produce nothing. The weights are arrays or `fp8.Fp8BlockWeights` (all
      three, or any of them): FP8 weights go to tokamax as a qwix `QArray` (e4m3 codes, one scale
      per block of K and column, the block scales repeated along the columns), which its quantised
      kernels read in FP8 and scale in the kernel.
      Accumulation is fp32 in every implementation. The products come back in xs.dtype (bf16
      inputs: g and u rounded to bf16 before the activation, as tokamax's Mosaic GPU kernels write
      their accumulator; fp32 inputs: fp32), then the contract's fp32 biases and activation.
      `implementation`: tokamax's (`None`: IMPLEMENTATIONS for this platform; "mosaic", "triton",
      "xla" or a tuple, the first that does not raise NotImplementedError runs).

  IMPLEMENTATIONS: platform -> what None asks tokamax for. GPU: None, tokamax's own order of what
      imported there: its Mosaic GPU kernels (sm90 and sm100; the only GPU kernels tokamax tunes),
      then its Pallas-Triton ones, then XLA's `ragged_dot` (what the "ragged_dot" backend runs),
      each tried when the one before raises NotImplementedError for the shape or dtype. Elsewhere:
      ("xla",) (jax.lax.ragged_dot_general; on CPU E x the FLOPs: correct, for tests and the
      float64 oracle, not fast; tokamax's default would try its TPU kernel off NVIDIA devices).
  available() -> bool: whether tokamax imports.
  prepare_weights(w, platform) -> the layout its kernels read: FP8 codes held `[E, C, K]` on GPU
      (`fp8.transposed_for_tokamax`, once at load by `moe.prepare_params`); dense arrays as they are
      (its sm90 bf16 kernel reads `[E, K, C]`).

"auto" never picks this backend yet (`ops.choose_backend`): it would where a GPU run of
benchmarks/tokamax_layer.py says tokamax beats "pallas" and "ragged_dot" at that shape.
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from expertd.kernels.experts import fp8
from expertd.kernels.ffn import grouped_ffn_by, matmul_precision

IMPLEMENTATIONS = {"gpu": None}
DEFAULT_IMPLEMENTATION = ("xla",)


class TokamaxMissing(ImportError):
    """The "tokamax" backend was asked for and the tokamax package does not import."""


def _tokamax():
    try:
        module = importlib.import_module("tokamax")
    except ImportError as exc:
        raise TokamaxMissing(
            "the 'tokamax' expert backend needs the tokamax package: pip install 'expertd[tokamax]' "
            f"(or tokamax==0.0.12) ({exc})") from exc
    # tokamax reads its options as absl flags, parsing sys.argv on first use unless they are parsed:
    # the process's argv is expertd's (or pytest's), not tokamax's, so its options keep their defaults.
    flags = importlib.import_module("absl.flags")
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return module


def available() -> bool:
    try:
        _tokamax()
    except TokamaxMissing:
        return False
    return True


def implementation_for(platform: str | None = None) -> tuple[str, ...] | None:
    """What `grouped_ffn_tokamax` asks tokamax for on `platform` (IMPLEMENTATIONS)."""
    return IMPLEMENTATIONS.get(platform or jax.default_backend(), DEFAULT_IMPLEMENTATION)


def prepare_weights(w, platform: str | None = None):
    """`w` in the layout tokamax's kernels read on `platform` (module docstring)."""
    if fp8.is_fp8(w) and (platform or jax.default_backend()) == "gpu":
        return fp8.transposed_for_tokamax(w)
    return w


def _rhs(w, dtype):
    """The ragged_dot right-hand side: the array, or a qwix QArray of FP8 weights whose logical
    shape [E, K, C] tokamax reads (scales in `dtype`). FP8 weights whose K is not whole blocks with
    more than one block (no scale tile of tokamax's form) are dequantised here instead."""
    if not fp8.is_fp8(w):
        return w
    e, k, c = w.logical_shape
    if w.scales.shape[1] > 1 and k % w.block:
        return fp8.dequantize(w, dtype)
    qwix = importlib.import_module("qwix")
    codes = jnp.swapaxes(w.codes, 1, 2) if w.transposed else w.codes  # cancels the kernel's own transpose
    return qwix.QArray(qvalue=codes, scale=fp8.column_scales(w, dtype), qtype=codes.dtype)


def grouped_ffn_tokamax(xs, group_sizes, w_gate, w_up, w_down, *, activation="silu", biases=None,
                        implementation=None):
    """Grouped FFN through `tokamax.ragged_dot`; see the module docstring for the contract."""
    tokamax = _tokamax()
    impl = implementation_for() if implementation is None else implementation  # None: tokamax's own order

    def rdot(a, w, gs):
        rhs = _rhs(w, a.dtype)
        dense = rhs if isinstance(rhs, jax.Array) else None
        precision = matmul_precision(a, dense) if dense is not None else matmul_precision(a)
        out = tokamax.ragged_dot(a, rhs, gs, precision=precision, preferred_element_type=a.dtype,
                                 implementation=impl)
        return out.astype(jnp.float32)

    return grouped_ffn_by(rdot, xs, group_sizes, w_gate, w_up, w_down, activation=activation, biases=biases)
