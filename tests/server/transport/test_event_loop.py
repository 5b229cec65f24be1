"""The gRPC server's event loop (``--event-loop``, ``expertd.server.transport.event_loop``): uvloop by default
where it is installed (as in this project's environment), the standard library's loop on request,
a clear error when uvloop is asked for and missing; a server serves and drains on either."""
import dataclasses
import sys

import numpy as np
import pytest
from service_support import host_params, reference_forward, server_config

from expertd.client import ExpertClient
from expertd.server.app import create_server
from expertd.server.config import ServerConfig
from expertd.server.transport.event_loop import loop_factory


def test_auto_picks_uvloop_where_installed_and_asyncio_on_request():
    import uvloop  # a dependency of expertd on Linux and macOS

    factory, description = loop_factory("auto")
    assert description == f"uvloop {uvloop.__version__}" and factory is uvloop.new_event_loop
    assert loop_factory("uvloop")[1] == description
    assert loop_factory("asyncio")[1] == "asyncio"


def test_a_missing_uvloop_is_named_when_asked_for_and_auto_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: importing it fails
    with pytest.raises(ValueError, match="--event-loop uvloop: uvloop is not installed"):
        loop_factory("uvloop")
    assert loop_factory("auto")[1] == "asyncio"


def test_an_unknown_loop_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--event-loop must be one of auto, uvloop, asyncio, got 'tokio'"):
        ServerConfig(event_loop="tokio")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_server_serves_and_drains_on_either_loop(tmp_path_factory, loop):
    handle = create_server(dataclasses.replace(server_config(tmp_path_factory), event_loop=loop))
    try:
        handle.wait_ready(timeout=300)
        assert handle.event_loop.split()[0] == loop
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
            want, _ = reference_forward(host_params(handle.engine.layers[0], np.float32), handle.engine.layers[0].cfg,
                                        x, np.float32)
            np.testing.assert_allclose(client.forward(x, layer=0), want, rtol=1e-5, atol=1e-5)
    finally:
        handle.stop(grace=5)
    assert handle.wait(0)  # drained and stopped within the grace
