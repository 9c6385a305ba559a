"""The Kubernetes manifests stay true to the code: every container's arguments parse
with its process's own flag parser, probes hit open routes on declared ports, grace
periods cover the drain, and the gateway names every scheduler replica."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from gateway import __main__ as gateway_main
from gateway.http_api import _OPEN_PATHS
from scheduler_svc import __main__ as scheduler_main

K8S = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "k8s"


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
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
                     "HorizontalPodAutoscaler"}
    assert {"Deployment", "StatefulSet", "Service"} <= kinds


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
