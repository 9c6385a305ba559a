"""continuum/bench/clients.py's OpenAI client against a real socket that misbehaves as
llama-server's keep-alive handling does: a request whose connection fails before any
response is sent again (at most RETRIES times), never one that got an answer."""

from __future__ import annotations

import asyncio
import json

from continuum.bench.clients import OpenAIClient, Outcome
from continuum.bench.workload import Spec

_SSE = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (
    {"choices": [{"text": "a"}]}, {"choices": [{"text": "b", "finish_reason": "length"}]},
    {"choices": [], "usage": {"completion_tokens": 2}})) + b"data: [DONE]\n\n"


async def _serve(drops: int, status: int = 200):
    """A server that closes the first ``drops`` connections unanswered; every later
    request gets ``status`` (200: two streamed tokens). Returns (server, url, counts)."""
    seen = {"connections": 0, "answered": 0}

    async def handle(reader, writer):
        seen["connections"] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        if seen["connections"] <= drops:
            writer.close()  # what a closed keep-alive connection looks like to the client
            return
        seen["answered"] += 1
        body = _SSE if status == 200 else b"busy"
        writer.write(b"HTTP/1.1 %d X\r\nContent-Type: text/event-stream\r\nContent-Length: %d"
                     b"\r\nConnection: close\r\n\r\n" % (status, len(body)) + body)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1", seen


def _run(drops: int, status: int = 200) -> tuple[Outcome, dict]:
    async def go():
        server, url, seen = await _serve(drops, status)
        client = OpenAIClient(url, None)
        outcome = Outcome(0, "default", 1, 3, 2, 0.0)
        try:
            await client.run(Spec(0, 0.0, [1, 2, 3], 2), outcome, lambda: 1.0)
        finally:
            await client.close()
            server.close()
        return outcome, seen
    return asyncio.run(go())


def test_a_connection_dropped_before_any_response_is_retried():
    outcome, seen = _run(drops=2)
    assert outcome.completed and outcome.output_tokens == 2
    assert seen == {"connections": 3, "answered": 1}


def test_retries_are_bounded_and_an_answer_is_never_resent():
    outcome, seen = _run(drops=OpenAIClient.RETRIES + 1)
    assert outcome.code == "CONNECTION" and not outcome.completed
    assert seen["connections"] == OpenAIClient.RETRIES + 1
    outcome, seen = _run(drops=0, status=429)
    assert outcome.code == "HTTP_429" and outcome.status == "refused"
    assert seen == {"connections": 1, "answered": 1}
