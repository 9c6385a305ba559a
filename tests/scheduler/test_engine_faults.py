"""The engine loop against a raw DEALER (tests/scheduler/fake_peer.py) on a real ipc socket:
junk never kills a reader, forged Hellos never become the peer, malformed results and
failing steps are survived, a poison request ends alone, and a dead task is fatal."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from continuum.serve.procs import free_port
from protos import wire
from protos.continuum.v1 import executor_pb2 as pb
from scheduler_svc import link as link_module
from scheduler_svc.core import FinishReason, SchedulerConfig
from scheduler_svc.loop import HEARTBEAT_S, EngineLoop
from tests.scheduler.factories import make_request
from tests.scheduler.fake_peer import SECRET, FakePeer, linked_peers, make_hello

TIMEOUT_S = 20.0


async def until(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def drain(queue: asyncio.Queue) -> list:
    events = []
    while not events or events[-1][2] is None:
        events.append(await asyncio.wait_for(queue.get(), TIMEOUT_S))
    return events


def test_junk_and_forged_hellos_are_dropped_and_the_reader_survives(tmp_path):
    async def go():
        async with linked_peers(f"ipc://{tmp_path}/s.sock", b"rogue") as (
                link, hellos, (peer,)):
            junk = [
                (b"a", b"b"),  # two frames
                (b"\x00\xffgarbage",),  # undecodable
                (wire.encode_to_scheduler("hello", make_hello())[:0] + b"\x08\x63",),  # v99
            ]
            for frames in junk:
                await peer.send_raw(*frames)
            bad = [make_hello(block_size=0), make_hello(num_device_blocks=0),
                   make_hello(vocab_size=0), make_hello(max_model_len=0),
                   make_hello(num_device_blocks=1 << 30), make_hello(schema_version=7),
                   make_hello(secret=None), make_hello(secret=b"x" * 32)]
            tampered = make_hello()
            tampered.num_device_blocks += 1  # signed before: the tag no longer matches
            for hello in [*bad, tampered]:
                await peer.say_hello(hello)
            await until(lambda: link.num_dropped_frames == len(junk) + len(bad) + 1)
            assert link.peer is None and hellos == []
            await peer.send("heartbeat", pb.Heartbeat(incarnation="x"))  # not the peer
            kind, msg = await peer.recv()
            assert kind == "heartbeat" and msg.detached and msg.incarnation == "x"
            good = make_hello()
            await peer.say_hello(good)
            await until(lambda: hellos)
            assert link.peer == b"rogue" and hellos[0].incarnation == good.incarnation

    asyncio.run(go())


def test_an_oversized_frame_is_refused_by_zmq_and_the_link_goes_on(tmp_path):
    async def go():
        async with linked_peers(f"ipc://{tmp_path}/s.sock", None) as (link, hellos, (peer,)):
            await peer.send_raw(b"\0" * (link_module.MAX_FRAME_BYTES + 1))
            for _ in range(200):  # zmq cuts the connection and the DEALER reconnects: a
                await peer.say_hello(make_hello())  # Hello sent meanwhile may be lost
                await asyncio.sleep(0.1)
                if hellos:
                    break
            assert hellos  # had the big frame been read, it was counted before this
            assert link.num_dropped_frames == 0  # the big frame was never read

    asyncio.run(go())


def _engine(tmp_path, **config) -> tuple[EngineLoop, str]:
    address = f"ipc://{tmp_path}/s.sock"
    config.setdefault("watermark", 0.0)
    return EngineLoop(SchedulerConfig(**config), address, secret=SECRET), address


def test_a_malformed_result_is_dropped_and_the_step_resynchronized(tmp_path):
    async def go():
        loop, address = _engine(tmp_path)
        loop.start()
        peer = FakePeer(address)
        try:
            await peer.say_hello(make_hello())
            queue = loop.submit(make_request(prompt_len=5, max_tokens=3, request_id="a"))
            plan = await peer.next_plan()
            bad = peer.answer(plan)
            bad.token_ids.append(7)  # one more token than seq ids
            await peer.send("result", bad)
            peer.seqs.clear()  # as the scheduler resynchronizes, everything comes anew
            server = asyncio.create_task(peer.serve())
            events = await drain(queue)
            server.cancel()
            assert events[-1][2] == FinishReason.LENGTH
            assert [t for _, t, _, _ in events if t is not None] == events[0][0].token_ids[5:]
            assert loop.num_dropped_frames == 1 and not loop.fatal.done()
        finally:
            peer.close()
            await loop.stop()

    asyncio.run(go())


@pytest.mark.parametrize("code", [pb.STEP_ERROR_CODE_INTERNAL, pb.STEP_ERROR_CODE_BAD_BLOCK])
def test_a_poison_request_is_ended_alone_and_the_others_finish(tmp_path, code):
    """A forward failure blames the step at once; a refusal only when repeated."""
    async def go():
        loop, address = _engine(tmp_path, max_step_failures=2)
        loop.start()
        peer = FakePeer(address)
        try:
            await peer.say_hello(make_hello())
            queues = {rid: loop.submit(make_request(prompt_len=5 + i, max_tokens=4,
                                                    request_id=rid))
                      for i, rid in enumerate(["p", "a", "b", "c"])}
            poison = next(iter(loop.core.requests.values())).seq_id

            async def serve():
                while True:
                    plan = await peer.next_plan()
                    if any(n.seq_id == poison for n in plan.new_seqs):
                        peer.seqs.clear()
                        await peer.send("result", pb.StepResult(
                            incarnation=plan.incarnation, step_id=plan.step_id,
                            error_code=code, error_message="forward failed: boom"))
                    else:
                        await peer.send("result", peer.answer(plan))

            server = asyncio.create_task(serve())
            ends = {rid: (await drain(q))[-1] for rid, q in queues.items()}
            server.cancel()
            req, _, reason, _ = ends.pop("p")
            assert reason == FinishReason.ERROR and "boom" in req.error
            assert {r for _, _, r, _ in ends.values()} == {FinishReason.LENGTH}
            for ev_req, _, _, _ in ends.values():  # the peer's tokens: 100 + seq id + position
                assert ev_req.token_ids[ev_req.num_prompt_tokens:] == [
                    100 + ev_req.seq_id + p for p in range(ev_req.num_prompt_tokens,
                                                           ev_req.num_tokens)]
            assert loop.faults.num_failed_steps >= 2 and not loop.fatal.done()
        finally:
            peer.close()
            await loop.stop()

    asyncio.run(go())


@pytest.mark.parametrize("victim", ["core", "reader", "heartbeats"])
def test_a_dead_task_is_fatal(tmp_path, monkeypatch, victim):
    async def go():
        loop, address = _engine(tmp_path)

        def boom(*args, **kwargs):
            raise RuntimeError(f"{victim} bug")

        if victim == "core":
            monkeypatch.setattr(loop.core, "schedule", boom)
        elif victim == "reader":
            monkeypatch.setattr(link_module.wire, "decode_from_executor", boom)
        loop.start()
        peer = FakePeer(address)
        try:
            await peer.say_hello(make_hello())
            if victim == "heartbeats":  # the idle probe, once the executor is attached
                await until(lambda: loop.executor is not None)
                monkeypatch.setattr(loop.link, "send_heartbeat", boom)
            else:
                loop.submit(make_request(prompt_len=4, max_tokens=2, request_id="x"))
            why = await asyncio.wait_for(loop.fatal, TIMEOUT_S)
            assert f"{victim} bug" in why
        finally:
            peer.close()
            await loop.stop()

    asyncio.run(go())


def test_abort_all_ends_every_stream_with_a_reason(tmp_path):
    async def go():
        loop, _ = _engine(tmp_path)
        loop.start()
        try:
            queues = [loop.submit(make_request(request_id=f"r{i}")) for i in range(3)]
            assert loop.abort_all("the replica is shutting down") == 3
            for queue in queues:
                req, token, reason, _ = await asyncio.wait_for(queue.get(), TIMEOUT_S)
                assert reason == FinishReason.ABORT and token is None
                assert req.error == "the replica is shutting down"
            assert not loop.core.requests and not loop.has_work
        finally:
            await loop.stop()

    asyncio.run(go())


def test_a_dead_task_makes_the_scheduler_process_exit_1(tmp_path):
    """`python -m scheduler_svc` whose heartbeat task dies at once: it logs why and exits
    non-zero (for its supervisor or Kubernetes to restart it) instead of wedging."""
    code = ("import asyncio, sys\n"
            "import scheduler_svc.loop as loop\n"
            "async def boom(self):\n"
            "    raise RuntimeError('heartbeat bug')\n"
            "loop.EngineLoop._heartbeats = boom\n"
            "from scheduler_svc.__main__ import main\n"
            "main(sys.argv[1:])\n")
    proc = subprocess.run(
        [sys.executable, "-c", code, "--ipc", f"ipc://{tmp_path}/s.sock",
         "--scheduler-port", str(free_port())],
        env={**os.environ, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 1
    assert "heartbeat bug" in proc.stderr and "fatal" in proc.stderr


def test_a_request_whose_step_hangs_the_executor_is_ended_alone(tmp_path):
    """The executor never answers a step holding the poison request: the step deadline
    (shortened here) or the replacement's Hello fails it; a fresh executor registers each
    time, and after its step alone hangs too the poison is ended; the others finish."""
    async def go():
        loop, address = _engine(tmp_path, max_step_failures=2)
        loop.deadlines.cold_floor_s = loop.deadlines.floor_s = 0.3
        loop.start()
        peer = FakePeer(address)
        try:
            await peer.say_hello(make_hello())
            queues = {rid: loop.submit(make_request(prompt_len=5 + i, max_tokens=3,
                                                    request_id=rid))
                      for i, rid in enumerate(["p", "a", "b"])}
            poison = loop.core.requests["p"].seq_id

            async def serve():
                while True:  # heard nothing for long, or told it is detached: as a real
                    try:  # executor would, it registers again (a fresh, empty one)
                        kind, msg = await peer.recv(3 * HEARTBEAT_S)
                    except TimeoutError:
                        kind, msg = "heartbeat", pb.Heartbeat(detached=True)
                    if kind == "heartbeat" and msg.detached:
                        peer.seqs.clear()
                        await peer.say_hello(make_hello())
                    elif kind == "heartbeat":
                        await peer.send("heartbeat",
                                        pb.Heartbeat(incarnation=peer.hello.incarnation))
                    if kind != "plan":
                        continue
                    if any(n.seq_id == poison for n in msg.new_seqs):
                        await asyncio.sleep(1.0)  # hung; then a new executor starts
                        peer.seqs.clear()
                        await peer.say_hello(make_hello())
                    else:
                        await peer.send("result", peer.answer(msg))

            server = asyncio.create_task(serve())
            ends = {rid: (await drain(q))[-1] for rid, q in queues.items()}
            server.cancel()
            assert ends.pop("p")[2] == FinishReason.ERROR
            assert {reason for _, _, reason, _ in ends.values()} == {FinishReason.LENGTH}
            assert loop.core.requests == {} and not loop.fatal.done()
        finally:
            peer.close()
            await loop.stop()

    asyncio.run(go())
