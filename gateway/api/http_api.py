"""The OpenAI-compatible HTTP API, served by the gateway process next to gRPC (routes:
docs/usage.md, "OpenAI-compatible HTTP"). Errors are OpenAI's shapes (http_replies.py).

A streamed response's headers are sent only once the first token (or the refusal) is known,
so admission failures are proper statuses; a failure after that is an SSE `error` event and
`[DONE]`. A client that disconnects cancels the handler, and with it the upstream call."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from gateway.admit.admission import Admission
from gateway.admit.auth import UNAUTHENTICATED_MESSAGE, ApiKeys, Principal
from gateway.admit.parse_guard import parse_guard
from gateway.api import http_tokenize, openapi_doc
from gateway.api.http_replies import error_response, json_response, request_error
from gateway.api.json_body import decode_json
from gateway.api.openai_api import (
    COMPLETION,
    HTTP_STATUS,
    ApiRequest,
    ChatDialect,
    Choices,
    Dialect,
    error_body,
    finish_reason,
    now_s,
    usage,
)
from gateway.edge import http_edge
from gateway.edge.http_edge import HttpLimits, read_body
from gateway.edge.probes import Probes
from gateway.metrics import GatewayMetrics
from gateway.routing.relay import DRAINING, END_S, Relay, RelayError, end_after_grace
from gateway.routing.replicas import ReplicaSet
from gateway.routing.watchdog import bound_send_buffer
from gateway.text.tokenizer import Tokenizer
from gateway.validation import (
    MAX_REQUEST_ID_CHARS,
    RequestError,
    ValidatedRequest,
    check_identifier,
)
from protos.echo import clip
from runtime.metrics import CONTENT_TYPE

_log = structlog.get_logger("gateway.http")
_OPEN_PATHS = frozenset({"/health", "/live"})
_PRINCIPAL = web.RequestKey("principal", Principal)
_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class HttpApi:
    def __init__(self, relay: Relay, admission: Admission, tokenizer: Tokenizer,
                 model_name: str, keys: ApiKeys, metrics: GatewayMetrics, replicas: ReplicaSet,
                 limits: HttpLimits, tool_call_parser: str | None = None):
        self._relay = relay
        self._chat = ChatDialect(parser=tool_call_parser) if tool_call_parser else ChatDialect()
        self._admission = admission
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._keys = keys
        self._metrics = metrics
        self.limits = limits
        self._max_body_bytes = limits.max_body_bytes
        self._max_model_len = tokenizer.info.max_model_len
        self.draining = False
        self.probes = Probes(lambda: self.draining, lambda: replicas.any_healthy)
        self._openapi = json.dumps(openapi_doc.document(tokenizer.info.vocab_size)).encode()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Refuses new requests with 503 (the listener stays open) until in-flight ones
        finish or grace_s passes; streams still running then end with an SSE `error`."""
        self.draining = True
        await end_after_grace(self._relay, grace_s)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), END_S)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body_bytes,
                              middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        self.probes.add_routes(app)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
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
                           f"{self._max_body_bytes} bytes (the gateway's --max-body-bytes)")
            elif exc.status == 404:
                message = (f"no route {clip(request.path)}; /openapi.json lists this "
                           "server's routes")
            elif exc.status == 405:
                message = f"{clip(request.method)} is not allowed on {clip(request.path)}"
            else:
                message = exc.reason
            return json_response(exc.status, error_body(message, "invalid_request_error"))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:  # a bug of ours: the client still gets JSON, the log the traceback
            _log.exception("unexpected error", path=request.path)
            self._metrics.error("INTERNAL")
            return json_response(500, error_body(
                "internal server error; the request id is in the server log", "server_error"))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            return await handler(request)
        principal = self._keys.check(request.headers.get("Authorization"))
        if principal is None:
            return json_response(401, error_body(UNAUTHENTICATED_MESSAGE, "authentication_error",
                                                  None, "invalid_api_key"),
                                  {"WWW-Authenticate": "Bearer"})
        request[_PRINCIPAL] = principal
        return await handler(request)

    # --- simple routes ----------------------------------------------------------------

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        return json_response(200, {"object": "list", "data": [{
            "id": self._model_name, "object": "model", "created": 0, "owned_by": "continuum",
            "root": self._model_name, "parent": None, "max_model_len": self._max_model_len,
        }]})

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tool(request, http_tokenize.tokenize, "tokenize")

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tool(request, http_tokenize.detokenize, "detokenize")

    async def _tool(self, request: web.Request, answer, api: str) -> web.Response:
        """A body-in, JSON-out route, answered off the event loop inside the parse guard."""
        tokenizer = self._admission.tokenizer_for(request[_PRINCIPAL])  # generation's ids

        def run() -> dict:
            with parse_guard(api, self._metrics):
                return answer(decode_json(raw, charset), self._model_name, tokenizer)

        try:
            raw = await read_body(request, self.limits)
            charset = request.charset
            return json_response(200, await asyncio.to_thread(run))
        except RequestError as exc:
            self._metrics.error(exc.code.name)
            return request_error(exc)

    # --- generation -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETION)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, self._chat)

    async def _generate(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        if self.draining:
            return error_response(DRAINING)
        clients = self.limits.clients
        client = clients.client_of(request.remote or "", request.headers.get("X-Forwarded-For"))
        try:
            clients.acquire(client)
        except RequestError as exc:
            self._metrics.error(exc.code.name)
            return request_error(exc)
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._generate_counted(request, dialect)
        finally:
            clients.release(client)
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _generate_counted(self, request: web.Request,
                                dialect: Dialect) -> web.StreamResponse:
        try:
            validated, api = await self._admit(request, dialect)
        except RequestError as exc:
            return request_error(exc)
        log = _log.bind(request_id=validated.request_id)
        generation = self._relay.generate(validated, api=dialect.name, stream=api.stream)
        async with contextlib.aclosing(generation) as stream:
            try:
                first = await anext(stream)
            except RelayError as exc:
                return error_response(exc.status)
            if api.stream:
                return await self._stream(request, api, validated, first, stream, log)
            return await self._collect(api, validated, first, stream)

    async def _admit(self, request: web.Request,
                     dialect: Dialect) -> tuple[ValidatedRequest, ApiRequest]:
        """Reads the body (bounded in time and size), then runs the shared admit step."""
        try:
            raw = await read_body(request, self.limits)
            charset = request.charset  # LookupError-free: it is only a parsed header
        except RequestError as exc:  # a body too slow: refused before the admit step
            _log.info("request rejected", api=dialect.name, code=exc.code.name,
                      reason=exc.message)
            self._metrics.error(exc.code.name)
            raise
        request_id = request.headers.get("X-Request-Id", "")

        def build():
            check_identifier(request_id, "X-Request-Id header", MAX_REQUEST_ID_CHARS)
            api = dialect.parse(decode_json(raw, charset), self._model_name, self._tokenizer)
            api.proto.request_id = request_id
            return api.proto, api

        return await self._admission.admit(request[_PRINCIPAL], build, api=dialect.name,
                                           request_id=ascii(request_id)[1:-1],
                                           headers=request.headers.get)

    def _chunks(self, api: ApiRequest, validated: ValidatedRequest, created: int,
                choices: Choices, response) -> list[dict]:
        """One response's SSE chunks: none when it has nothing to send; the last has logprobs."""
        text, first = choices.text_of(response)
        reason = finish_reason(response)
        logprobs = choices.logprobs_of(response)
        if not (text or reason or first or (logprobs and response.token_ids)):
            return []
        chunks = []
        for choice in api.dialect.chunk_choices(response.index, text, first, reason):
            choice["logprobs"] = None
            chunk = api.dialect.envelope(validated.request_id, self._model_name, created, True)
            chunk["choices"] = [choice]
            if api.continuous_usage:
                chunk["usage"] = usage(len(validated.prompt_token_ids), choices.streamed_tokens)
            elif api.include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        chunks[-1]["choices"][0]["logprobs"] = logprobs
        return chunks

    async def _stream(self, request: web.Request, api: ApiRequest, validated: ValidatedRequest,
                      first, stream: AsyncIterator, log) -> web.StreamResponse:
        created = now_s()
        choices = Choices(api, self._tokenizer)
        response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        response.headers["X-Request-Id"] = validated.request_id
        await response.prepare(request)
        bound_send_buffer(request.transport)  # a client that stops reading holds little
        try:
            pending = first
            while pending is not None:
                for chunk in self._chunks(api, validated, created, choices, pending):
                    await response.write(_sse(chunk))
                pending = await anext(stream, None)
            if api.include_usage:
                final = api.dialect.envelope(validated.request_id, self._model_name, created, True)
                final["choices"] = []
                final["usage"] = usage(choices.prompt_tokens, choices.completion_tokens)
                await response.write(_sse(final))
            ending = _sse("[DONE]")
        except RelayError as exc:  # drain past its grace period included: a terminal answer
            log.warning("stream failed after it started", code=exc.status.code.name,
                        reason=exc.status.message)
            _, error_type = HTTP_STATUS.get(exc.status.code, (500, "server_error"))
            ending = _sse(error_body(exc.status.message, error_type)) + _sse("[DONE]")
        except ConnectionError:  # the client went away; closing the relay cancels upstream
            log.info("client disconnected")
            return response
        try:
            await response.write(ending)
            await response.write_eof()
        except ConnectionError:
            log.info("client disconnected before the end of its stream")
        return response

    async def _collect(self, api: ApiRequest, validated: ValidatedRequest, first,
                       stream: AsyncIterator) -> web.Response:
        choices = Choices(api, self._tokenizer)
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
            return error_response(exc.status)
        body = api.dialect.envelope(validated.request_id, self._model_name, now_s(), chunk=False)
        body["choices"] = [
            api.dialect.final_choice(index, "".join(choices.text[index]), logprobs.get(index),
                                     choices.finish.get(index))
            for index in sorted(choices.text)
        ]
        body["usage"] = usage(choices.prompt_tokens, choices.completion_tokens)
        return json_response(200, body, {"X-Request-Id": validated.request_id})


async def start_http(api: HttpApi, host: str, port: int, tls=None) -> tuple[web.AppRunner, int]:
    """Starts serving with the connection limits of `api.limits`; returns the runner and
    the bound port. Call `api.drain` before `runner.cleanup()`, which cuts whatever is
    still running after a second."""
    return await http_edge.start_http(api.app(), host, port, api.limits, tls)
