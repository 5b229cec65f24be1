"""``expertd.v1.ExpertService`` on grpc.aio: decode once, batch, encode.

Each call: ``expertd.server.frontends.decode`` reads the message's header (layer, dtype, shape: ``NOT_FOUND``
for a layer not served, ``INVALID_ARGUMENT`` naming the field) -> the batcher admits it or refuses it
at once (``UNAVAILABLE`` while warming up or draining, ``RESOURCE_EXHAUSTED`` with a RetryInfo delay
when the queued work or the call's deadline leaves no room: ``expertd.server.batching.admission``) -> the
tensor body is decoded and validated (byte length, NaN/Inf) -> the batcher computes it ->
``expertd.client.messages`` encodes its result. Failures become status codes in ``errors`` (anything
unexpected is ``INTERNAL`` with a generic message; the trace goes to the server log only). Calls are
counted by the ``grpc_server_*`` wrapper; ForwardStream's messages also in
``expertd_stream_messages_total{code}``.

Shared memory (``expertd.server.frontends.shared_memory``, the registry the KServe service shares):
Register / Unregister / GetSharedMemoryStatus; a Forward's hidden states may name a region
(``Tensor.shared_memory``) and its output may go into one (``output_shared_memory``: the response's
``output`` then has dtype, shape and that reference, no data); Route's inputs may name one too.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc

from expertd.client import admission, codec, messages
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server.batching import offload
from expertd.server.batching.batcher import Batcher
from expertd.server.engine import api
from expertd.server.engine.api import ModelDescription
from expertd.server.errors import DeadlineExpired, InvalidRequest, run_unary, status_of
from expertd.server.frontends import decode
from expertd.server.frontends.shared_memory import SharedMemoryRegistry
from expertd.server.metrics.families import Metrics

# ForwardStream: messages read ahead of the oldest unanswered one (bounds memory per stream).
STREAM_WINDOW = 64


ADMITTED_MESSAGE_WAIT_S = 5.0
"""How long a Forward admitted from its metadata waits for its message. The declaration reserves no
place in the queue (the call is admitted again, for real, once its message is here), so withheld
bodies cost other callers nothing; this bound ends the waiting call itself."""


class ExpertServicer(expert_pb2_grpc.ExpertServiceServicer):
    """Forward, Route, ForwardStream, GetModelInfo and GetExpertLoad over one Batcher."""

    def __init__(self, model: ModelDescription, batcher: Batcher, metrics: Metrics, *, aux_loss_coeff: float,
                 version: str, placements: api.Placements | None = None,
                 shared_memory: SharedMemoryRegistry | None = None):
        self.model = model
        self.shared_memory = shared_memory
        self.batcher = batcher
        self.metrics = metrics
        self.aux_loss_coeff = aux_loss_coeff
        self.placements = placements  # the layers' current expert placements (expert-parallel mesh)
        self._model_info = model_info(model, version)

    def unary_methods(self) -> dict[str, tuple[type, object]]:
        """{path: (request class, ``async handler(message, deadline)``)} for the same-host channel."""
        handlers = {"Forward": self._forward, "Route": self._route, "GetModelInfo": self._model_info_now,
                    "GetExpertLoad": self._get_expert_load, "RegisterSharedMemory": self._register,
                    "UnregisterSharedMemory": self._unregister, "GetSharedMemoryStatus": self._shm_status}
        return {f"/expertd.v1.ExpertService/{name}": (getattr(expert_pb2, f"{name}Request"), handler)
                for name, handler in handlers.items()}

    # -- Forward ---------------------------------------------------------------------------------
    async def Forward(self, request, context):
        return await run_unary(context, self._forward(request, _deadline(context)))

    async def _forward(self, message, deadline: float | None) -> expert_pb2.ForwardResponse:
        header = decode.forward_header(message, self.model)
        with self.batcher.admit(header, deadline) as ticket:
            result, slot = await self._forward_admitted(message, header, ticket, deadline)
        return await self._forward_answer(message, result, slot)

    async def ForwardAdmittedEarly(self, request_iterator, context):
        """Forward for a call that carries ``admission.ADMISSION_METADATA``: checked against admission
        from it before its message is read (a refused call's body is never read; an accepted
        declaration reserves nothing), then admitted and served as Forward once the message is here
        and agrees with it; a call that also sends ``admission.EXPECT_METADATA`` is told it may send
        (initial metadata ``admission.ADMITTED_METADATA``) before it sends the message.
        Registered with ``early_handlers``."""
        return await run_unary(context, self._forward_early(context, request_iterator, _deadline(context)))

    async def _forward_early(self, context, request_iterator, deadline: float | None) -> expert_pb2.ForwardResponse:
        metadata = context.invocation_metadata()
        declared = decode.admission_header(metadata, self.model)
        expects = decode.expects_admission(metadata)
        self.batcher.check_admission(declared, deadline)  # refused now, or told to send: nothing reserved
        if expects:
            await context.send_initial_metadata((admission.ADMITTED_METADATA,))
        try:  # the call itself is what waits: its message must come promptly
            message = await asyncio.wait_for(anext(aiter(request_iterator), None), ADMITTED_MESSAGE_WAIT_S)
        except TimeoutError:
            raise DeadlineExpired(f"the ForwardRequest message did not arrive within {ADMITTED_MESSAGE_WAIT_S:g} "
                                  "s of the call's admission from its metadata") from None
        if message is None:
            raise InvalidRequest("request", "the call ended before its ForwardRequest message")
        header = decode.forward_header(message, self.model)
        if (header.layer, header.tokens) != (declared.layer, declared.tokens):
            raise InvalidRequest(f"metadata {admission.ADMISSION_METADATA!r}", f"declares layer {declared.layer} "
                                 f"with {declared.tokens} tokens; the message has layer {header.layer} with "
                                 f"{header.tokens}")
        with self.batcher.admit(header, deadline) as ticket:  # the place is taken once the body is here
            result, slot = await self._forward_admitted(message, header, ticket, deadline)
        return await self._forward_answer(message, result, slot)

    def early_handlers(self) -> dict[str, tuple[str, grpc.RpcMethodHandler]]:
        """{method: (metadata key, handler)}: the calls of a method that carry the key go to the
        handler (``registration.RoutedServer.add_early_handler``)."""
        handler = grpc.stream_unary_rpc_method_handler(
            self.ForwardAdmittedEarly, request_deserializer=expert_pb2.ForwardRequest.FromString,
            response_serializer=expert_pb2.ForwardResponse.SerializeToString)
        return {"/expertd.v1.ExpertService/Forward": (admission.ADMISSION_METADATA, handler)}

    async def _forward_admitted(self, message, header, ticket, deadline: float | None):
        """(result, output slot or None) of an admitted Forward; large bodies and answers off the loop."""
        request = await offload.run(decode.decode_forward, message, self.model, deadline, self.shared_memory,
                                    header, elements=header.body_elements)
        slot = decode.output_slot(message, request, self.shared_memory)
        result, _ = await self.batcher.forward(request, ticket)
        return result, slot

    async def _forward_answer(self, message, result, slot) -> expert_pb2.ForwardResponse:
        if slot is None:
            return await offload.run(messages.forward_response, result, message.request_id, message.return_routing,
                                     elements=result.output.size)
        slot.write(result.output)
        response = messages.forward_response(dataclasses.replace(result, output=result.output[:0]), message.request_id,
                                             message.return_routing)
        response.output.shape[:] = result.output.shape
        response.output.shared_memory.CopyFrom(message.output_shared_memory)
        return response

    # -- Route -----------------------------------------------------------------------------------
    async def Route(self, request, context):
        return await run_unary(context, self._route(request, _deadline(context)))

    async def _route(self, message, deadline: float | None) -> expert_pb2.RouteResponse:
        header = decode.route_header(message, self.model)
        with self.batcher.admit(header, deadline) as ticket:
            request = await offload.run(decode.decode_route, message, self.model, self.aux_loss_coeff, deadline,
                                        self.shared_memory, header, elements=header.body_elements)
            result, _ = await self.batcher.route(request, ticket)
        return messages.route_response(result, message.request_id)

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
        code = grpc.StatusCode.OK
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
            self.metrics.observe_stream_message(code.name)

    # -- shared memory ---------------------------------------------------------------------------
    async def RegisterSharedMemory(self, request, context):
        return await run_unary(context, self._register(request))

    async def _register(self, request, _deadline=None) -> expert_pb2.RegisterSharedMemoryResponse:
        self._registry().register(request.name, request.key, request.offset, request.byte_size)
        return expert_pb2.RegisterSharedMemoryResponse()

    async def UnregisterSharedMemory(self, request, context):
        return await run_unary(context, self._unregister(request))

    async def _unregister(self, request, _deadline=None) -> expert_pb2.UnregisterSharedMemoryResponse:
        self._registry().unregister(request.name)
        return expert_pb2.UnregisterSharedMemoryResponse()

    async def GetSharedMemoryStatus(self, request, context):
        return await run_unary(context, self._shm_status(request))

    async def _shm_status(self, request, _deadline=None) -> expert_pb2.GetSharedMemoryStatusResponse:
        return expert_pb2.GetSharedMemoryStatusResponse(regions=[
            expert_pb2.RegisterSharedMemoryRequest(name=i.name, key=i.key, offset=i.offset, byte_size=i.byte_size)
            for i in self._registry().status(request.name)])

    def _registry(self) -> SharedMemoryRegistry:
        if self.shared_memory is None:
            raise InvalidRequest("name", "shared memory is off on this server (--shared-memory-regions 0)")
        return self.shared_memory

    # -- info ------------------------------------------------------------------------------------
    async def GetModelInfo(self, request, context):
        return self.current_model_info()

    async def _model_info_now(self, _request, _deadline=None) -> expert_pb2.GetModelInfoResponse:
        return self.current_model_info()

    def current_model_info(self) -> expert_pb2.GetModelInfoResponse:
        """GetModelInfo's answer now: the model's description with each expert-parallel layer's
        current placement (it changes when the rebalancer swaps one in)."""
        if self.placements is None or not self.placements.layers:
            return self._model_info
        info = expert_pb2.GetModelInfoResponse()
        info.CopyFrom(self._model_info)
        for layer in info.layers:
            if self.placements.placement(layer.index) is not None:
                layer.placement.CopyFrom(placement_message(self.placements, layer.index))
        return info

    async def GetExpertLoad(self, request, context):
        return await run_unary(context, self._get_expert_load(request))

    async def _get_expert_load(self, request, _deadline=None) -> expert_pb2.GetExpertLoadResponse:
        """At most one entry per served layer (``len`` first: the loop never grows with the request)."""
        if len(request.layers) > len(self.model.layers):
            raise InvalidRequest("layers", f"at most {len(self.model.layers)} layers (those served), got "
                                           f"{len(request.layers)}")
        loads = self.batcher.loads
        response = expert_pb2.GetExpertLoadResponse()
        for index in dict.fromkeys(request.layers) or list(self.model.layers):
            self.model.layer(index)
            recent = loads.recent(index)
            load = response.layers.add(layer=index, tokens_total=loads.total(index).tolist(),
                                       tokens_recent=recent.tolist(), window_seconds=loads.window_s)
            placement = None if self.placements is None else self.placements.placement(index)
            if placement is not None:
                load.placement.CopyFrom(placement_message(self.placements, index))
                load.rank_tokens_recent.extend(placement.rank_loads(recent).tolist())
                load.balancedness = placement.balancedness(recent)
        return response


def _deadline(context) -> float | None:
    """The call's deadline on the monotonic clock (None without one)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def placement_message(placements: api.Placements, layer: int) -> expert_pb2.ExpertPlacement:
    """Layer ``layer``'s current physical expert placement as an ExpertPlacement message."""
    placement = placements.placement(layer)
    return expert_pb2.ExpertPlacement(
        num_ranks=placement.num_ranks, slots_per_rank=placement.slots_per_rank,
        physical_to_logical=placement.physical_to_logical.reshape(-1).tolist(),
        replica_counts=placement.replica_counts.tolist(), num_redundant_experts=placement.num_redundant,
        version=placements.version(layer))


def model_info(model: ModelDescription, version: str) -> expert_pb2.GetModelInfoResponse:
    """GetModelInfo's answer: the description's layers, dtype, buckets, limits and mesh."""
    info = expert_pb2.GetModelInfoResponse(
        model=model.name, dtype=codec.dtype_enum(model.dtype), buckets=list(model.buckets),
        max_batch_tokens=model.max_batch_tokens, max_request_tokens=model.max_request_tokens,
        server_version=version, input_dtypes=list(codec.FLOAT_DTYPES),
        mesh=expert_pb2.Mesh(axis_names=[model.mesh.axis], axis_sizes=[model.mesh.size],
                             platform=model.mesh.platform, num_devices=model.mesh.size),
    )
    for index, cfg in model.layers.items():
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
