"""Tool-call parsers: a model's free text to OpenAI tool calls (``tool_choice: "auto"``), a
registry keyed by ``--tool-call-parser`` as vLLM's flag: ``hermes`` (the default:
``<tool_call>`` blocks with the text around them kept as content, or a bare JSON call,
which small models given the fallback prompt often write) and ``json`` / ``llama3_json``
(the whole answer is one call or a list of them).

A call counts only when it names one of the request's tools and its arguments are a JSON
object (or its text); anything else stays content, so no text is lost. A parser is a
stream: ``feed`` answers what can be said so far, ``finish`` the rest (a non-streamed answer
is one feed and a finish, so both parse alike); text that may still become a call is held
back. An ``incremental`` stream says what it found as ``pieces``: ``("call", Call)`` for a
whole call, and for a Hermes block that opens ``{"name": "<a tool>", "arguments": {`` a
``("name", name)`` at once, then ``("arguments", text)`` pieces whose concatenation is the
arguments as written (the block's last ``}`` held until the tag shows it is not theirs)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# A call block's start, up to its arguments object: where a stream can name the call.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*'
                     r'"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass
class Call:
    name: str
    arguments: str  # JSON object text


@dataclass
class Events:
    """What one feed or finish found: content to pass on, then complete calls."""

    content: str = ""
    calls: list[Call] = field(default_factory=list)
    pieces: list[tuple[str, object]] = field(default_factory=list)  # incremental only


def call_of(value: object, names: Collection[str]) -> Call | None:
    """A decoded JSON value as a call of one of ``names``, or None."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(name, str) or name not in names:
        return None
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def bare_calls(text: str, names: Collection[str]) -> list[Call] | None:
    """``text`` as one JSON call or a non-empty list of them, else None."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    values = value if isinstance(value, list) and value else [value]
    calls = [call_of(v, names) for v in values]
    return None if None in calls else calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class JsonStream:
    """The ``json`` parser: an answer opening with ``{`` or ``[`` is held to the end
    and becomes calls if it is one; any other answer streams as content at once."""

    tagged = False

    def __init__(self, names: Collection[str], incremental: bool = False):
        self.names = frozenset(names)
        self.incremental = incremental
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "json": held, "text": passed on

    def feed(self, text: str) -> Events:
        self._buffer += text
        if self._mode is None:
            stripped = self._buffer.lstrip()
            if not stripped:
                return Events()
            self._mode = "json" if stripped[0] in "{[" else "text"
        if self._mode == "json":
            return Events()
        return self._scan(final=False)

    def finish(self) -> Events:
        if self._mode == "json":
            calls = bare_calls(self._buffer, self.names)
            if calls is not None:
                self._buffer = ""
                out = Events()
                for call in calls:
                    self._emit(out, call)
                return out
        return self._scan(final=True)

    def _emit(self, out: Events, call: Call) -> None:
        if self.incremental:
            out.pieces.append(("call", call))
        else:
            out.calls.append(call)

    def _scan(self, final: bool) -> Events:
        out = Events(content=self._buffer)
        self._buffer = ""
        return out


class HermesStream(JsonStream):
    """The ``hermes`` parser: ``<tool_call>`` blocks anywhere, or a bare JSON answer."""

    tagged = True

    def __init__(self, names: Collection[str], incremental: bool = False):
        super().__init__(names, incremental)
        self._in_call = False
        self._open: int | None = None  # where a named block's arguments begin
        self._sent = 0  # characters of them sent

    def _scan(self, final: bool) -> Events:
        out = Events()
        while True:
            if not self._in_call:
                at = self._buffer.find(OPEN_TAG)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buffer, OPEN_TAG)
                    out.content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(OPEN_TAG):]
                self._in_call = True
                continue
            at = self._buffer.find(CLOSE_TAG)
            if self.incremental and self._stream_arguments(out, at, final):
                return out
            if at < 0 and not final:
                return out
            # At the end an unclosed block still counts: models often stop on EOS
            # where the closing tag should be.
            body = self._buffer if at < 0 else self._buffer[:at]
            if self._open is None:  # (a streamed call's pieces are all sent by now)
                call = bare_calls(body.strip(), self.names)
                if call is not None and len(call) == 1:
                    self._emit(out, call[0])
                else:
                    out.content += OPEN_TAG + body + (CLOSE_TAG if at >= 0 else "")
            self._open = None
            self._buffer = "" if at < 0 else self._buffer[at + len(CLOSE_TAG):]
            self._in_call = False
            if at < 0:
                return out


    def _stream_arguments(self, out: Events, at: int, final: bool) -> bool:
        """Names an open block once its header is in, and sends what is surely its
        arguments; True while the block goes on (nothing more to do this feed)."""
        if self._open is None:
            header = _HEADER.match(self._buffer)
            if header is None or header.group(1) not in self.names:
                return False
            self._open, self._sent = header.end(), 0
            out.pieces.append(("name", header.group(1)))
        ended = at >= 0 or final
        region = self._buffer[self._open:at if at >= 0 else len(self._buffer)]
        if not ended:
            region = region[:len(region) - _partial_suffix(region, CLOSE_TAG)]
        # The last "}" may close the block rather than the arguments: held back.
        region = region.rstrip()
        region = (region[:-1] if region.endswith("}") else region).rstrip()
        if len(region) > self._sent:
            out.pieces.append(("arguments", region[self._sent:]))
            self._sent = len(region)
        return not ended


PARSERS: dict[str, Callable[..., JsonStream]] = {
    "hermes": HermesStream,
    "json": JsonStream,
    "llama3_json": JsonStream,
}
DEFAULT_PARSER = "hermes"


def parse_all(text: str, names: Collection[str], parser: str = DEFAULT_PARSER) -> Events:
    """The whole of a non-streamed answer at once."""
    stream = PARSERS[parser](names)
    first, rest = stream.feed(text), stream.finish()
    return Events(first.content + rest.content, first.calls + rest.calls)
