"""Incremental detokenization of one output stream.

Token-by-token decoding splits multi-byte characters (byte-level BPE) and loses
context-dependent text (SentencePiece's leading space). As vLLM and TGI do, decode two
overlapping windows and emit their difference:

    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text = decode(ids[prefix_offset:]);  delta = new_text[len(prefix_text):]

While `new_text` ends in U+FFFD nothing is emitted; `flush()` emits what is held, so the
deltas always join to `decode(all ids)`. Linear in the output: skipped special tokens never
enter the window, and past `MAX_HELD_TOKENS` held ids (a real character completes long
before) the window moves to the last settled position, one whose text later ids only
extend (what a run of invalid bytes looks like), keeping the output exact."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; one instance per stream.
    Invariant: the text emitted equals `decode(ids[:read_offset])`, `prefix_offset <=
    read_offset <= len(ids)`, and `len(ids) - read_offset <= MAX_HELD_TOKENS` after `add`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []  # the ids that reach the text (skipped ones are left out)
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends ids and returns the newly decodable text (possibly "")."""
        self._ids.extend(t for t in token_ids if t not in self._skipped)
        return self._delta(final=False)

    def flush(self) -> str:
        """Returns any held-back text; call once when the stream has ended."""
        return self._delta(final=True)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(
            self._ids[start:end], skip_special_tokens=self._skip_special_tokens
        )

    @staticmethod
    def _held_back(prefix_text: str, new_text: str) -> bool:
        # Nothing visible yet, or the tail may be half a character: wait for more ids.
        return len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR)

    def _delta(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        end = len(self._ids)
        if not final and self._held_back(prefix_text, new_text):
            if end - self._read_offset <= MAX_HELD_TOKENS:
                return ""
            end, new_text = self._settled_cut(new_text)
        self._prefix_offset = self._read_offset
        self._read_offset = end
        return new_text[len(prefix_text) :]

    def _settled_cut(self, new_text: str) -> tuple[int, str]:
        """The last held position whose text the ids after it only extend, and that
        text (at most MAX_HELD_TOKENS decodes); all of it if there is none."""
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            text = self._decode(self._prefix_offset, end)
            if len(new_text) > len(text) and new_text.startswith(text):
                return end, text
        return len(self._ids), new_text  # nothing settles (ids without bytes): emit as is
