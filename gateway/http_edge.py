"""The HTTP server's connection-level defences: connections cannot be held hostage.

* Request head: a connection must send a complete request head within
  `header_timeout_s` of opening (or of its previous response ending), else it
  is closed. aiohttp's keep-alive timer already runs from connection_made and
  closes a connection whose next request has not been parsed when it fires, so
  `keepalive_timeout=header_timeout_s` gives exactly that (a slowloris head
  that trickles a byte a second is closed on time; data does not reset it).
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
    max_body_bytes: int = 4 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 2048
    lingering_s: float = 5.0


def _refusal(status: str, message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable_error",
                                 "param": None, "code": None}}).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
            ).encode() + body


def _cap_connections(server: web.Server, max_connections: int) -> None:
    """Makes aiohttp's connection manager refuse connections past `max_connections`.

    Wraps the instance's `connection_made` (which every new RequestHandler calls
    with its transport) rather than subclassing, so aiohttp's runner internals
    stay untouched."""
    admit = server.connection_made

    def connection_made(handler: web_protocol.RequestHandler,
                        transport: asyncio.Transport) -> None:
        if len(server.connections) >= max_connections:
            transport.write(_refusal(
                "503 Service Unavailable",
                f"this gateway holds its limit of {max_connections} open connections; "
                "retry shortly or on another gateway"))
            handler.force_close()  # closes the transport once the bytes are written
            return
        admit(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]


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
                           access_log=None, keepalive_timeout=limits.header_timeout_s,
                           lingering_time=limits.lingering_s)
    await runner.setup()
    assert runner.server is not None
    _cap_connections(runner.server, limits.max_connections)
    site = web.TCPSite(runner, host, port, reuse_port=False)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = runner.addresses
    return runner, sockets[0][1] if sockets else port
