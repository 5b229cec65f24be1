"""The typed requests the batcher takes, built once by a front end's decoder
(``expertd.server.frontends.decode``, ``kserve_decode``, the native port) and never changed after.

Shapes: T tokens, H hidden, E routed experts. Step kinds: ``engine.api.FORWARD``, ``ROUTE_HIDDEN``,
``ROUTE_LOGITS``.
"""
from __future__ import annotations

import dataclasses

import numpy as np


# The per-request types are slotted, not frozen: a frozen dataclass costs about a microsecond more
# to build, and the serving path builds several per call. Nothing changes them after decoding.
@dataclasses.dataclass(slots=True)
class Header:
    """What admission needs: the layer, the step kind (``api.FORWARD``, ``ROUTE_HIDDEN``,
    ``ROUTE_LOGITS``) and the tokens T, read from the header fields alone; and ``body_elements``,
    the elements of the tensor the message itself carries (T x width; 0 when it lies in shared
    memory), which sizes the work of decoding it."""

    layer: int
    kind: str
    tokens: int
    body_elements: int = 0


@dataclasses.dataclass(slots=True)
class ForwardRequest:
    """One MoE-layer forward: ``tokens [T, H]`` in the engine dtype, the dtype the caller sent
    (``out_dtype``: its output comes back in it), its deadline (monotonic seconds, or None) and
    the name of its input field (what an error about its tokens names); its tokens' vocabulary ids
    ``token_ids [T]`` int32 (None when the caller sent none)."""

    layer: int
    tokens: np.ndarray
    out_dtype: np.dtype
    deadline: float | None = None
    field: str = "hidden_states"
    token_ids: np.ndarray | None = None


@dataclasses.dataclass(slots=True)
class RouteRequest:
    """Top-k routing of ``tokens``: hidden states ``[T, H]`` in the engine dtype, or router logits
    ``[T, E]`` float32 (``from_logits``); the aux loss is scaled by ``aux_loss_coeff`` (>= 0);
    ``token_ids [T]`` int32 or None as in ForwardRequest."""

    layer: int
    tokens: np.ndarray
    from_logits: bool
    aux_loss_coeff: float
    deadline: float | None = None
    field: str = "hidden_states"
    token_ids: np.ndarray | None = None
