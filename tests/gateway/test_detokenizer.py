"""Incremental detokenization: deltas concatenate to the full decode, never split a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.text.detokenizer import IncrementalDetokenizer

VOCAB_SIZE = 49152
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _stream(tokenizer, ids, chunk_sizes, skip_special_tokens=True):
    """Feeds ids in chunks (sizes cycled); returns the deltas including the flush."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas, pos, i = [], 0, 0
    while pos < len(ids):
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.add(ids[pos : pos + size]))
        pos, i = pos + size, i + 1
    deltas.append(detok.flush())
    return deltas


chunkings = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=8)
# The vocabulary lacks the byte tokens of a few control characters and of lead bytes
# F1/F2 (code points U+40000..U+BFFFF), so those cannot round-trip; everything else must.
natural_text = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
        st.sampled_from(list("日本語中文한국어éèàüñç😀👍🏽👨‍👩‍👧🇫🇷 \n\t")),
    ),
    max_size=60,
)


@SETTINGS
@given(
    ids=st.lists(st.integers(min_value=0, max_value=VOCAB_SIZE - 1), max_size=40), chunks=chunkings
)
def test_random_ids_concatenate_to_full_decode(tokenizer, ids, chunks):
    deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids)


@SETTINGS
@given(text=natural_text, chunks=chunkings)
def test_real_text_round_trips_without_split_characters(tokenizer, text, chunks):
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)
    deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == full
    # When the full decode is clean, no delta may show half a character.
    if "\ufffd" not in full:
        assert not any("\ufffd" in delta for delta in deltas)
    if not any(0x40000 <= ord(c) < 0xC0000 for c in text):
        assert full == text


@SETTINGS
@given(raw=st.lists(st.integers(min_value=0, max_value=255), max_size=24), chunks=chunkings)
def test_arbitrary_bytes_concatenate_to_full_decode(tokenizer, raw, chunks):
    """Byte tokens make every UTF-8 edge case: truncated, overlong, stray continuations."""
    ids = [tid for b in raw for tid in _byte_token(tokenizer, b)]
    deltas = _stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("text", ["😀", "日本語", "naïve", "👨‍👩‍👧 family"])
def test_multibyte_character_is_held_until_complete(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    emitted = ""
    for token_id in ids:
        emitted += detok.add([token_id])
        assert "\ufffd" not in emitted
        assert text.startswith(emitted)
    assert emitted + detok.flush() == text


def test_byte_tokens_of_one_emoji_emit_nothing_until_the_last(tokenizer):
    # Byte-level BPE has a token per byte; feed 😀 (F0 9F 98 80) one byte token at a time.
    ids = tokenizer.encode("😀")
    singles = [tid for b in "😀".encode() for tid in _byte_token(tokenizer, b)]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([tid]) for tid in singles]
    assert deltas[:-1] == ["", "", ""] and deltas[-1] == "😀"
    assert tokenizer.decode(ids) == "😀"


def _byte_token(tokenizer, byte: int) -> list[int]:
    """The id of the byte-level token for one raw byte (GPT-2 byte-to-unicode map)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    token_id = tokenizer.token_to_id(mapping[byte])
    return [] if token_id is None else [token_id]  # a few bytes have no token


def test_special_tokens_are_skipped_by_default(tokenizer):
    ids = [1, *tokenizer.encode("Hello"), 2]
    assert "".join(_stream(tokenizer, ids, [1])) == "Hello"
    assert "".join(_stream(tokenizer, ids, [1], skip_special_tokens=False)) == (
        "<|im_start|>Hello<|im_end|>"
    )


def test_flush_on_empty_stream_is_empty(tokenizer):
    assert IncrementalDetokenizer(tokenizer).flush() == ""


class _CountingTokenizer:
    """The real tokenizer, counting how many ids `decode` is asked to decode."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.special_token_ids = tokenizer.special_token_ids
        self.ids_decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.ids_decoded += len(ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _ids_decoded(tokenizer, ids, skip_special_tokens=True) -> tuple[int, str]:
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, skip_special_tokens=skip_special_tokens)
    text = "".join(detok.add([token_id]) for token_id in ids) + detok.flush()
    return counting.ids_decoded, text


def _pathological_streams(tokenizer):
    """Streams whose text never settles: the quadratic cases before the hold was bounded."""
    continuation = _byte_token(tokenizer, 0x80)  # a stray continuation byte: always U+FFFD
    lead = _byte_token(tokenizer, 0xF0)  # lead bytes that never complete a character
    emoji_head = [tid for b in b"\xf0\x9f\x98" for tid in _byte_token(tokenizer, b)]
    return {
        "continuation bytes": (continuation, True),
        "lead bytes": (lead, True),
        "truncated emojis": (emoji_head, True),
        "skipped special tokens": ([1, 2, 0], True),
        "special tokens kept": ([1, 2, 0], False),
        "special tokens around a half character": ([*lead, 1, 2], True),
    }


@pytest.mark.parametrize("case", ["continuation bytes", "lead bytes", "truncated emojis",
                                  "skipped special tokens", "special tokens kept",
                                  "special tokens around a half character"])
def test_decoding_work_is_linear_in_the_output(tokenizer, case):
    """Counted, not timed: ids handed to decode per generated token stay bounded."""
    unit, skip = _pathological_streams(tokenizer)[case]
    per_token = []
    for repeats in (300, 1200):
        ids = unit * repeats
        decoded, text = _ids_decoded(tokenizer, ids, skip)
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)
        per_token.append(decoded / len(ids))
    # Quadratic work would be ~len(ids)/2 ids per token (hundreds here) and grow 4x.
    assert max(per_token) < 60, per_token
    assert per_token[1] < 1.25 * per_token[0] + 1, per_token


def test_normal_text_decodes_a_few_ids_per_token(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. 日本語のテキスト 😀👍🏽 " * 40
    ids = tokenizer.encode(text)
    decoded, out = _ids_decoded(tokenizer, ids)
    assert out == tokenizer.decode(ids)
    assert decoded / len(ids) < 8
