"""What the reliability rows and the tests send through the one client stream
(continuum/bench/clients.py): a GenerateRequest or a completion body whose length is known
in advance, and a polite client that waits out each refusal."""

from __future__ import annotations

import asyncio

from continuum.bench.clients import Outcome, grpc_stream
from protos.continuum.v1 import generation_pb2 as gen


def request(prompt: str, max_tokens: int, *, chat: bool = True, seed: int | None = None,
            temperature: float = 0.0, **fields) -> gen.GenerateRequest:
    """A GenerateRequest; ignore_eos so every stream's length is known in advance."""
    req = gen.GenerateRequest(max_tokens=max_tokens, **fields)
    if chat:
        req.chat.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    req.sampling.temperature = temperature
    req.sampling.ignore_eos = True
    if seed is not None:
        req.sampling.seed = seed
    return req


async def grpc_stream_accepted(addr: str, req: gen.GenerateRequest, *, attempts: int = 20,
                               **kwargs) -> Outcome:
    """grpc_stream, retried after each refusal as its retry hint says (a polite client):
    rows that need every stream to run (chaos) are not about admission."""
    for _ in range(attempts - 1):
        out = await grpc_stream(addr, req, **kwargs)
        if out.status != "refused":
            return out
        await asyncio.sleep(min(15.0, out.retry_after_s or 1.0))
        out.__init__()  # the same object: a watcher may hold it
    return await grpc_stream(addr, req, **kwargs)


def completion_body(prompt: str, max_tokens: int, *, stream: bool = True, **extra) -> dict:
    return {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}
