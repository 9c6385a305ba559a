"""``continuum serve`` says "ready" only once the gateway's readiness probe passes: its
port answering is not enough, since for a moment after start the gateway has not yet seen
its scheduler healthy and /health answers 503. A gateway that never does is an error that
quotes /health, not a hang."""

from __future__ import annotations

import http.server
import json
import pathlib
import threading
from concurrent import futures

import grpc
import pytest

from continuum.serve import supervisor
from continuum.serve.supervisor import ServeError, Supervisor
from gateway.config import GatewayConfig


class _Health(http.server.BaseHTTPRequestHandler):
    status = (503, "no healthy scheduler replica")

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        code, word = type(self).status
        body = json.dumps({"status": word}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


class _Alive:
    def poll(self):
        return None


@pytest.fixture
def gateway():
    """A gRPC port that answers and an HTTP /health whose answer the test sets."""
    grpc_server = grpc.server(futures.ThreadPoolExecutor(1))
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=http_server.serve_forever, daemon=True).start()
    sup = Supervisor.__new__(Supervisor)  # only what _wait_gateway reads
    sup.gateway = GatewayConfig(model_dir=pathlib.Path("m"), scheduler_address="127.0.0.1:1",
                                port=port, http_port=http_server.server_address[1])
    sup.procs, sup._stop = {"gateway": _Alive()}, False
    try:
        yield sup
    finally:
        http_server.shutdown()
        grpc_server.stop(0)


def test_ready_waits_for_the_gateways_readiness_not_only_its_port(gateway, monkeypatch):
    _Health.status = (503, "no healthy scheduler replica")
    threading.Timer(0.3, lambda: setattr(_Health, "status", (200, "serving"))).start()
    monkeypatch.setattr(supervisor, "READY_TIMEOUT_S", 30.0)
    gateway._wait_gateway()  # returns once /health says 200
    assert _Health.status == (200, "serving")


def test_a_gateway_that_never_gets_ready_is_an_error_quoting_its_health(gateway, monkeypatch):
    _Health.status = (503, "no healthy scheduler replica")
    monkeypatch.setattr(supervisor, "READY_TIMEOUT_S", 0.5)
    with pytest.raises(ServeError, match="not ready after .*no healthy scheduler replica"):
        gateway._wait_gateway()
