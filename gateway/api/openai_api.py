"""The two OpenAI dialects (completions, chat): bodies to `GenerateRequest`s and back.

Pure functions. Each dialect owns everything that differs between the two endpoints (the
body's translation; the shapes of chunks, choices, logprobs, envelope), so the HTTP front
never branches on which it serves. Both then go through the same `validation.validate`;
OpenAI-only rules are checked here and in openai_fields.py. Extensions, as in other open
servers: protos/sampling_checks.py's numbers (`top_k`, `min_p`, ...), `ignore_eos`,
`stop_token_ids`, and Continuum's `priority` (a tier name) and `tenant`."""

from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.api import openai_fields as fields
from gateway.routing.relay import finish_name
from gateway.text.tokenizer import Tokenizer
from gateway.tools import tool_calls, tool_parsers
from gateway.tools.tool_answers import ToolAnswers
from gateway.validation import MAX_CHAT_MESSAGES
from protos import limits
from protos import sampling_checks as checks
from protos.continuum.v1 import generation_pb2

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = limits.MAX_LOGPROBS  # OpenAI's top_logprobs limit
MAX_TOKENS_RANGE = (checks.MAX_TOKENS.low, checks.MAX_TOKENS.high)
# The logprob of a token the sampler could not draw (-inf: masked). JSON has no infinity;
# vLLM's OpenAI server writes the same floor.
MIN_LOGPROB = -9999.0


@dataclass
class ApiRequest:
    """A parsed OpenAI request: the protobuf to validate plus how to answer."""

    dialect: Dialect
    proto: generation_pb2.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far on every chunk (vLLM's extension)
    logprobs: bool = False  # return logprobs at all
    echo_text: str = ""  # /v1/completions echo: prompt text prepended to each choice


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _logprob(value: float) -> float:
    """``value``, or MIN_LOGPROB for -inf (or NaN): a number JSON can hold."""
    return value if math.isfinite(value) else MIN_LOGPROB


class Dialect(abc.ABC):
    """One OpenAI endpoint's request parsing and response shapes."""

    name = ""  # "completion" | "chat": the `api` label of logs
    object_name = ""  # the `object` of a non-streamed response
    chunk_object_name = ""
    id_prefix = ""

    @abc.abstractmethod
    def parse(self, body: Any, served_model: str, tokenizer: Tokenizer) -> ApiRequest:
        """The request for `body`; raises RequestError naming the offending field."""

    def envelope(self, request_id: str, model: str, created: int, chunk: bool) -> dict:
        return {"id": self.id_prefix + request_id,
                "object": self.chunk_object_name if chunk else self.object_name,
                "created": created, "model": model}

    @abc.abstractmethod
    def logprobs(self, tokenizer: Tokenizer, response: generation_pb2.GenerateResponse,
                 offset: int) -> dict:
        """The logprobs of one response's tokens; `offset` is the choice's text length so far."""

    @abc.abstractmethod
    def chunk_choice(self, index: int, text: str, first: bool, reason: str | None) -> dict:
        """One streamed chunk's choice; tool calls may turn ``reason`` into "tool_calls"."""

    def chunk_choices(self, index: int, text: str, first: bool, reason: str | None) -> list[dict]:
        """One response's streamed choices, each in a chunk of its own, in order."""
        return [self.chunk_choice(index, text, first, reason)]

    @abc.abstractmethod
    def final_choice(self, index: int, text: str, parts: list[dict] | None,
                     reason: str | None) -> dict:
        """A non-streamed choice; `parts` are its responses' `logprobs` objects in order."""


class CompletionDialect(Dialect):
    name = "completion"
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"
    _LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def parse(self, body: Any, served_model: str, tokenizer: Tokenizer) -> ApiRequest:
        if not isinstance(body, dict):
            raise fields.bad("the request body must be a JSON object")
        proto = generation_pb2.GenerateRequest()
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        echo = fields.boolean(body, "echo")
        echo_text = ""
        if isinstance(prompt, str):
            proto.prompt = prompt
            echo_text = prompt
        elif fields.looks_like_token_ids(prompt):
            info = tokenizer.info
            ids = fields.token_ids(prompt, "prompt", info.max_model_len, info.vocab_size)
            proto.token_ids.ids.extend(ids)
            echo_text = tokenizer.decode(ids) if echo else ""
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise fields.bad("send one prompt per request (or use n for several completions)",
                             "prompt")
        else:
            raise fields.bad("prompt is required: a string or a list of token ids", "prompt")
        tool_calls.refuse(body)
        fields.common(body, proto, served_model, tokenizer.info.vocab_size)
        proto.max_tokens = fields.integer(body, "max_tokens", *MAX_TOKENS_RANGE,
                                          COMPLETION_DEFAULT_MAX_TOKENS)
        logprobs = fields.integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        if logprobs is not None:
            proto.sampling.logprobs = logprobs
        stream = fields.boolean(body, "stream")
        if echo and logprobs is not None:
            raise fields.bad("echo together with logprobs is not supported", "echo")
        include_usage, continuous = fields.stream_options(body, stream)
        return ApiRequest(self, proto, stream=stream, include_usage=include_usage,
                          continuous_usage=continuous, logprobs=logprobs is not None,
                          echo_text=echo_text if echo else "")

    def logprobs(self, tokenizer, response, offset):
        """The legacy completions logprobs object."""
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for item in response.logprobs:
            text = _token_text(tokenizer, item.token_id)
            tokens.append(text)
            token_logprobs.append(_logprob(item.logprob))
            tops.append({_token_text(tokenizer, t): _logprob(lp)
                         for t, lp in zip(item.top_token_ids, item.top_logprobs, strict=False)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    def chunk_choice(self, index, text, first, reason):
        return {"index": index, "text": text, "finish_reason": reason}

    def final_choice(self, index, text, parts, reason):
        merged = None
        if parts is not None:
            merged = {key: [v for part in parts for v in part[key]] for key in self._LOGPROB_KEYS}
        return {"index": index, "text": text, "logprobs": merged, "finish_reason": reason}


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise fields.bad(f"messages[{index}].content: only text parts are supported",
                                 "messages")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise fields.bad(f"messages[{index}].content must be a string or a list of text parts",
                     "messages")


class ChatDialect(Dialect):
    """Chat; a request with tools gets its own instance holding its tool-call parse state
    (``answers``). ``parser``: the ``--tool-call-parser``."""

    name = "chat"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, answers: ToolAnswers | None = None,
                 parser: str = tool_parsers.DEFAULT_PARSER):
        self.answers = answers
        self.parser = parser

    def parse(self, body: Any, served_model: str, tokenizer: Tokenizer) -> ApiRequest:
        if not isinstance(body, dict):
            raise fields.bad("the request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise fields.bad("messages is required: a non-empty list of {role, content}",
                             "messages")
        if len(messages) > MAX_CHAT_MESSAGES:  # before building anything from them
            raise fields.bad(f"messages holds {len(messages)} messages; at most "
                             f"{MAX_CHAT_MESSAGES}", "messages")
        proto = generation_pb2.GenerateRequest()
        for index, message in enumerate(messages):
            if not isinstance(message, dict):
                raise fields.bad(f"messages[{index}] must be an object with role and content",
                                 "messages")
            role = message.get("role")
            role = "system" if role == "developer" else role
            if not isinstance(role, str):
                raise fields.bad(f"messages[{index}].role is required: a string", "messages")
            entry = proto.chat.messages.add(role=role,
                                            content=_message_text(message.get("content"), index))
            tool_calls.read_message(message, entry, index)
        plan = tool_calls.read(body, proto.chat, tokenizer.guided, self.parser)
        fields.common(body, proto, served_model, tokenizer.info.vocab_size)
        tool_calls.constrain(plan, proto.chat, proto.sampling)
        dialect = self if plan is None or plan.mode == "none" else \
            ChatDialect(ToolAnswers(plan), self.parser)
        max_tokens = fields.integer(body, "max_completion_tokens", *MAX_TOKENS_RANGE)
        if max_tokens is None:
            max_tokens = fields.integer(body, "max_tokens", *MAX_TOKENS_RANGE, 0)
        proto.max_tokens = max_tokens
        logprobs = fields.boolean(body, "logprobs")
        top = fields.integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not logprobs:
            raise fields.bad("top_logprobs requires logprobs to be true", "top_logprobs")
        if logprobs:
            proto.sampling.logprobs = top or 0
        stream = fields.boolean(body, "stream")
        include_usage, continuous = fields.stream_options(body, stream)
        return ApiRequest(dialect, proto, stream=stream, include_usage=include_usage,
                          continuous_usage=continuous, logprobs=logprobs)

    def logprobs(self, tokenizer, response, offset):
        def entry(token_id: int, logprob: float) -> dict:
            text = _token_text(tokenizer, token_id)
            return {"token": text, "logprob": _logprob(logprob),
                    "bytes": list(text.encode("utf-8"))}

        content = []
        for item in response.logprobs:
            top = [entry(t, lp)
                   for t, lp in zip(item.top_token_ids, item.top_logprobs, strict=False)]
            content.append({**entry(item.token_id, item.logprob), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def chunk_choice(self, index, text, first, reason):
        if self.answers is not None:  # what it holds back or finds is its own
            delta, reason = self.answers.delta(index, text, first, reason)
            return {"index": index, "delta": delta, "finish_reason": reason}
        # Every chunk here carries a token, so its delta has `content`, "" included: vLLM's
        # benchmark client ends a request at its last chunk with `content`.
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "finish_reason": reason}

    def chunk_choices(self, index, text, first, reason):
        if first and not text and self.answers is None:
            # A first token without text yet (part of a character, or the end at once): the
            # role opens in a chunk of its own, as OpenAI's and vLLM's do, since vLLM's
            # benchmark client counts no token in a chunk with `role` (TTFT, or a failure).
            return [{"index": index, "delta": {"role": "assistant", "content": ""},
                     "finish_reason": None},
                    {"index": index, "delta": {"content": ""}, "finish_reason": reason}]
        return [self.chunk_choice(index, text, first, reason)]

    def final_choice(self, index, text, parts, reason):
        merged = None
        if parts is not None:
            merged = {"content": [c for part in parts for c in part["content"]], "refusal": None}
        # refusal: required by OpenAI's schema; this server never refuses in text.
        message = {"role": "assistant", "content": text, "refusal": None}
        if self.answers is not None:
            message, reason = self.answers.message(index, text, reason)
        return {"index": index, "message": message, "logprobs": merged,
                "finish_reason": reason}


COMPLETION = CompletionDialect()
CHAT = ChatDialect()


class Choices:
    """Per-choice state of one response being relayed: text so far, logprob offsets, usage."""

    def __init__(self, api: ApiRequest, tokenizer: Tokenizer):
        self.api = api
        self.tokenizer = tokenizer
        self.text: dict[int, list[str]] = {}
        self.offset: dict[int, int] = {}
        self.finish: dict[int, str | None] = {}
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.streamed_tokens = 0  # every choice's tokens so far (continuous usage)

    def text_of(self, response) -> tuple[str, bool]:
        """The response's text (with echo on a choice's first), and whether it is the first."""
        first = response.index not in self.text
        text = (self.api.echo_text if first else "") + response.text
        self.text.setdefault(response.index, []).append(text)
        self.streamed_tokens += len(response.token_ids)
        if response.finish_reason:
            self.finish[response.index] = finish_reason(response)
            self.completion_tokens += response.usage.completion_tokens
            self.prompt_tokens = response.usage.prompt_tokens
        return text, first

    def logprobs_of(self, response) -> dict | None:
        if not self.api.logprobs:
            return None
        offset = self.offset.get(response.index, len(self.api.echo_text))
        result = self.api.dialect.logprobs(self.tokenizer, response, offset)
        self.offset[response.index] = offset + len(response.text)
        return result


# --- shared response pieces -------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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
