"""Tool calling in the chat API: tool definitions and turns in, tool calls parsed out."""
