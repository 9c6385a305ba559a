"""Incremental detokenization: deltas concatenate to the full decode, never split a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import IncrementalDetokenizer

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
