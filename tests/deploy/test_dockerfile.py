"""deploy/docker/Dockerfile, linted (no Docker engine here): parsed with dockerfile-parse and
checked for what the image must be. That the entry point, health check command and exposed ports
work against a real server is checked in test_live_server.py."""
from __future__ import annotations

import json
import re
import shlex
import tomllib
from fnmatch import fnmatch

import yaml
from deploy_manifests import DOCKERFILE, K8S, ROOT, container_ports, dockerfile, pod_templates, rendered
from packaging.requirements import Requirement

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CPU_BUILD = {"BASE_IMAGE": "ubuntu:24.04", "EXPERTD_EXTRAS": ""}


def instructions(parser, name):
    return [i for i in parser.structure if i["instruction"] == name]


def global_args(parser):
    """The ARG defaults declared before the first FROM (the build's version knobs)."""
    first_from = instructions(parser, "FROM")[0]["startline"]
    pairs = (i["value"].partition("=") for i in instructions(parser, "ARG") if i["startline"] < first_from)
    return {name: default for name, _, default in pairs}


def last_stage(parser):
    froms = [i["startline"] for i in instructions(parser, "FROM")]
    return [i for i in parser.structure if i["startline"] >= froms[-1]]


def test_base_images_are_pinned_build_args():
    parser = dockerfile()
    for instruction in instructions(parser, "FROM"):
        assert instruction["value"].split()[0] == "${BASE_IMAGE}", "every stage builds on the pinned base"
    for build_args in ({}, CPU_BUILD):
        for image in dockerfile(build_args).parent_images:
            name, _, tag = image.rpartition(":")
            assert name and re.search(r"\d", tag) and tag != "latest", f"{image}: pin a versioned tag"
    assert dockerfile().parent_images[0].startswith("nvidia/cuda:12.")
    assert dockerfile(CPU_BUILD).parent_images[0] == "ubuntu:24.04"


def test_version_build_args_match_the_project():
    args = global_args(dockerfile())
    jax_requirement = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("jax>"))
    assert jax_requirement.specifier.contains(args["JAX_VERSION"])
    assert args["EXPERTD_EXTRAS"] in PYPROJECT["project"]["optional-dependencies"]
    text = DOCKERFILE.read_text()
    assert '"jax[${EXPERTD_EXTRAS}]==${JAX_VERSION}"' in text and '"jax==${JAX_VERSION}"' in text


def test_runs_as_the_non_root_user_of_the_manifests():
    parser = dockerfile()
    stage = last_stage(parser)
    (user,) = [i for i in stage if i["instruction"] == "USER"]
    uid = user["value"].replace("${EXPERTD_UID}", parser.args["EXPERTD_UID"]).split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, non-root (Kubernetes runAsNonRoot checks it)"
    assert all(i["startline"] < user["startline"] for i in stage if i["instruction"] in ("RUN", "COPY")), \
        "nothing runs as root after USER"
    for template in pod_templates(rendered("base")).values():
        assert template["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_entrypoint_is_expertd_serve():
    parser = dockerfile()
    (entrypoint,) = instructions(parser, "ENTRYPOINT")
    assert json.loads(entrypoint["value"]) == ["expertd", "serve"]
    assert PYPROJECT["project"]["scripts"]["expertd"] == "expertd.server.cli:main"
    (cmd,) = instructions(parser, "CMD")
    json.loads(cmd["value"])  # exec form


def test_exposes_the_ports_of_the_manifests():
    (expose,) = instructions(dockerfile(), "EXPOSE")
    exposed = {int(p) for p in expose["value"].split()}
    declared = set()
    for name in ("base", "overlays/multihost", "overlays/native-port"):
        for template in pod_templates(rendered(name)).values():
            declared |= set(container_ports(template).values())
    assert exposed == declared


def test_healthcheck_is_a_grpc_health_probe():
    (healthcheck,) = instructions(dockerfile(), "HEALTHCHECK")
    options, _, command = healthcheck["value"].partition("CMD")
    argv = json.loads(command)
    assert argv[:2] == ["expertd", "health"] and "liveness" in argv
    assert "--start-period" in options, "loading and compiling takes minutes"


def test_build_copies_what_the_wheel_needs_and_the_ignore_file_lets_it_through():
    parser = dockerfile()
    copied = set()
    for instruction in instructions(parser, "COPY"):
        words = shlex.split(instruction["value"])
        if not any(w.startswith("--from=") for w in words):
            copied |= set(words[:-1])
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert copied >= package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"], "proto"}
    assert all((ROOT / path).exists() for path in copied)
    patterns = [line for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
                if line and not line.startswith("#")]
    for path in copied:
        included = False
        for pattern in patterns:  # last match wins, as in .dockerignore
            negated = pattern.startswith("!")
            if fnmatch(path, pattern.lstrip("!").rstrip("/")):
                included = negated
        assert included, f"{path} is excluded from the build context"


def test_apt_usage_is_lean():
    for instruction in instructions(dockerfile(), "RUN"):
        if "apt-get install" in instruction["value"]:
            assert "--no-install-recommends" in instruction["value"]
            assert "rm -rf /var/lib/apt/lists/*" in instruction["value"]
    assert not instructions(dockerfile(), "ADD"), "COPY, never ADD (no remote URLs or auto-extraction)"


def test_the_image_and_ci_install_what_the_native_port_build_asks_for():
    """The build stage and .ci/run install every package the native port's builder names (it needs
    protobuf.pc, which libgrpc++-dev does not pull in: without libprotobuf-dev the image's build
    fails and CI skips the native tests)."""
    from expertd.server.native_front.build import PACKAGES_HINT

    wanted = set(PACKAGES_HINT.partition("apt-get install")[2].split())
    assert {"libgrpc++-dev", "libprotobuf-dev", "protobuf-compiler-grpc", "pkg-config"} <= wanted
    parser = dockerfile()
    runtime_from = last_stage(parser)[0]["startline"]
    build_stage = [i for i in instructions(parser, "RUN") if i["startline"] < runtime_from]
    installed = {word for i in build_stage if "apt-get install" in i["value"]
                 for word in re.findall(r"[\w+.-]+", i["value"])}
    assert wanted <= installed, f"the build stage lacks {sorted(wanted - installed)}"
    ci = set(re.findall(r"[\w+.-]+", (ROOT / ".ci" / "run").read_text()))
    assert wanted <= ci, f".ci/run lacks {sorted(wanted - ci)}"


def test_kubernetes_probes_ask_the_same_service_as_the_healthcheck():
    (healthcheck,) = instructions(dockerfile(), "HEALTHCHECK")
    service = json.loads(healthcheck["value"].partition("CMD")[2])[-1]
    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    (main,) = deployment["spec"]["template"]["spec"]["containers"]
    assert main["livenessProbe"]["grpc"]["service"] == service
