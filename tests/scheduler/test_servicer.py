"""The scheduler's gRPC face as a real process (no executor: nothing here needs a step).

Deny by default: every Scheduler method needs the internal secret, health stays
open, and the process refuses to start without a secret or the opt-out. A
request id is scoped to its tenant.
"""

# ruff: noqa: F811 (the scheduler fixtures are imported from scheduler_process)
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.routing.replicas import ReplicaSet
from gateway.routing.upstream import StreamEnd
from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth
from tests.conftest import TEST_METADATA, TEST_SECRET
from tests.scheduler.scheduler_process import (  # noqa: F401 (fixtures)
    free_port,
    scheduler,
    scheduler_address,
    scheduler_cmd,
    wait_serving,
)
from tests.scheduler.submit_client import Stream, StreamFailed


def submit_request(request_id: str = "r1", **fields) -> scheduler_pb2.SubmitRequest:
    fields.setdefault("sampling", sampling_pb2.SamplingParams(temperature=0.0))
    fields.setdefault("max_tokens", 4)
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                       **fields)


WRONG = ((internal_auth.METADATA_KEY, "not-the-secret-at-all-000000"),)


@pytest.mark.parametrize("metadata", [(), WRONG], ids=["none", "wrong"])
def test_every_method_needs_the_secret(scheduler, metadata):
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler)
    calls = {
        "Stats": lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=metadata),
        "Abort": lambda: stub.Abort(scheduler_pb2.AbortRequest(request_id="r1"), timeout=5,
                                    metadata=metadata),
        "SubmitMany": lambda: stub.SubmitMany(
            iter([scheduler_pb2.SubmitManyRequest(stream_id=1, submit=submit_request())]),
            timeout=5, metadata=metadata),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as caught:
            result = call()
            if name == "SubmitMany":
                next(result)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert internal_auth.METADATA_KEY in caught.value.details()
    # Refused calls queued nothing.
    stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=TEST_METADATA)
    assert stats.num_waiting == 0


def test_health_is_open_and_the_secret_opens_stats(scheduler):
    health = health_pb2_grpc.HealthStub(scheduler)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler)
    stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=TEST_METADATA)
    assert not stats.executor_ready
    assert stats.submit_many  # a gateway may multiplex its requests on one call


@pytest.mark.parametrize("secret", [TEST_SECRET.encode(), None], ids=["secret", "none"])
def test_the_gateways_replica_channels_carry_the_secret(scheduler_address, secret):
    """Stats on ``replica.stub`` needs no metadata of its own: the channel adds it; the
    replica's SubmitMany call (``replica.submit``) carries it itself. Without a secret
    both are refused; with it, both get past auth."""
    async def calls():
        replicas = ReplicaSet([scheduler_address], secret=secret)
        replica = replicas.replicas[0]
        stub = replica.stub
        codes = []
        for call in (lambda: stub.Stats(scheduler_pb2.StatsRequest(), timeout=5),
                     lambda: replica.submit(submit_request(max_tokens=0), 5).read()):
            try:
                result = await call()
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            else:  # a stream's end without a finish: its status
                codes.append(result.code if isinstance(result, StreamEnd)
                             else grpc.StatusCode.OK)
        await replicas.close()
        return codes

    codes = asyncio.run(asyncio.wait_for(calls(), 30))
    if secret is None:
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2
    else:  # past auth: Stats answers, the submit is judged on its merits (max_tokens 0)
        assert codes == [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT]


def stats(stub) -> scheduler_pb2.StatsResponse:
    return stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=TEST_METADATA)


def wait_waiting(stub, num_waiting: int) -> None:
    deadline = time.monotonic() + 30
    while stats(stub).num_waiting != num_waiting:
        assert time.monotonic() < deadline, f"never {num_waiting} waiting"
        time.sleep(0.05)


def test_a_request_id_is_scoped_to_its_tenant(scheduler):
    stub = scheduler_pb2_grpc.SchedulerStub(scheduler)

    def submit(tenant: str) -> Stream:
        return Stream(stub, submit_request("same-id", tenant=tenant), timeout=60,
                      metadata=TEST_METADATA)

    def abort(tenant: str) -> bool:
        request = scheduler_pb2.AbortRequest(request_id="same-id", tenant=tenant)
        return stub.Abort(request, timeout=5, metadata=TEST_METADATA).aborted

    mine, theirs = submit("x"), submit("")  # "" is the default tenant
    wait_waiting(stub, 2)  # one id, two tenants: two requests (no executor: both wait)
    with pytest.raises(StreamFailed) as caught:
        next(iter(submit("x")))
    assert caught.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert not abort("y"), "another tenant's abort must not find the request"
    assert abort("default")
    assert next(iter(theirs)).finish_reason == sampling_pb2.FINISH_REASON_ABORT
    wait_waiting(stub, 1)  # the other tenant's request is untouched
    mine.cancel()  # a cancelled call aborts its stream's request
    wait_waiting(stub, 0)


def _env_without_secret(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        internal_auth.ENV_SECRET, internal_auth.ENV_SECRET_FILE, internal_auth.ENV_INSECURE)}
    return {**env, **extra}


@pytest.mark.parametrize("module", ["scheduler_svc", "gateway"])
@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_no_secret_no_opt_out_is_one_line_and_exit_2(tmp_path, model_dir, module):
    if module == "scheduler_svc":
        cmd = scheduler_cmd(tmp_path, free_port())
    else:
        cmd = [sys.executable, "-m", "gateway", "--model-dir", str(model_dir), "--scheduler",
               f"127.0.0.1:{free_port()}", "--port", "0", "--http-port", "-1"]
    done = subprocess.run(cmd, env=_env_without_secret(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    prefix = "scheduler" if module == "scheduler_svc" else "gateway"
    assert done.stderr.startswith(f"{prefix}: no internal secret: set "
                                  f"{internal_auth.ENV_SECRET}"), done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_a_short_secret_is_refused(tmp_path):
    done = subprocess.run(scheduler_cmd(tmp_path, free_port()),
                          env=_env_without_secret(**{internal_auth.ENV_SECRET: "short"}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "at least 16 characters" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_a_missing_ipc_directory_is_created_private(tmp_path):
    """The Kubernetes layout names a socket directory inside the pod's shared emptyDir
    (mode 0777): the scheduler creates it with mode 0700."""
    ipc_dir, port = tmp_path / "shared" / "private", free_port()
    proc = subprocess.Popen(scheduler_cmd(ipc_dir, port), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_serving(port, proc)
        assert ipc_dir.stat().st_mode & 0o777 == 0o700
        assert (ipc_dir / "executor.sock").exists()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_how_a_request_the_server_ended_is_told_to_its_client():
    """Shed from an overloaded queue: RESOURCE_EXHAUSTED with the retry hint the gateway
    turns into 429 + Retry-After; poison: INTERNAL, marked not to retry elsewhere;
    drained: UNAVAILABLE, so the gateway continues it on another replica."""
    from scheduler_svc.core import FinishReason
    from scheduler_svc.streams import server_end
    from tests.scheduler.factories import make_request

    shed = make_request(request_id="shed")
    shed.error, shed.retry_after_s = "the server is overloaded: ...", 5.0
    code, message, trailer = server_end(shed, FinishReason.ABORT)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "overloaded" in message
    assert dict(trailer) == {"retry-after-ms": "5000"}
    poison = make_request(request_id="poison")
    poison.error = "the executor failed"
    code, _, trailer = server_end(poison, FinishReason.ERROR)
    assert code == grpc.StatusCode.INTERNAL and dict(trailer) == {"request-failed": "poison"}
    drained = make_request(request_id="drained")
    drained.error = "shutting down"
    assert server_end(drained, FinishReason.ABORT)[0] == grpc.StatusCode.UNAVAILABLE
