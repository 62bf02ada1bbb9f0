"""A strict reader of the kustomize features deploy/k8s uses, so that the manifests render where no kustomize
binary is installed: `resources` (files and folders with a kustomization), `namespace`, `images`, `patches`
(inline JSON patches with a target of kind and name, optionally group and version) and `configMapGenerator` with
`files` (name suffix hash off). Any other field, or another form of these, is refused (KustomizeError) rather
than rendered differently from kustomize; tests/deploy/test_manifests.py compares the two where `kubectl
kustomize` is on PATH. Transformers run in kustomize's order: patches, namespace, images."""
import copy
from pathlib import Path

import yaml

FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches", "configMapGenerator"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
                  "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass", "ValidatingWebhookConfiguration",
                  "MutatingWebhookConfiguration", "APIService", "ClusterTriggerAuthentication"}


class KustomizeError(ValueError):
    pass


def render(folder) -> list[dict]:
    """The objects `kustomize build folder` prints (in the order they were read)."""
    folder = Path(folder)
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{folder}: no kustomization.yaml")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - FIELDS
    if unknown:
        raise KustomizeError(f"{path}: fields this reader does not know: {sorted(unknown)}")
    if (spec.get("apiVersion"), spec.get("kind")) != ("kustomize.config.k8s.io/v1beta1", "Kustomization"):
        raise KustomizeError(f"{path}: not a kustomize.config.k8s.io/v1beta1 Kustomization")
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        target = (folder / entry).resolve()
        objects += render(target) if target.is_dir() else _documents(target)
    for generator in spec.get("configMapGenerator", []):
        objects.append(_config_map(folder, generator))
    _unique(objects, path)
    for patch in spec.get("patches", []):
        _patch(objects, patch, path)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        _set_image(objects, image, path)
    return objects


def _documents(path: Path) -> list[dict]:
    if not path.is_file():
        raise KustomizeError(f"resource {path} does not exist")
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= set(d) or "name" not in d["metadata"]:
            raise KustomizeError(f"{path}: a document without apiVersion, kind and metadata.name")
    return docs


def _unique(objects: list[dict], path: Path) -> None:
    seen = set()
    for obj in objects:
        key = (obj["apiVersion"].split("/")[0], obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{path}: {key} defined twice")
        seen.add(key)


def _config_map(folder: Path, generator: dict) -> dict:
    unknown = set(generator) - {"name", "files", "options"}
    options = generator.get("options", {})
    if unknown or set(options) - {"labels", "disableNameSuffixHash"}:
        raise KustomizeError(f"configMapGenerator {generator.get('name')}: fields this reader does not know")
    if options.get("disableNameSuffixHash") is not True:
        raise KustomizeError(f"configMapGenerator {generator['name']}: needs options.disableNameSuffixHash: true "
                             "(this reader does not compute kustomize's name hash)")
    data = {}
    for entry in generator["files"]:
        key, _, source = entry.rpartition("=")
        source_path = (folder / source).resolve()
        if not source_path.is_relative_to(folder.resolve()):
            raise KustomizeError(f"{source}: outside the kustomization's folder (kustomize refuses it)")
        data[key or source_path.name] = source_path.read_text()
    metadata = {"name": generator["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    want = {"kind": obj["kind"], "name": obj["metadata"]["name"], "group": group, "version": version}
    return all(want[k] == v for k, v in target.items())


def _patch(objects: list[dict], patch: dict, path: Path) -> None:
    target = patch.get("target") or {}
    if set(patch) != {"target", "patch"} or not {"kind", "name"} <= set(target) \
            or set(target) - {"group", "version", "kind", "name"}:
        raise KustomizeError(f"{path}: a patch needs `target` (kind, name; group, version) and an inline `patch`")
    ops = yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise KustomizeError(f"{path}: only JSON patches (a list of operations) are read, not strategic merges")
    hits = [obj for obj in objects if _matches(obj, target)]
    if not hits:
        raise KustomizeError(f"{path}: patch target {target} matches nothing")
    for obj in hits:
        for op in ops:
            _apply(obj, op, path)


def _apply(obj: dict, op: dict, path: Path) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        else:
            raise KustomizeError(f"{path}: JSON patch op {kind} is not read")
        return
    if kind in ("replace", "remove") and last not in parent:
        raise KustomizeError(f"{path}: {op['path']} does not exist in {obj['kind']} {obj['metadata']['name']}")
    if kind in ("add", "replace"):
        parent[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del parent[last]
    else:
        raise KustomizeError(f"{path}: JSON patch op {kind} is not read")


def _containers(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict) and "image" in c)
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for value in node:
            yield from _containers(value)


def _set_image(objects: list[dict], image: dict, path: Path) -> None:
    if set(image) - {"name", "newName", "newTag"} or "name" not in image:
        raise KustomizeError(f"{path}: an images entry takes name, newName and newTag")
    for obj in objects:
        for container in _containers(obj):
            ref = container["image"]
            name, tag = ref, None
            if ":" in ref.rsplit("/", 1)[-1]:
                name, tag = ref.rsplit(":", 1)
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name
