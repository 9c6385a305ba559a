"""Liveness and readiness, on the API port and on a `--probe-port` listener of their own.

`/live`: 200 while the event loop runs, whatever the crowd (a kubelet that restarts an
overloaded gateway turns overload into an outage). `/health`: 503 while draining or with no
healthy replica. The probe listener's small cap closes idle connections first, so a client
holding its sockets is evicted by the next probe."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from gateway.api.http_replies import json_response
from gateway.edge import http_edge
from gateway.edge.client_limits import ClientLimits

PROBE_LIMITS = http_edge.HttpLimits(max_body_bytes=1024, header_timeout_s=5.0,
                                    body_timeout_s=5.0, max_connections=64, keepalive_s=5.0,
                                    lingering_s=1.0, clients=ClientLimits(max_connections=64))


class Probes:
    """The two answers; ``draining`` and ``any_healthy`` are read on each probe."""

    def __init__(self, draining: Callable[[], bool], any_healthy: Callable[[], bool]):
        self._draining = draining
        self._any_healthy = any_healthy

    async def live(self, request: web.Request) -> web.Response:
        return json_response(200, {"status": "alive"})

    async def health(self, request: web.Request) -> web.Response:
        if self._draining():
            return json_response(503, {"status": "draining"})
        if not self._any_healthy():
            return json_response(503, {"status": "no healthy scheduler replica"})
        return json_response(200, {"status": "serving"})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)


async def start_probes(probes: Probes, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serves /live and /health alone on (host, port); returns the runner and port."""
    app = web.Application(client_max_size=PROBE_LIMITS.max_body_bytes)
    probes.add_routes(app)
    return await http_edge.start_http(app, host, port, PROBE_LIMITS)
