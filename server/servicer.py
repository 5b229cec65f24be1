"""``expertd.v1.ExpertService`` on grpc.aio, and the one place where failures become gRPC codes.

Each call: decode and validate (``INVALID_ARGUMENT`` naming the field: dtype, shape, byte length,
hidden size, token limit, NaN/Inf; ``NOT_FOUND`` for a layer not served) -> the batcher
(``UNAVAILABLE`` while warming up or draining, ``RESOURCE_EXHAUSTED`` when its queue is full) ->
encode. Anything else is ``INTERNAL`` with a generic message; the stack trace goes to the server
log only. Every request is counted in ``expertd_requests_total{rpc, code}`` in a ``finally``.

``status_of(exc)`` is the mapping and ``answer`` runs a unary handler under it; the KServe
servicer uses both.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import time

import grpc
import numpy as np
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from expertd.client import codec
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server import validation
from expertd.server.batcher import Batcher
from expertd.server.errors import DeadlineExpired, InvalidRequest, NotReady, Overloaded

log = logging.getLogger(__name__)

# ForwardStream: messages read ahead of the oldest unanswered one (bounds memory per stream).
STREAM_WINDOW = 64


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, list]:
    """(code, message, rich details) for a failure; unexpected ones are logged with their traceback."""
    if isinstance(exc, ValueError) and getattr(exc, "field", None):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.description)
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), [error_details_pb2.BadRequest(field_violations=[violation])]
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(exc).strip("'\""), []
    if isinstance(exc, Overloaded):
        delay = duration_pb2.Duration()
        delay.FromTimedelta(datetime.timedelta(seconds=exc.retry_after))
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), [error_details_pb2.RetryInfo(retry_delay=delay)]
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, str(exc), []
    if isinstance(exc, DeadlineExpired):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc), []
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc), []
    log.error("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); details are in the server log", []


async def abort(context: grpc.aio.ServicerContext, status: tuple[grpc.StatusCode, str, list]) -> None:
    """End the call with ``status`` (from ``status_of``), BadRequest / RetryInfo details included."""
    code, message, details = status
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    await context.abort_with_status(rpc_status.to_status(status))


async def answer(metrics, rpc: str, context: grpc.aio.ServicerContext, work):
    """Await ``work`` (a unary handler's coroutine); a failure ends the call with its status.

    Counted in ``expertd_requests_total{rpc, code}`` whatever happens (the KServe servicer uses it too).
    """
    started, code = time.perf_counter(), "OK"
    try:
        return await work
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a status
        status = status_of(exc)
        code = status[0].name
        await abort(context, status)
    finally:
        metrics.observe_request(rpc, code, time.perf_counter() - started)


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    """Forward, Route, ForwardStream, GetModelInfo and GetExpertLoad over one Batcher."""

    def __init__(self, batcher: Batcher, *, model_name: str, aux_loss_coeff: float, max_request_tokens: int,
                 version: str):
        self.batcher = batcher
        self.engine = batcher.engine
        self.metrics = batcher.metrics
        self.aux_loss_coeff = aux_loss_coeff
        self.max_request_tokens = max_request_tokens
        self._model_info = _model_info(self.engine, model_name, batcher, max_request_tokens, version)

    # -- Forward ---------------------------------------------------------------------------------
    async def Forward(self, request, context):
        return await self._unary("Forward", context, self._forward(request, _deadline(context)))

    async def _forward(self, request, deadline: float | None) -> expert_pb2.ForwardResponse:
        layer = validation.check_layer(self.engine, request.layer)
        x = validation.hidden_states(request.hidden_states if request.HasField("hidden_states") else None,
                                     "hidden_states", layer.cfg.hidden_size, "H", self.max_request_tokens)
        result = await self.batcher.forward(request.layer, x, deadline=deadline)
        response = expert_pb2.ForwardResponse(output=codec.encode(result.output), request_id=request.request_id)
        if request.return_routing:
            response.routing.CopyFrom(_routing(result.topk_ids, result.topk_weights, result.tokens_per_expert))
        return response

    # -- Route -----------------------------------------------------------------------------------
    async def Route(self, request, context):
        return await self._unary("Route", context, self._route(request, _deadline(context)))

    async def _route(self, request, deadline: float | None) -> expert_pb2.RouteResponse:
        layer = validation.check_layer(self.engine, request.layer)
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidRequest("input", "set hidden_states [T, H] or logits [T, E]")
        width, name = (layer.cfg.hidden_size, "H") if which == "hidden_states" else (layer.cfg.num_experts, "E")
        tokens = validation.hidden_states(getattr(request, which), which, width, name, self.max_request_tokens)
        coeff = request.aux_loss_coeff if request.HasField("aux_loss_coeff") else self.aux_loss_coeff
        if not np.isfinite(coeff):
            raise InvalidRequest("aux_loss_coeff", f"must be finite, got {coeff}")
        inputs = {"hidden": tokens} if which == "hidden_states" else {"logits": tokens}
        result = await self.batcher.route(request.layer, aux_loss_coeff=coeff, deadline=deadline, **inputs)
        return expert_pb2.RouteResponse(
            routing=_routing(result.topk_ids, result.topk_weights, result.tokens_per_expert),
            aux_loss=result.aux_loss, request_id=request.request_id)

    # -- ForwardStream ---------------------------------------------------------------------------
    async def ForwardStream(self, request_iterator, context):
        """Answers in request order; each message's failure is reported in-band (``error``)."""
        deadline = _deadline(context)
        window = asyncio.Semaphore(STREAM_WINDOW)
        answers: asyncio.Queue = asyncio.Queue()  # tasks in request order; None marks the end

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await window.acquire()
                    answers.put_nowait(asyncio.ensure_future(self._stream_item(request, deadline)))
            finally:
                answers.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (task := await answers.get()) is not None:
                response = await task
                window.release()
                yield response
            await reader  # re-raises a failure to read the request stream
        finally:
            reader.cancel()
            while not answers.empty():
                task = answers.get_nowait()
                if task is not None:
                    task.cancel()

    async def _stream_item(self, request, deadline: float | None) -> expert_pb2.ForwardResponse:
        started, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            return await self._forward(request, deadline)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - reported in-band, the stream goes on
            code, message, _ = status_of(exc)
            return expert_pb2.ForwardResponse(request_id=request.request_id,
                                              error=expert_pb2.Error(code=code.value[0], message=message))
        finally:
            self.metrics.observe_request("ForwardStream", code.name, time.perf_counter() - started)

    # -- info ------------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return await self._unary("GetModelInfo", context, self._get_model_info())

    async def _get_model_info(self) -> expert_pb2.GetModelInfoResponse:
        return self._model_info

    async def GetExpertLoad(self, request, context):
        return await self._unary("GetExpertLoad", context, self._get_expert_load(request))

    async def _get_expert_load(self, request) -> expert_pb2.GetExpertLoadResponse:
        loads = self.batcher.loads
        response = expert_pb2.GetExpertLoadResponse()
        for index in list(request.layers) or sorted(self.engine.layers):
            validation.check_layer(self.engine, index)
            response.layers.add(layer=index, tokens_total=loads.total(index).tolist(),
                                tokens_recent=loads.recent(index).tolist(), window_seconds=loads.window_s)
        return response

    async def _unary(self, rpc: str, context, work):
        return await answer(self.metrics, rpc, context, work)


def _deadline(context) -> float | None:
    """The call's deadline on the monotonic clock (None without one)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _routing(ids: np.ndarray, weights: np.ndarray, tokens_per_expert: np.ndarray) -> expert_pb2.Routing:
    return expert_pb2.Routing(topk_ids=codec.encode(ids.astype(np.int32, copy=False)),
                              topk_weights=codec.encode(weights.astype(np.float32, copy=False)),
                              tokens_per_expert=tokens_per_expert.tolist())


def _model_info(engine, model_name: str, batcher: Batcher, max_request_tokens: int,
                version: str) -> expert_pb2.GetModelInfoResponse:
    info = expert_pb2.GetModelInfoResponse(
        model=model_name,
        dtype=codec.dtype_enum(engine.dtype),
        buckets=list(engine.buckets),
        max_batch_tokens=batcher.max_part_tokens,
        max_request_tokens=max_request_tokens,
        server_version=version,
        input_dtypes=list(codec.FLOAT_DTYPES),
        mesh=expert_pb2.Mesh(axis_names=[engine.mesh.axis_names[0]], axis_sizes=[len(engine.devices)],
                             platform=engine.devices[0].platform, num_devices=len(engine.devices)),
    )
    for index, layer in sorted(engine.layers.items()):
        cfg = layer.cfg
        router = expert_pb2.RouterSettings(
            score_function=cfg.score_function, use_pre_softmax=cfg.use_pre_softmax,
            num_groups=cfg.num_groups or 0, group_topk=cfg.group_topk or 0,
            scaling_factor=cfg.scaling_factor, has_expert_bias=cfg.use_expert_bias)
        if cfg.norm_topk_prob is not None:
            router.norm_topk_prob = cfg.norm_topk_prob
        info.layers.add(index=index, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                        num_experts=cfg.num_experts, topk=cfg.topk, router=router,
                        num_shared_experts=cfg.num_shared_experts,
                        shared_intermediate_size=cfg.shared_intermediate_size,
                        shared_expert_gate=cfg.shared_expert_gate, activation=cfg.activation)
    return info
