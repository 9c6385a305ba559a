"""Incremental detokenization of one output stream.

Decoding token by token is wrong twice over: a multi-byte UTF-8 character can
be split across tokens (byte-level BPE), and some decoders change a token's
text depending on what precedes it (SentencePiece drops the leading space of
the first token it decodes). The technique used by vLLM and TGI fixes both by
decoding two overlapping windows of recent ids and emitting their difference:

    ids:   ... | prefix_offset ........ read_offset ........ len(ids)
                 └─ prefix_text = decode(ids[prefix:read]) ┘
                 └──────── new_text = decode(ids[prefix:]) ─────────┘
    delta = new_text[len(prefix_text):]

While `new_text` ends in U+FFFD the last character is (probably) incomplete,
so nothing is emitted and the offsets stay put; the next token may complete it.
`flush()` emits whatever is held back once the stream has ended, so the
concatenated deltas always equal `decode(all ids)`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; one instance per stream.

    Invariant: the text emitted so far equals `decode(ids[:read_offset])` with
    the windowing above, and `prefix_offset <= read_offset <= len(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    @property
    def token_ids(self) -> list[int]:
        return list(self._ids)

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends ids and returns the newly decodable text (possibly "")."""
        self._ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        """Returns any held-back text; call once when the stream has ended."""
        return self._delta(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    def _delta(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if not final and (
            len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)
        ):
            # Either nothing visible yet (special tokens skipped) or the tail may
            # be half of a character: wait for more ids.
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]
