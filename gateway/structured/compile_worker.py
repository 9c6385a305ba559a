"""A child process that compiles structured-output specs while yielding the CPU to serving.

A compile is CPU work in llguidance (a regex repeat bomb costs ~30 ms before it is
refused); in a gateway thread it takes a core from the executor mid-step, and lowering a
thread's priority does not help (the kernel shares CPU between sessions first, and a
low-priority thread holding the GIL stalls the event loop; figures: docs/reliability.md,
"Bad specs after the compile workers"). So the child starts its own session and takes the
least CPU share (runtime/cpu_priority.py); a process can also be killed past its budget,
and a crash in the matcher costs a respawn, not the gateway.

Protocol on stdin / stdout: frames of a 4-byte little-endian length and a body. First
to the child JSON ``{"tokenizer", "vocab_size", "eos"}``, answered ``{"ready": true}``;
then each frame is a serialized ``Guided``, answered JSON ``{"verdict": str | null}``."""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import time

import llguidance

from protos import guided as guided_spec
from protos.continuum.v1 import sampling_pb2
from protos.echo import clip
from runtime import cpu_priority

FRAME = struct.Struct("<I")
# How often a waiting parent reads the child's CPU time (``Worker.ask``).
POLL_S = 0.05
START_TIMEOUT_S = 60.0  # a cold import of llguidance plus a 262k-token tokenizer
READY = b'{"ready": true}'


class WorkerGone(Exception):
    """The child exited or closed its pipe with a spec in hand (crashed or killed)."""


class StartFailed(Exception):
    """A child could not be started or did not say it was ready."""


class Worker:
    """The parent's handle on one child; used by one caller at a time."""

    def __init__(self, init: dict):
        self._init = json.dumps(init).encode()
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        self.kill()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.structured.compile_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, start_new_session=True, close_fds=True)
        _write(self._proc.stdin, self._init)
        reply = self._read(time.monotonic() + START_TIMEOUT_S, None)
        if not isinstance(reply, bytes) or reply != READY:  # EOF, or "late"
            self.kill()
            raise StartFailed("the structured-output compile worker did not start")

    def ask(self, guided: bytes, deadline: float, cpu_budget_s: float
            ) -> tuple[str, str | None]:
        """("verdict", message or None), or ("costly" | "late", None) past ``cpu_budget_s``
        of CPU or ``deadline`` (the child is killed). WorkerGone if a fresh child died
        with the spec too (one death may be from outside: an OOM kill while idle)."""
        for attempt in range(2):
            if not self.alive or attempt:
                self.start()
            try:
                _write(self._proc.stdin, guided)
            except OSError:  # died while idle
                continue
            reply = self._read(deadline, cpu_budget_s)
            if isinstance(reply, str):
                self.kill()
                return reply, None
            if reply is not None:
                return "verdict", json.loads(reply)["verdict"]
        self.kill()
        raise WorkerGone("the structured-output compile worker died compiling the spec")

    def kill(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                pipe.close()
            self._proc = None

    def _read(self, deadline: float, cpu_budget_s: float | None) -> bytes | str | None:
        """One frame; "costly" / "late" past the budget or deadline; None at EOF."""
        fd = self._proc.stdout.fileno()
        cpu_start = _cpu_seconds(self._proc.pid)
        buffer = b""
        while True:
            if len(buffer) >= FRAME.size and len(buffer) >= FRAME.size + _length(buffer):
                return buffer[FRAME.size:FRAME.size + _length(buffer)]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "late"
            readable, _, _ = select.select([fd], [], [], min(remaining, POLL_S))
            if readable:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return None
                buffer += chunk
            elif cpu_budget_s is not None and cpu_start is not None:
                used = _cpu_seconds(self._proc.pid)
                if used is not None and used - cpu_start > cpu_budget_s:
                    return "costly"


def _length(buffer: bytes) -> int:
    return FRAME.unpack_from(buffer)[0]


def _write(pipe, payload: bytes) -> None:
    pipe.write(FRAME.pack(len(payload)) + payload)
    pipe.flush()


def _cpu_seconds(pid: int) -> float | None:
    """The process's user + system CPU seconds from /proc (None where there is none)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _read_frame(stream) -> bytes | None:
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    payload = stream.read(FRAME.unpack(head)[0])
    return payload if len(payload) == FRAME.unpack(head)[0] else None


def verdict(tokenizer: llguidance.LLTokenizer, guided: sampling_pb2.Guided) -> str | None:
    """The refusal message for ``guided`` against ``tokenizer``, or None (runs in a
    worker: gateway/structured/compile_worker.py)."""
    try:
        grammar = guided_spec.grammar_of(guided)
        if grammar is not None:
            guided_spec.probe(tokenizer, grammar, f"guided.{guided.WhichOneof('kind')}")
        for pattern in guided_spec.schema_patterns(guided):  # each built only when reached
            guided_spec.probe(tokenizer, guided_spec.grammar_of(
                sampling_pb2.Guided(regex=pattern)), f"the schema's pattern {clip(pattern)}")
    except guided_spec.GuidedError as exc:
        return str(exc)
    return None


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    init = _read_frame(stdin)
    if init is None:
        return
    config = json.loads(init)
    # Built at the gateway's own priority: a one-off (~2 s for a 262k-token vocabulary)
    # that took past START_TIMEOUT_S at the least share of a busy host.
    tokenizer = guided_spec.load_tokenizer(config["tokenizer"], config["vocab_size"],
                                           tuple(config["eos"]))
    cpu_priority.lower(cpu_priority.LOWEST)
    _write(stdout, READY)
    while (frame := _read_frame(stdin)) is not None:  # EOF: the gateway is gone
        try:
            message = verdict(tokenizer, sampling_pb2.Guided.FromString(frame))
        except Exception as exc:  # what no check foresaw: still this spec's refusal
            message = f"the spec cannot be compiled ({type(exc).__name__})"
        _write(stdout, json.dumps({"verdict": message}).encode())


if __name__ == "__main__":
    try:
        main()
    except (BrokenPipeError, KeyboardInterrupt):  # the gateway went first: nothing to say
        sys.exit(0)
