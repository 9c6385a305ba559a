"""Function calling, the checks both APIs share (called by gateway/validation.py): what a
``ChatInput`` says about tools, and how the chat template is given it."""

from __future__ import annotations

import json
import re

from gateway.structured.guided_check import GuidedCheck
from protos import limits
from protos.continuum.v1 import generation_pb2, sampling_pb2
from protos.echo import clip

NAME_PATTERN = "[A-Za-z0-9_-]+"  # a function name (with MAX_TOOL_NAME_CHARS)
_NAME = re.compile(NAME_PATTERN)
# A tool without parameters takes none: its call's arguments are {}.
NO_ARGUMENTS_SCHEMA = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters(tool: generation_pb2.Tool) -> dict:
    """The tool's arguments schema (checked JSON by ``chat_problem``)."""
    return json.loads(tool.parameters) if tool.parameters else NO_ARGUMENTS_SCHEMA


def chat_problem(chat: generation_pb2.ChatInput, guides: GuidedCheck) -> str | None:
    """Why ``chat``'s tools or tool turns cannot be served, or None; each tool's
    parameters are compiled by ``guides`` (the served tokenizer's check)."""
    if len(chat.tools) > limits.MAX_TOOLS:
        return f"tools holds {len(chat.tools)} tools; at most {limits.MAX_TOOLS}"
    size = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    if size > limits.MAX_TOOLS_BYTES:
        return (f"tools hold {size} characters of names, descriptions and parameters; "
                f"at most {limits.MAX_TOOLS_BYTES}")
    seen: set[str] = set()
    for index, tool in enumerate(chat.tools):
        if not (len(tool.name) <= limits.MAX_TOOL_NAME_CHARS and _NAME.fullmatch(tool.name)):
            return (f"tools[{index}] name {clip(tool.name)} must be 1-"
                    f"{limits.MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, _ and -")
        if tool.name in seen:
            return f"tools[{index}]: two tools are named {clip(tool.name)}; names must be unique"
        seen.add(tool.name)
        if tool.parameters:
            found = guides.problem(sampling_pb2.Guided(json_schema=tool.parameters))
            if found is not None:
                return f"tools[{index}] ({tool.name}) parameters: {found}"
    for index, message in enumerate(chat.messages):
        for call in message.tool_calls:
            if not _is_object_text(call.arguments):
                return (f"messages[{index}].tool_calls: the arguments of {clip(call.name)} "
                        "must be the JSON text of an object")
    return None


def _is_object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (json.JSONDecodeError, RecursionError):
        return False


def chat_chars(chat: generation_pb2.ChatInput) -> int:
    """Characters the template will be given: turns, call arguments and tools."""
    return (sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                for m in chat.messages)
            + sum(len(t.description) + len(t.parameters) for t in chat.tools))


# --- what the template is given --------------------------------------------------------


def template_messages(chat: generation_pb2.ChatInput) -> list[dict]:
    """The turns as HF templates read them (a call's arguments as an object)."""
    messages = []
    for m in chat.messages:
        message: dict = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in m.tool_calls]
        if m.role == "tool":
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def template_tools(chat: generation_pb2.ChatInput) -> list[dict] | None:
    """The tools as ``apply_chat_template(tools=...)`` takes them; None without any."""
    if not chat.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": parameters(t)}}
            for t in chat.tools]
