"""A Submit stream that fell behind the steps sends what it owes in one TokenEvent
(scheduler_svc/streams.py ``take_ready``): every token once, in order, its logprobs
beside it, the end last; one event queued is one message, as before. With a stream
interval (``next_batch``) a message waits for that many tokens, except the first and the
end; through a real gRPC server the client gets every token, in fewer messages."""

from __future__ import annotations

import asyncio

import pytest

from protos.continuum.v1 import sampling_pb2, scheduler_pb2
from scheduler_svc.core import ConfigError, FinishReason, SchedulerConfig
from scheduler_svc.streams import next_batch, take_ready, to_event
from tests.scheduler.factories import make_request
from tests.scheduler.fake_peer import served


def _queue(*events) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for ev in events:
        queue.put_nowait(ev)
    return queue


def _logprob(token: int) -> sampling_pb2.TokenLogprob:
    return sampling_pb2.TokenLogprob(token_id=token, logprob=-0.5)


def test_one_event_queued_is_one_message_of_one_token():
    req = make_request()
    req.token_ids.append(7)
    first = (req, 7, None, None)
    assert take_ready(_queue(), first) == [first]
    event = to_event([first], False)
    assert list(event.token_ids) == [7] and event.finish_reason == 0
    assert event.num_generated_tokens == req.num_output_tokens == 1


def test_events_behind_it_join_it_up_to_the_end_and_nothing_after():
    req = make_request()
    req.token_ids += [5, 6, 7]
    events = [(req, t, None, _logprob(t)) for t in (5, 6)]
    end = (req, 7, FinishReason.LENGTH, _logprob(7))
    queue = _queue(events[1], end, ("after the end",))
    batch = take_ready(queue, events[0])
    assert batch == [*events, end] and queue.qsize() == 1  # never past the stream's end
    event = to_event(batch, False)
    assert list(event.token_ids) == [5, 6, 7]
    assert [lp.token_id for lp in event.logprobs] == [5, 6, 7]  # beside their tokens
    assert event.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert event.num_generated_tokens == 3


def test_an_end_without_a_token_ends_the_message_of_the_tokens_before_it():
    req = make_request()
    req.token_ids.append(9)
    batch = take_ready(_queue((req, None, FinishReason.ABORT, None)), (req, 9, None, None))
    event = to_event(batch, False)
    assert list(event.token_ids) == [9] and not event.logprobs
    assert event.finish_reason == sampling_pb2.FINISH_REASON_ABORT


def test_a_stream_interval_holds_tokens_back_but_never_the_first_or_the_end():
    req = make_request()

    async def go():
        queue = _queue((req, 1, None, None))
        assert await next_batch(queue, 4, first=True) == [(req, 1, None, None)]
        later = asyncio.create_task(next_batch(queue, 4, first=False))
        for token in (2, 3, 4):
            queue.put_nowait((req, token, None, None))
            await asyncio.sleep(0)
            assert not later.done()  # three tokens: it waits for a fourth
        queue.put_nowait((req, 5, None, None))
        assert [t for _, t, _, _ in await later] == [2, 3, 4, 5]
        queue.put_nowait((req, 6, None, None))
        end = asyncio.create_task(next_batch(queue, 4, first=False))
        await asyncio.sleep(0)
        assert not end.done()
        queue.put_nowait((req, None, FinishReason.STOP, None))  # the end goes at once
        assert [(t, r) for _, t, r, _ in await end] == [(6, None), (None, FinishReason.STOP)]
        queue.put_nowait((req, 7, None, None))  # interval 1: every token as it comes
        assert await next_batch(queue, 1, first=False) == [(req, 7, None, None)]

    asyncio.run(go())


def test_stream_interval_must_be_a_positive_integer():
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="stream_interval"):
            SchedulerConfig(stream_interval=bad)
    assert SchedulerConfig(stream_interval=8).stream_interval == 8


@pytest.mark.parametrize("interval", [1, 4])
def test_a_grpc_client_gets_every_token_in_messages_of_the_interval(tmp_path, interval):
    """A real Submit call through a real gRPC server on loopback, the engine loop stepped
    by a fake executor on a real ipc socket: the tokens are the executor's, in order;
    after the first message, every one but the last holds at least ``interval``."""
    async def go():
        async with served(tmp_path, stream_interval=interval) as (_, stub, *_):
            call = stub.Submit(scheduler_pb2.SubmitRequest(
                request_id="r", prompt_token_ids=[5, 6, 7], max_tokens=11,
                sampling=sampling_pb2.SamplingParams(temperature=0.0)), timeout=20)
            messages = [list(event.token_ids) async for event in call]
        tokens = [t for m in messages for t in m]
        seq_id = tokens[0] - 100 - 3  # the fake executor's tokens: 100 + seq id + position
        assert tokens == [100 + seq_id + p for p in range(3, 14)]
        assert all(len(m) >= interval for m in messages[1:-1])
        assert len(messages) <= 2 + (11 - 1) // interval

    asyncio.run(go())
