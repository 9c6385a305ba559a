"""The relay's watchdog against real grpc.aio servers: a replica that stops answering
(streams move to another one, or end UNAVAILABLE), a replica that is only slow (streams
wait), a client that stops reading (cancelled, upstream freed), and drain past its grace
period (a terminal error on gRPC and on SSE, not a cut connection)."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import socket

import aiohttp
import grpc
import pytest

from gateway.routing import watchdog
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2

from .harness import (
    FakeScheduler,
    collect,
    fake_scheduler,
    gateway,
    generation_stub,
    polled,
    run,
)

GenerateRequest = generation_pb2.GenerateRequest
TEXT = "one two three four five six seven eight"
ENDLESS = 4000


@pytest.fixture(autouse=True)
def quick_watchdog(monkeypatch):
    """Bounds small enough for a test; what is tested is what happens, not how soon."""
    monkeypatch.setattr(watchdog, "TICK_S", 0.05)
    monkeypatch.setattr(watchdog, "PROGRESS_TIMEOUT_S", 0.3)
    monkeypatch.setattr(watchdog, "PROBE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(watchdog, "WRITE_STALL_S", 0.5)


def _events(tokenizer, text=TEXT):
    events = [scheduler_pb2.TokenEvent(token_ids=[t]) for t in tokenizer.encode(text)]
    events[-1].finish_reason = sampling_pb2.FINISH_REASON_LENGTH
    return events


@dataclasses.dataclass
class Freezing(FakeScheduler):
    """Streams its events, then freezes like a SIGSTOPped process: the stream goes
    silent and, with `frozen`, Stats stop answering too (else they keep answering:
    a replica that is only slow, e.g. its executor restarting)."""

    frozen: bool = True
    pause_s: float | None = None  # None: silent forever; else resume after this long
    more: list = dataclasses.field(default_factory=list)
    stopped: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    async def stream(self, request):
        self.submitted.append(request)
        for event in self.events:
            yield event
        self.stopped.set()
        if self.pause_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.pause_s)
        for event in self.more:
            yield event

    async def Stats(self, request, context):
        if self.frozen and self.stopped.is_set():
            await asyncio.Event().wait()
        return await super().Stats(request, context)


@dataclasses.dataclass
class Endless(FakeScheduler):
    """Streams one token after another (as fast as it may write): until cancelled for a
    request of ENDLESS max_tokens, else max_tokens of them."""

    token_id: int = 0

    async def stream(self, request):
        self.submitted.append(request)
        for n in itertools.count(1):
            event = scheduler_pb2.TokenEvent(token_ids=[self.token_id])
            if n == request.max_tokens < ENDLESS:
                event.finish_reason = sampling_pb2.FINISH_REASON_LENGTH
                yield event
                return
            yield event


def _text(responses):
    return "".join(r.text for r in responses)


def test_a_stalled_replica_s_stream_continues_on_another(tokenizer):
    events = _events(tokenizer)
    stalled = Freezing(events=events[:3])
    healthy = FakeScheduler(events=events[3:])

    async def scenario():
        async with fake_scheduler(stalled) as a, fake_scheduler(healthy) as b, \
                gateway(tokenizer, f"{a},{b}") as (running, channel):
            await polled(running)
            for replica in running.replicas.replicas:  # route to `stalled` first
                replica.load = (0.0, 0.0, 0.0) if replica.address == a else (1.0, 0.0, 0.0)
            call = generation_stub(channel).Generate(GenerateRequest(prompt="hi"), timeout=20)
            return await collect(call)

    responses = run(scenario())
    assert _text(responses) == TEXT  # nothing lost, nothing twice
    assert responses[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    (resumed,) = healthy.submitted
    assert list(resumed.prompt_token_ids[-3:]) == [e.token_ids[0] for e in events[:3]]
    assert resumed.num_resumed_output_tokens == 3
    assert stalled.cancelled.is_set()  # the stalled call was given up, not left open


def test_a_stalled_only_replica_ends_the_stream_unavailable(tokenizer):
    stalled = Freezing(events=_events(tokenizer)[:2])

    async def scenario():
        async with fake_scheduler(stalled) as a, gateway(tokenizer, a) as (running, channel):
            await polled(running)
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await collect(generation_stub(channel).Generate(GenerateRequest(prompt="hi"),
                                                                timeout=20))
            return failed.value

    error = run(scenario())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "stopped responding" in error.details()


def test_a_slow_replica_that_answers_keeps_its_streams(tokenizer):
    events = _events(tokenizer)
    slow = Freezing(events=events[:3], more=events[3:], frozen=False, pause_s=1.5)

    async def scenario():
        async with fake_scheduler(slow) as a, gateway(tokenizer, a) as (_, channel):
            return await collect(generation_stub(channel).Generate(GenerateRequest(prompt="hi"),
                                                                   timeout=20))

    responses = run(scenario())
    assert _text(responses) == TEXT
    assert len(slow.submitted) == 1  # waited through the pause: no failover, no error


def test_a_client_that_stops_reading_is_cancelled_and_frees_upstream(tokenizer):
    """A raw socket with a tiny receive buffer asks for a long SSE stream and never
    reads: once the server's buffers are full its write blocks, and the watchdog
    cancels the request; a normal request is served meanwhile."""
    endless = Endless(token_id=tokenizer.encode(" word")[0])

    async def scenario():
        async with fake_scheduler(endless) as a, \
                gateway(tokenizer, a, http_port=0) as (running, channel):
            await polled(running)
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", running.http_port))
            body = json.dumps({"model": "smollm2", "prompt": "hi", "stream": True,
                               "max_tokens": ENDLESS}).encode()
            reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            try:
                normal = await collect(generation_stub(channel).Generate(
                    GenerateRequest(prompt="hi", max_tokens=5), timeout=20))
                await asyncio.wait_for(endless.cancelled.wait(), 20)
            finally:
                reader.close()
            return normal, running.metrics.render().decode()

    normal, metrics = run(scenario())
    assert normal[-1].usage.completion_tokens == 5  # served while the other was stuck
    assert ('continuum_gateway_stream_interventions_total{model_name="smollm2",'
            'reason="slow_reader"} 1.0') in metrics


def test_drain_past_its_grace_period_ends_streams_with_an_error(tokenizer):
    """Streams still running when the grace period is over get UNAVAILABLE (gRPC) or an
    SSE `error` event then `[DONE]`, not a cut connection."""
    endless = FakeScheduler(events=_events(tokenizer, "word " * 500), delay_s=0.05)

    async def scenario():
        async with fake_scheduler(endless) as a, \
                gateway(tokenizer, a, http_port=0) as (running, channel):
            await polled(running)
            call = generation_stub(channel).Generate(GenerateRequest(prompt="hi"), timeout=20)
            await call.read()
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{running.http_port}/v1/completions"
                async with session.post(url, json={"model": "smollm2", "prompt": "hi",
                                                   "stream": True}) as sse:
                    first = await sse.content.readline()
                    await running.stop(0.2)
                    rest = (await sse.content.read()).decode()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await call.read() != grpc.aio.EOF:
                    pass
            return first, rest, ended.value

    first, rest, ended = run(scenario())
    assert first.startswith(b"data: {")
    assert ended.code() == grpc.StatusCode.UNAVAILABLE
    assert "grace period" in ended.details()
    events = [line[len("data: "):] for line in rest.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "grace period" in error["message"]
