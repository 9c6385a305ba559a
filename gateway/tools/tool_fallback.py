"""Tools for a chat template that takes none, in the Hermes convention (NousResearch Hermes,
Qwen 2.5) that the default ``hermes`` parser reads. Such a template would drop them
silently, as `apply_chat_template` does.

A system block lists the signatures in ``<tools></tools>`` and asks for
``<tool_call>{"name", "arguments"}</tool_call>`` (after the conversation's own system
message, or as it); an assistant's ``tool_calls`` become such blocks after its text; ``tool``
turns become one user turn of ``<tool_response>`` blocks per run of results (as Qwen's
template renders them), so a "tool" role never reaches the template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

_PREAMBLE = (
    "# Tools\n\nYou may call one or more of these functions to answer. Their "
    "signatures, one JSON object per line, are inside <tools></tools>:\n<tools>\n")
_INSTRUCTIONS = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and "
    "arguments inside <tool_call></tool_call> tags, one block per call:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <arguments-object>}\n"
    "</tool_call>")


def system_block(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return _PREAMBLE + lines + _INSTRUCTIONS


def _call_text(call: Mapping) -> str:
    function = call.get("function", call)
    body = {"name": function.get("name"), "arguments": function.get("arguments", {})}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def _escaped(result: str) -> str:
    """A result's own ``<tool_response>`` tags escaped (``&lt;``), so a result cannot close
    its block and open another (or a ``<tool_call>``) in the model's eyes."""
    return result.replace("<tool_response>", "&lt;tool_response&gt;").replace(
        "</tool_response>", "&lt;/tool_response&gt;")


def messages(turns: Sequence[Mapping], tools: list[dict] | None) -> list[dict]:
    """``turns`` rewritten as above; unchanged (as plain dicts) with no tools, calls or
    results in them."""
    out: list[dict] = []
    for turn in turns:
        role, content = turn.get("role"), turn.get("content") or ""
        if role == "tool":
            block = "<tool_response>\n" + _escaped(content) + "\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_results": True})
            continue
        if turn.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in turn["tool_calls"])
            content = (content + "\n" if content else "") + calls
        out.append({"role": role, "content": content})
    for turn in out:
        turn.pop("_results", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + system_block(tools)
        else:
            out.insert(0, {"role": "system", "content": system_block(tools)})
    return out
