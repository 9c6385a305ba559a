"""HTTP bodies to JSON: the depth pre-scan agrees with the parser, and every way a body
can be wrong is a RequestError naming what to fix (never a RecursionError or a 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.json_body import MAX_JSON_DEPTH, check_depth, decode_json
from gateway.validation import RequestError

_leaves = st.none() | st.booleans() | st.integers() | st.text(alphabet="ab[]{}\"\\ \u00e9")
_json_values = st.recursive(
    _leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(alphabet="k[]{}\"\\", max_size=3), inner, max_size=3), max_leaves=60)


def _depth(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@settings(max_examples=300, deadline=None)
@given(value=_json_values, limit=st.integers(min_value=1, max_value=6))
def test_the_depth_scan_agrees_with_the_parsed_depth(value, limit):
    """Brackets inside strings (escaped quotes too) do not count."""
    text = json.dumps(value)
    if _depth(value) > limit:
        with pytest.raises(RequestError, match=f"deeper than {limit} levels"):
            check_depth(text, limit)
    else:
        check_depth(text, limit)


@pytest.mark.parametrize("raw,words", [
    (b"[" * 200_000, "deeper than 32 levels"),
    (b'{"a":' * 40 + b"1" + b"}" * 40, "deeper than 32 levels"),
    (b'"' + b'\\"' * 100_000, "not valid JSON"),  # one unterminated string: no quadratic scan
    (b"[" + b"[]" * 40, "not valid JSON"),  # unbalanced, but shallow
    (b"]" + b"[" * 100_000, "not valid JSON"),  # the parser stops at the first "]"
    (b'{"x": NaN}', "contains NaN"),
    (b'{"x": -Infinity}', "contains -Infinity"),
    (b'{"x": "\\ud800"}', "x contains a lone UTF-16 surrogate (U+D800)"),
    (b'{"a": [{"b": "\\udfff"}]}', "a[0].b contains a lone UTF-16 surrogate"),
    (b'{"\\ud800": 1}', "contains a lone UTF-16 surrogate"),
    (b'{"x": "\xff"}', "not valid UTF-8 (byte 0xFF at offset 7)"),
    (b"", "not valid JSON"),
])
def test_bad_bodies_are_request_errors(raw, words):
    with pytest.raises(RequestError) as refused:
        decode_json(raw)
    assert words in refused.value.message


def test_good_bodies_decode_like_json_loads():
    raw = json.dumps({"a": ["\ud83d\ude00", 1.5e300, -0.0, 10**30, {"[": "]"}]}).encode()
    assert decode_json(raw, "UTF-8") == json.loads(raw)
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert decode_json(nested.encode()) == json.loads(nested)
    assert decode_json(b"[1e400]") == [float("inf")]  # the field readers refuse it by name


@pytest.mark.parametrize("charset", ["bogus", "latin-1", "utf-16"])
def test_charsets_other_than_utf8_are_refused(charset):
    with pytest.raises(RequestError, match=f"charset '{charset}' is not supported"):
        decode_json(b"{}", charset)


@pytest.mark.parametrize("openers", ["[" * 17 + "{" * 16, "{" * 16 + "[" * 17, "[{" * 17])
def test_the_opener_count_spans_both_bracket_kinds(openers):
    """The cheap pre-check (at most `limit` openers cannot nest deeper) counts `[` and
    `{` together: 33 openers, however mixed, go on to the real depth scan."""
    body = openers + "".join({"[": "]", "{": "}"}[c] for c in reversed(openers))
    with pytest.raises(RequestError, match="deeper than 32 levels"):
        check_depth(body)
    check_depth(body, limit=len(openers))


def test_a_large_body_is_checked_as_a_small_one():
    """A body near the 4 MiB limit, its bulk one long string: the fast paths (no
    backslash, few brackets) skip no check that applies."""
    bulk = "u" * (4 * 1024 * 1024 - 4096)
    assert decode_json(json.dumps({"user": bulk, "n": [1]}).encode()) == {"user": bulk, "n": [1]}
    with pytest.raises(RequestError, match="user contains a lone UTF-16 surrogate"):
        decode_json(b'{"user": "' + bulk.encode() + b'\\ud800"}')
    with pytest.raises(RequestError, match="deeper than 32 levels"):
        decode_json(b'{"user": "' + bulk.encode() + b'", "x": ' + b"[" * 40 + b"]" * 40 + b"}")
