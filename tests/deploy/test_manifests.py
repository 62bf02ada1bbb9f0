"""deploy/k8s renders (overlays cpu and gpu) and every object validates offline: the built-in kinds against the
Kubernetes schemas of kubernetes-validate (strict: an unknown field fails), KEDA's ScaledObject and the Prometheus
Operator's ServiceMonitor against their CRDs vendored in deploy/schemas (unknown fields refused, as the API
server's strict field validation does). Then what no schema knows: references resolve, the commands parse with
Tidepool's own CLI, the settings are real ones, the grace periods fit the lease and the visibility timeout, and
the autoscaling follows metrics Tidepool exports, over the queues each pod consumes."""
import copy
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from tests.deploy import kustomize

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "deploy" / "schemas"
OVERLAYS = ["cpu", "gpu"]
# The oldest Kubernetes the manifests are for, and the newest the package knows.
K8S_VERSIONS = ["1.30", kv_utils.latest_version()]
CRDS = {("keda.sh", "ScaledObject"): SCHEMAS / "keda.sh_scaledobjects.yaml",
        ("monitoring.coreos.com", "ServiceMonitor"): SCHEMAS / "monitoring.coreos.com_servicemonitors.yaml"}
# Named by the manifests, made outside them: the Ingress's certificate (cert-manager or by hand).
EXTERNAL_SECRETS = {"tidepool-tls"}
# The trigger metadata KEDA's prometheus scaler reads (pkg/scalers/prometheus_scaler.go, prometheusMetadata, at
# v2.20.2, the release whose ScaledObject CRD is vendored); the first three are required.
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_METADATA = PROMETHEUS_REQUIRED | {"queryParameters", "activationThreshold", "namespace", "customHeaders",
                                             "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout",
                                             "identityOwner"}
PLANNER_METRIC = "tidepool:desired_workers"      # the fleet planner's (beat, service/ledger/fleet.py)


@functools.cache
def _rendered(overlay: str) -> tuple:
    return tuple(kustomize.render(K8S / "overlays" / overlay))


def rendered(overlay: str) -> list[dict]:
    return copy.deepcopy(list(_rendered(overlay)))


def find(objects, kind, name=None):
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    if name is not None:
        assert len(hits) == 1, f"{kind}/{name}: {len(hits)} objects"
        return hits[0]
    return hits


def workloads(objects):
    """(object, pod template) of every Deployment and Job."""
    return [(o, o["spec"]["template"]) for o in objects if o["kind"] in ("Deployment", "Job")]


def settings(objects) -> dict:
    config = find(objects, "ConfigMap", "tidepool-config")["data"]
    secret = find(objects, "Secret", "tidepool-secrets")["stringData"]
    return {**config, **secret}


def container_env(container, objects) -> dict:
    env = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(find(objects, "Secret", source["secretRef"]["name"])["stringData"])
    env.update({e["name"]: e.get("value") for e in container.get("env", []) if "value" in e})
    return env


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# -- rendering ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_overlay_renders_the_objects_of_a_deployment(overlay):
    objects = rendered(overlay)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    common = {("Deployment", "tidepool-web"), ("Service", "tidepool-web"), ("Ingress", "tidepool"),
              ("Deployment", "tidepool-beat"), ("Job", "tidepool-migrate"), ("ConfigMap", "tidepool-config"),
              ("Secret", "tidepool-secrets"), ("Deployment", "tidepool-worker-cpu"),
              ("ScaledObject", "tidepool-worker-cpu"), ("PodDisruptionBudget", "tidepool-web"),
              ("PodDisruptionBudget", "tidepool-worker-cpu"), ("ServiceMonitor", "tidepool-web"),
              ("ServiceMonitor", "tidepool-workers"), ("ConfigMap", "tidepool-grafana-dashboard"),
              ("Service", "tidepool-postgres"), ("Service", "tidepool-redis")}
    gpu = {("Deployment", "tidepool-worker-gpu"), ("ScaledObject", "tidepool-worker-gpu"),
           ("PodDisruptionBudget", "tidepool-worker-gpu")}
    assert common <= kinds, sorted(common - kinds)
    assert (gpu <= kinds) == (overlay == "gpu") and (gpu & kinds == set()) == (overlay == "cpu")
    assert {o["metadata"].get("namespace") for o in objects} == {"tidepool"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubectl_kustomize_renders_what_the_reader_renders(overlay):
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = [d for d in yaml.safe_load_all(done.stdout) if d]

    def key(o):
        return o["apiVersion"], o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]

    assert sorted(map(key, theirs)) == sorted(map(key, rendered(overlay)))
    ours = {key(o): o for o in rendered(overlay)}
    for obj in theirs:
        assert obj == ours[key(obj)], f"{key(obj)} differs between kubectl kustomize and tests/deploy/kustomize.py"


def test_the_reader_refuses_what_it_does_not_render(tmp_path):
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\ndata: {}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [cm.yaml]\n"
        "commonLabels: {a: b}\n")
    with pytest.raises(kustomize.KustomizeError, match="commonLabels"):
        kustomize.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [cm.yaml]\npatches:\n"
        "  - target: {kind: ConfigMap, name: a}\n    patch: |-\n      metadata: {labels: {a: b}}\n")
    with pytest.raises(kustomize.KustomizeError, match="strategic"):
        kustomize.render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [cm.yaml]\npatches:\n"
        "  - target: {kind: ConfigMap, name: b}\n    patch: |-\n      - {op: add, path: /data/x, value: y}\n")
    with pytest.raises(kustomize.KustomizeError, match="matches nothing"):
        kustomize.render(tmp_path)


# -- schemas -----------------------------------------------------------------------------------------------------

def _closed(node):
    """The CRD schema with unknown fields refused wherever it lists the fields (the API server's strict field
    validation, `kubectl apply --validate=strict`); maps and preserved-unknown-fields nodes stay open."""
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            _closed(value)
    elif isinstance(node, list):
        for value in node:
            _closed(value)
    return node


@functools.cache
def crd_validator(group: str, kind: str, version: str):
    crd = yaml.safe_load(CRDS[(group, kind)].read_text())
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    assert version in served, f"{kind} {group}/{version} is not served by the vendored CRD"
    schema = _closed(copy.deepcopy(served[version]["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_its_schema(overlay):
    errors = []
    for obj in rendered(overlay):
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        group, _, version = obj["apiVersion"].rpartition("/")
        if (group, obj["kind"]) in CRDS:
            errors += [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"
                       for e in crd_validator(group, obj["kind"], version).iter_errors(obj)]
            continue
        for k8s in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, k8s, strict=True)
            except kubernetes_validate.ValidationError as e:
                errors.append(f"{name} (Kubernetes {k8s}): {'.'.join(map(str, e.path))}: {e.message}")
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{name}: {e.message}")
    assert not errors, "\n".join(errors)


def test_the_schema_checks_fail_on_a_wrong_field():
    objects = rendered("gpu")
    deployment = find(objects, "Deployment", "tidepool-worker-gpu")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessprobe"):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)
    scaled = find(objects, "ScaledObject", "tidepool-worker-gpu")
    scaled["spec"]["minReplicas"] = 1
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    messages = [e.message for e in crd_validator("keda.sh", "ScaledObject", "v1alpha1").iter_errors(scaled)]
    assert any("minReplicas" in m for m in messages) and any("is not of type 'string'" in m for m in messages)
    monitor = find(objects, "ServiceMonitor", "tidepool-web")
    monitor["spec"]["endpoints"][0]["bearerTokenFile"] = 5
    assert list(crd_validator("monitoring.coreos.com", "ServiceMonitor", "v1").iter_errors(monitor))


# -- references --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_resolves(overlay):
    objects = rendered(overlay)
    names = {kind: {o["metadata"]["name"] for o in find(objects, kind)}
             for kind in ("ConfigMap", "Secret", "Service", "PersistentVolumeClaim", "Deployment")}
    secrets = {o["metadata"]["name"]: o.get("stringData", {}) for o in find(objects, "Secret")}
    pods = workloads(objects)
    problems = []
    for owner, template in pods:
        spec, where = template["spec"], f"{owner['kind']}/{owner['metadata']['name']}"
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim is not None and claim not in names["PersistentVolumeClaim"]:
                problems.append(f"{where}: claim {claim}")
        for c in spec["containers"]:
            for source in c.get("envFrom", []):
                for ref, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                    if ref in source and source[ref]["name"] not in names[kind]:
                        problems.append(f"{where}: {kind} {source[ref]['name']}")
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where}: volume {mount['name']}")
            ports = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = c.get(probe, {}).get("httpGet", {}).get("port")
                if isinstance(port, str) and port not in ports:
                    problems.append(f"{where}: {probe} port {port}")
    for service in find(objects, "Service"):
        if service["spec"].get("type") == "ExternalName":
            continue
        matched = [t for _, t in pods if selects(service["spec"]["selector"], t["metadata"]["labels"])]
        if not matched:
            problems.append(f"Service/{service['metadata']['name']} selects no pod")
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            for t in matched:
                if isinstance(target, str) and not any(target == p["name"] for c in t["spec"]["containers"]
                                                       for p in c.get("ports", [])):
                    problems.append(f"Service/{service['metadata']['name']}: a pod without port {target}")
    for pdb in find(objects, "PodDisruptionBudget"):
        matched = [t for _, t in pods if selects(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])]
        if len(matched) != 1:
            problems.append(f"PodDisruptionBudget/{pdb['metadata']['name']} covers {len(matched)} workloads")
    for ingress in find(objects, "Ingress"):
        for tls in ingress["spec"].get("tls", []):
            if tls["secretName"] not in names["Secret"] | EXTERNAL_SECRETS:
                problems.append(f"Ingress: TLS secret {tls['secretName']}")
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                service = find(objects, "Service", backend["name"])
                if backend["port"]["name"] not in {p["name"] for p in service["spec"]["ports"]}:
                    problems.append(f"Ingress: port {backend['port']['name']} of {backend['name']}")
    for scaled in find(objects, "ScaledObject"):
        target = scaled["spec"]["scaleTargetRef"]
        deployment = find(objects, target["kind"], target["name"])
        if "replicas" in deployment["spec"]:
            problems.append(f"Deployment/{target['name']} sets replicas, which its ScaledObject owns")
        if not scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]:
            problems.append(f"ScaledObject/{scaled['metadata']['name']}: min above max")
    for monitor in find(objects, "ServiceMonitor"):
        services = [s for s in find(objects, "Service")
                    if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        if len(services) != 1:
            problems.append(f"ServiceMonitor/{monitor['metadata']['name']} selects {len(services)} Services")
        for endpoint in monitor["spec"]["endpoints"]:
            if services and endpoint["port"] not in {p["name"] for p in services[0]["spec"]["ports"]}:
                problems.append(f"ServiceMonitor/{monitor['metadata']['name']}: port {endpoint['port']}")
            credentials = endpoint.get("authorization", {}).get("credentials")
            if credentials and credentials["key"] not in secrets.get(credentials["name"], {}):
                problems.append(f"ServiceMonitor/{monitor['metadata']['name']}: secret key {credentials}")
    assert not problems, "\n".join(problems)


def test_the_web_scrape_carries_the_metrics_token():
    monitor = find(rendered("gpu"), "ServiceMonitor", "tidepool-web")
    endpoint, = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "tidepool-secrets",
                                                                           "key": "TIDEPOOL_METRICS_TOKEN"}}


# -- what the pods run -------------------------------------------------------------------------------------------

def _parse(args):
    from tidepool.workers.cli import build_parser
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(f"`tidepool {' '.join(args)}` does not parse") from None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_commands_are_tidepools_own(overlay):
    objects = rendered(overlay)
    procfile = dict(line.split(":", 1) for line in (ROOT / "Procfile").read_text().splitlines() if ":" in line)
    web = procfile["web"].replace("$PORT", "8000").split()
    for owner, template in workloads(objects):
        for c in template["spec"]["containers"]:
            if "command" in c:       # the web: the Procfile's line, as the image has gunicorn on PATH
                assert owner["metadata"]["name"] == "tidepool-web" and c["command"] + c["args"] == web
            else:                    # the image's ENTRYPOINT, tidepool
                _parse(c["args"])
    assert find(objects, "Job", "tidepool-migrate")["spec"]["template"]["spec"]["containers"][0]["args"] == \
        ["db", "upgrade"]
    assert find(objects, "Deployment", "tidepool-beat")["spec"]["template"]["spec"]["containers"][0]["args"] == \
        ["beat"]


def _worker(objects, name):
    deployment = find(objects, "Deployment", name)
    container, = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container, _parse(container["args"])


def test_gpu_workers_run_one_engine_on_one_gpu_from_the_cuda_image():
    objects = rendered("gpu")
    _, container, args = _worker(objects, "tidepool-worker-gpu")
    assert (args.command, args.kind, args.device) == ("worker", "gpu", "cuda")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("-cuda")
    _, fallback, args = _worker(objects, "tidepool-worker-cpu")
    assert (args.kind, args.device) == ("cpu", "cpu") and "nvidia.com/gpu" not in fallback["resources"]["limits"]
    others = [c["image"] for _, t in workloads(objects) for c in t["spec"]["containers"] if c is not container]
    assert others and not any(image.endswith("-cuda") for image in others)
    assert all("/" in image and ":" in image for image in others + [container["image"]]), \
        "an image the overlay did not point at a registry"


def test_cpu_only_deployments_serve_every_class_on_the_cpu():
    objects = rendered("cpu")
    _, _, args = _worker(objects, "tidepool-worker-cpu")
    assert (args.kind, args.device) == ("auto", "cpu")
    assert "nvidia.com/gpu" not in json.dumps(objects) and "-cuda" not in json.dumps(objects)
    assert find(objects, "ScaledObject", "tidepool-worker-cpu")["spec"]["minReplicaCount"] >= 1, \
        "the only engines of a CPU deployment scaled to zero leave online requests unanswered"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_readiness_is_the_metrics_port_the_worker_binds(overlay):
    objects = rendered(overlay)
    for deployment in find(objects, "Deployment"):
        if deployment["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") != "worker":
            continue
        container, = deployment["spec"]["template"]["spec"]["containers"]
        port, = [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"]
        assert container_env(container, objects)["TIDEPOOL_METRICS_PORT"] == str(port)
        assert container["readinessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_beat_is_one_replica_never_two():
    for overlay in OVERLAYS:
        beat = find(rendered(overlay), "Deployment", "tidepool-beat")
        assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_as_the_images_unprivileged_user(overlay):
    for owner, template in workloads(rendered(overlay)):
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        for c in spec["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


# -- settings ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_settings_are_real_ones_and_parse(overlay):
    from tidepool.service.ledger.settings import OTHER_VARIABLES, Config, variables
    objects = rendered(overlay)
    known = {name for name, _, _ in variables()} | {name for name, _, _ in OTHER_VARIABLES}
    for owner, template in workloads(objects):
        for c in template["spec"]["containers"]:
            env = container_env(c, objects)
            unknown = {k for k in env if k.startswith(("TIDEPOOL_", "PROMETHEUS_"))} - known
            assert not unknown, f"{owner['metadata']['name']}: not settings: {sorted(unknown)}"
            values = Config.env_values(env)         # SettingsError names a bad value
            assert values["database_url"].startswith("postgresql+psycopg://")
            assert values["redis_url"].startswith("redis://")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_models_are_mounted_read_only_where_tidepool_model_points(overlay):
    objects = rendered(overlay)
    model = Path(settings(objects)["TIDEPOOL_MODEL"])
    claim = find(objects, "PersistentVolumeClaim", "tidepool-models")
    assert claim["spec"]["accessModes"] == ["ReadOnlyMany"]
    mounted = []
    for owner, template in workloads(objects):
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        for c in template["spec"]["containers"]:
            for mount in c.get("volumeMounts", []):
                source = volumes[mount["name"]].get("persistentVolumeClaim", {})
                if source.get("claimName") == "tidepool-models":
                    assert mount.get("readOnly") is True and source.get("readOnly") is True
                    assert model.is_relative_to(mount["mountPath"]), f"TIDEPOOL_MODEL {model} is not on the mount"
                    mounted.append(owner["metadata"]["name"])
    workers = [d["metadata"]["name"] for d in find(objects, "Deployment") if "worker" in d["metadata"]["name"]]
    assert set(workers) | {"tidepool-web"} <= set(mounted)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_read_only_root_filesystems_have_the_folders_they_write(overlay):
    objects = rendered(overlay)
    env = settings(objects)
    for owner, template in workloads(objects):
        for c in template["spec"]["containers"]:
            if not c["securityContext"].get("readOnlyRootFilesystem"):
                continue
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            writes = ["/tmp"] + [v for k, v in container_env(c, objects).items() if k == "PROMETHEUS_MULTIPROC_DIR"]
            name = owner["metadata"]["name"]
            if name in ("tidepool-web", "tidepool-beat"):
                writes.append(env["TIDEPOOL_STORAGE_DIR"])
            if name == "tidepool-beat":
                writes.append(str(Path(env["TIDEPOOL_BEAT_SCHEDULE"]).parent))
            for folder in writes:
                assert folder in mounts, f"{name} writes {folder} on a read-only root filesystem"


# -- draining ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_periods_fit_the_lease_and_the_visibility_timeout(overlay):
    from gunicorn.config import GracefulTimeout
    from tidepool.service.ledger.settings import Config
    objects = rendered(overlay)
    values = Config.env_values(settings(objects))
    lease = values.get("lease_seconds", Config.lease_seconds)
    visibility = values.get("visibility_timeout", Config.visibility_timeout)
    for deployment in find(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        if "worker" in deployment["metadata"]["name"]:
            assert 2 * lease <= grace < visibility, f"{deployment['metadata']['name']}: grace {grace}"
    web = find(objects, "Deployment", "tidepool-web")["spec"]["template"]["spec"]
    pre_stop = int(web["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert web["terminationGracePeriodSeconds"] >= pre_stop + GracefulTimeout.default


# -- autoscaling -------------------------------------------------------------------------------------------------

def _reference_metrics() -> set[str]:
    text = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(tidepool:[a-z_]+)` \|", text, re.M))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaled_objects_follow_metrics_tidepool_exports_over_the_queues_the_pods_consume(overlay):
    from tidepool.service.ledger.models import ONLINE_CLASSES
    from tidepool.workers.worker import QUEUES, host_workers
    objects = rendered(overlay)
    served = Path(settings(objects)["TIDEPOOL_MODEL"]).name
    exported = _reference_metrics()
    assert {"tidepool:queue_depth", PLANNER_METRIC} <= exported
    for scaled in find(objects, "ScaledObject"):
        _, _, args = _worker(objects, scaled["spec"]["scaleTargetRef"]["name"])
        classes = {c for kind, _ in host_workers(args.kind, args.device) for c in QUEUES[kind]}
        pool = f"{served}/{'gpu' if args.device.startswith('cuda') else 'cpu'}"
        planner = depth = None
        for trigger in scaled["spec"]["triggers"]:
            meta = trigger["metadata"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            assert PROMETHEUS_REQUIRED <= set(meta) <= PROMETHEUS_METADATA, sorted(meta)
            float(meta["threshold"])
            assert re.match(r"(sum|max)\(", meta["query"]), "KEDA refuses a query that returns several series"
            metric, = set(re.findall(r"tidepool:[a-z_]+", meta["query"]))
            assert metric in exported, f"{metric} is not a metric Tidepool exports"
            if metric == PLANNER_METRIC:
                planner = meta
            else:
                depth = meta
        assert planner is not None and depth is not None
        assert f'pool="{pool}"' in planner["query"] and planner["threshold"] == "1"
        assert planner["ignoreNullValues"] == "true", "a plan older than PLAN_TTL is not exported: 0, not an error"
        # the queue backs the planner up for online work (the planner owns offline work and its deadlines: a batch
        # of 10,000 jobs must not scale a pool to its maximum); a pool without online classes counts its own queues
        labels = dict(re.findall(r'(\w+)=~"([^"]*)"', depth["query"]))
        expected = (classes & set(ONLINE_CLASSES)) or classes
        assert set(labels["sla_class"].split("|")) == expected, f"{scaled['metadata']['name']} counts other queues"
        assert set(labels["model"].split("|")) == {"", served}


# -- dashboards --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_dashboard_config_map_is_the_repositorys_dashboard(overlay):
    dashboard = find(rendered(overlay), "ConfigMap", "tidepool-grafana-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    text, = dashboard["data"].values()
    assert text == (ROOT / "web" / "grafana" / "tidepool-dashboard.json").read_text(), \
        "deploy/k8s/base/grafana/tidepool-dashboard.json differs from web/grafana/tidepool-dashboard.json: copy it"
    assert json.loads(text)["uid"]


# -- the fleet planner and the drain --------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_planners_pools_are_the_scaled_objects(overlay):
    """Each pool beat plans (TIDEPOOL_PLANNER_POOLS) is a ScaledObject's target with the same most workers, and
    each ScaledObject's pool is one beat plans."""
    from tidepool.service.ledger.fleet import parse_pools
    from tidepool.service.ledger.settings import Config
    objects = rendered(overlay)
    kinds = parse_pools(Config.env_values(settings(objects)).get("planner_pools", Config.planner_pools))
    scaled = {}
    for obj in find(objects, "ScaledObject"):
        _, _, args = _worker(objects, obj["spec"]["scaleTargetRef"]["name"])
        scaled["gpu" if args.device.startswith("cuda") else "cpu"] = obj["spec"]["maxReplicaCount"]
    assert scaled == kinds


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_drain_fits_inside_the_grace_period(overlay):
    """A worker drains for TIDEPOOL_DRAIN_GRACE_S, then hands back what still runs (its engine thread gets at most
    10 s to stop, the ledger writes a few more): all before the kubelet's SIGKILL."""
    from tidepool.service.ledger.settings import Config
    objects = rendered(overlay)
    drain = Config.env_values(settings(objects)).get("drain_grace_s", Config.drain_grace_s)
    for deployment in find(objects, "Deployment"):
        if "worker" in deployment["metadata"]["name"]:
            assert drain + 20 <= deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
