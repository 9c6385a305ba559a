"""The replica's /metrics server cannot be held: connections past its cap get a 503 at
once, and a connection that sends nothing, or trickles its request, is closed once its
request timeout is spent (scheduler_svc/metrics_server.py). The server runs in this
process with a small cap and timeout, so the scenario takes a few seconds."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import pytest

from scheduler_svc import metrics_server

CAP = 4
TIMEOUT_S = 1.0
PAGE = b"# a page\nvllm:num_requests_waiting 0\n"


@pytest.fixture
def server(tmp_path):
    page = metrics_server.PageFile(str(tmp_path / "page"), create=True)
    page.write(PAGE)
    httpd = metrics_server.serve(page, "127.0.0.1", 0, max_connections=CAP,
                                 request_timeout_s=TIMEOUT_S)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()
    page.close()


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S + 3)
    return sock


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reads to EOF; a reset counts)."""
    start = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def _scrape(port: int) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class SlowLoris(threading.Thread):
    """Sends a request head a byte every 0.2 s, never finishing it, until closed."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = _connect(port)
        self.sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        self.closed_after: float | None = None

    def run(self) -> None:
        start = time.monotonic()
        try:
            for _ in range(100):
                self.sock.sendall(b"X")
                self.sock.settimeout(0.2)
                try:
                    if self.sock.recv(4096) == b"":
                        break
                except TimeoutError:
                    continue
        except OSError:  # reset or broken pipe: closed by the server
            pass
        self.closed_after = time.monotonic() - start


def test_silent_and_trickling_connections_are_closed_within_the_timeout(server):
    idle = [_connect(server) for _ in range(CAP - 1)]
    loris = SlowLoris(server)
    loris.start()
    for sock in idle:
        assert _closed_after(sock) < TIMEOUT_S + 1.0
        sock.close()
    loris.join(TIMEOUT_S + 3)
    # It kept sending, a byte at a time, and was still closed on time.
    assert loris.closed_after is not None and loris.closed_after < TIMEOUT_S + 1.0
    loris.sock.close()
    assert _scrape(server) == (200, PAGE)


def test_past_the_cap_a_connection_gets_503_at_once_and_scrapes_resume(server):
    holders = [_connect(server) for _ in range(CAP - 1)]
    loris = SlowLoris(server)
    loris.start()
    time.sleep(0.2)  # all CAP accepted and holding a thread each
    extra = [_connect(server) for _ in range(3 * CAP)]
    start = time.monotonic()
    for sock in extra:  # refused without a thread: answered before any timeout
        reply = sock.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert _closed_after(sock) < 0.5
        sock.close()
    assert time.monotonic() - start < 0.5 * TIMEOUT_S
    status, _ = _scrape(server)
    assert status == 503  # full: told so at once, not left waiting
    # Once the holders' timeout is spent, their slots are free again.
    deadline = time.monotonic() + TIMEOUT_S + 2.0
    while time.monotonic() < deadline:
        if _scrape(server) == (200, PAGE):
            break
        time.sleep(0.1)
    else:
        pytest.fail("no 200 within 2 s of the idle connections' timeout")
    for sock in holders:
        sock.close()
    loris.join(TIMEOUT_S + 3)
    loris.sock.close()


def test_a_kept_alive_scraper_is_served_request_after_request(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=3)
    for _ in range(3 * CAP):  # one connection, one slot, however many requests
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, PAGE)
        time.sleep(TIMEOUT_S / 10)
    conn.request("GET", "/other")
    assert conn.getresponse().status == 404
    conn.close()
