"""The client side of every row: one stream (gRPC or OpenAI HTTP+SSE), one ``Outcome``.

A stream ends in exactly one ``status``:

* ``ok``: a finish reason arrived (the terminal answer);
* ``refused``: 429 / RESOURCE_EXHAUSTED (``retry_hint`` says whether it carried one);
* ``client_error``: a 4xx / INVALID_ARGUMENT-like status (bad input, correctly refused);
* ``unavailable``: 503 / UNAVAILABLE (no replica could serve: an answer, not an error);
* ``cancelled``: the client cancelled or disconnected on purpose;
* ``deadline``: the client's own deadline passed (a server that answers nothing by
  then has *lost* the stream when the row did not ask for a short deadline);
* ``server_error``: 5xx other than 503/504, INTERNAL, UNKNOWN, an SSE error event of
  type ``server_error``, or a broken connection: what the targets say must never happen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aiohttp
import grpc

from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc, sampling_pb2

SERVER_ERROR_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED})
RETRY_KEY = "retry-after-ms"
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)


@dataclasses.dataclass
class Outcome:
    api: str
    status: str = "ok"
    code: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    ttft_s: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # monotonic
    elapsed_s: float = 0.0
    retry_hint: bool = False
    retry_after_s: float | None = None  # the hint's value, when there was one
    detail: str = ""


def grpc_status(code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "refused"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code == grpc.StatusCode.CANCELLED:
        return "cancelled"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "deadline"
    return "server_error" if code in SERVER_ERROR_CODES else "client_error"


def http_status(status: int) -> str:
    if status == 429:
        return "refused"
    if status == 503:
        return "unavailable"
    if status == 504:
        return "deadline"
    return "server_error" if status >= 500 else "client_error"


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


async def grpc_stream(addr: str, req: gen.GenerateRequest, *, timeout: float = 120.0,
                      cancel_after: int | None = None,
                      channel: grpc.aio.Channel | None = None,
                      out: Outcome | None = None) -> Outcome:
    """Runs one Generate call; ``cancel_after`` tokens: call.cancel() there. ``out``:
    fill this Outcome as tokens arrive (a row watching progress passes its own)."""
    out = out or Outcome("grpc")
    started = time.monotonic()
    own = channel is None
    # A channel of its own is a connection of its own (grpc shares one between channels
    # unless told not to, and the gateway caps the streams on one connection).
    ch = grpc.aio.insecure_channel(addr, options=LOCAL_POOL) if own else channel
    try:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout)
        try:
            async for response in call:
                if response.token_ids:
                    now = time.monotonic()
                    out.ttft_s = out.ttft_s if out.ttft_s is not None else now - started
                    out.token_times.append(now)
                    out.token_ids.extend(response.token_ids)
                    out.text += response.text
                if response.finish_reason:
                    out.finish_reason = sampling_pb2.FinishReason.Name(response.finish_reason)
                if cancel_after is not None and len(out.token_ids) >= cancel_after:
                    call.cancel()
                    out.status = "cancelled"
                    break
        except grpc.aio.AioRpcError as exc:
            out.code = exc.code().name
            out.status = grpc_status(exc.code())
            out.detail = exc.details() or ""
            metadata = exc.trailing_metadata() or ()
            hints = [int(v) / 1000 for k, v in metadata if k == RETRY_KEY and str(v).isdigit()]
            out.retry_hint = bool(hints)
            out.retry_after_s = hints[0] if hints else None
        except asyncio.CancelledError:
            call.cancel()
            raise
        if out.status == "ok" and not out.finish_reason:
            out.status, out.detail = "server_error", "stream ended without a finish reason"
    finally:
        out.elapsed_s = time.monotonic() - started
        if own:
            await ch.close()
    return out


async def grpc_stream_accepted(addr: str, req: gen.GenerateRequest, *, attempts: int = 20,
                               **kwargs) -> Outcome:
    """grpc_stream, retried after each refusal as its retry hint says (a polite client):
    rows that need every stream to run (chaos) are not about admission."""
    for _ in range(attempts - 1):
        out = await grpc_stream(addr, req, **kwargs)
        if out.status != "refused":
            return out
        await asyncio.sleep(min(15.0, out.retry_after_s or 1.0))
        out.__init__("grpc")  # the same object: a watcher may hold it
    return await grpc_stream(addr, req, **kwargs)


def completion_body(prompt: str, max_tokens: int, *, stream: bool = True, **extra) -> dict:
    return {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream, **extra}


async def http_stream(session: aiohttp.ClientSession, url: str, body: dict | bytes, *,
                      timeout: float = 120.0, close_after: int | None = None,
                      headers: dict | None = None) -> Outcome:
    """POSTs ``body``; streams SSE when the response is an event stream.
    ``close_after`` chunks with text: drop the connection there (a client disconnect)."""
    out = Outcome("http")
    started = time.monotonic()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(url, data=data, headers=hdrs,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            out.code = str(resp.status)
            retry_after = resp.headers.get("Retry-After", "")
            out.retry_hint = retry_after.isdigit()
            out.retry_after_s = float(retry_after) if out.retry_hint else None
            if resp.status != 200:
                out.status = http_status(resp.status)
                out.detail = (await resp.text())[:300]
                return out
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                _apply_json(out, await resp.json(), started)
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _apply_chunk(out, json.loads(line[6:]), started)
                if out.status != "ok":
                    return out
                if close_after is not None and len(out.token_times) >= close_after:
                    resp.close()
                    out.status = "cancelled"
                    return out
    except TimeoutError:
        out.status = "deadline"
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.status, out.detail = "server_error", f"connection broke: {exc!r}"
    finally:
        out.elapsed_s = time.monotonic() - started
    if out.status == "ok" and not out.finish_reason:
        out.status, out.detail = "server_error", "stream ended without a finish reason"
    return out


def _apply_chunk(out: Outcome, chunk: dict, started: float) -> None:
    if "error" in chunk:
        kind = chunk["error"].get("type", "")
        out.status = "server_error" if kind == "server_error" else {
            "rate_limit_error": "refused", "service_unavailable_error": "unavailable",
            "timeout_error": "deadline"}.get(kind, "client_error")
        out.detail = chunk["error"].get("message", "")
        return
    for choice in chunk.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text:
            now = time.monotonic()
            out.ttft_s = out.ttft_s if out.ttft_s is not None else now - started
            out.token_times.append(now)
            out.text += text
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]


def _apply_json(out: Outcome, body: dict, started: float) -> None:
    out.ttft_s = time.monotonic() - started
    for choice in body.get("choices", []):
        out.text += choice.get("text") or (choice.get("message") or {}).get("content") or ""
        out.finish_reason = out.finish_reason or choice.get("finish_reason") or ""
    if not out.finish_reason:
        out.status, out.detail = "server_error", "response without a finish reason"
