"""The HTTP server's connection-level defences: no connection can be held hostage (flags,
defaults and answers: docs/usage.md, "Bad input and connection limits").

aiohttp has no request-head timer, so `_Handler` adds one (data does not reset it: a
slowloris head is closed on time). `read_body` bounds the body (408). `_Server` holds the
connection caps: a newcomer past one closes the longest-idle connection under it (idle:
answered, then silent for `IDLE_BEFORE_REUSE_S`; one not yet asked is never closed), or,
with none idle, is read and answered 429 / 503 with `Retry-After`, never reset; past
`max_connections` such refusals the answer is written at once. With TLS, each new
connection re-reads changed certificate files (runtime/tls.py)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import grpc
from aiohttp import web, web_protocol

from gateway.api.openai_api import error_body
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


# A connection answered and then silent this long is idle: one that was just answered may
# have its client's next request on the wire, and closing it would drop that request.
IDLE_BEFORE_REUSE_S = 1.0


@dataclass(frozen=True)
class Refusal:
    """The answer every request on a connection let in past a cap gets."""

    status: int
    message: str
    kind: str

    def raw(self) -> bytes:
        """The whole HTTP answer, for a connection refused before it is read."""
        body = json.dumps(error_body(self.message, self.kind)).encode()
        return (f"HTTP/1.1 {self.status} {_REASONS[self.status]}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\nRetry-After: 1\r\n\r\n").encode() + body


_REASONS = {429: "Too Many Requests", 503: "Service Unavailable"}



@web.middleware
async def _answer_refused(request: web.Request, handler) -> web.StreamResponse:
    """Answers a refused connection's request (its body is left to aiohttp's lingering
    read, so the close after the answer is a FIN, not a reset)."""
    refusal = getattr(request.protocol, "refusal", None)
    if refusal is None:
        return await handler(request)
    response = web.json_response(error_body(refusal.message, refusal.kind),
                                 status=refusal.status,
                                 headers={"Retry-After": "1"})
    response.force_close()
    return response


class _Handler(web_protocol.RequestHandler):
    """aiohttp's per-connection protocol with a request-head deadline. The parent waits on
    `_waiter` until a request is parsed and counts them in `_request_count` (aiohttp 3.14,
    pinned); a head is complete when either moves."""

    __slots__ = ("_head_timeout_s", "_head_timer", "_head_count", "refusal")

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_count = 0  # requests parsed when the running timer started
        self.refusal: Refusal | None = None  # set by _Server for a connection past a cap

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if not self._force_close:  # the first head's clock runs from the arrival
            self._head_timer = self._loop.call_later(self._head_timeout_s, self._head_expired)

    def _waiting_for_a_head(self) -> bool:
        return self._waiter is not None and not self._waiter.done()

    def idle_for(self, now: float) -> float:
        """Seconds since this connection's last answer while it waits for its next
        request; 0 while a request is arriving or in progress, or none was answered."""
        if (self._request_count == 0 or not self._waiting_for_a_head()
                or self._request_in_progress or self._head_timer is not None):
            return 0.0
        return now - (self._next_keepalive_close_time - self._keepalive_timeout)

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
    `_Handler`s and holding the connection caps."""

    limits: HttpLimits
    _addresses: dict[_Handler, str]  # admitted connections' clients
    _refused: set[_Handler]  # connections let in to be answered a refusal
    num_idle_closed: int  # idle connections closed to let a new one in

    tls: ReloadingSslContext | None = None

    def __call__(self) -> web_protocol.RequestHandler:
        if self.tls is not None:  # asyncio asks for the protocol before the handshake
            self.tls.refresh()
        return _Handler(self, loop=self._loop, head_timeout_s=self.limits.header_timeout_s,
                        **self._kwargs)

    def connection_made(self, handler: _Handler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        address = peer[0] if peer else ""
        refusal = self._admit(address)
        if refusal is not None:
            if len(self._refused) >= self.limits.max_connections:  # a flood past both caps
                transport.write(refusal.raw())
                handler.force_close()  # closes the transport once the bytes are written
                return
            handler.refusal = refusal
            self._refused.add(handler)
        else:
            self.limits.clients.open_connection(address)
            self._addresses[handler] = address
        super().connection_made(handler, transport)

    def _admit(self, address: str) -> Refusal | None:
        """Makes room for a connection from ``address`` under both caps, closing an idle
        one where needed (the caps run one over until its connection_lost); or says why
        it cannot be served."""
        clients = self.limits.clients
        if clients.at_connection_cap(address):
            own = self._longest_idle(h for h, a in self._addresses.items() if a == address)
            if own is None:
                return Refusal(429, clients.connection_refusal(), "rate_limit_exceeded")
        elif len(self._addresses) >= self.limits.max_connections:
            own = self._longest_idle(self._addresses)
            if own is None:
                return Refusal(503, f"this gateway holds its limit of "
                               f"{self.limits.max_connections} open connections, all busy; "
                               "retry shortly or on another gateway",
                               "service_unavailable_error")
        else:
            return None
        own.force_close()
        self.num_idle_closed += 1
        return None

    def _longest_idle(self, connections) -> _Handler | None:
        now = self._loop.time()
        idle_for, longest = max(((h.idle_for(now), h) for h in connections),
                                key=lambda pair: pair[0], default=(0.0, None))
        return longest if idle_for >= IDLE_BEFORE_REUSE_S else None

    def connection_lost(self, handler: _Handler, exc: BaseException | None = None) -> None:
        self._refused.discard(handler)
        address = self._addresses.pop(handler, None)
        if address is not None:
            self.limits.clients.close_connection(address)
        super().connection_lost(handler, exc)


async def read_body(request: web.Request, limits: HttpLimits) -> bytes:
    """The whole body within `body_timeout_s`, else RequestError 408 (over
    `max_body_bytes`, aiohttp's 413)."""
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
    app.middlewares.insert(0, _answer_refused)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None, keepalive_timeout=limits.keepalive_s,
                           lingering_time=limits.lingering_s)
    await runner.setup()
    assert type(runner.server) is web.Server  # what AppRunner makes; ours only adds
    runner.server.__class__ = _Server
    runner.server.limits = limits
    runner.server._addresses = {}
    runner.server._refused = set()
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
