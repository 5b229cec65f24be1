"""Denial of service (issue 27): each attack of the issue against a real ``expertd serve`` process on
loopback, with a bearer token; the server must stay responsive (liveness answered fast while the
attack runs from another process), keep its memory bounded where the attack is unauthenticated,
answer the attacker with a cheap, bounded status and log no traceback.

The server runs in a subprocess (its resident memory is read from /proc/<pid>/status and its log
from the file its output goes to); the attacks run in other subprocesses, so the test's own GIL
never slows the liveness probe down.
"""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_support import ServeProcess, serve_process

from expertd.client.kserve_protos import service_grpc, service_pb2
from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

TOKEN = "dos-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
H = 64
LIVENESS_P90_S = 0.1   # the bound on liveness during an attack
LIVENESS_MAX_S = 1.0   # generous for a loaded CI box; the attacks of the issue stalled it ~10 s


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``expertd serve`` (tiny, one layer, fp32, buckets 1/8) with a token; its output in a file."""
    with serve_process(tmp_path_factory, env={"EXPERTD_AUTH_TOKEN": TOKEN}) as handle:
        yield handle


def attack(server: ServeProcess, code: str, seconds: float) -> subprocess.Popen:
    """Run ``code`` (with ``target``, ``TOKEN``, ``seconds`` defined) in another process."""
    prelude = f"import time, grpc\ntarget, TOKEN, seconds = {server.target!r}, {TOKEN!r}, {seconds!r}\n"
    return subprocess.Popen([sys.executable, "-c", prelude + textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def liveness_during(server: ServeProcess, attacker: subprocess.Popen, *,
                    minimum_s: float = 1.0) -> tuple[list[float], str]:
    """Seconds of each liveness Check sent while ``attacker`` runs (and at least ``minimum_s``), and
    what the attacker printed."""
    latencies = []
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)  # connected
        started = time.monotonic()
        while attacker.poll() is None or time.monotonic() - started < minimum_s:
            sent = time.perf_counter()
            answer = stub.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            latencies.append(time.perf_counter() - sent)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(0.02)
    output, _ = attacker.communicate(timeout=60)
    assert attacker.returncode == 0, output
    return latencies, output


def assert_responsive(latencies: list[float]) -> None:
    assert len(latencies) >= 10
    assert np.percentile(latencies, 90) < LIVENESS_P90_S, sorted(latencies)[-5:]
    assert max(latencies) < LIVENESS_MAX_S, sorted(latencies)[-5:]


def codes_of(output: str) -> set[str]:
    return set(re.findall(r"code=(\w+)", output))


def test_a_huge_repeated_field_is_refused_unparsed_while_liveness_stays_fast(server):
    # GetExpertLoad listing layer 0 three million times (3 MB, under the server-wide limit): refused
    # by the method's own limit before it is parsed, over and over, while liveness is probed.
    attacker = attack(server, """
        from expertd.client.pb.v1 import expert_pb2
        payload = expert_pb2.GetExpertLoadRequest(layers=[0] * 3_000_000).SerializeToString()
        channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)])
        call = channel.unary_unary("/expertd.v1.ExpertService/GetExpertLoad")
        codes, end = set(), time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                call(payload, timeout=10, metadata=(("authorization", "Bearer " + TOKEN),))
            except grpc.RpcError as error:
                codes.add(error.code().name)
                message = error.details()
        print("code=" + " code=".join(sorted(codes)), len(payload), message)
    """, seconds=3.0)
    latencies, output = liveness_during(server, attacker)
    assert_responsive(latencies)
    assert codes_of(output) == {"RESOURCE_EXHAUSTED"}, output
    # the same request, one at a time: its status, and a listing under the limit but longer than the model
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetExpertLoad(expert_pb2.GetExpertLoadRequest(layers=[0] * 3_000_000), timeout=10, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this method's limit of 65536 bytes" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.GetExpertLoad(expert_pb2.GetExpertLoadRequest(layers=[0] * 20_000), timeout=10, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 1 layers" in info.value.details()
        assert len(stub.GetExpertLoad(expert_pb2.GetExpertLoadRequest(layers=[0]), timeout=10,
                                      metadata=AUTH).layers) == 1


def test_an_unauthenticated_body_is_never_read(server):
    # 128 MiB to Forward without the token: refused from the call's metadata, before the body is read.
    before = server.memory_kib("VmHWM")
    attacker = attack(server, """
        payload = bytes(128 << 20)
        channel = grpc.insecure_channel(target, options=[("grpc.max_send_message_length", -1)])
        call = channel.unary_unary("/expertd.v1.ExpertService/Forward")
        codes = set()
        for _ in range(3):
            try:
                call(payload, timeout=30)
            except grpc.RpcError as error:
                codes.add(error.code().name)
        print("code=" + " code=".join(sorted(codes)))
    """, seconds=0.0)
    latencies, output = liveness_during(server, attacker)
    assert_responsive(latencies)
    assert codes_of(output) == {"UNAUTHENTICATED"}, output
    growth_mib = (server.memory_kib("VmHWM") - before) / 1024
    assert growth_mib < 48, f"the server's peak memory grew by {growth_mib:.0f} MiB"


def test_an_oversize_authenticated_message_is_refused_by_grpc(server):
    # With the token, gRPC core reads a message before it compares it with the server-wide limit
    # (docs/overload.md): refused with RESOURCE_EXHAUSTED, and the server serves on.
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary("/expertd.v1.ExpertService/Forward")
        with pytest.raises(grpc.RpcError) as info:
            call(bytes(8 << 20), timeout=30, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in info.value.details()
        info_call = channel.unary_unary("/expertd.v1.ExpertService/GetModelInfo")
        with pytest.raises(grpc.RpcError) as info:  # a small method's own limit: refused unparsed
            info_call(bytes(1 << 20), timeout=30, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "this method's limit" in \
            info.value.details()
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        assert stub.GetModelInfo(expert_pb2.GetModelInfoRequest(), timeout=10, metadata=AUTH).layers[0].hidden_size == H


def test_undecodable_bodies_deadlines_and_cancellations_log_no_traceback(server):
    offset = server.log_size()
    attacker = attack(server, """
        channel = grpc.insecure_channel(target)
        call = channel.unary_unary("/expertd.v1.ExpertService/Forward")
        codes, end, n = set(), time.monotonic() + seconds, 0
        while time.monotonic() < end:
            metadata = (("authorization", "Bearer " + TOKEN),) if n % 2 else ()
            try:
                call(b"\\xff\\xff\\xff\\xff" * 64, timeout=5, metadata=metadata)
            except grpc.RpcError as error:
                codes.add(error.code().name)
            n += 1
        print("code=" + " code=".join(sorted(codes)), n)
    """, seconds=3.0)
    latencies, output = liveness_during(server, attacker)
    assert_responsive(latencies)
    assert codes_of(output) == {"UNAUTHENTICATED", "INVALID_ARGUMENT"}, output
    with grpc.insecure_channel(server.target) as channel:  # ordinary deadlines and cancellations
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        request = expert_pb2.ForwardRequest(layer=0, hidden_states=expert_pb2.Tensor(
            dtype=expert_pb2.DTYPE_FLOAT32, shape=[3, H], data=bytes(3 * H * 4)))
        futures = []
        for i in range(40):
            futures.append(stub.Forward.future(request, timeout=0.001 * (i % 5 + 1), metadata=AUTH))
            if i % 3 == 0:
                futures[-1].cancel()
        for future in futures:
            try:
                future.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                pass
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/expertd.v1.ExpertService/Forward")(b"\xff" * 8, timeout=5, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "request is not a valid expertd.v1.ForwardRequest message"
    time.sleep(0.5)
    log = server.log_since(offset)
    assert "Traceback" not in log and "ERROR" not in log, log[:3000]
    assert len(log) < 8 * 1024, f"{len(log)} bytes of log for one attack: not rate-limited?\n{log[:3000]}"
    assert re.search(r"INVALID_ARGUMENT: /expertd.v1.ExpertService/Forward: request is not a valid", log)


def test_error_messages_are_bounded(server):
    huge = expert_pb2.Tensor(dtype=expert_pb2.DTYPE_FLOAT32, shape=[1] * 300_000, data=b"")
    with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", -1)]) as channel:
        stub = expert_pb2_grpc.ExpertServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Forward(expert_pb2.ForwardRequest(layer=0, hidden_states=huge), timeout=10, metadata=AUTH)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hidden_states.shape" in info.value.details() and "300000 dimensions" in info.value.details()
        assert len(info.value.details()) <= 1024
        kserve = service_grpc.GRPCInferenceServiceStub(channel)
        cases = [service_pb2.ModelInferRequest(model_name="x" * 100_000),
                 service_pb2.ModelInferRequest(model_name="moe-layer-0", inputs=[
                     service_pb2.ModelInferRequest.InferInputTensor(name="y" * 100_000, datatype="FP32", shape=[1, H])
                     for _ in range(5)])]
        bad_key = service_pb2.ModelInferRequest(model_name="moe-layer-0")
        bad_key.inputs.add(name="hidden_states", datatype="FP32", shape=[1, H])
        bad_key.parameters["k" * 100_000].int64_param = 1
        for request in (*cases, bad_key):
            with pytest.raises(grpc.RpcError) as info:
                kserve.ModelInfer(request, timeout=10, metadata=AUTH)
            assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            assert len(info.value.details()) <= 1024, len(info.value.details())
            trailing = dict(info.value.trailing_metadata() or ())
            assert len(trailing.get("grpc-status-details-bin", b"")) <= 4096
