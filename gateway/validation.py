"""Validation of client requests: the edge where bad input becomes a status code.

Every check raises a `RequestError` whose message says what to change; nothing a client
sends may surface as INTERNAL. Sampling values, stop strings and n are
protos/sampling_checks.py's checks (shared with the scheduler; numbers in protos/limits.py).

Caps, checked by length before any template is rendered or text tokenized, following or
tightening trusted servers: top_logprobs <= 20 (OpenAI); stop strings 16 x 256 bytes
(OpenAI and TGI allow 4, vLLM has no cap); n <= 16 (OpenAI: 128, but each completion here is
a running sequence). Ours beyond them: stop_token_ids <= 128 (the whole vocabulary with
min_tokens > 0 would ban every token, at a vocabulary-sized list a step); 1,024 chat
messages; prompt ids <= max_model_len; prompt and chat text <= max_model_len x the longest
token's characters (longer text is necessarily too many tokens); request_id and tenant:
128 printable ASCII characters."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from gateway.text.chat_template import ChatTemplateError
from gateway.text.tokenizer import Tokenizer
from gateway.tools import tool_checks
from protos import limits, sampling_checks, tiers
from protos.continuum.v1 import generation_pb2, sampling_pb2, scheduler_pb2
from protos.echo import clip, shorten

# The limits the scheduler enforces again on its internal plane live in protos/limits.py.
MAX_REQUEST_ID_CHARS = limits.MAX_REQUEST_ID_CHARS
MAX_TENANT_CHARS = limits.MAX_TENANT_CHARS
MAX_CHAT_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 256
DEFAULT_TENANT = "default"
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


class RequestError(Exception):
    """A request the gateway refuses; `code` is the gRPC status to return."""

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT,
        param: str | None = None,
        error_code: str | None = None,
        http_status: int | None = None,
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.http_status = http_status  # where HTTP is more precise (408 for a slow body)
        self.param = param  # the offending field, for OpenAI-style errors
        self.error_code = error_code  # OpenAI's word where it has one ("model_not_found")


@dataclass(frozen=True)
class UndecodableRequest:
    """Bytes that are not a GenerateRequest (e.g. a string field with invalid UTF-8)."""

    reason: str


def parse_request(data: bytes) -> generation_pb2.GenerateRequest | UndecodableRequest:
    """The servicer's request deserializer: never raises, so bad bytes can become
    INVALID_ARGUMENT in the handler instead of grpc's UNKNOWN."""
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        return UndecodableRequest(str(exc))


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed every check, resolved to what the scheduler needs."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: sampling_pb2.SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    tenant: str
    tier: int  # protos/tiers.py: 0 premium .. 2 best effort
    n: int = 1

    def to_submit(self) -> scheduler_pb2.SubmitRequest:
        return scheduler_pb2.SubmitRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            sampling=self.sampling,
            max_tokens=self.max_tokens,
            tenant=self.tenant,
            priority_tier=self.tier,
        )


def check_identifier(value: str, field: str, max_chars: int) -> None:
    if problem := sampling_checks.identifier_problem(value, field, max_chars):
        raise RequestError(problem, param=field)


def context_exceeded(max_model_len: int, however: str, reduce: str,
                     param: str) -> RequestError:
    """A request that cannot fit the context, in OpenAI's words and code (tools detect
    overflow by "maximum context length" and ``context_length_exceeded``)."""
    return RequestError(
        f"This model's maximum context length is {max_model_len} tokens. However, "
        f"{however}. Please reduce the length of {reduce}.",
        param=param, error_code="context_length_exceeded")


def model_not_served(model, served_model: str) -> RequestError:
    return RequestError(f"model {clip(model)} is not served here; this gateway serves "
                        f"{served_model!r} (or leave model empty)", grpc.StatusCode.NOT_FOUND,
                        param="model", error_code="model_not_found")


def check_sampling(sampling: sampling_pb2.SamplingParams, tokenizer: Tokenizer) -> None:
    """protos/sampling_checks.py's checks, then a structured-output spec compiled against
    the served tokenizer (gateway/structured/guided_check.py)."""
    found = (sampling_checks.sampling_problem(sampling)
             or sampling_checks.vocabulary_problem(sampling, tokenizer.info.vocab_size))
    if found is None and sampling.HasField("guided") and \
            (message := tokenizer.guided.problem(sampling.guided)) is not None:
        found = message, "response_format"
    if found is not None:
        raise RequestError(found[0], param=found[1])


def max_prompt_chars(tokenizer: Tokenizer) -> int:
    """Text longer than this cannot tokenize to max_model_len tokens or fewer."""
    return tokenizer.info.max_model_len * tokenizer.info.max_token_chars


def _check_prompt_chars(field: str, num_chars: int, tokenizer: Tokenizer) -> None:
    limit = max_prompt_chars(tokenizer)
    if num_chars > limit:
        raise context_exceeded(
            tokenizer.info.max_model_len,
            f"the {field} is {num_chars} characters long, and at most {limit} characters "
            f"({tokenizer.info.max_token_chars} a token at most) can fit",
            "the messages" if field.startswith("chat") else "the prompt",
            "messages" if field.startswith("chat") else "prompt")


def _chat_messages(chat: generation_pb2.ChatInput, tokenizer: Tokenizer) -> list[dict]:
    if not chat.messages:
        raise RequestError("chat has no messages; send at least one", param="messages")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise RequestError(f"chat holds {len(chat.messages)} messages; at most "
                           f"{MAX_CHAT_MESSAGES}", param="messages")
    _check_prompt_chars("chat message text", tool_checks.chat_chars(chat), tokenizer)
    problem = tool_checks.chat_problem(chat, tokenizer.guided)
    if problem is not None:
        raise RequestError(problem, param="tools" if problem.startswith("tools") else "messages")
    for index, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise RequestError(
                f"chat.messages[{index}].role is {clip(message.role)}; "
                f"use one of {', '.join(sorted(CHAT_ROLES))}",
                param="messages",
            )
    return tool_checks.template_messages(chat)


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """Resolves the request's input (prompt, chat or token ids) to prompt token ids."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise RequestError("no input: set exactly one of prompt, chat or token_ids")
    if kind == "prompt":
        if not request.prompt:
            raise RequestError("prompt is empty", param="prompt")
        _check_prompt_chars("prompt", len(request.prompt), tokenizer)
        ids = tokenizer.encode(request.prompt)
    elif kind == "chat":
        try:
            ids = tokenizer.encode_chat(_chat_messages(request.chat, tokenizer),
                                        tool_checks.template_tools(request.chat))
        except ChatTemplateError as exc:
            raise RequestError(
                f"the model's chat template rejected the messages: {shorten(str(exc))}",
                param="messages",
            ) from exc
    else:
        ids = list(request.token_ids.ids)
        if not ids:
            raise RequestError("token_ids is empty", param="prompt")
        if len(ids) > tokenizer.info.max_model_len:
            raise context_exceeded(tokenizer.info.max_model_len,
                                   f"token_ids.ids holds {len(ids)} token ids", "token_ids.ids",
                                   "token_ids")
        if problem := sampling_checks.token_ids_problem("token_ids.ids", ids,
                                                        tokenizer.info.vocab_size):
            raise RequestError(problem, param="token_ids")
    if not ids:
        raise RequestError(f"the {kind} tokenizes to zero tokens", param=kind)
    return ids


def resolve_max_tokens(requested: int, num_prompt_tokens: int, max_model_len: int) -> int:
    """Applies the default (up to 256, within the context) and checks the context limit."""
    max_tokens = requested or max(1, min(DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens))
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise context_exceeded(
            max_model_len, f"you requested {total} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion)", "the prompt or of max_tokens",
            "max_tokens" if num_prompt_tokens < max_model_len else "prompt")
    return max_tokens


def _check_envelope(request: generation_pb2.GenerateRequest, served_model: str) -> None:
    """Checks everything that needs no tokenizer."""
    check_identifier(request.request_id, "request_id", MAX_REQUEST_ID_CHARS)
    check_identifier(request.tenant, "tenant", MAX_TENANT_CHARS)
    if request.model and request.model != served_model:
        raise model_not_served(request.model, served_model)
    if tiers.from_priority(request.priority) is None:
        raise RequestError(
            f"priority {request.priority} is not a known Priority value; use one of "
            f"{', '.join(generation_pb2.Priority.keys())}", param="priority"
        )
    if request.n and (problem := sampling_checks.N.problem(request.n)):
        raise RequestError(problem, param="n")
    if problem := sampling_checks.stop_strings_problem(request.stop):
        raise RequestError(problem, param="stop")


def validate(
    request: generation_pb2.GenerateRequest | UndecodableRequest,
    tokenizer: Tokenizer,
    served_model: str,
) -> ValidatedRequest:
    """Checks a client request and resolves it for the scheduler (a SubmitRequest);
    raises RequestError."""
    if isinstance(request, UndecodableRequest):
        raise RequestError(
            f"the request is not a valid GenerateRequest ({shorten(request.reason)}); "
            "string fields must be UTF-8"
        )
    _check_envelope(request, served_model)
    check_sampling(request.sampling, tokenizer)
    ids = prompt_token_ids(request, tokenizer)
    max_tokens = resolve_max_tokens(request.max_tokens, len(ids), tokenizer.info.max_model_len)
    if request.sampling.min_tokens > max_tokens:
        raise RequestError(
            f"sampling.min_tokens ({request.sampling.min_tokens}) must be <= max_tokens "
            f"({max_tokens})",
            param="min_tokens",
        )
    return ValidatedRequest(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=tuple(ids),
        sampling=request.sampling,
        max_tokens=max_tokens,
        stop=tuple(request.stop),
        tenant=request.tenant or DEFAULT_TENANT,
        tier=tiers.from_priority(request.priority),
        n=request.n or 1,
    )
