"""The OpenAI-compatible HTTP API, served by the gateway process next to gRPC.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (JSON or SSE with
`"stream": true`), `GET /v1/models`, `GET /health` (readiness: 503 while
draining or with no healthy scheduler replica), `GET /live` (liveness) and
`GET /metrics` (Prometheus). Every error is OpenAI's
`{"error": {"message", "type", "param", "code"}}` with a matching status;
overload is 429 with `Retry-After`, draining 503.

A streamed response's headers are sent only once the first token (or the
upstream's refusal) is known, so admission failures are proper HTTP statuses;
a failure after that arrives as an SSE `error` event followed by `[DONE]`.
When the client disconnects, aiohttp cancels the handler and the relay's
upstream call is cancelled with it, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator

import grpc
import structlog
from aiohttp import web

from gateway.auth import UNAUTHENTICATED_MESSAGE, ApiKeys, Principal, resolve_tenant
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.openai_api import (
    HTTP_STATUS,
    ApiRequest,
    chat_logprobs,
    completion_logprobs,
    envelope,
    error_body,
    finish_reason,
    now_s,
    parse_chat,
    parse_completion,
    usage,
)
from gateway.relay import Relay, RelayError
from gateway.replicas import ReplicaSet
from gateway.tokenizer import Tokenizer
from gateway.upstream import RETRY_AFTER_KEY, ClientStatus
from gateway.validation import RequestError, ValidatedRequest, validate

_log = structlog.get_logger("gateway.http")
_OPEN_PATHS = frozenset({"/health", "/live"})
_PRINCIPAL = web.RequestKey("principal", Principal)
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


def _json_response(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json",
                        headers=headers)


def _error_response(status: ClientStatus, param: str | None = None,
                    code: str | None = None) -> web.Response:
    http_status, error_type = HTTP_STATUS.get(status.code, (500, "server_error"))
    headers = {}
    for key, value in status.trailing_metadata:
        if key == RETRY_AFTER_KEY and value.isdigit():
            headers["Retry-After"] = str(max(1, math.ceil(int(value) / 1000)))
    if http_status == 429:
        code = code or "rate_limit_exceeded"
        headers.setdefault("Retry-After", "1")
    return _json_response(http_status, error_body(status.message, error_type, param, code),
                          headers)


def _request_error(exc: RequestError) -> web.Response:
    code = exc.error_code
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        code = "invalid_api_key"
    return _error_response(ClientStatus(exc.code, exc.message), exc.param, code)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Choices:
    """Per-choice state while relaying: text so far, first chunk sent, logprobs."""

    def __init__(self, api: ApiRequest, tokenizer: Tokenizer):
        self.api = api
        self.tokenizer = tokenizer
        self.text: dict[int, list[str]] = {}
        self.offset: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.completion_tokens = 0
        self.prompt_tokens = 0

    def text_of(self, response) -> tuple[str, bool]:
        """The response's text (with echo on a choice's first), and whether it is the first."""
        first = response.index not in self.text
        text = (self.api.echo_text if first else "") + response.text
        self.text.setdefault(response.index, []).append(text)
        if response.finish_reason:
            self.finish[response.index] = finish_reason(response)
            self.completion_tokens += response.usage.completion_tokens
            self.prompt_tokens = response.usage.prompt_tokens
        return text, first

    def logprobs_of(self, response) -> dict | None:
        if not self.api.logprobs:
            return None
        if self.api.kind == "chat":
            return chat_logprobs(self.tokenizer, response)
        offset = self.offset.get(response.index, len(self.api.echo_text))
        result = completion_logprobs(self.tokenizer, response, offset)
        self.offset[response.index] = offset + len(response.text)
        return result


class HttpApi:
    def __init__(self, relay: Relay, tokenizer: Tokenizer, model_name: str, keys: ApiKeys,
                 metrics: GatewayMetrics, replicas: ReplicaSet, max_body_bytes: int,
                 max_model_len: int):
        self._relay = relay
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._keys = keys
        self._metrics = metrics
        self._replicas = replicas
        self._max_body_bytes = max_body_bytes
        self._max_model_len = max_model_len
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuses new requests with 503 (the listener stays open, so clients get an
        answer, not a refused connection) until in-flight ones finish or grace_s passes."""
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/live", self.live)
        app.router.add_get("/metrics", self.metrics)
        return app

    # --- middleware -------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        """aiohttp's own errors (404, 405, 413) as OpenAI error bodies."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if exc.status == 413:
                message = (f"the request body is larger than the server's limit of "
                           f"{self._max_body_bytes} bytes")
            elif exc.status == 404:
                message = f"no route {request.path}; see /v1/completions, /v1/chat/completions"
            elif exc.status == 405:
                message = f"{request.method} is not allowed on {request.path}"
            else:
                message = exc.reason
            return _json_response(exc.status, error_body(message, "invalid_request_error"))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:  # a bug of ours: the client still gets JSON, the log the traceback
            _log.exception("unexpected error", path=request.path)
            self._metrics.error("INTERNAL")
            return _json_response(500, error_body(
                "internal server error; the request id is in the server log", "server_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        principal = self._keys.check(request.headers.get("Authorization"))
        if principal is None:
            return _json_response(401, error_body(UNAUTHENTICATED_MESSAGE, "authentication_error",
                                                  None, "invalid_api_key"),
                                  {"WWW-Authenticate": "Bearer"})
        request[_PRINCIPAL] = principal
        return await handler(request)

    # --- simple routes ----------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return _json_response(503, {"status": "draining"})
        if not self._replicas.any_healthy:
            return _json_response(503, {"status": "no healthy scheduler replica"})
        return _json_response(200, {"status": "serving"})

    async def live(self, request: web.Request) -> web.Response:
        return _json_response(200, {"status": "alive"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        return _json_response(200, {"object": "list", "data": [{
            "id": self._model_name, "object": "model", "created": 0, "owned_by": "continuum",
            "max_model_len": self._max_model_len,
        }]})

    # --- generation -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.draining:
            return _error_response(ClientStatus(
                grpc.StatusCode.UNAVAILABLE,
                "this gateway is shutting down; retry (another replica will serve it)"))
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._generate_counted(request, kind)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _generate_counted(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            api, validated = await self._parse(request, kind)
        except RequestError as exc:
            _log.info("request rejected", code=exc.code.name, reason=exc.message)
            self._metrics.error(exc.code.name)
            return _request_error(exc)
        log = _log.bind(request_id=validated.request_id)
        generation = self._relay.generate(validated, api=kind, stream=api.stream)
        async with contextlib.aclosing(generation) as stream:
            try:
                first = await anext(stream)
            except RelayError as exc:
                return _error_response(exc.status)
            if api.stream:
                return await self._stream(request, api, validated, first, stream, log)
            return await self._collect(api, validated, first, stream)

    async def _parse(self, request: web.Request, kind: str) -> tuple[ApiRequest, ValidatedRequest]:
        try:
            body = await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON ({exc})") from exc
        if kind == "chat":
            api = parse_chat(body, self._model_name)
        else:
            api = parse_completion(body, self._model_name, self._tokenizer)
        api.proto.request_id = request.headers.get("X-Request-Id", "")
        api.proto.tenant = resolve_tenant(request[_PRINCIPAL], api.proto.tenant)
        validated = await asyncio.to_thread(validate, api.proto, self._tokenizer, self._model_name)
        return api, validated

    def _chunk(self, api: ApiRequest, validated: ValidatedRequest, created: int,
               choices: _Choices, response) -> dict | None:
        """The SSE chunk for one response, or None when it carries nothing to send."""
        text, first = choices.text_of(response)
        reason = finish_reason(response)
        logprobs = choices.logprobs_of(response)
        if not (text or reason or first or (logprobs and response.token_ids)):
            return None
        choice: dict = {"index": response.index}
        if api.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta if (text or first) else {}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = reason
        chunk = envelope(api.kind, validated.request_id, self._model_name, created, chunk=True)
        chunk["choices"] = [choice]
        if api.include_usage:
            chunk["usage"] = None
        return chunk

    async def _stream(self, request: web.Request, api: ApiRequest, validated: ValidatedRequest,
                      first, stream: AsyncIterator, log) -> web.StreamResponse:
        created = now_s()
        choices = _Choices(api, self._tokenizer)
        response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        response.headers["X-Request-Id"] = validated.request_id
        await response.prepare(request)
        try:
            pending = first
            while pending is not None:
                chunk = self._chunk(api, validated, created, choices, pending)
                if chunk is not None:
                    await response.write(_sse(chunk))
                pending = await anext(stream, None)
            if api.include_usage:
                final = envelope(api.kind, validated.request_id, self._model_name, created, True)
                final["choices"] = []
                final["usage"] = usage(choices.prompt_tokens, choices.completion_tokens)
                await response.write(_sse(final))
        except RelayError as exc:
            log.warning("stream failed after it started", code=exc.status.code.name)
            _, error_type = HTTP_STATUS.get(exc.status.code, (500, "server_error"))
            await response.write(_sse(error_body(exc.status.message, error_type)))
        except ConnectionError:  # the client went away; closing the relay cancels upstream
            log.info("client disconnected")
            return response
        await response.write(_sse("[DONE]"))
        await response.write_eof()
        return response

    async def _collect(self, api: ApiRequest, validated: ValidatedRequest, first,
                       stream: AsyncIterator) -> web.Response:
        choices = _Choices(api, self._tokenizer)
        logprobs: dict[int, list] = {}
        pending = first
        try:
            while pending is not None:
                choices.text_of(pending)
                lp = choices.logprobs_of(pending)
                if lp is not None:
                    logprobs.setdefault(pending.index, []).append(lp)
                pending = await anext(stream, None)
        except RelayError as exc:
            return _error_response(exc.status)
        body = envelope(api.kind, validated.request_id, self._model_name, now_s(), chunk=False)
        body["choices"] = [
            self._final_choice(api, index, "".join(choices.text[index]),
                               logprobs.get(index), choices.finish.get(index))
            for index in sorted(choices.text)
        ]
        body["usage"] = usage(choices.prompt_tokens, choices.completion_tokens)
        return _json_response(200, body, {"X-Request-Id": validated.request_id})

    @staticmethod
    def _final_choice(api: ApiRequest, index: int, text: str, parts: list | None,
                      reason: str | None) -> dict:
        if api.kind == "chat":
            merged = None
            if parts is not None:
                merged = {"content": [c for part in parts for c in part["content"]]}
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": merged, "finish_reason": reason}
        merged = None
        if parts is not None:
            merged = {key: [v for part in parts for v in part[key]]
                      for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return {"index": index, "text": text, "logprobs": merged, "finish_reason": reason}


async def start_http(api: HttpApi, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Starts serving; returns the runner and the bound port. Call `api.drain` before
    `runner.cleanup()`, which cuts whatever is still running after a second."""
    runner = web.AppRunner(api.app(), handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=False)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    sockets = runner.addresses
    return runner, sockets[0][1] if sockets else port
