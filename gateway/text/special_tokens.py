"""Client text is tokenized as text: a chat's control tokens come from its template only
(docs/security.md: why, what is covered, and what is not).

Only when some client string holds a special token's string: each occurrence becomes a
sentinel ``<nonce>_<n>_`` (a per-request random hex nonce, which `tojson`, `trim` and
concatenation leave alone and no client can predict); the template renders; the sentinels
are put back, noting where each lies; the prompt is encoded in one call as before, so every
other id is unchanged; and a special token lying on client text is replaced by the ids of
its text, encoded by a second backend with special-token matching off for good (encoding
runs on worker threads: no flag is toggled on a shared instance)."""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import tokenizers

from gateway.text.chat_template import ChatTemplateError

_Containers = (Mapping, list, tuple)
_NONCE_BYTES = 12
# Any request's sentinel (a nonce of its own is compiled per request otherwise).
_SENTINEL = re.compile(rf"([0-9a-f]{{{2 * _NONCE_BYTES}}})_(\d+)_")


def _strings(value: Any) -> list[str]:
    """Every string in nested dicts (keys too) and lists, iteratively: arguments may nest
    deeper than Python recursion goes."""
    found: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, dict):  # before the slower Mapping check: nearly all are
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, Mapping):
            stack.extend(item)
            stack.extend(item.values())
    return found


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of nested dicts and lists with `change` applied to every string (keys too),
    iteratively; dict order is kept."""
    if not isinstance(value, _Containers):
        return change(value) if isinstance(value, str) else value
    holder: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(value, holder, 0)]
    while stack:
        source, target, slot = stack.pop()
        if isinstance(source, Mapping):
            made: Any = {}
            items = [(change(k) if isinstance(k, str) else k, v) for k, v in source.items()]
        else:
            made = [None] * len(source)
            items = list(enumerate(source))
        target[slot] = made
        for key, child in items:
            if isinstance(child, _Containers):
                made[key] = None  # holds the key's place in dict order
                stack.append((child, made, key))
            else:
                made[key] = change(child) if isinstance(child, str) else child
    return holder[0]


class Masking:
    """One request's sentinels: which special-token text each one stands for."""

    def __init__(self, pattern: re.Pattern[str]):
        self._pattern = pattern
        self.nonce = secrets.token_hex(_NONCE_BYTES)
        self.originals: list[str] = []

    def apply(self, value: Any) -> Any:
        """`value` with each special token's string in its strings made a sentinel."""
        return _map_strings(value, lambda text: self._pattern.sub(self._stand_in, text))

    def _stand_in(self, match: re.Match[str]) -> str:
        self.originals.append(match.group())
        return f"{self.nonce}_{len(self.originals) - 1}_"

    def restore(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The prompt with each sentinel put back, and the (start, end) of each one."""
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        length = last = 0
        for match in _SENTINEL.finditer(rendered):
            if match.group(1) != self.nonce:
                continue  # hex that looks like a sentinel, but not this request's
            index = int(match.group(2))
            if index >= len(self.originals):
                raise ChatTemplateError("the chat template rewrote message text that holds "
                                        "special-token strings; remove them and retry")
            before = rendered[last:match.start()]
            parts += (before, self.originals[index])
            length += len(before)
            spans.append((length, length + len(self.originals[index])))
            length += len(self.originals[index])
            last = match.end()
        parts.append(rendered[last:])
        text = "".join(parts)
        if self.nonce[:8] in text.lower():
            # A filter (upper, truncate, ...) changed a sentinel: what it stood for is
            # unknown here, so refuse rather than guess.
            raise ChatTemplateError("the chat template rewrote message text that holds "
                                    "special-token strings; remove them and retry")
        return text, spans


class SpecialTokenEscape:
    """Finds special-token strings in client text and encodes a rendered chat so that only
    the template's become special tokens."""

    def __init__(self, backend: tokenizers.Tokenizer):
        self._backend = backend
        added = backend.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        strings = sorted({added[i].content for i in self.special_ids}, key=len, reverse=True)
        # Longest first: at one position the longest string wins, as the tokenizer's
        # own leftmost-longest matching does. None: no special tokens, nothing to escape.
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def found_in(self, *values: Any) -> bool:
        """Whether any string in `values` (messages, tools) holds a special token's text."""
        if self._pattern is None:
            return False
        # One search over the strings joined (half the time of one each); a match across
        # a join only takes the careful path needlessly, which encodes as the plain one.
        return self._pattern.search("\x00".join(_strings(values))) is not None

    def masking(self) -> Masking:
        assert self._pattern is not None, "masking() follows a found_in() that was True"
        return Masking(self._pattern)

    @functools.cached_property
    def _text_backend(self) -> tokenizers.Tokenizer:
        # Built on first use; two threads racing here build equivalent ones.
        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.encode_special_tokens = True
        return backend

    def encode(self, rendered: str, masking: Masking) -> list[int]:
        """The ids of a prompt rendered from `masking.apply`'d input."""
        text, spans = masking.restore(rendered)
        encoding = self._backend.encode(text, add_special_tokens=False)
        ids: list[int] = []
        next_span = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            while next_span < len(spans) and spans[next_span][1] <= start:
                next_span += 1
            on_client_text = next_span < len(spans) and spans[next_span][0] < end
            if token_id in self.special_ids and on_client_text:
                ids += self.as_text(text[start:end])
            else:
                ids.append(token_id)
        return ids

    def as_text(self, text: str) -> list[int]:
        """The ids of `text` with special-token matching off (none among them)."""
        ids = self._text_backend.encode(text, add_special_tokens=False).ids
        if self.special_ids.intersection(ids):
            # A vocabulary whose merges rebuild the token from its pieces: the text
            # cannot be sent as text, so it is refused rather than let through.
            raise ChatTemplateError(f"message text holds {text!r}, which this model's "
                                    "tokenizer can only encode as a control token; remove it")
        return ids
