"""Plans through the shared-memory ring under a real scheduler loop (in this process) and
real executor processes (scheduler_svc/plan_channel.py, runtime/plan_ring.py): the ring
carries the plans and the greedy text is the one ZeroMQ gives; an executor killed with
-9 mid-stream is replaced by one that gets a fresh ring and the streams finish; no ring
name is left in /dev/shm; a tcp:// channel keeps ZeroMQ.
The fault tests (tests/integration/test_faults.py, test_standby.py, test_reregister.py)
run over the ring too (``--plan-channel shm``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import pytest

from protos.continuum.v1 import sampling_pb2
from runtime import shm_ring
from runtime.plan_ring import MIN_CPUS_TO_SPIN
from scheduler_svc import metrics
from scheduler_svc.core import Request, SchedulerConfig
from scheduler_svc.loop import EngineLoop
from scheduler_svc.plan_channel import PlanChannel, ring_unavailable
from scheduler_svc.process_config import SchedulerProcessConfig

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shm_ring.available() is not None,
                                 reason=f"no ring here: {shm_ring.available()}")]


def _executor(model_dir, ipc: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.Popen(
        [sys.executable, "-m", "executor_svc", "--model", str(model_dir), "--ipc", ipc,
         "--device", "cpu", "--kv-cache-bytes", "8MiB", "--warmup-tokens", "16",
         "--threads", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _until(predicate, what: str, timeout: float = 240.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _generate(engine: EngineLoop, n: int, max_tokens: int, tag: str,
                    on_token=None) -> list[list[int]]:
    greedy = sampling_pb2.SamplingParams(temperature=0.0)
    queues = [engine.submit(Request(f"{tag}-{i}", 0, [1, 9690 + i, 198, 2683], 4, max_tokens,
                                    ignore_eos=True, sampling=greedy))
              for i in range(n)]
    texts = []
    for queue in queues:
        tokens = []
        while True:
            _, token, reason = (await queue.get())[:3]
            if token is not None:
                tokens.append(token)
                if on_token is not None:
                    on_token(len(tokens))
            if reason is not None:
                break
        texts.append(tokens)
    return texts


def _ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("continuum-plan-")}


async def _serve(model_dir, tmp_path, channel: str) -> tuple[list[list[int]], EngineLoop]:
    ipc = f"ipc://{tmp_path}/{channel}.sock"
    engine = EngineLoop(SchedulerConfig(max_num_seqs=8), ipc, plan_channel=channel)
    engine.start()
    proc = _executor(model_dir, ipc)
    try:
        await _until(lambda: engine.executor is not None, "the executor's Hello")
        if channel == "shm":
            await _until(lambda: engine.link.plans.confirmed, "the executor to attach")
        return await _generate(engine, 4, 12, channel), engine
    finally:
        await engine.stop()
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)


def test_the_ring_carries_the_plans_and_the_text_is_zmqs(model_dir, tmp_path):
    before = _ours()
    ring_texts, engine = asyncio.run(_serve(model_dir, tmp_path, "shm"))
    plans = engine.link.plans
    assert plans.num_ring_plans > 0 and plans.num_ring_plans >= plans.num_zmq_plans
    page = metrics.render(engine, metrics.Histograms(), "m").decode()  # what /metrics says
    for channel, sent in (("shm", plans.num_ring_plans), ("zmq", plans.num_zmq_plans)):
        line = f'continuum:plans_sent_total{{model_name="m",channel="{channel}"}} {sent:.1f}'
        assert line in page.splitlines()
    zmq_texts, engine = asyncio.run(_serve(model_dir, tmp_path, "zmq"))
    assert engine.link.plans.num_ring_plans == 0 and engine.link.plans.ring is None
    assert ring_texts == zmq_texts and all(len(t) == 12 for t in ring_texts)
    assert _ours() <= before


def test_a_killed_executor_is_replaced_and_the_new_one_gets_a_fresh_ring(model_dir, tmp_path):
    async def scenario() -> None:
        ipc = f"ipc://{tmp_path}/kill.sock"
        engine = EngineLoop(SchedulerConfig(max_num_seqs=8), ipc, plan_channel="shm")
        engine.start()
        first = _executor(model_dir, ipc)
        second = None
        try:
            await _until(lambda: engine.link.plans.confirmed, "the first executor's ring")
            old_ring = engine.link.plans.ring.name
            killed = []

            def kill_midway(n: int) -> None:
                if n == 4 and not killed:
                    killed.append(True)
                    os.kill(first.pid, signal.SIGKILL)

            task = asyncio.ensure_future(_generate(engine, 3, 24, "k", kill_midway))
            await _until(lambda: killed, "tokens before the kill")
            second = _executor(model_dir, ipc)
            texts = await asyncio.wait_for(task, 240)
            assert all(len(t) == 24 for t in texts)
            assert engine.executor.pid == second.pid  # (its Hello may come before the loss)
            plans = engine.link.plans
            assert plans.confirmed and plans.ring.name != old_ring and plans.num_ring_plans
        finally:
            await engine.stop()
            for proc in (first, second):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(30)

    before = _ours()
    asyncio.run(scenario())
    assert _ours() <= before


def test_auto_takes_the_ring_where_its_reader_has_a_core_to_spin_on():
    ipc = "ipc:///tmp/x.sock"
    assert ring_unavailable("auto", ipc, num_cpus=MIN_CPUS_TO_SPIN) is None
    assert "2 CPUs" in ring_unavailable("auto", ipc, num_cpus=2)
    assert ring_unavailable("shm", ipc, num_cpus=2) is None  # shm forces it
    assert "ipc" in ring_unavailable("auto", "tcp://127.0.0.1:5555", num_cpus=16)
    assert SchedulerProcessConfig(ipc=ipc).plan_channel == "auto"


def test_no_ring_without_ipc_or_when_turned_off():
    assert "ipc" in PlanChannel("shm", "tcp://127.0.0.1:5555", None).why_not
    assert PlanChannel("zmq", "ipc:///tmp/x.sock", None).why_not == "--plan-channel zmq"
    channel = PlanChannel("zmq", "ipc:///tmp/x.sock", None)
    channel.renew("inc")
    assert channel.ring is None and channel.offer() is None and channel.write(b"p") is None
    with pytest.raises(ValueError):
        PlanChannel("udp", "ipc:///tmp/x.sock", None)
