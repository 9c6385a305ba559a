"""The HTTP API's request bodies as data: for each endpoint, every key the gateway reads,
its JSON shape and the values it accepts.

This enforces nothing: the readers (openai_api.py, openai_fields.py, tool_calls.py,
http_tokenize.py) are the rules. The reliability fuzzer generates bodies from it and
/openapi.json is built from it; tests/gateway/test_openai_schema.py fails when a reader
reads a key not listed here (docs/reliability.md, "Schema fuzzing")."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gateway.api.openai_api import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from gateway.api.openai_fields import UNSUPPORTED as UNSUPPORTED_NAMES
from gateway.validation import MAX_CHAT_MESSAGES
from protos import limits, tiers
from protos import sampling_checks as checks
from protos.sampling_checks import UINT32_MAX


class Text(enum.Enum):
    """What a string field holds, where it means more than text."""

    PLAIN = "plain"  # free text that reaches the model (prompt, content, stop)
    MODEL = "model"  # a model name
    IDENTIFIER = "identifier"  # a tenant or request id: printable ASCII, capped
    ROLE = "role"  # a chat role
    TOOL_NAME = "tool_name"  # a function name
    JSON = "json"  # JSON text (tool call arguments)
    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text or as an object
    REGEX = "regex"
    LARK = "lark"  # a Lark grammar (llguidance's dialect)
    TOKEN_ID = "token_id"  # a token id as a string of digits (logit_bias keys)


@dataclass(frozen=True)
class Shape:
    """One JSON value's shape. ``kind``: "string", "integer", "number", "boolean",
    "array", "object", "map" (``keys`` to ``values``), "any_of" (``options``) or "any"
    (read, but any value is refused). ``low``/``high``: inclusive (None: unbounded or the
    model's), the low end open when ``low_open``."""

    kind: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    enum: tuple = ()
    text: Text = Text.PLAIN
    items: Shape | None = None
    fields: tuple[tuple[str, Shape], ...] = ()
    keys: Shape | None = None
    values: Shape | None = None
    options: tuple[Shape, ...] = ()
    max_items: int | None = None
    min_items: int = 0
    min_length: int = 0
    required: tuple[str, ...] = ()

    @property
    def field_map(self) -> dict[str, Shape]:
        return dict(self.fields)


def string(text: Text = Text.PLAIN, min_length: int = 0) -> Shape:
    return Shape("string", text=text, min_length=min_length)


def words(*accepted: str, text: Text = Text.PLAIN) -> Shape:
    return Shape("string", enum=accepted, text=text)


def integer(low: int | None, high: int | None) -> Shape:
    return Shape("integer", low=low, high=high)


def number(low: float, high: float, low_open: bool = False) -> Shape:
    return Shape("number", low=low, high=high, low_open=low_open)


def array(items: Shape, max_items: int | None = None, min_items: int = 0) -> Shape:
    return Shape("array", items=items, max_items=max_items, min_items=min_items)


def obj(required: tuple[str, ...] = (), **fields: Shape) -> Shape:
    return Shape("object", fields=tuple(fields.items()), required=required)


def any_of(*options: Shape) -> Shape:
    return Shape("any_of", options=options)


BOOLEAN = Shape("boolean")
REFUSED = Shape("any")
TOKEN_ID = integer(0, None)  # < the model's vocabulary size
# An object that is a JSON Schema: the fuzzer draws schemas, not the object's own keys.
SCHEMA_OBJECT = Shape("object", text=Text.JSON_SCHEMA)
TEXT_PART = obj(required=("type", "text"), type=words("text"), text=string())

# --- what both generation dialects read (openai_fields.common) -----------------------

RESPONSE_FORMAT = any_of(
    obj(required=("type",), type=words("text")),
    obj(required=("type",), type=words("json_object")),
    obj(required=("type", "json_schema"), type=words("json_schema"),
        json_schema=obj(required=("schema",), name=string(), schema=SCHEMA_OBJECT,
                        strict=BOOLEAN)))
GUIDED = {
    "response_format": RESPONSE_FORMAT,
    "guided_json": any_of(SCHEMA_OBJECT, string(Text.JSON_SCHEMA)),
    "guided_regex": string(Text.REGEX, min_length=1),
    "guided_choice": array(string(min_length=1), min_items=1),
    "guided_grammar": string(Text.LARK, min_length=1),
}
# Every sampling number, as protos/sampling_checks.py bounds it (an open low end, as
# top_p's 0, is drawn too: it is refused). top_k also takes -1 (vLLM's "off").
SAMPLING_NUMBERS = {
    b.name: integer(-1 if b.name == "top_k" else b.low, b.high) if b.integer
    else number(b.low, b.high, b.low_open) for b in checks.NUMBERS}
COMMON = {
    "model": string(Text.MODEL),
    **SAMPLING_NUMBERS,
    "ignore_eos": BOOLEAN,
    "stop_token_ids": array(TOKEN_ID, limits.MAX_STOP_TOKEN_IDS),
    "logit_bias": Shape("map", keys=string(Text.TOKEN_ID),
                        values=number(-limits.MAX_LOGIT_BIAS, limits.MAX_LOGIT_BIAS),
                        max_items=limits.MAX_LOGIT_BIAS_ENTRIES),
    **GUIDED,
    "stop": any_of(string(min_length=1), array(string(min_length=1), limits.MAX_STOP_STRINGS)),
    "n": integer(checks.N.low, checks.N.high),
    "best_of": integer(1, UINT32_MAX),  # only equal to n
    "tenant": string(Text.IDENTIFIER),
    "priority": any_of(words(*tiers.NAMES), integer(0, tiers.NUM_TIERS - 1)),
    "stream": BOOLEAN,
    "stream_options": obj(include_usage=BOOLEAN, continuous_usage_stats=BOOLEAN),
}
# Read only to be refused by name (a silent drop would answer something else than asked).
UNSUPPORTED = {name: REFUSED for name in UNSUPPORTED_NAMES}
# OpenAI fields that are accepted and not read (they change nothing here).
IGNORED = {"user": string()}

# --- chat ----------------------------------------------------------------------------

TOOL_CALL = obj(required=("function",), id=string(), type=words("function"),
                function=obj(required=("name", "arguments"), name=string(Text.TOOL_NAME),
                             arguments=any_of(string(Text.JSON), SCHEMA_OBJECT)))
CONTENT = any_of(string(), array(TEXT_PART))
# One shape per kind of turn: only an assistant's has tool_calls, and a tool's must name
# the call it answers (tool_calls.read_message).
MESSAGE = any_of(
    obj(required=("role",), role=words("system", "user", "developer", text=Text.ROLE),
        content=CONTENT, tool_calls=REFUSED),
    obj(required=("role",), role=words("assistant", text=Text.ROLE), content=CONTENT,
        tool_calls=array(TOOL_CALL)),
    obj(required=("role", "tool_call_id"), role=words("tool", text=Text.ROLE),
        content=CONTENT, tool_calls=REFUSED, tool_call_id=string(min_length=1)),
)
TOOL = obj(required=("type", "function"), type=words("function"),
           function=obj(required=("name",), name=string(Text.TOOL_NAME),
                        description=string(), parameters=SCHEMA_OBJECT, strict=BOOLEAN))
TOOLS = {
    "tools": array(TOOL, limits.MAX_TOOLS),
    "tool_choice": any_of(words("none", "auto", "required"),
                          obj(required=("type", "function"), type=words("function"),
                              function=obj(required=("name",),
                                           name=string(Text.TOOL_NAME)))),
    "parallel_tool_calls": BOOLEAN,
}
MESSAGES = array(MESSAGE, MAX_CHAT_MESSAGES, min_items=1)

COMPLETIONS = {
    "prompt": any_of(string(min_length=1), array(TOKEN_ID, min_items=1),
                     array(string(min_length=1), 1, min_items=1),
                     array(array(TOKEN_ID, min_items=1), 1, min_items=1)),
    "echo": BOOLEAN,
    "max_tokens": integer(checks.MAX_TOKENS.low, checks.MAX_TOKENS.high),
    "logprobs": integer(0, MAX_COMPLETION_LOGPROBS),
    **COMMON, **{name: REFUSED for name in TOOLS},  # tools: chat only (tool_calls.refuse)
    **UNSUPPORTED, **IGNORED,
}
CHAT = {
    "messages": MESSAGES,
    "max_completion_tokens": integer(checks.MAX_TOKENS.low, checks.MAX_TOKENS.high),
    "max_tokens": integer(checks.MAX_TOKENS.low, checks.MAX_TOKENS.high),
    "logprobs": BOOLEAN,
    "top_logprobs": integer(0, MAX_TOP_LOGPROBS),
    **COMMON, **TOOLS, **UNSUPPORTED, **IGNORED,
}
TOKENIZE = {  # prompt or messages (not both), rendered as the dialects render them
    "model": string(Text.MODEL), "prompt": COMPLETIONS["prompt"], "messages": MESSAGES,
    "tools": TOOLS["tools"], "return_token_strs": BOOLEAN,
}
DETOKENIZE = {"model": string(Text.MODEL), "tokens": array(TOKEN_ID)}

ENDPOINTS: dict[str, dict[str, Shape]] = {
    "/v1/completions": COMPLETIONS,
    "/v1/chat/completions": CHAT,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}
# The keys a body must hold: all of one of the tuples (/tokenize takes a prompt or
# messages, never both).
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "/v1/completions": (("prompt",),),
    "/v1/chat/completions": (("messages",),),
    "/tokenize": (("prompt",), ("messages",)),
    "/detokenize": (("tokens",),),
}
# A body that each endpoint accepts and answers quickly: what the fuzzer changes.
# max_tokens stays set: unset, chat would generate up to the context limit.
VALID = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 4, "temperature": 0},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


def top_level_keys() -> set[str]:
    """Every key any endpoint reads from the body itself."""
    return {key for fields in ENDPOINTS.values() for key in fields}


def nested_keys() -> set[str]:
    """Every key of every object nested anywhere in a body."""
    found: set[str] = set()
    stack = [shape for fields in ENDPOINTS.values() for shape in fields.values()]
    while stack:
        shape = stack.pop()
        found.update(name for name, _ in shape.fields)
        stack += [s for _, s in shape.fields] + list(shape.options)
        stack += [s for s in (shape.items, shape.keys, shape.values) if s is not None]
    return found
