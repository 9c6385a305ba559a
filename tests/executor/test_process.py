"""The executor process over a real zmq ipc socket, with the test as the scheduler."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import zmq

from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from protos.continuum.v1 import sampling_pb2
from runtime import internal_auth

TIMEOUT_MS = 60_000


def start_executor(*args: str) -> subprocess.Popen:
    """On the CPU unless ``args`` name another --device (the last one wins): the default
    (auto) would move these tests to a GPU wherever there is one."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(  # keep what the caller set
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "executor_svc", "--device", "cpu", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


class FakeScheduler:
    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.peer = b""

    def recv(self):
        assert self.sock.poll(TIMEOUT_MS), "executor sent nothing"
        self.peer, frame = self.sock.recv_multipart()
        return wire.decode_from_executor(frame)

    def send(self, kind: str, msg) -> None:
        self.sock.send_multipart([self.peer, wire.encode_to_executor(kind, msg)])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def executor(model_dir, tmp_path):
    address = f"ipc://{tmp_path}/executor.sock"
    scheduler = FakeScheduler(address)
    proc = start_executor("--model", str(model_dir), "--ipc", address, "--kv-cache-bytes",
                          "8MiB", "--warmup-tokens", "16", "--threads", "2")
    yield proc, scheduler, address
    if proc.poll() is None:
        proc.kill()
    proc.communicate()
    scheduler.close()


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_hello_plan_heartbeat_reconnect_and_sigterm(executor):
    proc, scheduler, address = executor
    kind, hello = scheduler.recv()
    assert kind == "hello"
    assert (hello.schema_version, hello.block_size, hello.tp_size) == (wire.SCHEMA_VERSION, 16, 1)
    assert hello.num_device_blocks == (8 << 20) // (46080 * 16)
    assert list(hello.eos_token_ids) == [2] and hello.vocab_size == 49152
    assert hello.prefill_tokens_per_s > 0 and hello.pid == proc.pid and hello.incarnation
    secret = internal_auth.load_secret()  # tests/conftest.py sets the suite's
    assert internal_auth.check_tag(secret, wire.hello_payload(hello), hello.auth_tag)

    plan = pb.BatchPlan(incarnation=hello.incarnation, step_id=1)
    plan.new_seqs.add(seq_id=3, token_ids=[1, 9690, 198, 2683], num_scheduled_tokens=4,
                      block_ids=[5], num_prompt_tokens=4,
                      sampling=sampling_pb2.SamplingParams(temperature=0.0))
    scheduler.send("plan", plan)
    kind, result = scheduler.recv()
    assert kind == "result" and result.error_code == 0
    assert (result.step_id, wire.result_seq_ids(result), len(result.token_ids)) == (1, [3], 1)

    scheduler.sock.send_multipart([scheduler.peer, b"\x00garbage"])  # logged and dropped
    scheduler.sock.send_multipart([scheduler.peer, b"x", b"y", b"z"])  # 3 frames: dropped
    decode = pb.BatchPlan(incarnation=hello.incarnation, step_id=2, cached_seq_ids=[3],
                          cached_num_scheduled_tokens=[1], cached_num_new_blocks=[0])
    scheduler.send("plan", decode)
    kind, result = scheduler.recv()
    assert kind == "result" and wire.result_seq_ids(result) == [3] and result.forward_ms > 0

    scheduler.send("heartbeat", pb.Heartbeat(incarnation=hello.incarnation))
    kind, beat = scheduler.recv()
    assert kind == "heartbeat" and beat.incarnation == hello.incarnation
    assert beat.last_step_id == 2

    # Detached (as after a stall): it drops its state and registers as a new incarnation.
    scheduler.send("heartbeat", pb.Heartbeat(incarnation=hello.incarnation, detached=True))
    kind, fresh = scheduler.recv()
    assert kind == "hello" and fresh.incarnation != hello.incarnation
    assert internal_auth.check_tag(secret, wire.hello_payload(fresh), fresh.auth_tag)
    scheduler.send("plan", decode)  # the old incarnation's plan: refused, state is gone
    kind, result = scheduler.recv()
    assert kind == "result" and result.error_code == pb.STEP_ERROR_CODE_STALE_INCARNATION
    hello = fresh

    # The scheduler restarts: the executor reconnects and introduces itself again.
    scheduler.close()
    scheduler.__init__(address)
    kind, again = scheduler.recv()
    assert kind == "hello" and again.incarnation == hello.incarnation

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_a_float16_kv_cache_doubles_the_blocks_and_still_generates(model_dir, tmp_path):
    address = f"ipc://{tmp_path}/executor.sock"
    scheduler = FakeScheduler(address)
    proc = start_executor("--model", str(model_dir), "--ipc", address, "--kv-cache-bytes",
                          "8MiB", "--warmup-tokens", "16", "--threads", "2",
                          "--kv-cache-dtype", "float16")
    try:
        kind, hello = scheduler.recv()
        assert kind == "hello"
        assert hello.num_device_blocks == (8 << 20) // (23040 * 16)  # 2 bytes per element
        plan = pb.BatchPlan(incarnation=hello.incarnation, step_id=1)
        plan.new_seqs.add(seq_id=1, token_ids=[1, 9690, 198, 2683], num_scheduled_tokens=4,
                          block_ids=[hello.num_device_blocks - 1], num_prompt_tokens=4,
                          sampling=sampling_pb2.SamplingParams(temperature=0.0))
        scheduler.send("plan", plan)
        kind, result = scheduler.recv()
        assert kind == "result" and result.error_code == 0 and len(result.token_ids) == 1
    finally:
        proc.kill()
        proc.communicate()
        scheduler.close()


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_no_internal_secret_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTINUUM_INTERNAL")}
    env["PYTHONPATH"] = os.getcwd()
    proc = subprocess.run([sys.executable, "-m", "executor_svc", "--ipc",
                           f"ipc://{tmp_path}/x.sock"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert internal_auth.ENV_SECRET in proc.stderr


@pytest.mark.spawns  # starts a service process (tests/tiers.py)
def test_bad_model_path_exits_2_with_one_line(tmp_path):
    proc = start_executor("--model", str(tmp_path / "nope"), "--ipc", f"ipc://{tmp_path}/x.sock")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert stderr.strip().count("\n") == 0 and "does not exist" in stderr
