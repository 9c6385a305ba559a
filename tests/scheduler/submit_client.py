"""A test's request to a real scheduler, as a gateway sends it: one stream on a SubmitMany
call (here a call of its own, half-closed after the submit), with a sync stub."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from protos.continuum.v1 import scheduler_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class StreamFailed(Exception):
    """The stream ended with a StreamError: its ``code``, ``message`` and ``trailers``."""

    def __init__(self, error: scheduler_pb2.StreamError) -> None:
        super().__init__(f"{_CODES[error.code].name}: {error.message}")
        self.code = _CODES[error.code]
        self.message = error.message
        self.trailers = dict(error.trailers)


class Stream:
    """``request``'s TokenEvents as they come (iterate it); raises StreamFailed at a
    StreamError. ``cancel()`` cancels the call (the scheduler aborts the request)."""

    def __init__(self, stub, request: scheduler_pb2.SubmitRequest,
                 timeout: float | None = None, metadata=()) -> None:
        self.call = stub.SubmitMany(
            iter([scheduler_pb2.SubmitManyRequest(stream_id=1, submit=request)]),
            timeout=timeout, metadata=metadata)

    def __iter__(self) -> Iterator[scheduler_pb2.TokenEvent]:
        for response in self.call:
            for item in response.events:
                if item.HasField("error"):
                    raise StreamFailed(item.error)
                yield item.event
                if item.event.finish_reason:
                    return

    def cancel(self) -> None:
        self.call.cancel()


def submit(stub, request: scheduler_pb2.SubmitRequest, timeout: float | None = None,
           metadata=()) -> list[scheduler_pb2.TokenEvent]:
    """Every TokenEvent of ``request``, to its finish; raises StreamFailed."""
    return list(Stream(stub, request, timeout, metadata))
