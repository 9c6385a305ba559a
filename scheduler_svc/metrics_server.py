"""The replica's ``/metrics`` HTTP server, in a process of its own.

Why a process: a scrape answered by a thread of the scheduler process needs the GIL a
few times (accept, read the request, write the page), and each time waits for the busy
event loop to give it up (up to the 5 ms switch interval), so under full load the p99
passed 10 ms though the answer was prebuilt bytes. Here the loop only copies the
rendered page into a shared file (``PageFile.write``: a memcpy, every 50 ms); this
stdlib-only process answers every scrape from it and never waits on the scheduler.

The page file: a seqlock header ``<QQ`` (sequence, length) then the bytes. The writer
makes the sequence odd, writes, makes it even; a reader retries while it is odd or
changed under it, so it never serves a torn page.

    python -m scheduler_svc.metrics_server --page-file F --host H --port P --parent-pid N

prints ``listening <port>`` (or ``error <errno> <message>``) on stdout, then serves
until the parent is gone.
"""

from __future__ import annotations

import argparse
import http.server
import mmap
import os
import struct
import sys
import threading
import time

HEADER = struct.Struct("<QQ")
CAPACITY = 16 << 20  # page bytes (a sparse file: only what is written takes memory)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class PageFile:
    """A shared page: one writer (the scheduler's loop), readers in the server."""

    def __init__(self, path: str, create: bool = False) -> None:
        if create:
            with open(path, "wb") as f:
                f.truncate(HEADER.size + CAPACITY)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), HEADER.size + CAPACITY)
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


def serve(page_file: PageFile, host: str, port: int) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a scraper reuses its connection

        def do_GET(self) -> None:  # noqa: N802
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

    server = http.server.ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


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
