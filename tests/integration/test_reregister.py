"""The Kubernetes layout (scheduler and executor started separately, no supervisor):
an executor SIGSTOPped past the heartbeat timeout is detached; woken by SIGCONT it is
told so, re-registers under a new incarnation and serves again. A forged Hello and junk
frames from a rogue DEALER on the same socket change nothing but a counter. And a
scheduler drained past its grace period ends every open stream with UNAVAILABLE."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import zmq

from continuum.serve.procs import free_port
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth
from tests.scheduler.submit_client import Stream, StreamFailed, submit

pytestmark = pytest.mark.integration
READY_S = 240


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen([sys.executable, "-m", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, what: str, timeout: float = READY_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def replica(tmp_path, model_dir):
    ipc, port = f"ipc://{tmp_path}/replica.sock", free_port()
    procs = [spawn("scheduler_svc", "--ipc", ipc, "--scheduler-port", str(port),
                   "--plan-channel", "shm", "--executor-heartbeat-timeout-s", "2"),
             spawn("executor_svc", "--model", str(model_dir), "--ipc", ipc, "--device", "cpu",
                   "--kv-cache-bytes", "8MiB", "--warmup-tokens", "16", "--threads", "2")]
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    yield stub, procs[1], ipc
    channel.close()
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def stats(stub) -> scheduler_pb2.StatsResponse | None:
    try:
        return stub.Stats(scheduler_pb2.StatsRequest(), timeout=5, metadata=_metadata())
    except grpc.RpcError:
        return None  # not listening yet


def _metadata():
    return internal_auth.metadata(internal_auth.load_secret())


def generate(stub, request_id: str) -> list[scheduler_pb2.TokenEvent]:
    request = scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=[1, 9690, 198, 2683], max_tokens=4,
        sampling=sampling_pb2.SamplingParams(temperature=0.0))
    return submit(stub, request, timeout=120, metadata=_metadata())


def test_forged_hello_is_ignored_and_a_stalled_executor_re_registers(replica):
    stub, executor, ipc = replica
    first = wait_for(lambda: (s := stats(stub)) and s.executor_ready and s, "the executor")
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(ipc)
    try:
        forged = pb.Hello(schema_version=wire.SCHEMA_VERSION, incarnation="rogue",
                          model_id="evil", block_size=16, num_device_blocks=8,
                          max_model_len=64, vocab_size=100, auth_tag=b"\0" * 32)
        rogue.send(wire.encode_to_scheduler("hello", forged))
        rogue.send_multipart([b"a", b"b", b"c"])
        wait_for(lambda: stats(stub).num_dropped_frames >= 2, "the drops to be counted", 30)
    finally:
        rogue.close()
        ctx.term()
    now = stats(stub)
    assert now.executor_incarnation == first.executor_incarnation  # never the peer
    assert generate(stub, "before")[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH

    os.kill(executor.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not stats(stub).executor_ready, "the executor to be detached", 60)
    finally:
        os.kill(executor.pid, signal.SIGCONT)
    again = wait_for(lambda: (s := stats(stub)) and s.executor_ready and s, "re-registration",
                     60)
    assert again.executor_incarnation != first.executor_incarnation
    assert again.num_executor_losses == 1 and executor.poll() is None
    events = generate(stub, "after")
    assert events[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert sum(len(e.token_ids) for e in events) == 4


def test_a_drain_past_its_grace_period_ends_each_stream_with_unavailable(tmp_path):
    """No executor: the request can never finish, so the drain's grace period passes;
    its stream ends with a status and a message, not a cut connection."""
    port = free_port()
    scheduler = spawn("scheduler_svc", "--ipc", f"ipc://{tmp_path}/s.sock",
                      "--scheduler-port", str(port), "--grace-period", "0.5",
                      "--executor-heartbeat-timeout-s", "2")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            wait_for(lambda: stats(stub), "the scheduler", 60)
            request = scheduler_pb2.SubmitRequest(request_id="stuck", prompt_token_ids=[1, 2],
                                                  max_tokens=4)
            stream = Stream(stub, request, timeout=60, metadata=_metadata())
            wait_for(lambda: stats(stub).num_waiting == 1, "the request to queue", 30)
            scheduler.send_signal(signal.SIGTERM)
            with pytest.raises(StreamFailed) as err:
                list(stream)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "shut down before the request finished" in err.value.message
        assert scheduler.wait(timeout=30) == 0
    finally:
        if scheduler.poll() is None:
            scheduler.kill()
