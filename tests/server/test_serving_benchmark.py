"""benchmarks/serving.py's in-server view: the means it reads from a real server's own histograms.

The benchmark splits a single-token call's time with the server's ``grpc_server_handling_seconds``
(per method) and ``expertd_compute_duration_seconds`` (its Forward steps); here a real server
answers a known number of Forward and health Check calls and the means must count exactly those.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import struct
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from service_support import server_config

from expertd.client import ExpertClient
from expertd.server.app import create_server

ROOT = pathlib.Path(__file__).resolve().parents[2]


def benchmark_module(script: str):
    """``benchmarks/<script>.py`` imported as a module, with benchmarks/ on ``sys.path`` as when it
    runs as a script (for its ``import harness``)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"{script}_benchmark", ROOT / "benchmarks" / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_in_server_means_count_the_calls_between_two_readings(tmp_path_factory):
    serving = benchmark_module("serving")
    registry = CollectorRegistry()
    handle = create_server(server_config(tmp_path_factory), registry=registry)
    try:
        handle.wait_ready(timeout=300)
        target = f"127.0.0.1:{handle.port}"
        hidden = handle.engine.layers[0].cfg.hidden_size
        with ExpertClient(target) as client, grpc.insecure_channel(target) as channel:
            client.forward(np.ones((1, hidden), np.float32), layer=handle.engine.layers[0].index)  # not counted
            before = serving.server_totals(registry)
            for _ in range(3):
                client.forward(np.ones((1, hidden), np.float32), layer=handle.engine.layers[0].index)
            check = health_pb2_grpc.HealthStub(channel).Check
            for _ in range(2):
                check(health_pb2.HealthCheckRequest())
            after = serving.server_totals(registry)
    finally:
        handle.stop(grace=5)

    def calls(key):
        return after[key][1] - before.get(key, (0.0, 0.0))[1]

    assert (calls("Forward"), calls("step"), calls("Check")) == (3, 3, 2)  # one lone call, one step
    forward, check = serving.server_means(before, after, "Forward"), serving.server_means(before, after, "Check")
    assert 0 < forward["server_step_ms_mean"] < forward["server_handling_ms_mean"]
    assert check["server_handling_ms_mean"] > 0 and "server_step_ms_mean" not in check
    assert serving.server_means(after, after, "Forward") == {"server_handling_ms_mean": None,
                                                             "server_step_ms_mean": None}


def test_python_floor_native_echo_answers_each_call_with_its_own_rows():
    """``python_floor.py``'s ``native-echo`` (the native port's transport ceiling) answers each Forward
    with its own rows, calls queued behind a direct batch included, and its Check says SERVING."""
    import concurrent.futures
    import socket
    import subprocess

    from native_front_fixtures import require_native_front

    from expertd.client import codec
    from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc

    require_native_front()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "python_floor.py"), "--serve", "native-echo",
                               str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            forward = expert_pb2_grpc.ExpertServiceStub(channel).Forward

            def call(seed: int) -> bool:
                rows = np.random.default_rng(seed).standard_normal((1 + seed % 3, 64)).astype(np.float32)
                answer = forward(expert_pb2.ForwardRequest(layer=0, hidden_states=codec.encode(rows)), timeout=30)
                return np.array_equal(codec.decode(answer.output), rows)

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                assert all(pool.map(call, range(200)))
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
            assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.kill()
        server.wait(30)


def test_python_floor_cpu_latency_qos_holds_its_request_only_inside_the_block():
    """``--cpu-latency-qos``: reading ``/dev/cpu_dma_latency`` gives the kernel's current target, 0 us
    while the benchmark holds its request and back to what it was after (root and Linux only)."""
    floor = benchmark_module("python_floor")
    try:
        os.close(os.open(floor.CPU_LATENCY_QOS, os.O_WRONLY))
    except OSError as exc:
        pytest.skip(f"{floor.CPU_LATENCY_QOS} cannot be written here: {exc.strerror}")

    def target_us() -> int:
        with open(floor.CPU_LATENCY_QOS, "rb") as current:
            return struct.unpack("i", current.read(4))[0]

    before = target_us()
    with floor.cpu_latency_qos(True):
        assert target_us() == 0
    assert target_us() == before
    with floor.cpu_latency_qos(False):
        assert target_us() == before


def test_python_floor_cpu_latency_qos_names_the_file_it_cannot_open(tmp_path, monkeypatch, capsys):
    floor = benchmark_module("python_floor")
    monkeypatch.setattr(floor, "CPU_LATENCY_QOS", tmp_path / "no-such-device")
    with pytest.raises(OSError, match="no-such-device.*needs Linux and root"), floor.cpu_latency_qos(True):
        pass
    with pytest.raises(SystemExit):
        floor.main(["--servers", "expertd", "--cpu-latency-qos", "ab", "--rounds", "0"])
    assert f"--cpu-latency-qos: cannot open {tmp_path / 'no-such-device'}" in capsys.readouterr().err
