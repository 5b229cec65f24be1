"""A port another process listens on: refused at start, before the model loads, with the address
and the flag named (``expertd.server.transport.listen``), through ``create_server`` and ``expertd serve``."""
import dataclasses
import os
import socket
import subprocess
import sys

import pytest
from service_support import held_port, server_config

from expertd.server.app import create_server
from expertd.server.config import ModelConfig
from expertd.server.transport import listen


def _has_ipv6() -> bool:
    try:
        socket.socket(socket.AF_INET6, socket.SOCK_STREAM).close()
        return True
    except OSError:
        return False


def test_a_port_held_by_a_listener_is_named_with_its_flag():
    hosts = ("127.0.0.1", "0.0.0.0") + (("[::]",) if _has_ipv6() else ())
    with held_port() as port:
        for host in hosts:  # the wildcard "[::]" listens dual-stack, as gRPC does
            with pytest.raises(OSError, match=rf"cannot listen on {host.replace('[', '.').replace(']', '.')}:{port} "
                               r"\(--port\): another process is listening there"):
                listen.check_free(host, port, "--port")


def test_free_ports_and_ports_left_by_a_closed_listener_pass(monkeypatch):
    listen.check_free("127.0.0.1", 0, "--port")  # 0: the system picks one
    with held_port() as port:
        pass
    listen.check_free("127.0.0.1", port, "--port")  # closed (TIME_WAIT or free): the real bind may take it
    listen.check_free("no-such-host.invalid", 8001, "--port")  # left to the real bind, which names it

    def no_such_family(*args, **kwargs):
        raise OSError(97, "Address family not supported by protocol")

    monkeypatch.setattr(listen.socket, "socket", no_such_family)  # a host without IPv6, say
    listen.check_free("[::]", port, "--port")  # left to the real bind (gRPC falls back to IPv4)


def test_create_server_refuses_a_taken_grpc_port_before_building_the_model(tmp_path_factory):
    missing = ModelConfig(checkpoint=str(tmp_path_factory.mktemp("none") / "absent"), dtype="float32",
                          num_devices=1)  # building it would fail with ValueError: the port is checked first
    with held_port() as port:
        config = dataclasses.replace(server_config(tmp_path_factory, model=missing), port=port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(--port\\)"):
            create_server(config)


def test_create_server_refuses_a_taken_metrics_port(tmp_path_factory):
    with held_port() as port:
        config = dataclasses.replace(server_config(tmp_path_factory), metrics_port=port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} \\(--metrics-port\\)"):
            create_server(config)


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_serve_says_which_port_is_taken_in_one_line_and_exits_1(tmp_path_factory, flag):
    with held_port() as port:
        ports = {"--port": "0", "--metrics-port": "0", flag: str(port)}
        command = [sys.executable, "-m", "expertd.server.cli", "serve", "--host", "127.0.0.1",
                   "--port", ports["--port"], "--metrics-port", ports["--metrics-port"], "--preset", "tiny",
                   "--num-layers", "1", "--dtype", "float32", "--num-devices", "1"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert f"error: cannot listen on 127.0.0.1:{port} ({flag}): another process is listening there" in output
    assert "Traceback" not in output and "ready:" not in output
