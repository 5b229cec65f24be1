"""The same-host channel (``expertd serve --shm-channel``) with the real server in its own process,
called by the real clients over ``shm://`` and by hand-made frames: equal to gRPC bit for bit, many
calls in flight, the same errors, and every failure of docs/attention.md's list: another user, a
malformed or oversize frame, a client killed mid-call, a server killed under a waiting call, a
restart, a drain, the token. No timed asserts: waits are bounded polls."""
import asyncio
import concurrent.futures
import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import pytest
from google.rpc import status_pb2
from grpc_health.v1 import health_pb2
from service_support import poll, sample, scrape, serve_process

from expertd.client import (
    AsyncExpertClient,
    DeadlineExceededError,
    ExpertClient,
    InvalidArgumentError,
    NotFoundError,
    UnauthenticatedError,
    UnavailableError,
)
from expertd.client import shm_frames as wire
from expertd.client.pb.v1 import expert_pb2
from expertd.client.shared_memory import SharedMemoryRegion
from expertd.client.shm_connection import connect

H = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("channel") / "expertd.sock")
    with serve_process(tmp_path_factory, "--shm-channel", path, "--shm-channel-slots", "4") as server:
        yield server, path


@pytest.fixture(scope="module")
def clients(served):
    server, path = served
    with ExpertClient(server.target, timeout=30) as grpc_client, ExpertClient(f"shm://{path}", timeout=30) as shm:
        yield grpc_client, shm


def tokens(n: int, seed: int = 0, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, H)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 5, 8, 11])
def test_forward_and_route_equal_grpc_bit_for_bit(clients, dtype, n):
    grpc_client, shm = clients
    x = tokens(n, seed=n, dtype=dtype)
    over_grpc, over_shm = (c.forward(x, layer=0, return_routing=True) for c in (grpc_client, shm))
    assert over_shm.output.dtype == x.dtype
    np.testing.assert_array_equal(over_shm.output, over_grpc.output)
    np.testing.assert_array_equal(over_shm.routing.topk_ids, over_grpc.routing.topk_ids)
    np.testing.assert_array_equal(over_shm.routing.topk_weights, over_grpc.routing.topk_weights)
    for kwargs in ({"hidden_states": x}, {"logits": tokens(n, seed=n + 1)[:, :8]}):
        a, b = (c.route(layer=0, **kwargs) for c in (grpc_client, shm))
        np.testing.assert_array_equal(b.topk_ids, a.topk_ids)
        np.testing.assert_array_equal(b.topk_weights, a.topk_weights)
        assert b.aux_loss == a.aux_loss


def test_model_info_health_and_expert_load_answer_as_over_grpc(clients):
    grpc_client, shm = clients
    assert shm.model_info() == grpc_client.model_info()
    assert shm.health() == health_pb2.HealthCheckResponse.SERVING
    shm.wait_ready(timeout=5)
    assert set(shm.expert_load()) == set(grpc_client.expert_load()) == {0}


def test_errors_are_grpcs_with_the_same_codes_messages_and_fields(clients):
    grpc_client, shm = clients
    for call, kind in [(lambda c: c.forward(tokens(2)[:, :3], layer=0), InvalidArgumentError),
                       (lambda c: c.forward(np.full((2, H), np.nan, np.float32), layer=0), InvalidArgumentError),
                       (lambda c: c.forward(tokens(2), layer=7), NotFoundError),
                       (lambda c: c.health("no-such-service"), NotFoundError)]:
        errors = []
        for client in (grpc_client, shm):
            with pytest.raises(kind) as caught:
                call(client)
            errors.append((caught.value.code, caught.value.message, caught.value.field_violations))
        assert errors[0] == errors[1]


def test_many_threads_and_calls_in_flight_get_their_own_answers(clients):
    grpc_client, shm = clients
    inputs = [tokens(1 + i % 8, seed=100 + i) for i in range(48)]
    want = [grpc_client.forward(x, layer=0) for x in inputs]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # 8 threads over 4 slots
        got = list(pool.map(lambda x: shm.forward(x, layer=0), inputs))
    for a, b in zip(got, want, strict=True):  # merged into steps with other calls: fp32 sums in another order
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    async def gathered():
        async with AsyncExpertClient(f"shm://{shm.target[len('shm://'):]}", timeout=30) as client:
            return await asyncio.gather(*(client.forward(x, layer=0) for x in inputs))
    for a, b in zip(asyncio.run(gathered()), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_output_can_go_into_a_registered_region_in_place(clients):
    grpc_client, shm = clients
    x = tokens(4, seed=3)
    region = SharedMemoryRegion("channel-out", x.nbytes)
    try:
        shm.register_shared_memory(region)
        assert [r.name for r in shm.shared_memory_status()] == ["channel-out"]
        out = region.tensor(0, x.dtype, x.shape)
        result = shm.forward(x, layer=0, out=out)
        np.testing.assert_array_equal(out.array, grpc_client.forward(x, layer=0))
        assert np.shares_memory(result, out.array)
        shm.unregister_shared_memory("channel-out")
        del out, result
    finally:
        region.close()


def test_calls_count_in_the_grpc_families_and_by_transport(served, clients):
    server, _ = served
    _, shm = clients
    labels = {"grpc_type": "unary", "grpc_service": "expertd.v1.ExpertService", "grpc_method": "Forward",
              "grpc_code": "OK"}
    before = scrape(server.metrics_port)
    for _ in range(5):
        shm.forward(tokens(1), layer=0)
    after = scrape(server.metrics_port)
    assert sample(after, "grpc_server_handled_total", **labels) - sample(before, "grpc_server_handled_total",
                                                                         **labels) == 5
    mine = {"transport": "shm", "grpc_method": "Forward", "grpc_code": "OK"}
    assert sample(after, "expertd_shm_channel_handled_total", **mine) - \
        sample(before, "expertd_shm_channel_handled_total", **mine) == 5
    assert sample(after, "expertd_shm_channel_clients") >= 1


def test_the_socket_is_owner_only_and_another_user_cannot_attach(served):
    server, path = served
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root and a system python3 to run a client as another user")
    attach = ("import socket, struct, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
              f"s.connect(sys.argv[1]); s.send(struct.pack('<IHHI', {wire.MAGIC}, {wire.VERSION}, 0, 0)); "
              "m = s.recv(4096); print(struct.unpack_from('<IHHI', m)[3], m[12:].decode())")
    opened = pathlib.Path(tempfile.mkdtemp())  # beside pytest's folders (one file system), but open to all
    opened.chmod(0o777)
    if not all(parent.stat().st_mode & 0o001 for parent in opened.parents):
        shutil.rmtree(opened)
        pytest.skip(f"{tempfile.gettempdir()} is not open to other users")
    link = opened / "ch.sock"
    os.link(path, link)  # the same socket, reachable by another user
    try:
        refused = subprocess.run([python, "-c", attach, str(link)], user=65534, capture_output=True, text=True,
                                 timeout=30)
        assert "PermissionError" in refused.stderr, refused  # 0600: the kernel refuses the connect itself
        os.chmod(link, 0o666)  # past the file mode, the peer's uid is what refuses
        answer = subprocess.run([python, "-c", attach, str(link)], user=65534, capture_output=True, text=True,
                                timeout=30)
    finally:
        os.chmod(link, 0o600)
        shutil.rmtree(opened)
    code, _, message = answer.stdout.strip().partition(" ")
    assert int(code) == 7 and "uid 65534 may not attach" in message, answer  # PERMISSION_DENIED
    assert sample(scrape(server.metrics_port), "expertd_shm_channel_refused_clients_total", reason="permission") >= 1


def pause(process: subprocess.Popen) -> None:
    """SIGSTOP ``process`` and wait until it is stopped (a polling loop could still answer meanwhile)."""
    process.send_signal(signal.SIGSTOP)
    poll(lambda: pathlib.Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T",
         timeout=30)


def raw_call(path: str, *, method: int = 1, payload: bytes = b"", length: int | None = None, magic: int = wire.MAGIC,
             slot: int = 0, bell: bytes | None = None):
    """One hand-made frame in slot ``slot`` and its doorbell: (gRPC code, google.rpc.Status or
    response bytes), or None when the server closed the connection."""
    sock, segment, slots, slot_bytes = connect(path, b"")
    try:
        wire.FRAME.pack_into(segment, 0, magic, wire.VERSION, method, 1, 10_000_000,
                             len(payload) if length is None else length, 0)
        segment[wire.FRAME.size:wire.FRAME.size + len(payload)] = payload
        sock.setblocking(True)
        sock.settimeout(30)
        sock.send(bell if bell is not None else wire.DOORBELL.pack(wire.CALL, slot, 1))
        answer = sock.recv(64)
        if not answer:
            return None
        _, _, _, _, _, size, code = wire.FRAME.unpack_from(segment, 0)
        body = segment[wire.FRAME.size:wire.FRAME.size + size]
        return code, status_pb2.Status.FromString(body) if code else body
    finally:
        sock.close()
        segment.close()


def test_a_malformed_frame_is_answered_naming_the_field_and_the_server_goes_on(served, clients):
    _, path = served
    good = expert_pb2.GetModelInfoRequest().SerializeToString()
    assert raw_call(path, method=3, payload=good)[0] == 0
    cases = [({"method": 99, "payload": good}, "frame.method: expected 1..8"),
             ({"magic": 0x1234, "payload": good}, "frame: expected magic"),
             ({"length": 0xFFFFFFFF}, "frame.payload_length: expected <= "),
             ({"method": 1, "payload": b"\xff\xff\xff"}, "request is not a valid expertd.v1.ForwardRequest message")]
    for frame, message in cases:
        code, status = raw_call(path, **frame)
        assert code == 3 and message in status.message, (frame, status)  # INVALID_ARGUMENT
    for bell in (wire.DOORBELL.pack(wire.CALL, 4, 1), wire.DOORBELL.pack(wire.ANSWER, 0, 1), b"\x01\x02"):
        assert raw_call(path, method=3, payload=good, bell=bell) is None  # no such slot / not a call: disconnected
    _, shm = clients
    assert shm.model_info().layers  # every other client is served as before


def test_a_client_killed_mid_call_frees_its_connection(served, clients):
    server, path = served
    clients_now = lambda: sample(scrape(server.metrics_port), "expertd_shm_channel_clients")  # noqa: E731
    baseline = clients_now()
    code = ("import sys, time, numpy as np; from expertd.client import ExpertClient; "
            "c = ExpertClient('shm://' + sys.argv[1], timeout=60); c.model_info(); print('attached', flush=True); "
            "[c.forward(np.ones((8, 64), np.float32), layer=0) for _ in iter(int, 1)]")
    child = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "attached"
        poll(lambda: clients_now() == baseline + 1, timeout=30)
        time.sleep(0.2)  # calling in a loop: killed in the middle of one, or between two
    finally:
        child.kill()
        child.wait(timeout=30)
    poll(lambda: clients_now() == baseline, timeout=30)
    _, shm = clients
    np.testing.assert_array_equal(shm.forward(tokens(2), layer=0), clients[0].forward(tokens(2), layer=0))


def test_the_token_is_required_on_the_channel_too(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("channel") / "auth.sock")
    with serve_process(tmp_path_factory, "--shm-channel", path, env={"EXPERTD_AUTH_TOKEN": "s3cret-token"}):
        with ExpertClient(f"shm://{path}", timeout=10) as anonymous, pytest.raises(UnauthenticatedError):
            anonymous.model_info()
        with ExpertClient(f"shm://{path}", timeout=10, token="s3cret-token") as client:
            assert client.model_info().layers


def test_a_killed_server_fails_waiting_calls_at_once_and_a_restarted_one_is_reattached(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("channel") / "restart.sock")
    client = ExpertClient(f"shm://{path}", timeout=30, retries=0)
    with serve_process(tmp_path_factory, "--shm-channel", path) as first:
        want = client.forward(tokens(3), layer=0)
        pause(first.process)  # the next call waits on a server that cannot answer
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.forward, tokens(3), layer=0)
            time.sleep(0.2)
            assert not waiting.done()
            first.process.kill()
            first.process.send_signal(signal.SIGCONT)
            with pytest.raises(UnavailableError, match="closed the connection"):
                waiting.result(timeout=30)  # at once: the socket closed with the process, not the 30 s deadline
    with pytest.raises(UnavailableError, match="cannot connect"):
        client.forward(tokens(3), layer=0)
    with serve_process(tmp_path_factory, "--shm-channel", path):  # the stale socket is replaced
        np.testing.assert_array_equal(client.forward(tokens(3), layer=0), want)
    client.close()


def test_a_draining_server_refuses_new_calls_unavailable(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("channel") / "drain.sock")
    with serve_process(tmp_path_factory, "--shm-channel", path, "--drain-linger-s", "2") as server, \
            ExpertClient(f"shm://{path}", timeout=10, retries=0) as client:
        client.forward(tokens(1), layer=0)
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        with pytest.raises(UnavailableError) as refused:
            while time.monotonic() < deadline:
                client.forward(tokens(1), layer=0)
        assert "draining" in refused.value.message or "closed the connection" in refused.value.message \
            or "cannot connect" in refused.value.message
        assert server.process.wait(timeout=60) == 0


def test_a_stale_socket_is_replaced_and_a_live_one_is_refused(served, tmp_path_factory):
    _, path = served
    with pytest.raises(AssertionError, match="another server listens there"):
        with serve_process(tmp_path_factory, "--shm-channel", path):
            pass
    stale = str(tmp_path_factory.mktemp("channel") / "stale.sock")
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    leftover.bind(stale)
    leftover.close()  # a socket file nobody listens on, as a killed server leaves it
    with serve_process(tmp_path_factory, "--shm-channel", stale), ExpertClient(f"shm://{stale}") as client:
        assert client.model_info().layers


def test_a_call_past_its_deadline_fails_and_its_slot_comes_back_with_the_late_answer(served, clients):
    server, path = served
    grpc_client, _ = clients
    x = tokens(2, seed=9)
    want = grpc_client.forward(x, layer=0)

    async def late_async(client):
        with pytest.raises(DeadlineExceededError):
            await client.forward(x, layer=0, timeout=0.3)

    with ExpertClient(f"shm://{path}", timeout=30, retries=0) as blocking:
        blocking.forward(x, layer=0)  # attached
        pause(server.process)  # a server that cannot answer in time
        try:
            for _ in range(6):  # more than its 4 slots: each timed-out call holds one until answered
                with pytest.raises(DeadlineExceededError):
                    blocking.forward(x, layer=0, timeout=0.05)
        finally:
            server.process.send_signal(signal.SIGCONT)
        np.testing.assert_array_equal(blocking.forward(x, layer=0), want)  # the late answers freed the slots

    async def scenario():
        async with AsyncExpertClient(f"shm://{path}", timeout=30, retries=0) as client:
            np.testing.assert_array_equal(await client.forward(x, layer=0), want)
            pause(server.process)
            try:
                await asyncio.gather(*(late_async(client) for _ in range(6)))
            finally:
                server.process.send_signal(signal.SIGCONT)
            np.testing.assert_array_equal(await client.forward(x, layer=0), want)
    asyncio.run(scenario())


@pytest.mark.parametrize("value", ["soon", "-5", "2e6"])
def test_a_bad_spin_setting_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("EXPERTD_SHM_SPIN_US", value)
    with pytest.raises(ValueError, match="EXPERTD_SHM_SPIN_US: expected"):
        ExpertClient("shm://nowhere")
