"""benchmarks/python_floor.py's ``native`` server: the gRPC C++ front end it measures serves real answers.

The floor benchmark compares expertd with a front end that has no Python handler; its numbers mean
something only if that server does the same job: the engine's own output for every call (batched
calls included, each caller its own rows), the checks that name the field, and a health service.
It needs Debian's libgrpc++-dev and protobuf-compiler-grpc to build; where they are missing the
test is skipped with the builder's reason.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib.util
import os
import pathlib
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from expertd.client import ExpertClient
from expertd.client.errors import InvalidArgumentError, NotFoundError

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLOOR = ROOT / "benchmarks" / "python_floor.py"
START_TIMEOUT_S = 300


@functools.cache
def _floor_module():
    spec = importlib.util.spec_from_file_location("python_floor_benchmark", FLOOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def native_server():
    """(target, the in-process engine, H) of a running ``python_floor.py --serve native``."""
    floor = _floor_module()
    try:
        floor.build_native()
    except floor.NativeUnavailable as exc:
        pytest.skip(f"the native front end cannot be built here: {exc}")
    port = floor._free_port()
    process = subprocess.Popen([sys.executable, str(FLOOR), "--serve", "native", str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    first_line: list[str] = []
    reader = threading.Thread(target=lambda: first_line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(START_TIMEOUT_S)
    try:
        assert first_line and first_line[0].strip() == "ready", "the native server did not start"
        engine, hidden = floor._engine()
        yield f"127.0.0.1:{port}", engine, hidden
    finally:
        process.kill()
        process.wait(30)


def _engine_output(engine, x: np.ndarray) -> np.ndarray:
    return _floor_module().engine_step(engine, [x])


def test_forward_is_the_engines_output(native_server):
    target, engine, hidden = native_server
    rng = np.random.default_rng(0)
    with ExpertClient(target) as client:
        for tokens in (1, 5, 16, 256):
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)
            np.testing.assert_allclose(client.forward(x, layer=0), _engine_output(engine, x), rtol=1e-6, atol=1e-6)


def test_concurrent_calls_each_get_their_own_rows(native_server):
    target, engine, hidden = native_server
    inputs = [np.random.default_rng(i).standard_normal((1 + i % 3, hidden)).astype(np.float32) for i in range(48)]
    with ExpertClient(target) as client, concurrent.futures.ThreadPoolExecutor(16) as pool:
        outputs = list(pool.map(lambda x: client.forward(x, layer=0), inputs))
    for x, y in zip(inputs, outputs, strict=True):
        np.testing.assert_allclose(y, _engine_output(engine, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("x", "layer", "error", "names"), [
    (np.ones((1, 64), np.float32), 3, NotFoundError, "layer"),
    (np.full((2, 64), np.nan, np.float32), 0, InvalidArgumentError, "NaN"),
    (np.ones((257, 64), np.float32), 0, InvalidArgumentError, "hidden_states.shape"),
    (np.ones((2, 63), np.float32), 0, InvalidArgumentError, "hidden_states.shape"),
    (np.ones((2, 64), np.float16), 0, InvalidArgumentError, "hidden_states.dtype"),
])
def test_bad_calls_are_refused_naming_the_field_and_the_server_keeps_serving(native_server, x, layer, error, names):
    target, engine, hidden = native_server
    assert hidden == 64  # the parameters above are written for the tiny layer
    with ExpertClient(target) as client:
        with pytest.raises(error, match=names):
            client.forward(x, layer=layer)
        ok = np.ones((1, hidden), np.float32)
        np.testing.assert_allclose(client.forward(ok, layer=0), _engine_output(engine, ok), rtol=1e-6, atol=1e-6)


def test_health_check_answers_serving(native_server):
    target, _, _ = native_server
    with grpc.insecure_channel(target) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
