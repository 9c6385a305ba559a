"""HTTP answers in OpenAI's error shape, with the status the gRPC code maps to
(openai_api.py `HTTP_STATUS`); overload is 429 with `Retry-After` from the retry hint."""

from __future__ import annotations

import json
import math

import grpc
from aiohttp import web

from gateway.api.openai_api import HTTP_STATUS, error_body
from gateway.routing.upstream import ERROR_CODE_KEY, ClientStatus
from gateway.validation import RequestError
from protos import pushback


def json_response(status: int, body: dict, headers: dict | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json",
                        headers=headers)


def error_response(status: ClientStatus, param: str | None = None,
                    code: str | None = None) -> web.Response:
    http_status, error_type = HTTP_STATUS.get(status.code, (500, "server_error"))
    headers = {}
    delay_ms = pushback.delay_ms(status.trailing_metadata)
    if delay_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(delay_ms / 1000)))
    for key, value in status.trailing_metadata:
        if key == ERROR_CODE_KEY and code is None:
            code = value[:64]  # our own scheduler's word, bounded all the same
    if http_status == 429:
        code = code or "rate_limit_exceeded"
        headers.setdefault("Retry-After", "1")
    return json_response(http_status, error_body(status.message, error_type, param, code),
                          headers)


def request_error(exc: RequestError) -> web.Response:
    code = exc.error_code
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        code = "invalid_api_key"
    if exc.http_status is not None:
        _, error_type = HTTP_STATUS.get(exc.code, (400, "invalid_request_error"))
        response = json_response(exc.http_status, error_body(exc.message, error_type,
                                                              exc.param, code))
        response.force_close()  # a 408's connection is not kept alive
        return response
    return error_response(ClientStatus(exc.code, exc.message), exc.param, code)
