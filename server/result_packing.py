"""A compiled step's results as one buffer, so reading them back is one device-to-host transfer.

Off the CPU every transfer pays a fixed cost, and a step has four or five small results (output,
top-k ids and weights, tokens per expert; a route step's aux loss and scores): on the H100,
``jax.device_get`` of one forward step's results took 460-550 us at 1-16 rows against 350-390 us
for one buffer of the same bytes (BENCHMARKS.md, engine_step). ``PackedStep`` wraps a step
function so that, traced under ``jax.jit``, it returns one uint8 ``[nbytes]`` array: each result's
bytes, the widest dtypes first (so every piece starts aligned on the host), concatenated.
``unpack`` turns the fetched buffer back into the step's results as numpy views, no copy. On CPU
results already sit in host memory, and the engine reads them where they are instead.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class ResultLayout(NamedTuple):
    """Where each result lies in the packed buffer: ``shapes`` and ``dtypes`` in the step's own
    result order, ``offsets`` in bytes (each a multiple of its dtype's item size), ``nbytes`` in all."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, results: Sequence) -> ResultLayout:
        """The layout of arrays (or abstract values) ``results``: the widest item sizes first, ties in
        result order."""
        dtypes = tuple(np.dtype(r.dtype) for r in results)
        sizes = [int(np.prod(r.shape, dtype=np.int64)) * d.itemsize for r, d in zip(results, dtypes, strict=True)]
        offsets, position = [0] * len(results), 0
        for index in sorted(range(len(results)), key=lambda i: -dtypes[i].itemsize):
            offsets[index] = position
            position += sizes[index]
        return cls(tuple(tuple(r.shape) for r in results), dtypes, tuple(offsets), position)


def pack(results: Sequence[jax.Array], layout: ResultLayout) -> jax.Array:
    """``results`` (traced) as one uint8 ``[layout.nbytes]`` array laid out by ``layout``."""
    order = sorted(range(len(results)), key=lambda i: layout.offsets[i])
    pieces = [jax.lax.bitcast_convert_type(results[i].reshape(-1), jnp.uint8).reshape(-1) for i in order]
    return jnp.concatenate(pieces) if pieces else jnp.zeros((0,), jnp.uint8)


def unpack(buffer: np.ndarray, layout: ResultLayout) -> list[np.ndarray]:
    """The results in ``buffer`` (uint8 ``[layout.nbytes]``, from ``pack``) as read-only numpy views."""
    if buffer.shape != (layout.nbytes,) or buffer.dtype != np.uint8:
        raise ValueError(f"packed results: expected uint8 [{layout.nbytes}], got {buffer.dtype} {list(buffer.shape)}")
    results = []
    for shape, dtype, offset in zip(layout.shapes, layout.dtypes, layout.offsets, strict=True):
        count = int(np.prod(shape, dtype=np.int64))
        results.append(np.frombuffer(buffer, dtype, count, offset).reshape(shape))
    return results


class PackedStep:
    """``step`` returning its results packed (module docstring); to be traced by ``jax.jit``.
    ``layout`` is set by the trace (None before)."""

    def __init__(self, step: Callable):
        self._step = step
        self.layout: ResultLayout | None = None

    def __call__(self, *args):
        results = tuple(self._step(*args))
        self.layout = ResultLayout.of(results)
        return pack(results, self.layout)
