"""deploy/k8s: every kustomization renders, validates offline against the Kubernetes schemas and
the CRD schemas kept in the repo, and is wired together consistently (selectors find their pods,
named ports exist, probes, GPUs, shared memory, security, multi-host wiring).

What the running server really exposes (ports, health service names, metric names) is checked
against these manifests in test_live_server.py."""
from __future__ import annotations

import copy
import shutil
import subprocess
import tomllib

import deploy_render
import deploy_schemas
import jsonschema
import kubernetes_validate
import pytest
import yaml
from deploy_manifests import (
    ADAPTER_RULES,
    K8S,
    ROOT,
    by_kind,
    container,
    container_ports,
    dockerfile,
    flag,
    kustomizations,
    one,
    pod_templates,
    pods,
    probe_target,
    rendered,
    selects,
)

from expertd.client.channel import resolve_target

VARIANTS = {
    "base": {"Deployment"},
    "overlays/multihost": {"LeaderWorkerSet", "PodMonitor"},
    "overlays/multihost-statefulset": {"StatefulSet", "PodMonitor"},
    "overlays/native-port": {"Deployment"},
    "overlays/autoscaling": {"Deployment", "HorizontalPodAutoscaler"},
    "overlays/multihost-autoscaling": {"LeaderWorkerSet", "PodMonitor", "HorizontalPodAutoscaler"},
    "overlays/replicas": {"Deployment"},
    "overlays/tls": {"Deployment"},
}
COMMON_KINDS = {"ConfigMap", "Service", "ServiceMonitor", "PodDisruptionBudget"}


def test_the_known_kustomizations_are_all_there_are():
    assert kustomizations() == sorted(VARIANTS)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_renders_and_validates(name):
    resources = rendered(name)
    kinds = {r["kind"] for r in resources}
    assert kinds >= COMMON_KINDS | VARIANTS[name], f"{name}: missing {COMMON_KINDS | VARIANTS[name] - kinds}"
    workload_kinds = {"Deployment", "StatefulSet", "LeaderWorkerSet"}
    assert len([r for r in resources if r["kind"] in workload_kinds]) == 1, "exactly one workload per variant"
    for resource in resources:
        deploy_schemas.validate(resource)


def test_validation_catches_mistakes():
    """The validators are not vacuous: typical mistakes in each kind are rejected."""
    deployment = one(rendered("base"), "Deployment")
    typo = copy.deepcopy(deployment)
    container(typo["spec"]["template"])["readinesProbe"] = {"grpc": {"port": 8001}}
    named_port = copy.deepcopy(deployment)
    container(named_port["spec"]["template"])["readinessProbe"]["grpc"]["port"] = "grpc"
    for bad in (typo, named_port):
        with pytest.raises(kubernetes_validate.ValidationError):
            deploy_schemas.validate(bad)

    lws = one(rendered("overlays/multihost"), "LeaderWorkerSet")
    bad_policy = copy.deepcopy(lws)
    bad_policy["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnFailure"
    bad_template = copy.deepcopy(lws)
    container(bad_template["spec"]["leaderWorkerTemplate"]["workerTemplate"])["imagePullPolicy"] = 3
    bad_monitor = copy.deepcopy(one(rendered("base"), "ServiceMonitor"))
    bad_monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    for bad in (bad_policy, bad_template, bad_monitor):
        with pytest.raises(jsonschema.ValidationError):
            deploy_schemas.validate(bad)


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: prod-\n")
    with pytest.raises(deploy_render.UnsupportedKustomization, match="namePrefix"):
        deploy_render.build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [s.yaml]\npatches:\n- patch: |\n"
        "    {apiVersion: v1, kind: Service, metadata: {name: s}, spec: {externalIPs: []}}\n")
    (tmp_path / "s.yaml").write_text("{apiVersion: v1, kind: Service, metadata: {name: s}, spec: {}}\n")
    with pytest.raises(deploy_render.UnsupportedKustomization, match="list"):
        deploy_render.build(tmp_path)


def test_renderer_merges_pod_spec_lists_as_kustomize_does(tmp_path):
    """kustomize 5.5 (kubectl 1.32) on this patch gives volumes d, b (merged), e, a, c and the args replaced."""
    (tmp_path / "kustomization.yaml").write_text("resources: [d.yaml]\npatches:\n- path: p.yaml\n")
    head = "{apiVersion: apps/v1, kind: Deployment, metadata: {name: x}, spec: {template: {spec: "
    (tmp_path / "d.yaml").write_text(
        head + "{containers: [{name: m, image: i, args: [a, b]}], volumes: [{name: a, emptyDir: {}}, "
        "{name: b, emptyDir: {}}, {name: c, emptyDir: {}}]}}}}\n")
    (tmp_path / "p.yaml").write_text(
        head + "{containers: [{name: m, args: [c]}], volumes: [{name: d, emptyDir: {}}, "
        "{name: b, emptyDir: {medium: Memory}}, {name: e, emptyDir: {}}]}}}}\n")
    (deployment,) = deploy_render.build(tmp_path)
    spec = deployment["spec"]["template"]["spec"]
    assert [(v["name"], v["emptyDir"]) for v in spec["volumes"]] == [
        ("d", {}), ("b", {"medium": "Memory"}), ("e", {}), ("a", {}), ("c", {})]
    assert spec["containers"] == [{"name": "m", "image": "i", "args": ["c"]}]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl (with built-in kustomize) on PATH")
def test_renderer_matches_kubectl_kustomize():
    for name in VARIANTS:
        out = subprocess.run(["kubectl", "kustomize", str(K8S / name)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        theirs = {deploy_render.resource_id(r): r for r in yaml.safe_load_all(out) if r}
        ours = {deploy_render.resource_id(r): r for r in rendered(name)}
        assert ours == theirs, name


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_pod_templates(name):
    resources = rendered(name)
    config_maps = {c["metadata"]["name"]: c for c in by_kind(resources, "ConfigMap")}
    uid = int(dockerfile().args["EXPERTD_UID"])
    images = set()
    for key, template in pod_templates(resources).items():
        spec, main = template["spec"], container(template)
        images.add(main["image"])
        ports = container_ports(template)
        assert {"grpc", "metrics"} <= set(ports), key
        # Probes (gRPC, or exec `expertd health` where the port speaks TLS) on the gRPC port, on the
        # health service names.
        probes = {kind: main[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
        assert {k: probe_target(p) for k, p in probes.items()} == {
            "startupProbe": (ports["grpc"], "liveness"), "readinessProbe": (ports["grpc"], "readiness"),
            "livenessProbe": (ports["grpc"], "liveness")}, key
        startup = probes["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, f"{key}: startup budget < 10 min"
        # GPUs: whole devices in limits; requests, if given, equal limits.
        limits, requests = main["resources"]["limits"], main["resources"].get("requests", {})
        assert int(limits["nvidia.com/gpu"]) >= 1, key
        assert requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"]) == limits["nvidia.com/gpu"], key
        assert "memory" in limits and "cpu" in requests, key
        # /dev/shm in memory, and a writable place for everything the read-only root needs.
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in main["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", key
        # The config file the server is told to read is in the mounted ConfigMap.
        config_path = flag(main["args"], "--config")
        directory, file_name = config_path.rsplit("/", 1)
        config_map = config_maps[volumes[mounts[directory]]["configMap"]["name"]]
        config = tomllib.loads(config_map["data"][file_name])
        for writable in ("/tmp", config["compile_cache_dir"]):
            assert any(writable == m or writable.startswith(m + "/") for m in mounts), f"{key}: {writable} not writable"
        # SIGTERM drains within drain_grace_s; the kubelet must not SIGKILL before (+ margin).
        assert spec["terminationGracePeriodSeconds"] >= config["drain_grace_s"] + 15, key
        # Non-root, as the image's user, nothing more than needed.
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == uid, key
        security = main["securityContext"]
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True, key
        assert security["capabilities"]["drop"] == ["ALL"], key
    assert len(images) == 1 and not images.pop().endswith(":latest"), "one pinned image everywhere"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_services_and_monitors_find_their_pods(name):
    resources = rendered(name)
    created = pods(resources)
    service = next(s for s in by_kind(resources, "Service") if s["metadata"]["name"] == "expertd")
    selected = [p for p in created if selects(service["spec"]["selector"], p["labels"])]
    # The client Service reaches exactly the gRPC front ends: one per group, process 0.
    frontends = [p for p in created if p["labels"].get("app.kubernetes.io/component") == "frontend"
                 or p["labels"].get("apps.kubernetes.io/pod-index") == "0"]
    assert [p["name"] for p in selected] == [p["name"] for p in frontends] and selected, name
    for port in service["spec"]["ports"]:
        assert all(port["targetPort"] in container_ports(p["template"]) for p in selected), port
    monitor = one(resources, "ServiceMonitor")
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    scraped = {p["name"] for p in selected}
    for pod_monitor in by_kind(resources, "PodMonitor"):
        followers = [p for p in created if selects(pod_monitor["spec"]["selector"], p["labels"])]
        assert followers and not scraped & {p["name"] for p in followers}, "followers scraped once"
        for endpoint in pod_monitor["spec"]["podMetricsEndpoints"]:
            assert all(endpoint["port"] in container_ports(p["template"]) for p in followers)
        scraped |= {p["name"] for p in followers}
    assert scraped == {p["name"] for p in created}, f"{name}: every pod's metrics are scraped"
    budget = one(resources, "PodDisruptionBudget")
    assert all(selects(budget["spec"]["selector"], p["labels"]) for p in created)


def test_leaderworkerset_group():
    resources = rendered("overlays/multihost")
    lws = one(resources, "LeaderWorkerSet")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] >= 2
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader, worker = container(lwt["leaderTemplate"]), container(lwt["workerTemplate"])
    assert leader == worker, "one pod definition: the process id decides the role"
    # Coordinator wiring comes from the LWS_* variables the controller injects; the ports the
    # processes listen on are declared.
    assert flag(leader["args"], "--coordinator-address") is None and flag(leader["args"], "--process-id") is None
    ports = container_ports(lwt["leaderTemplate"])
    assert ports["coordinator"] == int(flag(leader["args"], "--coordinator-port"))
    assert ports["batches"] == int(flag(leader["args"], "--multihost-port"))
    env = {e["name"]: e["value"] for e in leader["env"]}
    assert env["NCCL_SOCKET_IFNAME"] and env["NCCL_DEBUG"] == "WARN"


def test_statefulset_group():
    resources = rendered("overlays/multihost-statefulset")
    sts = one(resources, "StatefulSet")
    headless = next(s for s in by_kind(resources, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    main = container(sts["spec"]["template"])
    assert int(flag(main["args"], "--num-processes")) == sts["spec"]["replicas"]
    host, port = flag(main["args"], "--coordinator-address").rsplit(":", 1)
    assert host == f"{sts['metadata']['name']}-0.{headless['metadata']['name']}"
    ports = container_ports(sts["spec"]["template"])
    assert int(port) == ports["coordinator"] and int(flag(main["args"], "--multihost-port")) == ports["batches"]
    assert {p["targetPort"] for p in headless["spec"]["ports"]} == {"coordinator", "batches"}
    assert flag(main["args"], "--process-id") == "$(POD_INDEX)"
    (pod_index,) = [e for e in main["env"] if e["name"] == "POD_INDEX"]
    assert pod_index["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert all(selects(headless["spec"]["selector"], p["labels"]) for p in pods(resources))


@pytest.mark.parametrize("name, workload", [("overlays/autoscaling", "Deployment"),
                                            ("overlays/multihost-autoscaling", "LeaderWorkerSet")])
def test_autoscaler_targets_the_workload_on_the_adapter_metric(name, workload):
    resources = rendered(name)
    hpa = one(resources, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == deploy_render.resource_id(one(resources, workload))
    (metric,) = hpa["spec"]["metrics"]
    rules = yaml.safe_load(ADAPTER_RULES.read_text())["rules"]["custom"]
    served = {rule["name"]["as"] for rule in rules}
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served


def test_replicas_behind_a_headless_service():
    """N replicas; the headless Service resolves to exactly the ready front-end pods on the gRPC port,
    is not scraped twice, and the documented client target is one the client takes."""
    resources = rendered("overlays/replicas")
    deployment = one(resources, "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    strategy = deployment["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    budget = one(resources, "PodDisruptionBudget")
    assert budget["spec"]["maxUnavailable"] == 1  # drains evict one replica at a time
    (headless,) = [s for s in by_kind(resources, "Service") if s["spec"].get("clusterIP") == "None"]
    assert not headless["spec"].get("publishNotReadyAddresses", False), "only ready (SERVING) pods in DNS"
    created = pods(resources)
    selected = [p["name"] for p in created if selects(headless["spec"]["selector"], p["labels"])]
    assert len(selected) == deployment["spec"]["replicas"] == len(created)
    (port,) = headless["spec"]["ports"]
    assert (port["name"], port["port"], port["appProtocol"]) == ("grpc", 8001, "kubernetes.io/h2c")
    assert all(container_ports(p["template"])[port["targetPort"]] == 8001 for p in created)
    for template in pod_templates(resources).values():  # readiness is the gRPC health probe
        assert container(template)["readinessProbe"]["grpc"] == {"port": 8001, "service": "readiness"}
    monitor = one(resources, "ServiceMonitor")
    assert not selects(monitor["spec"]["selector"], headless["metadata"]["labels"]), "pods scraped once"
    target = f"dns:///{headless['metadata']['name']}.<namespace>.svc.cluster.local:{port['port']}"
    assert target in (K8S / "overlays" / "replicas" / "kustomization.yaml").read_text()
    assert target in (ROOT / "docs" / "deploy.md").read_text()
    concrete = target.replace("<namespace>", "default")
    assert resolve_target(concrete).uri == concrete  # gRPC's own DNS resolver takes it as it is


def test_native_port_overlay_serves_it_beside_the_main_port_and_its_patches_compose(tmp_path):
    """The pod listens on 8003 through $EXPERTD_NATIVE_PORT (the args untouched), the Service carries
    it as h2c beside the main port, the probes stay on the main port; the two patch files, copied
    beside an overlay of the TLS overlay as docs/deploy.md says, give TLS with the native port."""
    overlay = K8S / "overlays" / "native-port"
    resources = rendered("overlays/native-port")
    (template,) = pod_templates(resources).values()
    main = container(template)
    assert container_ports(template) == {"grpc": 8001, "metrics": 8002, "grpc-native": 8003}
    assert {"name": "EXPERTD_NATIVE_PORT", "value": "8003"} in main["env"]
    (base_template,) = pod_templates(rendered("base")).values()
    assert main["args"] == container(base_template)["args"]
    assert main["readinessProbe"]["grpc"] == {"port": 8001, "service": "readiness"}
    service = next(s for s in by_kind(resources, "Service") if s["metadata"]["name"] == "expertd")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(ports) == {"grpc", "metrics", "grpc-native"}
    assert ports["grpc-native"] == {"name": "grpc-native", "port": 8003, "targetPort": "grpc-native", "protocol": "TCP",
                                    "appProtocol": "kubernetes.io/h2c"}
    assert "expertd.<namespace>.svc:8003" in (overlay / "kustomization.yaml").read_text()
    assert "expertd.<namespace>.svc:8003" in (ROOT / "docs" / "deploy.md").read_text()

    patches = ("deployment-native-port.yaml", "service-native-port.yaml")
    for name in patches:
        shutil.copy(overlay / name, tmp_path / name)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
        {"resources": [str(K8S / "overlays" / "tls")], "patches": [{"path": name} for name in patches]}))
    tls_native = deploy_render.build(tmp_path)
    (template,) = pod_templates(tls_native).values()
    main = container(template)
    assert flag(main["args"], "--tls-cert") == "/etc/expertd-tls/tls.crt" and "exec" in main["readinessProbe"]
    assert {"name": "EXPERTD_NATIVE_PORT", "value": "8003"} in main["env"]
    assert container_ports(template)["grpc-native"] == 8003
    for resource in tls_native:
        deploy_schemas.validate(resource)
