"""What a ``Guided`` message (structured output) means: one llguidance grammar.

The gateway compiles it to refuse a bad schema or regex with a 400 before anything
runs; the executor compiles the same text into a matcher per sequence whose token
mask the sampler applies. Both read it here, so they cannot disagree on what a
request asked for. llguidance (Microsoft's guidance engine; the grammar library of
vLLM's and SGLang's structured output) computes a mask in tens of microseconds and
needs nothing but the model's tokenizer.json.
"""

from __future__ import annotations

import json

import llguidance

from protos import limits
from protos.continuum.v1 import sampling_pb2

ANY_OBJECT_SCHEMA = '{"type": "object"}'
# JSON as json.dumps writes it: one space after "," and ":", no other whitespace. With
# free whitespace a model can pad a JSON answer with blank lines until max_tokens (a
# known failure of JSON modes); this keeps every answer parseable and short.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedError(ValueError):
    """A Guided spec that cannot be compiled; the message says why."""


def grammar_of(guided: sampling_pb2.Guided) -> str | None:
    """The llguidance grammar for ``guided``, or None when it constrains nothing.
    GuidedError for one too large, not JSON where JSON is due, or not compilable."""
    kind = guided.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not guided.json_object):
        return None
    text = getattr(guided, kind) if kind != "json_object" else ANY_OBJECT_SCHEMA
    if len(text.encode()) > limits.MAX_GUIDED_BYTES:
        raise GuidedError(f"guided.{kind} is {len(text.encode())} bytes; at most "
                          f"{limits.MAX_GUIDED_BYTES}")
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GuidedError(f"guided.{kind} is not JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise GuidedError(f"guided.{kind} must be a JSON Schema object")
    try:
        if kind in ("json_schema", "json_object"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except ValueError as exc:
        raise GuidedError(f"guided.{kind} is not valid: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GuidedError(f"guided.{kind} cannot be compiled: {messages[0]}")
    return grammar
