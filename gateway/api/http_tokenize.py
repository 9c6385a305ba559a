"""`POST /tokenize` and `POST /detokenize`, as vLLM's OpenAI server serves them.

Tools (load generators, routers that count tokens, prompt builders) ask the server
to tokenize with the model's own tokenizer and chat template, so their counts match
what generation sees:

* `/tokenize` takes `{"model", "prompt"}` or `{"model", "messages"}` (the chat is
  rendered with the model's template and generation prompt, exactly as
  `/v1/chat/completions` renders it) and answers `{"count", "max_model_len",
  "tokens"}`, plus `"token_strs"` with `"return_token_strs": true`.
* `/detokenize` takes `{"model", "tokens": [ids]}` and answers `{"prompt": text}`.

Both go through the same parsing and caps as generation (the dialects in
gateway/api/openai_api.py, `validation.prompt_token_ids`): the same input gets the same
ids, or the same 400. Neither answers past the model's context (what no generation
could take, so nothing a client needs), both refused with a 400
`context_length_exceeded` that names the numbers:

* `/tokenize`: text longer than max_model_len x the longest token's characters is
  refused before it is tokenized (validation's rule for prompts); text that tokenizes
  to more than max_model_len tokens after.
* `/detokenize`: more than max_model_len ids.

Pure functions here; gateway/api/http_api.py serves them off the event loop (one large
tokenize does not stall the other streams), inside gateway/admit/parse_guard.py.
"""

from __future__ import annotations

from typing import Any

import grpc

from gateway.api import openai_fields as fields
from gateway.api.openai_api import CHAT, COMPLETION
from gateway.text.tokenizer import Tokenizer
from gateway.validation import RequestError, context_exceeded, prompt_token_ids
from protos.echo import clip


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
        raise RequestError(f"model {clip(model)} is not served here; this gateway serves "
                           f"{model_name!r} (or leave model empty)", grpc.StatusCode.NOT_FOUND,
                           param="model", error_code="model_not_found")


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
