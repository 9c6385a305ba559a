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

Linear in the output in every case. Holding back re-decodes the held ids on
every token, so an unbounded hold costs O(hold^2); two things bound it:

* skipped special tokens never enter the window (decode would drop them
  anyway), so a run of them costs nothing;
* after `MAX_HELD_TOKENS` held ids (a UTF-8 character is at most 4 bytes, so
  a real one completes long before) the window moves to the last *settled*
  held position: the longest held prefix whose text the later ids only
  extend (every id after it is decoded already, and the text up to it did not
  change, so a later id cannot complete a character that ends there). That
  is what a run of invalid bytes (stray continuation bytes, lead bytes that
  never complete) looks like, and it keeps the output exact. Each step then
  decodes O(MAX_HELD_TOKENS + the previous emission) ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"
MAX_HELD_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas; one instance per stream.

    Invariant: the text emitted so far equals `decode(ids[:read_offset])` with
    the windowing above, `prefix_offset <= read_offset <= len(ids)`, and
    `len(ids) - read_offset <= MAX_HELD_TOKENS` after every `add`.
    """

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
        # Either nothing visible yet or the tail may be half of a character:
        # wait for more ids.
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
