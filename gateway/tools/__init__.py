"""Tool calling in the chat API: `tools` / `tool_choice` and tool turns read into a
`ChatInput` (`tool_calls.py`), the checks both APIs share (`tool_checks.py`), tools for a
chat template that takes none (`tool_fallback.py`), the `--tool-call-parser` registry that
reads calls out of the model's text (`tool_parsers.py`), and a choice's text answered as
`tool_calls`, streamed or whole (`tool_answers.py`).
"""
