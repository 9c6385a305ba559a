"""SubmitMany (scheduler_svc/streams.py) through a real gRPC server on loopback, the
engine loop stepped by a fake executor on a real ipc socket: each stream gets the
executor's tokens in order and its end, many streams' messages share a response, and
one stream's trouble (refused, malformed, cancelled) stays its own; the call's end aborts
what is open on it. Drawn messages (the fuzzer's strategies) never break the call or
another stream."""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import proto_strategies
from protos.continuum.v1 import sampling_pb2, scheduler_pb2
from scheduler_svc.streams import MESSAGE_EVENTS, RESPONSE_BYTES, ManyCall
from tests.scheduler.factories import make_request
from tests.scheduler.fake_peer import served, settled

STOP = sampling_pb2.FINISH_REASON_STOP
LENGTH = sampling_pb2.FINISH_REASON_LENGTH


def submit(request_id: str, max_tokens: int = 5, prompt=(5, 6, 7), **fields):
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=list(prompt), max_tokens=max_tokens,
        sampling=sampling_pb2.SamplingParams(temperature=0.0), **fields)


def opening(stream_id: int, request: scheduler_pb2.SubmitRequest):
    return scheduler_pb2.SubmitManyRequest(stream_id=stream_id, submit=request)


def cancelling(stream_id: int):
    return scheduler_pb2.SubmitManyRequest(stream_id=stream_id, cancel=True)


class Streams:
    """What one SubmitMany call delivered, per stream id: token lists of each message,
    the finish reason, the error; and how many responses carried more than one stream."""

    def __init__(self, reused_ids: bool = False) -> None:
        self.reused_ids = reused_ids  # a message after a stream's end opens a new one
        self.messages: dict[int, list[list[int]]] = {}
        self.finish: dict[int, int] = {}
        self.errors: dict[int, scheduler_pb2.StreamError] = {}
        self.num_responses = 0
        self.num_shared = 0

    def add(self, response: scheduler_pb2.SubmitManyResponse) -> None:
        self.num_responses += 1
        self.num_shared += len({e.stream_id for e in response.events}) > 1
        for e in response.events:
            if self.reused_ids:
                if e.stream_id in self.finish or e.stream_id in self.errors:
                    for ends in (self.messages, self.finish, self.errors):
                        ends.pop(e.stream_id, None)
            else:
                assert e.stream_id not in self.finish and e.stream_id not in self.errors, \
                    f"stream {e.stream_id} got a message after its end"
            if e.HasField("error"):
                self.errors[e.stream_id] = e.error
                continue
            self.messages.setdefault(e.stream_id, []).append(list(e.event.token_ids))
            if e.event.finish_reason:
                self.finish[e.stream_id] = e.event.finish_reason

    def tokens(self, stream_id: int) -> list[int]:
        return [t for m in self.messages.get(stream_id, []) for t in m]

    def ended(self, ids) -> bool:
        return all(i in self.finish or i in self.errors for i in ids)


async def _collect(call, streams: Streams, until, timeout_s: float = 20.0) -> None:
    async def read() -> None:
        async for response in call:
            streams.add(response)
            if until(streams):
                return
        raise AssertionError(f"the call ended first: {await call.code()}")

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"not ended in {timeout_s} s: finished {streams.finish}, "
                             f"errors {sorted(streams.errors)}, "
                             f"tokens { {i: len(m) for i, m in streams.messages.items()} }"
                             ) from None


def _executor_tokens(tokens: list[int], prompt_len: int, n: int) -> bool:
    """The fake executor's answer: 100 + seq id + position, from the prompt's end."""
    if len(tokens) != n:
        return False
    seq_id = tokens[0] - 100 - prompt_len
    return tokens == [100 + seq_id + p for p in range(prompt_len, prompt_len + n)]


def test_many_streams_on_one_call_each_get_their_tokens_and_share_responses(tmp_path):
    async def go():
        async with served(tmp_path) as (loop, stub, *_):
            call = stub.SubmitMany(timeout=30)
            ids = list(range(1, 9))
            for i in ids:
                await call.write(opening(i, submit(f"r{i}", max_tokens=6 + i)))
            streams = Streams()
            await _collect(call, streams, lambda s: s.ended(ids))
            call.cancel()
            for i in ids:
                assert streams.finish[i] == LENGTH, i
                assert _executor_tokens(streams.tokens(i), 3, 6 + i), streams.tokens(i)
            assert streams.num_shared > 0  # a step's messages for several in one write
            assert not loop.core.requests

    asyncio.run(go())


def test_refused_and_malformed_streams_end_alone_and_the_others_finish(tmp_path):
    async def go():
        async with served(tmp_path) as (loop, stub, *_):
            call = stub.SubmitMany(timeout=30)
            await call.write(opening(1, submit("good", max_tokens=40)))
            await call.write(opening(2, submit("bad", max_tokens=0)))  # INVALID_ARGUMENT
            await call.write(opening(3, submit("good")))  # its id is in flight
            await call.write(scheduler_pb2.SubmitManyRequest(stream_id=4))  # no action
            await call.write(opening(5, submit("long", max_tokens=10_000)))  # past the model
            await call.write(opening(6, submit("other", max_tokens=40)))  # still open next
            await call.write(opening(6, submit("again", max_tokens=4)))  # id 6 is open
            await call.write(cancelling(99))  # nothing open: nothing happens
            streams = Streams()
            await _collect(call, streams, lambda s: s.ended([1, 2, 3, 4, 5, 6]))
            call.cancel()
            code = {i: grpc.StatusCode.INVALID_ARGUMENT.value[0] for i in (2, 4, 5, 6)}
            code[3] = grpc.StatusCode.ALREADY_EXISTS.value[0]
            assert {i: e.code for i, e in streams.errors.items()} == code
            assert "max_tokens" in streams.errors[2].message
            assert "already open" in streams.errors[6].message
            assert streams.errors[5].trailers["error-code"] == "context_length_exceeded"
            assert streams.finish[1] == LENGTH and _executor_tokens(streams.tokens(1), 3, 40)
            # The open stream 6 was aborted with its bad twin.
            assert await settled(lambda: not loop.core.requests, 1)

    asyncio.run(go())


def test_a_cancelled_stream_is_aborted_and_the_calls_end_aborts_the_rest(tmp_path):
    async def go():
        async with served(tmp_path, executor=False) as (loop, stub, *_):  # nothing runs
            call = stub.SubmitMany(timeout=30)
            for i in (1, 2, 3):
                await call.write(opening(i, submit(f"r{i}")))
            assert await settled(lambda: len(loop.core.requests) == 3)
            await call.write(cancelling(2))
            await settled(lambda: len(loop.core.requests) == 2)
            assert sorted(k.split("\x1f")[1] for k in loop.core.requests) == ["r1", "r3"]
            assert not loop.is_known("default\x1fr2")
            call.cancel()  # the gateway went away
            assert await settled(lambda: not loop.core.requests)

    asyncio.run(go())


def test_a_full_queue_and_a_drain_end_streams_with_their_statuses(tmp_path):
    async def go():
        async with served(tmp_path, executor=False, max_num_waiting=1) as (loop, stub, *_):
            call = stub.SubmitMany(timeout=30)
            await call.write(opening(1, submit("waits")))
            await call.write(opening(2, submit("refused")))
            streams = Streams()
            await _collect(call, streams, lambda s: 2 in s.errors)
            error = streams.errors[2]
            assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            assert int(error.trailers["retry-after-ms"]) > 0
            loop.abort_all("the scheduler is draining; retry elsewhere")
            await _collect(call, streams, lambda s: 1 in s.errors)
            assert streams.errors[1].code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert "draining" in streams.errors[1].message
            await call.done_writing()  # done sending, nothing open: the call ends OK
            async for _ in call:
                raise AssertionError("nothing more was due")
            assert await call.code() == grpc.StatusCode.OK

    asyncio.run(go())


def test_a_stream_interval_gathers_each_streams_tokens(tmp_path):
    async def go():
        async with served(tmp_path, stream_interval=4) as (loop, stub, *_):
            call = stub.SubmitMany(timeout=30)
            for i in (1, 2):
                await call.write(opening(i, submit(f"r{i}", max_tokens=13)))
            streams = Streams()
            await _collect(call, streams, lambda s: s.ended([1, 2]))
            call.cancel()
            for i in (1, 2):
                messages = streams.messages[i]
                assert _executor_tokens(streams.tokens(i), 3, 13)
                assert len(messages[0]) >= 1 and all(len(m) >= 4 for m in messages[1:-1])
                assert len(messages) <= 2 + (13 - 1) // 4

    asyncio.run(go())


@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(drawn=st.lists(proto_strategies.messages(scheduler_pb2.SubmitManyRequest.DESCRIPTOR),
                      min_size=1, max_size=12))
def test_drawn_messages_never_break_the_call_or_another_stream(tmp_path_factory, drawn):
    """Whatever the drawn messages ask (any ids, actions, fields), the call stays up and a
    good stream beside them (an id none of them can take) gets all its tokens."""
    tmp_path = tmp_path_factory.mktemp("many")
    good = 2**64 - 1
    for message in drawn:
        if message.stream_id == good:
            message.stream_id = 0
        if message.HasField("submit"):  # bounded work for the fake executor
            message.submit.max_tokens = min(message.submit.max_tokens, 8)
            del message.submit.prompt_token_ids[64:]

    async def go():
        async with served(tmp_path) as (loop, stub, *_):
            call = stub.SubmitMany(timeout=30)
            await call.write(opening(good, submit("guard", max_tokens=12)))
            for message in drawn:
                await call.write(message)
            streams = Streams(reused_ids=True)
            await _collect(call, streams, lambda s: s.ended([good]))
            assert good in streams.finish, streams.errors.get(good)
            assert _executor_tokens(streams.tokens(good), 3, 12)
            assert call.done() is False  # the call itself is still up
            call.cancel()

    asyncio.run(go())


def test_a_backlog_goes_out_in_bounded_messages_and_responses(tmp_path):
    """Streams far behind (a gateway that stopped reading for a while), with top-20
    logprobs: each stream's tokens come in order, MESSAGE_EVENTS at most a message, in
    responses that stay about RESPONSE_BYTES, far under the 4 MiB a gateway receives, so
    no stream's backlog can break the call for the others."""
    async def go():
        async with served(tmp_path, executor=False) as (loop, *_):
            call = ManyCall(loop)
            reqs = [make_request(request_id=f"b{i}") for i in range(40)]
            sinks = [call.opened(i + 1, req) for i, req in enumerate(reqs)]
            lp = sampling_pb2.TokenLogprob(token_id=1, logprob=-0.5,
                                           top_token_ids=range(20), top_logprobs=[-1.0] * 20)
            for sink, req in zip(sinks, reqs, strict=True):
                for token in range(1000):
                    sink.put_nowait((req, token, None, lp))
            responses = call.take()
            tokens: dict[int, list[int]] = {}
            for response in responses:
                assert response.ByteSize() < RESPONSE_BYTES + 200_000 < 4 << 20
                for e in response.events:
                    assert len(e.event.token_ids) <= MESSAGE_EVENTS
                    assert len(e.event.logprobs) == len(e.event.token_ids)
                    tokens.setdefault(e.stream_id, []).extend(e.event.token_ids)
            assert len(responses) > 1
            assert tokens == {i + 1: list(range(1000)) for i in range(40)}

    asyncio.run(go())
