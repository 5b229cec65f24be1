"""A multi-host process at start: what `expertd serve` refuses in one line before it joins the group
(a taken port, a checkpoint it does not serve), and a follower's listeners under the security
settings (health over TLS, metrics at --metrics-host behind TLS and the token), as the leader's.

The followers here are built in this process (`FollowerServer`, one CPU device, no group joined):
their listeners are what is tested; the group itself is tests/server/multihost/test_multihost_processes.py's.
"""
import dataclasses
import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_support import held_port, server_config
from tls_fixtures import make_pki

from expertd.server.config import ModelConfig, SecurityConfig
from expertd.server.multihost.follower import FollowerServer

TOKEN = "s3cret-token"
ONE_LAYER = ModelConfig(preset="tiny", num_layers=1, dtype="float32", num_devices=1)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve_in_group(process_id: int, *flags: str, model=("--preset", "tiny", "--num-layers", "1"),
                    timeout: float = 120) -> subprocess.CompletedProcess:
    """`expertd serve` as process ``process_id`` of a two-process group whose other process never
    comes: what it refuses, it must refuse before joining (else it would wait for the group)."""
    command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1", *model,
               "--dtype", "float32", "--coordinator-address", f"127.0.0.1:{_free_port()}",
               "--num-processes", "2", "--process-id", str(process_id), "--join-timeout-s", "300", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("process_id, flag", [(0, "--port"), (0, "--metrics-port"), (0, "--multihost-port"),
                                              (1, "--port"), (1, "--metrics-port")])
def test_a_taken_port_is_refused_in_one_line_before_joining_the_group(process_id, flag):
    with held_port() as port:
        ports = {"--port": "0", "--metrics-port": "0", "--multihost-port": str(_free_port()), flag: str(port)}
        done = _serve_in_group(process_id, *(item for pair in ports.items() for item in pair))
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"error: cannot listen on 127.0.0.1:{port} ({flag}): another process is listening there" in output
    assert "Traceback" not in output and "joined" not in output


def test_a_checkpoint_expertd_does_not_serve_is_refused_before_joining_the_group(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_moe", "architectures": ["NoSuchMoe"]}))
    done = _serve_in_group(1, "--port", "0", "--metrics-port", "0", model=("--checkpoint", str(tmp_path)))
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "error:" in output and "no_such_moe" in output
    assert "Traceback" not in output and "joined" not in output


def test_a_follower_refuses_a_taken_port_before_loading_its_model(tmp_path_factory):
    missing = ModelConfig(checkpoint=str(tmp_path_factory.mktemp("none") / "absent"), dtype="float32",
                          num_devices=1)  # building it would fail with ValueError: the ports are checked first
    for field, flag in (("port", "--port"), ("metrics_port", "--metrics-port")):
        with held_port() as port:
            config = dataclasses.replace(server_config(tmp_path_factory, model=missing), **{field: port})
            with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\({flag}\\)"):
                FollowerServer(config)


def _https(url: str, pki, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=ssl.create_default_context(cafile=str(pki.ca)),
                                    timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def test_a_followers_health_and_metrics_are_behind_tls_and_the_token(tmp_path_factory, pki):
    security = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), auth_token=TOKEN)
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER, security=security),
                                 metrics_tls=True, metrics_auth=True)
    follower = FollowerServer(config)
    try:
        assert follower.tls and follower.metrics_url == f"https://127.0.0.1:{follower.metrics_port}/metrics"
        assert follower.security == ("security: TLS on, mTLS off, auth on (--auth-token or $EXPERTD_AUTH_TOKEN); "
                                     f"metrics: {follower.metrics_url} (TLS on, auth on)")
        assert _https(follower.metrics_url, pki, TOKEN) == 200
        assert _https(follower.metrics_url, pki) == 401
        assert _https(follower.metrics_url, pki, "wrong-token") == 401
        credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{follower.port}", credentials,
                                 options=[("grpc.ssl_target_name_override", "localhost")]) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            assert check(health_pb2.HealthCheckRequest(service="liveness"), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(f"127.0.0.1:{follower.port}") as plain:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        follower.stop()


def test_a_follower_with_auth_keeps_unauthenticated_metrics_on_loopback(tmp_path_factory):
    security = SecurityConfig(auth_token=TOKEN)
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER, security=security), host="0.0.0.0")
    follower = FollowerServer(config)
    try:
        assert not follower.tls
        assert follower.metrics_url == f"http://127.0.0.1:{follower.metrics_port}/metrics"
        assert follower.security.endswith("(TLS off, auth off; loopback only: auth is on and --metrics-auth is not, "
                                          "give --metrics-host to change)")
        with urllib.request.urlopen(follower.metrics_url, timeout=10) as reply:
            assert "expertd_model_ready 0.0" in reply.read().decode()
    finally:
        follower.stop()
