"""One request's answer from its steps' pieces (the batcher's step 5; ``expertd.server.batching.batcher``).

A request's rows may have been computed in several steps; the batcher hands over each step's
piece for them, in row order, and these functions join them into the client's own result types:
- ``forward_result``: output ``[T, H]`` cast once to the caller's dtype (``api.cast``), the
  routing ``topk_ids [T, k]`` int32, ``topk_weights [T, k]`` float32 and ``tokens_per_expert [E]``.
- ``route_result``: the routing, and the aux loss of the request's own tokens, computed on the host
  from its pieces' score sums (``api.aux_loss_of``); one that overflows float32 (the answer's
  type) is an INVALID_ARGUMENT naming ``aux_loss_coeff``.
Pure numpy; the batcher runs a large request's ``forward_result`` off the event loop (``offload``).
"""
from __future__ import annotations

import numpy as np

from expertd.client.messages import ForwardResult, RouteResult, Routing
from expertd.kernels.config import MoEConfig
from expertd.server.engine import api
from expertd.server.errors import InvalidRequest

FLOAT32_MAX = float(np.finfo(np.float32).max)


def tokens_per_expert(topk_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """``[E]`` int64 from ``topk_ids [T, k]``."""
    return np.bincount(topk_ids.reshape(-1), minlength=num_experts)


def step_piece(kind: str, result, rows: slice) -> tuple:
    """One request's ``rows`` of a step's ``result`` (the engine's, of ``kind``): (output, topk_ids,
    topk_weights) for ``api.FORWARD``, else (topk_ids, topk_weights, the rows' own score sums
    ``[E]`` in fp64, from which the request's aux loss is computed)."""
    if kind == api.FORWARD:
        return result.output[rows], result.topk_ids[rows], result.topk_weights[rows]
    return result.topk_ids[rows], result.topk_weights[rows], result.aux_scores[rows].sum(axis=0, dtype=np.float64)


def not_finite(field: str, token: int) -> InvalidRequest:
    """The error of a request whose result is NaN / Inf from ``token`` on (its input overflowed the layer)."""
    return InvalidRequest(field, f"the layer's result is not finite at token {token}: the input's magnitude "
                                 "overflows the layer's arithmetic")


def forward_result(pieces: list, out_dtype, num_experts: int) -> ForwardResult:
    """From the (output, topk_ids, topk_weights) rows of each step, in row order."""
    output, ids, weights = pieces[0] if len(pieces) == 1 else (np.concatenate(p) for p in zip(*pieces))
    return ForwardResult(api.cast(output, out_dtype), Routing(ids, weights, tokens_per_expert(ids, num_experts)))


def route_result(pieces: list, cfg: MoEConfig, aux_loss_coeff: float) -> RouteResult:
    """From the (topk_ids, topk_weights, score sums ``[E]`` float64) of each step, in row order."""
    ids, weights = pieces[0][:2] if len(pieces) == 1 else (np.concatenate([p[i] for p in pieces]) for i in (0, 1))
    counts = tokens_per_expert(ids, cfg.num_experts)
    aux_loss = api.aux_loss_of(sum(p[2] for p in pieces), counts, len(ids), cfg.topk, aux_loss_coeff)
    if not abs(aux_loss) <= FLOAT32_MAX:  # the answer's aux_loss is a float32
        raise InvalidRequest("aux_loss_coeff", f"the aux loss with coefficient {aux_loss_coeff:g} overflows "
                                               f"float32; use a smaller coefficient")
    return RouteResult(ids, weights, counts, aux_loss)
