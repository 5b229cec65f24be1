"""The deploy/ tree against what the server really exposes.

A real server (`create_server`, configured from the ConfigMap's own config.toml with small-model
flags on top) runs on loopback; the probes' health service names are asked over gRPC, the
Dockerfile's HEALTHCHECK command is run against it, and its metrics endpoint is scraped at the
ServiceMonitor's path: every series and label that the Grafana dashboard, the autoscaler and the
prometheus-adapter rule read must be there. The container args of every manifest and the image's
CMD must parse as `expertd serve` flags, and the ports they name must be the server's.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import ssl
import urllib.request

import grpc
import numpy as np
import pytest
import yaml
from deploy_manifests import (
    ADAPTER_RULES,
    K8S,
    TARGET_LABELS,
    by_kind,
    container,
    container_ports,
    dashboard_panels,
    dockerfile,
    flag,
    one,
    pod_templates,
    promql_grouping_labels,
    promql_metrics,
    rendered,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from native_front_fixtures import native_front_available
from prometheus_client.parser import text_string_to_metric_families
from tls_fixtures import make_pki

from expertd.client import ExpertClient, TlsOptions, UnauthenticatedError
from expertd.server import cli as server_cli
from expertd.server import config as config_module
from expertd.server.app import create_server

LWS_ENV = {"LWS_LEADER_ADDRESS": "expertd-0.expertd.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
POD_ENV = {"POD_INDEX": "1"}
SMALL_MODEL = ["--preset", "tiny", "--num-layers", "1", "--dtype", "float32", "--num-devices", "1",
               "--bucket-sizes", "1,8"]


def serve_parser() -> argparse.ArgumentParser:
    """The flags `expertd serve` accepts (server/cli.py builds the same parser)."""
    parser = argparse.ArgumentParser(prog="expertd serve", exit_on_error=False)
    config_module.add_arguments(parser)
    return parser


def parse_serve(argv: list[str], environ: dict[str, str]):
    """(ServerConfig, its MultihostConfig) for a container's args, $(VAR) expanded as the kubelet does,
    with the container's environment."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: environ[m.group(1)], arg) for arg in argv]
    config = config_module.from_args(serve_parser().parse_args(argv), environ=environ)
    return config, config.multihost


def configmap_file(name: str = "base") -> str:
    (config_map,) = by_kind(rendered(name), "ConfigMap")
    return config_map["data"]["config.toml"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config_path = tmp_path_factory.mktemp("deploy") / "config.toml"
    config_path.write_text(configmap_file())
    cache = tmp_path_factory.getbasetemp() / "expertd-jax-cache"  # shared with the service tests
    native = ["--native-port", "0"] if native_front_available() else []  # the dashboard's native panels read it
    config, _ = parse_serve(["--config", str(config_path), *SMALL_MODEL, "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", "0", "--compile-cache-dir", str(cache), *native], {})
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=180)
        with ExpertClient(f"127.0.0.1:{handle.port}", timeout=60) as client:
            x = np.random.default_rng(0).standard_normal((5, client.model_info().layers[0].hidden_size),
                                                        dtype=np.float32)
            client.forward(x, layer=0)
            client.route(x, layer=0)
        if handle.native_port:
            with ExpertClient(f"127.0.0.1:{handle.native_port}", timeout=60) as client:
                client.forward(x, layer=0)
        yield handle
    finally:
        handle.stop(grace=1)


def test_container_args_are_expertd_serve_flags(tmp_path):
    """Each workload's args, with its ConfigMap's config.toml, parse as `expertd serve` flags."""
    defaults = config_module.ServerConfig()
    for name in ("base", "overlays/replicas", "overlays/multihost", "overlays/multihost-statefulset",
                 "overlays/native-port"):
        (tmp_path / "config.toml").write_text(configmap_file(name))
        for key, template in pod_templates(rendered(name)).items():
            main = container(template)
            args = [str(tmp_path / "config.toml") if a == flag(main["args"], "--config") else a for a in main["args"]]
            environ = {**(LWS_ENV if "LeaderWorkerSet" in key else {}), **POD_ENV,
                       **{e["name"]: e["value"] for e in main.get("env", []) if "value" in e}}
            config, group = parse_serve(args, environ)
            ports = container_ports(template)
            assert (config.port, config.metrics_port) == (ports["grpc"], ports["metrics"]) == \
                (defaults.port, defaults.metrics_port), key
            assert config.native_port == ports.get("grpc-native"), key  # the native port: declared where served
            assert config.drain_grace_s + 15 <= template["spec"]["terminationGracePeriodSeconds"], key
            if not name.startswith("overlays/multihost"):
                assert not group.enabled, key
                continue
            assert group.enabled and group.process_id == 1 and group.num_processes == 2, key
            assert int(group.coordinator_address.rsplit(":", 1)[1]) == ports["coordinator"], key
            assert group.channel_port == ports["batches"], key
    (command,) = [i for i in dockerfile().structure if i["instruction"] == "CMD"]
    config, group = parse_serve(json.loads(command["value"]), {})
    assert (config.port, config.metrics_port) == (defaults.port, defaults.metrics_port) and not group.enabled
    assert config.compile_cache_dir == "/var/cache/expertd/jax"


def test_probe_service_names_are_served(server):
    services = {probe["grpc"]["service"] for name in ("base", "overlays/multihost", "overlays/multihost-statefulset")
                for template in pod_templates(rendered(name)).values()
                for probe in (container(template)[k] for k in ("startupProbe", "readinessProbe", "livenessProbe"))}
    assert services == {"liveness", "readiness"}
    ports = {probe["grpc"]["port"] for t in pod_templates(rendered("base")).values()
             for probe in (container(t)[k] for k in ("readinessProbe", "livenessProbe"))}
    assert ports == {config_module.ServerConfig().port}
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in services:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="no-such-service"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_image_healthcheck_command_passes_against_the_server(server, capsys):
    (healthcheck,) = [i for i in dockerfile().structure if i["instruction"] == "HEALTHCHECK"]
    argv = json.loads(healthcheck["value"].partition("CMD")[2])
    assert argv[0] == "expertd"
    target = f"127.0.0.1:{server.port}"
    argv = [target if a == f"127.0.0.1:{config_module.ServerConfig().port}" else a for a in argv[1:]]
    assert target in argv
    assert server_cli.main(argv) == 0
    wrong = [("no-such-service" if a == "liveness" else a) for a in argv]
    assert server_cli.main(wrong) != 0
    capsys.readouterr()


def scrape(server) -> dict[str, set[str]]:
    """Sample name -> label names, from the ServiceMonitor's path on the metrics port; names of
    families without samples yet get their label names from the registered collectors."""
    (endpoint,) = one(rendered("base"), "ServiceMonitor")["spec"]["endpoints"]
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{endpoint['path']}", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    declared = {c._name: set(c._labelnames) for c in vars(server.metrics).values() if hasattr(c, "_labelnames")}
    declared.update({f.name: set(f._labelnames) for f in server.metrics.statistics.describe()})  # a collector's
    series: dict[str, set[str]] = {}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, [""]):
            name = family.name + suffix
            series[name] = set(declared.get(family.name, set())) | ({"le"} if suffix == "_bucket" else set())
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_metrics_read_by_dashboard_and_autoscaler_are_exported(server):
    series = scrape(server)
    exprs = [t["expr"] for panel in dashboard_panels() for t in panel["targets"]]
    board = json.loads((K8S.parents[0] / "grafana" / "expertd-dashboard.json").read_text())
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    hpa = one(rendered("overlays/autoscaling"), "HorizontalPodAutoscaler")
    hpa_metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    exprs.append(hpa_metric)
    for rule in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["custom"]:
        exprs += [rule["seriesQuery"], rule["name"]["matches"].strip("^$")]
    assert len(exprs) > 20
    for expr in exprs:
        read = promql_metrics(expr)
        assert read, expr
        if not server.native_port and any(name.startswith("expertd_native_") for name in read):
            continue  # the native port cannot be built here (native_front_fixtures): its series are not exported
        for name, labels in read.items():
            assert name in series, f"{name} (in {expr!r}) is not exported; exported: {sorted(series)}"
            assert labels - TARGET_LABELS <= series[name], f"{name} has no label(s) {labels - series[name]}"
        available = set().union(*(series[name] for name in read)) | TARGET_LABELS
        assert promql_grouping_labels(expr) <= available, expr
    assert series["expertd_pending_requests"] == set(), "the autoscaling gauge is one series per pod"


# -- overlays/tls: the same checks through TLS and the token ----------------------------------------
TLS_OVERLAY = "overlays/tls"
TLS_TOKEN = "overlay-test-token"


@pytest.fixture(scope="module")
def tls_overlay(tmp_path_factory):
    """(server, the overlay's pod template, Secret name -> {key: local file}, mounted path -> local
    path, the Pki): a real server started from overlays/tls's container args, the Secrets' files
    made here (a server certificate naming `expertd`, as the overlay asks)."""
    directory = tmp_path_factory.mktemp("tls-overlay")
    pki = make_pki(directory, server_names=("expertd",))
    (directory / "token").write_text(TLS_TOKEN + "\n")
    secrets = {"expertd-tls": {"tls.crt": pki.server_cert, "tls.key": pki.server_key, "ca.crt": pki.ca},
               "expertd-auth": {"token": directory / "token"}}
    (template,) = pod_templates(rendered(TLS_OVERLAY)).values()
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]]["secret"]["secretName"] for m in container(template)["volumeMounts"]
               if "secret" in volumes[m["name"]]}

    def local(arg: str) -> str:
        """A path inside a mounted Secret -> the file made here (KeyError: a key the Secret lacks)."""
        for mount_path, secret in mounted.items():
            if arg.startswith(mount_path + "/"):
                return str(secrets[secret][arg.removeprefix(mount_path + "/")])
        return arg

    (directory / "config.toml").write_text(configmap_file(TLS_OVERLAY))
    args = [str(directory / "config.toml") if a == flag(container(template)["args"], "--config") else local(a)
            for a in container(template)["args"]]
    cache = tmp_path_factory.getbasetemp() / "expertd-jax-cache"  # shared with the service tests
    config, _ = parse_serve([*args, *SMALL_MODEL, "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                             "--compile-cache-dir", str(cache)], {})
    assert config.security.tls_cert and config.security.token() == TLS_TOKEN
    assert config.metrics_tls and config.metrics_auth
    handle = create_server(config)
    try:
        handle.wait_ready(timeout=180)
        yield handle, template, secrets, local, pki
    finally:
        handle.stop(grace=1)


def test_tls_overlay_probes_pass_against_the_server(tls_overlay, capsys):
    server, template, _, local, pki = tls_overlay
    grpc_port = container_ports(template)["grpc"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = [local(a).replace(f"localhost:{grpc_port}", f"localhost:{server.port}")
                   for a in container(template)[kind]["exec"]["command"]]
        assert f"localhost:{server.port}" in command, kind
        assert server_cli.main(command[1:]) == 0, kind
        # the probe really verifies: another CA, or a name the certificate does not hold, fails
        other_ca = [str(pki.other_ca) if a == str(pki.ca) else a for a in command]
        assert server_cli.main(other_ca[1:]) != 0, kind
        assert server_cli.main([("elsewhere" if a == "expertd" else a) for a in command[1:]]) != 0, kind
    capsys.readouterr()


def test_tls_overlay_servicemonitor_scrapes_with_its_tls_settings_and_token(tls_overlay):
    server, _, secrets, _, _ = tls_overlay
    (endpoint,) = one(rendered(TLS_OVERLAY), "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    ca = endpoint["tlsConfig"]["ca"]["secret"]
    credentials = endpoint["authorization"]["credentials"]
    context = ssl.create_default_context(cafile=str(secrets[ca["name"]][ca["key"]]))
    token = secrets[credentials["name"]][credentials["key"]].read_text().strip()

    def scrape_status(authorization: str | None) -> tuple[int, str]:
        with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10) as raw, \
                context.wrap_socket(raw, server_hostname=endpoint["tlsConfig"]["serverName"]) as tls:
            head = f"GET {endpoint['path']} HTTP/1.1\r\nHost: expertd\r\nConnection: close\r\n"
            tls.sendall((head + (f"Authorization: {authorization}\r\n" if authorization else "") + "\r\n").encode())
            reply = b"".join(iter(lambda: tls.recv(65536), b"")).decode()
        return int(reply.split(" ", 2)[1]), reply

    status, reply = scrape_status(f"{endpoint['authorization']['type']} {token}")
    assert status == 200 and "expertd_pending_requests" in reply
    assert scrape_status(None)[0] == 401


def test_tls_overlay_serves_clients_with_the_ca_and_the_token(tls_overlay):
    server, _, secrets, _, _ = tls_overlay
    tls = TlsOptions(root_certificates=secrets["expertd-tls"]["ca.crt"], server_name="expertd")
    x = np.ones((2, 64), np.float32)
    with ExpertClient(f"127.0.0.1:{server.port}", tls=tls, token=TLS_TOKEN, timeout=60) as client:
        assert client.forward(x, layer=0).shape == (2, 64)
    with ExpertClient(f"127.0.0.1:{server.port}", tls=tls, timeout=60) as client, \
            pytest.raises(UnauthenticatedError):
        client.forward(x, layer=0)
