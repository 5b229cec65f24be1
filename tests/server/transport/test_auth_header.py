"""The bearer token as the server reads it (issue 27, item 11): the ``Bearer`` scheme in any case
(RFC 7235), the token itself exact; a blank or unsendable token is refused at start."""
import grpc
import pytest
from service_support import server_config

from expertd.client.pb.v1 import expert_pb2, expert_pb2_grpc
from expertd.server.app import create_server
from expertd.server.config import ModelConfig, SecurityConfig
from expertd.server.transport.auth import authorized, parse_token

TOKEN = "s3cret-token"
ONE_LAYER = ModelConfig(preset="tiny", num_layers=1, dtype="float32", num_devices=1)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    handle = create_server(server_config(tmp_path_factory, model=ONE_LAYER, security=SecurityConfig(auth_token=TOKEN)))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=2)


@pytest.mark.parametrize("header, accepted", [
    (f"Bearer {TOKEN}", True),
    (f"bearer {TOKEN}", True),  # the scheme is case-insensitive
    (f"BEARER   {TOKEN}", True),
    (f"Basic {TOKEN}", False),
    (f"Bearer {TOKEN.upper()}", False),  # the token is not
    (f"Bearer {TOKEN}x", False),
    (f"Bearer{TOKEN}", False),
    ("Bearer ", False),
])
def test_the_bearer_scheme_is_case_insensitive_and_the_token_exact(token_server, header, accepted):
    with grpc.insecure_channel(f"127.0.0.1:{token_server.port}") as channel:
        call = expert_pb2_grpc.ExpertServiceStub(channel).GetModelInfo
        if accepted:
            assert call(expert_pb2.GetModelInfoRequest(), timeout=10, metadata=(("authorization", header),)).layers
        else:
            with pytest.raises(grpc.RpcError) as info:
                call(expert_pb2.GetModelInfoRequest(), timeout=10, metadata=(("authorization", header),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("token", ["", "   ", "\t", " padded", "padded\n", "t\u00f6ken"])
def test_a_blank_or_unsendable_token_is_refused_at_start(tmp_path_factory, token):
    with pytest.raises(ValueError, match="auth token"):
        parse_token(token)
    if token.strip() == "":
        with pytest.raises(ValueError, match=r"auth.token.*empty"):  # refused at start, by whichever check is first
            create_server(server_config(tmp_path_factory, model=ONE_LAYER, security=SecurityConfig(auth_token=token)))
    assert authorized((("authorization", "Bearer x"),), parse_token("x"))
