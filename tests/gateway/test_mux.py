"""The gateway's SubmitMany multiplexer (gateway/routing/mux.py) against the real
scheduler servicer and engine loop (a fake executor stepping it on a real ipc socket),
over real gRPC on loopback: each stream reads the executor's tokens to its finish, on
one call for all; a refused stream ends with its StreamEnd (status, trailers) and the
others finish; cancel and a deadline abort it upstream; a scheduler that goes away ends
the open streams with a status the relay continues elsewhere, and the next stream opens
a new call; a retiring replica's call, and one past its age, closes once idle."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.routing.mux import FINISHED, Mux
from gateway.routing.upstream import ERROR_CODE_KEY, REPLICA_FAILURES, StreamEnd, client_status
from harness import proto_strategies
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.servicer import SchedulerServicer
from tests.gateway.harness import (
    FakeScheduler,
    collect,
    fake_scheduler,
    gateway,
    generation_stub,
    run,
)
from tests.scheduler.fake_peer import served, settled

LENGTH = sampling_pb2.FINISH_REASON_LENGTH
PROMPT = (5, 6, 7)


def submit(request_id: str, max_tokens: int = 6, prompt=PROMPT) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=list(prompt), max_tokens=max_tokens,
        sampling=sampling_pb2.SamplingParams(temperature=0.0))


async def read_all(stream) -> tuple[list[int], int]:
    """(tokens, finish reason) of a stream read to its finish."""
    tokens, reason = [], 0
    while not reason:
        event = await stream.read()
        assert event.__class__ is not StreamEnd, event
        tokens += event.token_ids
        reason = event.finish_reason
    assert await stream.read() is FINISHED  # and again: nothing more comes
    return tokens, reason


def executor_tokens(tokens: list[int], n: int) -> bool:
    """The fake executor's answer: 100 + seq id + position, from the prompt's end."""
    seq_id = tokens[0] - 100 - len(PROMPT) if tokens else 0
    return tokens == [100 + seq_id + p for p in range(len(PROMPT), len(PROMPT) + n)]


class Calls(grpc.aio.ServerInterceptor):
    """Counts the calls the server took, by method name."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    async def intercept_service(self, continuation, details):
        self.methods.append(details.method.rsplit("/", 1)[-1])
        return await continuation(details)


def test_many_streams_share_one_call_and_each_reads_its_tokens(tmp_path):
    calls = Calls()

    async def go():
        async with served(tmp_path, interceptors=[calls]) as (loop, stub, *_):
            mux = Mux(stub)
            streams = [mux.submit(submit(f"r{i}", max_tokens=4 + i % 5), 20) for i in range(24)]
            results = await asyncio.gather(*map(read_all, streams))
            for i, (tokens, reason) in enumerate(results):
                assert reason == LENGTH and executor_tokens(tokens, 4 + i % 5), i
            assert mux.num_open == 0 and not loop.core.requests
            later = await read_all(mux.submit(submit("again"), 20))  # the same call again
            assert executor_tokens(later[0], 6)
            await mux.close()
        assert calls.methods == ["SubmitMany"]

    run(go())


def test_a_refused_stream_ends_with_its_status_and_the_others_finish(tmp_path):
    async def go():
        async with served(tmp_path) as (loop, stub, address, _):
            mux = Mux(stub)
            # ok0 long enough to be still open when its twin arrives.
            lengths = [200, 6, 6]
            good = [mux.submit(submit(f"ok{i}", max_tokens=n), 20) for i, n in enumerate(lengths)]
            bad = {
                "zero": mux.submit(submit("zero", max_tokens=0), 20),
                "long": mux.submit(submit("long", prompt=range(300)), 20),
                "twin": mux.submit(submit("ok0"), 20),  # an id open on this scheduler
            }
            errors = {name: await stream.read() for name, stream in bad.items()}
            assert errors["zero"].code == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_tokens" in errors["zero"].details
            assert errors["twin"].code == grpc.StatusCode.ALREADY_EXISTS
            # What the client is told, the scheduler's trailers included.
            status = client_status(errors["long"], address)
            assert status.code == grpc.StatusCode.INVALID_ARGUMENT
            assert (ERROR_CODE_KEY, "context_length_exceeded") in status.trailing_metadata
            for stream, n in zip(good, lengths, strict=True):
                tokens, reason = await read_all(stream)
                assert reason == LENGTH and executor_tokens(tokens, n)
            await mux.close()

    run(go())


def test_cancel_and_a_deadline_abort_the_request_upstream(tmp_path):
    async def go():
        async with served(tmp_path, executor=False) as (loop, stub, *_):  # nothing runs
            mux = Mux(stub)
            kept = mux.submit(submit("kept"), None)
            cancelled = mux.submit(submit("cancelled"), None)
            timed = mux.submit(submit("timed"), 0.3)
            assert await settled(lambda: len(loop.core.requests) == 3)
            pending = asyncio.create_task(cancelled.read())
            await asyncio.sleep(0.05)
            assert cancelled.cancel() and not cancelled.cancel()  # idempotent
            with pytest.raises(asyncio.CancelledError):
                await pending
            assert (await timed.read()).code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await settled(lambda: len(loop.core.requests) == 1)
            assert not loop.is_known("default\x1fcancelled")
            assert not loop.is_known("default\x1ftimed") and loop.is_known("default\x1fkept")
            assert kept.cancel()
            assert await settled(lambda: not loop.core.requests)
            await mux.close()

    run(go())


def test_a_scheduler_that_goes_away_fails_its_streams_and_the_next_opens_a_new_call(tmp_path):
    async def go():
        async with served(tmp_path, executor=False) as (loop, _, address, server):
            async with grpc.aio.insecure_channel(address) as channel:
                mux = Mux(scheduler_pb2_grpc.SchedulerStub(channel))
                streams = [mux.submit(submit(f"r{i}"), 20) for i in range(3)]
                assert await settled(lambda: len(loop.core.requests) == 3)
                await server.stop(0)
                for stream in streams:
                    end = await stream.read()
                    assert end.code in REPLICA_FAILURES  # continued elsewhere
                assert await settled(lambda: not loop.core.requests)  # the call's end
                again = grpc.aio.server()  # the scheduler is back on its port
                scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(loop), again)
                again.add_insecure_port(address)
                await again.start()
                try:
                    stream = mux.submit(submit("after"), 20)
                    assert await settled(lambda: loop.is_known("default\x1fafter"), 10)
                    stream.cancel()
                finally:
                    await mux.close()
                    await again.stop(0)

    run(go())


def test_a_call_past_its_age_takes_no_new_stream_and_closes_once_idle(tmp_path):
    """With ``max_call_age_s`` (for a proxy that cuts long calls) a call that old takes no
    new stream: the next opens a new call, and the old one half-closes once its own
    streams have ended, every one of them served in full."""
    calls = Calls()

    async def go():
        async with served(tmp_path, interceptors=[calls]) as (loop, _, address, _):
            channel = grpc.aio.insecure_channel(address)
            mux = Mux(scheduler_pb2_grpc.SchedulerStub(channel), max_call_age_s=0.2)
            first = mux.submit(submit("first", max_tokens=40), 20)
            young = mux.submit(submit("young"), 20)  # the same call: not old yet
            await asyncio.sleep(0.3)
            later = mux.submit(submit("later"), 20)
            assert mux.num_calls == 2
            results = await asyncio.gather(read_all(first), read_all(young), read_all(later))
            for (tokens, reason), n in zip(results, (40, 6, 6), strict=True):
                assert reason == LENGTH and executor_tokens(tokens, n)
            assert await settled(lambda: loop.streams.num_many_calls == 1)  # the old one ended
            await mux.close()
            await channel.close()
        assert calls.methods == ["SubmitMany", "SubmitMany"]

    run(go())


def test_a_retiring_replicas_call_closes_once_its_streams_end(tmp_path):
    async def go():
        async with served(tmp_path) as (_, _, address, _):
            channel = grpc.aio.insecure_channel(address)
            mux = Mux(scheduler_pb2_grpc.SchedulerStub(channel))
            stream = mux.submit(submit("last", max_tokens=20), 20)
            mux.retire()
            tokens, _ = await read_all(stream)
            assert executor_tokens(tokens, 20)
            # Graceful close waits for calls in flight: the half-closed call has ended.
            await asyncio.wait_for(channel.close(grace=60), 10)
            await mux.close()

    run(go())


@pytest.mark.parametrize("age", [None, 0.2])
def test_upstream_call_max_age_reaches_the_gateways_replicas(tokenizer, age):
    """``--upstream-call-max-age`` (``python -m gateway`` and ``continuum serve`` alike:
    tests/continuum/test_serve_config.py) reaches the gateway's replicas: with it, a
    request after the call's age opens a new call; without it, every request rides the
    one call."""
    from gateway.__main__ import parse_args

    argv = [] if age is None else ["--upstream-call-max-age", str(age)]
    config = parse_args(["--model-dir", "m", "--scheduler", "127.0.0.1:1", *argv])
    assert config.upstream_call_max_age_s == (age or 0.0)
    scheduler = FakeScheduler(events=[scheduler_pb2.TokenEvent(
        token_ids=[42], finish_reason=LENGTH)])

    async def go():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, upstream_call_max_age_s=config.upstream_call_max_age_s
                        ) as (running, channel):
            answers = []
            for _ in range(2):
                request = generation_pb2.GenerateRequest(prompt="hi")
                answers += await collect(generation_stub(channel).Generate(request, timeout=10))
                await asyncio.sleep(0.3)
            return answers

    responses = run(go())
    assert [r.finish_reason for r in responses] == [LENGTH, LENGTH]
    assert scheduler.num_many_calls == (1 if age is None else 2)
    assert len(scheduler.submitted) == 2


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(proto_strategies.messages(scheduler_pb2.SubmitRequest.DESCRIPTOR),
                      min_size=1, max_size=10))
def test_drawn_requests_end_alone_and_a_guarded_stream_finishes(tmp_path_factory, drawn):
    """Whatever a drawn SubmitRequest holds, its stream ends by itself (tokens to a finish,
    or a StreamEnd the relay maps to a client status), and a stream beside them on the
    same call gets every token: none of them breaks the call."""
    tmp_path = tmp_path_factory.mktemp("mux")
    for request in drawn:  # bounded work for the fake executor
        request.max_tokens = min(request.max_tokens, 8)
        del request.prompt_token_ids[64:]
        if request.request_id == "guard":
            request.request_id = "not-the-guard"

    async def ends(stream) -> None:
        while (event := await stream.read()).__class__ is not StreamEnd:
            pass
        if event is not FINISHED:
            assert event.code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
            client_status(event, "replica")  # what the client gets: no exception

    async def go():
        async with served(tmp_path) as (_, stub, *_):
            mux = Mux(stub)
            guard = mux.submit(submit("guard", max_tokens=12), 20)
            streams = [mux.submit(request, 20) for request in drawn]
            await asyncio.wait_for(asyncio.gather(*map(ends, streams)), 20)
            tokens, _ = await read_all(guard)
            assert executor_tokens(tokens, 12)
            await mux.close()

    run(go())
