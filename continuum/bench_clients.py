"""``continuum bench``'s clients: send one request, record when each token came back.

Two clients with one interface (``run(spec, outcome, clock)``, ``close()``): gRPC
``Generate`` with token-id prompts, and the OpenAI API's streamed ``/v1/completions``
over SSE. Both request greedy decoding with ``ignore_eos``, so a request that is not
cancelled produces exactly ``max_tokens`` tokens. ``run_workload`` sends every request
at its arrival time, or as slots free up under ``--max-concurrency``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence

from continuum.bench_workload import Spec
from protos import tiers


@dataclasses.dataclass
class Outcome:
    """What happened to one request; times are seconds from the start of the run."""

    index: int
    tenant: str
    tier: int
    prompt_tokens: int
    max_tokens: int
    sent_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    chunk_times: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    status: str = "ok"  # ok | cancelled | error code (RESOURCE_EXHAUSTED, HTTP_429, ...)
    detail: str = ""

    @property
    def completed(self) -> bool:
        return self.status == "ok" and self.finish_s is not None


class GrpcClient:
    def __init__(self, addr: str, api_key: str | None):
        import grpc

        from protos.continuum.v1 import generation_pb2, generation_pb2_grpc

        self._grpc = grpc
        self._pb = generation_pb2
        self._channel = grpc.aio.insecure_channel(addr)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        request = self._pb.GenerateRequest(
            max_tokens=spec.max_tokens, tenant=spec.tenant, priority=tiers.to_priority(spec.tier),
            sampling={"temperature": 0.0, "ignore_eos": True})
        request.token_ids.ids.extend(spec.prompt_ids)
        call = self._stub.Generate(request, metadata=self._metadata, timeout=3600)
        try:
            async for response in call:
                if response.token_ids:
                    outcome.output_tokens += len(response.token_ids)
                    _on_chunk(outcome, clock())
                if spec.cancel_after is not None and outcome.output_tokens >= spec.cancel_after:
                    call.cancel()
                    outcome.status = "cancelled"
                    return
            outcome.finish_s = clock()
        except self._grpc.aio.AioRpcError as exc:
            outcome.status, outcome.detail = exc.code().name, exc.details() or ""

    async def close(self) -> None:
        await self._channel.close()


class OpenAIClient:
    """Streams /v1/completions with token-id prompts over SSE (aiohttp, one session)."""

    def __init__(self, base_url: str, api_key: str | None):
        import aiohttp

        self._aiohttp = aiohttp
        self._url = base_url.rstrip("/") + "/completions"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=3600),
            connector=aiohttp.TCPConnector(limit=0))

    # A request whose connection failed before any response came (a keep-alive connection
    # the server closed just as it was reused: llama-server's does, ~1 request in 6 under
    # load) is sent again on a fresh one, as the openai package does (2 retries); the
    # time it took stays in its TTFT.
    RETRIES = 2

    async def run(self, spec: Spec, outcome: Outcome, clock) -> None:
        body = {"prompt": spec.prompt_ids, "max_tokens": spec.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "tenant": spec.tenant, "priority": tiers.NAMES[spec.tier]}
        for attempt in range(self.RETRIES + 1):
            responded = await self._attempt(body, spec, outcome, clock)
            if responded or outcome.status != "CONNECTION" or attempt == self.RETRIES:
                return
            outcome.status, outcome.detail = "ok", ""

    async def _attempt(self, body: dict, spec: Spec, outcome: Outcome, clock) -> bool:
        """One POST; whether any response came (False: a connection error before it)."""
        responded = False
        try:
            async with self._session.post(self._url, json=body) as response:
                responded = True
                if response.status != 200:
                    outcome.status = f"HTTP_{response.status}"
                    outcome.detail = (await response.text())[:200]
                    return True
                chunks = 0
                async for line in response.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        outcome.status, outcome.detail = "STREAM_ERROR", event["error"]["message"]
                        return True
                    if event.get("usage"):
                        outcome.output_tokens = event["usage"]["completion_tokens"]
                    elif event["choices"] and event["choices"][0]["text"]:
                        chunks += 1  # one streamed message per token (held-back text merges)
                        outcome.output_tokens = chunks
                        _on_chunk(outcome, clock())
                        if spec.cancel_after is not None and chunks >= spec.cancel_after:
                            outcome.status = "cancelled"
                            return True  # leaving the block closes the connection
                outcome.finish_s = clock()
        except self._aiohttp.ClientError as exc:
            outcome.status, outcome.detail = "CONNECTION", str(exc)
        return responded

    async def close(self) -> None:
        await self._session.close()


def _on_chunk(outcome: Outcome, now: float) -> None:
    if outcome.first_token_s is None:
        outcome.first_token_s = now
    outcome.chunk_times.append(now)


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
