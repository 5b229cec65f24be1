"""Admission before the body: the client's half of Forward's early admission (docs/overload.md).

A Forward whose tensor body is large (ADMISSION_MIN_BYTES and up) carries ADMISSION_METADATA,
``"<layer>,<tokens>"``: the server admits or refuses the call from it before reading the message
(``expertd.server.frontends.expert_v1.ExpertServicer.ForwardAdmittedEarly``), so a refused call's body is
never parsed. Sent at once, that body still crosses the network and the server's transport for
nothing. So while the server pushes back (it refused a call of this client with RESOURCE_EXHAUSTED
within the last PUSHBACK_HOLD_S: ``Pushback``), the clients also send EXPECT_METADATA and hold the
body until the server's initial metadata carries ADMITTED_METADATA, as HTTP's
``Expect: 100-continue`` does: a refused call then costs a header frame each way, an admitted one a
round trip more before its body leaves. Otherwise bodies go at once (no round trip added).

A server from before the expectation never answers it (it sends its initial metadata with the
response): after VERDICT_WAIT_S without a verdict the body goes anyway, which is always safe (a
server that admitted the call reads it; one that refused it has ended the call).
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc

from expertd.client.pb.v1 import expert_pb2

ADMISSION_METADATA = "expertd-admission"
"""Call metadata ``"<layer>,<tokens>"`` of a Forward: the server admits the call from it before it
reads the message. The message must agree (INVALID_ARGUMENT otherwise)."""
ADMISSION_MIN_BYTES = 256 * 1024
"""Forward bodies from this size carry ADMISSION_METADATA; a smaller one costs the server less to
read than the early path's second read costs it (BENCHMARKS.md, Overload)."""
EXPECT_METADATA = ("expertd-expect", "admission")
"""Sent beside ADMISSION_METADATA by a client that holds the message until it is admitted; any
other value of the key is INVALID_ARGUMENT. Without ADMISSION_METADATA the key means nothing."""
ADMITTED_METADATA = ("expertd-admitted", "1")
"""The server's initial metadata for a call it admitted that sent EXPECT_METADATA: send the message."""
PUSHBACK_HOLD_S = 1.0
"""How long after a RESOURCE_EXHAUSTED the clients keep holding large bodies until admission."""
VERDICT_WAIT_S = 0.25
"""How long a held body waits for the server's verdict before it is sent regardless."""


def admission_metadata(request: expert_pb2.ForwardRequest) -> tuple[tuple[str, str], ...]:
    """``((ADMISSION_METADATA, "<layer>,<tokens>"),)`` for a Forward whose tensor body is at least
    ADMISSION_MIN_BYTES (not in shared memory), else ``()``."""
    tensor = request.hidden_states
    if len(tensor.data) < ADMISSION_MIN_BYTES or not tensor.shape:
        return ()
    return ((ADMISSION_METADATA, f"{request.layer},{tensor.shape[0]}"),)


class Pushback:
    """Whether the server has refused a call for lack of room within the last ``hold_s`` seconds.

    ``refused()`` after each RESOURCE_EXHAUSTED; ``active()`` before each large call. Safe from
    any thread (one float, replaced whole)."""

    def __init__(self, hold_s: float | None = None, clock=time.monotonic):
        self._hold_s = PUSHBACK_HOLD_S if hold_s is None else hold_s
        self._clock = clock
        self._until = float("-inf")

    def refused(self) -> None:
        self._until = self._clock() + self._hold_s

    def active(self) -> bool:
        return self._clock() < self._until


def _admitted(initial_metadata) -> bool:
    return any((key, value) == ADMITTED_METADATA for key, value in initial_metadata or ())


async def call_after_admission(multicallable: grpc.aio.StreamUnaryMultiCallable, request, *,
                               timeout: float | None, metadata) -> object:
    """One Forward on ``multicallable`` (the Forward method as stream-unary, so that its message can
    wait), its message sent only once the server's initial metadata says it was admitted.

    ``metadata`` must carry ADMISSION_METADATA. Returns the response; a refusal or any other failure
    raises the call's ``grpc.aio.AioRpcError``, as the unary call would."""
    call = multicallable(timeout=timeout, metadata=tuple(metadata) + (EXPECT_METADATA,))
    try:
        send = _admitted(await asyncio.wait_for(asyncio.shield(call.initial_metadata()), VERDICT_WAIT_S))
    except TimeoutError:  # no verdict: a server from before the expectation
        send = True
    if send:
        try:
            await call.write(request)
            await call.done_writing()
        except asyncio.InvalidStateError:  # the call ended meanwhile (deadline, cancellation, refusal)
            pass
    return await call  # an ended call raises its status here


def call_after_admission_blocking(multicallable: grpc.StreamUnaryMultiCallable, request, *,
                                  timeout: float | None, metadata) -> object:
    """The blocking twin of ``call_after_admission``: raises the call's ``grpc.RpcError``."""
    started, verdict = threading.Event(), []

    def await_verdict():  # initial_metadata() takes no timeout: a thread of its own waits for it
        started.wait()
        verdict.append(_admitted(call.initial_metadata()))

    def message():  # consumed on gRPC's own thread: waits for the verdict, then sends or half-closes
        waiter = threading.Thread(target=await_verdict, name="expertd-admission-verdict", daemon=True)
        waiter.start()
        waiter.join(VERDICT_WAIT_S)
        if verdict[:1] != [False]:  # admitted, or no verdict (a server from before the expectation)
            yield request

    call = multicallable.future(message(), timeout=timeout, metadata=tuple(metadata) + (EXPECT_METADATA,))
    started.set()
    return call.result()
