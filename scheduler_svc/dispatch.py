"""Where each request's events go as steps produce them: its call's stream.

A SubmitMany call (scheduler_svc/streams.py) gives each of its streams a sink that
gathers them for the call's next write (a test or benchmark driving the loop alone reads
an ``asyncio.Queue``). ``Streams`` maps request ids to those sinks (the loop's ``submit``
registers one, ``dispatch`` hands each event to its request's and forgets a request at its
end) and counts SubmitMany's calls and streams for /metrics.
"""

from __future__ import annotations

from typing import Protocol

from scheduler_svc.core import Event


class EventSink(Protocol):
    """A request's events go here, on the loop; must not block."""

    def put_nowait(self, ev: Event) -> None: ...


class Streams:
    """Request id → its sink, while the request lives."""

    __slots__ = ("_sinks", "num_many_calls", "num_many_streams")

    def __init__(self) -> None:
        self._sinks: dict[str, EventSink] = {}
        self.num_many_calls = 0  # SubmitMany calls open now
        self.num_many_streams = 0  # streams SubmitMany calls queued, ever

    def add(self, request_id: str, sink: EventSink) -> None:
        self._sinks[request_id] = sink

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sinks

    def dispatch(self, events: list[Event]) -> None:
        sinks = self._sinks
        for ev in events:
            req, _, reason, _ = ev
            sink = sinks.get(req.request_id)
            if sink is None:
                continue
            sink.put_nowait(ev)
            if reason is not None:
                del sinks[req.request_id]
