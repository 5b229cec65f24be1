"""expertd.client: what a remote caller installs (stubs, tensor codec, client, CLI, load test;
shared_memory: same-host regions whose tensors the server reads and writes in place).

Depends on grpcio (+ health checking), protobuf, numpy and ml_dtypes only: never on JAX.

    from expertd.client import ExpertClient
    with ExpertClient("localhost:8001") as client:
        y = client.forward(x, layer=0)        # x [T, H] -> y [T, H]
"""
from expertd.client.aio import AsyncExpertClient
from expertd.client.channel import Backoff, TlsOptions
from expertd.client.client import ExpertClient
from expertd.client.errors import (
    CancelledError,
    DeadlineExceededError,
    ExpertError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ThrottledError,
    UnauthenticatedError,
    UnavailableError,
)
from expertd.client.messages import ExpertLoad, ForwardResult, RouteResult, Routing, StreamResult
from expertd.client.throttle import Throttle

__all__ = [
    "AsyncExpertClient",
    "Backoff",
    "CancelledError",
    "DeadlineExceededError",
    "ExpertClient",
    "ExpertError",
    "ExpertLoad",
    "ForwardResult",
    "InternalError",
    "InvalidArgumentError",
    "NotFoundError",
    "ResourceExhaustedError",
    "RouteResult",
    "Routing",
    "StreamResult",
    "Throttle",
    "ThrottledError",
    "TlsOptions",
    "UnauthenticatedError",
    "UnavailableError",
]
