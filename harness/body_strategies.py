"""Hypothesis strategies for OpenAI HTTP bodies, built from gateway/api/openai_schema.py
(docs/reliability.md, "Schema fuzzing", says what is drawn and why).

Every field is drawn extreme, wrong-typed or valid-ish (``field``), in bodies now and then
oddly encoded or padded around the body cap. Inputs are drawn per field (``field_names``,
which the fuzzer sweeps): the valid body with that field drawn and up to two more
valid-ish; plus mixes of up to six valid-ish fields and, for chat, coherent tool requests.
JSON text no ``json.dumps`` writes (``1e999``, ``NaN``, lone surrogates, deep nesting) is
spliced in where a string ``"\\x00RAW<k>\\x00"`` stands (``RAW``, ``splice``)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from gateway.api import openai_schema as schema
from gateway.api.openai_schema import Shape, Text
from harness import fuzz_values as values

RAW = {  # JSON text no json.dumps writes: spliced in where a string "\x00RAW<k>\x00" stands
    0: "1e999", 1: "-1e999", 2: "1" + "0" * 400, 3: '"\\ud800"', 4: '"\\udfff x"',
    5: "[" * 100_000 + "]" * 100_000, 6: '{"a":' * 50_000 + "1" + "}" * 50_000,
    7: "NaN", 8: "Infinity", 9: "18446744073709551616", 10: "-9223372036854775809",
    11: "4294967296", 12: "1.5", 13: "true",
}
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2, 6),
                   st.sampled_from([2**31, 2**32, 2**63, 2**64, -(2**63), 10**30]),
                   st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                   st.sampled_from([f"\x00RAW{k}\x00" for k in RAW]))
ANY_JSON = st.recursive(SCALAR, lambda kids: st.lists(kids, max_size=5)
                        | st.dictionaries(st.text(max_size=12), kids, max_size=5),
                        max_leaves=25)
# null or unset means "the default length" (up to the context limit for chat): a valid
# request that would take minutes here, so a length is always set, and small.
LENGTH_KEYS = ("max_tokens", "max_completion_tokens")
SHORT, PAST_CONTEXT = 8, 2**20


def splice(body: object, ascii_only: bool = True) -> bytes:
    text = json.dumps(body, allow_nan=True, ensure_ascii=ascii_only)
    for k, raw in RAW.items():
        text = text.replace(f'"\\u0000RAW{k}\\u0000"', raw)
    return text.encode("utf-8", "surrogatepass")


def _deep(depth: int, leaf, wrap) -> object:
    for _ in range(depth):
        leaf = wrap(leaf)
    return leaf


def valid(shape: Shape, depth: int = 0) -> st.SearchStrategy:
    """A value of ``shape``, mostly one the gateway accepts; nested fields by ``field``."""
    kind = shape.kind
    if kind == "string":
        return st.sampled_from(shape.enum) if shape.enum else values.texts(shape.text)
    if kind == "integer":
        low = -(2**63) if shape.low is None else int(shape.low)
        high = values.VOCAB - 1 if shape.high is None else int(shape.high)
        return values.integers(low, high)
    if kind == "number":
        edges = [v for v in values.FLOAT_EDGES if shape.low <= v <= shape.high]
        return st.floats(shape.low, shape.high) | st.sampled_from(edges)
    if kind == "boolean":
        return st.booleans()
    if kind == "array":
        return st.lists(field(shape.items, depth + 1), max_size=4)
    if kind == "object" and shape.text == Text.JSON_SCHEMA:
        return values.schemas()
    if kind == "object":
        return st.fixed_dictionaries({}, optional={k: field(s, depth + 1)
                                                   for k, s in shape.fields})
    if kind == "map":
        return st.dictionaries(valid(shape.keys), field(shape.values, depth + 1), max_size=4)
    if kind == "any_of":
        return st.one_of([valid(o, depth) for o in shape.options])
    return SCALAR  # "any": refused whatever it is


def extreme(shape: Shape) -> st.SearchStrategy:
    """Edges and sizes: just past the range, the widths' limits, literals no double
    holds, 900 KB strings, lists and maps past their caps, nesting past the body's
    depth limit (and just within it)."""
    raw = [f"\x00RAW{k}\x00" for k in RAW]
    if shape.kind == "integer":
        low = -(2**63) if shape.low is None else int(shape.low)
        high = values.VOCAB if shape.high is None else int(shape.high)
        return values.int_extremes(low, high) | st.sampled_from(raw)
    if shape.kind == "number":
        past = [shape.low - 1e-6, shape.high + 1e-6, shape.low - 1, shape.high + 1]
        return st.sampled_from(past + values.FLOAT_EDGES) | st.sampled_from(raw)
    if shape.kind == "string":
        return st.sampled_from(["\x00RAW3\x00", "x" * values.HUGE, "\x00RAW4\x00",
                                "é" * (values.HUGE // 2), "\U0001f600" * 1000])
    if shape.kind in ("array", "map", "object"):
        return _extreme_containers(shape)
    if shape.kind == "any_of":
        return st.one_of([extreme(o) for o in shape.options])
    return st.sampled_from(raw)


def _extreme_containers(shape: Shape) -> st.SearchStrategy:
    cap = shape.max_items or 16
    if shape.kind == "array":
        item = valid(shape.items, 9).map(lambda v: v[:16] if isinstance(v, str) else v)
        long = st.tuples(item, st.sampled_from([cap + 1, 1025, 10_000]))
        sized = long.map(lambda t: [t[0]] * t[1])
    else:
        sized = st.sampled_from([cap + 1, 10_000]).map(
            lambda n: {str(i): 1.0 for i in range(n)})
    deep = st.sampled_from([28, 31, 33, 1000]).map(
        lambda n: _deep(n, {}, lambda inner: {"a": inner}) if shape.kind != "array"
        else _deep(n, [], lambda inner: [inner]))
    return st.one_of(sized, deep)


def field(shape: Shape, depth: int = 0) -> st.SearchStrategy:
    """Extreme, wrong-typed (any JSON) or valid-ish (nested fields deeper are valid more
    often, so that a body reaches its inner checks). Extreme comes first: hypothesis
    draws the first alternative for its first input, so a run of one input per field
    probes each field at its edge."""
    if depth > 4:
        return valid(shape, depth) if shape.kind not in ("array", "object", "map") \
            else st.just([] if shape.kind == "array" else {})
    one = valid(shape, depth)
    return st.one_of([extreme(shape), ANY_JSON] + [one] * (3 if depth <= 1 else 8))


def bound_lengths(body: dict, path: str) -> dict:
    """Keeps a generation short: small or far past any context, never unset in chat."""
    for key in LENGTH_KEYS:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and SHORT < v < PAST_CONTEXT:
            body[key] = 4
    if path == "/v1/chat/completions" and all(body.get(k) is None for k in LENGTH_KEYS):
        body["max_tokens"] = 4
    return body


@st.composite
def _with_field(draw, path: str, key: str) -> dict:
    """The endpoint's valid body with ``key`` drawn any way and up to two more fields
    drawn valid-ish (the probe's neighbours, which should mostly pass)."""
    fields = schema.ENDPOINTS[path]
    body = json.loads(json.dumps(schema.VALID[path]))
    body[key] = draw(field(fields[key], 1))
    neighbours = sorted(k for k, s in fields.items() if s.kind != "any" and k != key)
    for name in draw(st.lists(st.sampled_from(neighbours), max_size=2, unique=True)):
        body[name] = draw(valid(fields[name], 1))
    return body


@st.composite
def _valid_fields(draw, path: str) -> dict:
    """Up to six fields (of those the endpoint supports), each a valid-ish value."""
    fields = {k: s for k, s in schema.ENDPOINTS[path].items() if s.kind != "any"}
    body = json.loads(json.dumps(schema.VALID[path]))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(valid(fields[name], 1))
    return body


@st.composite
def tool_requests(draw) -> dict:
    """Chat with 1-3 tools whose parameters are drawn schemas, and a tool_choice that
    is "auto", "none", "required" or names one of them."""
    names = draw(st.lists(st.sampled_from(values.TOOL_NAMES), min_size=1, max_size=3))
    tools = [{"type": "function", "function": {"name": n, "parameters": draw(
        st.one_of(values.schemas(), values.schemas(), ANY_JSON))}} for n in names]
    choice = draw(st.sampled_from(["auto", "none", "required", "named"]))
    if choice == "named":
        choice = {"type": "function", "function": {"name": draw(st.sampled_from(names))}}
    return {**schema.VALID["/v1/chat/completions"], "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": draw(st.booleans())}


VALID_FIELDS, TOOL_REQUESTS = "(valid fields)", "(tools)"  # inputs of no one field


def field_names(path: str) -> list[str]:
    """What the fuzzer sweeps for ``path``: each key of its schema, then the mixes."""
    mixes = [VALID_FIELDS] + ([TOOL_REQUESTS] if path == "/v1/chat/completions" else [])
    return sorted(schema.ENDPOINTS[path]) + mixes


def bodies(path: str, key: str) -> st.SearchStrategy[dict]:
    """Bodies (JSON values, before encoding) for one endpoint that probe ``key`` (one of
    ``field_names``)."""
    if key == VALID_FIELDS:
        drawn = _valid_fields(path)
    elif key == TOOL_REQUESTS:
        drawn = tool_requests()
    else:
        drawn = _with_field(path, key)
    return drawn.map(lambda body: bound_lengths(body, path))

Headers = list[tuple[bytes, bytes]]
CHARSETS = [b"application/json; charset=utf-8", b"application/json; charset=UTF-8",
            b"application/json; charset=latin-1", b"application/json;charset=", b"text/plain"]


def encode(body: dict, how: str) -> tuple[bytes, Headers]:
    """``body`` on the wire, ``how`` one of ENCODINGS (bytes, extra headers)."""
    if how == "utf8":
        return splice(body, ascii_only=False), []
    data = splice(body)
    if how == "bom":
        return b"\xef\xbb\xbf" + data, []
    if how == "utf16":
        return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass"), \
            [(b"Content-Type", b"application/json; charset=utf-16")]
    if how == "invalid_utf8":  # an overlong "/" and a lone continuation byte in a string
        return data.replace(b'": "', b'": "\xc0\xaf\x80', 1), []
    if how == "duplicate_key" and data.startswith(b"{") and body:
        key = json.dumps(sorted(body)[0]).encode()
        return b"{" + key + b": {\"a\": [1]}, " + data[1:], []
    if how == "trailing":
        return data + b" \x00{}", []
    return data, []


# Mostly plain JSON, so that most inputs reach the field readers.
ENCODINGS = ("escaped",) * 12 + ("utf8",) * 6 + ("bom", "utf16", "invalid_utf8",
                                                 "duplicate_key", "trailing", "padded")


def _padded(body: dict, path: str, cap: int, draw) -> bytes:
    """The body with one string field grown so the whole is ``cap`` +- a few bytes."""
    key = draw(st.sampled_from(["user", "model", *[k for k in ("prompt",)
                                                    if k in schema.ENDPOINTS[path]]]))
    body = {**body, key: ""}
    room = cap + draw(st.sampled_from([-1, 0, 1, 64])) - len(splice(body))
    return splice({**body, key: "x" * max(0, room)})


@st.composite
def wire_requests(draw, path: str, key: str, cap: int) -> tuple[bytes, Headers]:
    """(body bytes, headers) for ``path`` probing ``key``; ``cap``: the body limit."""
    body = draw(bodies(path, key))
    how = draw(st.sampled_from(ENCODINGS))
    data, headers = (_padded(body, path, cap, draw), []) if how == "padded" \
        else encode(body, how)
    if not headers and draw(st.integers(0, 9)) == 0:
        headers = [(b"Content-Type", draw(st.sampled_from(CHARSETS)))]
    return data, headers
