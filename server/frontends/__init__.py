"""expertd.server.frontends: the gRPC APIs over the batcher and the model description.

Door: ``add_services(server, ...)`` registers ``expertd.v1.ExpertService`` (``expert_v1``) and the
KServe v2 ``inference.GRPCInferenceService`` (``kserve``) on a grpc.aio server (or the wrapping
stand-in of ``transport.registration``) and returns the expertd.v1 servicer and the service names.
Requests are decoded, validated and cast once here (``decode``: expertd.v1; ``kserve_decode``:
KServe v2), tensors may lie in registered shared memory (``shared_memory``).

Imports: ``batching`` (the Batcher and the typed requests), ``engine.api`` (types only: the model
description, step kinds, ``cast``), ``metrics``, ``errors`` and the client's codec, messages and
stubs. No JAX: ``tests/test_imports.py`` holds both.
"""
from __future__ import annotations

from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server.batching.batcher import Batcher
from expertd.server.config import BatchingConfig
from expertd.server.engine.api import ModelDescription, Placements
from expertd.server.frontends import kserve
from expertd.server.frontends.expert_v1 import ExpertServicer
from expertd.server.frontends.shared_memory import SharedMemoryRegistry
from expertd.server.metrics.families import Metrics

__all__ = ["EXPERT_SERVICE", "ExpertServicer", "SharedMemoryRegistry", "add_services"]

EXPERT_SERVICE = expert_pb2.DESCRIPTOR.services_by_name["ExpertService"].full_name


def add_services(server, *, model: ModelDescription, batcher: Batcher, metrics: Metrics, batching: BatchingConfig,
                 version: str, aux_loss_coeff: float, placements: Placements | None = None,
                 shared_memory: SharedMemoryRegistry | None = None) -> tuple[ExpertServicer, list[str]]:
    """Register expertd.v1 (with its header-first Forward handler) and KServe v2 on ``server``;
    (the expertd.v1 servicer, the registered service names for health and reflection)."""
    servicer = ExpertServicer(model, batcher, metrics, aux_loss_coeff=aux_loss_coeff, version=version,
                              placements=placements, shared_memory=shared_memory)
    expert_pb2_grpc.add_ExpertServiceServicer_to_server(servicer, server)
    for method, (key, handler) in servicer.early_handlers().items():
        server.add_early_handler(method, key, handler)
    names = [EXPERT_SERVICE, *kserve.add_to_server(server, model=model, batcher=batcher,
                                                   statistics=metrics.statistics, batching=batching,
                                                   version=version, shared_memory=shared_memory)]
    return servicer, names
