"""The expertd.v1 messages as Python types, both ways: request building and response decoding
for the sync and asyncio clients, and response encoding for the server (which answers with these
same result types: ``forward_response``, ``route_response``).

Shapes: T tokens, H hidden size, E routed experts, k experts per token.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from expertd.client import codec, errors
from expertd.client.pb.v1 import expert_pb2
from expertd.client.shared_memory import SharedTensor


@dataclasses.dataclass(frozen=True)
class Routing:
    """The router's decisions: ``topk_ids [T, k]`` int32 (descending weight), ``topk_weights
    [T, k]`` float32, ``tokens_per_expert [E]`` int64."""

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """``output [T, H]`` in the request's dtype, and the routing when it was asked for."""

    output: np.ndarray
    routing: Routing | None


@dataclasses.dataclass(frozen=True)
class RouteResult:
    """Route's answer: ids ``[T, k]`` int32, weights ``[T, k]`` float32, tokens per expert ``[E]``,
    and the load-balancing aux loss over the request's tokens."""

    topk_ids: np.ndarray
    topk_weights: np.ndarray
    tokens_per_expert: np.ndarray
    aux_loss: float


@dataclasses.dataclass(frozen=True)
class StreamResult:
    """One ForwardStream answer. On success ``output`` is set; a failed message has ``error``
    (a typed :class:`~expertd.client.errors.ExpertError`) instead, and the stream goes on."""

    request_id: str
    output: np.ndarray | None
    routing: Routing | None
    error: errors.ExpertError | None


@dataclasses.dataclass(frozen=True)
class ExpertLoad:
    """Tokens routed to each expert of one layer: since start and over the recent window."""

    layer: int
    tokens_total: np.ndarray
    tokens_recent: np.ndarray
    window_seconds: float


def forward_request(x: np.ndarray | SharedTensor, layer: int, return_routing: bool, request_id: str = "",
                    token_ids=None, out: SharedTensor | None = None) -> expert_pb2.ForwardRequest:
    """A ForwardRequest; ``x`` (and ``out``, where the server writes the output) may be in shared memory."""
    request = expert_pb2.ForwardRequest(layer=_layer(layer), return_routing=return_routing, request_id=request_id)
    x = set_tensor(request.hidden_states, x, "x")
    if out is not None:
        if out.array.shape != x.shape or out.array.dtype != x.dtype:
            raise ValueError(f"out must be a {x.dtype} {list(x.shape)} SharedTensor like x, got {out.array.dtype} "
                             f"{list(out.array.shape)}")
        request.output_shared_memory.CopyFrom(out.ref())
    if token_ids is not None:
        request.token_ids.CopyFrom(codec.encode(token_ids_array(token_ids, len(x))))
    return request


def set_tensor(field: expert_pb2.Tensor, x: np.ndarray | SharedTensor, name: str) -> np.ndarray:
    """Fill a request's (empty) Tensor ``field`` with ``x [T, W]`` in place, its bytes written once (a
    Tensor built first would be copied in whole), or (a SharedTensor) with a reference to its bytes;
    returns ``x``'s array."""
    if isinstance(x, SharedTensor):
        array = _tokens_by_hidden(x.array, name)
        field.dtype = codec.dtype_enum(array.dtype)
        field.shape[:] = array.shape
        field.shared_memory.CopyFrom(x.ref())
        return array
    array = _tokens_by_hidden(x, name)
    codec.encode_into(field, array)
    return array


def token_ids_array(token_ids, num_tokens: int) -> np.ndarray:
    """``token_ids`` (any integer sequence or array) as ``[T]`` int32 for ``num_tokens`` tokens
    (ValueError naming ``token_ids`` when it is not 1-D integers of length T in [0, 2**31 - 1])."""
    array = np.asarray(token_ids)
    if array.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {array.dtype}")
    if array.shape != (num_tokens,):
        raise ValueError(f"token_ids must have shape [T={num_tokens}] (one id per token), got {list(array.shape)}")
    if array.size and (array.min() < 0 or array.max() > np.iinfo(np.int32).max):
        raise ValueError(f"token_ids must be in [0, 2**31 - 1], got min {array.min()} max {array.max()}")
    return array.astype(np.int32)


def route_request(
    hidden_states: np.ndarray | None, logits: np.ndarray | None, layer: int, aux_loss_coeff: float | None,
    token_ids=None,
) -> expert_pb2.RouteRequest:
    if (hidden_states is None) == (logits is None):
        raise ValueError("route() needs exactly one of hidden_states [T, H] or logits= [T, E]")
    request = expert_pb2.RouteRequest(layer=_layer(layer))
    if hidden_states is not None:
        set_tensor(request.hidden_states, hidden_states, "hidden_states")
    else:
        set_tensor(request.logits, logits, "logits")
    if aux_loss_coeff is not None:
        request.aux_loss_coeff = float(aux_loss_coeff)
    if token_ids is not None:
        num_tokens = request.hidden_states.shape[0] if hidden_states is not None else request.logits.shape[0]
        request.token_ids.CopyFrom(codec.encode(token_ids_array(token_ids, num_tokens)))
    return request


def register_request(region) -> expert_pb2.RegisterSharedMemoryRequest:
    """A RegisterSharedMemoryRequest for a SharedMemoryRegion (the whole object), or the message itself."""
    if isinstance(region, expert_pb2.RegisterSharedMemoryRequest):
        return region
    return expert_pb2.RegisterSharedMemoryRequest(name=region.name, key=region.key, offset=0,
                                                  byte_size=region.byte_size)


def routing(message: expert_pb2.Routing) -> Routing:
    return Routing(
        topk_ids=codec.decode(message.topk_ids, field="routing.topk_ids"),
        topk_weights=codec.decode(message.topk_weights, field="routing.topk_weights"),
        tokens_per_expert=np.asarray(message.tokens_per_expert, dtype=np.int64),
    )


def routing_message(decoded: Routing) -> expert_pb2.Routing:
    """The inverse of ``routing``: ids int32 and weights float32 as tensors, counts as integers."""
    return expert_pb2.Routing(topk_ids=codec.encode(decoded.topk_ids), topk_weights=codec.encode(decoded.topk_weights),
                              tokens_per_expert=decoded.tokens_per_expert.tolist())


def forward_response(result: ForwardResult, request_id: str = "",
                     return_routing: bool = False) -> expert_pb2.ForwardResponse:
    """The inverse of ``forward_result``: the output, and the routing when asked for (and present)."""
    response = expert_pb2.ForwardResponse(request_id=request_id)
    codec.encode_into(response.output, result.output)
    if return_routing and result.routing is not None:
        response.routing.CopyFrom(routing_message(result.routing))
    return response


def route_response(result: RouteResult, request_id: str = "") -> expert_pb2.RouteResponse:
    """The inverse of ``route_result``."""
    return expert_pb2.RouteResponse(
        routing=routing_message(Routing(result.topk_ids, result.topk_weights, result.tokens_per_expert)),
        aux_loss=result.aux_loss, request_id=request_id)


def forward_result(response: expert_pb2.ForwardResponse,
                   out: SharedTensor | None = None) -> ForwardResult:
    """The response as a ForwardResult; with ``out``, the output is ``out.array`` (the server wrote it there)."""
    return ForwardResult(
        output=codec.decode(response.output, field="output") if out is None else out.array,
        routing=routing(response.routing) if response.HasField("routing") else None,
    )


def stream_result(response: expert_pb2.ForwardResponse) -> StreamResult:
    if response.HasField("error"):
        error = errors.error_for(response.error.code, response.error.message)
        return StreamResult(request_id=response.request_id, output=None, routing=None, error=error)
    result = forward_result(response)
    return StreamResult(request_id=response.request_id, output=result.output, routing=result.routing, error=None)


def route_result(response: expert_pb2.RouteResponse) -> RouteResult:
    decoded = routing(response.routing)
    return RouteResult(
        topk_ids=decoded.topk_ids,
        topk_weights=decoded.topk_weights,
        tokens_per_expert=decoded.tokens_per_expert,
        aux_loss=float(response.aux_loss),
    )


def expert_loads(response: expert_pb2.GetExpertLoadResponse) -> dict[int, ExpertLoad]:
    return {
        load.layer: ExpertLoad(
            layer=load.layer,
            tokens_total=np.asarray(load.tokens_total, dtype=np.int64),
            tokens_recent=np.asarray(load.tokens_recent, dtype=np.int64),
            window_seconds=load.window_seconds,
        )
        for load in response.layers
    }


def stream_requests(items, layer: int, return_routing: bool):
    """Pair each stream item (an array, ``(request_id, array)`` or ``(request_id, array, token_ids)``)
    with a request message."""
    for index, item in enumerate(items):
        yield stream_request(index, item, layer, return_routing)


def stream_request(index: int, item, layer: int, return_routing: bool) -> expert_pb2.ForwardRequest:
    if not isinstance(item, tuple):
        item = (str(index), item)
    if len(item) not in (2, 3):
        raise ValueError(f"stream item {index}: expected an array, (request_id, array) or "
                         f"(request_id, array, token_ids), got a tuple of {len(item)}")
    request_id, x, token_ids = item if len(item) == 3 else (*item, None)
    return forward_request(x, layer, return_routing, request_id=str(request_id), token_ids=token_ids)


def _layer(layer: int) -> int:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    return int(layer)


def _tokens_by_hidden(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {x.shape}")
    return x
