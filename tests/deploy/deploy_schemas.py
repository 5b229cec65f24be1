"""Offline schema validation of rendered manifests.

Built-in kinds go through `kubernetes-validate` (the Kubernetes OpenAPI schemas it ships, strict
mode: unknown fields are errors). Custom resources go through the schemas kept in
deploy/k8s/schemas (LeaderWorkerSet; ServiceMonitor and PodMonitor); the pod templates inside a
LeaderWorkerSet, which that schema leaves open, are validated as core/v1 PodTemplates.
"""
from __future__ import annotations

from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

SCHEMAS = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "schemas"
# The oldest release the manifests target (gRPC probes are GA since 1.27, StatefulSet pods carry
# apps.kubernetes.io/pod-index since 1.28) and the newest the package ships schemas for.
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
CUSTOM_SCHEMA_FILES = {
    "leaderworkerset.x-k8s.io/v1": "leaderworkerset.x-k8s.io-v1.yaml",
    "monitoring.coreos.com/v1": "monitoring.coreos.com-v1.yaml",
}


@cache
def _custom_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    document = yaml.safe_load((SCHEMAS / CUSTOM_SCHEMA_FILES[api_version]).read_text())
    schema = document if document.get("title") == kind else {**document, "$ref": f"#/$defs/{kind}"}
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def is_custom(resource: dict) -> bool:
    return resource["apiVersion"] in CUSTOM_SCHEMA_FILES


def validate(resource: dict) -> None:
    """Raise jsonschema.ValidationError (or kubernetes_validate's errors) if `resource` is invalid."""
    if is_custom(resource):
        _custom_validator(resource["apiVersion"], resource["kind"]).validate(resource)
        if resource["kind"] == "LeaderWorkerSet":
            template = resource["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in template:
                    validate({"apiVersion": "v1", "kind": "PodTemplate",
                              "metadata": {"name": f"{resource['metadata']['name']}-{key}"},
                              "template": template[key]})
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(resource, version, strict=True)
