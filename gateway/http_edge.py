"""The HTTP server's connection-level defences: connections cannot be held hostage.

* Request head: once a request head starts to arrive, it must be complete
  within `header_timeout_s`, else the connection is closed (a slowloris head
  that trickles a byte a second is closed on time: data does not reset the
  clock). aiohttp has no such timer, so `_Handler` adds one per connection.
* Idle keep-alive connections (and ones that never send a byte) are closed
  after `keepalive_s` by aiohttp's own keep-alive timer (75 s, nginx's
  keepalive_timeout: longer than the 60 s idle timeout of common proxies, so a
  proxy never reuses a connection we are closing).
* Request body: `read_body` reads it within `body_timeout_s`; a lying
  Content-Length or a body that trickles gets 408 at once, and the connection
  is closed after at most `lingering_s` more (aiohttp keeps reading an unread
  body that long so that a client still sending sees the answer instead of a
  reset; nginx's lingering_timeout is 5 s).
* Open connections: at most `max_connections`; the next one is answered a
  plain 503 with a JSON body and closed before any request is read.
* Head sizes: aiohttp's parser limits (8,190-byte lines and fields, 128
  headers) answer 400/431 themselves.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import grpc
from aiohttp import web, web_protocol

from gateway.validation import RequestError


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 2048
    lingering_s: float = 5.0
    keepalive_s: float = 75.0


def _refusal(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable_error",
                                 "param": None, "code": None}}).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
            ).encode() + body


class _Handler(web_protocol.RequestHandler):
    """aiohttp's per-connection protocol, closing the connection when a request head,
    once begun, is not complete within `head_timeout_s`.

    The parent waits on `_waiter` while no complete request has been parsed and
    counts parsed requests in `_request_count` (aiohttp 3.14, pinned); a head is
    complete when either moves."""

    __slots__ = ("_head_timeout_s", "_head_timer", "_head_count")

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_count = 0  # requests parsed when the running timer started

    def _waiting_for_a_head(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self._request_count != self._head_count:
            self._head_timer.cancel()  # that head is complete; the next one gets its own
            self._head_timer = None
        if self._head_timer is None and self._waiting_for_a_head():
            self._head_count = self._request_count
            self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._request_count == self._head_count and self._waiting_for_a_head():
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)


class _Server(web.Server):
    """aiohttp's connection manager (its class swapped in by `start_http`), making
    `_Handler`s and refusing connections past `limits.max_connections`."""

    limits: HttpLimits

    def __call__(self) -> web_protocol.RequestHandler:
        return _Handler(self, loop=self._loop, head_timeout_s=self.limits.header_timeout_s,
                        **self._kwargs)

    def connection_made(self, handler: web_protocol.RequestHandler,
                        transport: asyncio.Transport) -> None:
        if len(self._connections) >= self.limits.max_connections:
            transport.write(_refusal(
                "503 Service Unavailable",
                f"this gateway holds its limit of {self.limits.max_connections} open "
                "connections; retry shortly or on another gateway"))
            handler.force_close()  # closes the transport once the bytes are written
            return
        super().connection_made(handler, transport)


async def read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The whole body within `body_timeout_s`; RequestError 408 otherwise.

    Over `max_body_bytes` aiohttp raises its 413, which the error middleware shapes."""
    try:
        return await asyncio.wait_for(request.read(), limits.body_timeout_s)
    except TimeoutError as exc:
        raise RequestError(
            f"the request body did not arrive within {limits.body_timeout_s:g} s "
            "(Content-Length larger than the body sent?)",
            grpc.StatusCode.DEADLINE_EXCEEDED, http_status=408) from exc


async def start_http(app: web.Application, host: str, port: int, limits: HttpLimits
                     ) -> tuple[web.AppRunner, int]:
    """Starts serving `app`; returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None, keepalive_timeout=limits.keepalive_s,
                           lingering_time=limits.lingering_s)
    await runner.setup()
    assert type(runner.server) is web.Server  # what AppRunner makes; ours only adds
    runner.server.__class__ = _Server
    runner.server.limits = limits
    site = web.TCPSite(runner, host, port, reuse_port=False)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = runner.addresses
    return runner, sockets[0][1] if sockets else port
