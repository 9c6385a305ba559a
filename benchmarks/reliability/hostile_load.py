"""The hostile row's load: what each kind of hostile request is, its benign twin, and the
process that sends them.

A *kind* is ``(name, path, body)``: ``path`` is an HTTP route under ``/v1/``, or
``"grpc"`` (a gRPC Generate of ``body``'s prompt and ``max_tokens``, run to its end), or
``"grpc-cancel"`` (the same, cancelled ``CANCEL_AFTER_S`` after it started).

The sender runs in a process of its own (``Sender``), not in the normal client's event
loop: encoding a 4 MiB body costs the client ~14 ms of CPU per request, and a loop that
stalls for it stamps the normal stream's tokens late. That was part of what the row
measured before (a client artefact, not the server). Each body is encoded to JSON once,
before the phase starts.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import multiprocessing
import random
import time

import aiohttp
import grpc

from continuum.bench.clients import grpc_stream, http_stream
from harness.streams import request
from protos.continuum.v1 import generation_pb2_grpc

HOSTILE_TIMEOUT_S = 20.0
CANCEL_AFTER_S = 0.01
CANCELLED = ("gRPC stream cancelled 10 ms after start", "grpc-cancel",
             {"prompt": "Hello", "max_tokens": 64})
# What makes a costly kind costly without adding tokens; its benign twin drops it.
_UNPAID = ("stop", "logprobs", "top_logprobs", "user", "stop_token_ids", "min_tokens")

Kind = tuple[str, str, dict]


def _caps() -> tuple[int, int]:
    """(most chat messages, most stop token ids) the gateway accepts."""
    from gateway import validation
    from protos import limits

    return (getattr(validation, "MAX_CHAT_MESSAGES", 1024),
            getattr(limits, "MAX_STOP_TOKEN_IDS", 49152))


def _chat(num_messages: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"}
                         for i in range(num_messages)]
            + [{"role": "user", "content": "Sum it up."}], "max_tokens": max_tokens}


def heavy_kinds(max_model_len: int, pool_tokens: int) -> list[Kind]:
    """Prompts as long as the context and the KV pool allow (a plain one and a chat of as
    many messages as fit): they pay for their cost in prompt tokens; what they do to
    other streams' ITL is the scheduler's per-step prefill budget's business."""
    room = max(64, min(max_model_len, pool_tokens) - 96)
    max_messages, _ = _caps()
    num_messages = max(2, min(max_messages, room // 10) // 2 * 2 - 1)  # ~9 tokens a turn
    return [(f"chat {num_messages + 1} messages", "chat/completions", _chat(num_messages, 4)),
            (f"prompt of ~{room} tokens", "completions", {"prompt": "the " * room,
                                                          "max_tokens": 1})]


def costly_kinds(max_model_len: int = 8192) -> list[Kind]:
    """Requests whose cost is not in their token count, each as large as the caps allow
    (gateway and sampler work that the request caps bound) for a server of `max_model_len`
    tokens of context (its default body limit follows it); all valid input."""
    from gateway.config import default_body_limit

    max_messages, max_stop_ids = _caps()
    body_limit = default_body_limit(max_model_len)
    few = max(2, min(max_messages, 32) // 2 * 2 - 1)
    num_ids = min(max_stop_ids, 49152)
    return [
        ("stop strings 16x256B", "completions",
         {"prompt": "Hi", "max_tokens": 8, "stop": [f"{i:03d}" + "z" * 253 for i in range(16)]}),
        (f"chat {few + 1} messages", "chat/completions", _chat(few, 4)),
        ("top_logprobs 20", "chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
          "logprobs": True, "top_logprobs": 20}),
        ("n=16 max_tokens=1", "completions", {"prompt": "Once upon a time", "n": 16,
                                              "max_tokens": 1, "temperature": 1.0}),
        (f"body near the {body_limit >> 20} MiB limit", "completions",
         {"prompt": "Hi", "max_tokens": 2, "user": "u" * (body_limit - 4096)}),
        (f"{num_ids} stop token ids, min_tokens 1", "completions",
         {"prompt": "Hi", "max_tokens": 2, "min_tokens": 1,
          "stop_token_ids": list(range(num_ids))}),
        CANCELLED,
    ]


def benign_twin(kind: Kind, count_tokens=None) -> Kind:
    """The same paid work (prompt tokens, ``max_tokens``, ``n``) without what the caps
    bound: no stop strings or ids, no logprobs, a small body, one message for a chat of
    many, a gRPC stream of one token run to its end for a cancelled one (what a stream
    cancelled 10 ms in gets: admission and at most its prefill).

    ``count_tokens(path, body)``: the server's prompt token count (``/tokenize``). The
    one message of a chat's twin is padded to the chat's count: a chat's template
    tokens (~5 a message) are prompt tokens it pays for, not what the cap bounds."""
    name, path, body = kind
    if path == "grpc-cancel":
        return f"benign twin of {name}", "grpc", {**body, "max_tokens": 1}
    twin = {k: v for k, v in body.items() if k not in _UNPAID}
    if "messages" in twin:
        text = " ".join(m["content"] for m in twin["messages"])
        twin["messages"] = [{"role": "user", "content": text}]
        if count_tokens is not None:
            twin["messages"][0]["content"] = _padded(text, count_tokens(path, body),
                                                     lambda t: count_tokens(path, {
                                                         "messages": [{"role": "user",
                                                                       "content": t}]}))
    return f"benign twin of {name}", path, twin


def _padded(text: str, target: int, count) -> str:
    """``text`` with filler words until ``count(text)`` reaches ``target`` (each " m"
    is one token in the BPE vocabularies we serve; a few rounds settle any rest)."""
    for _ in range(8):
        missing = target - count(text)
        if missing <= 0:
            break
        text += " m" * missing
    return text


async def _cancelled(addr: str, body: dict) -> str:
    async with grpc.aio.insecure_channel(addr) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(
            request(body["prompt"], body["max_tokens"]))
        await asyncio.sleep(CANCEL_AFTER_S)
        call.cancel()
    return "cancelled"


async def _send(addr: str, http_port: int, kinds: list[Kind], end: float, rate: float,
                seed: int) -> dict[str, int]:
    """Poisson arrivals at ``rate`` until ``end`` (time.monotonic, the same clock in every
    process), rotating through ``kinds``; every outcome counted by kind and status."""
    seen: collections.Counter = collections.Counter()
    encoded = [body if path.startswith("grpc") else json.dumps({"model": "", **body}).encode()
               for _, path, body in kinds]
    rng = random.Random(seed)
    base = f"http://127.0.0.1:{http_port}/v1/"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session, \
            grpc.aio.insecure_channel(addr) as channel:
        async def one(k: int) -> None:
            (name, path, body), data = kinds[k % len(kinds)], encoded[k % len(kinds)]
            if path == "grpc-cancel":
                seen[f"{name}: " + await _cancelled(addr, body)] += 1
                return
            if path == "grpc":
                out = await grpc_stream(addr, request(body["prompt"], body["max_tokens"]),
                                        channel=channel, timeout=HOSTILE_TIMEOUT_S)
            else:
                out = await http_stream(session, base + path, data, timeout=HOSTILE_TIMEOUT_S)
            seen[f"{name}: {out.status} {out.code}"] += 1

        tasks, k = [], 0
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(one(k)))
            k += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return dict(seen)


def _send_in_process(*args) -> dict[str, int]:
    return asyncio.run(_send(*args))


class Sender:
    """The hostile sender's process ("spawn": the parent runs grpc's threads, which a
    fork would copy mid-flight), started once and reused by every phase."""

    def __init__(self, addr: str, http_port: int):
        self._addr, self._http_port = addr, http_port
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        self._pool.submit(time.monotonic).result()  # started (imports paid) before any phase

    async def send(self, kinds: list[Kind], end: float, rate: float,
                   seed: int = 20) -> dict[str, int]:
        return await asyncio.wrap_future(self._pool.submit(
            _send_in_process, self._addr, self._http_port, kinds, end, rate, seed))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
