"""Child processes that never outlive their parent, and the port and HTTP probes serve
runs on them."""

from __future__ import annotations

import ctypes
import http.client
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Linux: the kernel sends SIGTERM to the child when the supervisor dies,
    # even by SIGKILL, so no orphan keeps a port or the GPU.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def spawn(module: str, args: list[str], **kwargs) -> subprocess.Popen:
    """Starts ``python -m module args`` as a child bound to this process's life.

    Each child gets its own session, so a terminal's Ctrl-C reaches only the
    supervisor, which then stops the children in drain order."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *args], preexec_fn=_die_with_parent,
        start_new_session=True, **kwargs
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound and released: another process may take it
    before the caller does, which on loopback in tests and benchmarks is rare enough)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM everyone, wait up to ``grace_s``, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def http_ready(url: str) -> tuple[bool, str]:
    """(whether GET ``url`` answers 200, what it said otherwise: a 503's body, or why
    there was no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200, f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:  # 503: draining, or no healthy scheduler
        return False, exc.read(200).decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        return False, str(exc)
