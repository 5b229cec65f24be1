"""TLS, mutual TLS and bearer-token auth on the real server, with a throwaway CA made by openssl."""
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from service_support import make_pki, sample, scrape, server_config

from expertd.client import ExpertClient, TlsOptions, UnauthenticatedError, UnavailableError
from expertd.server.app import create_server
from expertd.server.config import ModelConfig, SecurityConfig

TOKEN = "s3cret-token"
ONE_LAYER = ModelConfig(preset="tiny", num_layers=1, dtype="float32", num_devices=1)
X = np.ones((2, 64), np.float32)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_token_server(tmp_path_factory, pki):
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    security = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key),
                              auth_token_file=str(token_file))
    handle = create_server(server_config(tmp_path_factory, model=ONE_LAYER, security=security))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=2)


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, pki):
    security = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(pki.ca))
    handle = create_server(server_config(tmp_path_factory, model=ONE_LAYER, security=security))
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=2)


def test_tls_with_the_right_ca_and_token_is_served(tls_token_server, pki):
    tls = TlsOptions(root_certificates=pki.ca, server_name="localhost")
    with ExpertClient(f"127.0.0.1:{tls_token_server.port}", tls=tls, token=TOKEN, retries=0) as client:
        assert client.forward(X, layer=0).shape == (2, 64)
        assert client.route(X, layer=0).topk_ids.shape == (2, 2)


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_missing_or_wrong_token_is_unauthenticated_but_health_stays_open(tls_token_server, pki, token):
    tls = TlsOptions(root_certificates=pki.ca)
    before = sample(scrape(tls_token_server.metrics_port), "grpc_server_handled_total", grpc_type="unary",
                    grpc_service="expertd.v1.ExpertService", grpc_method="Forward", grpc_code="UNAUTHENTICATED")
    with ExpertClient(f"127.0.0.1:{tls_token_server.port}", tls=tls, token=token, retries=0) as client:
        with pytest.raises(UnauthenticatedError, match="bearer token"):
            client.forward(X, layer=0)
        with pytest.raises(UnauthenticatedError):
            client.model_info()
        assert client.health("readiness") == health_pb2.HealthCheckResponse.SERVING
    after = sample(scrape(tls_token_server.metrics_port), "grpc_server_handled_total", grpc_type="unary",
                   grpc_service="expertd.v1.ExpertService", grpc_method="Forward", grpc_code="UNAUTHENTICATED")
    assert after == before + 1


def test_tls_server_refuses_plaintext_and_unknown_ca(tls_token_server, pki):
    with ExpertClient(f"127.0.0.1:{tls_token_server.port}", token=TOKEN, retries=0, timeout=5) as plain:
        with pytest.raises(UnavailableError):
            plain.forward(X, layer=0)
    tls = TlsOptions(root_certificates=pki.other_ca)
    with ExpertClient(f"127.0.0.1:{tls_token_server.port}", tls=tls, token=TOKEN, retries=0, timeout=5) as wrong_ca:
        with pytest.raises(UnavailableError):
            wrong_ca.forward(X, layer=0)


def test_mutual_tls_needs_a_client_certificate_signed_by_the_client_ca(mtls_server, pki):
    target = f"127.0.0.1:{mtls_server.port}"
    with ExpertClient(target, tls=TlsOptions(root_certificates=pki.ca), retries=0, timeout=5) as anonymous:
        with pytest.raises(UnavailableError):
            anonymous.forward(X, layer=0)
    tls = TlsOptions(root_certificates=pki.ca, client_certificate=pki.client_cert, client_key=pki.client_key)
    with ExpertClient(target, tls=tls, retries=0) as client:
        assert client.forward(X, layer=0).shape == (2, 64)


def test_client_certificate_needs_its_key():
    with pytest.raises(ValueError, match="together"):
        ExpertClient("127.0.0.1:1", tls=TlsOptions(client_certificate=b"cert"))
