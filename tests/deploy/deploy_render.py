"""A small, exact `kustomize build` for the kustomizations under deploy/k8s.

No kustomize binary installs from the project's package registries, so tests render the
manifests with this. It implements only the kustomization features deploy/k8s uses and refuses
every other one (so a new feature in a kustomization fails loudly here instead of rendering
wrong); `test_renderer_matches_kubectl_kustomize` compares it with the real kustomize wherever a
`kubectl` binary is on PATH.

Supported:
- `resources`: YAML files (several documents allowed) and directories holding a kustomization.
- `configMapGenerator`: `name` + `files` (key = file name), with
  `generatorOptions.disableNameSuffixHash: true` (no hashed names, so no name references to fix).
- `patches`: strategic-merge patches given by `path` or inline `patch`, matched by
  apiVersion/kind/metadata.name; `$patch: delete` removes a resource; maps merge, `null`
  removes a key. Lists only where `LIST_RULES` says how kustomize treats them: a workload's pod
  spec lists and a Service's ports merge element by element on their Kubernetes merge key (the
  patch's elements first, each merged into its namesake, then the others: kustomize 5.5's order),
  `args` and a custom resource's lists are replaced whole; any other list is refused.
- `configurations`: only files that configure the `images` transformer, which is a no-op here
  (no kustomization sets `images`).
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "generatorOptions",
                  "patches", "configurations"}


WORKLOAD_KINDS = ("Deployment", "StatefulSet")
POD_SPEC = ("spec", "template", "spec")
LIST_RULES = {
    **{(kind, *POD_SPEC, field): "name" for kind in WORKLOAD_KINDS for field in ("containers", "volumes")},
    **{(kind, *POD_SPEC, "containers", "*", field): key for kind in WORKLOAD_KINDS
       for field, key in (("volumeMounts", "mountPath"), ("env", "name"), ("ports", "containerPort"),
                          ("args", None))},
    ("Service", "spec", "ports"): "port",
    ("ServiceMonitor", "spec", "endpoints"): None,  # a custom resource: kustomize knows no merge key
}
"""(kind, *path to the list) -> the merge key of its elements, or None: the patch's list replaces it
(``*`` stands for an element of a merged list)."""


class UnsupportedKustomization(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def resource_id(resource: dict) -> tuple[str, str, str]:
    """(apiVersion, kind, name): how kustomize identifies a resource (one namespace here)."""
    return resource["apiVersion"], resource["kind"], resource["metadata"]["name"]


def load_documents(path: Path) -> list[dict]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def build(directory: str | Path) -> list[dict]:
    """Render the kustomization in `directory` to a list of resources (dicts), in input order."""
    directory = Path(directory)
    kustomization = _read_kustomization(directory)
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        target = directory / entry
        resources.extend(build(target) if target.is_dir() else load_documents(target))
    resources.extend(_generate_config_maps(directory, kustomization))
    for patch in kustomization.get("patches", []):
        resources = _apply_patch(resources, _patch_document(directory, patch))
    ids = [resource_id(r) for r in resources]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: resources defined more than once: {sorted(duplicates)}")
    return resources


def _read_kustomization(directory: Path) -> dict:
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: no kustomization.yaml")
    kustomization = yaml.safe_load(path.read_text())
    unknown = set(kustomization) - SUPPORTED_KEYS
    if unknown:
        raise UnsupportedKustomization(f"{path}: unsupported fields {sorted(unknown)}")
    for config in kustomization.get("configurations", []):
        fields = set(yaml.safe_load((directory / config).read_text()))
        if fields != {"images"}:
            raise UnsupportedKustomization(f"{directory / config}: only `images` is supported, got {sorted(fields)}")
    return kustomization


def _generate_config_maps(directory: Path, kustomization: dict) -> list[dict]:
    generators = kustomization.get("configMapGenerator", [])
    if generators and kustomization.get("generatorOptions") != {"disableNameSuffixHash": True}:
        raise UnsupportedKustomization(
            f"{directory}: configMapGenerator needs generatorOptions.disableNameSuffixHash: true")
    config_maps = []
    for generator in generators:
        unknown = set(generator) - {"name", "files"}
        if unknown:
            raise UnsupportedKustomization(f"{directory}: configMapGenerator fields {sorted(unknown)}")
        data = {}
        for entry in generator["files"]:
            if "=" in entry:
                raise UnsupportedKustomization(f"{directory}: key=path file entries ({entry})")
            data[Path(entry).name] = (directory / entry).read_text()
        config_maps.append({"apiVersion": "v1", "kind": "ConfigMap",
                            "metadata": {"name": generator["name"]}, "data": data})
    return config_maps


def _patch_document(directory: Path, patch: dict) -> dict:
    unknown = set(patch) - {"path", "patch"}
    if unknown or len(patch) != 1:
        raise UnsupportedKustomization(f"{directory}: patches need exactly one of path/patch, got {sorted(patch)}")
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    return yaml.safe_load(text)


def _apply_patch(resources: list[dict], patch: dict) -> list[dict]:
    patch = dict(patch)
    action = patch.pop("$patch", "merge")
    target = resource_id(patch)
    matches = [i for i, r in enumerate(resources) if resource_id(r) == target]
    if len(matches) != 1:
        raise ValueError(f"patch target {target} matched {len(matches)} resources")
    (index,) = matches
    if action == "delete":
        return resources[:index] + resources[index + 1:]
    if action != "merge":
        raise UnsupportedKustomization(f"$patch: {action}")
    patched = list(resources)
    patched[index] = _merge(resources[index], patch, (resources[index]["kind"],))
    return patched


def _merge(base: dict, patch: dict, path: tuple) -> dict:
    merged = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value, (*path, key))
        elif isinstance(value, list):
            merged[key] = _merge_list(merged.get(key), value, (*path, key))
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _merge_list(base: list | None, patch: list, path: tuple) -> list:
    if path not in LIST_RULES:
        raise UnsupportedKustomization(f"list in a strategic-merge patch (field {'.'.join(path[1:])!r} of a "
                                       f"{path[0]})")
    key = LIST_RULES[path]
    if key is None or base is None:
        return copy.deepcopy(patch)
    for element in patch:
        if not isinstance(element, dict) or key not in element or any(k.startswith("$") for k in element):
            raise UnsupportedKustomization(f"{'.'.join(path[1:])}: elements need their merge key {key!r} "
                                           "(and no $ directives)")
    # kustomize's order: the patch's elements (each merged into its namesake), then the others
    by_key = {element[key]: element for element in base}
    patched = [_merge(by_key[e[key]], e, (*path, "*")) if e[key] in by_key else copy.deepcopy(e) for e in patch]
    keys = {e[key] for e in patch}
    return patched + [copy.deepcopy(e) for e in base if e[key] not in keys]
