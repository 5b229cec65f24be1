"""Bodies the server must not read (issue 53, item 2), against a real ``expertd serve`` process
with a bearer token and the native port on, called over raw HTTP/2 (``http2_bodies``): a gRPC
prefix declaring 1 GiB, then zeros as fast as the server's windows let them through.

- Without the token, a call on either port is refused UNAUTHENTICATED from its headers: the server
  lets the caller send no more than the stream's first window, whatever the body declares.
  The native port answers a method it does not serve the same way (UNIMPLEMENTED, body unread).
- With the token, gRPC core reads a message to its declared length before any check can see it, on
  either port (no public hook of gRPC sees the prefix): docs/overload.md says so; not tested here.
"""
from __future__ import annotations

import re

import grpc
import pytest
from http2_bodies import send_declared
from native_front_fixtures import require_native_front
from service_support import serve_process

TOKEN = "bodies-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
DECLARED = 1 << 30
WINDOWS_BEFORE_REFUSAL = 8 << 20
"""The most a caller may send before the refusal reaches it: what gRPC's flow control granted by then
(64 KiB to 2 MiB here, on either port: the windows grow with gRPC's bandwidth estimate), never the
declared body (a body that is read gets window for all of its declared length)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_native_front()
    with serve_process(tmp_path_factory, "--native-port", "0", env={"EXPERTD_AUTH_TOKEN": TOKEN}) as handle:
        handle.native_port = int(re.search(r"native Forward port (\d+)", handle.log.read_text()).group(1))
        yield handle


def port_of(server, which: str) -> int:
    return server.native_port if which == "native" else int(server.target.rsplit(":", 1)[1])


@pytest.mark.parametrize("which", ["main", "native"])
@pytest.mark.parametrize("method", ["Forward", "GetModelInfo"])
def test_an_unauthenticated_body_is_refused_from_its_headers(server, which, method):
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        outcome = send_declared(port_of(server, which), f"/expertd.v1.ExpertService/{method}", DECLARED,
                                metadata=metadata, timeout_s=30)
        assert outcome.code == grpc.StatusCode.UNAUTHENTICATED.value[0], outcome
        assert "bearer token" in outcome.message
        assert outcome.sent <= WINDOWS_BEFORE_REFUSAL, f"the server let {outcome.sent} bytes in first"


def test_the_native_port_refuses_a_method_it_does_not_serve_unread(server):
    outcome = send_declared(server.native_port, "/expertd.v1.ExpertService/Route", DECLARED, metadata=AUTH)
    assert outcome.code == grpc.StatusCode.UNIMPLEMENTED.value[0], outcome
    assert outcome.sent <= WINDOWS_BEFORE_REFUSAL
