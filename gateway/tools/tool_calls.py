"""Function calling, request side: OpenAI's ``tools``, ``tool_choice``,
``parallel_tool_calls`` and tool turns, into ``ChatInput`` and ``sampling.guided``.

What each ``tool_choice`` does: docs/usage.md (its table). The tools travel in
``ChatInput.tools``, so gRPC takes them too; a named function or "required" constrains the
output through the guided path. The HTTP readers here check JSON shapes only; what a
ChatInput says about tools is checked for both APIs in gateway/tools/tool_checks.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.structured.guided_check import GuidedCheck
from gateway.tools import tool_checks, tool_parsers
from gateway.validation import RequestError
from protos import limits
from protos.continuum.v1 import generation_pb2, sampling_pb2
from protos.echo import clip


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read: ``mode`` is "none" | "auto" | "required" |
    "named"; ``function`` the named one; ``parallel``: several calls allowed."""

    mode: str
    names: frozenset[str]
    function: str = ""
    parallel: bool = True
    parser: str = tool_parsers.DEFAULT_PARSER


def _bad(message: str, param: str = "tools") -> RequestError:
    return RequestError(message, param=param)


# --- the HTTP body --------------------------------------------------------------------


def read(body: dict, chat: generation_pb2.ChatInput, guides: GuidedCheck,
         parser: str = tool_parsers.DEFAULT_PARSER) -> ToolPlan | None:
    """``tools`` into ``chat.tools``; the plan for the output, None when there are none.
    ``guides`` compiles the tools' schemas; ``parser``: the gateway's
    ``--tool-call-parser``, for "auto"."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise _bad("tool_choice needs tools: send the functions the model may call",
                       "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > limits.MAX_TOOLS:
        raise _bad(f"tools holds {len(tools)} tools; at most {limits.MAX_TOOLS}")
    for index, tool in enumerate(tools):
        _read_tool(tool, index, chat)
    names = frozenset(tool.name for tool in chat.tools)
    mode, function = _tool_choice(choice, names)
    if mode in ("named", "required"):  # before their grammar is checked as guided output
        problem = tool_checks.chat_problem(chat, guides)
        if problem is not None:
            raise _bad(problem)
    return ToolPlan(mode, names, function, parallel is not False, parser)


def _read_tool(tool: Any, index: int, chat: generation_pb2.ChatInput) -> None:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _bad(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                   "\"parameters\": {...}}}}; only function tools are supported")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function is required: an object with name and parameters")
    name, description = function.get("name"), function.get("description", "")
    parameters = function.get("parameters")
    if not isinstance(name, str):
        raise _bad(f"{where}.function.name is required: a string")
    if not isinstance(description, str | None):
        raise _bad(f"{where}.function.description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON Schema object")
    if not isinstance(function.get("strict", False), bool | None):
        raise _bad(f"{where}.function.strict must be true or false")
    chat.tools.add(name=name, description=description or "",
                   parameters="" if parameters is None else json.dumps(parameters))


def _tool_choice(choice: Any, names: frozenset[str]) -> tuple[str, str]:
    if choice is None:
        return "auto", ""
    if choice in ("none", "auto", "required"):
        return choice, ""
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise _bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": "
                   "\"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names function {clip(name)}, which is not in tools",
                   "tool_choice")
    return "named", name


def read_message(message: dict, entry: generation_pb2.ChatMessage, index: int) -> None:
    """An assistant turn's ``tool_calls`` and a tool turn's ``tool_call_id``."""
    calls = message.get("tool_calls")
    if calls is not None and calls != []:
        if entry.role != "assistant" or not isinstance(calls, list):
            raise _bad(f"messages[{index}].tool_calls: only an assistant message has them, "
                       "a list of calls", "messages")
        for number, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, dict):
                arguments = json.dumps(arguments)
            if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                    and isinstance(arguments, str)
                    and isinstance(call.get("id", ""), str)):
                raise _bad(f"messages[{index}].tool_calls[{number}] must be {{\"id\": ..., "
                           "\"type\": \"function\", \"function\": {\"name\": ..., "
                           "\"arguments\": \"<JSON text>\"}}", "messages")
            entry.tool_calls.add(id=call.get("id", ""), name=function["name"],
                                 arguments=arguments)
    if entry.role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise _bad(f"messages[{index}] has role tool: tool_call_id is required (the id "
                       "of the call it answers)", "messages")
        entry.tool_call_id = call_id


# --- constraining the output ----------------------------------------------------------


def constrain(plan: ToolPlan | None, chat: generation_pb2.ChatInput,
              sampling: sampling_pb2.SamplingParams) -> None:
    """A named or required tool_choice as a JSON Schema in ``sampling.guided``."""
    if plan is None or plan.mode not in ("named", "required"):
        return
    if sampling.HasField("guided"):
        raise _bad("tool_choice \"required\" or a named function constrains the output "
                   "already; drop response_format (or the guided_* field)", "tool_choice")
    tools = {tool.name: tool for tool in chat.tools}
    if plan.mode == "named":
        schema = tool_checks.parameters(tools[plan.function])
    else:
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": tool.name},
                                              "arguments": tool_checks.parameters(tool)},
             "required": ["name", "arguments"], "additionalProperties": False}
            for tool in chat.tools]}}
        if not plan.parallel:
            schema["maxItems"] = 1
    sampling.guided.json_schema = json.dumps(schema)


def refuse(body: dict) -> None:
    """/v1/completions has no tools (OpenAI's legacy API has none either)."""
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) not in (None, []):
            raise _bad(f"{name} is only supported on /v1/chat/completions", name)
