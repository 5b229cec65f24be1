"""Server reflection that can describe every served service, the KServe one included.

grpcio-reflection answers from one descriptor pool (protobuf's default pool unless told
otherwise). The ``inference.GRPCInferenceService`` stubs register into a private pool
(``expertd.client.kserve_pool``, so they never clash with tritonclient's copy of the same names),
which the default pool does not see: reflection would list that service but fail to describe it.
So reflection gets a pool of its own, holding the files of every served service and their
imports, copied byte for byte from whichever pool defines them.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from expertd.client.kserve_pool import POOL as KSERVE_POOL

SOURCE_POOLS = (descriptor_pool.Default(), KSERVE_POOL)
"""Where served services are defined, searched in this order."""


def reflection_pool(service_names: Iterable[str],
                    sources: Sequence[descriptor_pool.DescriptorPool] = SOURCE_POOLS) -> descriptor_pool.DescriptorPool:
    """A new pool with the files that define ``service_names`` and, before them, their imports.

    ValueError when a service is in none of the ``sources``.
    """
    pool, added = descriptor_pool.DescriptorPool(), set()

    def add(file) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        pool.AddSerializedFile(file.serialized_pb)
        added.add(file.name)

    for name in service_names:
        add(_find_service(name, sources).file)
    return pool


def enable_reflection(server, service_names: Iterable[str]) -> None:
    """Serve ``grpc.reflection.v1alpha.ServerReflection`` on ``server`` (a grpc.aio server, or the
    ``expertd.server.transport.registration.WrappingServer`` in front of one) for ``service_names`` and itself.

    The aio servicer is registered directly: ``reflection.enable_server_reflection`` picks the
    sync one for anything that is not a ``grpc.aio.Server`` instance.
    """
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=reflection_pool(names))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)


def _find_service(name: str, sources: Sequence[descriptor_pool.DescriptorPool]):
    for source in sources:
        try:
            return source.FindServiceByName(name)
        except KeyError:
            continue
    raise ValueError(f"service {name!r} is not defined in any known descriptor pool")
