"""Offline validation of everything under k8s/ and deployments/ (no cluster can run here).

What is checked, and against what:

- kustomize: base and every overlay are rendered by a small renderer for the subset these files
  use (``resources``, ``namespace``, ``patches`` as strategic-merge patches on our custom resources
  — maps merge, lists replace, as kustomize does for a kind it has no schema for — and RFC 6902
  JSON patches with a ``target``). Anything else in a kustomization fails the renderer. When a
  ``kustomize`` or ``kubectl`` binary is on PATH, its output must equal ours.
- built-in kinds: ``kubernetes-validate`` in strict mode (unknown fields are errors) for the
  oldest and newest Kubernetes versions we claim.
- RayService / RayCluster: the KubeRay 1.7 CRDs in ``../shared/kuberay/`` converted to JSON Schema
  (see ``crd_json_schema``). CEL rules (``x-kubernetes-validations``) are not evaluated.
- PodMonitor (k8s/monitoring; the Prometheus Operator's CRD is not in ``../shared``): the subset
  of its schema these files use (``PODMONITOR_SCHEMA``), and that it selects every Ray pod, and no
  other, on the container port Ray's metrics agent listens on.
- ``serveConfigV2`` and ``deployments/*.yaml``: parsed with ``ray.serve.schema.ServeDeploySchema``
  plus a strict check for keys Ray's schema would silently ignore; every application's ``args``
  parsed with ``RolloutServiceConfig.from_args``; every ``import_path`` imported (module, then
  attribute).
- consistency: engines fit the worker groups' GPUs / CPUs (tensor-parallel group on one pod),
  every Ray container (head included) runs the image k8s/image/Dockerfile builds, of the flavour
  ``engine.device`` needs and this package's version, ``rayVersion`` and the Dockerfile's base
  match the installed Ray, every ``--build-arg`` the docs and comments mention is one the
  Dockerfile declares, every Ray container gets the Redis URL / API key env from a Secret that the
  overlay renders or that the docs say to create, the demo Redis URL names a rendered Service, Redis
  runs with AOF on a PVC and a ``maxmemory`` below its container limit (``noeviction``), and the CPU
  demo's requests fit the node size its comment and the docs state.
- deliberately broken copies of the manifests fail, each for the reason it was broken.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
import shutil
import subprocess
from functools import lru_cache
from importlib import resources as importlib_resources
from pathlib import Path
from typing import Any, Callable

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml
from referencing import Registry, Resource

from rollout_service.config import RolloutServiceConfig
from rollout_service.ops.runtime import PROXY_ENV

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = Path(__file__).resolve().parents[2] / "shared" / "kuberay"
K8S = ROOT / "k8s"
DEPLOYMENTS = ROOT / "deployments"
DOCKERFILE = K8S / "image" / "Dockerfile"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# The node the CPU demo is documented to fit (k8s/overlays/cpu-demo/kustomization.yaml, docs/deployment.md),
# and what is left of it for Kubernetes itself (kubelet, control plane and CNI pods on kind / minikube).
DEMO_NODE = {"cpu": 8.0, "memory": 16 * 2**30}
DEMO_SYSTEM_RESERVE = {"cpu": 1.0, "memory": 2 * 2**30}

KUSTOMIZATIONS = ["base", "overlays/cpu-demo", "overlays/gpu"]
# Secrets the operator creates out of band (docs/deployment.md, "Secrets"), per kustomization.
EXTERNAL_SECRETS = {"base": {"rollout-service"}, "overlays/gpu": {"rollout-service"}, "overlays/cpu-demo": set()}
SECRET_KEYS = {"rollout-service": {"redis-url", "api-key"}}
K8S_VERSIONS = ["1.29", "1.37"]
CRD_FILES = {"RayService": "ray.io_rayservices.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
# Keeps Serve replicas off the head (which runs Ray's GCS and Serve's controller, num-cpus 0): every
# worker group offers it, the head does not, and every deployment of the app asks for a sliver of it.
WORKER_RESOURCE = "rollout_worker"
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
OBJECT_META_REF = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


# --------------------------------------------------------------------------- kustomize subset


def _load_all(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge_patch(base: Any, patch: Any) -> Any:
    """Strategic merge as kustomize applies it to a kind without schema: maps merge, null deletes,
    lists and scalars replace."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge_patch(base.get(key), value)
    return out


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add / replace / remove (the ops our overlays use)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = _pointer(op["path"])
        node: Any = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        kind = op["op"]
        if isinstance(node, list):
            index = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(index, copy.deepcopy(op["value"]))
            elif kind == "replace":
                node[index] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[index]
            else:
                raise NotImplementedError(f"JSON patch op {kind}")
        else:
            if kind in ("replace", "remove") and last not in node:
                raise KeyError(f"JSON patch {kind} of missing path {op['path']}")
            if kind in ("add", "replace"):
                node[last] = copy.deepcopy(op["value"])
            elif kind == "remove":
                del node[last]
            else:
                raise NotImplementedError(f"JSON patch op {kind}")
    return doc


def _matches(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    checks = {"group": group, "version": version, "kind": doc["kind"], "name": doc["metadata"]["name"]}
    return all(target[k] == v for k, v in checks.items() if k in target)


def _contains_list(value: Any) -> bool:
    if isinstance(value, list):
        return True
    return isinstance(value, dict) and any(_contains_list(v) for v in value.values())


def render_kustomization(directory: Path) -> list[dict]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(spec) - {"apiVersion", "kind", "namespace", "resources", "patches"}
    if unsupported:
        raise NotImplementedError(f"{directory}: renderer does not support {sorted(unsupported)}")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        docs += render_kustomization(path) if path.is_dir() else _load_all(path)
    for entry in spec.get("patches", []):
        if set(entry) - {"path", "target"}:
            raise NotImplementedError(f"{directory}: patch fields {sorted(entry)}")
        patch = yaml.safe_load((directory / entry["path"]).read_text())
        if isinstance(patch, list):
            target = entry["target"]
            apply: Callable[[dict], dict] = lambda d, p=patch: _json_patch(d, p)
        else:
            group, _, version = patch["apiVersion"].rpartition("/")
            target = entry.get("target") or {
                "group": group, "version": version, "kind": patch["kind"], "name": patch["metadata"]["name"]
            }
            if target["kind"] not in CRD_FILES and _contains_list(patch):
                raise NotImplementedError("strategic-merge lists of built-in kinds need merge keys: not supported")
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            apply = lambda d, p=body: _merge_patch(d, p)
        hits = [i for i, d in enumerate(docs) if _matches(d, target)]
        assert len(hits) == 1, f"{directory}/{entry['path']}: target {target} matched {len(hits)} resources"
        docs[hits[0]] = apply(docs[hits[0]])
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return docs


@lru_cache(maxsize=None)
def _rendered(name: str) -> tuple[str, ...]:
    return tuple(json.dumps(d) for d in render_kustomization(K8S / name))


def rendered(name: str) -> list[dict]:
    return [json.loads(d) for d in _rendered(name)]


def _key(doc: dict) -> tuple:
    return (doc["apiVersion"], doc["kind"], doc["metadata"].get("namespace"), doc["metadata"]["name"])


# --------------------------------------------------------------------------- CRD -> JSON Schema

_PASS_THROUGH = {
    "type", "required", "enum", "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "multipleOf",
}
_IGNORED = {"description", "default", "example", "title", "x-kubernetes-map-type", "x-kubernetes-validations"}


def crd_json_schema(node: dict, strict: bool = True) -> dict:
    """One CRD ``openAPIV3Schema`` node as a JSON Schema (draft 2020-12).

    - ``type: object`` with ``properties`` gets ``additionalProperties: false`` (strict field
      validation: the API server would reject, not prune, an unknown field), unless the node has
      ``x-kubernetes-preserve-unknown-fields: true``. An object with neither properties nor
      additionalProperties is free-form.
    - ``x-kubernetes-int-or-string`` becomes ``anyOf: [integer, string]``; ``nullable`` adds null.
    - ``x-kubernetes-embedded-resource`` requires apiVersion and kind and admits them (and metadata).
    - ``x-kubernetes-list-type: set`` -> ``uniqueItems``; ``map`` keeps ``x-kubernetes-list-map-keys``,
      which the validator below enforces (no two items with the same key values).
    - CEL ``x-kubernetes-validations``, defaults, descriptions and ``x-kubernetes-map-type`` do not
      constrain an object being created: dropped. Any other keyword fails the conversion loudly.
    """
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _PASS_THROUGH:
            out[key] = value
        elif key == "properties":
            out[key] = {k: crd_json_schema(v, strict) for k, v in value.items()}
        elif key == "items":
            out[key] = crd_json_schema(value, strict)
        elif key == "additionalProperties":
            out[key] = value if isinstance(value, bool) else crd_json_schema(value, strict)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [crd_json_schema(v, strict) for v in value]
        elif key == "not":
            out[key] = crd_json_schema(value, strict)
        elif key == "x-kubernetes-list-type":
            if value == "set":
                out["uniqueItems"] = True
        elif key == "x-kubernetes-list-map-keys":
            out[key] = value
        elif key in ("x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
                     "x-kubernetes-embedded-resource", "nullable"):
            pass
        elif key in _IGNORED:
            pass
        else:
            raise ValueError(f"CRD schema keyword not handled: {key}")
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        if "anyOf" not in out:
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {})
        out["properties"].setdefault("apiVersion", {"type": "string"})
        out["properties"].setdefault("kind", {"type": "string"})
        out["properties"].setdefault("metadata", {"type": "object"})
        out["required"] = sorted(set(out.get("required", [])) | {"apiVersion", "kind"})
    if (
        strict
        and out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else [*out["type"], "null"]
    return out


def _list_map_keys(validator, keys, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    seen: set = set()
    for item in instance:
        if not isinstance(item, dict):
            continue
        ident = tuple(json.dumps(item.get(k)) for k in keys)
        if ident in seen:
            yield jsonschema.ValidationError(f"duplicate item for list-map keys {keys}: {dict(zip(keys, ident))}")
        seen.add(ident)


_Validator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator, {"x-kubernetes-list-map-keys": _list_map_keys}
)


@lru_cache(maxsize=1)
def _k8s_definitions() -> Resource:
    latest = kubernetes_validate.utils.latest_version()
    ref = importlib_resources.files("kubernetes_validate").joinpath(
        f"kubernetes-json-schema/v{latest}-local-strict/_definitions.json"
    )
    return Resource.from_contents(json.loads(ref.read_text()))


@lru_cache(maxsize=None)
def crd_validator(kind: str, api_version: str = "ray.io/v1", part: str | None = None):
    crd = yaml.load((KUBERAY / CRD_FILES[kind]).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group, (crd["spec"]["group"], api_version)
    (schema,) = [v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version]
    out = crd_json_schema(schema)
    # The API server validates a custom resource's root metadata as ObjectMeta.
    out["properties"]["metadata"] = {"$ref": OBJECT_META_REF}
    out["properties"]["apiVersion"] = {"const": api_version}
    out["properties"]["kind"] = {"const": kind}
    out["required"] = sorted(set(out.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    if part == "spec":
        out = out["properties"]["spec"]
    registry = Registry().with_resource("https://kubernetes.io/api/_definitions.json", _k8s_definitions())
    return _Validator(out, registry=registry)


# --------------------------------------------------------------------------- checks

def _error_text(e: jsonschema.ValidationError) -> str:
    return f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"


def _unknown_keys(data: dict, model: Any, where: str) -> list[str]:
    fields = set(getattr(model, "model_fields", None) or model.__fields__)
    return [f"serve: unknown key {where}.{k}" for k in data if k not in fields]


def serve_config_problems(config: Any, where: str) -> list[str]:
    """Ray's schema, keys it would ignore, our config, and deployment overrides."""
    from ray.serve.schema import DeploymentSchema, HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    if not isinstance(config, dict):
        return [f"serve: {where} is not a mapping"]
    problems = _unknown_keys(config, ServeDeploySchema, where)
    problems += _unknown_keys(config.get("http_options") or {}, HTTPOptionsSchema, f"{where}.http_options")
    try:
        parse = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
        parse(config)
    except Exception as e:  # pydantic's ValidationError (v1 or v2 flavour)
        problems.append(f"serve: {where}: {e}")
    for i, app in enumerate(config.get("applications") or []):
        at = f"{where}.applications[{i}]"
        problems += _unknown_keys(app, ServeApplicationSchema, at)
        try:
            deployments = app_deployments(app.get("args"))
        except Exception as e:
            deployments = {}
            problems.append(f"args: {at}: the app does not build: {e}")
        for j, dep in enumerate(app.get("deployments") or []):
            problems += _unknown_keys(dep, DeploymentSchema, f"{at}.deployments[{j}]")
            code = deployments.get(dep.get("name"))
            if code is None and deployments:
                problems.append(f"serve: {at}: no deployment named {dep.get('name')!r} in the app "
                                f"(it has {sorted(deployments)})")
            if code is not None and _routed_by_rollout(code) and {"num_replicas", "autoscaling_config"} & set(dep):
                problems.append(f"serve: {at}: size {dep['name']} with service.num_affinity_replicas")
            overridden = dep.get("ray_actor_options")
            if code is not None and overridden is not None:
                # Serve replaces the code's ray_actor_options with the config's whole: restate them.
                lost = {k: v for k, v in (code.ray_actor_options or {}).items() if overridden.get(k) != v}
                if lost:
                    problems.append(f"serve: {at}: {dep['name']}.ray_actor_options drops the code's {lost}")
        if app.get("import_path") != "rollout_service.serve.app:build_app":
            problems.append(f"serve: {at}: unexpected import_path {app.get('import_path')!r}")
        try:
            RolloutServiceConfig.from_args(app.get("args"))
        except Exception as e:
            problems.append(f"args: {at}: {e}")
    return problems


@lru_cache(maxsize=None)
def _built(args_json: str) -> dict:
    from ray.serve._private.build_app import build_app as build

    from rollout_service.serve.app import build_app

    return {d.name: d for d in build(build_app(json.loads(args_json)), name="manifest-check").deployments}


def app_deployments(args: dict | None) -> dict:
    """The app's deployments by name, as the code builds them from these args (Serve rejects an
    override of a deployment the app does not have)."""
    return _built(json.dumps(args or {}, sort_keys=True))


def _routed_by_rollout(deployment) -> bool:
    """The deployment sized by service.num_affinity_replicas: requests routed by rollout id."""
    from rollout_service.serve.routing import ROUTER_CLASS

    router = str(deployment._deployment_config.request_router_config.request_router_class)
    return router == ROUTER_CLASS or "consistent_hash" in router


def head_placement_problems(rs: dict) -> list[str]:
    """No Serve replica can be placed on the head: each deployment asks for WORKER_RESOURCE, which
    every worker group offers (rayStartParams.resources) and the head does not."""
    cluster = rs["spec"]["rayClusterConfig"]

    def offered(group: dict) -> dict:
        raw = group.get("rayStartParams", {}).get("resources")
        return json.loads(json.loads(raw)) if raw else {}

    problems = []
    if WORKER_RESOURCE in offered(cluster["headGroupSpec"]):
        problems.append(f"placement: the head offers {WORKER_RESOURCE}")
    for group in cluster.get("workerGroupSpecs", []):
        if offered(group).get(WORKER_RESOURCE, 0) <= 0:
            problems.append(f"placement: worker group {group['groupName']} does not offer {WORKER_RESOURCE}")
    for app in _serve_config(rs).get("applications", []):
        overrides = {d["name"]: d for d in app.get("deployments") or []}
        for name in app_deployments(app.get("args")):
            asked = (overrides.get(name, {}).get("ray_actor_options") or {}).get("resources", {})
            if asked.get(WORKER_RESOURCE, 0) <= 0:
                problems.append(f"placement: {name} replicas may run on the head (no {WORKER_RESOURCE} in its "
                                "ray_actor_options.resources)")
    return problems


def _serve_config(rayservice: dict) -> Any:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _ray_containers(cluster_spec: dict) -> list[tuple[str, dict, dict]]:
    groups = [("head", cluster_spec["headGroupSpec"])] + [
        (g["groupName"], g) for g in cluster_spec.get("workerGroupSpecs", [])
    ]
    return [(name, group, group["template"]["spec"]["containers"][0]) for name, group in groups]


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_REDIS_UNITS = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 1000, "m": 1000**2, "g": 1000**3}


def _quantity(value: Any) -> float:
    """A Kubernetes quantity: CPUs (``500m``, ``4``) or bytes (``6Gi``, ``512Mi``)."""
    text = str(value)
    for suffix, factor in _BINARY.items():
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _redis_bytes(value: str) -> int:
    """A Redis memory setting (``3gb``, ``512mb``, bytes)."""
    text = value.lower()
    for suffix in sorted(_REDIS_UNITS, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * _REDIS_UNITS[suffix])
    return int(text)


def project_image_problem(image: str, device: str) -> str | None:
    """None if ``image`` is the one k8s/image/Dockerfile builds for ``device`` at this version
    (``[registry/]rollout-service:<version>-<cpu|gpu>``), else why not."""
    flavour = "gpu" if device == "cuda" else "cpu"
    name, _, tag = image.rpartition(":")
    if name.rpartition("/")[2] != "rollout-service":
        return f"{image} is not the rollout-service image (k8s/image/Dockerfile): it lacks rollout_service"
    if tag != f"{VERSION}-{flavour}":
        return f"{image} is not rollout-service:{VERSION}-{flavour} (engine.device {device})"
    return None


def rayservice_consistency_problems(rs: dict) -> list[str]:
    problems: list[str] = []
    cluster = rs["spec"]["rayClusterConfig"]
    if cluster.get("rayVersion") != ray.__version__:
        problems.append(f"consistency: rayVersion {cluster.get('rayVersion')} != installed Ray {ray.__version__}")
    containers = _ray_containers(cluster)
    for name, _, c in containers:
        env = {e["name"]: e for e in c.get("env", [])}
        for var in ("ROLLOUT_SERVICE_REDIS_URL", "ROLLOUT_SERVICE_API_KEY"):
            if "secretKeyRef" not in env.get(var, {}).get("valueFrom", {}):
                problems.append(f"consistency: {name} container lacks {var} from a Secret")
        if "readinessProbe" not in c or "livenessProbe" not in c:
            problems.append(f"consistency: {name} container lacks readiness or liveness probe")
        for var, value in PROXY_ENV["haproxy"].items():  # the ingress `up` runs, on every node
            if env.get(var, {}).get("value") != value:
                problems.append(f"consistency: {name} container lacks {var}={value} (the HAProxy ingress)")
    workers = [(g, c) for name, g, c in containers if name != "head"]
    for app in _serve_config(rs).get("applications", []):
        engine = RolloutServiceConfig.from_args(app.get("args")).engine
        if engine.device == "cuda":
            per_pod = [int(_quantity(c["resources"]["limits"].get("nvidia.com/gpu", 0))) for g, c in workers]
            total = sum(n * g["maxReplicas"] for n, (g, _) in zip(per_pod, workers))
            need = engine.num_engines * engine.tensor_parallel_size
            if need > total:
                problems.append(f"consistency: {need} GPUs needed, worker groups have {total}")
            if engine.tensor_parallel_size > max(per_pod, default=0):
                problems.append("consistency: a tensor-parallel group does not fit on one worker pod (STRICT_PACK)")
        else:
            total = sum(_quantity(c["resources"]["limits"]["cpu"]) * g["maxReplicas"] for g, c in workers)
            if engine.num_engines * engine.num_cpus_per_engine > total:
                problems.append(f"consistency: engines need more CPUs than the worker groups' {total}")
        for name, _, c in containers:
            wrong = project_image_problem(c["image"], engine.device)
            if wrong:
                problems.append(f"consistency: {name} image {wrong}")
    return problems


# --------------------------------------------------------------------------- PodMonitor
# The Prometheus Operator's CRDs are not in ../shared (only KubeRay's): a PodMonitor is checked against
# the subset of monitoring.coreos.com/v1 PodMonitor that k8s/monitoring uses (an unknown field is an
# error, as in strict mode; field names and formats from the operator's API reference), and against
# the RayService it scrapes (podmonitor_scrape_problems).
_LABEL_NAME = {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
PODMONITOR_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}, "namespace": {"type": "string"},
            "labels": _STR_MAP, "annotations": _STR_MAP}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
                 "properties": {
            "jobLabel": {"type": "string"},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "selector": {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
                "matchLabels": _STR_MAP,
                "matchExpressions": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False, "required": ["key", "operator"], "properties": {
                        "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                        "values": {"type": "array", "items": {"type": "string"}}}}}}},
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["port"], "properties": {
                    "port": {"type": "string", "minLength": 1}, "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "sourceLabels": {"type": "array", "items": _LABEL_NAME}, "targetLabel": _LABEL_NAME,
                            "action": {"enum": ["replace", "keep", "drop", "labelmap", "labeldrop", "labelkeep",
                                                "hashmod", "lowercase", "uppercase", "keepequal", "dropequal"]},
                            "regex": {"type": "string"}, "replacement": {"type": "string"},
                            "separator": {"type": "string"}, "modulus": {"type": "integer"}}}}}}},
        }},
    },
}


# The subset of monitoring.coreos.com/v1 PrometheusRule that k8s/monitoring uses (the operator's API reference).
PROMETHEUSRULE_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": PODMONITOR_SCHEMA["properties"]["metadata"],
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["name", "rules"], "properties": {
                    "name": {"type": "string", "minLength": 1}, "interval": _DURATION,
                    "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "additionalProperties": False, "required": ["expr"],
                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}], "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"type": ["string", "integer"]}, "for": _DURATION,
                            "labels": _STR_MAP, "annotations": _STR_MAP}}}}}}}},
    },
}


def podmonitor_scrape_problems(docs: list[dict]) -> list[str]:
    """Each PodMonitor selects every Ray pod of the RayServices in its namespace (head and each worker
    group) and no other workload's pods, on a container port named as its endpoint's, whose number is
    the group's ``metrics-export-port`` (KubeRay's default 8080 when unset): where Ray's metrics agent
    listens. matchExpressions are not evaluated (not used here)."""
    problems = []
    for pm in (d for d in docs if d["kind"] == "PodMonitor"):
        name, ns = pm["metadata"]["name"], pm["metadata"].get("namespace")
        wanted = pm["spec"]["selector"].get("matchLabels", {})

        def selected(template: dict) -> bool:
            labels = (template.get("metadata") or {}).get("labels") or {}
            return all(labels.get(k) == v for k, v in wanted.items())

        services = [d for d in docs if d["kind"] == "RayService" and d["metadata"].get("namespace") == ns]
        if not services:
            problems.append(f"{name}: no RayService in namespace {ns}")
        for rs in services:
            for group, spec, container in _ray_containers(rs["spec"]["rayClusterConfig"]):
                if not selected(spec["template"]):
                    problems.append(f"{name}: does not select the {group} pods")
                    continue
                port = int(spec.get("rayStartParams", {}).get("metrics-export-port", 8080))
                ports = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
                for endpoint in pm["spec"]["podMetricsEndpoints"]:
                    if ports.get(endpoint["port"]) != port:
                        problems.append(f"{name}: {group} has no container port {endpoint['port']!r} = "
                                        f"metrics-export-port {port} (ports: {ports})")
        for d in docs:
            if d["kind"] in ("StatefulSet", "Deployment", "DaemonSet") and d["metadata"].get("namespace") == ns \
                    and selected(d["spec"]["template"]):
                problems.append(f"{name}: also selects {d['kind']}/{d['metadata']['name']}")
    return problems


def document_problems(doc: dict) -> list[str]:
    """Schema problems of one rendered document (no imports)."""
    kind = doc.get("kind")
    if kind == "PodMonitor":
        return [f"podmonitor: {_error_text(e)}" for e in jsonschema.Draft202012Validator(PODMONITOR_SCHEMA).iter_errors(doc)]
    if kind == "PrometheusRule":
        return [f"prometheusrule: {_error_text(e)}"
                for e in jsonschema.Draft202012Validator(PROMETHEUSRULE_SCHEMA).iter_errors(doc)]
    if kind in CRD_FILES:
        problems = [f"crd: {_error_text(e)}" for e in crd_validator(kind).iter_errors(doc)]
        if kind == "RayService" and not problems:
            spec_validator = crd_validator("RayCluster", "ray.io/v1", part="spec")
            problems += [f"crd(RayCluster): {_error_text(e)}" for e in
                         spec_validator.iter_errors(doc["spec"]["rayClusterConfig"])]
            problems += serve_config_problems(_serve_config(doc), "serveConfigV2")
            if not problems:
                problems += rayservice_consistency_problems(doc) + head_placement_problems(doc)
        return problems
    problems = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"k8s {version}: {_error_text(e)}")
    return problems


# --------------------------------------------------------------------------- tests: rendering


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_and_every_document_validates(name):
    docs = rendered(name)
    assert docs
    problems = [f"{d['kind']}/{d['metadata']['name']}: {p}" for d in docs for p in document_problems(d)]
    assert problems == []


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renderer_agrees_with_kustomize_binary(name):
    binary = shutil.which("kustomize") or shutil.which("kubectl")
    if binary is None:
        pytest.skip("no kustomize / kubectl binary: only the Python renderer checked")
    cmd = [binary, "build" if binary.endswith("kustomize") else "kustomize", str(K8S / name)]
    theirs = {_key(d): d for d in yaml.safe_load_all(subprocess.run(cmd, check=True, capture_output=True,
                                                                     text=True, timeout=30).stdout) if d}
    ours = {_key(d): d for d in rendered(name)}
    assert ours == theirs


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_secret_reference_is_rendered_or_documented_as_external(name):
    docs = rendered(name)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    refs = set()

    def walk(node):
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                refs.add((node["secretKeyRef"]["name"], node["secretKeyRef"]["key"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(docs)
    assert refs
    for secret, key in refs:
        if secret in secrets:
            assert key in secrets[secret].get("stringData", {}) | secrets[secret].get("data", {}), (secret, key)
        else:
            assert secret in EXTERNAL_SECRETS[name], f"{secret} neither rendered nor documented as external"
            assert key in SECRET_KEYS[secret]


MONITORED = {"overlays/gpu": [], "overlays/cpu-demo": ["monitoring"]}  # overlay -> applied beside it


@pytest.mark.parametrize("name", sorted(MONITORED))
def test_podmonitor_scrapes_every_ray_pod_on_its_metrics_port(name):
    docs = rendered(name) + [d for extra in MONITORED[name] for d in render_kustomization(K8S / extra)]
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert len(monitors) == 1
    assert [p for d in monitors for p in document_problems(d)] == []
    assert podmonitor_scrape_problems(docs) == []


def test_broken_podmonitor_fails_for_the_reason_it_was_broken():
    docs = rendered("overlays/gpu")
    pm = next(d for d in docs if d["kind"] == "PodMonitor")
    rs = next(d for d in docs if d["kind"] == "RayService")
    worker = _ray_containers(rs["spec"]["rayClusterConfig"])[1]
    worker[2]["ports"] = [p for p in worker[2]["ports"] if p["name"] != "metrics"]
    assert podmonitor_scrape_problems(docs) == [
        f"rollout-service-ray: {worker[0]} has no container port 'metrics' = metrics-export-port 8080 "
        "(ports: {'serve': 8000})"]
    pm["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/part-of": "rollout-service"}
    assert any("also selects StatefulSet/" in p for p in podmonitor_scrape_problems(docs))
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    pm["spec"]["podMetricsEndpoints"][0]["scrape_interval"] = "15s"
    assert len(document_problems(pm)) == 2


# --------------------------------------------------------------------------- alert rules
ALERT_RULES = ROOT / "deployments" / "prometheus" / "rollout-service-alerts.yaml"


def test_the_alert_rules_ship_alike_in_both_places_and_query_only_series_that_exist():
    from rollout_service.metrics import METRICS

    groups = yaml.safe_load(ALERT_RULES.read_text())["groups"]
    (rule,) = [d for d in render_kustomization(K8S / "monitoring") if d["kind"] == "PrometheusRule"]
    assert document_problems(rule) == []
    assert rule["spec"]["groups"] == groups
    exported = {s for m in METRICS for s in m.exported_series()}
    exprs = [r["expr"] for g in groups for r in g["rules"]]
    used = {n for e in exprs for n in re.findall(r"\b(ray_[a-z_]+)", e)}
    assert used and used <= exported, used - exported
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("[") == e.count("]"), e


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (apt prometheus) not installed")
def test_promtool_accepts_the_alert_rules_and_they_fire_on_drift_only(tmp_path):
    """promtool's rule unit test: synthetic series as the canary exports them (two replica processes of
    engine slot 0, WorkerId apart; a healthy slot 1): the drift alert fires for slot 0 only once the
    share above the threshold has stayed over 1 % for its 10 minutes, and the max alert on a 0.9 max."""
    check = subprocess.run(["promtool", "check", "rules", str(ALERT_RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    series = {
        # per minute: 1000 tokens, 50 above the threshold on slot 0 (5 %), none on slot 1
        'ray_rollout_service_canary_tokens_total{engine="0",WorkerId="a"}': "0+500x40",
        'ray_rollout_service_canary_tokens_total{engine="0",WorkerId="b"}': "0+500x40",
        'ray_rollout_service_canary_tokens_above_threshold_total{engine="0",WorkerId="a"}': "0+25x40",
        'ray_rollout_service_canary_tokens_above_threshold_total{engine="0",WorkerId="b"}': "0+25x40",
        'ray_rollout_service_canary_tokens_total{engine="1",WorkerId="a"}': "0+1000x40",
        'ray_rollout_service_canary_tokens_above_threshold_total{engine="1",WorkerId="a"}': "0+0x40",
        'ray_rollout_service_canary_max_abs_diff{engine="0",WorkerId="a"}': "0.9x40",
        'ray_rollout_service_canary_max_abs_diff{engine="1",WorkerId="a"}': "0.000002x40",
        'ray_rollout_service_canary_checked_total{engine="0",WorkerId="a"}': "0+10x40",
        'ray_rollout_service_canary_skipped_total{reason="version_moved",WorkerId="a"}': "0+1x40",
    }
    drift = {"severity": "warning", "engine": "0"}
    tests = {"rule_files": [str(ALERT_RULES)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": k, "values": v} for k, v in series.items()],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "RolloutServiceParityDrift", "exp_alerts": []},  # pending
            {"eval_time": "25m", "alertname": "RolloutServiceParityDrift", "exp_alerts": [{"exp_labels": drift}]},
            {"eval_time": "25m", "alertname": "RolloutServiceParityBroken",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "engine": "0"}}]},
            {"eval_time": "35m", "alertname": "RolloutServiceCanaryChecksNothing", "exp_alerts": []},
        ]}, {
        # a canary that has never checked anything (no checked series at all) fires; a max that went
        # back to normal (the gauge covers 5 minutes) lets the critical alert clear
        "interval": "1m",
        "input_series": [
            {"series": 'ray_rollout_service_canary_skipped_total{reason="temperature_without_top_k",WorkerId="a"}',
             "values": "0+3x60"},
            {"series": 'ray_rollout_service_canary_max_abs_diff{engine="0",WorkerId="a"}', "values": "0.9x10 0.000001x50"},
        ],
        "alert_rule_test": [
            {"eval_time": "45m", "alertname": "RolloutServiceCanaryChecksNothing",
             "exp_alerts": [{"exp_labels": {"severity": "info"}}]},
            {"eval_time": "8m", "alertname": "RolloutServiceParityBroken",
             "exp_alerts": [{"exp_labels": {"severity": "critical", "engine": "0"}}]},
            {"eval_time": "30m", "alertname": "RolloutServiceParityBroken", "exp_alerts": []},
        ]}]}
    for t in (t for block in tests["tests"] for t in block["alert_rule_test"]):  # promtool compares annotations too
        for a in t["exp_alerts"]:
            a["exp_annotations"] = _annotations(t["alertname"], a["exp_labels"], t["eval_time"])
    path = tmp_path / "alerts_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def _annotations(alert: str, labels: dict, _eval_time: str) -> dict:
    """The rule's annotations rendered for ``labels`` as promtool renders them ($value: the series value)."""
    (rule,) = [r for g in yaml.safe_load(ALERT_RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == alert]
    value = {"RolloutServiceParityDrift": "5%", "RolloutServiceParityBroken": "0.9"}.get(alert, "")
    out = {}
    for k, v in rule["annotations"].items():
        v = v.replace("{{ $labels.engine }}", labels.get("engine", ""))
        v = v.replace("{{ $value | humanizePercentage }}", value).replace("{{ $value }}", value)
        out[k] = v
    return out


def test_demo_redis_url_names_a_rendered_service():
    docs = rendered("overlays/cpu-demo")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    url = secret["stringData"]["redis-url"]
    host, _, port = url.removeprefix("redis://").split("/")[0].partition(":")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert host in services
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]


@pytest.mark.parametrize("name", ["overlays/cpu-demo", "overlays/gpu"])
def test_redis_refuses_writes_below_its_container_limit_instead_of_being_oom_killed(name):
    assert redis_memory_problems(_redis(name)) == []


def redis_memory_problems(sts: dict) -> list[str]:
    """maxmemory set, with noeviction, and at most 80% of the container's memory limit: the rest is
    for the AOF rewrite's fork (copy-on-write), client buffers and fragmentation."""
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    if "--maxmemory" not in args:
        return ["redis: no --maxmemory: a full Redis is OOM-killed instead of refusing writes"]
    problems = []
    if args[args.index("--maxmemory-policy") + 1] != "noeviction":
        problems.append("redis: maxmemory-policy is not noeviction: a full Redis would drop rollouts")
    cap, limit = _redis_bytes(args[args.index("--maxmemory") + 1]), _quantity(container["resources"]["limits"]["memory"])
    if cap <= 0 or cap > 0.8 * limit:
        problems.append(f"redis: maxmemory {cap} not within 80% of the container limit {limit:.0f}")
    return problems


def demo_requests() -> dict[str, float]:
    """What the CPU demo's pods request in total (head, worker replicas, Redis)."""
    total = {"cpu": 0.0, "memory": 0.0}
    for doc in rendered("overlays/cpu-demo"):
        if doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            pods = [(1, cluster["headGroupSpec"])] + [(g["replicas"], g) for g in cluster["workerGroupSpecs"]]
            specs = [(n, g["template"]["spec"]) for n, g in pods]
        elif doc["kind"] == "StatefulSet":
            specs = [(doc["spec"]["replicas"], doc["spec"]["template"]["spec"])]
        else:
            continue
        for n, spec in specs:
            for c in spec["containers"]:
                for key in total:
                    total[key] += n * _quantity(c["resources"]["requests"][key])
    return total


def test_cpu_demo_requests_fit_the_documented_node():
    need = demo_requests()
    for key in ("cpu", "memory"):
        assert need[key] <= DEMO_NODE[key] - DEMO_SYSTEM_RESERVE[key], (key, need)
    text = (K8S / "overlays" / "cpu-demo" / "kustomization.yaml").read_text()
    assert f"{DEMO_NODE['cpu']:.0f} CPUs and {DEMO_NODE['memory'] // 2**30} GiB" in text
    assert f"request {need['cpu']:.0f} CPUs and {need['memory'] / 2**30:.0f} GiB" in text
    assert f"{DEMO_NODE['cpu']:.0f} CPUs and {DEMO_NODE['memory'] // 2**30} GiB" in (ROOT / "docs" / "deployment.md").read_text()


def test_dockerfile_builds_on_the_installed_ray_and_every_documented_build_argument_exists():
    text = DOCKERFILE.read_text()
    declared = {line.split()[1].split("=")[0] for line in text.splitlines() if line.startswith("ARG ")}
    assert f"FROM rayproject/ray:{ray.__version__}-py311-${{FLAVOR}}" in text
    mentioned = set()
    for path in [*K8S.rglob("*.yaml"), DOCKERFILE, ROOT / "docs" / "deployment.md", ROOT / "README.md"]:
        mentioned |= set(re.findall(r"--build-arg\s+([A-Za-z_]+)=", path.read_text()))
        assert not re.search(r"\bEXTRA=(cpu|gpu)\b", path.read_text()), f"{path}: the Dockerfile's argument is FLAVOR"
    assert mentioned and mentioned <= declared, mentioned - declared


@pytest.mark.parametrize("name", ["overlays/cpu-demo", "overlays/gpu"])
def test_redis_keeps_an_append_only_file_on_a_persistent_volume(name):
    (sts,) = [d for d in rendered(name) if d["kind"] == "StatefulSet"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    data_dir = args[args.index("--dir") + 1]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts[data_dir] in [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]]


# --------------------------------------------------------------------------- tests: Serve configs


def _deployment_files() -> list[Path]:
    """The Serve config files (``up-*.yaml`` are bare RolloutServiceConfig files for ``up --config``)."""
    return sorted(p for p in DEPLOYMENTS.glob("*.yaml") if not p.name.startswith("up-"))


def test_up_config_example_loads_as_up_loads_it():
    """`rollout-service up --config` takes a bare RolloutServiceConfig YAML (launcher.run_up: from_yaml)."""
    (path,) = DEPLOYMENTS.glob("up-*.yaml")
    config = RolloutServiceConfig.from_yaml(path)
    assert config.engine.device == "cuda" and config.engine.model and config.refit.backend == "nccl"
    assert config.engine.weight_transfer_backend == "nccl"
    assert serve_config_problems(yaml.safe_load(path.read_text()), path.name)  # not a Serve config
    assert f"up --config deployments/{path.name}" in path.read_text()
    assert f"deployments/{path.name}" in (ROOT / "docs" / "deployment.md").read_text()


def test_deployment_files_exist():
    names = {p.name for p in _deployment_files()}
    assert {"local-cpu.yaml", "single-node-gpu.yaml", "multi-node-gpu.yaml"} <= names


@pytest.mark.parametrize("path", _deployment_files(), ids=lambda p: p.name)
def test_serve_config_file_tells_how_to_run_the_haproxy_ingress(path):
    """The ingress is chosen by Ray's environment, not by a Serve config: each file says what to export."""
    text = path.read_text()
    for var, value in PROXY_ENV["haproxy"].items():
        assert re.search(rf"export .*{var}='?{re.escape(value)}'?", text), f"{path.name}: {var}={value}"


@pytest.mark.parametrize("path", _deployment_files(), ids=lambda p: p.name)
def test_serve_config_file_parses_with_ray_and_our_config(path):
    assert serve_config_problems(yaml.safe_load(path.read_text()), path.name) == []


def test_local_cpu_config_is_the_tiny_model_on_cpu():
    (app,) = yaml.safe_load((DEPLOYMENTS / "local-cpu.yaml").read_text())["applications"]
    config = RolloutServiceConfig.from_args(app["args"])
    assert config.engine.model is None and config.engine.device == "cpu"


def _import_paths() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in _deployment_files():
        for app in yaml.safe_load(path.read_text())["applications"]:
            found.setdefault(app["import_path"], []).append(f"deployments/{path.name}")
    for name in KUSTOMIZATIONS:
        for doc in rendered(name):
            if doc["kind"] == "RayService":
                for app in _serve_config(doc)["applications"]:
                    found.setdefault(app["import_path"], []).append(f"k8s/{name}")
    return found


@pytest.mark.parametrize("import_path", sorted(_import_paths()))
def test_serve_import_path_imports(import_path):
    """Every import_path of every Serve config names an attribute of an importable module."""
    module_name, _, attribute = import_path.partition(":")
    module = importlib.import_module(module_name)
    users = _import_paths()[import_path]
    assert getattr(module, attribute, None) is not None, f"{module_name} has no attribute {attribute} (used by {users})"


# --------------------------------------------------------------------------- tests: breakage


def _demo_rayservice() -> dict:
    (rs,) = [d for d in rendered("overlays/cpu-demo") if d["kind"] == "RayService"]
    return rs


def _with_args(rs: dict, edit: Callable[[dict], None]) -> dict:
    config = _serve_config(rs)
    edit(config["applications"][0]["args"])
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    return rs


def _with_serve(rs: dict, edit: Callable[[dict], None]) -> dict:
    config = _serve_config(rs)
    edit(config)
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    return rs


def _head(rs: dict) -> dict:
    return rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _worker_group(rs: dict) -> dict:
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]


def _worker_env(rs: dict) -> list:
    return _worker_group(rs)["template"]["spec"]["containers"][0]["env"]


RAYSERVICE_BREAKAGES = {
    "replicas is a string": (lambda rs: _worker_group(rs).update(replicas="two"), "crd: spec.rayClusterConfig.workerGroupSpecs.0.replicas"),
    "serveConfigV2 is a map": (lambda rs: rs["spec"].update(serveConfigV2={"applications": []}), "crd: spec.serveConfigV2"),
    "unknown spec field": (lambda rs: rs["spec"].update(serveConfig="x"), "crd: spec: Additional properties"),
    "unknown container field": (lambda rs: _head(rs).update(imagePullPolicyy="Always"), "Additional properties"),
    "unknown metadata field": (lambda rs: rs["metadata"].update(label={"a": "b"}), "crd: metadata"),
    "cpu limit is a list": (lambda rs: _head(rs)["resources"]["limits"].update(cpu=[1]), "crd: spec.rayClusterConfig.headGroupSpec"),
    "duplicate container name": (lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"].append(copy.deepcopy(_head(rs))), "duplicate item"),
    "worker group without groupName": (lambda rs: _worker_group(rs).pop("groupName"), "'groupName' is a required property"),
    "wrong kind": (lambda rs: rs.update(apiVersion="ray.io/v2"), "crd: apiVersion"),
    "unknown engine field": (lambda rs: _with_args(rs, lambda a: a["engine"].update(gpus=1)), "args: "),
    "engine device tpu": (lambda rs: _with_args(rs, lambda a: a["engine"].update(device="tpu")), "args: "),
    "tensor parallel on cpu": (lambda rs: _with_args(rs, lambda a: a["engine"].update(tensor_parallel_size=2)), "args: "),
    "unknown config section": (lambda rs: _with_args(rs, lambda a: a.update(engines={})), "args: "),
    "typo in serve application key": (lambda rs: _with_serve(rs, lambda c: c["applications"][0].update(route_prefx="/")), "serve: unknown key"),
    "bad proxy location": (lambda rs: _with_serve(rs, lambda c: c.update(proxy_location="Everywhere")), "serve: serveConfigV2:"),
    "override of an unknown deployment": (lambda rs: _with_serve(rs, lambda c: c["applications"][0].update(deployments=[{"name": "Engine"}])), "no deployment named"),
    "affinity replicas set outside the config": (lambda rs: _with_serve(rs, lambda c: c["applications"][0]["deployments"][-1].update(num_replicas=3)), "num_affinity_replicas"),
    "serve replica allowed on the head": (lambda rs: _with_serve(rs, lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].pop("resources")), "may run on the head"),
    "override drops the code's num_cpus": (lambda rs: _with_serve(rs, lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].pop("num_cpus")), "drops the code's {'num_cpus': 0}"),
    "head offers the worker resource": (lambda rs: rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update(resources='"{\\"rollout_worker\\": 1}"'), "placement: the head offers"),
    "worker group without the worker resource": (lambda rs: _worker_group(rs)["rayStartParams"].pop("resources"), "does not offer rollout_worker"),
    "more engines than worker CPUs": (lambda rs: _with_args(rs, lambda a: a["engine"].update(num_engines=64)), "consistency: engines need more CPUs"),
    "gpu engine on cpu images": (lambda rs: _with_args(rs, lambda a: a["engine"].update(device="cuda")), "consistency:"),
    "redis url not from a secret": (lambda rs: _head(rs).update(env=[{"name": "ROLLOUT_SERVICE_REDIS_URL", "value": "redis://x"}]), "lacks ROLLOUT_SERVICE_REDIS_URL"),
    "worker on serve's python proxy": (lambda rs: _worker_env(rs).__setitem__(slice(None), [e for e in _worker_env(rs) if e["name"] != "RAY_SERVE_ENABLE_HA_PROXY"]), "container lacks RAY_SERVE_ENABLE_HA_PROXY=1"),
    "haproxy balancing without the rollout header": (lambda rs: next(e for e in _head(rs)["env"] if e["name"] == "RAY_SERVE_HAPROXY_BALANCE_ALGORITHM").update(value="leastconn"), "head container lacks RAY_SERVE_HAPROXY_BALANCE_ALGORITHM"),
    "head on the stock ray image": (lambda rs: _head(rs).update(image="rayproject/ray:2.60.0-py311-cpu"), "consistency: head image rayproject/ray:2.60.0-py311-cpu is not the rollout-service image"),
    "image of another version": (lambda rs: _head(rs).update(image="registry.example.com/rollout-service:0.0.1-cpu"), "is not rollout-service:"),
}


def test_demo_rayservice_is_clean_before_it_is_broken():
    assert document_problems(_demo_rayservice()) == []


@pytest.mark.parametrize("breakage", list(RAYSERVICE_BREAKAGES))
def test_broken_rayservice_fails_for_the_reason_it_was_broken(breakage):
    edit, expected = RAYSERVICE_BREAKAGES[breakage]
    rs = _demo_rayservice()
    edit(rs)
    problems = document_problems(rs)
    assert any(expected in p for p in problems), problems


def test_int_or_string_accepts_both_an_integer_and_a_string_quantity():
    rs = _demo_rayservice()
    _head(rs)["resources"]["limits"].update(cpu=1, memory="3Gi")
    assert document_problems(rs) == []


def test_rayservice_field_that_ray_cluster_spec_lacks_is_caught_in_the_cluster_config():
    rs = _demo_rayservice()
    rs["spec"]["rayClusterConfig"]["headGroupSpec"]["replicas"] = 1
    assert any("headGroupSpec" in p for p in document_problems(rs))


def _redis(name: str = "overlays/cpu-demo") -> dict:
    (sts,) = [d for d in rendered(name) if d["kind"] == "StatefulSet"]
    return sts


BUILTIN_BREAKAGES = {
    "unknown container field": lambda s: s["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicyy="Always"),
    "replicas is a string": lambda s: s["spec"].update(replicas="one"),
    "unknown spec field": lambda s: s["spec"].update(volumeClaimTemplate=[]),
    "container without name": lambda s: s["spec"]["template"]["spec"]["containers"][0].pop("name"),
}


REDIS_MEMORY_BREAKAGES = {
    "no maxmemory": (lambda args: args.__delitem__(slice(args.index("--maxmemory"), args.index("--maxmemory") + 2)), "no --maxmemory"),
    "maxmemory at the limit": (lambda args: args.__setitem__(args.index("--maxmemory") + 1, "4gb"), "not within 80%"),
    "evicting policy": (lambda args: args.__setitem__(args.index("--maxmemory-policy") + 1, "allkeys-lru"), "not noeviction"),
}


@pytest.mark.parametrize("breakage", list(REDIS_MEMORY_BREAKAGES))
def test_broken_redis_memory_settings_fail(breakage):
    edit, expected = REDIS_MEMORY_BREAKAGES[breakage]
    sts = _redis()
    edit(sts["spec"]["template"]["spec"]["containers"][0]["args"])
    assert any(expected in p for p in redis_memory_problems(sts)), redis_memory_problems(sts)


@pytest.mark.parametrize("breakage", list(BUILTIN_BREAKAGES))
def test_broken_builtin_manifest_fails_strict_validation(breakage):
    sts = _redis()
    assert document_problems(sts) == []
    BUILTIN_BREAKAGES[breakage](sts)
    problems = document_problems(sts)
    assert problems and all(p.startswith("k8s ") for p in problems), problems


def test_broken_serve_config_file_fails():
    config = yaml.safe_load((DEPLOYMENTS / "local-cpu.yaml").read_text())
    config["applications"][0]["args"]["store"]["ttl_seconds"] = 0
    config["http_options"]["prot"] = 8000
    problems = serve_config_problems(config, "local-cpu.yaml")
    assert any(p.startswith("args: ") and "ttl_seconds" in p for p in problems)
    assert any("unknown key local-cpu.yaml.http_options.prot" in p for p in problems)


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages:\n  - name: x\n")
    with pytest.raises(NotImplementedError):
        render_kustomization(tmp_path)


def test_crd_converter_handles_preserve_unknown_fields_and_nullable():
    schema = crd_json_schema({
        "type": "object",
        "properties": {
            "free": {"type": "object", "properties": {"a": {"type": "string"}},
                     "x-kubernetes-preserve-unknown-fields": True},
            "closed": {"type": "object", "properties": {"a": {"type": "string"}}},
            "maybe": {"type": "string", "nullable": True},
            "port": {"x-kubernetes-int-or-string": True},
        },
    })
    validator = _Validator(schema)
    assert validator.is_valid({"free": {"a": "x", "b": 1}, "maybe": None, "port": 80})
    assert validator.is_valid({"port": "http"})
    assert not validator.is_valid({"closed": {"b": 1}})
    assert not validator.is_valid({"port": 1.5})
    with pytest.raises(ValueError):
        crd_json_schema({"type": "object", "x-kubernetes-something-new": True})
