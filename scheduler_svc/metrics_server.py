"""The replica's ``/metrics`` HTTP server, in a process of its own.

Why a process: a scrape served by a thread of the scheduler needs the GIL a few times
and waits each time for the busy loop (up to the 5 ms switch interval): p99 passed 10 ms
under load for prebuilt bytes. Here the loop only copies the page into a shared file
(``PageFile.write``, every 50 ms), and this stdlib-only process serves it.

The page file: a seqlock header ``<QQ`` (sequence, length) then the bytes; the writer
makes the sequence odd, writes, makes it even; a reader retries while it is odd or
changed, so it never serves a torn page.

    python -m scheduler_svc.metrics_server --page-file F --host H --port P --parent-pid N

prints ``listening <port>`` (or ``error <errno> <message>``), then serves until the parent
is gone. Bounded (the port is reachable in a pod): ``MAX_CONNECTIONS`` at once (one more
gets 503 without a thread), ``REQUEST_TIMEOUT_S`` for a request head (idle keep-alive
included), ``WRITE_TIMEOUT_S`` to take the page.
"""

from __future__ import annotations

import argparse
import http.server
import io
import mmap
import os
import socket
import struct
import sys
import threading
import time

from runtime.metrics import CONTENT_TYPE

HEADER = struct.Struct("<QQ")
CAPACITY = 16 << 20  # page bytes (a sparse file: only what is written takes memory)
# The readers are a few scrapers and routers, each with a connection or two: 32 is room
# for them all (and for bench tools) while a flood costs at most 32 threads.
MAX_CONNECTIONS = 32
# A scrape's request is one short head: 5 s is plenty on any network (nginx's
# client_header_timeout is 60 s for arbitrary clients), and Prometheus reconnects at
# its next scrape when an idle keep-alive connection was closed.
REQUEST_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0  # to take a page of at most a few MB
BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
              b"Retry-After: 1\r\nConnection: close\r\n\r\n")


class PageFile:
    """A shared page: one writer (the scheduler's loop), readers in the server."""

    def __init__(self, path: str | int, create: bool = False) -> None:
        """``path``: the file, or an open descriptor of it (the caller closes that)."""
        fd = path if isinstance(path, int) else os.open(
            path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, HEADER.size + CAPACITY)
            self._map = mmap.mmap(fd, HEADER.size + CAPACITY)
        finally:
            if fd is not path:
                os.close(fd)
        self._seq = HEADER.unpack_from(self._map, 0)[0] if not create else 0

    def write(self, page: bytes) -> None:
        page = page[:CAPACITY]
        self._seq += 1  # odd: a write is under way
        HEADER.pack_into(self._map, 0, self._seq, len(page))
        self._map[HEADER.size:HEADER.size + len(page)] = page
        self._seq += 1
        HEADER.pack_into(self._map, 0, self._seq, len(page))

    def read(self) -> bytes:
        while True:
            seq, length = HEADER.unpack_from(self._map, 0)
            if seq % 2 == 0:
                page = self._map[HEADER.size:HEADER.size + length]
                if HEADER.unpack_from(self._map, 0)[0] == seq:
                    return page
            time.sleep(0)

    def close(self) -> None:
        self._map.close()


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each bounded by what is left of ``deadline`` (monotonic; None:
    unbounded), so a trickle of bytes cannot outlive it the way a per-read timeout
    lets it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.deadline: float | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("request deadline passed")
            self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class BoundedHTTPServer(http.server.ThreadingHTTPServer):
    """A ThreadingHTTPServer that serves at most ``max_connections`` at once."""

    daemon_threads = True
    request_queue_size = 64  # a burst of connects waits in the kernel, not refused

    def __init__(self, address, handler, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """503 and close, on the accepting thread and never blocking it: what the
        client already sent is read first, so the close does not reset the 503."""
        try:
            request.setblocking(False)
            try:
                request.recv(65536)
            except BlockingIOError:
                pass
            request.send(BUSY_REPLY)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.shutdown_request(request)


def serve(page_file: PageFile, host: str, port: int,
          max_connections: int = MAX_CONNECTIONS,
          request_timeout_s: float = REQUEST_TIMEOUT_S) -> BoundedHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a scraper reuses its connection

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the stdlib's reader, replaced by one with a deadline
            self._reader = _DeadlineReader(self.connection)
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self) -> None:
            # The stdlib closes the connection when a read times out.
            self._reader.deadline = time.monotonic() + request_timeout_s
            super().handle_one_request()

        def do_GET(self) -> None:  # noqa: N802
            self.connection.settimeout(WRITE_TIMEOUT_S)
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            body = page_file.read()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every 50 ms: not logged
            pass

    return BoundedHTTPServer((host, port), Handler, max_connections)


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m scheduler_svc.metrics_server")
    p.add_argument("--page-file", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    a = p.parse_args(argv)
    try:
        server = serve(PageFile(a.page_file), a.host, a.port)
    except OSError as exc:
        print(f"error {exc.errno or 0} {exc.strerror or exc}", flush=True)
        sys.exit(2)
    print(f"listening {server.server_address[1]}", flush=True)
    threading.Thread(target=_exit_with_parent, args=(a.parent_pid,), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
