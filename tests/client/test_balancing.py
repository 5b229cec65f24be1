"""Targets, the service config, balancing and retries of the client, against small in-process gRPC
servers that stand in for replicas (they count the calls they get and answer what the test says).

The real servers under a real failure: tests/server/transport/test_failover.py."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import struct
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from expertd.client import (
    AsyncExpertClient,
    Backoff,
    CancelledError,
    ExpertClient,
    ResourceExhaustedError,
    UnavailableError,
)
from expertd.client.channel import (
    GRPC_MAX_ATTEMPTS,
    IDEMPOTENT_METHODS,
    channel_options,
    resolve_target,
    service_config,
)
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

FAST = Backoff(initial=0.01, maximum=0.02)


class Replica:
    """A gRPC server with grpc.health.v1 and an ExpertService whose GetModelInfo answers ``code``."""

    def __init__(self, name: str, code: grpc.StatusCode = grpc.StatusCode.OK, port: int = 0):
        self.name, self.code, self.calls = name, code, 0
        self.answering = None  # set: GetModelInfo calls it with its context before answering
        self._lock = threading.Lock()
        self.health = health.HealthServicer()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        expert_pb2_grpc.add_ExpertServiceServicer_to_server(self._Service(self), self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        assert self.port == port or not port, f"port {port} is taken"
        self.server.start()
        self.set_serving(True)

    class _Service(expert_pb2_grpc.ExpertServiceServicer):
        def __init__(self, replica):
            self.replica = replica

        def GetModelInfo(self, request, context):
            with self.replica._lock:
                self.replica.calls += 1
            if self.replica.answering is not None:
                self.replica.answering(context)
            if self.replica.code != grpc.StatusCode.OK:
                context.abort(self.replica.code, f"{self.replica.name} says no")
            return expert_pb2.GetModelInfoResponse(model=self.replica.name)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def replicas():
    started: list[Replica] = []

    def start(*names_or_codes) -> list[Replica]:
        for item in names_or_codes:
            started.append(Replica(*item) if isinstance(item, tuple) else Replica(item))
        return started[-len(names_or_codes):]

    yield start
    for replica in started:
        replica.stop()


def target(*replicas: Replica) -> str:
    return ",".join(f"127.0.0.1:{r.port}" for r in replicas)


def test_target_forms():
    assert resolve_target("localhost:8001").uri == "localhost:8001"
    assert resolve_target(" dns:///expertd-headless.ns.svc.cluster.local:8001 ").uri == \
        "dns:///expertd-headless.ns.svc.cluster.local:8001"
    assert resolve_target("ipv4:10.0.0.1:1,10.0.0.2:2").uri == "ipv4:10.0.0.1:1,10.0.0.2:2"
    listed = resolve_target("10.0.0.1:8001, 10.0.0.2:8002")
    assert (listed.uri, listed.authority) == ("ipv4:10.0.0.1:8001,10.0.0.2:8002", "10.0.0.1:8001")
    assert resolve_target("[::1]:1,[fe80::2]:2").uri == "ipv6:[::1]:1,[fe80::2]:2"
    names = resolve_target("localhost:8001,127.0.0.1:8002")  # names resolved once, one family
    assert names.uri.startswith(("ipv4:", "ipv6:")) and names.authority == "localhost:8001"
    assert names.uri.endswith(":8002")


@pytest.mark.parametrize("text, message", [
    ("", "target is empty"),
    ("10.0.0.1:8001,10.0.0.2", "entry '10.0.0.2' is not host:port"),
    ("10.0.0.1:8001,:8002", "entry ':8002' is not host:port"),
    ("10.0.0.1:8001,10.0.0.2:99999", "is not host:port"),
    ("10.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"),
    ("127.0.0.1:1,no-such-host.invalid:2", "cannot resolve 'no-such-host.invalid'"),
])
def test_bad_targets_name_the_entry(text, message):
    with pytest.raises(ValueError, match=message):
        resolve_target(text)


def test_service_config_balances_health_checked_and_retries_idempotent_calls_on_unavailable_and_cancelled():
    config = service_config(3, Backoff(initial=0.05, maximum=2.0, multiplier=2.0))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    (method_config,) = config["methodConfig"]
    names = {(n["service"], n["method"]) for n in method_config["name"]}
    assert names == set(IDEMPOTENT_METHODS) and ("expertd.v1.ExpertService", "ForwardStream") not in names
    assert method_config["retryPolicy"] == {"maxAttempts": 4, "initialBackoff": "0.050000s", "maxBackoff": "2.000000s",
                                            "backoffMultiplier": 2.0,
                                            "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]}
    assert service_config(10, FAST)["methodConfig"][0]["retryPolicy"]["maxAttempts"] == GRPC_MAX_ATTEMPTS
    assert "methodConfig" not in service_config(0, FAST)
    options = dict(channel_options(1024, None, retries=2, backoff=FAST))
    assert json.loads(options["grpc.service_config"]) == service_config(2, FAST) and options["grpc.enable_retries"] == 1


def test_calls_are_balanced_round_robin_over_the_replicas(replicas):
    a, b, c = replicas("a", "b", "c")
    with ExpertClient(target(a, b, c), retries=0, timeout=10) as client:
        seen = set()
        for _ in range(200):  # until every replica's connection is up and healthy
            seen.add(client.model_info().model)
            if seen == {"a", "b", "c"}:
                break
        answered = [client.model_info().model for _ in range(30)]
    assert {name: answered.count(name) for name in "abc"} == {"a": 10, "b": 10, "c": 10}


def test_a_replica_that_is_not_serving_gets_no_calls_and_health_still_reaches_it(replicas):
    a, b = replicas("a", "b")
    b.set_serving(False)
    with ExpertClient(target(a, b), retries=0, timeout=10) as client:
        answered = {client.model_info().model for _ in range(20)}
        assert answered == {"a"} and b.calls == 0
        # health goes through the probe channel, which reaches b too (round robin, no health check)
        statuses = {client.health() for _ in range(4)}
        assert statuses == {health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING}
        b.set_serving(True)
        # the client's Watch hears it: b gets calls again (only then is a taken down, or for a moment
        # the client could hear a go down before b come back, and have no replica to call)
        until = time.monotonic() + 10
        while client.model_info().model != "b":
            assert time.monotonic() < until, "b never got calls again"
        a.set_serving(False)
        until = time.monotonic() + 10
        while {client.model_info().model for _ in range(4)} != {"b"}:  # a's Watch: calls move to b
            assert time.monotonic() < until, "calls never left a"
        assert {client.model_info().model for _ in range(10)} == {"b"}


def test_no_serving_replica_fails_at_once_with_unavailable(replicas):
    (a,) = replicas("a")
    a.set_serving(False)
    with ExpertClient(target(a), retries=0, timeout=10) as client, pytest.raises(UnavailableError):
        client.model_info()
    assert a.calls == 0


@pytest.mark.parametrize(("code", "error"), [(grpc.StatusCode.UNAVAILABLE, UnavailableError),
                                             (grpc.StatusCode.CANCELLED, CancelledError)])
def test_unavailable_and_cancelled_are_retried_by_grpc_on_another_replica_not_twice_over(replicas, code, error):
    """CANCELLED as a server sends it: what a stopping gRPC server answers the calls it still holds."""
    dying, healthy = replicas(("dying", code), "healthy")
    with ExpertClient(target(dying, healthy), retries=3, timeout=10, backoff=FAST) as client:
        deadline = time.monotonic() + 30  # round robin uses a replica once its connection is ready
        while dying.calls == 0 and time.monotonic() < deadline:
            assert all(client.model_info().model == "healthy" for _ in range(10))
    assert dying.calls >= 1  # round robin sent some calls there first; each was retried on the other
    (alone,) = replicas(("alone", code))
    with ExpertClient(target(alone), retries=2, timeout=10, backoff=FAST) as client:
        with pytest.raises(error, match="alone says no"):
            client.model_info()
    assert alone.calls == 3  # 1 + 2 retries by gRPC's policy; the client's own loop added none


def test_a_call_the_client_cancels_is_not_retried(replicas):
    (slow,) = replicas("slow")
    released = threading.Event()
    slow.answering = lambda _context: released.wait(10)

    async def scenario():
        async with AsyncExpertClient(target(slow), retries=3, timeout=10, backoff=FAST) as client:
            call = asyncio.ensure_future(client.model_info())
            deadline = time.monotonic() + 10
            while slow.calls == 0:
                assert time.monotonic() < deadline, "the call never reached the replica"
                await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(0.5)  # many times FAST's backoff: a retry would have arrived

    try:
        asyncio.run(scenario())
    finally:
        released.set()
    assert slow.calls == 1


def test_resource_exhausted_is_retried_by_the_client(replicas):
    (full,) = replicas(("full", grpc.StatusCode.RESOURCE_EXHAUSTED))
    with ExpertClient(target(full), retries=2, timeout=10, backoff=FAST) as client:
        with pytest.raises(ResourceExhaustedError):
            client.model_info()
    assert full.calls == 3
    with ExpertClient(target(full), retries=0, timeout=10) as client, pytest.raises(ResourceExhaustedError):
        client.model_info()
    assert full.calls == 4


def test_a_killed_replica_is_left_and_a_restarted_one_is_used_again(replicas):
    a, b = replicas("a", "b")
    with ExpertClient(target(a, b), retries=3, timeout=10, backoff=FAST) as client:
        answered, deadline = set(), time.monotonic() + 30  # round robin uses a replica once its connection is ready
        while answered != {"a", "b"} and time.monotonic() < deadline:
            answered |= {client.model_info().model for _ in range(10)}
        assert answered == {"a", "b"}
        b.stop()
        assert all(client.model_info().model == "a" for _ in range(20))  # none failed
        restarted = Replica("b-again", port=b.port)
        try:
            deadline = time.monotonic() + 10  # reconnect backoff is capped at 2 s
            while restarted.calls == 0 and time.monotonic() < deadline:
                client.model_info()
                time.sleep(0.01)
            assert restarted.calls >= 1
        finally:
            restarted.stop()


class ResettingProxy:
    """A TCP proxy in front of ``replica`` that can reset every connection through it (RST, as the
    kernel does for a killed process) and then refuse new ones: a replica lost mid-call."""

    def __init__(self, replica: Replica):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = replica.port
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return  # closed by reset()
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            self.sockets += [downstream, upstream]
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass

    def reset(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept(), which holds it: no new connection
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):  # the peer may have closed it already
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
                sock.shutdown(socket.SHUT_RD)  # wakes its pump, which holds it in recv
        for sock in self.sockets:
            sock.close()


def answered_by_healthy_until_called(replica: Replica, options: dict, flavour: str) -> None:
    """GetModelInfo through a client of ``options`` (``flavour``: sync or asyncio) until ``replica``
    has been called (round robin uses a replica once its connection is ready; 30 s at most), each
    answer from the replica named "healthy"."""
    deadline = time.monotonic() + 30
    if flavour == "sync":
        with ExpertClient(**options) as client:
            while replica.calls == 0 and time.monotonic() < deadline:
                assert client.model_info().model == "healthy"
    else:
        async def calls() -> None:
            async with AsyncExpertClient(**options) as client:
                while replica.calls == 0 and time.monotonic() < deadline:
                    assert (await client.model_info()).model == "healthy"

        asyncio.run(calls())


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_call_lost_after_its_replica_began_answering_is_sent_again_to_another(replicas, flavour):
    """gRPC's retry policy retries a call only until the server's response headers arrive (the call
    commits, gRFC A6); a replica killed after that loses the call in transport ("Stream removed"),
    which the client's own loop sends once more, to another replica."""
    dying, healthy = replicas("dying", "healthy")
    proxy = ResettingProxy(dying)

    def headers_then_lost(context) -> None:
        context.send_initial_metadata((("replica", "dying"),))
        time.sleep(0.2)  # the headers reach the client: the call is committed
        proxy.reset()  # before the answer leaves

    dying.answering = headers_then_lost
    options = {"target": f"127.0.0.1:{proxy.port},{target(healthy)}", "retries": 2, "timeout": 10, "backoff": FAST}
    answered_by_healthy_until_called(dying, options, flavour)
    assert dying.calls == 1


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_a_call_a_closing_replica_cancels_is_sent_again_to_another(replicas, flavour):
    """gRPC's server core cancels the calls that reach a server while it shuts down (a draining
    replica's last moment), before any handler sees them: the retry policy (RETRIED_BY_GRPC) sends
    an idempotent call that ended CANCELLED once more, to another replica."""
    closing, healthy = replicas(("closing", grpc.StatusCode.CANCELLED), "healthy")
    options = {"target": target(closing, healthy), "retries": 2, "timeout": 10, "backoff": FAST}
    answered_by_healthy_until_called(closing, options, flavour)
    assert closing.calls >= 1
