"""Function calling, response side: a chat choice's text as OpenAI's ``tool_calls``.

One ``ToolAnswers`` per request with tools and a tool_choice other than "none" (what each
choice does: docs/usage.md). "auto" parses with the request's parser, keeping content
outside the calls (``null`` in a whole message when only whitespace), the first call only
with ``parallel_tool_calls: false``; a named function's text is its arguments; "required"'s
is a JSON list sent when complete. Streamed, each call is ``delta.tool_calls`` entries with
its index: the first with ``id``, ``type`` and ``function.name``, then ``arguments`` pieces.
A choice with calls that stopped ends ``"tool_calls"``; one cut by ``max_tokens`` keeps
``"length"``."""

from __future__ import annotations

import uuid

from gateway.tools import tool_parsers
from gateway.tools.tool_calls import ToolPlan
from gateway.tools.tool_parsers import Call, Events


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _Choice:
    """One choice's parse state."""

    def __init__(self, plan: ToolPlan, incremental: bool):
        self.plan = plan
        self.stream = tool_parsers.PARSERS[plan.parser](plan.names, incremental)
        self.buffer = ""  # "required": the whole JSON list, parsed at the end
        self.calls = 0  # calls sent so far
        self.named_id = ""  # a named call's id, once its first entry is sent
        self.open: int | None = None  # the index of the call whose arguments stream

    def entries(self, found: Events) -> list[dict]:
        """``delta.tool_calls`` entries for a stream's pieces (and whole calls)."""
        pieces = found.pieces + [("call", call) for call in found.calls]
        entries: list[dict] = []
        for kind, value in pieces:
            if kind == "arguments":
                if self.open is not None:
                    entries.append({"index": self.open, "function": {"arguments": value}})
                continue
            self.open = None
            if not self.plan.parallel and self.calls:  # the first call only, as asked
                continue
            name, arguments = (value, "") if kind == "name" else (value.name, value.arguments)
            entries.append({"index": self.calls, "id": call_id(), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
            if kind == "name":
                self.open = self.calls
            self.calls += 1
        return entries

    def feed(self, text: str, final: bool) -> Events:
        mode = self.plan.mode
        if mode == "auto":
            found = self.stream.feed(text)
            if final:
                rest = self.stream.finish()
                found = Events(found.content + rest.content, found.calls + rest.calls,
                               found.pieces + rest.pieces)
            return found
        self.buffer += text
        if not final:
            return Events()
        calls = tool_parsers.bare_calls(self.buffer, self.plan.names)
        if calls is None:  # cut short (max_tokens): the text as it is
            return Events(content=self.buffer)
        return Events(calls=calls)


class ToolAnswers:
    """The ``tool_calls`` of one request's choices, streamed or whole."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._choices: dict[int, _Choice] = {}

    def _choice(self, index: int, incremental: bool) -> _Choice:
        if index not in self._choices:
            self._choices[index] = _Choice(self.plan, incremental)
        return self._choices[index]

    def delta(self, index: int, text: str, first: bool, reason: str | None
              ) -> tuple[dict, str | None]:
        """One streamed chunk's delta and finish reason."""
        choice = self._choice(index, incremental=True)
        delta: dict = {"role": "assistant"} if first else {}
        if self.plan.mode == "named":
            entries = self._named_entries(choice, text, first)
        else:
            found = choice.feed(text, final=reason is not None)
            if found.content or first:
                delta["content"] = found.content
            entries = choice.entries(found)
        if entries:
            delta["tool_calls"] = entries
        return delta, self._reason(choice, reason)

    def _named_entries(self, choice: _Choice, text: str, first: bool) -> list[dict]:
        if not choice.named_id:
            choice.named_id = call_id()
            choice.calls = 1
            return [{"index": 0, "id": choice.named_id, "type": "function",
                     "function": {"name": self.plan.function, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def message(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        """A non-streamed choice's message and finish reason."""
        choice = self._choice(index, incremental=False)
        if self.plan.mode == "named":
            calls, content = [Call(self.plan.function, text)], None
        else:
            found = choice.feed(text, final=True)
            calls, content = found.calls, found.content
            if not self.plan.parallel:  # the first call only, as the client asked
                calls = calls[:1]
            if calls and not content.strip():
                content = None
        choice.calls = len(calls)
        message: dict = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = [
                {"id": call_id(), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls]
        return message, self._reason(choice, reason)

    @staticmethod
    def _reason(choice: _Choice, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and choice.calls else reason
