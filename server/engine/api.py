"""What the rest of the server knows of the engine: the step protocol, the step kinds, the step
outputs, the served model's description and the two host-side helpers every step input passes
through. Imports no JAX: the front ends and the batcher use these names and nothing else of
``expertd.server.engine`` (``tests/test_imports.py`` holds that).

The engine (``engine.Engine``) implements ``StepRunner``; so does the multi-host leader's engine
proxy. One device-worker thread calls it; its ``lock`` serialises the calls of other threads.
Shapes: B a compiled bucket (rows of a step), n <= B the valid rows, H hidden, E routed experts,
k experts per token.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from expertd.server.engine.description import MeshDescription, ModelDescription

__all__ = ["FORWARD", "ROUTE_HIDDEN", "ROUTE_LOGITS", "STEP_KINDS", "ForwardOutput", "MeshDescription",
           "ModelDescription", "Placements", "RouteOutput", "StepRunner", "aux_loss_of", "cast", "pad_rows"]

FORWARD, ROUTE_HIDDEN, ROUTE_LOGITS = "forward", "route_hidden", "route_logits"
STEP_KINDS = (ROUTE_HIDDEN, ROUTE_LOGITS, FORWARD)


class ForwardOutput(NamedTuple):
    """A forward step's results, cut to the valid rows n: output ``[n, H]`` in the engine dtype,
    topk_ids int32 ``[n, k]`` (descending weight), topk_weights fp32 ``[n, k]``, tokens_per_expert
    int32 ``[E]`` over the n rows."""

    output: np.ndarray
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray


class RouteOutput(NamedTuple):
    """A route step's results, cut to the valid rows n: topk_ids ``[n, k]``, topk_weights ``[n, k]``,
    tokens_per_expert ``[E]``, aux_loss (Switch loss over the n rows times the coefficient) and the
    router's dense per-token aux scores fp32 ``[n, E]`` (so that callers merging requests into one
    step get each request's own loss exactly: ``aux_loss_of``)."""

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray
    aux_loss: float
    aux_scores: np.ndarray


class StepRunner(Protocol):
    """Runs compiled steps on trusted inputs: tokens ``[B, W]`` already decoded, validated, cast to
    the engine dtype (``cast``) and padded to a bucket (``pad_rows``); ``num_valid`` rows of them
    are real. ``token_ids`` int ``[B]`` only for hash-routed layers."""

    lock: threading.RLock

    def forward(self, layer: int, tokens: np.ndarray, num_valid: int,
                token_ids: np.ndarray | None = None) -> ForwardOutput: ...

    def route(self, layer: int, tokens: np.ndarray, num_valid: int, *, from_logits: bool = False,
              aux_loss_coeff: float = 1.0, token_ids: np.ndarray | None = None) -> RouteOutput: ...


class Placements(Protocol):
    """The layers' current physical expert placements (``engine.rebalancer.Rebalancer``), as the
    front ends read them for GetModelInfo and GetExpertLoad. ``placement(layer)`` is an
    ``expertd.kernels.eplb.Placement`` (None: the layer is not expert-parallel)."""

    layers: list[int]

    def placement(self, layer: int): ...

    def version(self, layer: int) -> int: ...


def cast(array: np.ndarray, dtype) -> np.ndarray:
    """``array`` in ``dtype``: the serving path's only change of a token array's dtype (no copy when
    it is already ``dtype``). A token array changes dtype at most twice: decoded (wire -> engine
    dtype) and answered (engine -> the caller's dtype)."""
    return array.astype(dtype, copy=False)


def pad_rows(rows: Sequence[np.ndarray], bucket: int) -> np.ndarray:
    """Arrays [n_i, W] (or [n_i], e.g. token ids) of one dtype, sum(n_i) <= bucket, stacked into
    [bucket, W] ([bucket]) with zero rows after them: one copy, and none when a single array fills
    the bucket. Never changes a dtype."""
    if len(rows) == 1 and len(rows[0]) == bucket:
        return rows[0]
    first = rows[0]
    padded = np.zeros((bucket, *first.shape[1:]), first.dtype)
    offset = 0
    for part in rows:
        if part.dtype != first.dtype:
            raise TypeError(f"pad_rows: rows of {part.dtype} and {first.dtype} (the caller casts, not this)")
        padded[offset:offset + len(part)] = part
        offset += len(part)
    return padded


def aux_loss_of(score_sums: np.ndarray, tokens_per_expert: np.ndarray, num_tokens: int, topk: int,
                coeff: float) -> float:
    """The load-balancing aux loss of T tokens from their per-expert sums, on the host.

      loss = E * coeff / (k * T^2) * sum_e tokens_per_expert[e] * score_sums[e]

    score_sums [E]: the aux scores (a route step's) summed over the T tokens; tokens_per_expert [E]:
    the T tokens' routed counts. Equals `router.fused_moe_aux_loss` on those tokens (summed in fp64).
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    num_experts = len(score_sums)
    dot = float(np.dot(np.asarray(score_sums, np.float64), np.asarray(tokens_per_expert, np.float64)))
    return num_experts * coeff / (topk * num_tokens * num_tokens) * dot
