"""OpenAI request bodies to `GenerateRequest`s, and responses back to OpenAI JSON.

Pure functions, no I/O. Requests are translated into the same protobuf the gRPC
API takes and then go through the same `validation.validate`, so both APIs
accept and refuse exactly the same things. Type errors and OpenAI-only rules
(e.g. temperature ≤ 2, `stream_options` only with `stream`) are checked here.

Extensions beyond OpenAI's fields, as in other open servers: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`, and
Continuum's `priority` ("premium" | "standard" | "best_effort") and `tenant`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.relay import finish_name
from gateway.tokenizer import Tokenizer
from gateway.validation import RequestError
from protos.continuum.v1 import generation_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20
PRIORITIES = {
    "premium": generation_pb2.PRIORITY_PREMIUM,
    "standard": generation_pb2.PRIORITY_STANDARD,
    "best_effort": generation_pb2.PRIORITY_BEST_EFFORT,
}
_UNSUPPORTED = ("logit_bias", "suffix", "tools", "functions", "tool_choice", "function_call",
                "audio", "modalities", "prediction")


@dataclass
class ApiRequest:
    """A parsed OpenAI request: the protobuf to validate plus how to answer."""

    kind: str  # "completion" | "chat"
    proto: generation_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False  # return logprobs at all
    echo_text: str = ""  # /v1/completions echo: prompt text prepended to each choice


def _bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(message, param=param)


def _number(body: dict, name: str, low: float, high: float, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{name} must be a number, got {type(value).__name__}", name)
    if not (math.isfinite(value) and low <= value <= high):
        raise _bad(f"{name} must be between {low:g} and {high:g}, got {value:g}", name)
    return value


def _integer(body: dict, name: str, low: int, high: int | None = None, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise _bad(f"{name} must be {bound}, got {value}", name)
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {type(value).__name__}", name)
    return value


def _string(body: dict, name: str, default: str = "") -> str:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(f"{name} must be a string, got {type(value).__name__}", name)
    return value


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise _bad("stop must be a string or a list of strings", "stop")


def _token_id_list(value: Any, name: str) -> list[int] | None:
    if isinstance(value, list) and value and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        if any(t < 0 for t in value):
            raise _bad(f"{name} holds a negative token id", name)
        return value
    return None


def _common(body: dict, proto: generation_pb2.GenerateRequest, served_model: str) -> None:
    """Fields shared by completions and chat: model, sampling, stop, n, extensions."""
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, {}, []):
            raise _bad(f"{name} is not supported by this server; remove it", name)
    proto.model = _string(body, "model") or served_model
    sampling = proto.sampling
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature is not None:
        sampling.temperature = temperature
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p is not None:
        if top_p == 0:
            raise _bad("top_p must be > 0 (use temperature 0 for greedy decoding)", "top_p")
        sampling.top_p = top_p
    sampling.presence_penalty = _number(body, "presence_penalty", -2.0, 2.0, 0.0)
    sampling.frequency_penalty = _number(body, "frequency_penalty", -2.0, 2.0, 0.0)
    seed = _integer(body, "seed", 0, 2**64 - 1)
    if seed is not None:
        sampling.seed = seed
    top_k = _integer(body, "top_k", -1, 2**31 - 1, 0)
    sampling.top_k = max(top_k, 0)  # -1 (as in vLLM) and 0 both mean "no top-k"
    sampling.min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    repetition_penalty = _number(body, "repetition_penalty", 0.0, 1e6)
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    sampling.min_tokens = _integer(body, "min_tokens", 0, 2**31 - 1, 0)
    sampling.ignore_eos = _boolean(body, "ignore_eos")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_id_list(stop_ids, "stop_token_ids") if stop_ids else []
        if ids is None:
            raise _bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        sampling.stop_token_ids.extend(ids)
    proto.stop.extend(_stop(body))
    proto.n = _integer(body, "n", 1, None, 1)
    best_of = _integer(body, "best_of", 1, None)
    if best_of is not None and best_of != proto.n:
        raise _bad("best_of other than n is not supported; remove it", "best_of")
    proto.tenant = _string(body, "tenant")
    priority = body.get("priority")
    if priority is not None:
        if isinstance(priority, str) and priority in PRIORITIES:
            proto.priority = PRIORITIES[priority]
        elif isinstance(priority, int) and not isinstance(priority, bool) and 0 <= priority <= 2:
            proto.priority = list(PRIORITIES.values())[priority]
        else:
            raise _bad(f"priority must be one of {', '.join(PRIORITIES)} (or 0, 1, 2)",
                       "priority")


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return _boolean(options, "include_usage")


def parse_completion(body: Any, served_model: str, tokenizer: Tokenizer) -> ApiRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    proto = generation_pb2.GenerateRequest()
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    echo_text = ""
    if isinstance(prompt, str):
        proto.prompt = prompt
        echo_text = prompt
    elif (ids := _token_id_list(prompt, "prompt")) is not None:
        proto.token_ids.ids.extend(ids)
        echo_text = tokenizer.decode(ids) if _boolean(body, "echo") else ""
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("send one prompt per request (or use n for several completions)", "prompt")
    else:
        raise _bad("prompt is required: a string or a list of token ids", "prompt")
    _common(body, proto, served_model)
    proto.max_tokens = _integer(body, "max_tokens", 1, 2**31 - 1, COMPLETION_DEFAULT_MAX_TOKENS)
    logprobs = _integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    if logprobs is not None:
        proto.sampling.logprobs = logprobs
    stream = _boolean(body, "stream")
    echo = _boolean(body, "echo")
    if echo and logprobs is not None:
        raise _bad("echo together with logprobs is not supported", "echo")
    return ApiRequest(
        kind="completion",
        proto=proto,
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=logprobs is not None,
        echo_text=echo_text if echo else "",
    )


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{index}].content: only text parts are supported",
                           "messages")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise _bad(f"messages[{index}].content must be a string or a list of text parts",
               "messages")


def parse_chat(body: Any, served_model: str) -> ApiRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages is required: a non-empty list of {role, content}", "messages")
    proto = generation_pb2.GenerateRequest()
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{index}] must be an object with role and content", "messages")
        role = message.get("role")
        role = "system" if role == "developer" else role
        if not isinstance(role, str):
            raise _bad(f"messages[{index}].role is required", "messages")
        proto.chat.messages.add(role=role, content=_message_text(message.get("content"), index))
    _common(body, proto, served_model)
    max_tokens = _integer(body, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 2**31 - 1, 0)
    proto.max_tokens = max_tokens
    logprobs = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise _bad("top_logprobs requires logprobs to be true", "top_logprobs")
    if logprobs:
        proto.sampling.logprobs = top or 0
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise _bad("response_format other than text is not supported", "response_format")
    stream = _boolean(body, "stream")
    return ApiRequest(
        kind="chat",
        proto=proto,
        stream=stream,
        include_usage=_stream_options(body, stream),
        logprobs=logprobs,
    )


# --- responses --------------------------------------------------------------------------


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, response: generation_pb2.GenerateResponse,
                        offset: int) -> dict:
    """The legacy completions logprobs object for one response's tokens."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for item in response.logprobs:
        text = _token_text(tokenizer, item.token_id)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        tops.append({_token_text(tokenizer, t): lp
                     for t, lp in zip(item.top_token_ids, item.top_logprobs, strict=False)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, response: generation_pb2.GenerateResponse) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for item in response.logprobs:
        top = [entry(t, lp) for t, lp in zip(item.top_token_ids, item.top_logprobs, strict=False)]
        content.append({**entry(item.token_id, item.logprob), "top_logprobs": top})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, request_id: str, model: str, created: int, chunk: bool) -> dict:
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    if kind == "chat":
        obj = "chat.completion.chunk" if chunk else "chat.completion"
    else:
        obj = "text_completion"
    return {"id": prefix + request_id, "object": obj, "created": created, "model": model}


def now_s() -> int:
    return int(time.time())


def finish_reason(response: generation_pb2.GenerateResponse) -> str | None:
    return finish_name(response.finish_reason) if response.finish_reason else None


# grpc status → (HTTP status, OpenAI error type)
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
