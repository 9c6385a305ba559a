"""A Submit stream that fell behind the steps sends what it owes in one TokenEvent
(scheduler_svc/servicer.py ``take_ready``): every token once, in order, its logprobs
beside it, the end last; one event queued is one message, as before."""

from __future__ import annotations

import asyncio

from protos.continuum.v1 import sampling_pb2
from scheduler_svc.core import FinishReason
from scheduler_svc.servicer import _to_event, take_ready
from tests.scheduler.factories import make_request


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
    event = _to_event([first], False)
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
    event = _to_event(batch, False)
    assert list(event.token_ids) == [5, 6, 7]
    assert [lp.token_id for lp in event.logprobs] == [5, 6, 7]  # beside their tokens
    assert event.finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    assert event.num_generated_tokens == 3


def test_an_end_without_a_token_ends_the_message_of_the_tokens_before_it():
    req = make_request()
    req.token_ids.append(9)
    batch = take_ready(_queue((req, None, FinishReason.ABORT, None)), (req, 9, None, None))
    event = _to_event(batch, False)
    assert list(event.token_ids) == [9] and not event.logprobs
    assert event.finish_reason == sampling_pb2.FINISH_REASON_ABORT
