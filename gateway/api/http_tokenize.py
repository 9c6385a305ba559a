"""`POST /tokenize` and `POST /detokenize`, as vLLM's OpenAI server serves them.

`/tokenize` takes `{"model", "prompt"}` or `{"model", "messages"}` (rendered exactly as
chat completions renders it) and answers `{"count", "max_model_len", "tokens"}`, plus
`"token_strs"` with `"return_token_strs": true`; `/detokenize` takes `{"model", "tokens"}`
and answers `{"prompt"}`. Both parse as generation does, so the same input gets the same
ids or the same 400, and refuse past the context (`context_length_exceeded`). Pure
functions; gateway/api/http_api.py runs them off the loop inside the parse guard."""

from __future__ import annotations

from typing import Any

from gateway.api import openai_fields as fields
from gateway.api.openai_api import CHAT, COMPLETION
from gateway.text.tokenizer import Tokenizer
from gateway.validation import context_exceeded, model_not_served, prompt_token_ids


def tokenize(body: Any, model_name: str, tokenizer: Tokenizer) -> dict:
    """The `/tokenize` answer for a decoded JSON body; RequestError (400) otherwise."""
    if not isinstance(body, dict):
        raise fields.bad("the request body must be a JSON object")
    if "messages" in body and "prompt" in body:
        raise fields.bad("send either prompt or messages, not both", "messages")
    _check_model(body, model_name)
    dialect = CHAT if "messages" in body else COMPLETION
    want_strs = fields.boolean(body, "return_token_strs")
    # tools too (as vLLM's): they are rendered into a chat prompt (gateway/tools/tool_calls.py)
    body = {k: v for k, v in body.items() if k in ("model", "prompt", "messages", "tools")}
    ids = prompt_token_ids(dialect.parse(body, model_name, tokenizer).proto, tokenizer)
    _check_context(len(ids), tokenizer.info.max_model_len, dialect is CHAT)
    answer: dict = {"count": len(ids), "max_model_len": tokenizer.info.max_model_len,
                    "tokens": ids}
    if want_strs:
        answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
    return answer


def _check_context(num_tokens: int, max_model_len: int, chat: bool) -> None:
    if num_tokens > max_model_len:
        what = "messages" if chat else "prompt"
        raise context_exceeded(max_model_len, f"your {what} resulted in {num_tokens} tokens",
                               f"the {what}", what)


def _check_model(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model not in (None, "", model_name):
        raise model_not_served(model, model_name)


def detokenize(body: Any, model_name: str, tokenizer: Tokenizer) -> dict:
    """The `/detokenize` answer for a decoded JSON body; RequestError (400) otherwise."""
    if not isinstance(body, dict):
        raise fields.bad("the request body must be a JSON object")
    _check_model(body, model_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise fields.bad("tokens is required: a list of token ids", "tokens")
    limit = tokenizer.info.max_model_len
    if len(tokens) > limit:
        raise context_exceeded(limit, f"tokens holds {len(tokens)} token ids", "tokens",
                               "tokens")
    ids = fields.token_ids(tokens, "tokens", limit, tokenizer.info.vocab_size) if tokens else []
    return {"prompt": tokenizer.decode(ids, skip_special_tokens=False)}
