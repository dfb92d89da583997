"""deploy/kubernetes/, checked offline: schemas (strict) and the invariants between files."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml

MANIFEST_DIR = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
DEPLOYMENTS = ("deployment-gpu.yaml", "deployment-cpu.yaml")
EXPECTED_FILES = {
    *DEPLOYMENTS,
    "service-headless.yaml",
    "pdb.yaml",
    "secret-example.yaml",
    "kustomization.yaml",
}
# The oldest Kubernetes the manifests are meant for, and the newest the validator bundles.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# kustomize's own file: no Kubernetes API object, so no schema to validate it against.
NOT_API_OBJECTS = {("kustomize.config.k8s.io/v1beta1", "Kustomization")}
# After the HTTP drain the server still stops gRPC (grace up to 5 s), the engine and the
# gateway before it exits: SIGKILL must not land in the middle of that.
MIN_SHUTDOWN_MARGIN_SECONDS = 10

Manifest = dict[str, Any]


def load_file(name: str) -> list[Manifest]:
    text = (MANIFEST_DIR / name).read_text()
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


def load_one(name: str) -> Manifest:
    (doc,) = load_file(name)
    return doc


def api_objects() -> list[tuple[str, Manifest]]:
    return [
        (path.name, doc)
        for path in sorted(MANIFEST_DIR.glob("*.yaml"))
        for doc in load_file(path.name)
        if (doc["apiVersion"], doc["kind"]) not in NOT_API_OBJECTS
    ]


def container(deployment: Manifest) -> Manifest:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def init_container(deployment: Manifest) -> Manifest:
    (only,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return only


def quantity(text: str | int) -> float:
    """A Kubernetes quantity as a number: "250m" cores, "16Gi" bytes."""
    text = str(text)
    for suffix, factor in (("m", 1e-3), ("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


def arg_value(args: list[str], flag: str) -> str:
    """The value of `--flag=value` or `--flag value` in a container's args."""
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[i + 1]
    raise AssertionError(f"{flag} is not in the args {args}")


def container_port(deployment: Manifest, name: str) -> int:
    ports = {port["name"]: port["containerPort"] for port in container(deployment)["ports"]}
    return ports[name]


def pre_stop_sleep_seconds(deployment: Manifest) -> int:
    pre_stop = container(deployment)["lifecycle"]["preStop"]
    if "sleep" in pre_stop:  # the native sleep action (Kubernetes 1.30+)
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def pod_labels(deployment: Manifest) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def example_secret() -> Manifest:
    secret = load_one("secret-example.yaml")
    assert secret["kind"] == "Secret"
    return secret


# --- schemas ---------------------------------------------------------------------------


def test_the_manifest_directory_holds_the_expected_files() -> None:
    names = {path.name for path in MANIFEST_DIR.glob("*.yaml")}
    assert names == EXPECTED_FILES
    assert (MANIFEST_DIR / "README.md").is_file()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_api_object_validates_strictly(version: str) -> None:
    objects = api_objects()
    kinds = sorted(doc["kind"] for _, doc in objects)
    assert kinds == ["Deployment", "Deployment", "PodDisruptionBudget", "Secret", "Service"]
    for name, doc in objects:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            pytest.fail(f"{name}: {path}: {error.message} (Kubernetes {error.version})")


def _unknown_container_field(doc: Manifest) -> None:
    container(doc)["gpus"] = 1


def _replicas_as_string(doc: Manifest) -> None:
    doc["spec"]["replicas"] = "2"


def _probe_port_as_list(doc: Manifest) -> None:
    container(doc)["readinessProbe"]["httpGet"]["port"] = ["http"]


@pytest.mark.parametrize(
    "break_it", [_unknown_container_field, _replicas_as_string, _probe_port_as_list]
)
def test_a_broken_deployment_fails_validation(break_it: Callable[[Manifest], None]) -> None:
    broken = copy.deepcopy(load_one("deployment-gpu.yaml"))
    break_it(broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_kustomization_lists_one_variant_and_never_the_example_secret() -> None:
    kustomization = load_one("kustomization.yaml")
    resources: list[str] = kustomization["resources"]
    assert all((MANIFEST_DIR / name).is_file() for name in resources)
    assert [name for name in resources if name in DEPLOYMENTS] == ["deployment-gpu.yaml"]
    assert {"service-headless.yaml", "pdb.yaml"} <= set(resources)
    assert "secret-example.yaml" not in resources


# --- invariants between files --------------------------------------------------------------


def test_both_variants_are_the_same_deployment() -> None:
    gpu, cpu = (load_one(name) for name in DEPLOYMENTS)
    assert gpu["metadata"]["name"] == cpu["metadata"]["name"]
    assert gpu["spec"]["selector"] == cpu["spec"]["selector"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_service_pdb_and_deployment_select_the_pods(name: str) -> None:
    deployment = load_one(name)
    labels = pod_labels(deployment)
    service = load_one("service-headless.yaml")
    pdb = load_one("pdb.yaml")
    assert selects(deployment["spec"]["selector"]["matchLabels"], labels)
    assert selects(service["spec"]["selector"], labels)
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_the_ports_match_the_args_and_the_service(name: str) -> None:
    deployment = load_one(name)
    args = container(deployment)["args"]
    assert args[0] == "serve"
    assert arg_value(args, "--host") == "0.0.0.0"
    assert int(arg_value(args, "--port")) == container_port(deployment, "http")
    assert int(arg_value(args, "--grpc-port")) == container_port(deployment, "grpc")

    service = load_one("service-headless.yaml")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    # SRV records exist only for named ports: _http._tcp.zerohop.<ns>.svc.cluster.local
    by_name = {port["name"]: port for port in service["spec"]["ports"]}
    assert set(by_name) == {"http", "grpc"}
    for port_name, port in by_name.items():
        assert port["targetPort"] == port_name
        assert port["port"] == container_port(deployment, port_name)


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_probes_use_health_and_ready_on_the_http_port(name: str) -> None:
    server = container(load_one(name))
    expected_paths = {
        "startupProbe": "/health",
        "livenessProbe": "/health",
        "readinessProbe": "/ready",
    }
    for probe, path in expected_paths.items():
        assert server[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    # Loading a model takes minutes; liveness must not kill the pod meanwhile.
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_the_grace_period_covers_pre_stop_and_drain(name: str) -> None:
    deployment = load_one(name)
    drain_seconds = float(arg_value(container(deployment)["args"], "--drain-seconds"))
    pre_stop = pre_stop_sleep_seconds(deployment)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert pre_stop > 0
    assert grace >= pre_stop + drain_seconds + MIN_SHUTDOWN_MARGIN_SECONDS


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_prometheus_annotations_point_at_the_http_port(name: str) -> None:
    deployment = load_one(name)
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(container_port(deployment, "http"))


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_secret_references_exist_in_the_example_secret(name: str) -> None:
    deployment = load_one(name)
    server = container(deployment)
    secret = example_secret()
    secret_name, secret_keys = secret["metadata"]["name"], set(secret["stringData"])

    env = {var["name"]: var for var in server["env"]}
    metrics_ref = env["ZEROHOP_METRICS_KEY"]["valueFrom"]["secretKeyRef"]
    assert (metrics_ref["name"], metrics_ref["key"]) == (secret_name, "metrics-key")
    assert metrics_ref["key"] in secret_keys

    pod_spec = deployment["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    mounts = {mount["name"]: mount for mount in server["volumeMounts"]}
    jwt_files = []
    for volume_name, volume in volumes.items():
        if "secret" not in volume:
            continue
        assert volume["secret"]["secretName"] == secret_name
        mount = mounts[volume_name]
        assert mount["readOnly"] is True
        for item in volume["secret"]["items"]:
            assert item["key"] in secret_keys
            jwt_files.append(f"{mount['mountPath']}/{item['path']}")
    assert arg_value(server["args"], "--jwt-public-key") in jwt_files


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_writable_paths_are_empty_dirs_on_a_read_only_root(name: str) -> None:
    deployment = load_one(name)
    pod_spec = deployment["spec"]["template"]["spec"]
    server = container(deployment)
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert server["securityContext"]["readOnlyRootFilesystem"] is True

    empty_dirs = {volume["name"] for volume in pod_spec["volumes"] if "emptyDir" in volume}
    writable = {
        mount["mountPath"] for mount in server["volumeMounts"] if mount["name"] in empty_dirs
    }
    env = {var["name"]: var.get("value") for var in server["env"]}
    keys_db_dir = str(Path(arg_value(server["args"], "--keys-db")).parent)
    for path in (env["XDG_CACHE_HOME"], env["XDG_DATA_HOME"], keys_db_dir, "/tmp"):
        assert path in writable, path


def test_the_gpu_deployment_takes_one_gpu_per_replica() -> None:
    limits = container(load_one("deployment-gpu.yaml"))["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 1


def test_the_cpu_deployment_spreads_over_nodes_and_asks_for_no_gpu() -> None:
    deployment = load_one("deployment-cpu.yaml")
    assert "nvidia.com/gpu" not in container(deployment)["resources"]["limits"]
    anti_affinity = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (preferred,) = anti_affinity["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"], pod_labels(deployment))


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_num_threads_matches_the_cpu_limit(name: str) -> None:
    server = container(load_one(name))
    cpu_limit = str(server["resources"]["limits"]["cpu"])
    cores = int(cpu_limit[:-1]) / 1000 if cpu_limit.endswith("m") else float(cpu_limit)
    assert int(arg_value(server["args"], "--num-threads")) == cores


# --- the fleet store: its URL from the Secret, its schema from an initContainer -------------


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_the_store_url_comes_from_the_secret_and_may_be_absent(name: str) -> None:
    deployment = load_one(name)
    secret = example_secret()
    from_secret = {
        "secretKeyRef": {"name": secret["metadata"]["name"], "key": "store-url", "optional": True}
    }
    for each in (container(deployment), init_container(deployment)):
        env = {var["name"]: var for var in each["env"]}
        assert env["ZEROHOP_STORE"] == {"name": "ZEROHOP_STORE", "valueFrom": from_secret}
        # The URL carries the password: never in args (visible in `ps`) nor in the manifest.
        assert not any(arg.startswith("--store") or "://" in arg for arg in each["args"])
    url = urlsplit(secret["stringData"]["store-url"])
    assert url.scheme == "postgresql" and url.password == "REPLACE-ME"
    assert parse_qs(url.query)["sslmode"] == ["verify-full"]


@pytest.mark.parametrize("name", DEPLOYMENTS)
def test_an_init_container_migrates_the_store_with_the_servers_image(name: str) -> None:
    deployment = load_one(name)
    server, migrate = container(deployment), init_container(deployment)
    assert [*migrate["command"], *migrate["args"]] == ["zerohop", "store", "migrate"]
    assert migrate["image"] == server["image"]  # the schema this server version needs
    assert migrate["securityContext"] == server["securityContext"]
    # Cheap, and requests == limits as for the server, or the pod loses Guaranteed QoS.
    for each in (server, migrate):
        requests, limits = each["resources"]["requests"], each["resources"]["limits"]
        assert {k: limits[k] for k in ("cpu", "memory")} == requests, each["name"]
    for resource in ("cpu", "memory"):
        mine = quantity(migrate["resources"]["limits"][resource])
        assert mine <= quantity(server["resources"]["limits"][resource]) / 4, resource
    # HOME on a writable volume of the pod (the root filesystem is read-only).
    pod_spec = deployment["spec"]["template"]["spec"]
    empty_dirs = {volume["name"] for volume in pod_spec["volumes"] if "emptyDir" in volume}
    writable = {m["mountPath"] for m in migrate["volumeMounts"] if m["name"] in empty_dirs}
    env = {var["name"]: var.get("value") for var in migrate["env"]}
    assert env["HOME"] in writable


def test_the_readme_tells_how_to_run_a_fleet_on_one_store() -> None:
    readme = (MANIFEST_DIR / "README.md").read_text()
    assert "\n## One fleet, one set of keys\n" in readme
    section = readme.split("\n## One fleet, one set of keys\n", 1)[1].split("\n## ", 1)[0]
    for needed in ("store-url", "zerohop store migrate", "synchronous", "pgbouncer",
                   "LISTEN", "zerohop audit verify"):  # fmt: skip
        assert needed in section, needed
