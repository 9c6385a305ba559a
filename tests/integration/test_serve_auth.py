"""``continuum serve`` without a configured secret: it generates one for the run, its
children share it through their environment (never argv), and the scheduler refuses
anyone else while the gateway, which holds it, serves."""

from __future__ import annotations

import os
import pathlib

import grpc
import pytest

from protos.continuum.v1 import sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from runtime import internal_auth
from tests.conftest import TEST_SECRET
from tests.integration.conftest import processes_mentioning, start_server
from tests.integration.test_serve import chat, collect

pytestmark = pytest.mark.integration


def _environ(pid: int) -> dict[str, str]:
    raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw if item)


def test_serve_generates_a_per_run_secret_and_keeps_it_off_argv(tmp_path, model_dir):
    env = {k: v for k, v in os.environ.items() if k != internal_auth.ENV_SECRET}
    server = start_server(tmp_path, model_dir, "--kv-cache-bytes", str(32 << 20), env=env)
    try:
        responses = collect(server, chat("Say hi.", max_tokens=4, ignore_eos=True))
        assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH

        # The scheduler and the executor name the ipc path, the gateway the scheduler.
        children = {*processes_mentioning(server.ipc),
                    *processes_mentioning(f"127.0.0.1:{server.scheduler_port}")}
        children.discard(server.proc.pid)
        assert len(children) == 3
        assert internal_auth.ENV_SECRET not in _environ(server.proc.pid)
        secrets = {_environ(pid).get(internal_auth.ENV_SECRET) for pid in children}
        [secret] = secrets
        assert secret and secret != TEST_SECRET
        for pid in children:
            assert secret not in pathlib.Path(f"/proc/{pid}/cmdline").read_text(errors="replace")

        with grpc.insecure_channel(f"127.0.0.1:{server.scheduler_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            with pytest.raises(grpc.RpcError) as caught:  # the suite's secret is not this run's
                stub.Stats(scheduler_pb2.StatsRequest(), timeout=5,
                           metadata=internal_auth.metadata(TEST_SECRET.encode()))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stats = stub.Stats(scheduler_pb2.StatsRequest(), timeout=5,
                               metadata=internal_auth.metadata(secret.encode()))
            assert stats.executor_ready
    finally:
        assert server.stop() == 0, "".join(server.log[-30:])
