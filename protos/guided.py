"""What a ``Guided`` message (structured output) means: one llguidance grammar, and the
matcher that enforces it against the model's tokenizer.

The gateway compiles it to refuse a bad spec with a 400; the executor compiles the same
text into a matcher per sequence. Both read it here (``grammar_of``, ``load_tokenizer``,
``new_matcher``, ``PARSER_LIMITS``), so they cannot disagree. Some specs fail only against
a tokenizer (a token range past the vocabulary, a missing special token, a regex whose
lexer outgrows the limits: ``a{1000000}``'s first mask takes 0.4 s, then fails): ``probe``
builds the matcher and walks its first PROBE_TOKENS tokens, as the executor would.
llguidance (vLLM's and SGLang's grammar library) masks in tens of µs from tokenizer.json.
"""

from __future__ import annotations

import json

import llguidance

from protos import limits
from protos.continuum.v1 import sampling_pb2
from protos.echo import shorten

ANY_OBJECT_SCHEMA = '{"type": "object"}'
# JSON as json.dumps writes it: one space after "," and ":", no other whitespace. With
# free whitespace a model can pad a JSON answer with blank lines until max_tokens (a
# known failure of JSON modes); this keeps every answer parseable and short.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's defaults, tightened where a spec's cost lands on everyone else. Initial
# lexer fuel, a twentieth of its 1,000,000: it bounds how large a regex's expressions may
# grow; at the default (a{1000}){1000} costs 0.1 s of a mask (a stalled step for every row
# of the batch), at 50,000 it is refused after 17 ms. Per mask step, lexer fuel 30,000
# (~2 ms at llguidance's ~14k/ms, from 200,000) and Earley items 10,000 (~0.5 ms, from
# 50,000): a guided row's share of a step stays a few milliseconds whatever its grammar,
# and a row that needs more fails alone. JSON schemas with formats, enums and patterns
# compile in 1-5 ms and step in 0.1 ms within it; an anyOf of 30 tools with 40 fields
# each (37 KB) in 45 ms and 0.15 ms. Terse errors: llguidance's verbose ones print the
# parser state.
PARSER_LIMITS = llguidance.LLParserLimits(initial_lexer_fuel=50_000, step_lexer_fuel=30_000,
                                          step_max_items=10_000, verbose_errors=False)
# Tokens probe() walks: the first mask builds the lexer, and the first token consumed
# derives it, which is where an over-large regex fails.
PROBE_TOKENS = 2


class GuidedError(ValueError):
    """A Guided spec that cannot be compiled; the message says why."""


def grammar_of(guided: sampling_pb2.Guided) -> str | None:
    """The llguidance grammar for ``guided``, or None when it constrains nothing.
    GuidedError for one too large, not JSON where JSON is due, or not compilable
    (without a tokenizer: ``probe`` checks the rest)."""
    kind = guided.WhichOneof("kind")
    if kind is None or (kind == "json_object" and not guided.json_object):
        return None
    text = getattr(guided, kind) if kind != "json_object" else ANY_OBJECT_SCHEMA
    if len(text.encode()) > limits.MAX_GUIDED_BYTES:
        raise GuidedError(f"guided.{kind} is {len(text.encode())} bytes; at most "
                          f"{limits.MAX_GUIDED_BYTES}")
    if kind in ("json_schema", "json_object"):
        _check_schema_text(kind, text)
    try:
        if kind in ("json_schema", "json_object"):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
    except ValueError as exc:
        raise GuidedError(f"guided.{kind} is not valid: {shorten(str(exc))}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        grammar, limits=PARSER_LIMITS)
    if is_error:
        raise GuidedError(f"guided.{kind} cannot be compiled: {shorten(messages[0])}")
    return grammar


def _check_schema_text(kind: str, text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GuidedError(f"guided.{kind} is not JSON: {exc}") from exc
    except RecursionError as exc:  # "[[[[…" a hundred thousand deep, inside a string
        raise GuidedError(f"guided.{kind} nests too deeply to be a JSON Schema") from exc
    if not isinstance(schema, dict):
        raise GuidedError(f"guided.{kind} must be a JSON Schema object")


def load_tokenizer(tokenizer_json: str, vocab_size: int,
                   eos_token_ids: tuple[int, ...] | list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the model's tokenizer: ``tokenizer_json`` is the text of its
    tokenizer.json, ``vocab_size`` the model's (logits) vocabulary. ~0.3 s for 49k tokens."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                  eos_token=list(eos_token_ids) or None)


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str,
                what: str = "the grammar") -> llguidance.LLMatcher:
    """A matcher in its initial state; GuidedError when ``grammar`` does not compile
    against ``tokenizer`` (llguidance's matcher never raises: it enters an error state).
    ``what`` names the spec in the message."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
    if matcher.is_error():
        raise GuidedError(f"{what} cannot be compiled: {shorten(_reason(matcher))}")
    return matcher


def probe(tokenizer: llguidance.LLTokenizer, grammar: str, what: str = "the grammar") -> None:
    """GuidedError unless ``grammar`` compiles against ``tokenizer`` and survives its
    first PROBE_TOKENS tokens (each the lowest id the mask allows, EOS aside): what the
    executor's first steps do with it."""
    matcher = new_matcher(tokenizer, grammar, what)
    eos = set(tokenizer.eos_tokens)
    for _ in range(PROBE_TOKENS):
        if matcher.is_stopped():
            break
        token = _first_allowed(matcher.compute_bitmask(), eos, tokenizer.vocab_size)
        if matcher.is_error() or token is None:
            break
        matcher.consume_token(token)
    if matcher.is_error():
        raise GuidedError(f"{what} fails once it runs: {shorten(_reason(matcher))}")


def _reason(matcher: llguidance.LLMatcher) -> str:
    # Without verbose errors llguidance appends a marker that means nothing to a client.
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _first_allowed(mask: bytes, eos: set[int], vocab_size: int) -> int | None:
    for index, byte in enumerate(mask):  # 6 KB for 49k tokens: a short walk
        while byte:
            bit = (byte & -byte).bit_length() - 1
            token = index * 8 + bit
            if token >= vocab_size:
                return None
            if token not in eos:
                return token
            byte &= byte - 1
    return None


def schema_patterns(guided: sampling_pb2.Guided, limit: int = 64) -> list[str]:
    """The regexes a JSON-schema spec holds (``pattern`` values, ``patternProperties``
    keys), at most ``limit``: llguidance builds each lazily, when generation first enters
    its string, so ``probe`` on the whole schema cannot meet an over-large one; probing
    each as a regex can. Walked without recursion (a schema may nest deeply)."""
    if guided.WhichOneof("kind") != "json_schema":
        return []
    try:
        stack, found = [json.loads(guided.json_schema)], []
    except (ValueError, RecursionError):
        return []  # grammar_of refuses it
    while stack and len(found) < limit:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                found.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                found.extend(k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend(node.values())
    return found[:limit]
