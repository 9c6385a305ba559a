"""The Kubernetes manifests stay true to the code: every container's arguments parse
with its process's own flag parser, probes hit open routes on declared ports, grace
periods cover the drain, and the gateway names every scheduler replica. The internal
planes are never open: every scheduler, executor and gateway container gets the
internal secret from the Secret, and the Dockerfile's default command keeps the
scheduler on loopback."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import yaml

from continuum.cli import build_parser
from gateway import __main__ as gateway_main
from gateway.http_api import _OPEN_PATHS
from protos import internal_auth
from scheduler_svc import __main__ as scheduler_main

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATION = "kustomization.yaml"
SERVICES = ("scheduler_svc", "executor_svc", "gateway")  # each needs the internal secret


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != KUSTOMIZATION:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def workloads() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents()
            if d["kind"] in ("Deployment", "StatefulSet")}


def containers() -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads().values()
            for c in w["spec"]["template"]["spec"]["containers"]]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_every_manifest_parses_and_names_a_known_kind():
    kinds = {d["kind"] for d in documents()}
    assert kinds <= {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget",
                     "HorizontalPodAutoscaler", "Secret"}
    assert {"Deployment", "StatefulSet", "Service", "Secret"} <= kinds


def test_the_kustomization_applies_every_manifest():
    kustomization = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert kustomization["kind"] == "Kustomization"
    expected = {p.name for p in K8S.glob("*.yaml")} - {KUSTOMIZATION}
    assert set(kustomization["resources"]) == expected


@pytest.mark.parametrize("workload,container", containers(),
                         ids=[c["name"] for _, c in containers()])
def test_container_arguments_parse_with_the_process_parser(workload, container):
    module = container["command"][-1]
    args = container["args"]
    if module == "gateway":
        config = gateway_main.parse_args(args)  # raises ConfigError / SystemExit if wrong
        assert config.http_port and config.port
    elif module == "scheduler_svc":
        scheduler_main.config_from(scheduler_main.parse_args(args))
    elif module == "executor_svc":
        from executor_svc import __main__ as executor_main

        config = executor_main.parse_args(args)
        assert config.kv_cache_bytes > 0
    else:
        pytest.fail(f"unknown process {module!r}")


def test_probes_hit_open_routes_on_declared_ports():
    for _, container in containers():
        ports = {p["containerPort"] for p in container.get("ports", [])}
        for kind in ("readinessProbe", "livenessProbe"):
            probe = container.get(kind)
            if probe is None:
                continue
            target = probe.get("httpGet") or probe.get("grpc")
            assert target["port"] in ports, (container["name"], kind)
            if "httpGet" in probe:
                # With API keys on, any other route would answer the kubelet 401.
                assert probe["httpGet"]["path"] in _OPEN_PATHS


def test_grace_periods_cover_the_drain():
    for workload, container in containers():
        args = container["args"]
        if "--grace-period" in args:
            grace = float(_flag(args, "--grace-period"))
            assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def test_gateway_names_every_scheduler_replica_and_the_pod_shares_its_socket():
    sets = {n: w for n, w in workloads().items() if w["kind"] == "StatefulSet"}
    [(name, replica)] = sets.items()
    service = replica["spec"]["serviceName"]
    pods = replica["spec"]["template"]["spec"]["containers"]
    scheduler = next(c for c in pods if c["command"][-1] == "scheduler_svc")
    executor = next(c for c in pods if c["command"][-1] == "executor_svc")
    port = _flag(scheduler["args"], "--port")
    expected = {f"{name}-{i}.{service}:{port}" for i in range(replica["spec"]["replicas"])}
    gateway = next(c for _, c in containers() if c["command"][-1] == "gateway")
    assert set(_flag(gateway["args"], "--scheduler").split(",")) == expected
    ipc = _flag(scheduler["args"], "--ipc")
    assert ipc == _flag(executor["args"], "--ipc")
    mounts = [{m["mountPath"] for m in c["volumeMounts"]} for c in (scheduler, executor)]
    assert all(ipc.removeprefix("ipc://").startswith(next(iter(m))) for m in mounts)
    headless = next(d for d in documents() if d["kind"] == "Service"
                    and d["metadata"]["name"] == service)
    assert headless["spec"]["clusterIP"] == "None"


def _secret_source(container: dict, secrets: dict[str, dict]) -> str | None:
    """Where the container's internal secret comes from, if anywhere a Secret holds it."""
    for env in container.get("env", []):
        if env["name"] == internal_auth.ENV_INSECURE:
            pytest.fail(f"{container['name']} opts out of internal auth")
        if env["name"] == internal_auth.ENV_SECRET:
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["key"] in secrets[ref["name"]].get("stringData", {}) | \
                secrets[ref["name"]].get("data", {}), ref
            return f"{ref['name']}/{ref['key']}"
        if env["name"] == internal_auth.ENV_SECRET_FILE:
            return env["value"]
    return None


def test_every_service_container_gets_the_internal_secret_from_a_secret():
    """No internal port without the secret: the scheduler binds 0.0.0.0 here, so a
    container that lacked it would either refuse to start or, worse, be open."""
    secrets = {d["metadata"]["name"]: d for d in documents() if d["kind"] == "Secret"}
    sources = set()
    for _, container in containers():
        assert container["command"][-1] in SERVICES
        source = _secret_source(container, secrets)
        assert source is not None, f"{container['name']} has no internal secret"
        sources.add(source)
    assert len(sources) == 1, "every plane must share one secret"


def test_the_placeholder_secret_is_refused():
    """An unedited deployment fails loudly instead of running on a published secret."""
    [secret] = [d for d in documents() if d["kind"] == "Secret"]
    with pytest.raises(internal_auth.SecretError, match="at least"):
        internal_auth.load_secret({internal_auth.ENV_SECRET: secret["stringData"]["secret"]})


def test_the_pod_shares_its_socket_in_a_private_subdirectory():
    [replica] = [w for w in workloads().values() if w["kind"] == "StatefulSet"]
    pod = replica["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in pod["containers"]:
        ipc = _flag(container["args"], "--ipc").removeprefix("ipc://")
        [mount] = {m["mountPath"] for m in container["volumeMounts"]}
        # The scheduler creates the socket's directory (0700) below the shared mount.
        assert pathlib.PurePath(ipc).parent.parent == pathlib.PurePath(mount)


def test_the_dockerfile_keeps_the_scheduler_on_loopback():
    text = (DEPLOY / "Dockerfile").read_text()
    [cmd] = re.findall(r"^CMD (\[.*\])$", text, re.MULTILINE)
    argv = json.loads(cmd)
    assert argv[:3] == ["python", "-m", "continuum"]
    parser, _ = build_parser()
    args = parser.parse_args(argv[3:])
    assert args.command == "serve" and args.scheduler_host == "127.0.0.1"
    [expose] = re.findall(r"^EXPOSE (.*)$", text, re.MULTILINE)
    assert str(args.scheduler_port) not in expose.split()
