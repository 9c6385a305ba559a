"""The gateway's SubmitMany multiplexer (gateway/routing/mux.py) against the real
scheduler servicer and engine loop (a fake executor stepping it on a real ipc socket),
over real gRPC on loopback: each stream reads as its Submit call would (the executor's
tokens, then EOF), on one call for all; a refused stream raises the AioRpcError Submit
would and the others finish; cancel and a deadline abort it upstream; a scheduler that
goes away fails the open streams with a status the relay continues elsewhere, and the
next stream opens a new call; a retiring replica's call closes once idle."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.reliability import proto_strategies
from gateway.routing.mux import Mux
from gateway.routing.replicas import ReplicaSet
from gateway.routing.upstream import ERROR_CODE_KEY, REPLICA_FAILURES, client_status
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.servicer import SchedulerServicer
from tests.gateway.harness import (
    FakeScheduler,
    collect,
    fake_scheduler,
    gateway,
    generation_stub,
    polled,
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
    """(tokens, finish reason) of a stream read to its EOF."""
    tokens, reason = [], 0
    while (event := await stream.read()) is not grpc.aio.EOF:
        tokens += event.token_ids
        reason = event.finish_reason or reason
    assert await stream.read() is grpc.aio.EOF  # and again, as a call's
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


def test_many_streams_share_one_call_and_each_reads_as_its_submit(tmp_path):
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


def test_a_refused_stream_raises_submits_status_and_the_others_finish(tmp_path):
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
            errors = {}
            for name, stream in bad.items():
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await stream.read()
                errors[name] = caught.value
            assert errors["zero"].code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_tokens" in errors["zero"].details()
            assert errors["twin"].code() == grpc.StatusCode.ALREADY_EXISTS
            # The client sees what a refused Submit gives it, trailers included.
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
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await timed.read()
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
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
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await stream.read()
                    assert caught.value.code() in REPLICA_FAILURES  # continued elsewhere
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


def test_a_replica_uses_submit_many_only_where_its_stats_say_so(tmp_path):
    async def go():
        async with served(tmp_path) as (_, _, address, _):
            for multiplex in (True, False):
                replicas = ReplicaSet([address], secret=None, multiplex=multiplex)
                (replica,) = replicas.replicas
                first = replica.submit(submit(f"first-{multiplex}"), 20)
                assert isinstance(first, grpc.aio.UnaryStreamCall)  # no Stats yet
                await replicas._poll(replica)
                assert replica.stats.submit_many
                later = replica.submit(submit(f"later-{multiplex}"), 20)
                assert isinstance(later, grpc.aio.UnaryStreamCall) is not multiplex
                for call in (first, later):
                    tokens = [t async for e in _events(call) for t in e.token_ids]
                    assert executor_tokens(tokens, 6)
                await replicas.close()

    run(go())


async def _events(call):
    while (event := await call.read()) is not grpc.aio.EOF:
        yield event


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


@pytest.mark.parametrize("flag", [False, True])
def test_one_call_per_request_keeps_a_submit_call_each(tokenizer, flag):
    """The flag (``python -m gateway`` and ``continuum serve`` alike) reaches the
    gateway's replicas: with it, requests to a SubmitMany scheduler still go on a
    Submit call each."""
    from continuum.cli import build_parser
    from gateway.__main__ import parse_args
    from gateway.edge import edge_flags

    argv = ["--one-call-per-request"] if flag else []
    config = parse_args(["--model-dir", "m", "--scheduler", "127.0.0.1:1", *argv])
    assert config.one_call_per_request is flag
    parser, _ = build_parser()
    assert ("--one-call-per-request" in edge_flags.to_argv(
        parser.parse_args(["serve", *argv]))) is flag
    scheduler = FakeScheduler(events=[scheduler_pb2.TokenEvent(
        token_ids=[42], finish_reason=LENGTH)], many=True)

    async def go():
        async with fake_scheduler(scheduler) as address, \
                gateway(tokenizer, address, one_call_per_request=flag) as (running, channel):
            await polled(running)
            request = generation_pb2.GenerateRequest(prompt="hi")
            return await collect(generation_stub(channel).Generate(request, timeout=10))

    (response,) = run(go())
    assert response.finish_reason == LENGTH
    assert scheduler.num_many_calls == (not flag) and len(scheduler.submitted) == 1


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(proto_strategies.messages(scheduler_pb2.SubmitRequest.DESCRIPTOR),
                      min_size=1, max_size=10))
def test_drawn_requests_end_alone_and_a_guarded_stream_finishes(tmp_path_factory, drawn):
    """Whatever a drawn SubmitRequest holds, its stream ends by itself (tokens then EOF, or
    an AioRpcError the relay maps to a client status), and a stream beside them on the
    same call gets every token: none of them breaks the call."""
    tmp_path = tmp_path_factory.mktemp("mux")
    for request in drawn:  # bounded work for the fake executor
        request.max_tokens = min(request.max_tokens, 8)
        del request.prompt_token_ids[64:]
        if request.request_id == "guard":
            request.request_id = "not-the-guard"

    async def ends(stream) -> None:
        try:
            while await stream.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as exc:
            assert exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
            client_status(exc, "replica")  # what the client gets: no exception

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
