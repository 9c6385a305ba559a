"""A renderer for the subset of kustomize that deploy/k8s uses (kustomize itself is not
installed here): ``resources`` (files, and directories with a kustomization.yaml),
``patches`` by ``path`` (strategic merge, the target named by the patch's own kind and
metadata.name), ``images`` (newName / newTag) and ``namespace``. Any other field is
refused, so an overlay cannot use a feature these tests would silently skip.

Strategic merge as Kubernetes does it for the fields deploy/k8s patches: maps merge
key by key (null deletes), lists of containers, volumes, env and ports merge by their
patchMergeKey, every other list is replaced whole.
"""

from __future__ import annotations

import copy
import pathlib

import yaml

KUSTOMIZATION = "kustomization.yaml"
SUPPORTED = {"apiVersion", "kind", "resources", "patches", "images", "namespace"}
# Kubernetes' patchMergeKey for the lists deploy/k8s patches (k8s.io/api core/v1 types).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
              "env": "name", "volumeMounts": "mountPath", "ports": "containerPort"}


class KustomizeError(ValueError):
    """A kustomization this renderer does not support, or a patch with no target."""


def render(directory: pathlib.Path) -> list[dict]:
    """The objects ``kubectl apply -k directory`` would apply, in order."""
    path = directory / KUSTOMIZATION
    spec = yaml.safe_load(path.read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)}")
    objects: list[dict] = []
    for resource in spec.get("resources", []):
        target = (directory / resource).resolve()
        if target.is_dir():
            objects += render(target)
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise KustomizeError(f"{path}: only patches by path are supported, not {patch}")
        for document in yaml.safe_load_all((directory / patch["path"]).read_text()):
            _apply(objects, document, directory / patch["path"])
    for image in spec.get("images", []):
        _retag(objects, image)
    if "namespace" in spec:
        for obj in objects:
            obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return objects


def _apply(objects: list[dict], patch: dict, source: pathlib.Path) -> None:
    key = (patch["kind"], patch["metadata"]["name"])
    matches = [o for o in objects if (o["kind"], o["metadata"]["name"]) == key]
    if len(matches) != 1:
        raise KustomizeError(f"{source}: patch target {key} matches {len(matches)} objects")
    merged = merge(matches[0], patch)
    matches[0].clear()
    matches[0].update(merged)


def merge(base, patch, field: str | None = None):
    """``patch`` applied to ``base`` by strategic merge (a new object; neither changes)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    merge_key = MERGE_KEYS.get(field or "")
    if isinstance(base, list) and isinstance(patch, list) and merge_key:
        out = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, b in enumerate(out) if b.get(merge_key) == item[merge_key]),
                         None)
            if index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = merge(out[index], item)
        return out
    return copy.deepcopy(patch)


def _retag(objects: list[dict], image: dict) -> None:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                container["image"] = (f"{image.get('newName', name)}:"
                                      f"{image.get('newTag', tag)}")
