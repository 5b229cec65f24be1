"""Shared access to the deploy/ tree for the deploy tests: the kustomizations, their rendered
resources, the pod templates inside the workloads, and the Dockerfile."""
from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import deploy_render
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
DASHBOARD = ROOT / "deploy" / "grafana" / "expertd-dashboard.json"
ADAPTER_RULES = K8S / "overlays" / "autoscaling" / "prometheus-adapter-rules.yaml"


def kustomizations() -> list[str]:
    """Every kustomization directory under deploy/k8s, relative to it (e.g. "overlays/multihost")."""
    return sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))


@cache
def _rendered(name: str) -> tuple:
    return tuple(deploy_render.build(K8S / name))


def rendered(name: str) -> list[dict]:
    """The resources `kustomize build deploy/k8s/<name>` produces (fresh copies)."""
    return copy.deepcopy(list(_rendered(name)))


def by_kind(resources: list[dict], kind: str) -> list[dict]:
    return [r for r in resources if r["kind"] == kind]


def one(resources: list[dict], kind: str) -> dict:
    found = by_kind(resources, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def pod_templates(resources: list[dict]) -> dict[str, dict]:
    """Pod templates of the workloads, keyed "<Kind>/<name>[/leader|/worker]"."""
    templates = {}
    for r in resources:
        key = f"{r['kind']}/{r['metadata']['name']}"
        if r["kind"] in ("Deployment", "StatefulSet"):
            templates[key] = r["spec"]["template"]
        elif r["kind"] == "LeaderWorkerSet":
            lwt = r["spec"]["leaderWorkerTemplate"]
            templates[key + "/leader"] = lwt.get("leaderTemplate", lwt["workerTemplate"])
            templates[key + "/worker"] = lwt["workerTemplate"]
    return templates


def pods(resources: list[dict]) -> list[dict]:
    """The pods the workloads would create, as {"name", "labels", "template"}, with the labels
    their controllers add (StatefulSet ordinal, LeaderWorkerSet indices) merged in."""
    created = []
    for r in resources:
        name, spec = r["metadata"]["name"], r.get("spec", {})
        if r["kind"] == "Deployment":
            for i in range(spec.get("replicas", 1)):
                created.append({"name": f"{name}-{i}", "labels": dict(spec["template"]["metadata"]["labels"]),
                                "template": spec["template"]})
        elif r["kind"] == "StatefulSet":
            for i in range(spec.get("replicas", 1)):
                labels = {**spec["template"]["metadata"]["labels"], "apps.kubernetes.io/pod-index": str(i),
                          "statefulset.kubernetes.io/pod-name": f"{name}-{i}"}
                created.append({"name": f"{name}-{i}", "labels": labels, "template": spec["template"]})
        elif r["kind"] == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            for group in range(spec.get("replicas", 1)):
                for index in range(lwt.get("size", 1)):
                    template = lwt.get("leaderTemplate", lwt["workerTemplate"]) if index == 0 else lwt["workerTemplate"]
                    labels = {**template["metadata"]["labels"], "leaderworkerset.sigs.k8s.io/name": name,
                              "leaderworkerset.sigs.k8s.io/group-index": str(group),
                              "leaderworkerset.sigs.k8s.io/worker-index": str(index)}
                    pod_name = f"{name}-{group}" if index == 0 else f"{name}-{group}-{index}"
                    created.append({"name": pod_name, "labels": labels, "template": template})
    return created


def container(template: dict, name: str = "expertd") -> dict:
    (found,) = [c for c in template["spec"]["containers"] if c["name"] == name]
    return found


def container_ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(template).get("ports", [])}


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in a container's args, or None."""
    for i, arg in enumerate(args):
        if arg == name:
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def probe_target(probe: dict) -> tuple[int, str]:
    """(port, health service) a probe asks: a gRPC probe's, or an exec probe's ``expertd health``
    (``--target host:port``, ``--service``)."""
    if "grpc" in probe:
        assert "exec" not in probe, "a probe has one handler"
        return probe["grpc"]["port"], probe["grpc"]["service"]
    command = probe["exec"]["command"]
    assert command[:2] == ["expertd", "health"], command
    return int(flag(command, "--target").rsplit(":", 1)[1]), flag(command, "--service")


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Service-style selector (plain map) or a LabelSelector matches `labels`."""
    match_labels = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, present = labels.get(expression["key"]), expression["key"] in labels
        ok = {"In": present and value in expression.get("values", []),
              "NotIn": not present or value not in expression.get("values", []),
              "Exists": present, "DoesNotExist": not present}[expression["operator"]]
        if not ok:
            return False
    return True


def dockerfile(build_args: dict | None = None) -> DockerfileParser:
    parser = DockerfileParser(path=str(DOCKERFILE), build_args=build_args or {})
    return parser


# -- Grafana dashboard / PromQL -----------------------------------------------------------------
# Labels Prometheus attaches to every scraped series (target labels), not the server.
TARGET_LABELS = {"job", "instance", "pod", "namespace", "container", "service", "endpoint"}
_METRIC = re.compile(r"\b((?:expertd|grpc_server)_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels() -> list[dict]:
    """Every panel with queries (rows excluded), nested rows flattened."""
    panels = []
    for panel in dashboard()["panels"]:
        panels.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return panels


def promql_metrics(expr: str) -> dict[str, set[str]]:
    """The expertd/grpc_server series an expression reads, each with the labels its selectors match on."""
    found: dict[str, set[str]] = {}
    for name, selector in _METRIC.findall(expr):
        found.setdefault(name, set()).update(_MATCHER.findall(selector or ""))
    return found


def promql_grouping_labels(expr: str) -> set[str]:
    return {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",") if label.strip()}
