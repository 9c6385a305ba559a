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
* Open connections: at most `max_connections`. When they are all open, the one idle
  longest (a keep-alive connection between requests, or one that never sent a byte)
  is closed to make room, so a crowd of idle sockets cannot lock new clients out;
  only when none is idle is the next one answered a plain 503 with a JSON body and
  closed before any request is read. Per client address, at most
  `clients.max_connections` (gateway/edge/client_limits.py), with the same rule among that
  client's own connections: one more closes its longest-idle one, or, all busy, is
  answered 429.
* Head sizes: aiohttp's parser limits (8,190-byte lines and fields, 128
  headers) answer 400/431 themselves.
* TLS (`start_http(tls=...)`): each connection, as it arrives and before its
  handshake, has the certificate files looked at, so a replaced pair serves it
  (runtime/tls.py); connections already open keep theirs.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
from aiohttp import web, web_protocol

from gateway.edge.client_limits import ClientLimits
from gateway.validation import RequestError
from runtime.tls import ReloadingSslContext


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 2048
    lingering_s: float = 5.0
    keepalive_s: float = 75.0
    clients: ClientLimits = field(default_factory=ClientLimits)
    # Connections the kernel queues before the gateway accepts them: a burst of 1,000
    # clients connecting at once must wait there, not be reset (aiohttp's default is
    # 128; the kernel caps it at net.core.somaxconn).
    backlog: int = 4096


def _refusal(status: str, message: str, kind: str = "service_unavailable_error") -> bytes:
    body = json.dumps({"error": {"message": message, "type": kind,
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
    _addresses: dict[web_protocol.RequestHandler, str]  # counted connections' clients
    num_idle_closed: int  # idle connections closed to let a new one in

    tls: ReloadingSslContext | None = None

    def __call__(self) -> web_protocol.RequestHandler:
        if self.tls is not None:  # asyncio asks for the protocol before the handshake
            self.tls.refresh()
        return _Handler(self, loop=self._loop, head_timeout_s=self.limits.header_timeout_s,
                        **self._kwargs)

    def connection_made(self, handler: web_protocol.RequestHandler,
                        transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = peer[0] if peer else ""
        clients = self.limits.clients
        if clients.at_connection_cap(address):
            own = _longest_idle(h for h, a in self._addresses.items() if a == address)
            if own is None:
                transport.write(_refusal("429 Too Many Requests",
                                         clients.connection_refusal(), "rate_limit_exceeded"))
                handler.force_close()  # closes the transport once the bytes are written
                return
            self._make_room(own)  # its count is given back when it is gone
        elif len(self._connections) >= self.limits.max_connections:
            idle = _longest_idle(self._connections)
            if idle is None:
                transport.write(_refusal(
                    "503 Service Unavailable",
                    f"this gateway holds its limit of {self.limits.max_connections} open "
                    "connections, all busy; retry shortly or on another gateway"))
                handler.force_close()
                return
            self._make_room(idle)
        clients.open_connection(address)
        self._addresses[handler] = address
        super().connection_made(handler, transport)

    def _make_room(self, idle: web_protocol.RequestHandler) -> None:
        """Closes ``idle`` for a newcomer; the newcomer is let in at once, so the caps
        run one over until ``idle``'s connection_lost."""
        idle.force_close()
        self.num_idle_closed += 1

    def connection_lost(self, handler: web_protocol.RequestHandler,
                        exc: BaseException | None = None) -> None:
        address = self._addresses.pop(handler, None)
        if address is not None:
            self.limits.clients.close_connection(address)
        super().connection_lost(handler, exc)


def _longest_idle(connections) -> web_protocol.RequestHandler | None:
    """The connection waiting longest for its next request (aiohttp 3.14's handler
    state: waiting on `_waiter`, no request in progress, its keep-alive deadline the
    earliest); None if every one is busy."""
    idle = [handler for handler in connections
            if handler._waiter is not None and not handler._waiter.done()
            and not getattr(handler, "_request_in_progress", False)]
    return min(idle, key=lambda h: getattr(h, "_next_keepalive_close_time", 0.0),
               default=None)


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


async def start_http(app: web.Application, host: str, port: int, limits: HttpLimits,
                     tls: ReloadingSslContext | None = None) -> tuple[web.AppRunner, int]:
    """Starts serving `app` (over TLS with `tls`); returns the runner and the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None, keepalive_timeout=limits.keepalive_s,
                           lingering_time=limits.lingering_s)
    await runner.setup()
    assert type(runner.server) is web.Server  # what AppRunner makes; ours only adds
    runner.server.__class__ = _Server
    runner.server.limits = limits
    runner.server._addresses = {}
    runner.server.num_idle_closed = 0
    runner.server.tls = tls
    site = web.TCPSite(runner, host, port, reuse_port=False, backlog=limits.backlog,
                       ssl_context=None if tls is None else tls.context)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = runner.addresses
    return runner, sockets[0][1] if sockets else port
