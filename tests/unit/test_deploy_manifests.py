"""The Kubernetes example and the compose file: valid against their schemas (bundled, offline), and
the operational facts hold, read from the files and from the server's own code: the startup probe
allows a >= 30-minute load, readiness is /readyz and liveness /livez on the served port, the grace
period covers the drain, GPUs agree with tensor parallel, pods run as the image's non-root user, and
every name a manifest refers to (claims, secrets, volumes, services, pods) exists."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from eagle3.cli import build_parser
from eagle3.server import runtime, serve

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "docker" / "compose.yaml"
DOCS = ROOT / "docs" / "deploy.md"
MIN_LOAD_S = 30 * 60
IMAGE_UID = 10001  # USER in both Dockerfiles (tests/unit/test_dockerfiles.py checks it is the user created)
# After --drain-timeout-s: streams get ABORT_GRACE_S for their ERROR frame, the rest of shutdown at most
# SHUTDOWN_GRACE_S (server/runtime.py, server/serve.py; 0 if a later version drops the constant).
POST_DRAIN_S = float(getattr(runtime, "ABORT_GRACE_S", 0.0)) + float(getattr(serve, "SHUTDOWN_GRACE_S", 0.0))

Doc = dict[str, Any]


def documents() -> list[tuple[str, Doc]]:
    return [
        (f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
        for path in sorted(K8S_DIR.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]


def of_kind(kind: str) -> list[Doc]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def server_set() -> Doc:
    (found,) = of_kind("StatefulSet")
    return found


def pod_specs() -> list[tuple[str, Doc]]:
    return [(label, doc["spec"]["template"]["spec"]) for label, doc in documents() if "template" in doc.get("spec", {})]


def containers(pod: Doc) -> list[Doc]:
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def eagle3_args(container: Doc) -> Any:
    return build_parser().parse_args([str(a) for a in container["args"]])


def serve_container() -> Doc:
    (found,) = [c for c in containers(server_set()["spec"]["template"]["spec"]) if c["args"][0] == "serve"]
    return found


def project_version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


@pytest.mark.parametrize(("label", "doc"), documents(), ids=[label for label, _ in documents()])
def test_manifest_is_valid_kubernetes_strict(label, doc):
    kubernetes_validate.validate(doc, "1.37.0", strict=True)


def test_kubernetes_validation_catches_a_typo():
    job = of_kind("Job")[0]
    bad = {**job, "spec": {**job["spec"], "backofLimit": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.37.0", strict=True)


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    cmd = [exe, "--builtin-schema", "vendor.compose-spec", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_compose_is_valid_against_the_compose_spec(tmp_path):
    assert check_compose(COMPOSE).returncode == 0
    bad = tmp_path / "compose.yaml"
    bad.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_perod:"))
    result = check_compose(bad)
    assert result.returncode != 0 and "stop_grace_perod" in result.stdout


def test_server_probes():
    server = serve_container()
    port = eagle3_args(server).port
    (http,) = [p for p in server["ports"] if p["name"] == "http"]
    assert http["containerPort"] == port
    startup, readiness, liveness = server["startupProbe"], server["readinessProbe"], server["livenessProbe"]
    for probe in (startup, readiness, liveness):
        assert probe["httpGet"]["port"] in ("http", port)
    assert startup["httpGet"]["path"] == readiness["httpGet"]["path"] == "/readyz"
    assert liveness["httpGet"]["path"] == "/livez", "liveness must not depend on the model load"
    window_s = startup["failureThreshold"] * startup["periodSeconds"]
    assert window_s >= MIN_LOAD_S, f"startup probe allows only {window_s} s for the verifier load"


def test_server_grace_period_covers_the_drain():
    pod = server_set()["spec"]["template"]["spec"]
    server = serve_container()
    pre_stop_s = server.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    drain_s = eagle3_args(server).drain_timeout_s
    assert drain_s > 0
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + POST_DRAIN_S


def test_compose_stop_grace_covers_the_drain():
    server = yaml.safe_load(COMPOSE.read_text())["services"]["server"]
    drain_s = build_parser().parse_args([str(w) for w in server["command"]]).drain_timeout_s
    grace = re.fullmatch(r"(\d+)s", server["stop_grace_period"])
    assert grace and int(grace.group(1)) >= drain_s + POST_DRAIN_S
    assert f"docker stop -t {grace.group(1)} " in DOCS.read_text(), "docs/deploy.md stops with the same grace"


def test_gpus_match_tensor_parallel():
    server = serve_container()
    tp = eagle3_args(server).tensor_parallel_size
    assert tp == 8
    assert server["resources"]["requests"]["nvidia.com/gpu"] == server["resources"]["limits"]["nvidia.com/gpu"] == tp
    compose = yaml.safe_load(COMPOSE.read_text())["services"]["server"]
    compose_tp = build_parser().parse_args([str(w) for w in compose["command"]]).tensor_parallel_size
    (device,) = compose["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == compose_tp == tp


def test_server_has_a_memory_backed_shm():
    pod = server_set()["spec"]["template"]["spec"]
    (mount,) = [m for m in serve_container()["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert yaml.safe_load(COMPOSE.read_text())["services"]["server"]["shm_size"]


@pytest.mark.parametrize(("label", "pod"), pod_specs(), ids=[label for label, _ in pod_specs()])
def test_pods_run_as_the_image_user(label, pod):
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == IMAGE_UID
    for container in containers(pod):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert "ALL" in container["securityContext"]["capabilities"]["drop"]


@pytest.mark.parametrize(("label", "pod"), pod_specs(), ids=[label for label, _ in pod_specs()])
def test_references_resolve(label, pod):
    claims = {doc["metadata"]["name"] for doc in of_kind("PersistentVolumeClaim")}
    secret_keys = created_secret_keys()
    volumes = {v["name"]: v for v in pod["volumes"]}
    for volume in volumes.values():
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] in claims
        if "secret" in volume:
            name = volume["secret"]["secretName"]
            assert {i["key"] for i in volume["secret"].get("items", [])} <= secret_keys.get(name, set())
    for container in containers(pod):
        assert {m["name"] for m in container.get("volumeMounts", [])} <= set(volumes)
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secret_keys.get(ref["name"], set()), f"{label}: secret key {ref}"


def created_secret_keys() -> dict[str, set[str]]:
    """Secrets the docs tell the user to create: `kubectl create secret generic NAME --from-literal=K=V`."""
    text = re.sub(r"\\\n", " ", DOCS.read_text())
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if "kubectl create secret generic" in line:
            words = shlex.split(line)
            name = words[words.index("generic") + 1]
            keys = {w.split("=", 2)[1] for w in words if w.startswith("--from-literal=")}
            out[name] = keys
    assert out, "docs/deploy.md creates the API key secret"
    return out


def test_keys_file_is_the_mounted_secret():
    server = serve_container()
    keys_file = Path(eagle3_args(server).api_keys_file)
    pod = server_set()["spec"]["template"]["spec"]
    (mount,) = [m for m in server["volumeMounts"] if Path(m["mountPath"]) == keys_file.parent]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert keys_file.name in {i["path"] for i in volume["secret"]["items"]}


def test_services_select_the_server_pods():
    server = server_set()
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert server["spec"]["selector"]["matchLabels"].items() <= labels.items()
    services = {doc["metadata"]["name"]: doc for doc in of_kind("Service")}
    headless = services[server["spec"]["serviceName"]]["spec"]
    assert headless["clusterIP"] == "None", "per-pod DNS names need a headless Service"
    # a loading pod must answer 503 + Retry-After (the SDK waits) rather than not resolve (it gives up)
    assert headless["publishNotReadyAddresses"] is True
    port_names = {p["name"] for p in serve_container()["ports"]}
    for service in services.values():
        assert service["spec"]["selector"].items() <= labels.items()
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_extract_job_lists_existing_server_pods():
    server = server_set()
    (job,) = [d for d in of_kind("Job") if d["metadata"]["name"] == "eagle3-extract"]
    (extract,) = job["spec"]["template"]["spec"]["containers"]
    urls = eagle3_args(extract).server
    port = eagle3_args(serve_container()).port
    expected = {
        f"http://{server['metadata']['name']}-{i}.{server['spec']['serviceName']}:{port}"
        for i in range(server["spec"]["replicas"])
    }
    assert set(urls) == expected


def test_compose_wiring():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    for name, service in services.items():
        assert (ROOT / "docker" / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name
        assert service["image"].endswith(f":{project_version()}"), f"{name}: image tag = the project version"
        for volume in service.get("volumes", []):
            if isinstance(volume, str) and not volume.startswith((".", "/", "$")):
                assert volume.split(":")[0] in compose["volumes"], f"{name}: volume {volume}"
    server_port = build_parser().parse_args([str(w) for w in services["server"]["command"]]).port
    extract = build_parser().parse_args([str(w) for w in services["extract"]["command"]])
    assert extract.server == [f"http://server:{server_port}"]
    assert set(services["server"]["secrets"]) <= set(compose["secrets"])


def test_k8s_images_are_the_project_version():
    version = project_version()
    for label, pod in pod_specs():
        for container in containers(pod):
            image = container["image"]
            assert re.fullmatch(rf"registry\.example\.com/eagle3/(server|cpu):{re.escape(version)}", image), label
    assert serve_container()["image"].split("/")[-1].startswith("server:")
