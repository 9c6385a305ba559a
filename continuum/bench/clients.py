"""The client side of every load: one stream (gRPC ``Generate`` or the OpenAI API over
HTTP+SSE) and one ``Outcome`` of it, for ``continuum bench``, the benchmarks and the
tests alike.

``grpc_stream`` and ``http_stream`` send one request and fill its Outcome as tokens
arrive. ``continuum bench``'s two clients (``run(spec, outcome, clock)``, ``close()``)
wrap them: gRPC with token-id prompts, and streamed ``/v1/completions``; both ask for
greedy decoding with ``ignore_eos``, so a request that is not cancelled produces exactly
``max_tokens`` tokens. ``run_workload`` sends every request at its arrival time, or as
slots free up under ``--max-concurrency``.

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

``code`` keeps what was said: the gRPC code's name, ``HTTP_429``, an SSE error's type,
or ``CONNECTION`` when no response came at all.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence

import aiohttp
import grpc

from continuum.bench.workload import Spec
from protos import tiers
from protos.continuum.v1 import generation_pb2 as gen
from protos.continuum.v1 import generation_pb2_grpc, sampling_pb2

SERVER_ERROR_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                                grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED})
RETRY_KEY = "retry-after-ms"
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)


@dataclasses.dataclass
class Outcome:
    """What happened to one request, as its client saw it. Times are seconds on the clock
    the stream was given: ``continuum bench``'s counts from the start of the run, the
    reliability rows' is ``time.monotonic``. The first five fields label a load
    generator's request; a single stream leaves them at their defaults."""

    index: int = 0
    tenant: str = ""
    tier: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    sent_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None  # when the stream ended, however it ended
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # each with tokens
    output_tokens: int = 0
    status: str = "ok"
    detail: str = ""
    api: str = "grpc"
    code: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    retry_hint: bool = False
    retry_after_s: float | None = None  # the hint's value, when there was one
    queue_s: float | None = None  # the server's queue time (gRPC ``timing``), if it said

    @property
    def completed(self) -> bool:
        return self.status == "ok" and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token (sim/metrics.py's TTFT: first token − send)."""
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def elapsed_s(self) -> float:
        return 0.0 if self.finish_s is None else self.finish_s - self.sent_s

    def on_chunk(self, now: float) -> None:
        if self.first_token_s is None:
            self.first_token_s = now
        self.chunk_times.append(now)


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


async def grpc_stream(addr: str | None, req: gen.GenerateRequest, *, timeout: float = 120.0,
                      cancel_after: int | None = None,
                      channel: grpc.aio.Channel | None = None, out: Outcome | None = None,
                      clock: Callable[[], float] = time.monotonic, metadata=None) -> Outcome:
    """Runs one Generate call; ``cancel_after`` tokens: call.cancel() there. ``out``:
    fill this Outcome as tokens arrive (a row watching progress passes its own)."""
    out = out or Outcome(api="grpc")
    out.sent_s = clock()
    own = channel is None
    # A channel of its own is a connection of its own (grpc shares one between channels
    # unless told not to, and the gateway caps the streams on one connection).
    ch = grpc.aio.insecure_channel(addr, options=LOCAL_POOL) if own else channel
    try:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout,
                                                               metadata=metadata)
        try:
            async for response in call:
                if response.token_ids:
                    out.on_chunk(clock())
                    out.output_tokens += len(response.token_ids)
                    out.token_ids.extend(response.token_ids)
                    out.text += response.text
                if response.finish_reason:
                    out.finish_reason = sampling_pb2.FinishReason.Name(response.finish_reason)
                if response.HasField("timing"):
                    out.queue_s = response.timing.queue_time_s
                if cancel_after is not None and out.output_tokens >= cancel_after:
                    call.cancel()
                    out.status = "cancelled"
                    break
        except grpc.aio.AioRpcError as exc:
            out.code = exc.code().name
            out.status = grpc_status(exc.code())
            out.detail = exc.details() or ""
            trailing = exc.trailing_metadata() or ()
            hints = [int(v) / 1000 for k, v in trailing if k == RETRY_KEY and str(v).isdigit()]
            out.retry_hint = bool(hints)
            out.retry_after_s = hints[0] if hints else None
        except asyncio.CancelledError:  # the caller gave up on it: not completed
            call.cancel()
            out.status = "cancelled"
            raise
        if out.status == "ok" and not out.finish_reason:
            out.status, out.detail = "server_error", "stream ended without a finish reason"
    finally:
        out.finish_s = clock()
        if own:
            await ch.close()
    return out


async def http_stream(session: aiohttp.ClientSession, url: str, body: dict | bytes, *,
                      timeout: float = 120.0, close_after: int | None = None,
                      headers: dict | None = None, out: Outcome | None = None,
                      clock: Callable[[], float] = time.monotonic) -> Outcome:
    """POSTs ``body``; streams SSE when the response is an event stream.
    ``close_after`` chunks with text: drop the connection there (a client disconnect)."""
    out = out or Outcome(api="http")
    out.sent_s = clock()
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with session.post(url, data=data, headers=hdrs,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            out.code = f"HTTP_{resp.status}"
            retry_after = resp.headers.get("Retry-After", "")
            out.retry_hint = retry_after.isdigit()
            out.retry_after_s = float(retry_after) if out.retry_hint else None
            if resp.status != 200:
                out.status = http_status(resp.status)
                out.detail = (await resp.text())[:300]
                return out
            if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                _apply_json(out, await resp.json(), clock)
                return out
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                _apply_chunk(out, json.loads(line[6:]), clock)
                if out.status != "ok":
                    return out
                if close_after is not None and len(out.chunk_times) >= close_after:
                    resp.close()
                    out.status = "cancelled"
                    return out
    except TimeoutError:
        out.status = "deadline"
    except asyncio.CancelledError:  # the caller gave up on it: not completed
        out.status = "cancelled"
        raise
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.code = out.code or "CONNECTION"  # CONNECTION: no response came at all
        out.status, out.detail = "server_error", f"connection broke: {exc!r}"
    finally:
        out.finish_s = clock()
    if out.status == "ok" and not out.finish_reason:
        out.status, out.detail = "server_error", "stream ended without a finish reason"
    return out


def _apply_chunk(out: Outcome, chunk: dict, clock: Callable[[], float]) -> None:
    if "error" in chunk:
        kind = chunk["error"].get("type", "")
        out.status = "server_error" if kind == "server_error" else {
            "rate_limit_error": "refused", "service_unavailable_error": "unavailable",
            "timeout_error": "deadline"}.get(kind, "client_error")
        out.code, out.detail = kind or "STREAM_ERROR", chunk["error"].get("message", "")
        return
    for choice in chunk.get("choices", []):
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        if text:
            out.on_chunk(clock())
            out.output_tokens += 1  # one streamed message per token (held-back text merges)
            out.text += text
        if choice.get("finish_reason"):
            out.finish_reason = choice["finish_reason"]
    if chunk.get("usage"):
        out.output_tokens = chunk["usage"]["completion_tokens"]


def _apply_json(out: Outcome, body: dict, clock: Callable[[], float]) -> None:
    out.first_token_s = clock()
    for choice in body.get("choices", []):
        out.text += choice.get("text") or (choice.get("message") or {}).get("content") or ""
        out.finish_reason = out.finish_reason or choice.get("finish_reason") or ""
    if not out.finish_reason:
        out.status, out.detail = "server_error", "response without a finish reason"


class GrpcClient:
    def __init__(self, addr: str, api_key: str | None):
        self._channel = grpc.aio.insecure_channel(addr)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        request = gen.GenerateRequest(
            max_tokens=spec.max_tokens, tenant=spec.tenant, priority=tiers.to_priority(spec.tier),
            sampling={"temperature": 0.0, "ignore_eos": True})
        request.token_ids.ids.extend(spec.prompt_ids)
        await grpc_stream(None, request, timeout=3600, cancel_after=spec.cancel_after,
                          channel=self._channel, out=outcome, clock=clock,
                          metadata=self._metadata)

    async def close(self) -> None:
        await self._channel.close()


class OpenAIClient:
    """Streams /v1/completions with token-id prompts over SSE (aiohttp, one session)."""

    def __init__(self, base_url: str, api_key: str | None):
        self._url = base_url.rstrip("/") + "/completions"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    # A request whose connection failed before any response came (a keep-alive connection
    # the server closed just as it was reused: llama-server's does, ~1 request in 6 under
    # load) is sent again on a fresh one, as the openai package does (2 retries); the
    # time it took stays in its TTFT.
    RETRIES = 2

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        body = {"prompt": spec.prompt_ids, "max_tokens": spec.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "tenant": spec.tenant, "priority": tiers.NAMES[spec.tier]}
        outcome.api, sent = "http", outcome.sent_s
        for attempt in range(self.RETRIES + 1):
            await http_stream(self._session, self._url, body, timeout=3600,
                              close_after=spec.cancel_after, headers=self._headers,
                              out=outcome, clock=clock)
            outcome.sent_s = sent
            if outcome.code != "CONNECTION" or attempt == self.RETRIES:
                return
            outcome.status, outcome.code, outcome.detail = "ok", "", ""

    async def close(self) -> None:
        await self._session.close()


async def run_workload(client, specs: Sequence[Spec], max_concurrency: int | None,
                       progress: bool = True) -> tuple[list[Outcome], float]:
    """Sends every spec at its arrival time (or as slots free up); returns outcomes, wall s."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(specs), unit="req", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    started = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - started

    async def one(spec: Spec) -> Outcome:
        delay = spec.arrival_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if limit is not None:
            await limit.acquire()
        outcome = Outcome(spec.index, spec.tenant, spec.tier, len(spec.prompt_ids),
                          spec.max_tokens, sent_s=clock())
        try:
            await client.run(spec, outcome, clock)
        finally:
            if limit is not None:
                limit.release()
            bar.update(1)
        return outcome

    try:
        outcomes = await asyncio.gather(*(one(s) for s in specs))
    finally:
        bar.close()
    return list(outcomes), clock()
