"""TLS, mutual TLS and bearer-token auth on the real server, with a throwaway CA made by openssl; the
metrics endpoint behind TLS and the token; what the start-up log states."""
import dataclasses
import http.client
import ssl
import urllib.error
import urllib.request

import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from service_support import sample, scrape, server_config
from tls_fixtures import make_pki

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
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER, security=security), metrics_tls=True)
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=2)


@pytest.fixture(scope="module")
def locked_metrics_server(tmp_path_factory, pki):
    """TLS and the token on the gRPC port and on /metrics."""
    security = SecurityConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), auth_token=TOKEN)
    config = dataclasses.replace(server_config(tmp_path_factory, model=ONE_LAYER, security=security),
                                 metrics_tls=True, metrics_auth=True)
    handle = create_server(config)
    handle.wait_ready(timeout=300)
    yield handle
    handle.stop(grace=2)


def https_scrape(url: str, pki, *, token: str | None = None, client_certificate: bool = False):
    """(status, body) of GET ``url`` over TLS trusting the test CA; HTTPError statuses are returned too."""
    context = ssl.create_default_context(cafile=str(pki.ca))
    if client_certificate:
        context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


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


def test_start_up_log_states_tls_mtls_auth_and_the_metrics_endpoint(tls_token_server, mtls_server,
                                                                    locked_metrics_server):
    # auth on and no --metrics-host: unauthenticated metrics bound to loopback, and the log says so
    assert tls_token_server.security_summary() == (
        f"security: TLS on, mTLS off, auth on (--auth-token-file); metrics: "
        f"http://127.0.0.1:{tls_token_server.metrics_port}/metrics (TLS off, auth off; loopback only: auth is on "
        f"and --metrics-auth is not, give --metrics-host to change)")
    assert mtls_server.security_summary() == (
        f"security: TLS on, mTLS on, auth off; metrics: https://127.0.0.1:{mtls_server.metrics_port}/metrics "
        f"(TLS on, auth off)")
    assert locked_metrics_server.security_summary() == (
        f"security: TLS on, mTLS off, auth on (--auth-token or $EXPERTD_AUTH_TOKEN); metrics: "
        f"https://127.0.0.1:{locked_metrics_server.metrics_port}/metrics (TLS on, auth on)")


def test_metrics_behind_tls_and_the_token(locked_metrics_server, pki):
    url = locked_metrics_server.metrics_url
    assert url.startswith("https://")
    status, body = https_scrape(url, pki, token=TOKEN)
    assert status == 200 and "expertd_build_info" in body
    for token in (None, "wrong-token"):
        status, body = https_scrape(url, pki, token=token)
        assert status == 401 and "expertd" not in body
    status, body = https_scrape(url.replace("/metrics", "/"), pki, token=TOKEN)
    assert status == 404 and "expertd_build_info" not in body
    with pytest.raises((http.client.HTTPException, ConnectionError)):  # plain HTTP to the TLS port: no metrics
        scrape(locked_metrics_server.metrics_port)
    with pytest.raises(urllib.error.URLError):  # nor a client that does not trust the certificate
        urllib.request.urlopen(url, context=ssl.create_default_context(cafile=str(pki.other_ca)), timeout=10)


def test_metrics_with_mutual_tls_need_a_client_certificate(mtls_server, pki):
    status, body = https_scrape(mtls_server.metrics_url, pki, client_certificate=True)
    assert status == 200 and "expertd_build_info" in body
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
        https_scrape(mtls_server.metrics_url, pki)


def test_expertd_health_probes_a_mutual_tls_server_with_a_client_certificate(mtls_server, pki, capsys):
    """What an exec probe runs in a pod with mutual TLS: `expertd health` with the CA, this client's
    certificate and the name the server's certificate holds."""
    from expertd.client import cli

    base = ["health", "--target", f"127.0.0.1:{mtls_server.port}", "--ca-cert", str(pki.ca), "--service",
            "readiness", "--timeout", "10"]
    client_pair = ["--client-cert", str(pki.client_cert), "--client-key", str(pki.client_key)]
    code = cli.main([*base, *client_pair, "--server-name", "localhost"])
    out, err = capsys.readouterr()
    assert code == cli.EXIT_OK and "SERVING" in out, err
    assert cli.main(base) == cli.EXIT_UNAVAILABLE  # no client certificate: the handshake fails
    assert cli.main([*base, *client_pair, "--server-name", "wrong.example"]) == cli.EXIT_UNAVAILABLE
    capsys.readouterr()
    code = cli.main([*base, "--client-cert", str(pki.client_cert)])
    _, err = capsys.readouterr()
    assert code == cli.EXIT_INVALID_ARGUMENT and "--client-cert and --client-key go together" in err
