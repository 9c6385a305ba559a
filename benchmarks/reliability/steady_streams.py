"""Normal traffic that must not notice the fuzzing: a few greedy streams, run once for a
reference and then over and over in a background thread while the fuzzer runs; every
run must equal the reference (gRPC: token for token; HTTP SSE: text for text).

Greedy decoding of a prompt must not depend on what else shares its batch (the chaos
and bad_specs rows hold their streams to the same standard), so a difference is a
request that leaked into another's output, a prefix cache gone wrong, a stream cut
short by someone else's bad input, or arithmetic that changed with the batch.
"""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp

from continuum.bench.clients import grpc_stream, http_stream
from harness.streams import completion_body, request

PROMPTS = ("Tell me about the sea.", "Count to ten.", "Name three colors.",
           "What is a cat?")


class SteadyStreams:
    """``reference()`` once, then ``start()``; ``stop()`` says how every run compared."""

    def __init__(self, serve, max_tokens: int = 32):
        self.serve = serve
        self.max_tokens = max_tokens
        self.expected: list[tuple] = []
        self.rounds = 0
        self.mismatches: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error = ""
        self.round_spans: list[tuple[float, float]] = []  # monotonic start, end

    async def _once(self) -> list[tuple]:
        addr, url = self.serve.addr, f"http://127.0.0.1:{self.serve.http_port}/v1/completions"
        grpc_reqs = [request(PROMPTS[0], self.max_tokens),
                     request(PROMPTS[1], self.max_tokens),
                     request(PROMPTS[2], self.max_tokens, chat=False)]
        async with aiohttp.ClientSession() as session:
            outs = await asyncio.gather(
                *[grpc_stream(addr, r, timeout=60) for r in grpc_reqs],
                http_stream(session, url, completion_body(
                    PROMPTS[3], self.max_tokens), timeout=60))
        return [(o.api, o.status, tuple(o.token_ids), o.text) for o in outs]

    def reference(self) -> list[tuple]:
        self.expected = asyncio.run(self._once())
        bad = [r for r in self.expected if r[1] != "ok"]
        if bad:
            raise RuntimeError(f"a reference stream did not finish: {bad}")
        return self.expected

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                got = asyncio.run(self._once())
                self.round_spans.append((started, time.monotonic()))
                self.rounds += 1
                for index, (want, have) in enumerate(zip(self.expected, got, strict=True)):
                    if want != have and len(self.mismatches) < 10:
                        self.mismatches.append({"round": self.rounds, "stream": index,
                                                "expected": want[1:], "got": have[1:]})
        except Exception as exc:  # reported in the row, never lost with the thread
            self._error = f"{type(exc).__name__}: {exc}"[:300]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="steady-streams", daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        """Waits for the round in flight, then the figures."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
        return {"stream_rounds": self.rounds, "streams_identical":
                not self.mismatches and not self._error and self.rounds > 0,
                "stream_mismatches": self.mismatches, "stream_error": self._error,
                "stream_round_s_max": round(max((b - a for a, b in self.round_spans),
                                                default=0.0), 2)}
