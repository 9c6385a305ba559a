"""The Kubernetes manifests stay true to the code, overlay by overlay (cpu, gpu; rendered
by tests/deploy/kustomize.py, the subset of kustomize deploy/k8s uses): every object is
valid against the Kubernetes 1.31 schemas (kubernetes-validate, strict), every
container's arguments parse with its process's own flag parser, probes hit open routes
and real probe targets on declared ports, grace periods cover the drain, the gateways
find the replicas through the headless Service, GPU pods ask for one GPU per
tensor-parallel rank, and the autoscaler's metric is one the gateway exports. The
internal planes are never open: every container gets the internal secret from the
Secret, only gateways reach the schedulers, only a labelled router of the namespace
reads the KV events, no NetworkPolicy admits another namespace's pods by a label they
can set, and the Dockerfile's default command keeps the scheduler on loopback."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import urllib.parse

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from continuum.cli import build_parser
from continuum.serve.config import Configs
from deploy import probe
from executor_svc.settings import parse_bytes
from gateway import __main__ as gateway_main
from gateway.api.http_api import _OPEN_PATHS
from gateway.metrics import GatewayMetrics
from gateway.routing.relay import END_S
from gateway.routing.replicas import split_dns
from protos.continuum.v1 import scheduler_pb2
from runtime import internal_auth
from scheduler_svc import __main__ as scheduler_main

from .kustomize import KUSTOMIZATION, render

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
OVERLAYS = ("cpu", "gpu", "cpu-standby")
KUBERNETES_VERSION = "1.31.0"  # the schemas the manifests are validated against
SERVICES = ("scheduler_svc", "executor_svc", "gateway")  # each needs the internal secret
# continuum/serve/supervisor.py gives the executor this long to stop once the drain is done.
EXECUTOR_STOP_S = 10
# The GIE CRDs: kubernetes-validate ships only the built-in kinds' schemas.
CRDS = {"InferencePool", "InferenceObjective"}


def overlay(name: str) -> list[dict]:
    return render(K8S / "overlays" / name)


def find(objects: list[dict], kind: str, name: str | None = None) -> dict:
    [obj] = [o for o in objects if o["kind"] == kind
             and (name is None or o["metadata"]["name"] == name)]
    return obj


def containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    return [(w, c) for w in objects if w["kind"] in ("Deployment", "StatefulSet")
            for c in w["spec"]["template"]["spec"]["containers"]]


ROLES = {"scheduler_svc": "scheduler", "executor_svc": "executor", "gateway": "gateway"}


def pod_container(objects: list[dict], module: str) -> dict:
    """The container that runs ``module`` under its role's name (the executor in service
    first, in a pod with a standby)."""
    [container] = [c for _, c in containers(objects)
                   if c["command"][-1] == module and c["name"] == ROLES[module]]
    return container


def executors(objects: list[dict]) -> list[dict]:
    """Every executor container of the replica pod: one, or two with a warm standby."""
    return [c for _, c in containers(objects) if c["command"][-1] == "executor_svc"]


def _own_probe(executor: dict, pod_executors: list[dict]) -> list[str]:
    """What an executor's probes add to ``executor``: nothing when it is the pod's only
    one; with a standby, its own --incarnation-file (so a hung one is not kept alive by
    the other having taken over)."""
    if len(pod_executors) == 1:
        return []
    return ["--incarnation-file", _flag(executor["args"], "--incarnation-file")]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _pod(objects: list[dict], kind: str) -> dict:
    return find(objects, kind)["spec"]["template"]["spec"]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, overlay(request.param)


def test_every_manifest_is_reachable_from_a_kustomization():
    """No orphan: every YAML file under deploy/k8s is a resource or a patch somewhere."""
    used = set()
    for kustomization in K8S.rglob(KUSTOMIZATION):
        used.add(kustomization)
        spec = yaml.safe_load(kustomization.read_text())
        for entry in spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]:
            target = (kustomization.parent / entry).resolve()
            used.add(target / KUSTOMIZATION if target.is_dir() else target)
    assert {p.resolve() for p in K8S.rglob("*.yaml")} == {p.resolve() for p in used}


def test_the_top_level_kustomization_is_the_cpu_overlay():
    assert render(K8S) == overlay("cpu")


@pytest.mark.parametrize("layout", [*OVERLAYS, "gie"])
def test_every_object_is_valid_against_the_kubernetes_schemas(layout):
    objects = render(K8S / "gie") if layout == "gie" else overlay(layout)
    for obj in objects:
        if obj["kind"] in CRDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            continue  # checked field by field in test_the_gie_pool_selects_the_gateways
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_misspelled_field():
    """The schema check is live: strict validation refuses what the API server would."""
    replica = find(overlay("cpu"), "StatefulSet")
    replica["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(replica, KUBERNETES_VERSION, strict=True)


def test_container_arguments_parse_with_the_process_parser(rendered):
    for _, container in containers(rendered[1]):
        module, args = container["command"][-1], container["args"]
        if module == "gateway":
            config = gateway_main.parse_args(args)  # raises ConfigError / SystemExit if wrong
            assert config.http_port and config.port
        elif module == "scheduler_svc":
            scheduler_main.parse_args(args)  # exits 2 if wrong
        elif module == "executor_svc":
            from executor_svc import __main__ as executor_main

            executor_main.parse_args(args)
        else:
            pytest.fail(f"unknown process {module!r}")


def _probe_argv(probe_spec: dict) -> list[str] | None:
    """deploy/probe.py's arguments if ``probe_spec`` runs it, else None."""
    command = probe_spec.get("exec", {}).get("command")
    if command is None:
        return None
    if command[:2] == ["sh", "-c"]:
        command = shlex.split(command[2].split(";")[0].removeprefix("while "))
    assert command[:2] == ["python", "/opt/continuum/src/deploy/probe.py"], command
    return [a for a in command[2:] if a != ">/dev/null"]


def test_every_replica_and_gateway_container_has_three_probes(rendered):
    for _, container in containers(rendered[1]):
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert kind in container, (container["name"], kind)


def test_probes_hit_open_routes_and_real_targets_on_declared_ports(rendered):
    objects = rendered[1]
    scheduler_port = int(_flag(pod_container(objects, "scheduler_svc")["args"], "--scheduler-port"))
    assert probe.DEFAULT_ADDRESS == f"127.0.0.1:{scheduler_port}"
    for _, container in containers(objects):
        ports = {p["containerPort"] for p in container.get("ports", [])}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = container[kind]
            argv = _probe_argv(spec)
            if argv is not None:
                # The container's own process is what the probe judges.
                assert argv[0] == ROLES[container["command"][-1]], (container["name"], kind)
                assert spec["timeoutSeconds"] > probe.DEFAULT_TIMEOUT_S
                continue
            target = spec.get("httpGet") or spec.get("grpc")
            assert target["port"] in ports, (container["name"], kind)
            if "httpGet" in spec:
                # With API keys on, any other route would answer the kubelet 401.
                assert spec["httpGet"]["path"] in _OPEN_PATHS
                # The gateway's probes use its probe listener, which a crowd of
                # clients on the API port cannot fill (gateway/edge/probes.py).
                if container["command"][-1] == "gateway":
                    assert target["port"] == int(_flag(container["args"], "--probe-port"))


def test_a_hung_executor_fails_liveness_but_a_waiting_scheduler_does_not(rendered):
    objects = rendered[1]
    pod_executors = executors(objects)
    for executor in pod_executors:
        own = _own_probe(executor, pod_executors)
        assert _probe_argv(executor["livenessProbe"]) == ["executor", "--unreachable-ok", *own]
        assert _probe_argv(executor["readinessProbe"]) == ["executor", *own]
        assert _probe_argv(executor["startupProbe"]) == ["executor", *own]
    scheduler = pod_container(objects, "scheduler_svc")
    # Liveness answers NOT_SERVING too (work and no executor); readiness wants SERVING.
    assert _probe_argv(scheduler["livenessProbe"]) == ["scheduler"]
    assert scheduler["readinessProbe"]["grpc"]["port"] == int(_flag(scheduler["args"],
                                                                    "--scheduler-port"))


def test_executor_liveness_outlasts_a_re_registration():
    """An executor the scheduler detached but that still runs says Hello again (every
    2 s, executor_svc/link.py) and is attached within seconds: liveness must give it
    that, and more than one heartbeat timeout, before the kubelet restarts it."""
    executor = pod_container(overlay("cpu"), "executor_svc")
    liveness = executor["livenessProbe"]
    window = liveness["periodSeconds"] * liveness["failureThreshold"]
    timeout_s = scheduler_main.parse_args(["--ipc", "ipc:///x"]).executor_heartbeat_timeout_s
    assert window > timeout_s + 2 * 2.0
    assert liveness["failureThreshold"] >= 2  # one slow probe is no strike


def test_the_probe_script_is_in_the_image_where_the_manifests_run_it():
    text = (DEPLOY / "Dockerfile").read_text()
    [workdir] = re.findall(r"^WORKDIR (.*)$", text, re.MULTILINE)
    assert "COPY deploy/probe.py deploy/probe.py" in text
    assert workdir == "/opt/continuum/src"


def test_grace_periods_cover_the_drain(rendered):
    objects = rendered[1]
    replica = _pod(objects, "StatefulSet")
    scheduler = pod_container(objects, "scheduler_svc")
    grace = float(_flag(scheduler["args"], "--grace-period"))
    # Scheduler drain (+1 s server stop), then the executor's stop.
    assert replica["terminationGracePeriodSeconds"] > grace + 1 + EXECUTOR_STOP_S
    for executor in executors(objects):
        assert _probe_argv(executor["lifecycle"]["preStop"]) == ["scheduler", "--timeout", "1"]
    assert "preStop" not in scheduler.get("lifecycle", {})  # it drains on SIGTERM at once
    gateway = pod_container(objects, "gateway")
    gateway_grace = float(_flag(gateway["args"], "--grace-period"))
    [sleep, seconds] = gateway["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep == "sleep"
    assert _pod(objects, "Deployment")["terminationGracePeriodSeconds"] > \
        float(seconds) + gateway_grace + END_S


def test_gateways_find_the_replicas_through_the_headless_service(rendered):
    objects = rendered[1]
    replica = find(objects, "StatefulSet")
    service = find(objects, "Service", replica["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # Gateways route by Stats; DNS must list a pod whose executor is (re)starting, and a
    # terminating one until it is gone, so its in-flight streams keep their channel.
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == replica["spec"]["template"]["metadata"]["labels"]
    scheduler = pod_container(objects, "scheduler_svc")
    port = int(_flag(scheduler["args"], "--scheduler-port"))
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port, *_reader_ports(
        scheduler)]
    declared = {p["containerPort"] for p in scheduler["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= declared
    gateway = pod_container(objects, "gateway")
    assert gateway_main.parse_args(gateway["args"]).scheduler_addresses == \
        [f"dns:///{service['metadata']['name']}:{port}"]
    assert split_dns(_flag(gateway["args"], "--scheduler")) == (service["metadata"]["name"],
                                                                port)


def test_the_pod_shares_its_socket_in_a_private_subdirectory(rendered):
    objects = rendered[1]
    pod = _pod(objects, "StatefulSet")
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    ipcs = set()
    for container in [pod_container(objects, "scheduler_svc"), *executors(objects)]:
        ipc = pathlib.PurePath(_flag(container["args"], "--ipc").removeprefix("ipc://"))
        ipcs.add(ipc)
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "ipc"]
        # The scheduler creates the socket's directory (0700) below the shared mount.
        assert ipc.parent.parent == pathlib.PurePath(mount["mountPath"])
    assert len(ipcs) == 1
    assert volumes["ipc"]["emptyDir"]["medium"] == "Memory"


def _quantity(text: str) -> int:
    """A Kubernetes memory quantity in bytes ("3Gi", "512Mi")."""
    return parse_bytes(text.removesuffix("i") + "iB" if text[-2:-1].isalpha() else text)


def _gpus(resources: dict) -> int:
    return int(resources.get("limits", {}).get("nvidia.com/gpu", 0))


def test_gpu_pods_get_a_gpu_per_rank_shared_memory_and_the_taint_tolerated():
    objects = overlay("gpu")
    pod = _pod(objects, "StatefulSet")
    executor = pod_container(objects, "executor_svc")
    from executor_svc import __main__ as executor_main

    config = executor_main.parse_args(executor["args"])
    assert config.device == "cuda"
    assert _gpus(executor["resources"]) == config.tp_size  # one GPU per rank
    assert executor["resources"]["requests"]["nvidia.com/gpu"] == config.tp_size
    [shm] = [m for m in executor["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    volume = {v["name"]: v for v in pod["volumes"]}[shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
    assert any(t["key"] == "nvidia.com/gpu" and t["effect"] == "NoSchedule"
               for t in pod["tolerations"])
    assert all(_gpus(c["resources"]) == 0 for _, c in containers(objects)
               if c is not executor)
    assert executor["image"].endswith("-cuda")


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_scheduler_and_every_executor_share_one_dev_shm_for_the_plan_ring(name):
    objects = overlay(name)
    pod = _pod(objects, "StatefulSet")
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {c["name"]: [m["name"] for m in c.get("volumeMounts", [])
                          if m["mountPath"] == "/dev/shm"]
              for c in pod["containers"] if c["name"] != "gateway"}
    assert len(mounts) >= 2 and all(m == ["dshm"] for m in mounts.values()), mounts
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_cpu_pods_fit_the_bundled_model_and_ask_for_no_gpu():
    objects = overlay("cpu")
    executor = pod_container(objects, "executor_svc")
    from executor_svc import __main__ as executor_main

    config = executor_main.parse_args(executor["args"])
    assert config.device == "cpu" and config.tp_size == 1
    assert all(_gpus(c["resources"]) == 0 for _, c in containers(objects))
    assert "tolerations" not in _pod(objects, "StatefulSet")
    # The KV pool, the float32 weights (~0.55 GB) and torch's working set fit the request.
    requested = _quantity(executor["resources"]["requests"]["memory"])
    assert requested >= config.kv_cache_bytes + (1 << 30)
    assert _quantity(executor["resources"]["limits"]["memory"]) > requested
    assert int(executor["resources"]["requests"]["cpu"]) >= (config.threads or 1)


def test_the_standby_pod_runs_two_interchangeable_executors():
    """deploy/k8s/overlays/cpu-standby: the same executor twice, both ``--standby``, so
    whichever registers first serves and a restarted one comes back as the standby; each
    probes for itself through an incarnation file no other container sees, and either
    gets a lone executor's request, since after a takeover the standby is the one in
    service (tests/deploy/test_probe.py runs this layout with real processes)."""
    from executor_svc import __main__ as executor_main

    objects = overlay("cpu-standby")
    pod_executors = executors(objects)
    assert len(pod_executors) == 2 and len({c["name"] for c in pod_executors}) == 2
    first, second = pod_executors
    configs = [executor_main.parse_args(c["args"]) for c in pod_executors]
    assert all(c.standby and c.incarnation_file for c in configs)
    for key in ("args", "image", "command", "env", "volumeMounts", "resources", "lifecycle",
                "startupProbe", "readinessProbe", "livenessProbe"):
        assert first[key] == second[key], key
    path = pathlib.PurePath(configs[0].incarnation_file)
    assert path.is_absolute()
    assert not any(path.is_relative_to(m["mountPath"]) for m in first["volumeMounts"])
    assert second["resources"] == pod_container(overlay("cpu"), "executor_svc")["resources"]
    for name in ("cpu", "gpu"):  # without a standby container none registers as one
        assert not any(executor_main.parse_args(c["args"]).standby
                       for c in executors(overlay(name)))


def test_every_container_requests_cpu_and_memory_and_caps_memory(rendered):
    for _, container in containers(rendered[1]):
        resources = container["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), container["name"]
        assert "memory" in resources["limits"], container["name"]


def test_only_gateways_reach_the_schedulers(rendered):
    objects = rendered[1]
    policy = find(objects, "NetworkPolicy")["spec"]
    replica_labels = find(objects, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    gateway_labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == replica_labels
    assert policy["policyTypes"] == ["Ingress"]
    rule, scrapers, routers = policy["ingress"]
    [source] = rule["from"]
    assert source == {"podSelector": {"matchLabels": gateway_labels}}
    scheduler = pod_container(objects, "scheduler_svc")
    # Gateways reach only the scheduler's gRPC port; the executor listens on none.
    assert rule["ports"] == [{"protocol": "TCP", "port": int(_flag(scheduler["args"],
                                                                   "--scheduler-port"))}]
    assert all("ports" not in executor for executor in executors(objects))
    # Prometheus (its own namespace) and labelled pods of ours reach /metrics; only the
    # labelled router of this namespace reaches the KV events (every tenant's tokens).
    metrics_port, kv_port = _reader_ports(scheduler)
    assert scrapers["ports"] == [{"protocol": "TCP", "port": metrics_port}]
    assert scrapers["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        {"podSelector": {"matchLabels": {"continuum.ai/replica-reader": "true"}}}]
    assert routers["ports"] == [{"protocol": "TCP", "port": kv_port}]
    assert routers["from"] == [
        {"podSelector": {"matchLabels": {"continuum.ai/kv-events-reader": "true"}}}]


def _reader_ports(scheduler: dict) -> list[int]:
    """The scheduler's /metrics and KV event ports, as its own parser reads its args;
    both bind off loopback (the KV stream only with its explicit opt-in)."""
    args = scheduler_main.parse_args(scheduler["args"])
    assert args.metrics_port > 0 and args.metrics_host == "0.0.0.0"
    kv = urllib.parse.urlsplit(args.kv_events_endpoint)
    assert kv.scheme == "tcp" and args.kv_events_allow_remote
    assert args.kv_events_topic.startswith("kv@$(POD_IP)@")  # llm-d's kv@<pod>@<model>
    assert any(e["name"] == "POD_IP" for e in scheduler["env"])
    return [args.metrics_port, kv.port]


def _exported_metric_names() -> set[str]:
    class Replica:
        healthy = True
        stats = scheduler_pb2.StatsResponse(num_total_blocks=8, num_free_blocks=4,
                                            num_waiting_by_tier=[1, 2, 3])

    page = GatewayMetrics("m", lambda: [("10.0.0.1:50061", Replica())]).render().decode()
    return {family.name for family in text_string_to_metric_families(page)}


def test_replicas_scale_on_a_queue_depth_the_gateway_exports(rendered):
    objects = rendered[1]
    hpa = find(objects, "HorizontalPodAutoscaler", "continuum-replica")["spec"]
    replica = find(objects, "StatefulSet")
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                     "name": replica["metadata"]["name"]}
    [metric] = hpa["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["target"]["type"] == "AverageValue"  # per replica
    adapter = yaml.safe_load(find(objects, "ConfigMap")["data"]["config.yaml"])
    [rule] = adapter["externalRules"]
    assert rule["name"]["as"] == metric["external"]["metric"]["name"]
    [series] = re.findall(r'__name__="([^"]+)"', rule["seriesQuery"])
    assert series in _exported_metric_names()
    assert re.fullmatch(rule["name"]["matches"], series)
    # Every gateway reports every replica: max over gateways, then the sum.
    assert "max by (replica, priority)" in rule["metricsQuery"]


def test_the_gie_pool_selects_the_gateways_and_the_objectives_name_it():
    pool = find(render(K8S / "gie"), "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    objects = overlay("cpu")
    gateway = pod_container(objects, "gateway")
    labels = find(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"] == labels
    assert pool["spec"]["targetPorts"] == [{"number": int(_flag(gateway["args"],
                                                               "--http-port"))}]
    assert pool["spec"]["endpointPickerRef"]["name"]
    objectives = [o for o in render(K8S / "gie") if o["kind"] == "InferenceObjective"]
    assert objectives
    for objective in objectives:
        assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
        assert objective["spec"]["poolRef"] == {"group": "inference.networking.k8s.io",
                                                "kind": "InferencePool",
                                                "name": pool["metadata"]["name"]}
        assert isinstance(objective["spec"]["priority"], int)


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


def test_every_service_container_gets_the_internal_secret_from_a_secret(rendered):
    """No internal port without the secret: the scheduler binds 0.0.0.0 here, so a
    container that lacked it would either refuse to start or, worse, be open."""
    objects = rendered[1]
    secrets = {d["metadata"]["name"]: d for d in objects if d["kind"] == "Secret"}
    sources = set()
    for _, container in containers(objects):
        assert container["command"][-1] in SERVICES
        source = _secret_source(container, secrets)
        assert source is not None, f"{container['name']} has no internal secret"
        sources.add(source)
    assert len(sources) == 1, "every plane must share one secret"


def test_the_placeholder_secret_is_refused():
    """An unedited deployment fails loudly instead of running on a published secret."""
    secret = find(overlay("cpu"), "Secret")
    with pytest.raises(internal_auth.SecretError, match="at least"):
        internal_auth.load_secret({internal_auth.ENV_SECRET: secret["stringData"]["secret"]})


def test_the_dockerfile_keeps_the_scheduler_on_loopback():
    text = (DEPLOY / "Dockerfile").read_text()
    [cmd] = re.findall(r"^CMD (\[.*\])$", text, re.MULTILINE)
    argv = json.loads(cmd)
    assert argv[:3] == ["python", "-m", "continuum"]
    parser, _ = build_parser()
    args = parser.parse_args(argv[3:])
    assert args.command == "serve"
    scheduler = Configs.of(args, ipc="ipc:///x", model_name="m").scheduler
    assert scheduler.scheduler_host == "127.0.0.1"
    [expose] = re.findall(r"^EXPOSE (.*)$", text, re.MULTILINE)
    assert str(scheduler.scheduler_port) not in expose.split()


def test_gateways_serve_tls_from_a_mounted_tls_secret(rendered):
    """Client traffic (API keys, prompts) crosses the network: both gateway ports serve
    the certificate of a kubernetes.io/tls Secret, mounted read-only where the flags
    name its tls.crt and tls.key (the keys `kubectl create secret tls` writes)."""
    objects = rendered[1]
    gateway = pod_container(objects, "gateway")
    config = gateway_main.parse_args(gateway["args"])
    assert config.server_tls is not None and config.http_port
    [mount] = [m for m in gateway["volumeMounts"] if m["name"] == "tls"]
    assert mount["readOnly"] is True
    [volume] = [v for v in _pod(objects, "Deployment")["volumes"] if v["name"] == "tls"]
    assert "optional" not in volume["secret"]  # no Secret: the pod waits, never plaintext
    for path, key in ((config.tls_cert_file, "tls.crt"), (config.tls_key_file, "tls.key")):
        assert path == pathlib.Path(mount["mountPath"]) / key
    # The kubelet's probes stay on the plaintext probe listener, which needs no
    # certificate even under mutual TLS.
    for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe_kind]["httpGet"]["port"] == config.probe_port
