"""The KServe v2 / Open Inference Protocol service (``inference.GRPCInferenceService``), Triton-flavoured.

Registered by ``expertd.server.app`` on the same grpc.aio server (and port) as ``expertd.v1``, in
front of the same Batcher and ModelDescription: KServe and expertd.v1 requests for one layer share
batches, metrics (the ``grpc_server_*`` families) and the error mapping of
``expertd.server.errors``. ModelInferRequests are decoded and validated once, by
``expertd.server.frontends.kserve_decode.decode_model_infer``, and answers encoded once
(``_infer_response``), both off the event loop for large tensors (``batching.offload``, as
expertd.v1 does); ModelStatistics reads ``expertd.server.metrics.statistics``.

Models: one per served layer, ``moe-layer-<index>``, version ``1``, platform ``jax``:

| tensor | datatype | shape |
|---|---|---|
| input ``hidden_states`` | BF16, FP16 or FP32 (metadata shows the server's compute dtype) | [-1, H] |
| input ``token_ids`` (optional; not in metadata) | INT32: the tokens' vocabulary ids | [-1] |
| output ``output`` | the input's datatype | [-1, H] |
| output ``router_topk_ids`` | INT32 | [-1, k] |
| output ``router_topk_weights`` | FP32 | [-1, k] |

The token dimension is Triton's batch dimension: ModelConfig has ``max_batch_size`` = the server's
``--max-request-tokens`` and dims without it. Inputs come in ``raw_input_contents`` (any of the
three datatypes), typed contents (``fp32_contents``, ``int_contents``: the protocol has no typed
field for BF16 / FP16) or a registered system shared-memory region (see below). No requested
outputs means all three outputs; outputs go back in ``raw_output_contents``, or into the
shared-memory region an output names. The request ``id`` is echoed.

Request parameters: ``timeout`` (int64, microseconds; Triton's server-side queue timeout, ends
the request like a gRPC deadline) and ``priority`` (uint64/int64 >= 0, accepted and ignored: one
priority level). Everything else is INVALID_ARGUMENT naming the parameter: Triton's sequence
parameters (the layer is stateless), classification outputs.

System shared memory (Triton's ``system_shared_memory`` extension): ``SystemSharedMemoryRegister`` /
``Status`` / ``Unregister`` over ``expertd.server.frontends.shared_memory`` (the registry expertd.v1 shares);
tensors name ``shared_memory_region`` / ``_offset`` / ``_byte_size`` in their parameters.

ServerMetadata extensions: ``model_configuration``, ``statistics``, ``parameters``,
``system_shared_memory``. RPCs not in proto/inference (ModelStreamInfer, repository, CUDA shared
memory, trace, logging) are UNIMPLEMENTED.
"""
from __future__ import annotations

import time

import numpy as np

from expertd.client.kserve_protos import SERVICE_NAME, model_config_pb2, service_grpc, service_pb2
from expertd.server.batching import offload
from expertd.server.batching.batcher import Batcher
from expertd.server.config import BatchingConfig
from expertd.server.engine.api import ModelDescription
from expertd.server.errors import InvalidRequest, run_unary
from expertd.server.frontends import kserve_decode
from expertd.server.frontends.kserve_decode import (
    INPUT,
    MODEL_VERSION,
    OUTPUT,
    TOPK_IDS,
    TOPK_WEIGHTS,
    layer_of_model,
    little_endian,
    model_name,
)
from expertd.server.frontends.shared_memory import SharedMemoryRegistry
from expertd.server.metrics.statistics import InferenceTimes, Statistics

EXTENSIONS = ("model_configuration", "statistics", "parameters", "system_shared_memory")
_DATATYPE_OF = {dtype: name for name, dtype in kserve_decode.DATATYPES.items()}
_CONFIG_TYPES = {"BF16": model_config_pb2.TYPE_BF16, "FP16": model_config_pb2.TYPE_FP16,
                 "FP32": model_config_pb2.TYPE_FP32, "INT32": model_config_pb2.TYPE_INT32}


class KServeServicer(service_grpc.GRPCInferenceServiceServicer):
    """The OIP core RPCs plus Triton's ModelConfig and ModelStatistics over one Batcher."""

    def __init__(self, model: ModelDescription, batcher: Batcher, statistics: Statistics, *,
                 batching: BatchingConfig, version: str, shared_memory: SharedMemoryRegistry | None = None):
        self.model = model
        self.shared_memory = shared_memory
        self.batcher = batcher
        self.statistics = statistics
        self.batching = batching
        self.version = version

    @property
    def ready(self) -> bool:
        return bool(self.batcher.accepting)

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.ready)

    async def ModelReady(self, request, context):
        try:
            layer_of_model(self.model, request.name, request.version)
        except LookupError:
            return service_pb2.ModelReadyResponse(ready=False)  # as Triton: unknown models are not ready
        return service_pb2.ModelReadyResponse(ready=self.ready)

    async def ServerMetadata(self, request, context):
        extensions = EXTENSIONS if self.shared_memory is not None else EXTENSIONS[:-1]
        return service_pb2.ServerMetadataResponse(name="expertd", version=self.version, extensions=extensions)

    async def ModelMetadata(self, request, context):
        return await run_unary(context, self._metadata(request))

    async def _metadata(self, request) -> service_pb2.ModelMetadataResponse:
        index = layer_of_model(self.model, request.name, request.version)
        cfg = self.model.layers[index]
        compute = _DATATYPE_OF.get(self.model.dtype, "FP32")
        response = service_pb2.ModelMetadataResponse(name=model_name(index), versions=[MODEL_VERSION], platform="jax")
        response.inputs.add(name=INPUT, datatype=compute, shape=[-1, cfg.hidden_size])
        response.outputs.add(name=OUTPUT, datatype=compute, shape=[-1, cfg.hidden_size])
        response.outputs.add(name=TOPK_IDS, datatype="INT32", shape=[-1, cfg.topk])
        response.outputs.add(name=TOPK_WEIGHTS, datatype="FP32", shape=[-1, cfg.topk])
        return response

    async def ModelConfig(self, request, context):
        return await run_unary(context, self._config(request))

    async def _config(self, request) -> service_pb2.ModelConfigResponse:
        metadata = await self._metadata(request)
        index = layer_of_model(self.model, request.name, request.version)
        batching = self.batching
        config = model_config_pb2.ModelConfig(name=metadata.name, platform="jax", backend="expertd",
                                              max_batch_size=self.model.max_request_tokens)
        for tensor in metadata.inputs:
            config.input.add(name=tensor.name, data_type=_CONFIG_TYPES[tensor.datatype], dims=tensor.shape[1:])
        for tensor in metadata.outputs:
            config.output.add(name=tensor.name, data_type=_CONFIG_TYPES[tensor.datatype], dims=tensor.shape[1:])
        kind = model_config_pb2.ModelInstanceGroup
        config.instance_group.add(name="mesh", kind=kind.KIND_MODEL, count=1)
        dynamic = config.dynamic_batching
        dynamic.preferred_batch_size.extend(b for b in self.model.buckets if b <= self.model.max_batch_tokens)
        dynamic.max_queue_delay_microseconds = int(batching.max_queue_delay_ms * 1000)
        dynamic.default_queue_policy.max_queue_size = batching.max_queue_size
        dynamic.default_queue_policy.allow_timeout_override = True
        cfg = self.model.layers[index]
        for key, value in (("layer", index), ("num_experts", cfg.num_experts), ("topk", cfg.topk),
                           ("intermediate_size", cfg.intermediate_size), ("score_function", cfg.score_function),
                           ("num_shared_experts", cfg.num_shared_experts), ("activation", cfg.activation)):
            config.parameters[key].string_value = str(value)
        return service_pb2.ModelConfigResponse(config=config)

    async def ModelStatistics(self, request, context):
        return await run_unary(context, self._statistics(request))

    async def _statistics(self, request) -> service_pb2.ModelStatisticsResponse:
        indices = [layer_of_model(self.model, request.name, request.version)] if request.name \
            else list(self.model.layers)
        response = service_pb2.ModelStatisticsResponse()
        for index in indices:
            stats = self.statistics.inferences(index)
            entry = response.model_stats.add(name=model_name(index), version=MODEL_VERSION,
                                             last_inference=stats.last_inference_ms,
                                             inference_count=stats.inference_count,
                                             execution_count=self.statistics.executions(index, "forward"))
            infer = entry.inference_stats
            for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
                duration = getattr(stats, name)
                getattr(infer, name).CopyFrom(service_pb2.StatisticDuration(count=duration.count, ns=duration.ns))
        return response

    async def SystemSharedMemoryRegister(self, request, context):
        return await run_unary(context, self._shm_register(request))

    async def _shm_register(self, request) -> service_pb2.SystemSharedMemoryRegisterResponse:
        self._registry().register(request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request, context):
        return await run_unary(context, self._shm_unregister(request))

    async def _shm_unregister(self, request) -> service_pb2.SystemSharedMemoryUnregisterResponse:
        self._registry().unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    async def SystemSharedMemoryStatus(self, request, context):
        return await run_unary(context, self._shm_status(request))

    async def _shm_status(self, request) -> service_pb2.SystemSharedMemoryStatusResponse:
        response = service_pb2.SystemSharedMemoryStatusResponse()
        for info in self._registry().status(request.name):
            response.regions[info.name].CopyFrom(service_pb2.SystemSharedMemoryStatusResponse.RegionStatus(
                name=info.name, key=info.key, offset=info.offset, byte_size=info.byte_size))
        return response

    def _registry(self) -> SharedMemoryRegistry:
        if self.shared_memory is None:
            raise InvalidRequest("name", "shared memory is off on this server (--shared-memory-regions 0)")
        return self.shared_memory

    async def ModelInfer(self, request, context):
        return await run_unary(context, self._infer(request, context))

    async def _infer(self, request, context) -> service_pb2.ModelInferResponse:
        started = time.perf_counter()
        index = layer_of_model(self.model, request.model_name, request.model_version)
        try:
            remaining = context.time_remaining()
            call_deadline = None if remaining is None else time.monotonic() + remaining
            header = kserve_decode.model_infer_header(request, self.model, index)
            elements = header.tokens * self.model.layers[index].hidden_size  # raw, typed or in shared memory
            with self.batcher.admit(header, kserve_decode.infer_deadline(request, call_deadline)) as ticket:
                forward, wanted, slots = await offload.run(kserve_decode.decode_model_infer, request, self.model,
                                                           index, call_deadline, self.shared_memory, elements=elements)
                decoded = time.perf_counter()
                result, timing = await self.batcher.forward(forward, ticket)
            in_batcher = time.perf_counter()
            response = await offload.run(_infer_response, request, index, result, wanted, slots, elements=elements)
        except BaseException:  # counted as Triton's "fail", then mapped to a status by run_unary
            self.statistics.add_failure(index, time.perf_counter() - started)
            raise
        done = time.perf_counter()
        self.statistics.add_success(index, len(forward.tokens), InferenceTimes(
            compute_input=decoded - started, queue=timing.queue_seconds, compute_infer=timing.compute_seconds,
            compute_output=done - in_batcher, total=done - started))
        return response


def _infer_response(request, index: int, result, wanted: list[str], slots: dict) -> service_pb2.ModelInferResponse:
    """The ModelInferResponse of ``result`` (a ForwardResult) with the ``wanted`` outputs, each in its
    raw entry or written to its shared-memory slot (its parameters say where; its raw entry empty)."""
    response = service_pb2.ModelInferResponse(model_name=model_name(index), model_version=MODEL_VERSION, id=request.id)
    arrays = {OUTPUT: result.output, TOPK_IDS: result.routing.topk_ids, TOPK_WEIGHTS: result.routing.topk_weights}
    input_datatype = next(t.datatype for t in request.inputs if t.name == INPUT)
    for name in wanted:
        datatype = input_datatype if name == OUTPUT else ("INT32" if name == TOPK_IDS else "FP32")
        tensor = response.outputs.add(name=name, datatype=datatype, shape=arrays[name].shape)
        array = little_endian(np.ascontiguousarray(arrays[name]))
        slot = slots.get(name)
        if slot is None:
            response.raw_output_contents.append(array.tobytes())
        else:
            slot.write(array)
            for key, value in request.outputs[wanted.index(name)].parameters.items():
                tensor.parameters[key].CopyFrom(value)
            response.raw_output_contents.append(b"")
    return response


def add_to_server(server, *, model: ModelDescription, batcher: Batcher, statistics: Statistics,
                  batching: BatchingConfig, version: str, shared_memory: SharedMemoryRegistry | None = None
                  ) -> list[str]:
    """Register ``inference.GRPCInferenceService`` on ``server`` (a grpc.aio server or the wrapping
    stand-in in front of one); returns its name (for health and reflection)."""
    servicer = KServeServicer(model, batcher, statistics, batching=batching, version=version,
                              shared_memory=shared_memory)
    service_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    return [SERVICE_NAME]
