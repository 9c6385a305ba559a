"""The gateway's own OpenAPI document, served at ``GET /openapi.json``.

Request bodies come from gateway/api/openai_schema.py, so they cannot drift from the
readers. Responses are this module's strict JSON Schemas (``additionalProperties: false``)
of what the handlers send, under OpenAI's field names; a streamed answer's schema is each
event's ``data``, as OpenAI's document writes it. harness/openapi_run.py runs schemathesis
against it (docs/reliability.md, "Published schemas")."""

from __future__ import annotations

from gateway.admit import routing_headers
from gateway.api import openai_schema
from gateway.api.openai_api import HTTP_STATUS
from gateway.api.openai_schema import Shape, Text
from gateway.tools.tool_checks import NAME_PATTERN
from gateway.validation import MAX_REQUEST_ID_CHARS, MAX_TENANT_CHARS
from protos import limits

OPENAPI_VERSION = "3.1.0"
API_VERSION = "v1"  # the paths' /v1, as continuum.v1 is the gRPC contract's
PRINTABLE_ASCII = "^[ -~]*$"  # validation.check_identifier's rule
STRING, NUMBER, NULL = {"type": "string"}, {"type": "number"}, {"type": "null"}
COUNT = {"type": "integer", "minimum": 0}

# What a string holds, where JSON Schema can say it.
_TEXT = {
    Text.MODEL: {"description": "the served model's id (GET /v1/models); empty: that model"},
    Text.IDENTIFIER: {"pattern": PRINTABLE_ASCII},
    Text.JSON: {"contentMediaType": "application/json"},
    Text.JSON_SCHEMA: {"contentMediaType": "application/json",
                       "description": "a JSON Schema, as JSON text"},
    Text.REGEX: {"description": "a regular expression (llguidance's dialect)"},
    Text.LARK: {"description": "a Lark grammar (llguidance's dialect)"},
    Text.TOKEN_ID: {"pattern": "^[0-9]{1,10}$"},  # openai_fields.logit_bias's keys
    Text.TOOL_NAME: {"pattern": f"^{NAME_PATTERN}$", "maxLength": limits.MAX_TOOL_NAME_CHARS},
}

# Statuses each kind of route answers (the edge answers 429 or 503 on any route when the
# connection caps are reached, gateway/edge/http_edge.py).
EDGE_ERRORS = (429, 503)
GENERATION_ERRORS = tuple(sorted({status for status, _ in HTTP_STATUS.values()} | {408, 413}))
TOOL_ERRORS = (400, 401, 403, 404, 408, 413, 429, 503)
READ_ERRORS = (401, *EDGE_ERRORS)
_ERROR_WORDS = {
    400: "the request is invalid: error.param names the field, and error.code is "
         "context_length_exceeded when it cannot fit the context",
    401: "no API key, or a wrong one (when the gateway runs with --api-keys-file)",
    403: "the API key may not do this (a tier or tenant it lacks)",
    404: "no such model (error.code model_not_found)",
    408: "the body did not arrive within the gateway's body timeout",
    409: "a request with this X-Request-Id is running",
    413: "the body is larger than the gateway's --max-body-bytes",
    429: "overloaded: retry after Retry-After seconds",
    503: "draining, or no healthy scheduler replica: retry (another replica may serve it)",
    504: "the request's deadline passed",
}


def body_schema(shape: Shape, vocab_size: int | None = None) -> dict | bool:
    """The JSON Schema of the values a reader accepts for ``shape``; ``vocab_size``
    bounds token ids (a served document knows its model's)."""
    kind = shape.kind
    if kind == "any":
        return False  # read only to be refused
    if kind == "any_of":
        return {"anyOf": [body_schema(option, vocab_size) for option in shape.options]}
    schema: dict = {"type": "object" if kind == "map" else kind}
    if kind == "string":
        schema.update(_TEXT.get(shape.text, {}))
    elif kind == "array":
        schema["items"] = body_schema(shape.items, vocab_size)
    elif kind == "map":
        schema["propertyNames"] = body_schema(shape.keys, vocab_size)
        schema["additionalProperties"] = body_schema(shape.values, vocab_size)
    elif kind == "object" and shape.fields:  # else any object (a JSON Schema, arguments)
        schema["properties"] = {name: body_schema(field, vocab_size)
                                for name, field in shape.fields}
    if shape.enum:
        schema["enum"] = list(shape.enum)
    if shape.required:
        schema["required"] = list(shape.required)
    if shape.low is not None:
        schema["exclusiveMinimum" if shape.low_open else "minimum"] = shape.low
    if shape.high is not None:
        schema["maximum"] = shape.high
    elif shape == openai_schema.TOKEN_ID and vocab_size is not None:
        schema["maximum"] = vocab_size - 1
    if shape.min_items:
        schema["minItems"] = shape.min_items
    if shape.min_length:
        schema["minLength"] = shape.min_length
    if shape.max_items is not None:
        schema["maxProperties" if kind == "map" else "maxItems"] = shape.max_items
    return schema


def request_schema(path: str, vocab_size: int | None = None) -> dict:
    """The body of ``path``: every key its reader reads, and the keys it must hold."""
    schema: dict = {"type": "object", "properties": {
        name: body_schema(shape, vocab_size)
        for name, shape in openai_schema.ENDPOINTS[path].items()}}
    choices = openai_schema.REQUIRED[path]
    if len(choices) == 1:
        schema["required"] = list(choices[0])
    else:
        schema["oneOf"] = [{"required": list(keys)} for keys in choices]
    return schema


# --- answers --------------------------------------------------------------------------


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(required: dict, optional: dict | None = None) -> dict:
    """An object that always holds ``required``'s keys, sometimes ``optional``'s, and
    nothing else."""
    return {"type": "object", "required": list(required),
            "properties": {**required, **(optional or {})}, "additionalProperties": False}


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, NULL]}


def _answer(object_name: str, choice: dict, chunk: bool) -> dict:
    """A completion or chunk. A chunk's usage is null until the last with
    stream_options.include_usage (whose choices are empty), absent without it."""
    fields = {"id": STRING, "object": {"const": object_name}, "created": COUNT,
              "model": STRING, "choices": _array(choice)}
    if chunk:
        return _object(fields, {"usage": _nullable(_ref("Usage"))})
    return _object({**fields, "usage": _ref("Usage")})


def _finish(reasons: tuple[str, ...], chunk: bool) -> dict:
    """The finish_reason: null on every chunk of a choice but its last."""
    schema = {"enum": list(reasons)}
    return _nullable(schema) if chunk else schema


def _completion_choice(chunk: bool) -> dict:
    return _object({"index": COUNT, "text": STRING,
                    "logprobs": _nullable(_ref("CompletionLogprobs")),
                    "finish_reason": _finish(("stop", "length"), chunk)})


def _chat_choice(chunk: bool) -> dict:
    body = {"delta": _ref("ChatDelta")} if chunk else {"message": _ref("ChatMessage")}
    return _object({"index": COUNT, **body, "logprobs": _nullable(_ref("ChatLogprobs")),
                    "finish_reason": _finish(("stop", "length", "tool_calls"), chunk)})


def answer_schemas() -> dict[str, dict]:
    """Every answer's JSON Schema, by component name."""
    token = {"token": STRING, "logprob": NUMBER, "bytes": _array(COUNT)}
    function = _object({"name": STRING, "arguments": STRING})
    return {
        "Usage": _object({"prompt_tokens": COUNT, "completion_tokens": COUNT,
                          "total_tokens": COUNT}),
        "CompletionLogprobs": _object({
            "tokens": _array(STRING), "token_logprobs": _array(NUMBER),
            "top_logprobs": _array({"type": "object", "additionalProperties": NUMBER}),
            "text_offset": _array(COUNT)}),
        "Completion": _answer("text_completion", _completion_choice(False), chunk=False),
        "CompletionChunk": _answer("text_completion", _completion_choice(True), chunk=True),
        "TokenLogprob": _object({**token, "top_logprobs": _array(_object(token))}),
        # refusal: OpenAI's field for a refusal in words; never sent by this server
        "ChatLogprobs": _object({"content": _array(_ref("TokenLogprob")), "refusal": NULL}),
        "ToolCall": _object({"id": STRING, "type": {"const": "function"},
                             "function": function}),
        "ChatMessage": _object({"role": {"const": "assistant"},
                                "content": _nullable(STRING), "refusal": NULL},
                               {"tool_calls": _array(_ref("ToolCall"))}),
        "ChatCompletion": _answer("chat.completion", _chat_choice(False), chunk=False),
        # a call's first entry has its id, type and name; later ones argument pieces
        "ToolCallDelta": _object({"index": COUNT}, {
            "id": STRING, "type": {"const": "function"},
            "function": _object({}, {"name": STRING, "arguments": STRING})}),
        "ChatDelta": _object({}, {"role": {"const": "assistant"}, "content": STRING,
                                  "tool_calls": _array(_ref("ToolCallDelta"))}),
        "ChatCompletionChunk": _answer("chat.completion.chunk", _chat_choice(True),
                                       chunk=True),
        "Model": _object({"id": STRING, "object": {"const": "model"}, "created": COUNT,
                          "owned_by": STRING, "root": STRING, "parent": NULL,
                          "max_model_len": COUNT}),
        "ModelList": _object({"object": {"const": "list"}, "data": _array(_ref("Model"))}),
        "Tokenized": _object({"count": COUNT, "max_model_len": COUNT,
                              "tokens": _array(COUNT)}, {"token_strs": _array(STRING)}),
        "Detokenized": _object({"prompt": STRING}),
        "Probe": _object({"status": STRING}),
        "ErrorResponse": _object({"error": _object({
            "message": STRING, "type": STRING, "param": _nullable(STRING),
            "code": _nullable(STRING)})}),
        "OpenApiDocument": {"type": "object", "required": ["openapi", "info", "paths"]},
    }


# --- routes ---------------------------------------------------------------------------


def _header(name: str, words: str, max_chars: int) -> dict:
    return {"name": name, "in": "header", "required": False, "description": words,
            "schema": {"type": "string", "pattern": PRINTABLE_ASCII, "maxLength": max_chars}}


def _generation_headers() -> list[dict]:
    fairness = [_header(name, "the tenant, where the body names none (an inference "
                        "gateway's flow)", MAX_TENANT_CHARS)
                for name in routing_headers.FAIRNESS_HEADERS]
    objective = [_header(name, "an objective or tier name: the priority, where the body "
                         "sets none", routing_headers.MAX_OBJECTIVE_CHARS)
                 for name in routing_headers.OBJECTIVE_HEADERS]
    return [_header("X-Request-Id", "the caller's id for the request, echoed in the "
                    "answer's X-Request-Id", MAX_REQUEST_ID_CHARS), *fairness, *objective]


def _operation(operation_id: str, summary: str, answer: dict, errors: tuple[int, ...],
               request: dict | None = None, streamed: str | None = None,
               media: str = "application/json") -> dict:
    """``request``: the schema of the body it takes; ``streamed``: the component its
    stream's events hold."""
    content = {media: {"schema": answer}}
    if streamed is not None:
        content["text/event-stream"] = {"schema": _ref(streamed)}
    responses = {"200": {"description": "OK", "content": content}}
    responses.update({str(s): {"$ref": f"#/components/responses/Error{s}"} for s in errors})
    operation = {"operationId": operation_id, "summary": summary, "responses": responses}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": request}}}
    if streamed is not None:
        operation["parameters"] = _generation_headers()
    if 401 not in errors:
        operation["security"] = []  # open without a key, as the probes are
    return operation


def _paths(vocab_size: int | None) -> dict:
    def body(path: str) -> dict:
        return request_schema(path, vocab_size)

    generation = "; with stream true, server-sent events ending in data: [DONE] (an error " \
                 "after the first event arrives as an event holding an ErrorResponse)"
    health = _operation("health", "readiness: 503 while draining or with no healthy "
                        "scheduler replica", _ref("Probe"), (429,))
    health["responses"]["503"] = {"description": _ERROR_WORDS[503], "content": {
        "application/json": {"schema": {"anyOf": [_ref("Probe"), _ref("ErrorResponse")]}}}}
    return {
        "/v1/completions": {"post": _operation(
            "createCompletion", "a completion of a prompt" + generation,
            _ref("Completion"), GENERATION_ERRORS, body("/v1/completions"),
            "CompletionChunk")},
        "/v1/chat/completions": {"post": _operation(
            "createChatCompletion", "the assistant's next message" + generation,
            _ref("ChatCompletion"), GENERATION_ERRORS, body("/v1/chat/completions"),
            "ChatCompletionChunk")},
        "/v1/models": {"get": _operation("listModels", "the served model", _ref("ModelList"),
                                         READ_ERRORS)},
        "/tokenize": {"post": _operation("tokenize", "the token ids generation would see",
                                         _ref("Tokenized"), TOOL_ERRORS, body("/tokenize"))},
        "/detokenize": {"post": _operation("detokenize", "the text of token ids",
                                           _ref("Detokenized"), TOOL_ERRORS,
                                           body("/detokenize"))},
        "/health": {"get": health},
        "/live": {"get": _operation("live", "liveness: 200 while the event loop runs",
                                    _ref("Probe"), EDGE_ERRORS)},
        "/metrics": {"get": _operation("metrics", "Prometheus metrics", STRING, READ_ERRORS,
                                       media="text/plain")},
        "/openapi.json": {"get": _operation("openapi", "this document",
                                            _ref("OpenApiDocument"), READ_ERRORS)},
    }


def _error_responses() -> dict:
    responses = {}
    for status, words in _ERROR_WORDS.items():
        responses[f"Error{status}"] = {"description": words, "content": {
            "application/json": {"schema": _ref("ErrorResponse")}}}
    responses["Error429"]["headers"] = {"Retry-After": {
        "required": True, "description": "seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 1}}}
    return responses


def document(vocab_size: int | None = None) -> dict:
    """The whole document; ``vocab_size``: the served model's, which bounds token ids."""
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "Continuum", "version": API_VERSION, "description": (
            "The gateway's OpenAI-compatible HTTP API. A null value is the same as the key "
            "left out; keys a route does not read are ignored.")},
        "paths": _paths(vocab_size),
        "components": {
            "schemas": answer_schemas(),
            "responses": _error_responses(),
            "securitySchemes": {"ApiKey": {
                "type": "http", "scheme": "bearer",
                "description": "required when the gateway runs with --api-keys-file"}},
        },
        "security": [{"ApiKey": []}],
    }
