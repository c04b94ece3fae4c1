"""deploy/base (the kustomize base): valid against the Kubernetes API schemas, offline, and wired as the
services behave — probes on the health names ServingState reports, the tokenizer pointed at the engine's
headless Service, termination grace covering the drain — plus docker-compose.yml's engine being scalable."""

from __future__ import annotations

import copy
import re
import socket
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from llmserve.engine.v1 import engine_pb2
from llmserve.textgen.v1 import textgen_pb2
from services.engine.serving import main as engine_main
from services.tokenizer import __main__ as tokenizer_main

REPO_ROOT = Path(__file__).resolve().parents[1]
BASE = REPO_ROOT / "deploy" / "base"
ENTRY_POINTS = {"engine": engine_main, "tokenizer": tokenizer_main}
HEALTH_NAMES = {"engine": engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name,
                "tokenizer": textgen_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name}
COMPONENTS = list(ENTRY_POINTS)
PUBLIC_PORT = 50051
OLDEST_KUBERNETES = "1.27"  # native gRPC probes went GA in 1.27
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources"}  # all that load_base() applies
CLUSTER_SCOPED = {"Namespace"}


def load_base() -> tuple[str, list[dict]]:
    """(namespace, objects): what `kustomize build deploy/base` renders for a kustomization that only lists
    resources and sets a namespace. Any other kustomization key fails here rather than being ignored."""
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))
    assert set(kustomization) <= KUSTOMIZATION_KEYS, f"not rendered by this test: {set(kustomization) - KUSTOMIZATION_KEYS}"
    namespace = kustomization["namespace"]
    objects = []
    for name in kustomization["resources"]:
        for document in yaml.safe_load_all((BASE / name).read_text(encoding="utf-8")):
            if document is not None:
                if document["kind"] not in CLUSTER_SCOPED:
                    document.setdefault("metadata", {})["namespace"] = namespace
                objects.append(document)
    return namespace, objects


@pytest.fixture(scope="module")
def base() -> tuple[str, list[dict]]:
    return load_base()


@pytest.fixture(scope="module")
def objects(base) -> dict[tuple[str, str], dict]:
    by_key = {(obj["kind"], obj["metadata"]["name"]): obj for obj in base[1]}
    assert len(by_key) == len(base[1]), "two objects share a kind and name"
    return by_key


def deployment(objects, component: str) -> dict:
    return objects[("Deployment", f"llmserve-{component}")]


def container(objects, component: str) -> dict:
    (only,) = deployment(objects, component)["spec"]["template"]["spec"]["containers"]
    return only


def pod_labels(objects, component: str) -> dict[str, str]:
    return deployment(objects, component)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def parsed_args(objects, component: str, namespace: str = "default"):
    """The container's command line as the service's own argparse reads it ($(VAR) expanded from env)."""
    spec = container(objects, component)
    env = {item["name"]: item.get("value", "") for item in spec.get("env", [])}
    env["POD_NAMESPACE"] = namespace  # the downward API's metadata.namespace
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg) for arg in spec["args"]]
    return ENTRY_POINTS[component].parse_args(args)


def prestop_sleep_s(spec: dict) -> int:
    command = spec.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    return int(command[1]) if command[:1] == ["sleep"] else 0


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text(encoding="utf-8"))["resources"])
    on_disk = {path.name for path in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.fixture
def no_network(monkeypatch):
    """kubernetes-validate must use the schemas it ships: any connection or DNS lookup fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access during validation: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, kubernetes_validate.latest_version()])
def test_every_object_validates_against_the_api_schema(base, version, no_network):
    with pytest.raises(AssertionError):
        socket.create_connection(("pypi.org", 443))  # the guard is in place
    for obj in base[1]:
        kubernetes_validate.validate(obj, version, strict=True)  # strict: unknown fields fail too


def test_the_schema_check_rejects_a_broken_manifest(objects, no_network):
    broken = copy.deepcopy(deployment(objects, "engine"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)
    broken = copy.deepcopy(deployment(objects, "engine"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("component", COMPONENTS)
def test_deployment_selects_its_own_pods_only(objects, component):
    spec = deployment(objects, component)["spec"]
    assert selects(spec["selector"]["matchLabels"], pod_labels(objects, component))
    for other in set(COMPONENTS) - {component}:
        assert not selects(spec["selector"]["matchLabels"], pod_labels(objects, other))


@pytest.mark.parametrize("component", COMPONENTS)
def test_probes_are_grpc_health_checks_on_the_serving_port(objects, component):
    spec = container(objects, component)
    port = parsed_args(objects, component).port
    assert [p["containerPort"] for p in spec["ports"] if p["name"] == "grpc"] == [port]
    expected = {"startupProbe": "", "livenessProbe": "", "readinessProbe": HEALTH_NAMES[component]}
    for probe, service in expected.items():
        assert set(spec[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert spec[probe]["grpc"] == {"port": port, "service": service}, probe


@pytest.mark.parametrize("component", COMPONENTS)
def test_metrics_are_served_declared_and_annotated_for_scraping(objects, component):
    metrics_port = parsed_args(objects, component).metrics_port
    assert metrics_port > 0
    assert [p["containerPort"] for p in container(objects, component)["ports"] if p["name"] == "metrics"] == [
        metrics_port]
    annotations = deployment(objects, component)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                           "prometheus.io/path": "/metrics"}


@pytest.mark.parametrize("component", COMPONENTS)
def test_service_listens_where_the_kubelet_and_other_pods_reach_it(objects, component):
    assert parsed_args(objects, component).host == "0.0.0.0", "probes and peers connect to the pod IP"


@pytest.mark.parametrize("component", COMPONENTS)
def test_service_selects_its_pods_and_targets_their_port(objects, component):
    service = objects[("Service", f"llmserve-{component}")]["spec"]
    assert selects(service["selector"], pod_labels(objects, component))
    for other in set(COMPONENTS) - {component}:
        assert not selects(service["selector"], pod_labels(objects, other))
    ports = container(objects, component)["ports"]
    (service_port,) = service["ports"]
    target = service_port["targetPort"]
    assert any(target in (port["containerPort"], port.get("name")) for port in ports)


def test_engine_service_is_headless_and_the_public_port_is_50051(objects):
    assert objects[("Service", "llmserve-engine")]["spec"]["clusterIP"] == "None"
    assert not objects[("Service", "llmserve-engine")]["spec"].get("publishNotReadyAddresses", False)
    assert objects[("Service", "llmserve-tokenizer")]["spec"]["ports"][0]["port"] == PUBLIC_PORT


def test_tokenizer_engine_argument_names_the_engine_service(base, objects):
    namespace = base[0]
    env = {item["name"]: item for item in container(objects, "tokenizer")["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    host, _, port = parsed_args(objects, "tokenizer", namespace).engine.rpartition(":")
    engine_service = objects[("Service", "llmserve-engine")]
    assert host == f"{engine_service['metadata']['name']}.{namespace}.svc.cluster.local"
    assert int(port) == engine_service["spec"]["ports"][0]["port"]


@pytest.mark.parametrize("component", COMPONENTS)
def test_termination_grace_covers_the_drain(objects, component):
    pod = deployment(objects, component)["spec"]["template"]["spec"]
    spec = container(objects, component)
    drain_s = prestop_sleep_s(spec) + parsed_args(objects, component).grace_period
    if component == "engine":  # after the grace period it waits for its core process to leave
        drain_s += engine_main.CORE_EXIT_TIMEOUT_S
    assert pod["terminationGracePeriodSeconds"] > drain_s


@pytest.mark.parametrize("component", COMPONENTS)
def test_liveness_outlasts_a_drain(objects, component):
    # A drain reports "" NOT_SERVING too (enter_graceful_shutdown): liveness must not restart a draining pod.
    probe = container(objects, component)["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] > parsed_args(objects, component).grace_period


def test_engine_startup_probe_allows_the_model_load(objects):
    probe = container(objects, "engine")["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= engine_main.CORE_START_TIMEOUT_S


@pytest.mark.parametrize("component", COMPONENTS)
def test_resources_are_requested_and_only_the_engine_takes_a_gpu(objects, component):
    resources = container(objects, component)["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and "memory" in resources["limits"]
    gpus = resources["limits"].get("nvidia.com/gpu")
    assert gpus == (1 if component == "engine" else None)
    assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus  # extended resources: requests == limits


@pytest.mark.parametrize("component", COMPONENTS)
def test_pods_run_unprivileged_with_a_read_only_root(objects, component):
    pod = deployment(objects, component)["spec"]["template"]["spec"]
    spec = container(objects, component)
    dockerfile = (REPO_ROOT / "docker" / f"{component}.Dockerfile").read_text(encoding="utf-8")
    assert pod["securityContext"]["runAsNonRoot"] is True
    if not re.search(r"^USER\s", dockerfile, re.MULTILINE):  # the image runs as root: the pod must pick a uid
        assert pod["securityContext"].get("runAsUser", 0) > 0
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    emptydirs = {volume["name"] for volume in pod["volumes"] if "emptyDir" in volume}
    writable = [mount["mountPath"] for mount in spec["volumeMounts"] if mount["name"] in emptydirs]
    env = {item["name"]: item["value"] for item in spec["env"] if "value" in item}
    written = ["/tmp", env["HOME"], env["XDG_CACHE_HOME"]]  # ~/.cache/llmserve: the CPU kernel's build
    written += [env[name] for name in ("LLMSERVE_CACHE_DIR", "TRITON_CACHE_DIR") if name in env]
    for path in written:
        assert any(path == root or path.startswith(root.rstrip("/") + "/") for root in writable), path


@pytest.mark.parametrize("component", COMPONENTS)
def test_a_disruption_budget_covers_each_deployment(base, objects, component):
    budgets = [obj for obj in base[1] if obj["kind"] == "PodDisruptionBudget"]
    labels = pod_labels(objects, component)
    covering = [pdb for pdb in budgets if selects(pdb["spec"]["selector"]["matchLabels"], labels)]
    assert len(covering) == 1
    assert "maxUnavailable" in covering[0]["spec"], "minAvailable: 1 would block draining a lone replica"


def test_every_budget_selects_existing_pods(base, objects):
    for pdb in (obj for obj in base[1] if obj["kind"] == "PodDisruptionBudget"):
        assert any(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(objects, c)) for c in COMPONENTS)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text(encoding="utf-8"))


@pytest.mark.parametrize("component", COMPONENTS)
def test_images_are_the_ones_compose_builds(objects, compose, component):
    assert container(objects, component)["image"] == compose["services"][component]["image"]
    with open(REPO_ROOT / "pyproject.toml", "rb") as file:
        version = tomllib.load(file)["project"]["version"]
    assert container(objects, component)["image"].endswith(f":{version}")


def test_compose_engine_can_be_scaled(compose):
    """`docker compose up --scale engine=N` needs no fixed container name and no host port on the engine."""
    engine = compose["services"]["engine"]
    assert "container_name" not in engine
    assert "ports" not in engine, "a published host port can be bound by one replica only"
