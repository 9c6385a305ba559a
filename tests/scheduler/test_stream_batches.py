"""A stream that fell behind the steps sends what it owes in one message
(scheduler_svc/streams.py ``ManyCall.take``): every token once, in order, its logprobs
beside it, the end last, and nothing after the end; one event is one message of one
token. With a stream interval a message waits for that many tokens, except the first and
the end. Each test drives a ManyCall on a real engine loop directly, its events put into
the stream's sink as the loop puts them (the same through a real gRPC call:
tests/scheduler/test_submit_many.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from protos.continuum.v1 import sampling_pb2, scheduler_pb2
from scheduler_svc.core import ConfigError, FinishReason, SchedulerConfig
from scheduler_svc.streams import ManyCall
from tests.scheduler.factories import make_request
from tests.scheduler.fake_peer import served


def _logprob(token: int) -> sampling_pb2.TokenLogprob:
    return sampling_pb2.TokenLogprob(token_id=token, logprob=-0.5)


def _taken(call: ManyCall) -> list[scheduler_pb2.StreamEvent]:
    """The stream messages ``call`` sends now, in order."""
    return [message for response in call.take() for message in response.events]


def _with_loop(tmp_path, check, **config) -> None:
    """``check(loop)`` on a real engine loop (no executor: nothing steps)."""
    async def go():
        async with served(tmp_path, executor=False, **config) as (loop, *_):
            check(loop)

    asyncio.run(go())


def test_one_event_is_one_message_of_one_token(tmp_path):
    def check(loop):
        req = make_request()
        req.token_ids.append(7)
        call = ManyCall(loop)
        call.opened(1, req).put_nowait((req, 7, None, None))
        [message] = _taken(call)
        event = message.event
        assert message.stream_id == 1
        assert list(event.token_ids) == [7] and event.finish_reason == 0
        assert event.num_generated_tokens == req.num_output_tokens == 1
        assert not _taken(call)  # sent once

    _with_loop(tmp_path, check)


def test_events_behind_it_join_it_up_to_the_end_and_nothing_after(tmp_path):
    def check(loop):
        req = make_request()
        req.token_ids += [5, 6, 7]
        call = ManyCall(loop)
        sink = call.opened(1, req)
        for token in (5, 6):
            sink.put_nowait((req, token, None, _logprob(token)))
        sink.put_nowait((req, 7, FinishReason.LENGTH, _logprob(7)))
        [message] = _taken(call)
        event = message.event
        assert list(event.token_ids) == [5, 6, 7]
        assert [lp.token_id for lp in event.logprobs] == [5, 6, 7]  # beside their tokens
        assert event.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
        assert event.num_generated_tokens == 3
        sink.put_nowait((req, 8, None, None))  # after the end: never sent
        assert not _taken(call) and not call.open

    _with_loop(tmp_path, check)


def test_an_end_without_a_token_ends_the_message_of_the_tokens_before_it(tmp_path):
    def check(loop):
        req = make_request()
        req.token_ids.append(9)
        call = ManyCall(loop)
        sink = call.opened(1, req)
        sink.put_nowait((req, 9, None, None))
        sink.put_nowait((req, None, FinishReason.ABORT, None))
        [message] = _taken(call)
        assert list(message.event.token_ids) == [9] and not message.event.logprobs
        assert message.event.finish_reason == sampling_pb2.FINISH_REASON_ABORT

    _with_loop(tmp_path, check)


def test_a_stream_interval_holds_tokens_back_but_never_the_first_or_the_end(tmp_path):
    def tokens(call) -> list[list[int]]:
        return [list(message.event.token_ids) for message in _taken(call)]

    def check(loop):
        req = make_request()
        call = ManyCall(loop)
        sink = call.opened(1, req)
        sink.put_nowait((req, 1, None, None))
        assert tokens(call) == [[1]]  # the first token: time to first token is not held
        for token in (2, 3, 4):
            sink.put_nowait((req, token, None, None))
            assert tokens(call) == []  # three tokens: it waits for a fourth
        sink.put_nowait((req, 5, None, None))
        assert tokens(call) == [[2, 3, 4, 5]]
        sink.put_nowait((req, 6, None, None))
        assert tokens(call) == []
        sink.put_nowait((req, None, FinishReason.STOP, None))  # the end goes at once
        [message] = _taken(call)
        assert list(message.event.token_ids) == [6]
        assert message.event.finish_reason == sampling_pb2.FINISH_REASON_STOP
        # Interval 1 (read at each take, as a live reload sets it): every token as it comes.
        loop.reconfigure(dataclasses.replace(loop.core.config, stream_interval=1))
        other = make_request()
        sink = call.opened(2, other)
        for token in (7, 8, 9):
            sink.put_nowait((other, token, None, None))
            assert tokens(call) == [[token]]

    _with_loop(tmp_path, check, stream_interval=4)


def test_stream_interval_must_be_a_positive_integer():
    for bad in (0, -1, 2.5):
        with pytest.raises(ConfigError, match="stream_interval"):
            SchedulerConfig(stream_interval=bad)
    assert SchedulerConfig(stream_interval=8).stream_interval == 8
